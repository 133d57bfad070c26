// Interim cpu entry points that forward to the scalar reference, so the layers above can be built and tested
// while the optimised kernels are written. Replaced by the blocked SIMD kernels; not a deliverable.
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/attention.h"
#include "reference/attention_ref.h"

namespace rf::cpu {

void attention_forward(const AttnChunk& c, float* o, float* lse) {
  const RefForward r = reference_forward(c);
  std::transform(r.o.begin(), r.o.end(), o, [](double x) { return static_cast<float>(x); });
  std::transform(r.lse.begin(), r.lse.end(), lse, [](double x) { return static_cast<float>(x); });
}

void attention_delta(const AttnShape& s, DType dtype, const void* dout, const float* o, float* delta) {
  std::vector<float> d(static_cast<size_t>(s.q_elems()));
  to_float(d.data(), dout, d.size(), dtype);
  for (int64_t r = 0; r < s.lse_elems(); ++r) {
    float acc = 0;
    for (int i = 0; i < s.D; ++i) acc += d[r * s.D + i] * o[r * s.D + i];
    delta[r] = acc;
  }
}

// Chunk backward from the caller's merged statistics (the ring's contract): P = exp(scale q.k - lse) and
// dS = P (dout.v - delta) use the whole row's lse and delta, so per-chunk gradients add up to the full ones.
// Scalar, double accumulation, like the reference it stands in for.
void attention_backward(const AttnChunk& c, const void* dout, const float* lse, const float* delta, float* dq,
                        float* dk, float* dv) {
  validate(c);
  const AttnShape& sh = c.shape;
  const auto widen = [](const void* p, int64_t n, DType t) {
    std::vector<float> f(static_cast<size_t>(n));
    if (n > 0) to_float(f.data(), p, f.size(), t);
    return f;
  };
  const std::vector<float> q = widen(c.q, sh.q_elems(), c.dtype), k = widen(c.k, sh.kv_elems(), c.dtype);
  const std::vector<float> v = widen(c.v, sh.kv_elems(), c.dtype), dO = widen(dout, sh.q_elems(), c.dtype);
  for (int b = 0; b < sh.B; ++b)
    for (int h = 0; h < sh.Hq; ++h) {
      const int64_t kv_off = (int64_t{b} * sh.Hkv + h / sh.group_size()) * sh.Lk * sh.D;
      for (int i = 0; i < sh.Lq; ++i) {
        const int64_t row = (int64_t{b} * sh.Hq + h) * sh.Lq + i;
        if (std::isinf(lse[row])) continue;  // the query sees nothing anywhere: no gradient
        const TokenMeta& qm = c.q_meta[int64_t{b} * sh.Lq + i];
        const float* qi = q.data() + row * sh.D;
        const float* doi = dO.data() + row * sh.D;
        for (int j = 0; j < sh.Lk; ++j) {
          if (!allowed(c.mask, qm, c.k_meta[int64_t{b} * sh.Lk + j])) continue;
          const int64_t kj = kv_off + int64_t{j} * sh.D;
          double score = 0, dp = 0;
          for (int d = 0; d < sh.D; ++d) {
            score += double{qi[d]} * k[kj + d];
            dp += double{doi[d]} * v[kj + d];
          }
          const double pj = std::exp(c.scale * score - lse[row]);
          const double ds = pj * (dp - delta[row]) * c.scale;
          for (int d = 0; d < sh.D; ++d) {
            dq[row * sh.D + d] += static_cast<float>(ds * k[kj + d]);
            dk[kj + d] += static_cast<float>(ds * qi[d]);
            dv[kj + d] += static_cast<float>(pj * doi[d]);
          }
        }
      }
    }
}

}  // namespace rf::cpu
