// Shared harness of the cpu kernel tests: build a case, run the kernels the way the ring does (forward, delta
// from the kernel's own O, backward with the kernel's LSE), run the scalar reference, and compare element by
// element against a derived error bound.
//
// The bound. Every float32 quantity the kernel forms is a sum whose computed value is within γ_n·Σ|terms| of the
// exact one (γ_n ≈ n·eps, Higham's worst-case bound). Scores s = scale·q.k carry γ_D·E with
// E = max over allowed pairs of scale·Σ_d|q_d k_d|; subtracting the running max doubles that, and it reaches p
// as a relative error (d exp(s) = exp(s)·ds). The exp2 polynomial adds < 3e-7 relative (test_exp2), the softmax
// sum and every P·V-like product add γ_n with n = the longest row or column of allowed pairs. So every output
// x = Σ terms satisfies |x - x_ref| ≤ κ·M(x) with
//     κ = eps32 · (2·D·E + 3·n + kSlack),   M(x) = the same sum over |terms| (computed in double here),
// to first order. Backward quantities are products of two such factors (p and dp - delta, through the LSE
// and delta the forward produced), hence 2κ. bf16 inputs are exact in float32, and vdpbf16ps and AMX multiply
// bf16 pairs exactly and accumulate in float32, so the same bound holds for the score products on every path
// (the reference runs on the same bf16 values).
//
// The vdpbf16ps and AMX paths (src/cpu/isa.h: rounds_bf16_weights) also round the float32 weights of the accumulating
// products to bf16: P in O += P V and dV += P^T dO, dS in dK += dS^T Q and dQ += dS K. Round to nearest even with
// 8 significant bits gives |ŵ - w| ≤ u_bf16·|w|, u_bf16 = 2^-8, for every normal w (P ≤ 1 and dS are far from
// bf16's overflow; a float32 denormal weight becomes 0, an absolute error below 2^-126·|x| per term, which no
// float32 result of these magnitudes can show). So Σ ŵ·x = Σ w·x + Σ δ·w·x with |δ| ≤ u_bf16, one more error of
// at most u_bf16·Σ|w·x| ≤ u_bf16·M(x) per output: the forward's o gains u_bf16·M (l and the LSE use the
// unrounded P, so the LSE keeps κ). In the backward dV gains u_bf16·M(dv) from P's rounding; dK and dQ gain
// u_bf16·M from dS's rounding and u_bf16·M once more through delta = rowsum(dO ⊙ O), whose O carries the forward's
// rounding (|Δdelta| ≤ (κ + u_bf16)·Σ_j p_j·Σ_d|dO_d·v_jd|, the delta_abs term of M's dS magnitude). Hence
//     |x - x_ref| ≤ factor·(κ + u_bf16)·M(x),   factor 1 forward, 2 backward,
// with u_bf16 = 0 on the paths that do not round (Bounds::weight_rounding). It is ~4e-3·M: a few times κ at the
// sweep's largest rows, and still far below the O(M) error of a mask or layout mistake (a wrong pair of keys, a
// swapped half of a bf16 pair). The bound is relative to M, not to |x|: where the terms cancel (dQ = scale·Σ_j
// dS_ij·k_j with Σ_j dS_ij = 0) the relative error of x itself can exceed u_bf16.
// Where the kernel applies the mask wrongly the error is O(p·|v|) = O(M), far above κ·M (κ ≲ 1e-3 here).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "common/attention_bounds.h"
#include "common/random_case.h"
#include "core/error.h"
#include "cpu/attention.h"
#include "cpu/isa.h"
#include "reference/attention_ref.h"

namespace rf::testing {

constexpr double kEps32 = 5.9604644775390625e-8;  // 2^-24, float32 unit roundoff
constexpr double kSlack = 16;                     // exp2 polynomial (~5 ulp) and the final divide/log
constexpr double kBf16Unit = 0.00390625;          // 2^-8, bf16 unit roundoff (8 significant bits, nearest even)

struct Case {
  int B = 1, Hq = 1, Hkv = 1, Lq = 0, Lk = 0, D = 8;
  DType dtype = DType::F32;
  LayerMask mask;
  std::vector<TokenMeta> q_meta, k_meta;  // [B, Lq], [B, Lk]
  uint64_t seed = 1;
  float scale = 0;  // 0: 1/sqrt(D)

  std::string name() const {
    return concat("B=", B, " Hq=", Hq, " Hkv=", Hkv, " Lq=", Lq, " Lk=", Lk, " D=", D, " ", dtype_name(dtype), " ",
                  mask.name());
  }
};

struct Tensors {
  std::vector<uint8_t> q, k, v, dout;
  AttnChunk chunk;
};

inline Tensors make_tensors(const Case& cs) {
  Tensors t;
  AttnShape s{cs.B, cs.Hq, cs.Hkv, cs.Lq, cs.Lk, cs.D};
  t.q = random_tensor(s.q_elems(), cs.dtype, cs.seed * 4 + 0);
  t.k = random_tensor(s.kv_elems(), cs.dtype, cs.seed * 4 + 1);
  t.v = random_tensor(s.kv_elems(), cs.dtype, cs.seed * 4 + 2);
  t.dout = random_tensor(s.q_elems(), cs.dtype, cs.seed * 4 + 3);
  t.chunk.shape = s;
  t.chunk.dtype = cs.dtype;
  t.chunk.q = t.q.data(), t.chunk.k = t.k.data(), t.chunk.v = t.v.data();
  t.chunk.q_meta = cs.q_meta.data(), t.chunk.k_meta = cs.k_meta.data();
  t.chunk.mask = cs.mask;
  t.chunk.scale = cs.scale != 0 ? cs.scale : default_scale(cs.D);
  return t;
}

struct KernelResult {
  std::vector<float> o, lse, delta, dq, dk, dv;
};

// Forward, delta and backward, as the ring runs them on one chunk. Gradients start at zero.
inline KernelResult run_kernels(const AttnChunk& c, const void* dout) {
  const AttnShape& s = c.shape;
  KernelResult r;
  r.o.assign(static_cast<size_t>(s.q_elems()), 0.f);
  r.lse.assign(static_cast<size_t>(s.lse_elems()), 0.f);
  r.delta.assign(r.lse.size(), 0.f);
  r.dq.assign(r.o.size(), 0.f);
  r.dk.assign(static_cast<size_t>(s.kv_elems()), 0.f);
  r.dv.assign(r.dk.size(), 0.f);
  cpu::attention_forward(c, r.o.data(), r.lse.data());
  cpu::attention_delta(s, c.dtype, dout, r.o.data(), r.delta.data());
  cpu::attention_backward(c, dout, r.lse.data(), r.delta.data(), r.dq.data(), r.dk.data(), r.dv.data());
  return r;
}

// The magnitudes M(x) of the error bound (common/attention_bounds.h) and the factor κ, from the inputs in double.
// weight_rounding: u_bf16
// when the kernel path in use rounds P and dS to bf16 (bf16 inputs on vdpbf16ps), else 0; it adds to κ for o,
// dq, dk and dv, not for the LSE.
struct Bounds {
  double kappa = 0, weight_rounding = 0;
  std::vector<double> o, lse, dq, dk, dv;
  double products() const { return kappa + weight_rounding; }
};

inline Bounds error_bounds(const AttnChunk& c, const void* dout, const RefForward& ref) {
  Magnitudes m = attention_magnitudes(c, dout, ref);
  Bounds bd;
  bd.kappa = kEps32 * (2 * c.shape.D * m.e_max + 3 * m.n_max + kSlack);
  const bool rounds = c.dtype == DType::BF16 && cpu::rounds_bf16_weights(cpu::kernel_path().bf16);
  bd.weight_rounding = rounds ? kBf16Unit : 0;
  bd.o = std::move(m.o), bd.lse = std::move(m.lse), bd.dq = std::move(m.dq), bd.dk = std::move(m.dk);
  bd.dv = std::move(m.dv);
  return bd;
}

// |got - want| <= factor · κ · M elementwise; exact equality where M = 0 (nothing allowed: zeros, -inf).
inline void expect_close(const char* what, const std::vector<float>& got, const std::vector<double>& want,
                         const std::vector<double>& mag, double factor, double kappa, const std::string& name) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int reported = 0;
  for (size_t i = 0; i < got.size() && reported < 3; ++i) {
    ASSERT_FALSE(std::isnan(got[i])) << what << "[" << i << "] is NaN in " << name;
    if (std::isinf(want[i]) || mag[i] == 0) {
      if (static_cast<double>(got[i]) != want[i]) {
        ADD_FAILURE() << what << "[" << i << "] = " << got[i] << ", want exactly " << want[i] << " in " << name;
        ++reported;
      }
      continue;
    }
    const double tol = factor * kappa * mag[i];
    if (std::fabs(got[i] - want[i]) > tol) {
      ADD_FAILURE() << what << "[" << i << "] = " << got[i] << ", reference " << want[i] << ", bound " << tol << " in "
                    << name;
      ++reported;
    }
  }
}

// Runs one case through the kernels and the reference and checks every output.
inline void check_case(const Case& cs) {
  Tensors t = make_tensors(cs);
  const KernelResult r = run_kernels(t.chunk, t.dout.data());
  const RefForward ref = reference_forward(t.chunk);
  const RefBackward gref = reference_backward(t.chunk, t.dout.data());
  const Bounds bd = error_bounds(t.chunk, t.dout.data(), ref);
  const std::string name = cs.name();
  // Forward outputs are single sums: κ. Backward ones multiply two perturbed factors (p through the kernel's
  // LSE, dp - delta through its O): 2κ to first order.
  expect_close("o", r.o, ref.o, bd.o, 1, bd.products(), name);
  expect_close("lse", r.lse, ref.lse, bd.lse, 1, bd.kappa, name);
  expect_close("dq", r.dq, gref.dq, bd.dq, 2, bd.products(), name);
  expect_close("dk", r.dk, gref.dk, bd.dk, 2, bd.products(), name);
  expect_close("dv", r.dv, gref.dv, bd.dv, 2, bd.products(), name);
}

}  // namespace rf::testing
