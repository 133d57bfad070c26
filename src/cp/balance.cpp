#include "cp/balance.h"

#include <algorithm>
#include <numeric>

#include "core/error.h"

namespace rf::cp {

namespace {

// Runs of `run` consecutive blocks dealt to ranks, `per_rank` runs each.
struct Deal {
  int run = 1;
  std::vector<int> rank_of;    // [runs]
  std::vector<int64_t> load;   // [P]
  int64_t peak() const { return *std::max_element(load.begin(), load.end()); }
};

// Longest-processing-time-first with a capacity of per_rank runs: heaviest run to the least-loaded rank that still
// has room. Then pairwise swaps between the busiest rank and any other while they lower the pair's larger load.
// Each swap moves both loads strictly inside the old (low, high) interval, so the sum of squared loads falls and
// the loop ends; the cap only bounds a pathological tail of tiny improvements.
Deal deal_runs(const std::vector<int64_t>& block_work, int P, int run) {
  const int runs = static_cast<int>(block_work.size()) / run;
  const int per_rank = runs / P;
  std::vector<int64_t> run_work(static_cast<size_t>(runs), 0);
  for (int u = 0; u < runs; ++u) {
    run_work[u] = std::accumulate(block_work.begin() + u * run, block_work.begin() + (u + 1) * run, int64_t{0});
  }
  std::vector<int> order(static_cast<size_t>(runs));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return run_work[a] > run_work[b]; });

  Deal d;
  d.run = run;
  d.rank_of.assign(static_cast<size_t>(runs), -1);
  d.load.assign(static_cast<size_t>(P), 0);
  std::vector<std::vector<int>> members(static_cast<size_t>(P));
  for (const int u : order) {
    int best = -1;
    for (int r = 0; r < P; ++r) {
      if (static_cast<int>(members[r].size()) == per_rank) continue;
      if (best < 0 || d.load[r] < d.load[best]) best = r;
    }
    members[best].push_back(u);
    d.rank_of[u] = best;
    d.load[best] += run_work[u];
  }

  const int64_t max_swaps = int64_t{64} * runs;
  for (int64_t swaps = 0; swaps < max_swaps; ++swaps) {
    const int a = static_cast<int>(std::max_element(d.load.begin(), d.load.end()) - d.load.begin());
    int64_t best_peak = d.load[a];
    int best_b = -1, best_x = -1, best_y = -1;
    for (int b = 0; b < P; ++b) {
      if (b == a) continue;
      for (int x = 0; x < per_rank; ++x) {
        for (int y = 0; y < per_rank; ++y) {
          const int64_t delta = run_work[members[a][x]] - run_work[members[b][y]];
          if (delta <= 0) continue;
          const int64_t peak = std::max(d.load[a] - delta, d.load[b] + delta);
          if (peak < best_peak) {
            best_peak = peak;
            best_b = b;
            best_x = x;
            best_y = y;
          }
        }
      }
    }
    if (best_b < 0) break;
    const int ux = members[a][best_x], uy = members[best_b][best_y];
    const int64_t delta = run_work[ux] - run_work[uy];
    members[a][best_x] = uy;
    members[best_b][best_y] = ux;
    d.rank_of[ux] = best_b;
    d.rank_of[uy] = a;
    d.load[a] -= delta;
    d.load[best_b] += delta;
  }
  return d;
}

}  // namespace

BlockAssignment assign_blocks(const std::vector<int64_t>& block_work, int P) {
  RF_CHECK(P >= 1, "assign_blocks: P = ", P);
  const int n = static_cast<int>(block_work.size());
  RF_CHECK(n > 0 && n % P == 0, "assign_blocks: ", n, " blocks do not split evenly over ", P, " ranks");
  RF_CHECK(std::all_of(block_work.begin(), block_work.end(), [](int64_t w) { return w >= 0; }),
           "assign_blocks: negative block work");
  const int m = n / P;

  // Run lengths that divide m, longest (most contiguous) first.
  std::vector<Deal> deals;
  for (int run = m; run >= 1; --run) {
    if (m % run == 0) deals.push_back(deal_runs(block_work, P, run));
  }
  int64_t best = deals.front().peak();
  for (const Deal& d : deals) best = std::min(best, d.peak());
  const Deal* chosen = &deals.back();
  for (const Deal& d : deals) {
    if (static_cast<double>(d.peak()) <= static_cast<double>(best) * (1.0 + kContiguityTolerance)) {
      chosen = &d;
      break;
    }
  }

  BlockAssignment out;
  out.run_blocks = chosen->run;
  out.work = chosen->load;
  out.blocks.assign(static_cast<size_t>(P), {});
  for (int u = 0; u < static_cast<int>(chosen->rank_of.size()); ++u) {
    for (int k = 0; k < chosen->run; ++k) out.blocks[chosen->rank_of[u]].push_back(u * chosen->run + k);
  }
  return out;  // runs were visited in row order, so each rank's blocks are ascending
}

BalancedShard balanced_shard(const TokenMeta* rows, int B, int S, int P, const LayerMix& mix, int block) {
  RF_CHECK(S >= 1 && P >= 1 && B >= 1 && block >= 1, "balanced sharding: S = ", S, ", P = ", P, ", B = ", B,
           ", block = ", block, " (all must be positive)");
  const int per_rank = (S + P - 1) / P;
  const int L = (per_rank + block - 1) / block * block;
  const int S_padded = P * L;
  const std::vector<int64_t> work = token_work(rows, B, S, S_padded, mix, block);
  std::vector<int64_t> block_work(static_cast<size_t>(S_padded / block), 0);
  for (int t = 0; t < S_padded; ++t) block_work[t / block] += work[t];

  const BlockAssignment a = assign_blocks(block_work, P);
  BalancedShard out;
  out.map.S = S;
  out.map.S_padded = S_padded;
  out.map.P = P;
  out.map.L = L;
  out.map.scheme = Scheme::Balanced;
  out.map.positions.assign(static_cast<size_t>(P), {});
  for (int r = 0; r < P; ++r) {
    for (const int32_t j : a.blocks[r]) {
      for (int k = 0; k < block; ++k) out.map.positions[r].push_back(j * block + k);
    }
  }
  out.work = a.work;
  out.imbalance = imbalance(a.work);
  out.run_blocks = a.run_blocks;
  return out;
}

}  // namespace rf::cp
