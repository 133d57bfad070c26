// ringflex cp: the ring algorithm, forward and backward (design in cp_attention.h).
//
// Step s on rank r holds the chunk owned by rank j = r - s (mod P). Each step runs three phases:
//   post     irecv step s+1's chunk from r-1 into the free slot; isend the chunk in hand to r+1 (both only when
//            the plan says the chunk travels that far);
//   compute  the step-s chunk, if this rank needs it (its transfers run meanwhile);
//   complete wait for both transfers; the received slot becomes the chunk in hand.
// A slot is reused as a receive target two steps after it was computed, by which time its send has completed.
#include <algorithm>
#include <array>
#include <string>

#include "core/error.h"
#include "cp/cp_internal.h"
#include "cpu/attention.h"

namespace rf::cp::detail {
namespace {

// One K/V chunk with its metadata as it travels: k, v: [B, Hkv, L, D] in the input dtype; meta: [B, L].
struct ChunkSlot {
  std::vector<uint8_t> k, v;
  std::vector<TokenMeta> meta;
};

struct ChunkView {
  const void* k;
  const void* v;
  const TokenMeta* meta;
};

// The K/V ring: the rank's own chunk plus two receive slots, allocated only if something is ever received.
class KvRing {
 public:
  KvRing(comm::Communicator& comm, const CpShard& x, const RingPlan& plan, comm::Timeout timeout, Ledger& ledger)
      : comm_(comm),
        x_(x),
        plan_(plan),
        timeout_(timeout),
        ledger_(ledger),
        P_(comm.size()),
        r_(comm.rank()),
        kv_bytes_(static_cast<size_t>(x.shape.kv_elems()) * dtype_size(x.dtype)),
        meta_count_(static_cast<size_t>(x.shape.B) * x.shape.Lk) {
    ledger_.hold(chunk_bytes());  // the own chunk
  }

  int owner(int s) const { return (r_ - s + P_) % P_; }
  // The step-s chunk is here when it is this rank's own or the plan sends it at least s steps.
  bool holds(int s) const { return s == 0 || plan_.hops[owner(s)] >= s; }

  ChunkView chunk(int s) const {
    if (s == 0) return {x_.k, x_.v, x_.meta};
    const ChunkSlot& c = slots_[s % 2];
    return {c.k.data(), c.v.data(), c.meta.data()};
  }

  // step s, post: bring step s+1's chunk from r-1, pass the step-s chunk on to r+1.
  void post(int s) {
    if (s + 1 >= P_) return;
    const int next = (r_ + 1) % P_, prev = (r_ - 1 + P_) % P_;
    if (holds(s + 1)) {
      ChunkSlot& c = slot(s + 1);
      const std::array<comm::RecvBuffer, 3> bufs{
          {{c.k.data(), kv_bytes_}, {c.v.data(), kv_bytes_}, {c.meta.data(), meta_count_ * sizeof(TokenMeta)}}};
      recv_ = comm_.irecv(prev, tag(s + 1, MsgKind::KeyValue), bufs, label(s + 1));
      ledger_.received(chunk_bytes());
    }
    if (plan_.hops[owner(s)] >= s + 1) {
      const ChunkView c = chunk(s);
      const std::array<comm::SendBuffer, 3> bufs{
          {{c.k, kv_bytes_}, {c.v, kv_bytes_}, {c.meta, meta_count_ * sizeof(TokenMeta)}}};
      send_ = comm_.isend(next, tag(s + 1, MsgKind::KeyValue), bufs, label(s + 1));
      ledger_.sent(chunk_bytes());
    }
  }

  // step s, complete: both transfers of post(s) are done.
  void complete() {
    std::array<comm::RequestPtr, 2> reqs{std::move(recv_), std::move(send_)};
    comm::wait_all(reqs, timeout_);
  }

 private:
  // One chunk's K, V and metadata: what each slot holds and each transfer moves.
  int64_t chunk_bytes() const { return static_cast<int64_t>(2 * kv_bytes_ + meta_count_ * sizeof(TokenMeta)); }

  std::string label(int s) const { return concat("K/V of rank ", owner(s), " for ring step ", s); }

  ChunkSlot& slot(int s) {
    ChunkSlot& c = slots_[s % 2];
    if (c.k.empty()) {
      c.k.resize(kv_bytes_);
      c.v.resize(kv_bytes_);
      c.meta.resize(meta_count_);
      ledger_.hold(chunk_bytes());
    }
    return c;
  }

  comm::Communicator& comm_;
  const CpShard& x_;
  const RingPlan& plan_;
  comm::Timeout timeout_;
  Ledger& ledger_;
  int P_, r_;
  size_t kv_bytes_;    // one of k, v: [B, Hkv, L, D] in the input dtype
  size_t meta_count_;  // meta: [B, L]
  std::array<ChunkSlot, 2> slots_;
  comm::RequestPtr recv_, send_;
};

AttnChunk make_chunk(const CpShard& x, const LayerMask& mask, float scale, const ChunkView& c) {
  return AttnChunk{x.shape, x.dtype, x.q, c.k, c.v, x.meta, c.meta, mask, scale};
}

}  // namespace

void ring_forward(comm::Communicator& comm, const CpShard& x, const CpParams& p, float scale, float* o, float* lse,
                  Ledger& ledger) {
  const RingPlan plan = plan_ring(comm, x, p.mask, p.timeout);
  const int P = comm.size(), r = comm.rank();
  ForwardMerge merged(x, p.mask, scale, o, lse, ledger);
  KvRing ring(comm, x, plan, p.timeout, ledger);
  for (int s = 0; s < P; ++s) {
    // step s, post: the transfer for step s+1 runs while this step computes.
    ring.post(s);
    // step s, compute: attend to the chunk of rank owner(s) if any of this rank's queries may see it; merge by LSE.
    if (ring.holds(s) && plan.needs(r, ring.owner(s))) {
      const ChunkView kv = ring.chunk(s);
      merged.add(kv.k, kv.v, kv.meta, x.shape.Lk);
    }
    // step s, complete: the chunk for step s+1 has arrived and ours has left.
    ring.complete();
  }
}

void ring_backward(comm::Communicator& comm, const CpShard& x, const CpParams& p, float scale, const float* o,
                   const float* lse, const void* dout, float* dq, float* dk, float* dv, Ledger& ledger) {
  const RingPlan plan = plan_ring(comm, x, p.mask, p.timeout);
  const int P = comm.size(), r = comm.rank();
  const int64_t kv = x.shape.kv_elems();
  const auto f32_bytes = [](int64_t n) { return n * static_cast<int64_t>(sizeof(float)); };
  const std::vector<float> delta = start_backward(x, o, dout, dq, dk, dv, ledger);  // [B, Hq, L]

  // Gradient traffic, double-buffered by step parity. contrib[i]: this rank's dK/dV for another rank's chunk,
  // in flight to its owner; incoming[i]: another rank's dK/dV for this rank's chunk. Each is [2, B, Hkv, L, D].
  struct GradSlot {
    std::vector<float> g;  // dk then dv
    comm::RequestPtr req;
  };
  std::array<GradSlot, 2> contrib, incoming;
  const auto ensure = [&](GradSlot& slot) {
    if (slot.g.empty()) {
      slot.g.resize(static_cast<size_t>(2 * kv));
      ledger.hold(2 * f32_bytes(kv));
    }
  };
  const auto grad_bytes = static_cast<size_t>(f32_bytes(kv));
  // Step t's gradient transfers are finished at the end of step t+1, after that step's compute hid them.
  const auto finish_gradients = [&](int t) {
    finish_transfer(contrib[t % 2].req, p.timeout);
    GradSlot& in = incoming[t % 2];
    if (!finish_transfer(in.req, p.timeout)) return;
    for (int64_t i = 0; i < kv; ++i) dk[i] += in.g[i];
    for (int64_t i = 0; i < kv; ++i) dv[i] += in.g[kv + i];
  };

  KvRing ring(comm, x, plan, p.timeout, ledger);
  for (int s = 0; s < P; ++s) {
    const int j = ring.owner(s);
    // step s, post: K/V for step s+1, and the receive of the dK/dV that rank r+s computes now for our chunk.
    ring.post(s);
    const int helper = (r + s) % P;
    if (s > 0 && plan.hops[r] >= s && plan.needs(helper, r)) {
      GradSlot& in = incoming[s % 2];
      ensure(in);
      const std::array<comm::RecvBuffer, 2> bufs{{{in.g.data(), grad_bytes}, {in.g.data() + kv, grad_bytes}}};
      in.req = comm.irecv(helper, tag(s, MsgKind::Gradient), bufs, concat("dK/dV for our chunk from ring step ", s));
      ledger.received(2 * f32_bytes(kv));
    }
    // step s, compute: recompute chunk j's scores from the merged LSE; dQ accumulates here, dK/dV go to j.
    if (ring.holds(s) && plan.needs(r, j)) {
      const AttnChunk c = make_chunk(x, p.mask, scale, ring.chunk(s));
      if (ledger.counting())
        ledger.add_work(count_allowed(p.mask, x.meta, c.k_meta, x.shape.B, x.shape.Lq, x.shape.Lk));
      if (s == 0) {
        ledger.compute([&] { cpu::attention_backward(c, dout, lse, delta.data(), dq, dk, dv); });
      } else {
        GradSlot& out = contrib[s % 2];
        ensure(out);
        ledger.compute([&] {
          std::fill(out.g.begin(), out.g.end(), 0.f);
          cpu::attention_backward(c, dout, lse, delta.data(), dq, out.g.data(), out.g.data() + kv);
        });
        const std::array<comm::SendBuffer, 2> bufs{{{out.g.data(), grad_bytes}, {out.g.data() + kv, grad_bytes}}};
        out.req = comm.isend(j, tag(s, MsgKind::Gradient), bufs, concat("dK/dV of ring step ", s, " to rank ", j));
        ledger.sent(2 * f32_bytes(kv));
      }
    }
    // step s, complete: K/V for step s+1 is here; step s-1's gradients have arrived and are added in step order.
    ring.complete();
    if (s > 0) finish_gradients(s - 1);
  }
  finish_gradients(P - 1);
}

}  // namespace rf::cp::detail
