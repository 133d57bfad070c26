// ringflex report: per-rank reports of a sharding scheme and its plan, as text and JSON (see plan_report.h).
#include "report/plan_report.h"

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"

namespace rf::report {

using namespace rf::cp;

SchemeReport report_scheme(const std::string& name, const TokenMeta* rows, int B, const ShardMap& map,
                           const LayerMix& mix, const ReportOptions& opt) {
  const int P = map.P;
  const std::vector<BlockSummary> sums = summarize_all_shards(rows, B, map, opt.block);
  const CommPlan plan = plan_from_summaries(PlanGeometry{P, B, map.L, opt.block}, sums.data(), mix);

  SchemeReport rep;
  rep.scheme = name;
  rep.L = map.L;
  rep.work = rank_work(token_work(rows, B, map.S, map.S_padded, mix, opt.block), map);
  rep.imbalance = imbalance(rep.work);
  rep.tokens.assign(static_cast<size_t>(P), 0);
  for (int r = 0; r < P; ++r) {
    for (int b = 0; b < B; ++b) {
      for (const int32_t pos : map.positions[r]) {
        rep.tokens[r] += !map.is_pad(pos) && rows[int64_t{b} * map.S + pos].doc != kPaddingDoc ? 1 : 0;
      }
    }
  }
  for (const MaskCommPlan& mp : plan.masks) {
    const KvFormat& kv = mp.mask.window > 0 ? opt.windowed : opt.global;
    LayerTypeReport lt;
    lt.mask = mp.mask;
    lt.layers = mp.layers;
    lt.full_ring_bytes = kv_bytes(int64_t{P - 1} * map.L, B, kv);
    for (int r = 0; r < P; ++r) {
      lt.tokens_received.push_back(mp.recv_tokens(r));
      lt.bytes_received.push_back(kv_bytes(mp.recv_tokens(r), B, kv));
      lt.skipped_steps.push_back(mp.skipped_steps(r));
    }
    rep.layer_types.push_back(lt);
  }
  return rep;
}

namespace {

std::string human_bytes(int64_t n) {
  constexpr double kKiB = 1024.0;
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= kKiB && u < 4) {
    v /= kKiB;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", v, units[u]);
  return buf;
}

std::string human_count(int64_t n) {
  constexpr double kThousand = 1000.0;
  const char* units[] = {"", "k", "M", "G", "T", "P"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= kThousand && u < 5) {
    v /= kThousand;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f%s" : "%.3g%s", v, units[u]);
  return buf;
}

constexpr int kLabelWidth = 12;
constexpr int kColumnWidth = 14;

void column(std::ostringstream& out, const std::string& s, int width) {
  out << std::string(static_cast<size_t>(std::max<int>(1, width - static_cast<int>(s.size()))), ' ') << s;
}

// One quantity: a row per rank, a column per scheme.
template <typename Cell>
void section(std::ostringstream& out, const std::string& title, const std::vector<SchemeReport>& reports, Cell cell) {
  out << "\n" << title << "\n";
  const int P = static_cast<int>(reports.front().work.size());
  for (int r = 0; r < P; ++r) {
    std::string label = "  rank " + std::to_string(r);
    out << label << std::string(static_cast<size_t>(kLabelWidth - static_cast<int>(label.size())), ' ');
    for (const SchemeReport& rep : reports) column(out, cell(rep, r), kColumnWidth);
    out << "\n";
  }
}

// One line under a section: a per-scheme summary.
template <typename Cell>
void footer(std::ostringstream& out, const std::string& label, const std::vector<SchemeReport>& reports, Cell cell) {
  out << "  " << label
      << std::string(static_cast<size_t>(std::max(1, kLabelWidth - 2 - static_cast<int>(label.size()))), ' ');
  for (const SchemeReport& rep : reports) column(out, cell(rep), kColumnWidth);
  out << "\n";
}

}  // namespace

std::string report_text(const std::vector<SchemeReport>& reports) {
  RF_CHECK(!reports.empty(), "report_text: no schemes");
  std::ostringstream out;
  out << std::string(kLabelWidth, ' ');
  for (const SchemeReport& rep : reports) column(out, rep.scheme, kColumnWidth);
  out << "\n";
  out << "  L" << std::string(kLabelWidth - 3, ' ');
  for (const SchemeReport& rep : reports) column(out, std::to_string(rep.L), kColumnWidth);
  out << "\n";

  section(out, "tokens held (valid, all rows)", reports,
          [](const SchemeReport& rep, int r) { return std::to_string(rep.tokens[r]); });
  section(out, "work (allowed q.k pairs x layers)", reports,
          [](const SchemeReport& rep, int r) { return human_count(rep.work[r]); });
  footer(out, "max/mean", reports, [](const SchemeReport& rep) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.3f", rep.imbalance);
    return std::string(buf);
  });

  const std::vector<LayerTypeReport>& types = reports.front().layer_types;
  for (size_t k = 0; k < types.size(); ++k) {
    const std::string name = types[k].mask.name() + " (" + std::to_string(types[k].layers) + " layers)";
    section(out, "K/V received per layer, " + name, reports,
            [k](const SchemeReport& rep, int r) { return human_bytes(rep.layer_types[k].bytes_received[r]); });
    footer(out, "full ring", reports,
           [k](const SchemeReport& rep) { return human_bytes(rep.layer_types[k].full_ring_bytes); });
    section(out, "ring steps skipped, " + types[k].mask.name(), reports,
            [k](const SchemeReport& rep, int r) { return std::to_string(rep.layer_types[k].skipped_steps[r]); });
  }
  return out.str();
}

std::string report_json(const std::vector<SchemeReport>& reports) {
  RF_CHECK(!reports.empty(), "report_json: no schemes");
  nlohmann::ordered_json root;
  root["P"] = reports.front().work.size();
  for (const LayerTypeReport& lt : reports.front().layer_types)
    root["layer_types"][lt.mask.name()]["layers"] = lt.layers;
  for (const SchemeReport& rep : reports) {
    nlohmann::ordered_json s;
    s["L"] = rep.L;
    s["tokens"] = rep.tokens;
    s["work"] = rep.work;
    s["imbalance"] = rep.imbalance;
    for (const LayerTypeReport& lt : rep.layer_types) {
      s["bytes_received"][lt.mask.name()] = lt.bytes_received;
      s["skipped_steps"][lt.mask.name()] = lt.skipped_steps;
      s["full_ring_bytes_received"][lt.mask.name()] = lt.full_ring_bytes;
    }
    root["schemes"][rep.scheme] = s;
  }
  return root.dump(2) + "\n";
}

namespace {

// Tableau 10: distinguishable for the usual P <= 8 and in greyscale print; ranks beyond 10 reuse colours.
constexpr const char* kRankColours[] = {"#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f",
                                        "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"};
constexpr int kNumColours = 10;
constexpr int kMaxCells = 512;    // matrix cells per side: a 32K row at 64-token blocks draws every block
constexpr double kPanel = 480.0;  // matrix side, px
constexpr double kGap = 60.0;     // between panels
constexpr double kMargin = 40.0;
constexpr double kStripTop = 56.0, kStripHeight = 14.0, kMatrixTop = 80.0;
constexpr double kBarHeight = 14.0, kBarGap = 4.0;
constexpr int kOpacityLevels = 12;  // a mix's layer share is quantised to this many shades

constexpr int kNoOwner = -1;  // positions past a scheme's padded row
constexpr const char* kNoOwnerColour = "#dddddd";

const char* rank_colour(int r) { return r == kNoOwner ? kNoOwnerColour : kRankColours[r % kNumColours]; }

}  // namespace

std::string report_svg(const TokenMeta* rows, int S, const std::vector<ShardMap>& maps,
                       const std::vector<SchemeReport>& reports, const LayerMix& mix, int block) {
  RF_CHECK(!maps.empty() && maps.size() == reports.size(), "report_svg: ", maps.size(), " maps for ", reports.size(),
           " reports");
  // Schemes may pad the row differently: draw the longest padded row; a scheme's own padding ends where it ends.
  int S_padded = 0;
  for (const ShardMap& map : maps) S_padded = std::max(S_padded, map.S_padded);
  const int P = maps.front().P;
  // Cell size: whole planner blocks, coarsened so that the matrix has at most kMaxCells per side.
  const int blocks = (S_padded + block - 1) / block;
  const int cell = block * ((blocks + kMaxCells - 1) / kMaxCells);
  const int n = (S_padded + cell - 1) / cell;

  // Row 0 in row order, padded as sharding pads it; cell summaries.
  std::vector<TokenMeta> row(static_cast<size_t>(S_padded));
  for (int t = 0; t < S_padded; ++t) row[t] = t < S ? rows[t] : TokenMeta{t, kPaddingDoc, kNoGroup};
  const std::vector<BlockSummary> sums = summarize_blocks(row.data(), 1, S_padded, cell);  // [n]
  int total_layers = 0;
  for (const LayerKind& k : mix) total_layers += k.count;
  // level[i][j]: share of the mix's layers computing the pair, quantised.
  std::vector<uint8_t> level(static_cast<size_t>(n) * n, 0);
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      int layers = 0;
      for (const LayerKind& k : mix) layers += classify(k.mask, sums[i], sums[j]) != BlockClass::Empty ? k.count : 0;
      level[static_cast<size_t>(i) * n + j] =
          static_cast<uint8_t>((layers * kOpacityLevels + total_layers - 1) / std::max(1, total_layers));
    }
  }

  int64_t max_work = 1;
  for (const SchemeReport& rep : reports)
    max_work = std::max(max_work, *std::max_element(rep.work.begin(), rep.work.end()));

  const double px = kPanel / n;
  const double bars_top = kMatrixTop + kPanel + 40.0;
  const double legend_top = bars_top + P * (kBarHeight + kBarGap) + 30.0;
  const double width = 2 * kMargin + maps.size() * kPanel + (maps.size() - 1) * kGap;
  const double height = legend_top + 70.0;

  std::ostringstream out;
  out.setf(std::ios::fixed);
  out.precision(2);
  out << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
      << "\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  out << "<text x=\"" << kMargin << "\" y=\"24\" font-size=\"15\">S = " << S << ", P = " << P << ", cell = " << cell
      << " tokens; row 0 in row order: queries down, keys across</text>\n";

  for (size_t m = 0; m < maps.size(); ++m) {
    const ShardMap& map = maps[m];
    std::vector<int> owner(static_cast<size_t>(S_padded), kNoOwner);
    for (int r = 0; r < P; ++r) {
      for (const int32_t pos : map.positions[r]) owner[pos] = r;
    }
    const double x0 = kMargin + m * (kPanel + kGap);
    char title[96];
    std::snprintf(title, sizeof title, "%s: max/mean work %.3f", reports[m].scheme.c_str(), reports[m].imbalance);
    out << "<text x=\"" << x0 << "\" y=\"" << kStripTop - 8 << "\" font-size=\"14\">" << title << "</text>\n";
    // Ownership strip: runs of cells with one owner.
    for (int i = 0; i < n;) {
      int e = i + 1;
      while (e < n && owner[static_cast<size_t>(e) * cell] == owner[static_cast<size_t>(i) * cell]) ++e;
      out << "<rect x=\"" << x0 + i * px << "\" y=\"" << kStripTop << "\" width=\"" << (e - i) * px << "\" height=\""
          << kStripHeight << "\" fill=\"" << rank_colour(owner[static_cast<size_t>(i) * cell]) << "\"/>\n";
      i = e;
    }
    // Matrix: per query cell, runs of equal level in the query owner's colour.
    out << "<rect x=\"" << x0 << "\" y=\"" << kMatrixTop << "\" width=\"" << kPanel << "\" height=\"" << kPanel
        << "\" fill=\"none\" stroke=\"#888\"/>\n";
    for (int i = 0; i < n; ++i) {
      const char* colour = rank_colour(owner[static_cast<size_t>(i) * cell]);
      for (int j = 0; j < n;) {
        const uint8_t lv = level[static_cast<size_t>(i) * n + j];
        int e = j + 1;
        while (e < n && level[static_cast<size_t>(i) * n + e] == lv) ++e;
        if (lv > 0) {
          out << "<rect x=\"" << x0 + j * px << "\" y=\"" << kMatrixTop + i * px << "\" width=\"" << (e - j) * px
              << "\" height=\"" << px << "\" fill=\"" << colour << "\" fill-opacity=\""
              << static_cast<double>(lv) / kOpacityLevels << "\"/>\n";
        }
        j = e;
      }
    }
    // Work bars, one scale for all panels, a tick at the mean.
    out << "<text x=\"" << x0 << "\" y=\"" << bars_top - 8
        << "\">work per rank (same scale in every panel; | = mean)</text>\n";
    int64_t total = 0;
    for (const int64_t w : reports[m].work) total += w;
    const double bar_len = kPanel - 80.0;
    for (int r = 0; r < P; ++r) {
      const double y = bars_top + r * (kBarHeight + kBarGap);
      out << "<text x=\"" << x0 << "\" y=\"" << y + kBarHeight - 3 << "\">" << r << "</text>\n";
      out << "<rect x=\"" << x0 + 20 << "\" y=\"" << y << "\" width=\""
          << bar_len * static_cast<double>(reports[m].work[r]) / static_cast<double>(max_work) << "\" height=\""
          << kBarHeight << "\" fill=\"" << rank_colour(r) << "\"/>\n";
    }
    const double mean_x = x0 + 20 + bar_len * static_cast<double>(total) / P / static_cast<double>(max_work);
    out << "<line x1=\"" << mean_x << "\" y1=\"" << bars_top - 2 << "\" x2=\"" << mean_x << "\" y2=\""
        << bars_top + P * (kBarHeight + kBarGap) << "\" stroke=\"black\" stroke-dasharray=\"3,2\"/>\n";
  }

  // Legend: rank colours, then what opacity means.
  for (int r = 0; r < P; ++r) {
    const double x = kMargin + r * 70.0;
    out << "<rect x=\"" << x << "\" y=\"" << legend_top << "\" width=\"14\" height=\"14\" fill=\"" << rank_colour(r)
        << "\"/><text x=\"" << x + 18 << "\" y=\"" << legend_top + 12 << "\">rank " << r << "</text>\n";
  }
  std::string layers;
  for (const LayerKind& k : mix)
    layers += (layers.empty() ? "" : " + ") + std::to_string(k.count) + "x " + k.mask.name();
  out << "<text x=\"" << kMargin << "\" y=\"" << legend_top + 36 << "\">colour: rank that owns the query block; "
      << "opacity: share of the " << total_layers << " layers (" << layers
      << ") that compute the block pair; blank: never computed</text>\n";
  out << "</svg>\n";
  return out.str();
}

std::string cp_stats_json(comm::Communicator& comm, const CpStats& fwd, const CpStats* bwd, int64_t tokens,
                          const std::string& scheme, const std::string& algo) {
  // Plain numbers only: the record travels as bytes in one allgather.
  struct Record {
    int64_t tokens, work, peak, sent, received;
    double compute_s, wall_s;
  };
  const CpStats none;
  const CpStats& b = bwd ? *bwd : none;
  const Record mine{tokens,
                    fwd.work,
                    std::max(fwd.peak_attention_bytes, b.peak_attention_bytes),
                    fwd.bytes_sent + b.bytes_sent,
                    fwd.bytes_received + b.bytes_received,
                    fwd.compute_seconds + b.compute_seconds,
                    fwd.wall_seconds + b.wall_seconds};
  std::vector<Record> all(static_cast<size_t>(comm.size()));
  comm.allgather(&mine, all.data(), sizeof(Record), comm::default_timeout());

  nlohmann::ordered_json root;
  root["scheme"] = scheme;
  root["algo"] = algo;
  root["ranks"] = nlohmann::ordered_json::array();
  for (int r = 0; r < comm.size(); ++r) {
    const Record& x = all[r];
    root["ranks"].push_back({{"rank", r},
                             {"tokens", x.tokens},
                             {"work", x.work},
                             {"peak_attention_bytes", x.peak},
                             {"bytes_sent", x.sent},
                             {"bytes_received", x.received},
                             {"compute_s", x.compute_s},
                             {"wall_s", x.wall_s}});
  }
  return root.dump(2) + "\n";
}

}  // namespace rf::report
