// ringflex trainer: the optimizer's per-element passes of one ISA (optimizer_kernels.h), compiled once per ISA
// (src/trainer/CMakeLists.txt, src/cpu/isa_target.h). Plain loops under `omp simd`, which vectorises them for the
// region's ISA; the caller splits the elements over the threads.
#include <cmath>
#include <cstdint>

#include "cpu/isa_target.h"
#include "trainer/optimizer_kernels.h"

RF_ISA_BEGIN
namespace rf::trainer::RF_ISA_NS {

namespace {

void adamw(float* p, float* m, float* v, const float* g, int64_t n, const AdamWConstants& c) {
  const double b1 = c.b1, b2 = c.b2, c1 = c.correction1, c2 = c.correction2, eps = c.eps, lr = c.lr;
  const double decay = c.decay, grad_scale = c.grad_scale;
#pragma omp simd
  for (int64_t e = 0; e < n; ++e) {
    const double gd = static_cast<float>(g[e] * grad_scale);
    const double mn = b1 * m[e] + (1.0 - b1) * gd;
    const double vn = b2 * v[e] + (1.0 - b2) * gd * gd;
    m[e] = static_cast<float>(mn);
    v[e] = static_cast<float>(vn);
    const double update = (mn / c1) / (std::sqrt(vn / c2) + eps);
    const double pd = p[e];
    p[e] = static_cast<float>(pd - decay * pd - lr * update);
  }
}

void scale(float* g, int64_t n, double factor) {
#pragma omp simd
  for (int64_t e = 0; e < n; ++e) g[e] = static_cast<float>(g[e] * factor);
}

}  // namespace

}  // namespace rf::trainer::RF_ISA_NS
RF_ISA_END

namespace rf::trainer {

const OptimizerKernels& RF_ISA_EXPORT(optimizer_kernels)() {
  constexpr cpu::Isa kIsa = cpu::Isa::RF_ISA_KIND;
  namespace k = RF_ISA_NS;
  static const OptimizerKernels set{kIsa, k::adamw, k::scale};
  return set;
}

}  // namespace rf::trainer
