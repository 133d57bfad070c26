// ringflex trainer: AdamW, schedule and clipping (see optimizer.h).
#include "trainer/optimizer.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/error.h"
#include "trainer/optimizer_kernels.h"

namespace rf::trainer {

namespace {

// Elements one thread's call of a kernel takes: 64 KiB of each float32 stream, large enough that the call costs
// nothing beside it and small enough that the threads share a 640-element norm scale or a 42M-element table evenly.
constexpr int64_t kBlockElements = int64_t{1} << 14;

// Calls fn(first, count) over [0, n) in blocks, spread over the threads. Each element's result depends on itself
// alone, so the bits do not depend on the thread count or the blocks.
template <typename Fn>
void for_blocks(int64_t n, Fn&& fn) {
  const int64_t blocks = (n + kBlockElements - 1) / kBlockElements;
#pragma omp parallel for schedule(static) if (blocks > 1)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t first = b * kBlockElements;
    fn(first, std::min(kBlockElements, n - first));
  }
}

constexpr cpu::PerIsa<OptimizerKernels> kOptimizerKernels =
    RF_PER_ISA(OptimizerKernels, optimizer_kernels, "optimizer kernels");

}  // namespace

const OptimizerKernels& optimizer_kernels_for(cpu::Isa isa) { return kOptimizerKernels.for_isa(isa); }

const OptimizerKernels& optimizer_kernels() { return kOptimizerKernels.chosen(); }

double learning_rate(const OptimizerSection& opt, const ScheduleSection& sched, int step, int total_steps) {
  if (step <= sched.warmup_steps) return opt.lr * step / sched.warmup_steps;
  const int decay_steps = total_steps - sched.warmup_steps;
  if (decay_steps <= 0) return opt.lr;
  const double progress = std::min(1.0, static_cast<double>(step - sched.warmup_steps) / decay_steps);
  const double cosine = 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
  return opt.lr * (sched.min_lr_ratio + (1.0 - sched.min_lr_ratio) * cosine);
}

double sum_of_squares(std::span<const float> g) {
  double sum = 0.0;
  for (float x : g) sum += static_cast<double>(x) * x;
  return sum;
}

double clip_factor(double norm, double max_norm) {
  if (max_norm <= 0 || norm <= max_norm) return 1.0;
  // torch.nn.utils.clip_grad_norm_'s factor, with its 1e-6 guard against a zero norm.
  constexpr double kNormGuard = 1e-6;
  return max_norm / (norm + kNormGuard);
}

void scale(std::span<float> g, double factor) {
  const OptimizerKernels& k = optimizer_kernels();
  for_blocks(static_cast<int64_t>(g.size()), [&](int64_t first, int64_t n) { k.scale(g.data() + first, n, factor); });
}

double global_grad_norm(const model::ParamStore& store) {
  return std::sqrt(sum_of_squares(store.flat(model::Role::Grads)));
}

double clip_gradients(model::ParamStore& store, double norm, double max_norm) {
  const double factor = clip_factor(norm, max_norm);
  if (factor != 1.0) scale(store.mutable_flat(model::Role::Grads), factor);
  return factor;
}

AdamW::AdamW(model::ParamStore& store, OptimizerSection opt) : opt_(opt) { store.allocate_moments(); }

void AdamW::step(model::ParamStore& store, double lr, int64_t step, double grad_scale) {
  RF_ASSERT(step >= 1 && store.has_grads() && store.has_moments());
  const double b1 = opt_.beta1, b2 = opt_.beta2;
  const double correction1 = 1.0 - std::pow(b1, static_cast<double>(step));
  const double correction2 = 1.0 - std::pow(b2, static_cast<double>(step));
  // The elements whose moments the store holds: all trainable ones, or this rank's shard of them (ZeRO-1). Each
  // element's update depends on itself alone, so a shard's elements get the bits the whole update gives them.
  const model::Shard range = store.moment_range();
  float* const m_all = store.mutable_flat(model::Role::ExpAvg).data();
  float* const v_all = store.mutable_flat(model::Role::ExpAvgSq).data();
  const float* const g_all = store.flat(model::Role::Grads).data();  // from trainable element grads_begin()
  const OptimizerKernels& k = optimizer_kernels();
  for (const model::ParamStore::Segment& seg : store.trainable_segments(range.begin, range.end)) {
    const AdamWConstants c{b1,
                           b2,
                           correction1,
                           correction2,
                           opt_.eps,
                           lr,
                           store.info(seg.slot).decays() ? lr * opt_.weight_decay : 0.0,
                           grad_scale};
    float* p = store.mutable_master(seg.slot, seg.first);
    float* m = m_all + (seg.train_index - range.begin);
    float* v = v_all + (seg.train_index - range.begin);
    const float* g = g_all + (seg.train_index - store.grads_begin());
    for_blocks(seg.n, [&](int64_t first, int64_t n) { k.adamw(p + first, m + first, v + first, g + first, n, c); });
  }
}

}  // namespace rf::trainer
