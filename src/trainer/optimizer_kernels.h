// ringflex trainer: the optimizer's per-element passes (the AdamW update, the gradient scaling of clipping),
// compiled once per ISA like the model's elementwise kernels (model/elementwise.h).
//
// The library is compiled for the x86-64 baseline, where AdamW's float64 update (a sqrt and two divisions an
// element) stays scalar: `std::sqrt` may set errno, so GCC keeps the loop element by element, and over a model's
// 84M parameters that one pass took 8% of a 100m training step at S = 1024. optimizer_kernels.cpp is compiled per
// ISA with -fno-math-errno and -ffp-contract=off, so the loop is vectorised with the same operations in the same
// order: every operation is an IEEE float64 one, correctly rounded in a vector lane as in a scalar register, and
// no multiply-add is fused, so every ISA gives the baseline's bits (tests/trainer/test_optimizer.cpp checks each
// ISA the CPU has against the scalar form written out there).
#pragma once

#include <cstdint>

#include "cpu/isa.h"
#include "cpu/isa_table.h"

namespace rf::trainer {

// One AdamW step's constants (optimizer.h): the moments' decays, the bias corrections 1 - b^t, eps, the learning
// rate, the decoupled decay lr * weight_decay (0 for a tensor that does not decay) and the clipping factor the
// gradients are taken times (1: as they are).
struct AdamWConstants {
  double b1, b2, correction1, correction2, eps, lr, decay, grad_scale;
};

struct OptimizerKernels {
  cpu::Isa isa;
  // AdamW over n elements, in float64 per element, each result rounded to float32 once:
  //   g = float(g[e] grad_scale)  (scale's bits: clipping fused into the update, g[] left as it is);
  //   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g g;
  //   p = (p - decay p) - lr ((m / correction1) / (sqrt(v / correction2) + eps)).
  void (*adamw)(float* p, float* m, float* v, const float* g, int64_t n, const AdamWConstants& c);
  // g[i] = float(g[i] * factor), the product in float64.
  void (*scale)(float* g, int64_t n, double factor);
};

// The kernels of each ISA (optimizer_kernels.cpp, compiled once per ISA; cpu/isa_table.h).
RF_ISA_TABLE_EXPORTS(OptimizerKernels, optimizer_kernels);

// The set for the ISA src/cpu/isa.h chose (cpu::kernel_path()), decided on first use.
const OptimizerKernels& optimizer_kernels();
// The set for a given ISA (tests run every ISA the CPU has). Throws rf::Error for an ISA this build lacks.
const OptimizerKernels& optimizer_kernels_for(cpu::Isa isa);

}  // namespace rf::trainer
