// ringflex cp: the mask-aware `balanced` sharding scheme (SPEC §5).
//
// Causal work grows along the row (a query sees everything before it), packed documents and image groups make it
// lumpy, and sliding layers make it flat: contiguous shards leave the last rank with most of the work (max/mean
// ~1.9 at P = 8 on a causal row). The balancer cuts the padded row into blocks of `block` tokens, predicts each
// block's work exactly for the model's layer mix (cp/work.h), and deals blocks to ranks, L / block each (every rank
// holds L tokens: the ShardMap contract), so that the busiest rank has as little as possible.
//
// Contiguity matters too: every separate run of blocks on a rank needs its own sliding-window halo, and short runs
// fragment the kernel's work. So several deals are tried, from the fewest runs per rank to the most:
//   1. contiguous (one run per rank);
//   2. two runs per rank in zigzag order with movable cuts, the cuts chosen by a dynamic programme to minimise
//      the busiest rank (enough for causal rows and many packed ones: zigzag's balance on causal rows, adjusted
//      to documents, images and padding);
//   3. runs of every length dividing L / block, dealt heaviest first to the least-loaded rank with room, then
//      refined by swaps (for lumpy rows).
// The one with the fewest runs per rank whose busiest rank is within kContiguityTolerance of the best deal wins.
// Deterministic: no randomness, ties broken by block and rank index.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/mask.h"
#include "cp/plan.h"
#include "cp/shard.h"
#include "cp/work.h"

namespace rf::cp {

// A deal with fewer runs may cost at most this share of extra work on the busiest rank (1%): below the run-to-run
// noise of the kernels on a shared machine, so it "costs no balance", while each run saved saves a halo.
constexpr double kContiguityTolerance = 0.01;

struct BlockAssignment {
  int max_runs = 1;                          // most separate runs of consecutive blocks on one rank; 1 = contiguous
  std::vector<std::vector<int32_t>> blocks;  // [P][m]: row blocks each rank holds, ascending
  std::vector<int64_t> work;                 // [P]: the sum of its blocks' work
};

// Deals n = P * m blocks to P ranks, m each, minimising the largest per-rank sum of block_work ([n], >= 0).
BlockAssignment assign_blocks(const std::vector<int64_t>& block_work, int P);

struct BalancedShard {
  ShardMap map;                // scheme Balanced; L is a multiple of `block`; each rank's positions ascending
  std::vector<int64_t> work;   // [P]: predicted work (mask area summed over the mix and the B rows)
  double imbalance = 1.0;      // max / mean of work
  int max_runs = 1;            // most separate runs on one rank (each needs its own sliding-window halo)
};

// rows: [B, S]. L = ceil(S / P) rounded up to a multiple of `block`; the row is padded to P * L.
BalancedShard balanced_shard(const TokenMeta* rows, int B, int S, int P, const LayerMix& mix,
                             int block = kPlanBlock);

// The map of a scheme named on a command line: contiguous | zigzag (make_shard_map, L a multiple of `multiple`)
// | balanced | auto. auto is balanced: on the mix's predicted work it is never worse than contiguous or zigzag
// laid out on the same blocks (both lie in its search), and it stays contiguous where that is balanced already.
// rows: [B, S].
ShardMap shard_map_for(const std::string& scheme, const TokenMeta* rows, int B, int S, int P, const LayerMix& mix,
                       int multiple = 1);

// The map alone (what make_shard_map gives for the other schemes).
inline ShardMap balanced_shard_map(const TokenMeta* rows, int B, int S, int P, const LayerMix& mix,
                                   int block = kPlanBlock) {
  return balanced_shard(rows, B, S, P, mix, block).map;
}

}  // namespace rf::cp
