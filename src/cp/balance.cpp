// ringflex cp: the `balanced` scheme: dealing blocks to ranks by work, then reducing halos (see balance.h).
#include "cp/balance.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <tuple>
#include <utility>

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

// The largest halo cost any rank pulls: block_halo summed over the first blocks of its runs.
int64_t max_halo(const Deal& d, const std::vector<int64_t>& block_halo) {
  std::vector<int64_t> halo(d.load.size(), 0);
  for (size_t j = 0; j < d.owner.size(); ++j) {
    if (j == 0 || d.owner[j] != d.owner[j - 1]) halo[d.owner[j]] += block_halo[j];
  }
  return *std::max_element(halo.begin(), halo.end());
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
// [c_r, c_{r+1}) and |F_r| + |B_r| = m, B_r = [n - (r + 1) m + c_{r+1}, n - r m + c_r): each rank's load and halo
// depend only on its two front cuts, so cuts minimising the largest of them follow from a dynamic programme over
// ranks with the cut as state (P * n * (m + 1) steps: ~2.6e5 at S = 32K with 64-token blocks).
class Snake {
 public:
  Snake(const std::vector<int64_t>& block_work, const std::vector<int64_t>& block_halo, int P)
      : n_(static_cast<int>(block_work.size())),
        m_(n_ / P),
        P_(P),
        halo_(block_halo),
        prefix_(static_cast<size_t>(n_) + 1, 0) {
    for (int j = 0; j < n_; ++j) prefix_[j + 1] = prefix_[j] + block_work[j];
  }

  int64_t load(int r, int c, int c_next) const {
    return range_work(prefix_, c, c_next) + range_work(prefix_, back_begin(r, c_next), back_end(r, c));
  }

  // The halo cost of r's runs: one per non-empty run, except that F_{P-1} and B_{P-1} touch and form one run.
  int64_t halo(int r, int c, int c_next) const {
    const int bb = back_begin(r, c_next), be = back_end(r, c);
    int64_t h = 0;
    if (c < c_next) h += halo_[c];
    if (bb < be && !(c < c_next && bb == c_next)) h += halo_[bb];
    return h;
  }

  // Cuts c_0 = 0 <= c_1 <= ... <= c_P minimising, lexicographically, the largest cost(r, c_r, c_{r+1}) = {primary,
  // secondary} over ranks (the two maxima taken separately; exact for the primary, greedy for the secondary), among
  // cuts where every load is at most `cap`. Empty when no cuts meet the cap. Ties go to the smaller cut.
  template <typename Cost>
  std::vector<int> cuts(Cost cost, int64_t cap) const {
    using Key = std::pair<int64_t, int64_t>;
    constexpr int64_t kUnreachable = std::numeric_limits<int64_t>::max();
    const Key unreachable{kUnreachable, kUnreachable};
    // best[r][c]: the smallest key of ranks 0..r-1 with c_r = c; from[r][c]: the c_{r-1} achieving it.
    std::vector<std::vector<Key>> best(static_cast<size_t>(P_) + 1, std::vector<Key>(n_ + 1, unreachable));
    std::vector<std::vector<int>> from(static_cast<size_t>(P_) + 1, std::vector<int>(n_ + 1, -1));
    best[0][0] = {0, 0};
    for (int r = 0; r < P_; ++r) {
      for (int c = 0; c <= r * m_; ++c) {
        if (best[r][c] == unreachable) continue;
        for (int c_next = c; c_next <= c + m_; ++c_next) {
          if (load(r, c, c_next) > cap) continue;
          const Key k = cost(r, c, c_next);
          const Key key{std::max(best[r][c].first, k.first), std::max(best[r][c].second, k.second)};
          if (key < best[r + 1][c_next]) {
            best[r + 1][c_next] = key;
            from[r + 1][c_next] = c;
          }
        }
      }
    }
    int c_end = 0;
    for (int c = 0; c <= n_; ++c) {
      if (best[P_][c] < best[P_][c_end]) c_end = c;
    }
    if (best[P_][c_end] == unreachable) return {};
    std::vector<int> cut(static_cast<size_t>(P_) + 1, 0);
    cut[P_] = c_end;
    for (int r = P_; r > 0; --r) cut[r - 1] = from[r][cut[r]];
    return cut;
  }

  Deal deal(const std::vector<int>& cut) const {
    Deal d;
    d.owner.assign(static_cast<size_t>(n_), 0);
    d.load.assign(static_cast<size_t>(P_), 0);
    for (int r = 0; r < P_; ++r) {
      for (int j = cut[r]; j < cut[r + 1]; ++j) d.owner[j] = r;
      for (int j = back_begin(r, cut[r + 1]); j < back_end(r, cut[r]); ++j) d.owner[j] = r;
      d.load[r] = load(r, cut[r], cut[r + 1]);
    }
    return d;
  }

 private:
  int back_begin(int r, int c_next) const { return n_ - (r + 1) * m_ + c_next; }
  int back_end(int r, int c) const { return n_ - r * m_ + c; }

  int n_, m_, P_;
  const std::vector<int64_t>& halo_;
  std::vector<int64_t> prefix_;
};

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

// Most runs per rank for which dealt layouts get the halo-reducing swaps below: each swap trial costs O(runs), a
// pass O(runs^3); past 8 runs a rank the layout pulls 8 halos whatever the swaps, far from the one the bound allows.
constexpr int kMaxRunsForHaloSwaps = 8;

// A dealt-runs layout (runs of `run` blocks at multiples of `run`) with fewer halos: swap one run of the rank that
// pulls the most with one run of another rank while that lowers the larger of the two ranks' halos and keeps both
// loads within `cap` (a swap lands a run next to its rank's other runs, merging them, or on a document boundary).
// Only the two ranks' halos change: every other rank's run starts keep their predecessors' owners.
void reduce_halos(Deal& d, const std::vector<int64_t>& block_work, const std::vector<int64_t>& block_halo, int run,
                  int64_t cap) {
  const int P = static_cast<int>(d.load.size());
  const int runs = static_cast<int>(d.owner.size()) / run;
  std::vector<int> run_owner(static_cast<size_t>(runs));
  std::vector<int64_t> run_work(static_cast<size_t>(runs), 0);
  for (int u = 0; u < runs; ++u) {
    run_owner[u] = d.owner[u * run];
    for (int k = 0; k < run; ++k) run_work[u] += block_work[u * run + k];
  }
  // Blocks inside a run follow a block of the same rank, so only runs' first blocks can start a rank's run.
  auto rank_halo = [&](int r) {
    int64_t h = 0;
    for (int u = 0; u < runs; ++u) {
      if (run_owner[u] == r && (u == 0 || run_owner[u - 1] != r)) h += block_halo[u * run];
    }
    return h;
  };
  std::vector<int64_t> halo(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r) halo[r] = rank_halo(r);
  // Each accepted swap strictly lowers the busiest pair's larger halo; the cap only bounds a pathological tail.
  const int max_swaps = 4 * runs;
  for (int swaps = 0; swaps < max_swaps; ++swaps) {
    const int a = static_cast<int>(std::max_element(halo.begin(), halo.end()) - halo.begin());
    if (halo[a] == 0) break;
    bool improved = false;
    for (int u = 0; u < runs && !improved; ++u) {
      if (run_owner[u] != a) continue;
      for (int v = 0; v < runs && !improved; ++v) {
        const int b = run_owner[v];
        if (b == a) continue;
        const int64_t delta = run_work[v] - run_work[u];
        if (d.load[a] + delta > cap || d.load[b] - delta > cap) continue;
        std::swap(run_owner[u], run_owner[v]);
        const int64_t ha = rank_halo(a), hb = rank_halo(b);
        if (std::max(ha, hb) < halo[a]) {
          halo[a] = ha;
          halo[b] = hb;
          d.load[a] += delta;
          d.load[b] -= delta;
          improved = true;
        } else {
          std::swap(run_owner[u], run_owner[v]);
        }
      }
    }
    if (!improved) break;
  }
  for (int u = 0; u < runs; ++u) {
    for (int k = 0; k < run; ++k) d.owner[u * run + k] = run_owner[u];
  }
}

}  // namespace

BlockAssignment assign_blocks(const std::vector<int64_t>& block_work, int P, const std::vector<int64_t>& block_halo,
                              const BalanceOptions& options) {
  RF_CHECK(P >= 1, "assign_blocks needs P >= 1 ranks, got P = ", P);
  const int n = static_cast<int>(block_work.size());
  RF_CHECK(n > 0 && n % P == 0, "assign_blocks: ", n, " blocks do not split evenly over ", P, " ranks");
  RF_CHECK(std::all_of(block_work.begin(), block_work.end(), [](int64_t w) { return w >= 0; }),
           "assign_blocks: negative block work");
  RF_CHECK(block_halo.empty() || block_halo.size() == block_work.size(), "assign_blocks: ", block_halo.size(),
           " halo costs for ", n, " blocks");
  RF_CHECK(std::all_of(block_halo.begin(), block_halo.end(), [](int64_t h) { return h >= 0; }),
           "assign_blocks: negative halo cost");
  RF_CHECK(options.max_imbalance >= 1.0, "assign_blocks: max_imbalance ", options.max_imbalance,
           " is below 1 (perfect balance)");
  const std::vector<int64_t> halo = block_halo.empty() ? std::vector<int64_t>(block_work.size(), 0) : block_halo;
  const int m = n / P;
  const int64_t total = std::accumulate(block_work.begin(), block_work.end(), int64_t{0});
  // The largest load within the tolerance: max / mean <= max_imbalance.
  const auto cap = static_cast<int64_t>(std::floor(options.max_imbalance * static_cast<double>(total) / P));

  // Candidates: contiguous, two movable runs per rank cut for balance, then cut for halos within the cap, then
  // dealt runs of every length dividing m.
  std::vector<Deal> deals;
  deals.push_back(contiguous(block_work, P));
  const Snake snake(block_work, halo, P);
  deals.push_back(snake.deal(snake.cuts(
      [&](int r, int c, int c_next) {
        return std::pair<int64_t, int64_t>{snake.load(r, c, c_next), 0};
      },
      std::numeric_limits<int64_t>::max())));
  const std::vector<int> halo_cuts = snake.cuts(
      [&](int r, int c, int c_next) {
        return std::pair<int64_t, int64_t>{snake.halo(r, c, c_next), snake.load(r, c, c_next)};
      },
      cap);
  if (!halo_cuts.empty()) deals.push_back(snake.deal(halo_cuts));
  for (int run = m / 2; run >= 1; --run) {
    if (m % run != 0) continue;
    deals.push_back(deal_runs(block_work, P, run));
    if (m / run <= kMaxRunsForHaloSwaps && deals.back().peak() <= cap) {
      reduce_halos(deals.back(), block_work, halo, run, cap);
    }
  }

  // Within the cap: least halo, then fewest runs, then lowest peak, then the earlier candidate. None within it: the
  // lowest peak, then fewest runs.
  const Deal* chosen = nullptr;
  for (const Deal& d : deals) {
    if (d.peak() > cap) continue;
    const auto key = std::make_tuple(max_halo(d, halo), max_runs(d), d.peak());
    if (!chosen || key < std::make_tuple(max_halo(*chosen, halo), max_runs(*chosen), chosen->peak())) chosen = &d;
  }
  if (!chosen) {
    for (const Deal& d : deals) {
      if (!chosen || std::make_pair(d.peak(), max_runs(d)) < std::make_pair(chosen->peak(), max_runs(*chosen))) {
        chosen = &d;
      }
    }
  }

  BlockAssignment out;
  out.max_runs = max_runs(*chosen);
  out.max_halo = max_halo(*chosen, halo);
  out.work = chosen->load;
  out.blocks.assign(static_cast<size_t>(P), {});
  for (int j = 0; j < n; ++j) out.blocks[chosen->owner[j]].push_back(j);
  return out;
}

std::vector<int64_t> block_halo_cost(const TokenMeta* rows, int B, int S, int S_padded, const LayerMix& mix,
                                     int block) {
  RF_CHECK(block >= 1 && S_padded >= S && S_padded % block == 0,
           "block_halo_cost needs block >= 1 and S <= S_padded with S_padded a multiple of block, got S = ", S,
           ", S_padded = ", S_padded, ", block = ", block);
  std::vector<int64_t> cost(static_cast<size_t>(S_padded / block), 0);
  for (int b = 0; b < B; ++b) {
    const TokenMeta* row = rows + static_cast<size_t>(b) * S;
    // group_end[t]: one past the last position of the stretch of equal group ids holding t (a group's extent).
    std::vector<int> group_end(static_cast<size_t>(S), S);
    for (int t = S - 2; t >= 0; --t) {
      group_end[t] = row[t].group == row[t + 1].group && row[t].doc == row[t + 1].doc ? group_end[t + 1] : t + 1;
    }
    int doc_begin = 0;  // first position of the stretch of equal document ids that holds t
    for (int t = 0; t < S; ++t) {
      if (t > 0 && row[t].doc != row[t - 1].doc) doc_begin = t;
      if (t % block != 0 || row[t].doc == kPaddingDoc) continue;
      const int64_t before = t - doc_begin;
      // A cut inside an image group makes the run ending here read the group's rest (bidirectional), on another
      // rank. It is charged to the run starting here, so that cuts avoid groups; the sum stays a per-cut cost.
      const bool splits_group =
          t > 0 && row[t].group != kNoGroup && row[t - 1].group == row[t].group && row[t - 1].doc == row[t].doc;
      const int64_t group_rest_blocks = splits_group ? (group_end[t] - t + block - 1) / block : 0;
      int64_t c = 0;
      for (const LayerKind& lk : mix) {
        if (!lk.mask.causal || lk.mask.window == 0) continue;
        // The plan moves whole blocks: the halo's tokens end at a block boundary, so it spans this many blocks.
        const int64_t halo_blocks = (std::min<int64_t>(before, lk.mask.window - 1) + block - 1) / block;
        c += lk.count * (halo_blocks + (lk.mask.bidirectional_groups ? group_rest_blocks : 0)) * block;
      }
      cost[t / block] = std::max(cost[t / block], c);
    }
  }
  return cost;
}

BalancedShard balanced_shard(const TokenMeta* rows, int B, int S, int P, const LayerMix& mix, int block,
                             const BalanceOptions& options) {
  RF_CHECK(S >= 1 && P >= 1 && B >= 1 && block >= 1, "balanced sharding: S = ", S, ", P = ", P, ", B = ", B,
           ", block = ", block, " (all must be positive)");
  const int per_rank = (S + P - 1) / P;
  const int L = (per_rank + block - 1) / block * block;
  const int S_padded = P * L;
  const std::vector<int64_t> work = token_work(rows, B, S, S_padded, mix, block);
  std::vector<int64_t> block_work(static_cast<size_t>(S_padded / block), 0);
  for (int t = 0; t < S_padded; ++t) block_work[t / block] += work[t];

  const BlockAssignment a = assign_blocks(block_work, P, block_halo_cost(rows, B, S, S_padded, mix, block), options);
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
  out.max_halo = a.max_halo;
  return out;
}

ShardMap shard_map_for(const std::string& scheme, const TokenMeta* rows, int B, int S, int P, const LayerMix& mix,
                       int multiple) {
  if (scheme == "auto" || scheme == "balanced") {
    // Deal whole kPlanBlock blocks (the plan's and the kernels' key tile) when each rank gets at least one; a
    // shorter row is dealt in blocks of half a rank's share, so that it is still split over every rank rather than
    // handed whole to rank 0 inside one padded block.
    const int per_rank = (S + P - 1) / P;
    const int block = per_rank >= kPlanBlock ? kPlanBlock : std::max(1, (per_rank + 1) / 2);
    return balanced_shard_map(rows, B, S, P, mix, block);
  }
  return make_shard_map(parse_scheme(scheme), S, P, multiple);
}

}  // namespace rf::cp
