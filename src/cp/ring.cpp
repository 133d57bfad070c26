// ringflex cp: the ring, forward and backward — one loop for both traffics (design in cp_attention.h; how keys
// move in ring_transport.h).
//
// Ranks first agree on the batch's communication plan (one allgather of block summaries, or a plan the caller built
// once for all layers). Then at step t in [0, P) rank r
//   complete  waits for step t's transfers (posted one step earlier), so step t's keys are here;
//   post      posts step t+1's transfers, which run while step t computes;
//   compute   attends its queries to step t's keys, if any (the own chunk at t = 0, then owners r-1, r-2, ...),
//             merging partials by LSE in that fixed order.
// Backward repeats the forward's transfers, recomputes scores from the merged LSE, keeps dQ local, and returns the
// float32 dK/dV of exactly the keys a step computed against, compacted, directly to their owner. The owner adds
// them into its dK/dV in step order (own, then from r+1, r+2, ...), so gradients are deterministic bits; step t's
// gradient transfers are waited for at the end of step t+1, which hides them behind that step's compute.
#include <algorithm>
#include <array>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "cp/plan.h"
#include "cp/ring_transport.h"
#include "cpu/attention.h"

namespace rf::cp::detail {
namespace {

// The plan this call runs with: the caller's (checked to fit this shard), or one built now from every rank's
// block summaries.
struct PlanRef {
  std::unique_ptr<CommPlan> owned;
  const MaskCommPlan* mask_plan = nullptr;
};

PlanRef acquire_plan(comm::Communicator& comm, const CpShard& x, const CpParams& p) {
  const PlanGeometry g{comm.size(), x.shape.B, x.shape.Lq, kPlanBlock};
  PlanRef ref;
  if (p.plan) {
    const PlanGeometry& pg = p.plan->geometry;
    RF_CHECK(pg.P == g.P && pg.B == g.B && pg.L == g.L && pg.block == kPlanBlock, "the given CP plan is for P = ", pg.P,
             ", B = ", pg.B, ", L = ", pg.L, ", block = ", pg.block, ", this call has P = ", g.P, ", B = ", g.B,
             ", L = ", g.L, ", block = ", kPlanBlock);
    ref.mask_plan = &p.plan->for_mask(p.mask);
    return ref;
  }
  ref.owned = std::make_unique<CommPlan>(make_comm_plan(comm, x.meta, g, {{p.mask, 1}}, p.timeout));
  ref.mask_plan = &ref.owned->masks.front();
  return ref;
}

// The one place a RingTraffic becomes a transport.
std::unique_ptr<KvTransport> make_transport(comm::Communicator& comm, const CpShard& x, const CpParams& p,
                                            const MaskCommPlan& plan, Ledger& ledger) {
  switch (p.traffic) {
    case RingTraffic::Planned:
      return make_planned_transport(comm, x, plan, p.timeout, ledger);
    case RingTraffic::Chunks:
      return make_chunk_transport(comm, x, plan, p.timeout, ledger);
  }
  fail("unknown ring traffic ", static_cast<int>(p.traffic));
}

}  // namespace

void ring_forward(comm::Communicator& comm, const CpShard& x, const CpParams& p, float scale, float* o, float* lse,
                  Ledger& ledger) {
  const PlanRef plan = acquire_plan(comm, x, p);
  const int P = comm.size();
  ForwardMerge merged(x, p.mask, scale, o, lse, ledger);
  const std::unique_ptr<KvTransport> kv = make_transport(comm, x, p, *plan.mask_plan, ledger);
  for (int t = 0; t < P; ++t) {
    if (t > 0) kv->complete();  // step t's keys are here; step t's sends have left
    kv->post(t + 1);            // step t+1's transfers run while step t computes
    const StepKeys keys = kv->keys(t);
    if (keys.n > 0) merged.add(keys.k, keys.v, keys.meta, keys.n);
  }
}

void ring_backward(comm::Communicator& comm, const CpShard& x, const CpParams& p, float scale, const float* o,
                   const float* lse, const void* dout, float* dq, float* dk, float* dv, Ledger& ledger) {
  const PlanRef plan = acquire_plan(comm, x, p);
  const int P = comm.size(), r = comm.rank();
  const int B = x.shape.B, Hkv = x.shape.Hkv, L = x.shape.Lk, D = x.shape.D;
  const auto f32_bytes = [](int64_t n) { return n * static_cast<int64_t>(sizeof(float)); };
  const std::vector<float> delta = start_backward(x, o, dout, dq, dk, dv, ledger);  // [B, Hq, L]
  const std::unique_ptr<KvTransport> kv = make_transport(comm, x, p, *plan.mask_plan, ledger);

  // Gradient traffic, double-buffered by step parity. contrib: this rank's dK/dV for the keys it computed against
  // at a step, [2, B, Hkv, n, D], on its way back to their owner; incoming: dK/dV for this rank's keys lent at a
  // step, compacted the same way. Both are sized once for the most any step moves.
  struct GradSlot {
    std::vector<float> g;  // dk then dv
    int n = 0;
    comm::RequestPtr req;
  };
  std::array<GradSlot, 2> contrib, incoming;
  const int64_t most_elems = int64_t{B} * Hkv * kv->most_tokens() * D;
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
    add_gradient(in, kv->lent_ranges(t));
  };

  for (int t = 0; t < P; ++t) {
    if (t > 0) kv->complete();
    kv->post(t + 1);
    // The dK/dV that ring_dest(r, t) computes now for the keys this rank lent it at step t.
    int n_lent = 0;
    if (t > 0)
      for (const TokenRange& range : kv->lent_ranges(t)) n_lent += range.size();
    if (n_lent > 0) {
      const int helper = ring_dest(r, t, P);
      GradSlot& in = incoming[t % 2];
      ensure(in, n_lent);
      const size_t bytes = static_cast<size_t>(f32_bytes(int64_t{B} * Hkv * n_lent * D));
      const std::array<comm::RecvBuffer, 2> bufs{{{in.g.data(), bytes}, {in.g.data() + bytes / sizeof(float), bytes}}};
      in.req = comm.irecv(helper, tag(t, MsgKind::Gradient), bufs, concat("dK/dV for our keys from ring step ", t));
      ledger.received(2 * static_cast<int64_t>(bytes));
    }
    const StepKeys keys = kv->keys(t);
    if (keys.n > 0) {
      if (ledger.counting()) ledger.add_work(count_allowed_pairs(p.mask, x.meta, keys.meta, B, x.shape.Lq, keys.n));
      AttnChunk c{x.shape, x.dtype, x.q, keys.k, keys.v, x.meta, keys.meta, p.mask, scale};
      c.shape.Lk = keys.n;
      if (t == 0) {
        ledger.compute([&] { cpu::attention_backward(c, dout, lse, delta.data(), dq, dk, dv); });
      } else {
        GradSlot& out = contrib[t % 2];
        ensure(out, keys.n);
        const int64_t half = int64_t{B} * Hkv * keys.n * D;
        ledger.compute([&] {
          std::fill(out.g.begin(), out.g.begin() + 2 * half, 0.f);
          cpu::attention_backward(c, dout, lse, delta.data(), dq, out.g.data(), out.g.data() + half);
        });
        const size_t bytes = static_cast<size_t>(f32_bytes(half));
        const std::array<comm::SendBuffer, 2> bufs{{{out.g.data(), bytes}, {out.g.data() + half, bytes}}};
        const int owner = ring_source(r, t, P);
        out.req =
            comm.isend(owner, tag(t, MsgKind::Gradient), bufs, concat("dK/dV of ring step ", t, " to rank ", owner));
        ledger.sent(2 * static_cast<int64_t>(bytes));
      }
    }
    if (t > 0) finish_gradients(t - 1);
  }
  finish_gradients(P - 1);
}

}  // namespace rf::cp::detail
