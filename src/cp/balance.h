// ringflex cp: the mask-aware `balanced` sharding scheme (docs/spec.md §5).
//
// Causal work grows along the row (a query sees everything before it), packed documents and image groups make it
// lumpy, and sliding layers make it flat: contiguous shards leave the last rank with most of the work (max/mean
// ~1.9 at P = 8 on a causal row). The balancer cuts the padded row into blocks of `block` tokens, predicts each
// block's work exactly for the model's layer mix (cp/work.h), and deals blocks to ranks, L / block each (every rank
// holds L tokens: the ShardMap contract), so that the busiest rank has as little as possible.
//
// Contiguity matters too: on a sliding layer every separate run of blocks on a rank pulls its own halo (up to W - 1
// keys before the run), unless the run starts at a document boundary, where it pulls nothing. So the balancer
// predicts the halo a run starting at each block would pull (block_halo_cost below) and tries several deals:
//   1. contiguous (one run per rank);
//   2. two runs per rank in zigzag order with movable cuts, the cuts chosen by a dynamic programme to minimise
//      the busiest rank (zigzag's balance on causal rows, adjusted to documents, images and padding);
//   3. the same shape with the cuts chosen to minimise the largest halo a rank pulls, subject to every rank's work
//      staying within max_imbalance of perfect: cuts move to document boundaries where balance allows (exact for
//      the largest halo; among equal halos the busiest rank is minimised greedily);
//   4. runs of every length dividing L / block, dealt heaviest first to the least-loaded rank with room, then
//      refined by swaps (for rows too lumpy for the others).
// Among the deals whose busiest rank is within BalanceOptions::max_imbalance of perfect (max / mean), the one whose
// busiest-halo rank pulls least wins, then the one with the fewest runs per rank, then the better balanced; when
// no deal meets the tolerance, the best-balanced one wins (fewest runs on a tie).
// Deterministic: no randomness, ties broken by candidate order, block and rank index.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/mask.h"
#include "cp/plan.h"
#include "cp/shard.h"
#include "cp/work.h"

namespace rf::cp {

// The work target: the busiest rank may carry at most 5% more than the mean. Within it the balancer spends
// the freedom on communication (fewer halos) rather than on a still flatter balance, whose gain is below the
// run-to-run noise of the kernels while every extra halo is W - 1 tokens of K and V on every sliding layer.
constexpr double kDefaultMaxImbalance = 1.05;

struct BalanceOptions {
  double max_imbalance = kDefaultMaxImbalance;  // max / mean work a deal may have and still be chosen for its halos
};

struct BlockAssignment {
  int max_runs = 1;                          // most separate runs of consecutive blocks on one rank; 1 = contiguous
  int64_t max_halo = 0;                      // largest halo cost of one rank: block_halo summed over its runs' starts
  std::vector<std::vector<int32_t>> blocks;  // [P][m]: row blocks each rank holds, ascending
  std::vector<int64_t> work;                 // [P]: the sum of its blocks' work
};

// Deals n = P * m blocks to P ranks, m each. block_work: [n], >= 0. block_halo: [n] or empty (all zero), >= 0: the
// cost (tokens x layers) of the halo a run starting at block j pulls from before it; a rank's halo cost is the sum
// over its runs' first blocks. Chooses as described above.
BlockAssignment assign_blocks(const std::vector<int64_t>& block_work, int P,
                              const std::vector<int64_t>& block_halo = {}, const BalanceOptions& options = {});

// The halo cost of a run starting at each block of the padded row, [S_padded / block]: the tokens before the
// block's first token that lie in its document, capped at W - 1 and rounded up to whole blocks (what the plan
// moves), summed over the mix's causal sliding masks
// (weighted by layer count) and maxed over the B rows (the rows share the map, so their halos overlap). With
// groups, a block that starts inside an image group also costs the group's rest in blocks: the run that ends
// there (on another rank) reads it, and charging it here keeps cuts out of groups. Zero where the block starts a
// document or with padding. Only sliding layers count: their halo is what a cut adds, while a
// full causal layer's rank already pulls the whole earlier document for its latest run whatever the other cuts,
// and a non-causal mask has no "before". rows: [B, S].
std::vector<int64_t> block_halo_cost(const TokenMeta* rows, int B, int S, int S_padded, const LayerMix& mix, int block);

struct BalancedShard {
  ShardMap map;               // scheme Balanced; L is a multiple of `block`; each rank's positions ascending
  std::vector<int64_t> work;  // [P]: predicted work (mask area summed over the mix and the B rows)
  double imbalance = 1.0;     // max / mean of work
  int max_runs = 1;           // most separate runs on one rank (each needs its own sliding-window halo)
  int64_t max_halo = 0;       // largest predicted halo cost of one rank (block_halo_cost summed over its runs)
};

// rows: [B, S]. L = ceil(S / P) rounded up to a multiple of `block`; the row is padded to P * L.
BalancedShard balanced_shard(const TokenMeta* rows, int B, int S, int P, const LayerMix& mix, int block = kPlanBlock,
                             const BalanceOptions& options = {});

// The map of a scheme named on a command line: contiguous | zigzag (make_shard_map, L a multiple of `multiple`)
// | balanced | auto. auto is balanced: contiguous and zigzag laid out on the same blocks lie in its search, so its
// predicted work is within the default max_imbalance whenever theirs is, and never worse than theirs otherwise.
// Balanced deals blocks of kPlanBlock tokens, or half a rank's share when a rank gets fewer than kPlanBlock, so a
// short row still spreads over every rank. The one place a run's shard map is chosen. rows: [B, S].
ShardMap shard_map_for(const std::string& scheme, const TokenMeta* rows, int B, int S, int P, const LayerMix& mix,
                       int multiple = 1);

// The map alone (what make_shard_map gives for the other schemes).
inline ShardMap balanced_shard_map(const TokenMeta* rows, int B, int S, int P, const LayerMix& mix,
                                   int block = kPlanBlock) {
  return balanced_shard(rows, B, S, P, mix, block).map;
}

}  // namespace rf::cp
