// ringflex cp: the mask-aware communication plan of ring attention (docs/spec.md §6: work and traffic follow the mask).
// In src/cp, "plan" means this and nothing else; `ringflex plan` prints it (src/report).
//
// A full ring moves every chunk past every rank even when the mask uses none of it. The plan is computed once per
// batch, identically and deterministically on every rank, from the one thing ranks exchange up front: a summary of
// every block of `block` tokens of every rank's shard (a contiguous [P, B, nb] BlockSummary buffer, one small
// allgather). For each distinct layer mask it classifies every (query block of r, key block of s) pair with
// rf::classify, and from that derives what each receiver needs from each sender, as token ranges of the sender's
// shard at block granularity:
//   - a sliding layer pulls only the halo of W - 1 tokens before each of its runs (from several ranks when W > L),
//   - a causal contiguous shard never receives a later rank's keys,
//   - an image group crossing a shard boundary pulls that group's blocks, packed short documents almost nothing.
// Layers that share a mask share its MaskCommPlan.
//
// Schedule. With direct sends, at ring step t in [1, P) rank r receives from (r - t) mod P and sends to
// (r + t) mod P, so every ordered (sender, receiver) pair meets exactly once. A step whose transfer is empty is
// skipped (no message, no compute). In the backward pass the same transfers repeat, and the dK/dV partials of
// exactly the received ranges go back from receiver to sender in the reverse direction: a received block always has
// at least one non-empty pair, so those are all the partials that can be non-zero, and nothing else travels.
#pragma once

#include <cstdint>
#include <vector>

#include "comm/communicator.h"
#include "core/error.h"
#include "core/mask.h"
#include "cp/shard.h"
#include "cp/work.h"

namespace rf::cp {

// 64 tokens: a halo overshoots the window by less than one block, and the P^2 * (L / block)^2 classifications per
// mask stay near 2.6e5 per row at S = 32K for any P, which takes milliseconds.
constexpr int kPlanBlock = 64;

struct PlanGeometry {
  int P = 1;
  int B = 1;  // rows of the batch; they share one shard map, so a chunk carries all B rows' tokens
  int L = 0;  // tokens per rank
  int block = kPlanBlock;

  int blocks() const { return (L + block - 1) / block; }  // nb per rank; the last block is short when block ∤ L
};

// A rank's contribution to the plan: summaries of its shard's blocks. meta: [B, L] in local order; returns
// [B, nb]. BlockSummary is plain int32 data, so the P contributions concatenated in rank order ([P, B, nb]) are
// the receive buffer of one allgather.
std::vector<BlockSummary> summarize_shard(const TokenMeta* meta, const PlanGeometry& g);

// Every rank's summaries at once, [P, B, nb]: what the allgather yields, for single-process callers (the CLI,
// tests, benchmarks). rows: [B, map.S].
std::vector<BlockSummary> summarize_all_shards(const TokenMeta* rows, int B, const ShardMap& map, int block);

// [begin, end) positions in the sender's local (shard) order.
struct TokenRange {
  int32_t begin = 0;
  int32_t end = 0;

  int32_t size() const { return end - begin; }
  bool operator==(const TokenRange&) const = default;
};

inline int ring_source(int r, int t, int P) { return (r - t + P) % P; }  // who r receives from at step t
inline int ring_dest(int r, int t, int P) { return (r + t) % P; }        // whom r sends to at step t

// The plan of one layer mask.
struct MaskCommPlan {
  LayerMask mask;
  int layers = 0;  // layers of the mix that use this mask
  PlanGeometry geometry;
  std::vector<BlockClass> classes;              // [P recv, P send, B, nb q, nb k]; recv == send is the local chunk
  std::vector<uint8_t> needed;                  // [P recv, P send, nb k]: 1 if any row has a non-empty pair
  std::vector<std::vector<TokenRange>> ranges;  // [P recv * P send]: needed blocks as merged token ranges

  BlockClass pair_class(int r, int s, int b, int i, int j) const;
  bool needs_block(int r, int s, int j) const;
  // What r receives from s (and, in backward, returns dK/dV for). Empty for s == r: the local chunk never travels.
  const std::vector<TokenRange>& recv_ranges(int r, int s) const;
  int64_t recv_tokens(int r, int s) const;
  int64_t recv_tokens(int r) const;  // from all other ranks
  bool receives_at(int r, int t) const { return recv_tokens(r, ring_source(r, t, geometry.P)) > 0; }
  bool sends_at(int r, int t) const { return recv_tokens(ring_dest(r, t, geometry.P), r) > 0; }
  // Steps t in [1, P) at which r receives nothing, so computes nothing remote for this mask.
  int skipped_steps(int r) const;
};

struct CommPlan {
  PlanGeometry geometry;
  std::vector<MaskCommPlan> masks;  // one per distinct mask of the mix, in mix order

  const MaskCommPlan& for_mask(const LayerMask& m) const;  // throws rf::Error when m is not in the mix
};

// summaries: [P, B, nb] (summarize_shard of every rank, in rank order). Deterministic: the same inputs give the
// same plan on every rank.
CommPlan plan_from_summaries(const PlanGeometry& g, const BlockSummary* summaries, const LayerMix& mix);

// The plan as the ranks of a CP call build it: one allgather of every rank's summaries (of meta, this rank's
// shard [B, g.L]), then plan_from_summaries on the identical [P, B, nb] buffer. Collective over `comm` (g.P = its
// size).
CommPlan make_comm_plan(comm::Communicator& comm, const TokenMeta* meta, const PlanGeometry& g, const LayerMix& mix,
                        comm::Timeout timeout);

// Shapes of what travels: K and V of Hkv heads of D elements of elem_bytes each, per token per row.
struct KvFormat {
  int Hkv = 1;
  int D = 1;
  int elem_bytes = 2;
};

// Bytes of K and V for `tokens` tokens of each of B rows (metadata, 12 bytes a token, not included). Throws
// rf::Error when the product does not fit int64 (a report must never show a wrapped, negative byte count).
inline int64_t kv_bytes(int64_t tokens, int B, const KvFormat& f) {
  constexpr int kTensorsPerToken = 2;  // K and V
  int64_t bytes = tokens;
  for (const int64_t factor :
       {int64_t{B}, int64_t{f.Hkv}, int64_t{f.D}, int64_t{kTensorsPerToken}, int64_t{f.elem_bytes}}) {
    RF_CHECK(!__builtin_mul_overflow(bytes, factor, &bytes), "K/V bytes of ", tokens, " tokens x ", B, " rows x ",
             f.Hkv, " heads x ", f.D, " dims x ", kTensorsPerToken, " x ", f.elem_bytes,
             " bytes overflow a 64-bit count");
  }
  return bytes;
}

// Bytes plan_from_summaries allocates for geometry g and `mask_kinds` distinct masks: per mask the block classes
// [P, P, B, nb, nb], the needed flags [P, P, nb] and P * P range lists (each at most nb ranges). A caller checks
// it against the machine's memory before planning for a large P: the plan grows with P^2. -1 when it overflows.
inline int64_t plan_bytes(const PlanGeometry& g, int mask_kinds) {
  const int64_t nb = g.blocks();
  const int64_t per_pair = int64_t{g.B} * nb * nb * static_cast<int64_t>(sizeof(BlockClass)) + nb +
                           static_cast<int64_t>(sizeof(std::vector<TokenRange>)) +
                           nb * static_cast<int64_t>(sizeof(TokenRange));
  int64_t bytes = per_pair;
  for (const int64_t factor : {int64_t{g.P}, int64_t{g.P}, int64_t{mask_kinds}}) {
    if (__builtin_mul_overflow(bytes, factor, &bytes)) return -1;
  }
  return bytes;
}

}  // namespace rf::cp
