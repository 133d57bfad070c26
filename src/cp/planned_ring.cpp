// ringflex cp: the planned ring, forward and backward — the ring whose traffic follows the mask (cp/plan.h).
//
// Ranks first agree on the batch's plan (one allgather of block summaries, or a plan the caller built once for
// all layers). Then at step t in [1, P) rank r receives from src = r - t exactly the token ranges of src's shard
// its queries may read, and sends dst = r + t the ranges dst needs from it: every transfer is one direct hop from
// the owner, a sliding layer moves only its halo, and a step with nothing to move costs no message and no
// compute. Received ranges land compacted, [B, Hkv, n, D], and the kernel runs on those n keys.
//
// Like the chunk ring (ring.cpp) it holds the own chunk plus two receive slots (the step computed and the step
// arriving), posts step t+1's transfers before computing step t, and merges partials in the same order (own
// chunk, then r-1, r-2, ...). The plan's block (64 tokens) is the kernels' key tile and ranges start on block
// boundaries, so the compacted chunk's tiles are the chunk ring's tiles minus tiles no query of this rank reads:
// the kernels skip those anyway, and the results are the chunk ring's bits.
//
// Backward repeats the forward's transfers, computes dK/dV for exactly the received keys, and returns them
// (float32, compacted) directly to the owner, who adds them into its dK/dV in step order (own, r+1, r+2, ...).
// Sends are zero-copy: one buffer per (tensor, row, kv head, range), matched one to one by the receiver.
#include <algorithm>
#include <array>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "cp/cp_internal.h"
#include "cp/plan.h"
#include "cpu/attention.h"

namespace rf::cp::detail {
namespace {

// Received ranges start on plan-block boundaries; matching the kernels' key tile keeps their tiles aligned.
static_assert(kPlanBlock == cpu::kTileK, "the planned ring's bit-for-bit agreement needs plan blocks = key tiles");

// The plan this call runs with: the caller's (checked to fit this shard), or one built now from every rank's
// block summaries.
struct PlanRef {
  std::unique_ptr<Plan> owned;
  const MaskPlan* mask_plan = nullptr;
};

PlanRef acquire_plan(comm::Communicator& comm, const CpShard& x, const CpParams& p) {
  const PlanGeometry g{comm.size(), x.shape.B, x.shape.Lq, kPlanBlock};
  PlanRef ref;
  if (p.plan) {
    const PlanGeometry& pg = p.plan->geometry;
    RF_CHECK(pg.P == g.P && pg.B == g.B && pg.L == g.L && pg.block == kPlanBlock, "the given CP plan is for P = ",
             pg.P, ", B = ", pg.B, ", L = ", pg.L, ", block = ", pg.block, ", this call has P = ", g.P, ", B = ",
             g.B, ", L = ", g.L, ", block = ", kPlanBlock);
    ref.mask_plan = &p.plan->for_mask(p.mask);
    return ref;
  }
  ref.owned = std::make_unique<Plan>(make_comm_plan(comm, x.meta, g, {{p.mask, 1}}, p.timeout));
  ref.mask_plan = &ref.owned->masks.front();
  return ref;
}

// A received chunk: the ranges of one sender, compacted. k, v: [B, Hkv, n, D] in the input dtype; meta: [B, n].
struct Slot {
  std::vector<uint8_t> k, v;
  std::vector<TokenMeta> meta;
  int n = 0;
};

class PlannedRing {
 public:
  PlannedRing(comm::Communicator& comm, const CpShard& x, const MaskPlan& plan, comm::Timeout timeout, Ledger& ledger)
      : comm_(comm), x_(x), plan_(plan), timeout_(timeout), ledger_(ledger), P_(comm.size()), r_(comm.rank()),
        row_bytes_(static_cast<size_t>(x.shape.D) * dtype_size(x.dtype)) {
    ledger_.hold(static_cast<int64_t>(2 * kv_bytes(x.shape.Lk) + meta_bytes(x.shape.Lk)));  // the own chunk
  }

  int source(int t) const { return ring_source(r_, t, P_); }
  int dest(int t) const { return ring_dest(r_, t, P_); }
  // Tokens this rank receives at step t (its own L at step 0).
  int tokens_in(int t) const { return t == 0 ? x_.shape.Lk : static_cast<int>(plan_.recv_tokens(r_, source(t))); }

  // Step t's keys: the own chunk, or the compacted ranges received from source(t).
  const Slot* slot(int t) const { return t == 0 ? nullptr : &slots_[t % 2]; }

  // Posts step t's transfers: receive from source(t), send to dest(t), each only if the plan moves anything.
  void post(int t) {
    if (t <= 0 || t >= P_) return;
    const std::vector<TokenRange>& in = plan_.recv_ranges(r_, source(t));
    if (!in.empty()) {
      Slot& s = slots_[t % 2];
      s.n = static_cast<int>(plan_.recv_tokens(r_, source(t)));
      ensure(s);
      std::vector<comm::RecvBuffer> bufs;
      for_each_piece(in, s.n, [&](const Piece& pc) {
        bufs.push_back({s.k.data() + pc.dst_kv, pc.kv_bytes});
        bufs.push_back({s.v.data() + pc.dst_kv, pc.kv_bytes});
      }, [&](int b, int offset, const TokenRange& range) {
        bufs.push_back({s.meta.data() + static_cast<size_t>(b) * s.n + offset, range.size() * sizeof(TokenMeta)});
      });
      recv_ = comm_.irecv(source(t), tag(t, MsgKind::KeyValue), bufs, label(t, source(t)));
      ledger_.received(static_cast<int64_t>(2 * kv_bytes(s.n) + meta_bytes(s.n)));
    }
    const std::vector<TokenRange>& out = plan_.recv_ranges(dest(t), r_);
    if (!out.empty()) {
      const int n = static_cast<int>(plan_.recv_tokens(dest(t), r_));
      std::vector<comm::SendBuffer> bufs;
      const auto* k = static_cast<const uint8_t*>(x_.k);
      const auto* v = static_cast<const uint8_t*>(x_.v);
      for_each_piece(out, n, [&](const Piece& pc) {
        bufs.push_back({k + pc.src_kv, pc.kv_bytes});
        bufs.push_back({v + pc.src_kv, pc.kv_bytes});
      }, [&](int b, int, const TokenRange& range) {
        bufs.push_back({x_.meta + static_cast<int64_t>(b) * x_.shape.Lk + range.begin, range.size() * sizeof(TokenMeta)});
      });
      send_ = comm_.isend(dest(t), tag(t, MsgKind::KeyValue), bufs, label(t, r_));
      ledger_.sent(static_cast<int64_t>(2 * kv_bytes(n) + meta_bytes(n)));
    }
  }

  void complete() {
    std::array<comm::RequestPtr, 2> reqs{std::move(recv_), std::move(send_)};
    comm::wait_all(reqs, timeout_);
  }

  // One (row, kv head, range) piece of a transfer: byte offsets in the owner's [B, Hkv, L, D] and in the
  // compacted [B, Hkv, n, D] layouts.
  struct Piece {
    size_t src_kv, dst_kv, kv_bytes;
  };

  // Calls kv(piece) for every (b, h, range) in row-major order, then meta(b, offset in the compacted row, range)
  // for every (b, range): the order both sides of a transfer list their buffers in.
  template <typename KvFn, typename MetaFn>
  void for_each_piece(const std::vector<TokenRange>& ranges, int n, KvFn kv, MetaFn meta) const {
    const int L = x_.shape.Lk;
    for (int b = 0; b < x_.shape.B; ++b)
      for (int h = 0; h < x_.shape.Hkv; ++h) {
        const size_t bh = static_cast<size_t>(b) * x_.shape.Hkv + h;
        int offset = 0;
        for (const TokenRange& range : ranges) {
          kv(Piece{(bh * L + range.begin) * row_bytes_, (bh * n + offset) * row_bytes_, range.size() * row_bytes_});
          offset += range.size();
        }
      }
    for (int b = 0; b < x_.shape.B; ++b) {
      int offset = 0;
      for (const TokenRange& range : ranges) {
        meta(b, offset, range);
        offset += range.size();
      }
    }
  }

 private:
  size_t kv_bytes(int n) const { return static_cast<size_t>(x_.shape.B) * x_.shape.Hkv * n * row_bytes_; }
  size_t meta_bytes(int n) const { return static_cast<size_t>(x_.shape.B) * n * sizeof(TokenMeta); }

  // A slot is sized once for the most any step brings, so the ledger counts two receive slots at most.
  void ensure(Slot& s) {
    if (!s.k.empty()) return;
    int most = 0;
    for (int t = 1; t < P_; ++t) most = std::max(most, tokens_in(t));
    s.k.resize(kv_bytes(most));
    s.v.resize(kv_bytes(most));
    s.meta.resize(static_cast<size_t>(x_.shape.B) * most);
    ledger_.hold(static_cast<int64_t>(2 * kv_bytes(most) + meta_bytes(most)));
  }

  std::string label(int t, int owner) const { return concat("K/V ranges of rank ", owner, " for planned step ", t); }

  comm::Communicator& comm_;
  const CpShard& x_;
  const MaskPlan& plan_;
  comm::Timeout timeout_;
  Ledger& ledger_;
  int P_, r_;
  size_t row_bytes_;  // one token of one kv head: D elements
  std::array<Slot, 2> slots_;
  comm::RequestPtr recv_, send_;
};

}  // namespace

void planned_ring_forward(comm::Communicator& comm, const CpShard& x, const CpParams& p, float scale, float* o,
                          float* lse, Ledger& ledger) {
  const PlanRef plan = acquire_plan(comm, x, p);
  const int P = comm.size();
  ForwardMerge merged(x, p.mask, scale, o, lse, ledger);
  PlannedRing ring(comm, x, *plan.mask_plan, p.timeout, ledger);
  for (int t = 0; t < P; ++t) {
    if (t > 0) ring.complete();  // step t's keys are here; step t's send has left
    ring.post(t + 1);            // step t+1's transfers run while step t computes
    if (ring.tokens_in(t) == 0) continue;
    if (const Slot* s = ring.slot(t)) {
      merged.add(s->k.data(), s->v.data(), s->meta.data(), s->n);
    } else {
      merged.add(x.k, x.v, x.meta, x.shape.Lk);
    }
  }
}

void planned_ring_backward(comm::Communicator& comm, const CpShard& x, const CpParams& p, float scale,
                           const float* o, const float* lse, const void* dout, float* dq, float* dk, float* dv,
                           Ledger& ledger) {
  const PlanRef plan = acquire_plan(comm, x, p);
  const MaskPlan& mp = *plan.mask_plan;
  const int P = comm.size(), r = comm.rank();
  const int B = x.shape.B, Hkv = x.shape.Hkv, L = x.shape.Lk, D = x.shape.D;
  const auto f32_bytes = [](int64_t n) { return n * static_cast<int64_t>(sizeof(float)); };
  const std::vector<float> delta = start_backward(x, o, dout, dq, dk, dv, ledger);  // [B, Hq, L]

  // Gradient traffic, double-buffered by step parity. contrib: this rank's dK/dV for the keys it received at a
  // step, [2, B, Hkv, n, D], on its way back to their owner; incoming: dK/dV for this rank's keys computed by
  // dest(t), compacted the same way. Both are sized once for the most any step moves.
  struct GradSlot {
    std::vector<float> g;
    int n = 0;
    comm::RequestPtr req;
  };
  std::array<GradSlot, 2> contrib, incoming;
  int most = 0;
  for (int t = 1; t < P; ++t) {
    most = std::max(most, static_cast<int>(mp.recv_tokens(r, ring_source(r, t, P))));
    most = std::max(most, static_cast<int>(mp.recv_tokens(ring_dest(r, t, P), r)));
  }
  const int64_t most_elems = int64_t{B} * Hkv * most * D;
  const auto ensure = [&](GradSlot& slot, int n) {
    if (slot.g.empty()) {
      slot.g.resize(static_cast<size_t>(2 * most_elems));
      ledger.hold(2 * f32_bytes(most_elems));
    }
    slot.n = n;
  };
  // Scatter-adds a compacted [2, B, Hkv, n, D] gradient for `ranges` of this rank's keys into dk, dv.
  const auto add_gradient = [&](const GradSlot& in, const std::vector<TokenRange>& ranges) {
    const int64_t half = int64_t{B} * Hkv * in.n * D;
    for (int64_t bh = 0; bh < int64_t{B} * Hkv; ++bh) {
      int offset = 0;
      for (const TokenRange& range : ranges) {
        const int64_t src = (bh * in.n + offset) * D, dst = (bh * L + range.begin) * D;
        for (int64_t i = 0; i < int64_t{range.size()} * D; ++i) {
          dk[dst + i] += in.g[src + i];
          dv[dst + i] += in.g[half + src + i];
        }
        offset += range.size();
      }
    }
  };
  // Step t's gradient transfers finish at the end of step t+1, after that step's compute hid them.
  const auto finish_gradients = [&](int t) {
    finish_transfer(contrib[t % 2].req, p.timeout);
    GradSlot& in = incoming[t % 2];
    if (!finish_transfer(in.req, p.timeout)) return;
    add_gradient(in, mp.recv_ranges(ring_dest(r, t, P), r));
  };

  PlannedRing ring(comm, x, mp, p.timeout, ledger);
  for (int t = 0; t < P; ++t) {
    if (t > 0) ring.complete();
    ring.post(t + 1);
    // The dK/dV that dest(t) computes now for the keys we sent it at step t.
    const int helper = ring_dest(r, t, P);
    const int n_out = t > 0 ? static_cast<int>(mp.recv_tokens(helper, r)) : 0;
    if (n_out > 0) {
      GradSlot& in = incoming[t % 2];
      ensure(in, n_out);
      const size_t bytes = static_cast<size_t>(f32_bytes(int64_t{B} * Hkv * n_out * D));
      const std::array<comm::RecvBuffer, 2> bufs{{{in.g.data(), bytes}, {in.g.data() + bytes / sizeof(float), bytes}}};
      in.req = comm.irecv(helper, tag(t, MsgKind::Gradient), bufs, concat("dK/dV for our keys from planned step ", t));
      ledger.received(2 * static_cast<int64_t>(bytes));
    }
    const int n = ring.tokens_in(t);
    if (n > 0) {
      const Slot* s = ring.slot(t);
      if (ledger.counting()) ledger.add_work(count_allowed(p.mask, x.meta, s ? s->meta.data() : x.meta, B, L, n));
      if (t == 0) {
        ledger.compute([&] {
          const AttnChunk c{x.shape, x.dtype, x.q, x.k, x.v, x.meta, x.meta, p.mask, scale};
          cpu::attention_backward(c, dout, lse, delta.data(), dq, dk, dv);
        });
      } else {
        GradSlot& out = contrib[t % 2];
        ensure(out, n);
        const int64_t half = int64_t{B} * Hkv * n * D;
        ledger.compute([&] {
          std::fill(out.g.begin(), out.g.begin() + 2 * half, 0.f);
          AttnChunk c{x.shape, x.dtype, x.q, s->k.data(), s->v.data(), x.meta, s->meta.data(), p.mask, scale};
          c.shape.Lk = n;
          cpu::attention_backward(c, dout, lse, delta.data(), dq, out.g.data(), out.g.data() + half);
        });
        const size_t bytes = static_cast<size_t>(f32_bytes(half));
        const std::array<comm::SendBuffer, 2> bufs{{{out.g.data(), bytes}, {out.g.data() + half, bytes}}};
        const int owner = ring.source(t);
        out.req = comm.isend(owner, tag(t, MsgKind::Gradient), bufs,
                             concat("dK/dV of planned step ", t, " to rank ", owner));
        ledger.sent(2 * static_cast<int64_t>(bytes));
      }
    }
    if (t > 0) finish_gradients(t - 1);
  }
  finish_gradients(P - 1);
}

}  // namespace rf::cp::detail
