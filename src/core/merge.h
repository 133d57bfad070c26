// ringflex core: merging two partial attention results by their log-sum-exp (docs/spec.md §4).
//
// A partial result over a subset of keys is (o, lse) with o already normalised over that subset. Two partials
// over disjoint key sets combine exactly:
//     lse = logaddexp(lse_a, lse_b),  o = o_a * exp(lse_a - lse) + o_b * exp(lse_b - lse).
// A row that saw no allowed key has lse = -inf and o = 0; the weights below are written so that either side
// (or both) being -inf gives finite weights (0 for the empty side) and never exp(-inf - -inf) = NaN.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

namespace rf {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct MergeWeights {
  float a, b;  // multipliers of o_a and o_b
  float lse;   // merged log-sum-exp
};

inline MergeWeights merge_weights(float lse_a, float lse_b) {
  if (lse_a == kNegInf && lse_b == kNegInf) return {0.f, 0.f, kNegInf};
  // Subtract the larger side so the exponent is <= 0: exp cannot overflow and the larger side's weight is
  // exp(0) / (1 + exp(-d)) computed without cancellation.
  const float hi = std::fmax(lse_a, lse_b);
  const float ea = std::exp(lse_a - hi);  // exactly 1 on the larger side, 0 on a -inf side
  const float eb = std::exp(lse_b - hi);
  const float sum = ea + eb;
  return {ea / sum, eb / sum, hi + std::log(sum)};
}

// Merge partial (o_b, lse_b) into the accumulator (o_a, lse_a) in place.
// o_a, o_b: [rows, D] float32; lse_a, lse_b: [rows].
void merge_partial(float* o_a, float* lse_a, const float* o_b, const float* lse_b, int64_t rows, int D);

}  // namespace rf
