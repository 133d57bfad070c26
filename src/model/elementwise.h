// ringflex model: the decoder's elementwise passes (GELU/GeGLU and their derivatives, the final logit softcap and
// the cross-entropy gradient, RMSNorm rows), compiled once per ISA like the attention kernels.
//
// The library is compiled for the x86-64 baseline, where these loops get SSE2 at best and every tanh is a call
// into libm (~10-20 ns): a Gemma 4 training step takes ~4 tanh per MLP activation (forward, recompute, and two in
// the backward) and one per logit, hundreds of millions at S = 4K. elementwise_kernels.cpp is compiled per ISA
// (src/cpu/isa_target.h: a target pragma over a namespace per ISA, so no ISA copy of an inline function leaks into
// baseline code), with an inline tanh the compiler vectorises, and `elementwise()` picks the copy for the path
// src/cpu/isa.h chose for the attention kernels (CPUID, RINGFLEX_ISA): the one run-time decision for both.
//
// Numerics: tanh is a polynomial below |x| = 1/4 and 1 - 2 / (2^(2|x| log2 e) + 1) above, relative error below
// 1e-6 (tests/model/test_elementwise.cpp checks every ISA the CPU has against double precision). Row sums (RMSNorm)
// use kSumLanes float32 accumulators folded in a fixed tree, so a row's bits depend on the ISA (FMA contraction)
// but never on the thread count or on which rows share a thread.
#pragma once

#include <cstdint>

#include "cpu/isa.h"
#include "cpu/isa_table.h"

namespace rf::model {

// float32 accumulators of a row sum: a fixed count, the same on every ISA, so the summation order is fixed by n.
constexpr int kSumLanes = 16;

struct ElementwiseKernels {
  cpu::Isa isa;
  // h[i] = gelu_tanh(g[i]) * u[i], i < n.
  void (*geglu_forward)(const float* g, const float* u, float* h, int64_t n);
  // dg[i] = dh[i] u[i] gelu_tanh'(g[i]) and du[i] = dh[i] gelu_tanh(g[i]), added to dg/du when `accumulate`,
  // written otherwise. Written, dg may be g and du may be u (in place: each element is read before it is written).
  void (*geglu_backward)(const float* g, const float* u, const float* dh, float* dg, float* du, int64_t n,
                         bool accumulate);
  // z[v] = cap * tanh(z[v] / cap) in place (cap > 0: Gemma's final_logit_softcapping); returns max_v z[v] after
  // the cap (-inf for n = 0; NaNs are skipped, they reach the loss through their exp).
  float (*softcap_max)(float* z, int64_t n, float cap);
  // The loss's gradient on one row of capped logits z[n], in place: z[v] = (ex[v] * p_scale - [v == label]) *
  // loss_scale, times (1 - (z[v] / cap)^2) when cap > 0 (d cap tanh(x / cap) / dx).
  void (*cross_entropy_grad)(float* z, const float* ex, int64_t n, float p_scale, int64_t label, float loss_scale,
                             float cap);
  // sum_i x[i]^2 over one row, kSumLanes lanes folded in a fixed order.
  float (*sum_squares)(const float* x, int64_t n);
  // sum_i a[i] * b[i] * (w ? w[i] : 1), the same order.
  float (*dot_scaled)(const float* a, const float* b, const float* w, int64_t n);
  // y[i] = x[i] * s * (w ? w[i] : 1).
  void (*scale_row)(const float* x, const float* w, float s, float* y, int64_t n);
  // dx[i] += s * dy[i] * (w ? w[i] : 1) - c * x[i] (the RMSNorm backward of one row).
  void (*rmsnorm_grad_row)(const float* x, const float* w, const float* dy, float s, float c, float* dx, int64_t n);
};

// The kernels of each ISA (elementwise_kernels.cpp, compiled once per ISA; cpu/isa_table.h).
RF_ISA_TABLE_EXPORTS(ElementwiseKernels, elementwise);

// The set for the ISA src/cpu/isa.h chose (cpu::kernel_path()), decided on first use.
const ElementwiseKernels& elementwise();
// The set for a given ISA (tests run every ISA the CPU has). Throws rf::Error for an ISA this build lacks.
const ElementwiseKernels& elementwise_for(cpu::Isa isa);

}  // namespace rf::model
