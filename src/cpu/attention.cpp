// ringflex cpu: the public kernel entry points (attention.h). Each validates its arguments, then runs the KernelSet
// of the path isa.h chose (dispatch.h: kernels_for).
#include "cpu/attention.h"

#include <algorithm>
#include <limits>

#include "core/error.h"
#include "cpu/dispatch.h"
#include "cpu/isa.h"
#include "cpu/kernels.h"

namespace rf::cpu {

namespace {

template <DType kT>
float load(const void* p, int64_t i) {
  if constexpr (kT == DType::F32)
    return static_cast<const float*>(p)[i];
  else
    return bf16_to_float(static_cast<const bf16*>(p)[i]);
}

template <DType kT>
void delta_impl(const AttnShape& s, const void* dout, const float* o, float* delta) {
  const int64_t rows = s.lse_elems();
  const int D = s.D;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    float acc = 0.f;
    for (int d = 0; d < D; ++d) acc += load<kT>(dout, r * D + d) * o[r * D + d];
    delta[r] = acc;
  }
}

}  // namespace

void attention_forward(const AttnChunk& c, float* o, float* lse) {
  validate(c);
  RF_CHECK(c.shape.lse_elems() == 0 || (o && lse), "attention_forward without output buffers");
  const KernelPath& path = kernel_path();
  kernels_for(path.isa).forward(c, path.bf16, o, lse);
}

void softmax_exp2(const float* x, float* y, int64_t n) {
  const KernelSet& kernels = kernels_for(kernel_path().isa);
  for (int64_t i0 = 0; i0 < n; i0 += std::numeric_limits<int>::max())
    kernels.exp2(x + i0, y + i0, static_cast<int>(std::min<int64_t>(n - i0, std::numeric_limits<int>::max())));
}

void attention_delta(const AttnShape& s, DType dtype, const void* dout, const float* o, float* delta) {
  if (dtype == DType::F32)
    delta_impl<DType::F32>(s, dout, o, delta);
  else
    delta_impl<DType::BF16>(s, dout, o, delta);
}

void attention_backward(const AttnChunk& c, const void* dout, const float* lse, const float* delta, float* dq,
                        float* dk, float* dv) {
  validate(c);
  const AttnShape& s = c.shape;
  RF_CHECK(s.q_elems() == 0 || (dout && lse && delta && dq), "attention_backward without dout/lse/delta/dq");
  RF_CHECK(s.kv_elems() == 0 || (dk && dv), "attention_backward without dk/dv buffers");
  const KernelPath& path = kernel_path();
  kernels_for(path.isa).backward(c, path.bf16, dout, lse, delta, dq, dk, dv);
}

}  // namespace rf::cpu
