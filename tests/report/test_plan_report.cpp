// The reports of `ringflex plan`: the JSON has the documented schema and its numbers agree with the plan and work
// model they summarise (recomputed here independently); the SVG is one well-formed picture with a panel per scheme.
#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "common/random_case.h"
#include "core/row_meta.h"
#include "cp/balance.h"
#include "cp/shard.h"
#include "report/plan_report.h"

namespace rf::report {

using namespace rf::cp;
namespace {

struct Fixture {
  static constexpr int kB = 2, kS = 700, kP = 4, kBlock = 16;
  std::vector<TokenMeta> rows;
  LayerMix mix = parse_layer_mix("5xsliding:64:groups,1xfull:groups");
  ReportOptions opt;
  std::vector<ShardMap> maps;
  std::vector<SchemeReport> reports;

  Fixture() {
    for (int b = 0; b < kB; ++b) {
      const std::vector<TokenMeta> row = gemma4_vlm_row(kS, 40 + b);
      rows.insert(rows.end(), row.begin(), row.end());
    }
    opt.block = kBlock;
    maps = {make_shard_map(Scheme::Contiguous, kS, kP, kBlock), make_shard_map(Scheme::Zigzag, kS, kP, kBlock),
            balanced_shard(rows.data(), kB, kS, kP, mix, kBlock).map};
    for (const ShardMap& m : maps)
      reports.push_back(report_scheme(scheme_name(m.scheme), rows.data(), kB, m, mix, opt));
  }
};

TEST(PlanReport, JsonMatchesSchemaAndNumbers) {
  const Fixture f;
  const nlohmann::json j = nlohmann::json::parse(report_json(f.reports));
  ASSERT_TRUE(j.contains("schemes"));
  EXPECT_EQ(j["P"], Fixture::kP);
  ASSERT_EQ(j["layer_types"].size(), 2u);
  EXPECT_EQ(j["layer_types"]["causal,W=64,groups"]["layers"], 5);
  EXPECT_EQ(j["layer_types"]["causal,groups"]["layers"], 1);
  for (size_t m = 0; m < f.maps.size(); ++m) {
    const std::string name = scheme_name(f.maps[m].scheme);
    ASSERT_TRUE(j["schemes"].contains(name)) << name;
    const nlohmann::json& s = j["schemes"][name];
    for (const char* key :
         {"work", "imbalance", "bytes_received", "skipped_steps", "tokens", "L", "full_ring_bytes_received"}) {
      ASSERT_TRUE(s.contains(key)) << name << " lacks " << key;
    }
    ASSERT_TRUE(s["work"].is_array());
    ASSERT_EQ(s["work"].size(), static_cast<size_t>(Fixture::kP));
    // Work: brute force over row positions of each rank, weighted by the mix.
    const std::vector<int64_t> work = s["work"].get<std::vector<int64_t>>();
    for (int r = 0; r < Fixture::kP; ++r) {
      int64_t expect = 0;
      for (const LayerKind& k : f.mix) {
        for (int b = 0; b < Fixture::kB; ++b) {
          const TokenMeta* row = f.rows.data() + b * Fixture::kS;
          for (const int32_t q : f.maps[m].positions[r]) {
            if (f.maps[m].is_pad(q)) continue;
            for (int key = 0; key < Fixture::kS; ++key) expect += k.count * (allowed(k.mask, row[q], row[key]) ? 1 : 0);
          }
        }
      }
      EXPECT_EQ(work[r], expect) << name << " rank " << r;
    }
    const int64_t most = *std::max_element(work.begin(), work.end());
    int64_t total = 0;
    for (const int64_t w : work) total += w;
    EXPECT_DOUBLE_EQ(s["imbalance"].get<double>(),
                     static_cast<double>(most) * Fixture::kP / static_cast<double>(total));
    // Bytes: tokens received x B x Hkv x D x 2 (K and V) x 2 (bf16), with the layer type's heads and head size.
    for (const LayerTypeReport& lt : f.reports[m].layer_types) {
      const std::vector<int64_t> bytes = s["bytes_received"][lt.mask.name()].get<std::vector<int64_t>>();
      const std::vector<int> skipped = s["skipped_steps"][lt.mask.name()].get<std::vector<int>>();
      ASSERT_EQ(bytes.size(), static_cast<size_t>(Fixture::kP));
      ASSERT_EQ(skipped.size(), static_cast<size_t>(Fixture::kP));
      const int64_t per_token = lt.mask.window > 0 ? 16 * 256 * 2 * 2 : 4 * 512 * 2 * 2;
      for (int r = 0; r < Fixture::kP; ++r) {
        EXPECT_EQ(bytes[r], lt.tokens_received[r] * Fixture::kB * per_token);
        EXPECT_LE(bytes[r], s["full_ring_bytes_received"][lt.mask.name()].get<int64_t>());
        EXPECT_TRUE(skipped[r] >= 0 && skipped[r] < Fixture::kP);
      }
    }
  }
}

TEST(PlanReport, SvgIsOnePictureWithAPanelPerScheme) {
  const Fixture f;
  const std::string svg = report_svg(f.rows.data(), Fixture::kS, f.maps, f.reports, f.mix, Fixture::kBlock);
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("</svg>\n"), std::string::npos);
  for (const SchemeReport& rep : f.reports) EXPECT_NE(svg.find(rep.scheme + ": max/mean work"), std::string::npos);
  for (int r = 0; r < Fixture::kP; ++r) EXPECT_NE(svg.find(">rank " + std::to_string(r) + "<"), std::string::npos);
  // Every element opened is closed: self-closing rects/lines, paired text and svg.
  const auto count = [&](const std::string& s) {
    size_t n = 0;
    for (size_t at = svg.find(s); at != std::string::npos; at = svg.find(s, at + 1)) ++n;
    return n;
  };
  EXPECT_EQ(count("<text"), count("</text>"));
  EXPECT_EQ(count("<rect") + count("<line"), count("/>"));
}

TEST(PlanReport, TextHasEverySchemeAndLayerType) {
  const Fixture f;
  const std::string text = report_text(f.reports);
  for (const SchemeReport& rep : f.reports) EXPECT_NE(text.find(rep.scheme), std::string::npos);
  EXPECT_NE(text.find("causal,W=64,groups (5 layers)"), std::string::npos);
  EXPECT_NE(text.find("max/mean"), std::string::npos);
}

}  // namespace
}  // namespace rf::report
