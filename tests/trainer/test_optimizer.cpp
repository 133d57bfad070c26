// AdamW, the schedule and clipping against their textbook formulas written out here in float64.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <memory>
#include <numbers>
#include <vector>

#include "common/error_of.h"
#include "cpu/isa.h"
#include "trainer/optimizer.h"
#include "trainer/optimizer_kernels.h"

namespace rf::trainer {
namespace {

// A store of three parameters with distinct values; `freeze` as model.freeze.
std::unique_ptr<model::ParamStore> three_params(const std::vector<std::string>& freeze = {}) {
  auto s = std::make_unique<model::ReplicatedStore>();
  s->add("w", {2, 3});  // a matrix: decays
  s->add("norm", {3});  // a gain: does not decay
  s->add("frozen", {2});
  s->allocate_weights();
  for (size_t i = 0; i < s->size(); ++i) {
    float* w = s->mutable_weight(i);
    for (int64_t e = 0; e < s->info(i).numel; ++e) w[e] = 0.5f - 0.25f * static_cast<float>(e) + static_cast<float>(i);
  }
  s->freeze(freeze);
  return s;
}

TEST(AdamW, MatchesTheFormulaInFloat64) {
  OptimizerSection opt;
  opt.lr = 0.01;
  opt.beta1 = 0.8;
  opt.beta2 = 0.9;
  opt.eps = 1e-6;
  opt.weight_decay = 0.3;
  const std::unique_ptr<model::ParamStore> store = three_params({"frozen"});
  model::ParamStore& p = *store;
  AdamW adam(p, opt);
  p.allocate_grads();
  const model::TensorSet ref = three_params()->snapshot(model::Role::Weights);
  std::vector<std::vector<double>> m(3), v(3), x(3);
  for (size_t i = 0; i < 3; ++i) {
    m[i].assign(ref[i].data.size(), 0.0);
    v[i].assign(ref[i].data.size(), 0.0);
    x[i].assign(ref[i].data.begin(), ref[i].data.end());
  }
  for (int t = 1; t <= 3; ++t) {
    const double lr = opt.lr * t;   // a changing lr, as the schedule gives
    for (size_t i = 0; i < 2; ++i)  // tensor 2 is frozen: no gradient
      for (int64_t e = 0; e < p.info(i).numel; ++e) p.grad(i)[e] = std::sin(1.0f + t * 0.7f + e + 3 * i);
    adam.step(p, lr, t);
    for (size_t i = 0; i < 2; ++i) {
      const double wd = i == 0 ? opt.weight_decay : 0.0;
      for (size_t e = 0; e < x[i].size(); ++e) {
        const double gr = p.grad(i)[e];
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
      EXPECT_NEAR(p.weight(i)[e], x[i][e], 1e-6) << p.info(i).name << "[" << e << "]";
  EXPECT_EQ(p.snapshot(model::Role::Weights)[2].data, ref[2].data);  // frozen: untouched bits
  // Moments only where the parameter trains: a frozen tensor has none, and they cost no memory.
  for (model::Role role : {model::Role::ExpAvg, model::Role::ExpAvgSq}) {
    EXPECT_TRUE(p.moment(role, 0) != nullptr && p.moment(role, 1) != nullptr);
    EXPECT_EQ(p.moment(role, 2), nullptr);
    EXPECT_EQ(p.flat(role).size(), 6u + 3u);
  }
}

std::vector<const OptimizerKernels*> optimizer_kernels_this_cpu_runs() {
  const cpu::CpuFeatures f = cpu::detect_cpu();
  std::vector<const OptimizerKernels*> sets = {&optimizer_kernels_for(cpu::Isa::Scalar)};
  if (f.avx2) sets.push_back(&optimizer_kernels_for(cpu::Isa::Avx2));
  if (f.avx512) sets.push_back(&optimizer_kernels_for(cpu::Isa::Avx512));
  return sets;
}

// Every ISA's kernels give the bits of the element-by-element float64 loop written out here (the update
// optimizer.h describes, each operation separately rounded: this file is compiled with -ffp-contract=off), on a
// length that leaves a remainder after every vector width, with gradients from 1e-30 to 1e3, zeros of both signs,
// and the moments of an earlier step.
TEST(OptimizerKernels, EveryIsaGivesTheScalarLoopsBits) {
  constexpr int64_t n = 1000 + 13;
  std::vector<float> p0(n), m0(n), v0(n), g(n);
  for (int64_t e = 0; e < n; ++e) {
    const double t = static_cast<double>(e);
    p0[e] = static_cast<float>(std::sin(0.37 * t) * 2.0);
    g[e] = static_cast<float>(std::cos(1.3 * t) * std::pow(10.0, -30.0 + 33.0 * (e % 97) / 96.0));
    m0[e] = static_cast<float>(0.1 * std::sin(2.1 * t));
    v0[e] = static_cast<float>(0.01 * std::fabs(std::cos(0.9 * t)));
  }
  g[0] = 0.f;
  g[1] = -0.f;
  m0[2] = v0[2] = 0.f;
  constexpr double kFactor = 0.123456789;
  const AdamWConstants c{0.9, 0.95, 1.0 - std::pow(0.9, 7.0), 1.0 - std::pow(0.95, 7.0), 1e-8, 3e-3, 3e-4, 1.0};
  AdamWConstants clipped = c;
  clipped.grad_scale = kFactor;
  std::vector<float> p_want = p0, m_want = m0, v_want = v0, g_want = g;
  for (int64_t e = 0; e < n; ++e) {
    const double gd = g[e];
    const double mn = c.b1 * m_want[e] + (1.0 - c.b1) * gd;
    const double vn = c.b2 * v_want[e] + (1.0 - c.b2) * gd * gd;
    m_want[e] = static_cast<float>(mn);
    v_want[e] = static_cast<float>(vn);
    const double update = (mn / c.correction1) / (std::sqrt(vn / c.correction2) + c.eps);
    const double pd = p_want[e];
    p_want[e] = static_cast<float>(pd - c.decay * pd - c.lr * update);
    g_want[e] = static_cast<float>(g[e] * kFactor);
  }
  const auto bits = [](const std::vector<float>& x) {
    std::vector<uint32_t> b(x.size());
    for (size_t i = 0; i < x.size(); ++i) b[i] = std::bit_cast<uint32_t>(x[i]);
    return b;
  };
  for (const OptimizerKernels* k : optimizer_kernels_this_cpu_runs()) {
    const std::string isa = cpu::isa_name(k->isa);
    std::vector<float> p = p0, m = m0, v = v0, gs = g;
    k->adamw(p.data(), m.data(), v.data(), g.data(), n, c);
    EXPECT_EQ(bits(p), bits(p_want)) << isa;
    EXPECT_EQ(bits(m), bits(m_want)) << isa;
    EXPECT_EQ(bits(v), bits(v_want)) << isa;
    k->scale(gs.data(), n, kFactor);
    EXPECT_EQ(bits(gs), bits(g_want)) << isa;
    // Clipping fused into the update: the bits of scale() then adamw(), the gradients left unscaled.
    std::vector<float> p_scaled = p0, m_scaled = m0, v_scaled = v0, p_fused = p0, m_fused = m0, v_fused = v0;
    const std::vector<float> g_before = g;
    k->adamw(p_scaled.data(), m_scaled.data(), v_scaled.data(), gs.data(), n, c);
    k->adamw(p_fused.data(), m_fused.data(), v_fused.data(), g.data(), n, clipped);
    EXPECT_EQ(bits(p_fused), bits(p_scaled)) << isa;
    EXPECT_EQ(bits(m_fused), bits(m_scaled)) << isa;
    EXPECT_EQ(bits(v_fused), bits(v_scaled)) << isa;
    EXPECT_EQ(bits(g), bits(g_before)) << isa;
  }
}

TEST(AdamW, FreezePatternMustMatchSomething) {
  EXPECT_EQ(testing::error_of([&] { three_params({"embed"}); }),
            "config: model.freeze entry 'embed' matches no parameter");
  const std::unique_ptr<model::ParamStore> p = three_params({"o"});  // "norm" and "frozen" contain 'o'
  EXPECT_EQ(p->trainable_after({}), (std::vector<bool>{true, false, false}));
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
  model::ReplicatedStore g;
  g.add("a", {2});
  g.add("b", {1});
  g.add("c", {1});
  g.freeze({"c"});  // frozen: no gradient, so neither counted nor scaled
  g.allocate_grads();
  g.grad(0)[0] = 3.0f;
  g.grad(1)[0] = 4.0f;
  EXPECT_EQ(g.grad(2), nullptr);
  const double norm = global_grad_norm(g);
  EXPECT_DOUBLE_EQ(norm, 5.0);
  EXPECT_DOUBLE_EQ(clip_gradients(g, norm, 10.0), 1.0);  // under the limit: unchanged
  const double f = clip_gradients(g, norm, 1.0);
  EXPECT_NEAR(f, 1.0 / (5.0 + 1e-6), 1e-15);
  EXPECT_FLOAT_EQ(g.grad(0)[0], static_cast<float>(3.0 * f));
  EXPECT_EQ(g.grad(0)[1], 0.0f);
  EXPECT_FLOAT_EQ(g.grad(1)[0], static_cast<float>(4.0 * f));
}

}  // namespace
}  // namespace rf::trainer
