// The model's per-ISA elementwise kernels (src/model/elementwise.h) on every ISA this CPU runs, against the same
// formulas in double precision (std::tanh): tanh through the softcap, GeGLU forward and backward (written, in place
// and accumulated), the cross-entropy gradient, and the RMSNorm row kernels. An ISA the CPU lacks is left out of
// the sweep (the CPU is the machine the tests run on; tests/cpu runs the same sweep for the attention kernels).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cpu/isa.h"
#include "model/elementwise.h"

namespace rf::model {
namespace {

using Vec = std::vector<float>;

constexpr double kGeluC = 0.7978845608028654, kGeluA = 0.044715;

std::vector<const ElementwiseKernels*> kernels_this_cpu_runs() {
  const cpu::CpuFeatures f = cpu::detect_cpu();
  std::vector<const ElementwiseKernels*> sets = {&elementwise_for(cpu::Isa::Scalar)};
  if (f.avx2) sets.push_back(&elementwise_for(cpu::Isa::Avx2));
  if (f.avx512) sets.push_back(&elementwise_for(cpu::Isa::Avx512));
  return sets;
}

Vec random_vec(size_t n, uint64_t seed, float lo, float hi) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  Vec v(n);
  for (float& x : v) x = u(rng);
  return v;
}

// Arguments that cross every branch of the kernels' tanh: the Taylor polynomial below 1/4, the exp form above it,
// the saturation at 10, and lengths that are not a multiple of any vector width (1013 elements: vector tails).
Vec tanh_arguments() {
  Vec x = random_vec(1013, 7, -12.f, 12.f);
  for (float v : {0.f,   -0.f, 1e-30f, -1e-30f, 1e-6f, 0.2499999f, 0.25f, 0.2500001f, -0.25f, 0.5f, 1.f,  3.f,
                  8.99f, 9.f,  9.02f,  -9.02f,  9.99f, 10.f,       10.5f, 20.f,       -20.f,  88.f, 1e30f})
    x.push_back(v);
  for (int i = 0; i < 200; ++i) x.push_back(-0.3f + 0.003f * static_cast<float>(i));  // around the 1/4 switch
  return x;
}

double gelu(double x) { return 0.5 * x * (1.0 + std::tanh(kGeluC * (x + kGeluA * x * x * x))); }
double gelu_slope(double x) {
  const double t = std::tanh(kGeluC * (x + kGeluA * x * x * x));
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * kGeluC * (1.0 + 3.0 * kGeluA * x * x);
}

// The kernels' tanh has a relative error below 1e-6 (elementwise.h): near 0 the Taylor polynomial is exact to
// 9e-9 plus float32 rounding of five terms (~4 ulp); above 1/4, 1 - 2/(e + 1) loses at most 2 bits to cancellation
// and the exp carries ~2 ulp, so ~16 ulp = 1e-6 relative at worst.
constexpr double kTanhRelTol = 1e-6;

TEST(ModelElementwise, SoftcapIsCapTimesTanhAndReturnsTheMax) {
  for (const ElementwiseKernels* k : kernels_this_cpu_runs()) {
    const std::string isa = cpu::isa_name(k->isa);
    for (float cap : {1.f, 30.f}) {
      const Vec x = tanh_arguments();
      Vec z(x.size());
      for (size_t i = 0; i < x.size(); ++i) z[i] = x[i] * cap;
      const float mx = k->softcap_max(z.data(), static_cast<int64_t>(z.size()), cap);
      float want_max = -std::numeric_limits<float>::infinity();
      for (size_t i = 0; i < x.size(); ++i) {
        const double want = cap * std::tanh(static_cast<double>(x[i] * cap) / cap);
        EXPECT_NEAR(z[i], want, kTanhRelTol * std::fabs(want) + 1e-38) << isa << " cap " << cap << " x " << x[i];
        want_max = std::max(want_max, z[i]);
      }
      EXPECT_EQ(mx, want_max) << isa;
    }
    // Infinities saturate, NaN stays NaN and is skipped by the max; an empty row's max is -inf.
    Vec special = {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                   std::numeric_limits<float>::quiet_NaN(), 0.5f};
    const float mx = k->softcap_max(special.data(), 4, 1.f);
    EXPECT_EQ(special[0], 1.f) << isa;
    EXPECT_EQ(special[1], -1.f) << isa;
    EXPECT_TRUE(std::isnan(special[2])) << isa;
    EXPECT_EQ(mx, 1.f) << isa;
    EXPECT_EQ(k->softcap_max(special.data(), 0, 1.f), -std::numeric_limits<float>::infinity()) << isa;
  }
}

// GeGLU's outputs are products with gelu(x) = x (1 + t) / 2: an error e in t moves them by |x u| e / 2, so they
// are compared against |x u| (1 + |x|) (the slope carries one more factor of x) times the tanh tolerance, plus
// float32 rounding of the few products (8 ulp of the result).
constexpr double kProductUlps = 8 * 0x1p-24;

TEST(ModelElementwise, GegluForwardAndBackwardMatchDouble) {
  const int64_t n = 1013;
  const Vec g = random_vec(n, 11, -6.f, 6.f), u = random_vec(n, 12, -2.f, 2.f), dh = random_vec(n, 13, -1.f, 1.f);
  for (const ElementwiseKernels* k : kernels_this_cpu_runs()) {
    const std::string isa = cpu::isa_name(k->isa);
    Vec h(n), dg(n), du(n);
    k->geglu_forward(g.data(), u.data(), h.data(), n);
    k->geglu_backward(g.data(), u.data(), dh.data(), dg.data(), du.data(), n, false);
    for (int64_t i = 0; i < n; ++i) {
      const double x = g[i], scale = std::fabs(x * u[i]) * (1.0 + std::fabs(x)) + std::fabs(x);
      const double want_h = gelu(x) * u[i], want_dg = dh[i] * u[i] * gelu_slope(x), want_du = dh[i] * gelu(x);
      EXPECT_NEAR(h[i], want_h, kTanhRelTol * scale + kProductUlps * std::fabs(want_h)) << isa << " x " << x;
      EXPECT_NEAR(dg[i], want_dg, kTanhRelTol * scale + kProductUlps * std::fabs(want_dg)) << isa << " x " << x;
      EXPECT_NEAR(du[i], want_du, kTanhRelTol * scale + kProductUlps * std::fabs(want_du)) << isa << " x " << x;
    }
    // Accumulating adds the written values to what was there: one rounding more, or one fewer where the ISA fuses
    // the last product with the add (2 ulp of the O(1) sum).
    Vec dg_acc(n, 0.5f), du_acc(n, -0.25f);
    k->geglu_backward(g.data(), u.data(), dh.data(), dg_acc.data(), du_acc.data(), n, true);
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_NEAR(dg_acc[i], 0.5f + dg[i], 2 * 0x1p-24 * (0.5 + std::fabs(dg[i]))) << isa;
      EXPECT_NEAR(du_acc[i], -0.25f + du[i], 2 * 0x1p-24 * (0.25 + std::fabs(du[i]))) << isa;
    }
    // In place (the MoE experts overwrite gate and up with their gradients): the same bits as out of place.
    Vec gate_up(2 * n);
    std::copy(g.begin(), g.end(), gate_up.begin());
    std::copy(u.begin(), u.end(), gate_up.begin() + n);
    k->geglu_backward(gate_up.data(), gate_up.data() + n, dh.data(), gate_up.data(), gate_up.data() + n, n, false);
    EXPECT_EQ(Vec(gate_up.begin(), gate_up.begin() + n), dg) << isa;
    EXPECT_EQ(Vec(gate_up.begin() + n, gate_up.end()), du) << isa;
  }
}

TEST(ModelElementwise, CrossEntropyGradientMatchesDouble) {
  const int64_t n = 517, label = 300;
  const float cap = 30.f, p_scale = 0.01f, loss_scale = 0.125f;
  const Vec ex = random_vec(n, 21, 0.f, 1.f);
  Vec capped = random_vec(n, 22, -29.f, 29.f);
  for (const ElementwiseKernels* k : kernels_this_cpu_runs()) {
    for (float c : {cap, 0.f}) {
      Vec z = capped;
      k->cross_entropy_grad(z.data(), ex.data(), n, p_scale, label, loss_scale, c);
      for (int64_t v = 0; v < n; ++v) {
        const double th = c > 0.f ? capped[v] / static_cast<double>(c) : 0.0;
        const double want = (ex[v] * double{p_scale} - (v == label ? 1.0 : 0.0)) * loss_scale * (1.0 - th * th);
        // A handful of float32 operations on O(1) values: 8 ulp of the largest term.
        EXPECT_NEAR(z[v], want, kProductUlps) << cpu::isa_name(k->isa) << " v " << v;
      }
    }
  }
}

TEST(ModelElementwise, RmsNormRowKernelsMatchDouble) {
  for (int64_t n : {1, 15, 16, 17, 72, 256, 640}) {
    const Vec x = random_vec(n, 31, -2.f, 2.f), w = random_vec(n, 32, 0.5f, 1.5f), dy = random_vec(n, 33, -1.f, 1.f);
    for (const ElementwiseKernels* k : kernels_this_cpu_runs()) {
      const std::string isa = cpu::isa_name(k->isa);
      double ss = 0, abs_dot = 0, dot_w = 0, dot = 0;
      for (int64_t i = 0; i < n; ++i) {
        ss += double{x[i]} * x[i];
        dot_w += double{dy[i]} * w[i] * x[i];
        dot += double{dy[i]} * x[i];
        abs_dot += std::fabs(double{dy[i]} * w[i] * x[i]);
      }
      // Blocked float32 sums: each lane adds n / 16 terms, then 4 folds: (n / 16 + 4) roundings of at most the sum
      // of magnitudes each, 2^-24 relative.
      const double sum_tol = (static_cast<double>(n) / kSumLanes + 4) * 0x1p-24;
      EXPECT_NEAR(k->sum_squares(x.data(), n), ss, sum_tol * ss) << isa << " n " << n;
      EXPECT_NEAR(k->dot_scaled(dy.data(), x.data(), w.data(), n), dot_w, 2 * sum_tol * abs_dot) << isa;
      EXPECT_NEAR(k->dot_scaled(dy.data(), x.data(), nullptr, n), dot, 2 * sum_tol * abs_dot * 2) << isa;
      Vec y(n), dx(n, 1.f);
      const float s = 0.75f, c = 0.125f;
      k->scale_row(x.data(), w.data(), s, y.data(), n);
      k->rmsnorm_grad_row(x.data(), w.data(), dy.data(), s, c, dx.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        const double want_y = double{x[i]} * s * w[i];
        const double want_dx = 1.0 + double{s} * dy[i] * w[i] - double{x[i]} * c;
        // Two or three roundings (one fewer where the ISA fuses a multiply-add).
        EXPECT_NEAR(y[i], want_y, 4 * 0x1p-24 * std::fabs(want_y)) << isa;
        EXPECT_NEAR(dx[i], want_dx, 8 * 0x1p-24 * 3.0) << isa;
      }
    }
  }
}

TEST(ModelElementwise, RunsTheIsaTheAttentionKernelsChose) { EXPECT_EQ(elementwise().isa, cpu::kernel_path().isa); }

}  // namespace
}  // namespace rf::model
