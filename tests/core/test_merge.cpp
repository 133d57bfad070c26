// The LSE merge: two partial softmaxes over disjoint key sets equal one softmax over their union; -inf on either
// side (an empty partial) is handled without NaN. The oracle is a direct double-precision softmax.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/merge.h"

namespace rf {
namespace {

// Softmax-weighted sum of v over scores s (double): returns o [D] and lse; lse = -inf when s is empty.
void softmax_attend(const std::vector<double>& s, const std::vector<std::vector<double>>& v, int D,
                    std::vector<double>& o, double& lse) {
  o.assign(D, 0.0);
  if (s.empty()) {
    lse = -INFINITY;
    return;
  }
  double mx = -INFINITY;
  for (double x : s) mx = std::fmax(mx, x);
  double sum = 0;
  for (double x : s) sum += std::exp(x - mx);
  lse = mx + std::log(sum);
  for (size_t j = 0; j < s.size(); ++j)
    for (int d = 0; d < D; ++d) o[d] += std::exp(s[j] - lse) * v[j][d];
}

TEST(Merge, TwoPartialsEqualOneSoftmax) {
  std::mt19937 rng(1);
  std::uniform_real_distribution<double> u(-8, 8);
  const int D = 5;
  for (int trial = 0; trial < 200; ++trial) {
    const int na = trial % 7, nb = (trial / 7) % 5;  // includes empty sides
    std::vector<double> sa(na), sb(nb), s;
    std::vector<std::vector<double>> va(na, std::vector<double>(D)), vb(nb, std::vector<double>(D)), v;
    for (int j = 0; j < na; ++j) {
      sa[j] = u(rng);
      for (double& x : va[j]) x = u(rng);
    }
    for (int j = 0; j < nb; ++j) {
      sb[j] = u(rng);
      for (double& x : vb[j]) x = u(rng);
    }
    s = sa;
    s.insert(s.end(), sb.begin(), sb.end());
    v = va;
    v.insert(v.end(), vb.begin(), vb.end());
    std::vector<double> oa, ob, o;
    double la, lb, l;
    softmax_attend(sa, va, D, oa, la);
    softmax_attend(sb, vb, D, ob, lb);
    softmax_attend(s, v, D, o, l);

    std::vector<float> acc(oa.begin(), oa.end()), part(ob.begin(), ob.end());
    float lse_acc = static_cast<float>(la), lse_part = static_cast<float>(lb);
    merge_partial(acc.data(), &lse_acc, part.data(), &lse_part, 1, D);
    if (std::isinf(l)) {
      EXPECT_EQ(lse_acc, kNegInf);
    } else {
      // Inputs are rounded to float32 (|v| <= 8, |lse| <= ~10); each output is a convex combination, so a few
      // float32 ulps of the largest magnitude bound the error.
      EXPECT_NEAR(lse_acc, l, 8 * 16 * 6e-8);
    }
    for (int d = 0; d < D; ++d) {
      EXPECT_TRUE(std::isfinite(acc[d]));
      EXPECT_NEAR(acc[d], o[d], 8 * 8 * 6e-8) << "trial " << trial << " d " << d;
    }
  }
}

TEST(Merge, NegativeInfinityOnEitherSide) {
  const MergeWeights both = merge_weights(kNegInf, kNegInf);
  EXPECT_EQ(both.a, 0.f);
  EXPECT_EQ(both.b, 0.f);
  EXPECT_EQ(both.lse, kNegInf);
  const MergeWeights left = merge_weights(kNegInf, 2.5f);
  EXPECT_EQ(left.a, 0.f);
  EXPECT_EQ(left.b, 1.f);
  EXPECT_EQ(left.lse, 2.5f);
  const MergeWeights right = merge_weights(-1.f, kNegInf);
  EXPECT_EQ(right.a, 1.f);
  EXPECT_EQ(right.b, 0.f);
  EXPECT_EQ(right.lse, -1.f);
}

TEST(Merge, HugeGapDoesNotOverflow) {
  const MergeWeights w = merge_weights(80.f, -80.f);
  EXPECT_EQ(w.a, 1.f);
  EXPECT_EQ(w.b, 0.f);
  EXPECT_FLOAT_EQ(w.lse, 80.f);
}

TEST(Merge, EmptyPartialLeavesAccumulatorBitsUntouched) {
  std::vector<float> acc = {0.1f, 0.2f}, part = {7.f, 7.f};
  float la = 0.3f, lb = kNegInf;
  merge_partial(acc.data(), &la, part.data(), &lb, 1, 2);
  EXPECT_EQ(acc[0], 0.1f);
  EXPECT_EQ(acc[1], 0.2f);
  EXPECT_EQ(la, 0.3f);
}

}  // namespace
}  // namespace rf
