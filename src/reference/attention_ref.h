// ringflex reference: the plain scalar oracle for masked attention, forward and backward.
//
// This is the clean, minimal version that every optimised path (cpu kernels, the ring at any P, the model) is
// tested against. It evaluates the docs/spec.md §3 predicate for every (q, k) pair, accumulates in double, and does
// nothing clever: no blocking, no SIMD, no skipping beyond the mask itself (a forbidden pair is absent from every
// sum, never multiplied by 0, so values no query reads cannot reach a result; docs/numerics.md). Only tests and
// benchmarks' validate steps call it.
#pragma once

#include <vector>

#include "core/attention_args.h"

namespace rf {

struct RefForward {
  std::vector<double> o;    // [B, Hq, Lq, D]; 0 for a query with no allowed key
  std::vector<double> lse;  // [B, Hq, Lq], natural log; -inf for a query with no allowed key
};

struct RefBackward {
  std::vector<double> dq;  // [B, Hq, Lq, D]
  std::vector<double> dk;  // [B, Hkv, Lk, D]
  std::vector<double> dv;  // [B, Hkv, Lk, D]
};

RefForward reference_forward(const AttnChunk& c);

// dout: [B, Hq, Lq, D] in c.dtype, the gradient of the loss with respect to O.
RefBackward reference_backward(const AttnChunk& c, const void* dout);

}  // namespace rf
