// The magnitudes M(x) = Σ |terms| of every attention output, from the inputs in double: what the derived error
// bounds of tests/cpu/attention_check.h (which holds the derivation) and tests/cli/attn_case.cpp scale with.
// Header-only and free of gtest, so test tools that are not gtest binaries use it too.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/attention_args.h"
#include "core/dtype.h"
#include "core/mask.h"
#include "reference/attention_ref.h"

namespace rf::testing {

// o, dq: [B, Hq, Lq, D]; dk, dv: [B, Hkv, Lk, D]; lse: [B, Hq, Lq] (1 + |lse|, 1 where no key is allowed).
// e_max: max over allowed pairs of scale·Σ_d|q_d k_d|; n_max: the longest row or column of allowed pairs (>= D).
struct Magnitudes {
  double e_max = 0;
  int n_max = 0;
  std::vector<double> o, lse, dq, dk, dv;
};

// M(o) = Σ_j p_j·|v_j|, M(dv) = Σ_i p_i·|dO_i|, and M(dq), M(dk) = Σ |dS|·|k| and Σ |dS|·|q| with
// |dS_ij| <= p_ij·(Σ_d|dO_id·v_jd| + Σ_j' p_ij'·Σ_d|dO_id·v_j'd|)·|scale| (the magnitudes of dP and delta).
// p from the reference LSE.
inline Magnitudes attention_magnitudes(const AttnChunk& c, const void* dout, const RefForward& ref) {
  const AttnShape& s = c.shape;
  const int D = s.D, G = s.group_size();
  auto widen = [](const void* p, int64_t n, DType t) {
    std::vector<float> f(static_cast<size_t>(n));
    if (n > 0) to_float(f.data(), p, f.size(), t);
    return std::vector<double>(f.begin(), f.end());
  };
  const std::vector<double> q = widen(c.q, s.q_elems(), c.dtype), k = widen(c.k, s.kv_elems(), c.dtype);
  const std::vector<double> v = widen(c.v, s.kv_elems(), c.dtype), go = widen(dout, s.q_elems(), c.dtype);
  Magnitudes bd;
  bd.o.assign(q.size(), 0), bd.dq.assign(q.size(), 0), bd.dk.assign(k.size(), 0), bd.dv.assign(k.size(), 0);
  bd.lse.assign(static_cast<size_t>(s.lse_elems()), 1);
  double e_max = 0;
  int n_max = D;
  std::vector<int> col_count(static_cast<size_t>(s.Lk));
  std::vector<double> p(static_cast<size_t>(s.Lk)), dpa(p.size());
  for (int b = 0; b < s.B; ++b) {
    std::fill(col_count.begin(), col_count.end(), 0);
    for (int h = 0; h < s.Hq; ++h) {
      const int64_t kv0 = (int64_t{b} * s.Hkv + h / G) * s.Lk;
      for (int i = 0; i < s.Lq; ++i) {
        const int64_t row = (int64_t{b} * s.Hq + h) * s.Lq + i;
        const double lse = ref.lse[row];
        if (std::isinf(lse)) continue;
        bd.lse[row] = 1 + std::fabs(lse);
        const TokenMeta& qm = c.q_meta[int64_t{b} * s.Lq + i];
        int n = 0;
        double delta_abs = 0;
        for (int j = 0; j < s.Lk; ++j) {
          p[j] = 0;
          if (!allowed(c.mask, qm, c.k_meta[int64_t{b} * s.Lk + j])) continue;
          ++n, ++col_count[j];
          double dot = 0, mag = 0, da = 0;
          for (int d = 0; d < D; ++d) {
            dot += q[row * D + d] * k[(kv0 + j) * D + d];
            mag += std::fabs(q[row * D + d] * k[(kv0 + j) * D + d]);
            da += std::fabs(go[row * D + d] * v[(kv0 + j) * D + d]);
          }
          e_max = std::max(e_max, std::fabs(c.scale) * mag);
          p[j] = std::exp(c.scale * dot - lse);
          dpa[j] = da;
          delta_abs += p[j] * da;
        }
        n_max = std::max(n_max, n);
        for (int j = 0; j < s.Lk; ++j) {
          if (p[j] == 0) continue;
          const double ds = p[j] * (dpa[j] + delta_abs) * std::fabs(c.scale);
          for (int d = 0; d < D; ++d) {
            bd.o[row * D + d] += p[j] * std::fabs(v[(kv0 + j) * D + d]);
            bd.dq[row * D + d] += ds * std::fabs(k[(kv0 + j) * D + d]);
            bd.dk[(kv0 + j) * D + d] += ds * std::fabs(q[row * D + d]);
            bd.dv[(kv0 + j) * D + d] += p[j] * std::fabs(go[row * D + d]);
          }
        }
      }
    }
    for (int j = 0; j < s.Lk; ++j) n_max = std::max(n_max, col_count[j]);
  }
  bd.e_max = e_max, bd.n_max = n_max;
  return bd;
}

}  // namespace rf::testing
