// Benchmark behind BENCHMARKS.md "Mask-aware CP": what the plan saves in traffic and what the balancer saves in
// imbalance. Both are exact counts from the planner (no timing), so they are the same on every machine.
//
//   bench_plan_traffic            prints two markdown tables:
//   1. K/V bytes received per rank per layer (max over ranks) for a sliding and a full layer, planned vs a full
//      ring vs all-gather, W in {512, 1024}, S in {8K, 32K}, P in {2, 4, 8}, on a one-document causal row with
//      contiguous shards (the halo case) and on a Gemma 4 VLM row with contiguous and with balanced shards, with
//      each layout's max/mean work under that row's mix (5 sliding : 1 full);
//   2. max/mean work of contiguous, zigzag and balanced sharding for plain causal rows and Gemma 4 VLM rows under
//      5 sliding (W = 1024, groups) : 1 full (groups) layers, at S = 32K, P in {2, 4, 8} (VLM: median of 5 rows).
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "core/row_meta.h"
#include "cp/balance.h"
#include "cp/plan.h"
#include "cp/shard.h"
#include "cp/work.h"

namespace {

using namespace rf;
using namespace rf::cp;

constexpr KvFormat kSlidingKv{16, 256, 2};  // Gemma 4 31B sliding layers, bf16
constexpr KvFormat kFullKv{4, 512, 2};      // Gemma 4 31B full layers, bf16
constexpr int kVlmSeeds = 5;

double mib(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

int64_t max_recv(const MaskCommPlan& mp) {
  int64_t most = 0;
  for (int r = 0; r < mp.geometry.P; ++r) most = std::max(most, mp.recv_tokens(r));
  return most;
}

CommPlan plan_for(const std::vector<TokenMeta>& row, const ShardMap& map, const LayerMix& mix) {
  const std::vector<BlockSummary> sums = summarize_all_shards(row.data(), 1, map, kPlanBlock);
  return plan_from_summaries(PlanGeometry{map.P, 1, map.L, kPlanBlock}, sums.data(), mix);
}

void traffic_table() {
  std::printf(
      "| row, shards | W | S | P | sliding: planned MiB | bound MiB | full: planned MiB | full ring = all-gather MiB "
      "(sliding / full) | planned vs full ring (sliding) | max/mean work |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  enum class Rows { CausalContiguous, VlmContiguous, VlmBalanced };
  const char* names[] = {"causal 1 doc, contiguous", "Gemma 4 VLM, contiguous", "Gemma 4 VLM, balanced"};
  for (const Rows rows : {Rows::CausalContiguous, Rows::VlmContiguous, Rows::VlmBalanced}) {
    for (const int W : {512, 1024}) {
      for (const int S : {8192, 32768}) {
        for (const int P : {2, 4, 8}) {
          const bool vlm = rows != Rows::CausalContiguous;
          const std::vector<TokenMeta> row = vlm ? gemma4_vlm_row(S, 1) : make_row_meta(S, nullptr, nullptr);
          const LayerMask sliding{true, W, vlm}, full{true, 0, vlm};
          const LayerMix mix = {{sliding, 5}, {full, 1}};
          const ShardMap map = rows == Rows::VlmBalanced ? balanced_shard(row.data(), 1, S, P, mix).map
                                                         : make_shard_map(Scheme::Contiguous, S, P, kPlanBlock);
          const CommPlan plan = plan_for(row, map, mix);
          const int64_t sliding_bytes = kv_bytes(max_recv(plan.for_mask(sliding)), 1, kSlidingKv);
          const int64_t full_bytes = kv_bytes(max_recv(plan.for_mask(full)), 1, kFullKv);
          const int64_t ring_tokens = int64_t{P - 1} * map.L;
          const int64_t bound = kv_bytes(W - 1 + kPlanBlock, 1, kSlidingKv);
          const double work_imbalance =
              imbalance(rank_work(token_work(row.data(), 1, S, map.S_padded, mix, kPlanBlock), map));
          std::printf("| %s | %d | %dK | %d | %.2f | %.2f | %.2f | %.1f / %.1f | %.1fx less | %.3f |\n",
                      names[static_cast<int>(rows)], W, S / 1024, P, mib(sliding_bytes), mib(bound), mib(full_bytes),
                      mib(kv_bytes(ring_tokens, 1, kSlidingKv)), mib(kv_bytes(ring_tokens, 1, kFullKv)),
                      static_cast<double>(kv_bytes(ring_tokens, 1, kSlidingKv)) / std::max<int64_t>(1, sliding_bytes),
                      work_imbalance);
        }
      }
    }
  }
}

double scheme_imbalance(const std::vector<TokenMeta>& row, int S, int P, const LayerMix& mix, Scheme s) {
  const ShardMap map =
      s == Scheme::Balanced ? balanced_shard(row.data(), 1, S, P, mix).map : make_shard_map(s, S, P, kPlanBlock);
  return imbalance(rank_work(token_work(row.data(), 1, S, map.S_padded, mix, kPlanBlock), map));
}

void imbalance_table() {
  constexpr int kS = 32768;
  const LayerMix gemma = parse_layer_mix("5xsliding:1024:groups,1xfull:groups");
  const LayerMix causal = parse_layer_mix("full");
  std::printf("\n| rows, layers | P | contiguous | zigzag | balanced | balanced: most runs on a rank |\n");
  std::printf("|---|---|---|---|---|---|\n");
  for (const bool vlm : {false, true}) {
    for (const int P : {2, 4, 8}) {
      const LayerMix& mix = vlm ? gemma : causal;
      std::vector<double> imb[3];
      std::vector<int> runs;
      for (int seed = 1; seed <= (vlm ? kVlmSeeds : 1); ++seed) {
        const std::vector<TokenMeta> row = vlm ? gemma4_vlm_row(kS, seed) : make_row_meta(kS, nullptr, nullptr);
        int k = 0;
        for (const Scheme s : {Scheme::Contiguous, Scheme::Zigzag, Scheme::Balanced}) {
          imb[k++].push_back(scheme_imbalance(row, kS, P, mix, s));
        }
        runs.push_back(balanced_shard(row.data(), 1, kS, P, mix).max_runs);
      }
      auto median = [](std::vector<double> v) {
        std::sort(v.begin(), v.end());
        return v[v.size() / 2];
      };
      std::sort(runs.begin(), runs.end());
      std::printf("| %s | %d | %.3f | %.3f | %.3f | %d |\n",
                  vlm ? "Gemma 4 VLM (median of 5), 5 x sliding:1024:groups + 1 x full:groups"
                      : "causal 1 doc, full causal",
                  P, median(imb[0]), median(imb[1]), median(imb[2]), runs[runs.size() / 2]);
    }
  }
}

}  // namespace

int main() {
  traffic_table();
  imbalance_table();
  return 0;
}
