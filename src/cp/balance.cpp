#include "cp/balance.h"

#include <algorithm>
#include <limits>
#include <numeric>

#include "core/error.h"

namespace rf::cp {

namespace {

// One way of dealing the n = P * m blocks: owner of every block and each rank's load.
struct Deal {
  std::vector<int> owner;     // [n]
  std::vector<int64_t> load;  // [P]

  int64_t peak() const { return *std::max_element(load.begin(), load.end()); }
};

// The largest number of separate runs (maximal stretches of consecutive blocks) any rank holds: each one needs
// its own sliding-window halo.
int max_runs(const Deal& d) {
  std::vector<int> runs(d.load.size(), 0);
  for (size_t j = 0; j < d.owner.size(); ++j) {
    if (j == 0 || d.owner[j] != d.owner[j - 1]) ++runs[d.owner[j]];
  }
  return *std::max_element(runs.begin(), runs.end());
}

// Sum of block_work over [begin, end), from prefix sums ([n + 1]).
int64_t range_work(const std::vector<int64_t>& prefix, int begin, int end) { return prefix[end] - prefix[begin]; }

// Rank r holds blocks [r m, (r + 1) m), the contiguous scheme's layout.
Deal contiguous(const std::vector<int64_t>& block_work, int P) {
  const int n = static_cast<int>(block_work.size()), m = n / P;
  Deal d;
  d.owner.resize(static_cast<size_t>(n));
  d.load.assign(static_cast<size_t>(P), 0);
  for (int j = 0; j < n; ++j) {
    d.owner[j] = j / m;
    d.load[j / m] += block_work[j];
  }
  return d;
}

// Two runs per rank in snake order, F_0 F_1 ... F_{P-1} B_{P-1} ... B_0: zigzag with movable cuts. With F_r =
// [c_r, c_{r+1}) and |F_r| + |B_r| = m, B_r = [n - (r + 1) m + c_{r+1}, n - r m + c_r): each rank's load depends
// only on its two front cuts, so the cuts minimising the largest load follow from a dynamic programme over ranks
// with the cut as state (P * n * (m + 1) steps: ~2.6e5 at S = 32K with 64-token blocks). Exact for this shape;
// ties go to the smaller cut.
Deal snake_two_runs(const std::vector<int64_t>& block_work, int P) {
  const int n = static_cast<int>(block_work.size()), m = n / P;
  std::vector<int64_t> prefix(static_cast<size_t>(n) + 1, 0);
  for (int j = 0; j < n; ++j) prefix[j + 1] = prefix[j] + block_work[j];
  auto load = [&](int r, int c, int c_next) {
    const int back_end = n - r * m + c, back_begin = n - (r + 1) * m + c_next;
    return range_work(prefix, c, c_next) + range_work(prefix, back_begin, back_end);
  };

  constexpr int64_t kUnreachable = std::numeric_limits<int64_t>::max();
  // peak[r][c]: the smallest possible largest load of ranks 0..r-1 with c_r = c; from[r][c]: c_{r-1} achieving it.
  std::vector<std::vector<int64_t>> peak(static_cast<size_t>(P) + 1, std::vector<int64_t>(n + 1, kUnreachable));
  std::vector<std::vector<int>> from(static_cast<size_t>(P) + 1, std::vector<int>(n + 1, -1));
  peak[0][0] = 0;
  for (int r = 0; r < P; ++r) {
    for (int c = 0; c <= r * m; ++c) {
      if (peak[r][c] == kUnreachable) continue;
      for (int c_next = c; c_next <= c + m; ++c_next) {
        const int64_t p = std::max(peak[r][c], load(r, c, c_next));
        if (p < peak[r + 1][c_next]) {
          peak[r + 1][c_next] = p;
          from[r + 1][c_next] = c;
        }
      }
    }
  }
  int c_end = 0;
  for (int c = 0; c <= n; ++c) {
    if (peak[P][c] < peak[P][c_end]) c_end = c;
  }
  std::vector<int> cut(static_cast<size_t>(P) + 1, 0);
  cut[P] = c_end;
  for (int r = P; r > 0; --r) cut[r - 1] = from[r][cut[r]];

  Deal d;
  d.owner.assign(static_cast<size_t>(n), 0);
  d.load.assign(static_cast<size_t>(P), 0);
  for (int r = 0; r < P; ++r) {
    for (int j = cut[r]; j < cut[r + 1]; ++j) d.owner[j] = r;
    for (int j = n - (r + 1) * m + cut[r + 1]; j < n - r * m + cut[r]; ++j) d.owner[j] = r;
    d.load[r] = load(r, cut[r], cut[r + 1]);
  }
  return d;
}

// Runs of `run` consecutive blocks, dealt longest-processing-time-first with a capacity of m / run runs per rank:
// heaviest run to the least-loaded rank that still has room. Then pairwise swaps between the busiest rank and any
// other while they lower the pair's larger load (ending for the same sum-of-squares reason as above; the cap only
// bounds a pathological tail of tiny improvements). For rows too lumpy for two runs per rank.
Deal deal_runs(const std::vector<int64_t>& block_work, int P, int run) {
  const int runs = static_cast<int>(block_work.size()) / run;
  const int per_rank = runs / P;
  std::vector<int64_t> run_work(static_cast<size_t>(runs), 0);
  for (int u = 0; u < runs; ++u) {
    run_work[u] = std::accumulate(block_work.begin() + u * run, block_work.begin() + (u + 1) * run, int64_t{0});
  }
  std::vector<int> order(static_cast<size_t>(runs));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return run_work[x] > run_work[y]; });

  std::vector<int64_t> load(static_cast<size_t>(P), 0);
  std::vector<std::vector<int>> members(static_cast<size_t>(P));
  for (const int u : order) {
    int best = -1;
    for (int r = 0; r < P; ++r) {
      if (static_cast<int>(members[r].size()) == per_rank) continue;
      if (best < 0 || load[r] < load[best]) best = r;
    }
    members[best].push_back(u);
    load[best] += run_work[u];
  }

  const int64_t max_swaps = int64_t{64} * runs;
  for (int64_t swaps = 0; swaps < max_swaps; ++swaps) {
    const int a = static_cast<int>(std::max_element(load.begin(), load.end()) - load.begin());
    int64_t best_peak = load[a];
    int best_b = -1, best_x = -1, best_y = -1;
    for (int b = 0; b < P; ++b) {
      if (b == a) continue;
      for (int x = 0; x < per_rank; ++x) {
        for (int y = 0; y < per_rank; ++y) {
          const int64_t delta = run_work[members[a][x]] - run_work[members[b][y]];
          if (delta <= 0) continue;
          const int64_t peak = std::max(load[a] - delta, load[b] + delta);
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
    const int64_t delta = run_work[members[a][best_x]] - run_work[members[best_b][best_y]];
    std::swap(members[a][best_x], members[best_b][best_y]);
    load[a] -= delta;
    load[best_b] += delta;
  }

  Deal d;
  d.owner.assign(block_work.size(), 0);
  d.load = load;
  for (int r = 0; r < P; ++r) {
    for (const int u : members[r]) {
      for (int k = 0; k < run; ++k) d.owner[u * run + k] = r;
    }
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

  // Candidates: contiguous (runs of m), two movable runs per rank, then dealt runs of every length dividing m.
  std::vector<Deal> deals;
  deals.push_back(contiguous(block_work, P));
  deals.push_back(snake_two_runs(block_work, P));
  for (int run = m / 2; run >= 1; --run) {
    if (m % run == 0) deals.push_back(deal_runs(block_work, P, run));
  }
  int64_t best = deals.front().peak();
  for (const Deal& d : deals) best = std::min(best, d.peak());
  // Fewest runs per rank among those within the tolerance of the best; then the lower peak; then the earlier.
  const Deal* chosen = nullptr;
  for (const Deal& d : deals) {
    if (static_cast<double>(d.peak()) > static_cast<double>(best) * (1.0 + kContiguityTolerance)) continue;
    if (!chosen || max_runs(d) < max_runs(*chosen) || (max_runs(d) == max_runs(*chosen) && d.peak() < chosen->peak())) {
      chosen = &d;
    }
  }

  BlockAssignment out;
  out.max_runs = max_runs(*chosen);
  out.work = chosen->load;
  out.blocks.assign(static_cast<size_t>(P), {});
  for (int j = 0; j < n; ++j) out.blocks[chosen->owner[j]].push_back(j);
  return out;
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
  out.max_runs = a.max_runs;
  return out;
}

ShardMap shard_map_for(const std::string& scheme, const TokenMeta* rows, int B, int S, int P, const LayerMix& mix,
                       int multiple) {
  if (scheme == "auto" || scheme == "balanced") return balanced_shard_map(rows, B, S, P, mix);
  return make_shard_map(parse_scheme(scheme), S, P, multiple);
}

}  // namespace rf::cp
