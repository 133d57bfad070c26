// ringflex cp: pieces shared by the ring and all-gather algorithms (not a public header). The dispatcher
// (cp_attention.cpp) agrees on the header and calls one algorithm body; the bodies live in ring.cpp and
// allgather.cpp, the ring's two ways of moving keys in planned_ring.cpp and chunk_ring.cpp (ring_transport.h).
#pragma once

#include <chrono>
#include <cstdint>
#include <vector>

#include "comm/communicator.h"
#include "cp/cp_attention.h"
#include "cp/work.h"

namespace rf::cp::detail {

// Message tags: one band per ring step, one slot per kind of message in the step.
enum class MsgKind : int { KeyValue = 0, Gradient = 1, ReduceScatter = 2 };
constexpr int kKindsPerStep = 3;
inline int tag(int step, MsgKind kind) { return step * kKindsPerStep + static_cast<int>(kind); }

enum class Pass : int32_t { Forward = 0, Backward = 1 };

// Every rank validates its inputs, then all ranks allgather a small header and compare it with rank 0's, so an
// invalid or mismatched input fails on every rank with the same line. `outputs_ok` is false when a caller's buffer
// is missing (reported the same way). Returns the resolved scale. agree_header.cpp.
float agree_header(comm::Communicator& comm, const CpShard& x, const CpParams& p, Pass pass, bool outputs_ok);

// Bookkeeping for CpStats: bytes held (peak), bytes moved, time in kernels.
class Ledger {
 public:
  explicit Ledger(CpStats* stats) : stats_(stats), start_(Clock::now()) {}
  void hold(int64_t bytes) {
    held_ += bytes;
    if (stats_ && held_ > stats_->peak_attention_bytes) stats_->peak_attention_bytes = held_;
  }
  void sent(int64_t bytes) {
    if (stats_) stats_->bytes_sent += bytes;
  }
  void received(int64_t bytes) {
    if (stats_) stats_->bytes_received += bytes;
  }
  bool counting() const { return stats_ != nullptr; }
  void add_work(int64_t pairs) {
    if (stats_) {
      stats_->work += pairs;
      ++stats_->chunks_computed;
    }
  }
  // Runs fn and charges its time to compute.
  template <typename Fn>
  void compute(Fn&& fn) {
    const auto t0 = Clock::now();
    fn();
    if (stats_) stats_->compute_seconds += seconds(Clock::now() - t0);
  }
  void finish() {
    if (stats_) stats_->wall_seconds = seconds(Clock::now() - start_);
  }

 private:
  using Clock = std::chrono::steady_clock;
  static double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
  CpStats* stats_;
  Clock::time_point start_;
  int64_t held_ = 0;
};

// What the ring (ring.cpp) does with the keys of one step, whichever transport brought them; ring_common.cpp.

// Forward: merges every computed step into the shard's o: [B, Hq, L, D] and lse: [B, Hq, L] (log-sum-exp),
// in the order the steps are added. The first step writes o/lse directly; later steps run one (row, kv head) at a
// time into a partial of that group's G = Hq/Hkv query heads, [G, L, D] and [G, L], merged by LSE. Merging group
// by group keeps the partial at 1/(B*Hkv) of the output while the kernel still reads each K/V tile once for all G
// heads that share it (splitting further, per query head, measured 2x slower under GQA 8:1).
class ForwardMerge {
 public:
  // Sets o to 0 and lse to -inf (the merge's identity) and charges them to the ledger.
  ForwardMerge(const CpShard& x, const LayerMask& mask, float scale, float* o, float* lse, Ledger& ledger);
  // Attends this rank's queries to one step's n keys and merges the result. k, v: [B, Hkv, n, D] in the shard's
  // dtype; k_meta: [B, n].
  void add(const void* k, const void* v, const TokenMeta* k_meta, int n);

 private:
  const CpShard& x_;
  const LayerMask& mask_;
  float scale_;
  float* o_;
  float* lse_;
  Ledger& ledger_;
  std::vector<float> part_o_, part_lse_;  // [G, L, D], [G, L]: allocated at the second computed step
  bool first_ = true;
};

// Waits for `req` if a transfer is in flight and releases it; returns whether there was one. The backward passes
// finish step t's gradient send and receive with it at the end of step t+1.
inline bool finish_transfer(comm::RequestPtr& req, comm::Timeout timeout) {
  if (!req) return false;
  req->wait(timeout);
  req.reset();
  return true;
}

// Backward's common start: returns delta [B, Hq, L] = rowsum(dout * o) from the merged o, and zeroes
// dq: [B, Hq, L, D], dk, dv: [B, Hkv, L, D]; charges delta and the three gradients to the ledger.
std::vector<float> start_backward(const CpShard& x, const float* o, const void* dout, float* dq, float* dk, float* dv,
                                  Ledger& ledger);

// Algorithm bodies, called after the header agreement. The ring moves keys as p.traffic says (ring_transport.h).
void ring_forward(comm::Communicator& comm, const CpShard& x, const CpParams& p, float scale, float* o, float* lse,
                  Ledger& ledger);
void ring_backward(comm::Communicator& comm, const CpShard& x, const CpParams& p, float scale, const float* o,
                   const float* lse, const void* dout, float* dq, float* dk, float* dv, Ledger& ledger);
void allgather_forward(comm::Communicator& comm, const CpShard& x, const CpParams& p, float scale, float* o, float* lse,
                       Ledger& ledger);
void allgather_backward(comm::Communicator& comm, const CpShard& x, const CpParams& p, float scale, const float* o,
                        const float* lse, const void* dout, float* dq, float* dk, float* dv, Ledger& ledger);

}  // namespace rf::cp::detail
