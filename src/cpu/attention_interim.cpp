// Interim cpu entry points that forward to the scalar reference, so the layers above can be built and tested
// while the optimised kernels are written. Replaced by the blocked SIMD kernels; not a deliverable.
#include <algorithm>

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

void attention_backward(const AttnChunk& c, const void* dout, const float*, const float*, float* dq, float* dk,
                        float* dv) {
  const RefBackward g = reference_backward(c, dout);
  for (size_t i = 0; i < g.dq.size(); ++i) dq[i] += static_cast<float>(g.dq[i]);
  for (size_t i = 0; i < g.dk.size(); ++i) dk[i] += static_cast<float>(g.dk[i]);
  for (size_t i = 0; i < g.dv.size(); ++i) dv[i] += static_cast<float>(g.dv[i]);
}

}  // namespace rf::cpu
