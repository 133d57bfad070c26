// ringflex trainer: AdamW, the warmup + cosine learning-rate schedule, and global-norm gradient clipping.
//
// AdamW as in Loshchilov & Hutter (and torch.optim.AdamW): m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
// p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + lr * wd * p (decoupled decay, applied to the
// parameter before this step's update). Only tensors of 2 or more dimensions decay: norm scales and router
// scales are multiplicative gains around 1, and decaying them toward 0 would fight the model's normalisation.
// Moments are float32 (what a checkpoint stores); each element's arithmetic is done in float64 and rounded once,
// so the update is independent of thread count and vector width.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "model/param_store.h"
#include "trainer/config.h"

namespace rf::trainer {

// lr at optimizer step `step` (1-based): linear warmup over warmup_steps, then cosine from lr to lr * min_lr_ratio
// at `total_steps`.
double learning_rate(const OptimizerSection& opt, const ScheduleSection& sched, int step, int total_steps);

// sum of g^2, accumulated in float64 in order.
double sum_of_squares(std::span<const float> g);
// torch.nn.utils.clip_grad_norm_'s factor for a global norm `norm` and a limit `max_norm` (0 = off): 1 when the norm
// is within the limit.
double clip_factor(double norm, double max_norm);
// g *= factor, each element rounded once.
void scale(std::span<float> g, double factor);

// sqrt(sum of squares) of the store's gradients (the trainable parameters'), accumulated in float64 in registration
// order over the flat gradient arena (one rank: the trainer combines per-shard partial sums over several).
double global_grad_norm(const model::ParamStore& store);

// Scales the gradients so their global norm is at most `max_norm` (0 = off); returns the factor.
double clip_gradients(model::ParamStore& store, double norm, double max_norm);

// AdamW over a parameter store: the weights, gradients and moments of its trainable parameters (a frozen one,
// model.freeze, never changes and has no moments: a frozen 262144 x 10752 per-layer embedding would otherwise hold
// 22 GB of zeros).
class AdamW {
 public:
  // Allocates the store's moments (zero) for its trainable parameters: freeze before.
  AdamW(model::ParamStore& store, OptimizerSection opt);

  // One update with learning rate `lr` from the store's gradients; `step` counts updates from 1 (bias correction).
  // Updates the trainable elements whose moments the store holds (ParamStore::moment_range: all, or this rank's
  // shard under parallelism.shard = optimizer, whose other elements the trainer then gathers from their owners).
  // The gradients are taken times `grad_scale` (clip_factor's), each product rounded to float32 as scale() writes
  // it: the bits of scale() then step() in one pass over the arena instead of two, the store's gradients unchanged.
  void step(model::ParamStore& store, double lr, int64_t step, double grad_scale = 1.0);

 private:
  OptimizerSection opt_;
};

}  // namespace rf::trainer
