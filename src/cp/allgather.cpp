// ringflex cp: the all-gather algorithm (the seed's first design, kept for comparison; see cp_attention.h).
//
// Every rank gathers all P chunks of K, V and metadata into one key set [B, Hkv, P*L, D] (rank-major key order:
// metadata carries each key's idx, so order does not matter to the mask), runs one kernel call against it, and in
// backward reduce-scatters the float32 dK/dV: each rank sends every other rank that rank's slice of its partial
// and sums the P slices it receives in rank order. Memory per rank grows with P: that is what the ring avoids.
#include <algorithm>
#include <string>
#include <vector>

#include "core/error.h"
#include "cp/cp_internal.h"
#include "cpu/attention.h"

namespace rf::cp::detail {
namespace {

// All ranks' keys, values and metadata, laid out for one kernel call.
struct Gathered {
  std::vector<uint8_t> k, v;    // [B, Hkv, P*L, D] in the input dtype
  std::vector<TokenMeta> meta;  // [B, P*L]
};

Gathered gather(comm::Communicator& comm, const CpShard& x, comm::Timeout timeout, Ledger& ledger) {
  const int P = comm.size(), B = x.shape.B, Hkv = x.shape.Hkv, L = x.shape.Lk, D = x.shape.D;
  const size_t slice = static_cast<size_t>(L) * D * dtype_size(x.dtype);  // one (b, h) of one chunk, bytes
  Gathered g;
  g.k.resize(slice * P * B * Hkv);
  g.v.resize(g.k.size());
  g.meta.resize(static_cast<size_t>(B) * P * L);
  ledger.hold(static_cast<int64_t>(2 * g.k.size() + g.meta.size() * sizeof(TokenMeta)));
  // One allgather per (b, h) lands each rank's [L, D] slice at its place in the [P*L, D] key axis.
  const auto* k = static_cast<const uint8_t*>(x.k);
  const auto* v = static_cast<const uint8_t*>(x.v);
  for (int64_t bh = 0; bh < int64_t{B} * Hkv; ++bh) {
    comm.allgather(k + bh * slice, g.k.data() + bh * slice * P, slice, timeout);
    comm.allgather(v + bh * slice, g.v.data() + bh * slice * P, slice, timeout);
  }
  for (int b = 0; b < B; ++b)
    comm.allgather(x.meta + static_cast<int64_t>(b) * L, g.meta.data() + static_cast<size_t>(b) * P * L,
                   L * sizeof(TokenMeta), timeout);
  const auto moved = static_cast<int64_t>(2 * slice * B * Hkv + static_cast<size_t>(B) * L * sizeof(TokenMeta));
  ledger.sent(moved * (P - 1));
  ledger.received(moved * (P - 1));
  return g;
}

AttnChunk gathered_chunk(const CpShard& x, const Gathered& g, int P, const LayerMask& mask, float scale) {
  AttnChunk c{x.shape, x.dtype, x.q, g.k.data(), g.v.data(), x.meta, g.meta.data(), mask, scale};
  c.shape.Lk = P * x.shape.Lk;
  return c;
}

}  // namespace

void allgather_forward(comm::Communicator& comm, const CpShard& x, const CpParams& p, float scale, float* o, float* lse,
                       Ledger& ledger) {
  const Gathered g = gather(comm, x, p.timeout, ledger);
  ledger.hold((x.shape.q_elems() + x.shape.lse_elems()) * static_cast<int64_t>(sizeof(float)));
  const AttnChunk c = gathered_chunk(x, g, comm.size(), p.mask, scale);
  if (ledger.counting())
    ledger.add_work(count_allowed_pairs(p.mask, x.meta, c.k_meta, x.shape.B, x.shape.Lq, c.shape.Lk));
  ledger.compute([&] { cpu::attention_forward(c, o, lse); });
}

void allgather_backward(comm::Communicator& comm, const CpShard& x, const CpParams& p, float scale, const float* o,
                        const float* lse, const void* dout, float* dq, float* dk, float* dv, Ledger& ledger) {
  const int P = comm.size(), r = comm.rank(), L = x.shape.Lk, D = x.shape.D;
  const int64_t BH = int64_t{x.shape.B} * x.shape.Hkv, rows = x.shape.lse_elems();
  const Gathered g = gather(comm, x, p.timeout, ledger);
  const AttnChunk c = gathered_chunk(x, g, P, p.mask, scale);

  // dk_all, dv_all: [B, Hkv, P*L, D] float32 partials over this rank's queries; delta: [B, Hq, L].
  std::vector<float> dk_all(static_cast<size_t>(c.shape.kv_elems()), 0.f), dv_all(dk_all.size(), 0.f);
  std::vector<float> delta(static_cast<size_t>(rows));
  ledger.hold(static_cast<int64_t>((2 * dk_all.size() + delta.size()) * sizeof(float)) +
              (x.shape.q_elems() + 2 * x.shape.kv_elems()) * static_cast<int64_t>(sizeof(float)));
  std::fill(dq, dq + x.shape.q_elems(), 0.f);
  if (ledger.counting())
    ledger.add_work(count_allowed_pairs(p.mask, x.meta, c.k_meta, x.shape.B, x.shape.Lq, c.shape.Lk));
  ledger.compute([&] {
    cpu::attention_delta(x.shape, x.dtype, dout, o, delta.data());
    cpu::attention_backward(c, dout, lse, delta.data(), dq, dk_all.data(), dv_all.data());
  });

  // Reduce-scatter: rank j's slice of every (b, h) is [L, D] at offset j*L of the key axis.
  const size_t slice = static_cast<size_t>(L) * D;  // floats
  const auto slice_at = [&](std::vector<float>& a, int64_t bh, int j) { return a.data() + (bh * P + j) * slice; };
  const auto slices_for = [&](int j, std::vector<comm::SendBuffer>& out) {
    for (int64_t bh = 0; bh < BH; ++bh) out.push_back({slice_at(dk_all, bh, j), slice * sizeof(float)});
    for (int64_t bh = 0; bh < BH; ++bh) out.push_back({slice_at(dv_all, bh, j), slice * sizeof(float)});
  };
  // received: [P, 2, B, Hkv, L, D]; this rank's own partial is read in place.
  std::vector<float> received(static_cast<size_t>(P) * 2 * BH * slice);
  ledger.hold(static_cast<int64_t>(received.size() * sizeof(float)));
  std::vector<comm::RequestPtr> reqs;
  for (int j = 0; j < P; ++j) {
    if (j == r) continue;
    float* base = received.data() + static_cast<size_t>(j) * 2 * BH * slice;
    std::vector<comm::RecvBuffer> in;
    for (int64_t i = 0; i < 2 * BH; ++i) in.push_back({base + i * slice, slice * sizeof(float)});
    reqs.push_back(comm.irecv(j, tag(0, MsgKind::ReduceScatter), in, concat("dK/dV partial from rank ", j)));
    std::vector<comm::SendBuffer> out;
    slices_for(j, out);
    reqs.push_back(comm.isend(j, tag(0, MsgKind::ReduceScatter), out, concat("dK/dV partial to rank ", j)));
    ledger.sent(static_cast<int64_t>(2 * BH * slice * sizeof(float)));
    ledger.received(static_cast<int64_t>(2 * BH * slice * sizeof(float)));
  }
  comm::wait_all(reqs, p.timeout);

  // Sum in rank order 0..P-1 so every run (and every backend) gives the same bits.
  std::fill(dk, dk + BH * slice, 0.f);
  std::fill(dv, dv + BH * slice, 0.f);
  for (int j = 0; j < P; ++j)
    for (int64_t bh = 0; bh < BH; ++bh) {
      const float* src_k =
          j == r ? slice_at(dk_all, bh, r) : received.data() + (static_cast<size_t>(j) * 2 * BH + bh) * slice;
      const float* src_v =
          j == r ? slice_at(dv_all, bh, r) : received.data() + (static_cast<size_t>(j) * 2 * BH + BH + bh) * slice;
      for (size_t i = 0; i < slice; ++i) dk[bh * slice + i] += src_k[i];
      for (size_t i = 0; i < slice; ++i) dv[bh * slice + i] += src_v[i];
    }
}

}  // namespace rf::cp::detail
