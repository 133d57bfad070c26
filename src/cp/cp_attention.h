// ringflex cp: context-parallel masked attention over P ranks, forward and backward (docs/spec.md §6).
//
// Each rank holds one shard of the row (cp/shard.h): its queries, keys, values and their token metadata, L tokens
// per rank. Two algorithms give the same result to float32 rounding:
//
//   ring       K, V and metadata travel between ranks while the keys in hand are computed. Before the first step
//              the ranks build one shared communication plan (cp/plan.h) from an allgather of per-block metadata
//              summaries: which token ranges of which rank each rank's queries may read (rf::classify). Step t
//              computes the keys of rank r-t; the transfer for step t+1 is posted before the step-t compute and
//              completed after it, into the other of two receive slots, so a rank holds at most three K/V chunks
//              (its own, the one computed, the one arriving) plus float32 accumulators, whatever P is. Per-step
//              partials are merged by rf::merge_partial in a fixed order (own chunk first). Keys move only as
//              far as their readers (causal contiguous shards never send keys "backwards"; sliding windows move
//              only their halo), and a step with nothing to read costs no message and no compute.
//   allgather  every rank gathers all K/V and metadata (P chunks held at once), computes locally, and the dK/dV
//              partials are reduce-scattered (summed in rank order). The seed's first design, kept to compare.
//
// Backward recomputes scores from the saved (merged) LSE, flash-attention style; dQ stays local. Each chunk's
// dK/dV contribution (float32) is sent *directly* to its owner right after it is computed, rather than travelling
// on with the chunk: every contribution then makes one hop, the K/V ring stays identical to the forward's (the
// same sends, posted before compute), and a contribution from a rank that does not need the chunk is never sent.
// The owner adds contributions in step order (own chunk, then from r+1, r+2, ...), so gradients are
// deterministic bits, and equal P = 1 to float32 rounding. An owner waits for step s's contribution only at the
// end of step s+1, which hides its transfer behind the next compute.
//
// Every call first agrees on a header (shapes, dtype, mask, scale, scheme, algorithm) with one allgather; if any
// rank's inputs are invalid or differ, every rank throws the same one-line rf::Error. Every wait has the
// params' deadline; a timeout names the peer and step.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "comm/communicator.h"
#include "core/attention_args.h"
#include "cp/shard.h"

namespace rf::cp {

enum class Algo { Ring, AllGather };
std::string algo_name(Algo a);
Algo parse_algo(const std::string& name);  // "ring" | "allgather"; throws rf::Error naming the bad value

// What one call did on this rank (filled when CpParams::stats is set).
struct CpStats {
  int64_t peak_attention_bytes = 0;  // K/V chunks held at once (own + received) + float32 accumulators/partials
  int64_t bytes_sent = 0, bytes_received = 0;
  int64_t work = 0;            // allowed (query, key) pairs this rank computed, summed over rows (times Hq = scores)
  int chunks_computed = 0;     // ring steps (or 1 for allgather) that ran a kernel
  double compute_seconds = 0;  // inside attention kernels and merges
  double wall_seconds = 0;     // the whole call, header agreement included
};

// How Algo::Ring moves keys and values (cp/ring_transport.h); one ring loop (ring.cpp) runs either.
//   Planned  each rank receives, directly from the owner, only the token ranges of each shard its queries may
//            read (planned_ring.cpp): halos for sliding windows, nothing for later causal shards.
//   Chunks   the baseline: whole chunks hop rank to rank as far as their last reader (chunk_ring.cpp).
// Both give the same bits; Chunks stays to measure Planned against.
enum class RingTraffic { Planned, Chunks };

struct CommPlan;  // cp/plan.h

struct CpParams {
  LayerMask mask;
  std::optional<float> scale;  // unset: 1/sqrt(D); any finite value, 0 included, is used as it is
  Algo algo = Algo::Ring;
  Scheme scheme = Scheme::Contiguous;  // only agreed on, so ranks sharded with different schemes fail together
  comm::Timeout timeout = comm::default_timeout();
  CpStats* stats = nullptr;  // optional
  RingTraffic traffic = RingTraffic::Planned;
  // Optional: the batch's plan, built once for all of the model's layer masks (make_comm_plan) so layers that
  // share a mask share it; it must contain `mask`. Null: the ring builds one for `mask` (one allgather).
  const CommPlan* plan = nullptr;
};

// This rank's shard (core/attention_args.h): shape.Lq == shape.Lk == L (the shard length, equal on every rank).
using CpShard = AttnShard;

// o: [B, Hq, L, D] float32, lse: [B, Hq, L] float32 (-inf and o = 0 where a query sees nothing).
void cp_attention_forward(comm::Communicator& comm, const CpShard& x, const CpParams& p, float* o, float* lse);

// o, lse: the forward's outputs; dout: [B, Hq, L, D] in x.dtype. Writes (not accumulates) float32
// dq: [B, Hq, L, D]; dk, dv: [B, Hkv, L, D] for this rank's own keys, summed over every rank's queries.
void cp_attention_backward(comm::Communicator& comm, const CpShard& x, const CpParams& p, const float* o,
                           const float* lse, const void* dout, float* dq, float* dk, float* dv);

}  // namespace rf::cp
