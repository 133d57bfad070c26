// ringflex trainer: AdamW, schedule and clipping (see optimizer.h).
#include "trainer/optimizer.h"

#include <cmath>
#include <numbers>

#include "core/error.h"

namespace rf::trainer {

double learning_rate(const OptimizerSection& opt, const ScheduleSection& sched, int step, int total_steps) {
  if (step <= sched.warmup_steps) return opt.lr * step / sched.warmup_steps;
  const int decay_steps = total_steps - sched.warmup_steps;
  if (decay_steps <= 0) return opt.lr;
  const double progress = std::min(1.0, static_cast<double>(step - sched.warmup_steps) / decay_steps);
  const double cosine = 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
  return opt.lr * (sched.min_lr_ratio + (1.0 - sched.min_lr_ratio) * cosine);
}

double global_grad_norm(const model::TensorSet& grads, const std::vector<bool>& trainable) {
  double sum = 0.0;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!trainable[i]) continue;
    for (float g : grads[i].data) sum += static_cast<double>(g) * g;
  }
  return std::sqrt(sum);
}

double clip_gradients(model::TensorSet& grads, const std::vector<bool>& trainable, double norm, double max_norm) {
  if (max_norm <= 0 || norm <= max_norm) return 1.0;
  // torch.nn.utils.clip_grad_norm_'s factor, with its 1e-6 guard against a zero norm.
  constexpr double kNormGuard = 1e-6;
  const double factor = max_norm / (norm + kNormGuard);
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!trainable[i]) continue;
    for (float& g : grads[i].data) g = static_cast<float>(g * factor);
  }
  return factor;
}

AdamW::AdamW(const model::TensorSet& params, std::vector<bool> trainable, OptimizerSection opt)
    : trainable_(std::move(trainable)),
      opt_(opt),
      m_(params.zeros_like(trainable_)),
      v_(params.zeros_like(trainable_)) {}

void AdamW::step(model::TensorSet& params, const model::TensorSet& grads, double lr, int64_t step) {
  RF_ASSERT(step >= 1 && grads.size() == params.size());
  const double b1 = opt_.beta1, b2 = opt_.beta2;
  const double correction1 = 1.0 - std::pow(b1, static_cast<double>(step));
  const double correction2 = 1.0 - std::pow(b2, static_cast<double>(step));
  for (size_t i = 0; i < params.size(); ++i) {
    if (!trainable_[i]) continue;
    const bool decays = params[i].shape.size() >= 2;
    const double decay = decays ? lr * opt_.weight_decay : 0.0;
    float* p = params.data(i);
    float* m = m_.data(i);
    float* v = v_.data(i);
    const float* g = grads.data(i);
    const int64_t n = params[i].numel();
#pragma omp parallel for schedule(static)
    for (int64_t e = 0; e < n; ++e) {
      const double gd = g[e];
      const double mn = b1 * m[e] + (1.0 - b1) * gd;
      const double vn = b2 * v[e] + (1.0 - b2) * gd * gd;
      m[e] = static_cast<float>(mn);
      v[e] = static_cast<float>(vn);
      const double update = (mn / correction1) / (std::sqrt(vn / correction2) + opt_.eps);
      p[e] = static_cast<float>(p[e] - decay * p[e] - lr * update);
    }
  }
}

std::vector<bool> trainable_mask(const model::TensorSet& params, const std::vector<std::string>& freeze) {
  std::vector<bool> out(params.size(), true);
  for (const std::string& pattern : freeze) {
    bool matched = false;
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i].name.find(pattern) == std::string::npos) continue;
      out[i] = false;
      matched = true;
    }
    RF_CHECK(matched, "config: model.freeze entry '", pattern, "' matches no parameter");
  }
  return out;
}

}  // namespace rf::trainer
