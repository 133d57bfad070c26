// ringflex model: the elementwise kernels of one ISA (elementwise.h), compiled once per ISA (src/model/CMakeLists.txt,
// src/cpu/isa_target.h). Plain loops under `omp simd`: the compiler vectorises them for the region's ISA, and the
// pragma also asserts that in-place calls (geglu_backward writing over its inputs) carry no dependence between
// iterations, which a run-time alias check would otherwise send to the scalar loop.
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "core/math_constants.h"
#include "cpu/isa_target.h"
#include "model/elementwise.h"

RF_ISA_BEGIN
namespace rf::model::RF_ISA_NS {

namespace {

// sqrt(2/pi) and the cubic coefficient of the tanh GELU approximation (PyTorch's gelu(approximate="tanh")).
constexpr float kGeluC = 0.7978845608028654f;
constexpr float kGeluA = 0.044715f;

// 1.5 * 2^23: x + kRound - kRound rounds x to the nearest integer in float32 arithmetic (|x| < 2^22), without a
// call to rintf that the baseline ISA would not vectorise.
constexpr float kRound = 12582912.f;
constexpr int32_t kExponentBias = 127;
constexpr int kMantissaBits = 23;
// Taylor coefficients of 2^f = e^(f ln 2), (ln 2)^k / k!, k = 1..7: on |f| <= 1/2 the truncation is below
// (ln 2 / 2)^8 / 8! = 5e-9 relative, under float32's rounding.
constexpr float kExp2Coef[] = {1.f,
                               0.6931471805599453f,
                               0.2402265069591007f,
                               0.05550410866482158f,
                               0.009618129107628477f,
                               0.0013333558146428443f,
                               0.00015403530393381606f,
                               1.525273380405984e-05f};

// 2^x for x in [-126, 126]: 2^round(x) built in the exponent field times the polynomial of the rest.
inline float exp2_in_range(float x) {
  const float n = (x + kRound) - kRound;
  const float f = x - n;  // [-1/2, 1/2]
  float p = kExp2Coef[7];
  for (int k = 6; k >= 0; --k) p = p * f + kExp2Coef[k];
  const int32_t biased = static_cast<int32_t>(n) + kExponentBias;
  return p * std::bit_cast<float>(biased << kMantissaBits);
}

// Below this |x| tanh is its odd Taylor polynomial to x^9: the first term left out, 1382/155925 x^11, is 9e-9 of
// tanh(1/4); above it 1 - 2 / (e^2|x| + 1) cancels at most 2 bits (tanh(1/4) ~ 1/4).
constexpr float kTanhTaylorBelow = 0.25f;
// tanh(|x|) rounds to 1 in float32 from |x| = 9.01 on (1 - tanh x < 2^-25): clamping |x| at 10 (1 - tanh 10 =
// 4e-9) keeps the exp argument in range and maps +-inf to +-1.
constexpr float kTanhSaturates = 10.f;
// Taylor coefficients of tanh x = x + T3 x^3 + T5 x^5 + T7 x^7 + T9 x^9 + ...
constexpr float kTanhT3 = -1.f / 3.f;
constexpr float kTanhT5 = 2.f / 15.f;
constexpr float kTanhT7 = -17.f / 315.f;
constexpr float kTanhT9 = 62.f / 2835.f;

inline float tanh_fast(float x) {
  const float ax = std::fabs(x);
  const float x2 = x * x;
  const float small = x + x * x2 * (kTanhT3 + x2 * (kTanhT5 + x2 * (kTanhT7 + x2 * kTanhT9)));
  const float a = ax < kTanhSaturates ? ax : kTanhSaturates;  // NaN -> kTanhSaturates: no NaN reaches the exponent
  const float e = exp2_in_range(2.f * kLog2e * a);
  const float large = std::copysign(1.f - 2.f / (e + 1.f), x);
  const float t = ax < kTanhTaylorBelow ? small : large;
  return x == x ? t : x;  // NaN stays NaN
}

inline float gelu_inner(float x) { return kGeluC * (x + kGeluA * x * x * x); }

void geglu_forward(const float* g, const float* u, float* h, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float x = g[i];
    h[i] = 0.5f * x * (1.f + tanh_fast(gelu_inner(x))) * u[i];
  }
}

// d gelu_tanh(x) / dx = 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 a x^2), t = tanh(c (x + a x^3)).
inline void geglu_grads(float x, float up, float d, float& d_gate, float& d_up) {
  const float t = tanh_fast(gelu_inner(x));
  const float gelu = 0.5f * x * (1.f + t);
  const float slope = 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * kGeluC * (1.f + 3.f * kGeluA * x * x);
  d_gate = d * up * slope;
  d_up = d * gelu;
}

void geglu_backward(const float* g, const float* u, const float* dh, float* dg, float* du, int64_t n, bool accumulate) {
  if (accumulate) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      float d_gate, d_up;
      geglu_grads(g[i], u[i], dh[i], d_gate, d_up);
      dg[i] += d_gate;
      du[i] += d_up;
    }
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      float d_gate, d_up;
      geglu_grads(g[i], u[i], dh[i], d_gate, d_up);
      dg[i] = d_gate;
      du[i] = d_up;
    }
  }
}

float softcap_max(float* z, int64_t n, float cap) {
  const float inv_cap = 1.f / cap;
  float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
  for (int64_t v = 0; v < n; ++v) {
    const float c = cap * tanh_fast(z[v] * inv_cap);
    z[v] = c;
    mx = c > mx ? c : mx;
  }
  return mx;
}

void cross_entropy_grad(float* z, const float* ex, int64_t n, float p_scale, int64_t label, float loss_scale,
                        float cap) {
  if (cap > 0.f) {
    const float inv_cap = 1.f / cap;
#pragma omp simd
    for (int64_t v = 0; v < n; ++v) {
      const float th = z[v] * inv_cap;
      z[v] = (ex[v] * p_scale - (v == label ? 1.f : 0.f)) * loss_scale * (1.f - th * th);
    }
  } else {
#pragma omp simd
    for (int64_t v = 0; v < n; ++v) z[v] = (ex[v] * p_scale - (v == label ? 1.f : 0.f)) * loss_scale;
  }
}

// Folds kSumLanes partial sums pairwise (lane l with l + half), the same tree on every ISA.
inline float fold_lanes(float* lane) {
  for (int half = kSumLanes / 2; half > 0; half /= 2)
    for (int l = 0; l < half; ++l) lane[l] += lane[l + half];
  return lane[0];
}

float sum_squares(const float* x, int64_t n) {
  float lane[kSumLanes] = {};
  int64_t i = 0;
  for (; i + kSumLanes <= n; i += kSumLanes)
#pragma omp simd
    for (int l = 0; l < kSumLanes; ++l) lane[l] += x[i + l] * x[i + l];
  for (int l = 0; i + l < n; ++l) lane[l] += x[i + l] * x[i + l];
  return fold_lanes(lane);
}

float dot_scaled(const float* a, const float* b, const float* w, int64_t n) {
  float lane[kSumLanes] = {};
  int64_t i = 0;
  if (w) {
    for (; i + kSumLanes <= n; i += kSumLanes)
#pragma omp simd
      for (int l = 0; l < kSumLanes; ++l) lane[l] += a[i + l] * w[i + l] * b[i + l];
    for (int l = 0; i + l < n; ++l) lane[l] += a[i + l] * w[i + l] * b[i + l];
  } else {
    for (; i + kSumLanes <= n; i += kSumLanes)
#pragma omp simd
      for (int l = 0; l < kSumLanes; ++l) lane[l] += a[i + l] * b[i + l];
    for (int l = 0; i + l < n; ++l) lane[l] += a[i + l] * b[i + l];
  }
  return fold_lanes(lane);
}

void scale_row(const float* x, const float* w, float s, float* y, int64_t n) {
  if (w) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] * s * w[i];
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] * s;
  }
}

void rmsnorm_grad_row(const float* x, const float* w, const float* dy, float s, float c, float* dx, int64_t n) {
  if (w) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dx[i] += s * dy[i] * w[i] - x[i] * c;
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dx[i] += s * dy[i] - x[i] * c;
  }
}

}  // namespace

}  // namespace rf::model::RF_ISA_NS
RF_ISA_END

namespace rf::model {

const ElementwiseKernels& RF_ISA_EXPORT(elementwise)() {
  constexpr cpu::Isa kIsa = cpu::Isa::RF_ISA_KIND;
  namespace k = RF_ISA_NS;
  static const ElementwiseKernels set{kIsa,           k::geglu_forward,      k::geglu_backward,
                                      k::softcap_max, k::cross_entropy_grad, k::sum_squares,
                                      k::dot_scaled,  k::scale_row,          k::rmsnorm_grad_row};
  return set;
}

}  // namespace rf::model
