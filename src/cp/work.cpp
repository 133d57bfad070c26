// ringflex cp: parsing the layer mix and counting each token's attention work exactly (see work.h).
#include "cp/work.h"

#include <algorithm>
#include <charconv>
#include <cstdint>

#include "core/error.h"

namespace rf::cp {

namespace {

// Layers in one mix at most: far above any model (Gemma 4 has up to 60), and low enough that layer counts times
// mask areas stay inside int64 in the planner and its reports.
constexpr int64_t kMaxLayers = 1 << 16;

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> parts;
  size_t begin = 0;
  for (size_t end = s.find(sep); end != std::string::npos; end = s.find(sep, begin)) {
    parts.push_back(s.substr(begin, end - begin));
    begin = end + 1;
  }
  parts.push_back(s.substr(begin));
  return parts;
}

// A positive decimal integer occupying all of `s`, or -1.
int parse_positive(const std::string& s) {
  int v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  return ec == std::errc() && end == s.data() + s.size() && v > 0 ? v : -1;
}

LayerKind parse_kind(const std::string& item) {
  RF_CHECK(!item.empty(), "layer mix has an empty item (two commas in a row, or a trailing comma)");
  LayerKind kind;
  std::string body = item;
  const size_t x = item.find('x');
  const bool has_count = x != std::string::npos && x > 0 &&
                         std::all_of(item.begin(), item.begin() + x, [](char c) { return c >= '0' && c <= '9'; });
  if (has_count) {
    kind.count = parse_positive(item.substr(0, x));
    RF_CHECK(kind.count > 0, "layer mix item '", item, "': the layer count must be a positive integer");
    body = item.substr(x + 1);
  }
  std::vector<std::string> fields = split(body, ':');
  const std::string type = fields[0];
  fields.erase(fields.begin());
  if (!fields.empty() && fields.back() == "groups") {
    kind.mask.bidirectional_groups = true;
    fields.pop_back();
  }
  if (type == "sliding") {
    RF_CHECK(fields.size() == 1, "layer mix item '", item,
             "': sliding takes one window, then optionally groups, as in sliding:1024 or sliding:1024:groups");
    kind.mask.window = parse_positive(fields[0]);
    RF_CHECK(kind.mask.window > 0, "layer mix item '", item, "': window '", fields[0], "' is not a positive integer");
  } else if (type == "full") {
    RF_CHECK(fields.empty(), "layer mix item '", item, "': full takes no window; options after it: only groups");
  } else if (type == "bidir") {
    kind.mask.causal = false;
    RF_CHECK(fields.size() <= 1, "layer mix item '", item, "': bidir takes at most a window, then groups");
    if (!fields.empty()) {
      kind.mask.window = parse_positive(fields[0]);
      RF_CHECK(kind.mask.window > 0, "layer mix item '", item, "': window '", fields[0], "' is not a positive integer");
    }
  } else {
    fail("layer mix item '", item, "': unknown layer type '", type, "' (expected sliding:W, full or bidir)");
  }
  return kind;
}

}  // namespace

LayerMix parse_layer_mix(const std::string& spec) {
  LayerMix mix;
  int64_t total = 0;
  for (const std::string& item : split(spec, ',')) {
    const LayerKind kind = parse_kind(item);
    auto same = std::find_if(mix.begin(), mix.end(), [&](const LayerKind& k) { return k.mask == kind.mask; });
    total += kind.count;
    RF_CHECK(total <= kMaxLayers, "layer mix '", spec, "' has more than ", kMaxLayers, " layers");
    if (same != mix.end()) {
      same->count += kind.count;
    } else {
      mix.push_back(kind);
    }
  }
  return mix;
}

std::vector<int64_t> allowed_keys_per_query(const TokenMeta* q_meta, int nq, const TokenMeta* k_meta, int nk,
                                            const LayerMask& m, int block) {
  RF_CHECK(nq >= 0 && nk >= 0 && block > 0, "allowed_keys_per_query needs nq, nk >= 0 and block >= 1, got nq = ", nq,
           ", nk = ", nk, ", block = ", block);
  const std::vector<BlockSummary> q_sums = summarize_blocks(q_meta, 1, nq, block);
  const std::vector<BlockSummary> k_sums = summarize_blocks(k_meta, 1, nk, block);

  std::vector<int64_t> count(static_cast<size_t>(nq), 0);
  for (size_t i = 0; i < q_sums.size(); ++i) {
    const int q0 = static_cast<int>(i) * block, q1 = std::min(nq, q0 + block);
    int64_t full_keys = 0;  // keys of Full pairs, the same for every query of block i
    for (size_t j = 0; j < k_sums.size(); ++j) {
      const BlockClass c = classify(m, q_sums[i], k_sums[j]);
      if (c == BlockClass::Empty) continue;
      const int k0 = static_cast<int>(j) * block, k1 = std::min(nk, k0 + block);
      if (c == BlockClass::Full) {
        full_keys += k1 - k0;
        continue;
      }
      for (int q = q0; q < q1; ++q) {
        int64_t hits = 0;
        for (int k = k0; k < k1; ++k) hits += allowed(m, q_meta[q], k_meta[k]) ? 1 : 0;
        count[q] += hits;
      }
    }
    for (int q = q0; q < q1; ++q) count[q] += full_keys;
  }
  return count;
}

int64_t count_allowed_pairs(const LayerMask& m, const TokenMeta* q_meta, const TokenMeta* k_meta, int B, int Lq, int Lk,
                            int block) {
  int64_t pairs = 0;
  for (int b = 0; b < B; ++b)
    for (const int64_t keys :
         allowed_keys_per_query(q_meta + int64_t{b} * Lq, Lq, k_meta + int64_t{b} * Lk, Lk, m, block))
      pairs += keys;
  return pairs;
}

std::vector<int64_t> token_work(const TokenMeta* rows, int B, int S, int S_padded, const LayerMix& mix, int block) {
  RF_CHECK(B >= 0 && S >= 0 && S_padded >= S, "token_work needs B >= 0 and 0 <= S <= S_padded, got B = ", B,
           ", S = ", S, ", S_padded = ", S_padded);
  std::vector<int64_t> work(static_cast<size_t>(S_padded), 0);
  for (const LayerKind& kind : mix) {
    for (int b = 0; b < B; ++b) {
      const std::vector<int64_t> keys = allowed_keys_per_query(rows + int64_t{b} * S, S, kind.mask, block);
      for (int t = 0; t < S; ++t) work[t] += kind.count * keys[t];
    }
  }
  return work;
}

std::vector<int64_t> rank_work(const std::vector<int64_t>& token_work, const ShardMap& map) {
  RF_CHECK(static_cast<int>(token_work.size()) == map.S_padded, "rank_work: token work covers ", token_work.size(),
           " positions, the shard map ", map.S_padded);
  std::vector<int64_t> work(static_cast<size_t>(map.P), 0);
  for (int r = 0; r < map.P; ++r) {
    for (const int32_t pos : map.positions[r]) work[r] += token_work[pos];
  }
  return work;
}

double imbalance(const std::vector<int64_t>& per_rank) {
  int64_t total = 0, most = 0;
  for (const int64_t w : per_rank) {
    total += w;
    most = std::max(most, w);
  }
  if (total == 0) return 1.0;
  return static_cast<double>(most) * static_cast<double>(per_rank.size()) / static_cast<double>(total);
}

}  // namespace rf::cp
