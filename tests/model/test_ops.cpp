// Tests of the model's float32 building blocks: each backward against central finite differences of its
// forward (the ops are smooth and their inputs O(1), so one float32 step of 1e-3 suffices with the tolerance
// derived below), RoPE's backward as the transpose of its forward, and the chunked fused LM-head loss against an
// unchunked computation in double.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <vector>

#include "core/error.h"
#include "model/loss.h"
#include "model/ops.h"
#include "model/stream_rows.h"

namespace rf::model {
namespace {

using Vec = std::vector<float>;

Vec random_vec(size_t n, uint64_t seed, float lo = -1.f, float hi = 1.f) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  Vec v(n);
  for (float& x : v) x = u(rng);
  return v;
}

// A scalar probe of an op: loss = sum(probe * op(inputs)), so d loss / d output = probe.
double dot(const Vec& a, const Vec& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += double{a[i]} * b[i];
  return s;
}

// Central difference of f at x along element i, step h.
double central(const std::function<double()>& f, float& x, float h) {
  const float keep = x;
  x = keep + h;
  const double up = f();
  x = keep - h;
  const double down = f();
  x = keep;
  return (up - down) / (2.0 * h);
}

// Step 1e-3 on O(1) inputs: truncation error O(h^2) ~ 1e-6; float32 rounding of a sum of ~100 O(1) terms is
// ~1e-5 absolute, divided by 2h gives ~5e-3 worst case. Hence 1e-2 absolute plus 1e-2 relative.
constexpr float kStep = 1e-3f;
constexpr double kAbsTol = 1e-2, kRelTol = 1e-2;

void expect_close(double fd, double analytic, const char* what, size_t i) {
  EXPECT_NEAR(fd, analytic, kAbsTol + kRelTol * std::fabs(analytic)) << what << " element " << i;
}

TEST(ModelOps, RmsNormBackwardMatchesFiniteDifferences) {
  const int64_t R = 3, n = 8;
  for (bool with_scale : {true, false}) {
    Vec x = random_vec(R * n, 1), w = random_vec(n, 2, 0.5f, 1.5f), probe = random_vec(R * n, 3);
    Vec y(R * n), inv(R);
    auto loss = [&] {
      rmsnorm_forward(x.data(), with_scale ? w.data() : nullptr, 1e-6f, y.data(), inv.data(), R, n);
      return dot(y, probe);
    };
    loss();
    Vec dx(R * n, 0.f), dw(n, 0.f);
    rmsnorm_backward(x.data(), with_scale ? w.data() : nullptr, inv.data(), probe.data(), dx.data(), dw.data(), R, n);
    for (size_t i = 0; i < x.size(); ++i) expect_close(central(loss, x[i], kStep), dx[i], "rmsnorm dx", i);
    if (with_scale)
      for (size_t i = 0; i < w.size(); ++i) expect_close(central(loss, w[i], kStep), dw[i], "rmsnorm dw", i);
  }
}

// Model outputs are not zero-filled before an sgemm writes them (src/model/gemma4_run.h: uninit), so beta = 0 must
// write C without reading it even when K = 0 leaves OpenBLAS out: a NaN there must not survive as NaN * 0.
TEST(ModelOps, GemmWithBetaZeroNeverReadsC) {
  const int64_t M = 3, N = 40;
  for (int64_t K : {0, 5}) {
    const Vec a(static_cast<size_t>(M * std::max<int64_t>(K, 1)), 1.f),
        b(static_cast<size_t>(std::max<int64_t>(K, 1) * N), 2.f);
    Vec c(static_cast<size_t>(M * N), std::numeric_limits<float>::quiet_NaN());
    gemm(false, false, M, N, K, 1.f, a.data(), std::max<int64_t>(K, 1), b.data(), N, 0.f, c.data(), N);
    for (float v : c) EXPECT_EQ(v, 2.f * static_cast<float>(K)) << "K = " << K;
  }
}

// A decode step's products (model/stream_rows.h): each element one dot product over K, against a float64 oracle;
// a row's bits the same alone as among the step's other rows and at any thread count (a sequence's tokens do not
// depend on the batch it is decoded in); beta = 1 accumulates and beta = 0 never reads C; a row past kStreamRowsMax
// goes to sgemm, and without the scope every product does (training's bits).
TEST(ModelOps, StreamRowsProductsAreDotProductsWhateverTheRowsAndThreads) {
  const int64_t K = 1000, N = 700;  // N * K above kParallelMinElements: the panels are split over the threads
  const Vec W = random_vec(N * K, 11);
  const Matmul mm;
  std::optional<StreamRowsScope> scope;
  scope.emplace();
  for (int64_t M : {int64_t{1}, int64_t{3}, kStreamRowsMax}) {
    const Vec x = random_vec(M * K, 12 + M);
    Vec y(M * N, std::numeric_limits<float>::quiet_NaN());
    gemm(mm, false, true, M, N, K, 1.f, x.data(), K, W.data(), K, 0.f, y.data(), N);
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t n = 0; n < N; ++n) {
        double want = 0;
        for (int64_t k = 0; k < K; ++k) want += double{x[m * K + k]} * W[n * K + k];
        // A float32 sum of K = 1000 products of O(1): error ~ sqrt(K) 2^-24 |terms| ~ 1e-5; 1e-4 leaves room.
        ASSERT_NEAR(y[m * N + n], want, 1e-4) << "M = " << M << " row " << m << " column " << n;
      }
      Vec alone(N);
      for (int threads : {1, 2}) {
        const int keep = omp_get_max_threads();
        omp_set_num_threads(threads);
        gemm(mm, false, true, 1, N, K, 1.f, x.data() + m * K, K, W.data(), K, 0.f, alone.data(), N);
        omp_set_num_threads(keep);
        for (int64_t n = 0; n < N; ++n)
          ASSERT_EQ(alone[n], y[m * N + n]) << "row " << m << " alone, " << threads << " threads, column " << n;
      }
    }
    Vec twice = y;
    gemm(mm, false, true, M, N, K, 1.f, x.data(), K, W.data(), K, 1.f, twice.data(), N);
    for (size_t i = 0; i < y.size(); ++i) ASSERT_EQ(twice[i], y[i] + y[i]) << "beta = 1, element " << i;
  }
  // Past kStreamRowsMax: sgemm, the bits of the product outside the scope.
  const int64_t M = kStreamRowsMax + 1;
  const Vec x = random_vec(M * K, 13);
  Vec inside(M * N), outside(M * N), sgemm_row(N);
  gemm(mm, false, true, M, N, K, 1.f, x.data(), K, W.data(), K, 0.f, inside.data(), N);
  scope.reset();
  EXPECT_FALSE(streaming_rows());
  gemm(mm, false, true, M, N, K, 1.f, x.data(), K, W.data(), K, 0.f, outside.data(), N);
  EXPECT_EQ(inside, outside);
  // Outside the scope a one-row product is sgemm's, as training's one-token experts are: the oracle is the sgemm
  // path itself (the plain float32 gemm), bit for bit.
  Vec plain(N);
  gemm(mm, false, true, 1, N, K, 1.f, x.data(), K, W.data(), K, 0.f, sgemm_row.data(), N);
  gemm(false, true, 1, N, K, 1.f, x.data(), K, W.data(), K, 0.f, plain.data(), N);
  EXPECT_EQ(sgemm_row, plain);
}

// The attention projections of a decode step (L = 1, in a StreamRowsScope): one product over all heads, the same
// layout and, within float32 rounding, the same values as training's product a head at a time.
TEST(ModelOps, StreamRowsHeadProjectionsMatchTheHeadByHeadProducts) {
  const int B = 3, heads = 4;
  const int64_t K = 96, D = 32, N = 80;
  const Vec x = random_vec(B * K, 21), Wq = random_vec(heads * D * K, 22), o = random_vec(B * heads * D, 23),
            Wo = random_vec(N * heads * D, 24);
  Vec q_stream(B * heads * D), q_heads(B * heads * D), y_stream(B * N), y_heads(B * N);
  heads_forward(Matmul{}, x.data(), Wq.data(), q_heads.data(), B, 1, K, heads, D);
  merge_heads_forward(Matmul{}, o.data(), Wo.data(), y_heads.data(), B, 1, heads, D, N);
  {
    const StreamRowsScope scope;
    heads_forward(Matmul{}, x.data(), Wq.data(), q_stream.data(), B, 1, K, heads, D);
    merge_heads_forward(Matmul{}, o.data(), Wo.data(), y_stream.data(), B, 1, heads, D, N);
  }
  // Sums of at most 128 products of O(1) in two orders: ~1e-5 apart.
  for (size_t i = 0; i < q_heads.size(); ++i) ASSERT_NEAR(q_stream[i], q_heads[i], 1e-4) << "q element " << i;
  for (size_t i = 0; i < y_heads.size(); ++i) ASSERT_NEAR(y_stream[i], y_heads[i], 1e-4) << "o_proj element " << i;
}

TEST(ModelOps, LinearBackwardMatchesFiniteDifferences) {
  const int64_t T = 5, K = 7, N = 3;
  Vec x = random_vec(T * K, 4), W = random_vec(N * K, 5), probe = random_vec(T * N, 6), y(T * N);
  auto loss = [&] {
    linear_forward(Matmul{}, x.data(), W.data(), y.data(), T, K, N);
    return dot(y, probe);
  };
  Vec dx(T * K, 0.f), dW(N * K, 0.f);
  linear_backward(Matmul{}, x.data(), W.data(), probe.data(), dx.data(), dW.data(), T, K, N);
  for (size_t i = 0; i < x.size(); ++i) expect_close(central(loss, x[i], kStep), dx[i], "linear dx", i);
  for (size_t i = 0; i < W.size(); ++i) expect_close(central(loss, W[i], kStep), dW[i], "linear dW", i);
}

TEST(ModelOps, GegluBackwardMatchesFiniteDifferences) {
  const int64_t n = 40;
  Vec g = random_vec(n, 7, -3.f, 3.f), u = random_vec(n, 8), probe = random_vec(n, 9), h(n);
  auto loss = [&] {
    geglu_forward(g.data(), u.data(), h.data(), n);
    return dot(h, probe);
  };
  Vec dg(n, 0.f), du(n, 0.f);
  geglu_backward(g.data(), u.data(), probe.data(), dg.data(), du.data(), n, true);
  for (int64_t i = 0; i < n; ++i) {
    expect_close(central(loss, g[i], kStep), dg[i], "geglu dg", i);
    expect_close(central(loss, u[i], kStep), du[i], "geglu du", i);
  }
}

TEST(ModelOps, GegluMatchesClosedFormGelu) {
  // Hand values of 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) computed in double, through GeGLU with u = 1.
  // 1e-6: float32 rounding plus the kernels' tanh (a few ulp of 1, elementwise_kernels.cpp), which the factor
  // 0.5 |x| <= 1 does not enlarge; the exact (erf) GELU is 1.5e-4 away at x = 1.
  const Vec g = {0.f, 1.f, -2.f}, u(g.size(), 1.f);
  Vec h(g.size());
  geglu_forward(g.data(), u.data(), h.data(), static_cast<int64_t>(g.size()));
  EXPECT_EQ(h[0], 0.f);
  EXPECT_NEAR(h[1], 0.8411919906082768, 1e-6);
  EXPECT_NEAR(h[2], -0.04540230591222967, 1e-6);
}

TEST(ModelOps, RopeInverseIsTheTransposeAndPartialRopeLeavesTheRest) {
  const int64_t T = 4;
  const int heads = 2, D = 16;
  const std::vector<int32_t> pos = {0, 3, 7, 100};
  for (bool proportional : {false, true}) {
    const RopeTable r = make_rope_table(pos.data(), T, D, proportional, 10000.0, 0.25, 1.0);
    Vec x = random_vec(T * heads * D, 10), y = x, probe = random_vec(T * heads * D, 11);
    rope_apply(y.data(), r, T, heads, false);
    // <R x, p> == <x, R^T p>: the backward is the transpose of the forward.
    Vec pt = probe;
    rope_apply(pt.data(), r, T, heads, true);
    EXPECT_NEAR(dot(y, probe), dot(x, pt), 1e-4) << "proportional " << proportional;
    // Position 0 is the identity; with proportional RoPE (factor 0.25 of D/2 = 8 pairs -> 2 rotated) pairs 2..7
    // are never rotated.
    for (int i = 0; i < heads * D; ++i) EXPECT_FLOAT_EQ(y[i], x[i]);
    if (proportional) {
      for (int64_t t = 0; t < T; ++t)
        for (int h = 0; h < heads; ++h)
          for (int i : {2, 7, 10, 15}) EXPECT_FLOAT_EQ(y[(t * heads + h) * D + i], x[(t * heads + h) * D + i]);
    }
  }
}

// The unchunked loss in double: logits, cap, log-softmax, mean over label tokens, and its gradients.
struct PlainLoss {
  double loss = 0;
  std::vector<double> token_loss, dx, dW;
};
PlainLoss plain_loss(const Vec& x, const Vec& W, const std::vector<int32_t>& labels, int64_t T, int64_t H, int64_t V,
                     double cap) {
  PlainLoss p;
  p.token_loss.assign(T, 0);
  p.dx.assign(T * H, 0);
  p.dW.assign(V * H, 0);
  int64_t n = 0;
  for (int32_t l : labels) n += l != kIgnoreLabel;
  for (int64_t t = 0; t < T; ++t) {
    if (labels[t] == kIgnoreLabel) continue;
    std::vector<double> z(V), c(V);
    double mx = -1e300;
    for (int64_t v = 0; v < V; ++v) {
      for (int64_t i = 0; i < H; ++i) z[v] += double{x[t * H + i]} * W[v * H + i];
      c[v] = cap * std::tanh(z[v] / cap);
      mx = std::max(mx, c[v]);
    }
    double s = 0;
    for (int64_t v = 0; v < V; ++v) s += std::exp(c[v] - mx);
    const double lse = mx + std::log(s);
    p.token_loss[t] = lse - c[labels[t]];
    p.loss += p.token_loss[t] / n;
    for (int64_t v = 0; v < V; ++v) {
      const double th = std::tanh(z[v] / cap);
      const double g = (std::exp(c[v] - lse) - (v == labels[t])) / n * (1 - th * th);
      for (int64_t i = 0; i < H; ++i) {
        p.dx[t * H + i] += g * W[v * H + i];
        p.dW[v * H + i] += g * x[t * H + i];
      }
    }
  }
  return p;
}

TEST(ModelLoss, ChunkedMatchesUnchunkedForEveryChunkSize) {
  const int64_t T = 13, H = 6, V = 50;
  const double cap = 3.0;  // small, so the cap is far from the identity on these logits
  Vec x = random_vec(T * H, 12, -2.f, 2.f), W = random_vec(V * H, 13, -2.f, 2.f);
  std::vector<int32_t> labels(T);
  for (int64_t t = 0; t < T; ++t) labels[t] = t % 4 == 1 ? kIgnoreLabel : static_cast<int32_t>((t * 7) % V);
  const PlainLoss ref = plain_loss(x, W, labels, T, H, V, cap);
  for (int64_t chunk : {1, 4, 5, 13, 64}) {
    Vec token(T), dx(T * H, 0.f), dW(V * H, 0.f), logits(T * V);
    LmHeadLossArgs a{x.data(), W.data(), labels.data(), T, H, V, static_cast<float>(cap), 0.f,
                     chunk,    Matmul{}, HeldWeight{},  0};
    int64_t n = 0;
    for (int32_t l : labels) n += l != kIgnoreLabel;
    a.loss_scale = 1.f / static_cast<float>(n);
    const double loss = lm_head_loss(a, LmHeadLossOut{token.data(), logits.data(), dx.data(), dW.data()});
    // float32 logits over H = 6 terms and a float32 softmax against double: a few ulps of O(1) values.
    constexpr double kTol = 1e-5;
    EXPECT_NEAR(loss, ref.loss, kTol) << "chunk " << chunk;
    for (int64_t t = 0; t < T; ++t) EXPECT_NEAR(token[t], ref.token_loss[t], kTol) << "token " << t;
    for (size_t i = 0; i < dx.size(); ++i) EXPECT_NEAR(dx[i], ref.dx[i], kTol) << "dx " << i;
    for (size_t i = 0; i < dW.size(); ++i) EXPECT_NEAR(dW[i], ref.dW[i], kTol) << "dW " << i;
    for (int64_t v = 0; v < V; ++v) {
      double z = 0;
      for (int64_t i = 0; i < H; ++i) z += double{x[i]} * W[v * H + i];
      EXPECT_NEAR(logits[v], cap * std::tanh(z / cap), kTol);
    }
  }
}

// The float32 log-sum-exp over a Gemma-sized vocabulary against double. H = 1 and x = 1, so the logits are W's
// column exactly and dW is the logits' gradient itself. Error bound of the loss (lse - z[label]): the exps sum in
// float32 lanes of 16 terms folded into double, at most 19 roundings (19 * 2^-24 = 1.1e-6 relative); each exp is
// the vector exp2 (< 3e-7 relative) of (z - max) * log2(e), whose rounding adds |z - max| * 2^-24 <= 60 * 2^-24 =
// 3.6e-6 relative (softcap 30: logits within +-30); a relative error r of the sum is an absolute error r of the
// lse, so |loss error| <= 5e-6. Each gradient element p - onehot: p's own error (that bound plus ~2 roundings) times
// p, plus one rounding of (p - 1) at the label (<= 2^-23).
TEST(ModelLoss, Float32LogSumExpOverLargeVocabularyMatchesDouble) {
  const float cap = 30.f;
  constexpr double kLossTol = 5e-6, kGradRelTol = 5e-6, kGradAbsTol = 1.2e-7;
  for (const int64_t V : {int64_t{262144}, int64_t{262144} + 5}) {  // + 5: a tail past the 16-lane blocks
    for (const float spread : {1.f, 60.f}) {                        // near-flat softmax, and a peaked one
      Vec w = random_vec(static_cast<size_t>(V), 40 + static_cast<uint64_t>(spread), -spread, spread);
      const int32_t label = static_cast<int32_t>(V / 3);
      const float one = 1.f;
      Vec logits(static_cast<size_t>(V)), dW(static_cast<size_t>(V), 0.f);
      LmHeadLossArgs a{&one, w.data(), &label, 1, 1, V, cap, 1.f, 1, Matmul{}, HeldWeight{}, 0};
      const double loss = lm_head_loss(a, LmHeadLossOut{nullptr, logits.data(), nullptr, dW.data()});
      double mx = -1e300, sum = 0.0;
      for (float z : logits) mx = std::max(mx, double{z});
      for (float z : logits) sum += std::exp(double{z} - mx);
      const double lse = mx + std::log(sum);
      EXPECT_NEAR(loss, lse - logits[label], kLossTol) << "V " << V << " spread " << spread;
      int bad = 0;
      for (int64_t v = 0; v < V && bad < 5; ++v) {
        const double p = std::exp(double{logits[v]} - lse);
        const double th = double{logits[v]} / cap;
        const double g = (p - (v == label)) * (1 - th * th);
        const bool ok = std::abs(dW[v] - g) <= kGradRelTol * p + kGradAbsTol;
        EXPECT_TRUE(ok) << "V " << V << " spread " << spread << " v " << v << ": " << dW[v] << " vs " << g;
        bad += !ok;
      }
    }
  }
}

// A frozen head held in bf16 (or float32 read the same way), read by panels of vocabulary rows, against the same
// values widened whole, in both compute modes; panel sizes from one row to more than V. The logits are the same K = H
// dot products (each element's sum over H runs in the same order); dx's sum over V is cut at the panels' edges, a
// float32 partial per panel added into dx in vocabulary order: 50 terms, each below 0.2 (g <= 1/n times |W| <= 2),
// reassociated, differ by at most ~50 * 0.2 * 2^-24 = 6e-7 (float32 mode) and, in the bf16 mode, by the same
// reassociation of products of bf16 operands accumulated in float32. The loss is the same logits' loss: only a
// tolerance for a BLAS whose edge kernels (a panel's width is a new N) round their FMAs differently, a few ulps of
// O(1).
TEST(ModelLoss, AHeldHeadReadByPanelsMatchesTheHeadWidenedWhole) {
  const int64_t T = 13, H = 6, V = 50;
  const float cap = 3.f;
  const Vec x = random_vec(T * H, 21, -2.f, 2.f), W32 = random_vec(V * H, 22, -2.f, 2.f);
  std::vector<bf16> Wb(W32.size());
  for (size_t i = 0; i < W32.size(); ++i) Wb[i] = float_to_bf16(W32[i]);
  Vec Ww(W32.size());  // the bf16 values widened (exact)
  for (size_t i = 0; i < Wb.size(); ++i) Ww[i] = bf16_to_float(Wb[i]);
  std::vector<int32_t> labels(T);
  for (int64_t t = 0; t < T; ++t) labels[t] = t % 4 == 1 ? kIgnoreLabel : static_cast<int32_t>((t * 11) % V);
  constexpr double kLogitTol = 1e-5, kDxTol = 1e-6;
  for (const ComputeDtype mode : {ComputeDtype::Float32, ComputeDtype::Bfloat16}) {
    for (const HeldDType held : {HeldDType::BF16, HeldDType::F32}) {
      LmHeadLossArgs a{x.data(),     Ww.data(), labels.data(), T, H, V, cap, 1.f / 10, 4, Matmul{mode, nullptr},
                       HeldWeight{}, 0};
      Vec token(T), dx(T * H, 0.f), logits(T * V);
      const double loss = lm_head_loss(a, LmHeadLossOut{token.data(), logits.data(), dx.data(), nullptr});
      for (const int64_t panel : {1, 7, 16, 50, 64}) {
        SCOPED_TRACE(testing::Message() << "mode " << static_cast<int>(mode) << " held " << static_cast<int>(held)
                                        << " panel " << panel);
        LmHeadLossArgs b = a;
        b.W = nullptr;
        b.head = {held, held == HeldDType::BF16 ? static_cast<const void*>(Wb.data()) : Ww.data()};
        b.panel_rows = panel;
        Vec token_p(T), dx_p(T * H, 0.f), logits_p(T * V);
        const double loss_p = lm_head_loss(b, LmHeadLossOut{token_p.data(), logits_p.data(), dx_p.data(), nullptr});
        EXPECT_NEAR(loss_p, loss, kLogitTol);
        for (size_t i = 0; i < logits.size(); ++i) ASSERT_NEAR(logits_p[i], logits[i], kLogitTol) << "logit " << i;
        for (int64_t t = 0; t < T; ++t) EXPECT_NEAR(token_p[t], token[t], kLogitTol) << "token " << t;
        for (size_t i = 0; i < dx.size(); ++i) ASSERT_NEAR(dx_p[i], dx[i], kDxTol) << "dx " << i;
      }
    }
  }
}

// A held head is frozen: no dW through it; and the panel's scratch is what the memory model counts (loss.h).
TEST(ModelLoss, AHeldHeadTakesNoGradientAndItsPanelIsSmall) {
  const int64_t T = 2, H = 2, V = 3;
  Vec x(T * H, 0.1f), W(V * H, 0.1f), dx(T * H), dW(V * H);
  const std::vector<int32_t> labels = {1, 2};
  LmHeadLossArgs a{x.data(), nullptr, labels.data(), T, H, V, 0.f, 1.f, 1, Matmul{}, HeldWeight{}, 0};
  a.head = {HeldDType::F32, W.data()};
  EXPECT_THROW(lm_head_loss(a, LmHeadLossOut{nullptr, nullptr, dx.data(), dW.data()}), rf::Error);
  a.head = {};
  EXPECT_THROW(lm_head_loss(a, LmHeadLossOut{nullptr, nullptr, dx.data(), nullptr}), rf::Error);
  // Gemma 4 E2B's tied head, 262144 x 1536: 682 rows of float32 (kHeadPanelBytes = 4 MiB) against 1.5 GiB widened.
  EXPECT_EQ(head_panel_rows(1536), 682);
  EXPECT_EQ(head_panel_bytes(262144, 1536), int64_t{682} * 1536 * 4);
  EXPECT_EQ(head_panel_bytes(40, 16), 40 * 16 * 4);  // a head smaller than a panel: one panel of V rows
}

TEST(ModelLoss, RejectsLabelsOutsideTheVocabulary) {
  const int64_t T = 2, H = 2, V = 3;
  Vec x(T * H, 0.1f), W(V * H, 0.1f), token(T);
  const std::vector<int32_t> labels = {1, 3};
  LmHeadLossArgs a{x.data(), W.data(), labels.data(), T, H, V, 0.f, 1.f, 1, Matmul{}, HeldWeight{}, 0};
  EXPECT_THROW(lm_head_loss(a, LmHeadLossOut{token.data(), nullptr, nullptr, nullptr}), rf::Error);
}

// As many tokens as the budget holds, never fewer than kMinLossChunkTokens (the head's packing share, loss.h).
TEST(ModelLoss, ChunkSizeKeepsOneChunkWithinBudgetAboveTheFloor) {
  constexpr int64_t k64MiB = int64_t{64} << 20;
  EXPECT_EQ(loss_chunk_tokens(4096, k64MiB), 4096);
  EXPECT_EQ(loss_chunk_tokens(16384, k64MiB), 1024);
  EXPECT_EQ(loss_chunk_tokens(262144, k64MiB), kMinLossChunkTokens);
  EXPECT_EQ(loss_chunk_tokens(262144, 16), kMinLossChunkTokens);
}

}  // namespace
}  // namespace rf::model
