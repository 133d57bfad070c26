// ringflex cp: the ring's per-step compute (ring.cpp), whichever transport brought the keys. Both traffics merge
// the same partials in the same order through this one code path, which is what lets the planned ring promise the
// chunk ring's bits.
#include <algorithm>

#include "core/merge.h"
#include "cp/cp_internal.h"
#include "cpu/attention.h"

namespace rf::cp::detail {

ForwardMerge::ForwardMerge(const CpShard& x, const LayerMask& mask, float scale, float* o, float* lse, Ledger& ledger)
    : x_(x), mask_(mask), scale_(scale), o_(o), lse_(lse), ledger_(ledger) {
  const int64_t rows = x.shape.lse_elems();
  std::fill(o, o + x.shape.q_elems(), 0.f);
  std::fill(lse, lse + rows, kNegInf);
  ledger.hold((x.shape.q_elems() + rows) * static_cast<int64_t>(sizeof(float)));
}

void ForwardMerge::add(const void* k, const void* v, const TokenMeta* k_meta, int n) {
  const int B = x_.shape.B, Hkv = x_.shape.Hkv, L = x_.shape.Lq, D = x_.shape.D, G = x_.shape.group_size();
  const size_t es = dtype_size(x_.dtype);
  if (ledger_.counting()) ledger_.add_work(count_allowed_pairs(mask_, x_.meta, k_meta, B, L, n));
  if (!first_ && part_o_.empty()) {
    part_o_.resize(static_cast<size_t>(G) * L * D);
    part_lse_.resize(static_cast<size_t>(G) * L);
    ledger_.hold((int64_t{G} * L * D + int64_t{G} * L) * static_cast<int64_t>(sizeof(float)));
  }
  ledger_.compute([&] {
    for (int b = 0; b < B; ++b)
      for (int g = 0; g < Hkv; ++g) {
        const int64_t kvh = int64_t{b} * Hkv + g, qh = kvh * G;  // first query head of the group
        const AttnChunk c{AttnShape{1, G, 1, L, n, D},
                          x_.dtype,
                          static_cast<const uint8_t*>(x_.q) + qh * L * D * es,
                          static_cast<const uint8_t*>(k) + kvh * n * D * es,
                          static_cast<const uint8_t*>(v) + kvh * n * D * es,
                          x_.meta + int64_t{b} * L,
                          k_meta + int64_t{b} * n,
                          mask_,
                          scale_};
        float* oh = o_ + qh * L * D;
        float* lseh = lse_ + qh * L;
        if (first_) {
          cpu::attention_forward(c, oh, lseh);
        } else {
          cpu::attention_forward(c, part_o_.data(), part_lse_.data());
          merge_partial(oh, lseh, part_o_.data(), part_lse_.data(), int64_t{G} * L, D);
        }
      }
  });
  first_ = false;
}

std::vector<float> start_backward(const CpShard& x, const float* o, const void* dout, float* dq, float* dk, float* dv,
                                  Ledger& ledger) {
  const int64_t rows = x.shape.lse_elems(), q = x.shape.q_elems(), kv = x.shape.kv_elems();
  std::vector<float> delta(static_cast<size_t>(rows));
  ledger.hold((rows + q + 2 * kv) * static_cast<int64_t>(sizeof(float)));  // delta, dq, dk, dv
  cpu::attention_delta(x.shape, x.dtype, dout, o, delta.data());
  std::fill(dq, dq + q, 0.f);
  std::fill(dk, dk + kv, 0.f);
  std::fill(dv, dv + kv, 0.f);
  return delta;
}

}  // namespace rf::cp::detail
