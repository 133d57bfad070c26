// AdamW, the schedule and clipping against their textbook formulas written out here in float64.
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

#include "trainer/error_of.h"
#include "trainer/optimizer.h"

namespace rf::trainer {
namespace {

model::TensorSet two_tensors() {
  model::TensorSet s;
  s.add("w", {2, 3});  // a matrix: decays
  s.add("norm", {3});  // a gain: does not decay
  s.add("frozen", {2});
  for (size_t i = 0; i < s.size(); ++i)
    for (size_t e = 0; e < s[i].data.size(); ++e)
      s[i].data[e] = 0.5f - 0.25f * static_cast<float>(e) + static_cast<float>(i);
  return s;
}

TEST(AdamW, MatchesTheFormulaInFloat64) {
  OptimizerSection opt;
  opt.lr = 0.01;
  opt.beta1 = 0.8;
  opt.beta2 = 0.9;
  opt.eps = 1e-6;
  opt.weight_decay = 0.3;
  model::TensorSet p = two_tensors(), g = p.zeros_like();
  AdamW adam(p, trainable_mask(p, {"frozen"}), opt);
  model::TensorSet ref = two_tensors();
  std::vector<std::vector<double>> m(3), v(3), x(3);
  for (size_t i = 0; i < 3; ++i) {
    m[i].assign(ref[i].data.size(), 0.0);
    v[i].assign(ref[i].data.size(), 0.0);
    x[i].assign(ref[i].data.begin(), ref[i].data.end());
  }
  for (int t = 1; t <= 3; ++t) {
    const double lr = opt.lr * t;  // a changing lr, as the schedule gives
    for (size_t i = 0; i < 3; ++i)
      for (size_t e = 0; e < g[i].data.size(); ++e) g[i].data[e] = std::sin(1.0f + t * 0.7f + e + 3 * i);
    adam.step(p, g, lr, t);
    for (size_t i = 0; i < 2; ++i) {  // tensor 2 is frozen
      const double wd = i == 0 ? opt.weight_decay : 0.0;
      for (size_t e = 0; e < x[i].size(); ++e) {
        const double gr = g[i].data[e];
        m[i][e] = opt.beta1 * m[i][e] + (1 - opt.beta1) * gr;
        v[i][e] = opt.beta2 * v[i][e] + (1 - opt.beta2) * gr * gr;
        const double mh = m[i][e] / (1 - std::pow(opt.beta1, t)), vh = v[i][e] / (1 - std::pow(opt.beta2, t));
        x[i][e] = x[i][e] - lr * wd * x[i][e] - lr * mh / (std::sqrt(vh) + opt.eps);
      }
    }
  }
  for (size_t i = 0; i < 3; ++i)
    for (size_t e = 0; e < x[i].size(); ++e)
      // float32 parameters and moments, rounded once per step: a few float32 ulps of values O(1).
      EXPECT_NEAR(p[i].data[e], x[i][e], 1e-6) << p[i].name << "[" << e << "]";
  EXPECT_EQ(p[2].data, ref[2].data);  // frozen: untouched bits
  // Moments only where the parameter trains: a frozen tensor keeps its name and shape and no memory.
  for (const model::TensorSet* moments : {&adam.exp_avg(), &adam.exp_avg_sq()}) {
    EXPECT_TRUE(moments->allocated(0) && moments->allocated(1));
    EXPECT_FALSE(moments->allocated(2));
    EXPECT_EQ((*moments)[2].shape, p[2].shape);
    EXPECT_TRUE((*moments)[2].data.empty());
  }
}

TEST(AdamW, FreezePatternMustMatchSomething) {
  const model::TensorSet p = two_tensors();
  EXPECT_EQ(testing::error_of([&] { trainable_mask(p, {"embed"}); }),
            "config: model.freeze entry 'embed' matches no parameter");
  EXPECT_EQ(trainable_mask(p, {"o"}), (std::vector<bool>{true, false, false}));  // "norm" and "frozen" contain 'o'
}

TEST(Schedule, WarmupThenCosineToTheFloor) {
  OptimizerSection opt;
  opt.lr = 1.0;
  ScheduleSection s;
  s.warmup_steps = 4;
  s.min_lr_ratio = 0.1;
  EXPECT_DOUBLE_EQ(learning_rate(opt, s, 1, 14), 0.25);
  EXPECT_DOUBLE_EQ(learning_rate(opt, s, 4, 14), 1.0);
  // Halfway through the 10 decay steps the cosine is at its middle: 0.1 + 0.9 * 0.5.
  EXPECT_NEAR(learning_rate(opt, s, 9, 14), 0.55, 1e-15);
  EXPECT_NEAR(learning_rate(opt, s, 14, 14), 0.1, 1e-15);
  EXPECT_NEAR(learning_rate(opt, s, 6, 14), 0.1 + 0.45 * (1 + std::cos(std::numbers::pi * 0.2)), 1e-15);
  s.warmup_steps = 0;
  EXPECT_NEAR(learning_rate(opt, s, 1, 1), 0.1, 1e-15);  // no warmup: the one step is the last, at the floor
  EXPECT_NEAR(learning_rate(opt, s, 1, 2), 0.55, 1e-15);
}

TEST(Clipping, GlobalNormOverTrainableTensors) {
  model::TensorSet g;
  g.add("a", {2});
  g.add("b", {1});
  g.add("c", {1});
  g[0].data = {3.0f, 0.0f};
  g[1].data = {4.0f};
  g[2].data = {100.0f};  // frozen: neither counted nor scaled
  const std::vector<bool> trainable{true, true, false};
  const double norm = global_grad_norm(g, trainable);
  EXPECT_DOUBLE_EQ(norm, 5.0);
  EXPECT_DOUBLE_EQ(clip_gradients(g, trainable, norm, 10.0), 1.0);  // under the limit: unchanged
  const double f = clip_gradients(g, trainable, norm, 1.0);
  EXPECT_NEAR(f, 1.0 / (5.0 + 1e-6), 1e-15);
  EXPECT_FLOAT_EQ(g[0].data[0], static_cast<float>(3.0 * f));
  EXPECT_FLOAT_EQ(g[1].data[0], static_cast<float>(4.0 * f));
  EXPECT_EQ(g[2].data[0], 100.0f);
}

}  // namespace
}  // namespace rf::trainer
