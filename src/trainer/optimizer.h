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
#include <string>
#include <vector>

#include "model/params.h"
#include "trainer/config.h"

namespace rf::trainer {

// lr at optimizer step `step` (1-based): linear warmup over warmup_steps, then cosine from lr to lr * min_lr_ratio
// at `total_steps`.
double learning_rate(const OptimizerSection& opt, const ScheduleSection& sched, int step, int total_steps);

// sqrt(sum of squares) over the trainable tensors of `grads`, accumulated in float64 in registration order.
double global_grad_norm(const model::TensorSet& grads, const std::vector<bool>& trainable);

// Scales the trainable gradients so their global norm is at most `max_norm` (0 = off); returns the factor.
double clip_gradients(model::TensorSet& grads, const std::vector<bool>& trainable, double norm, double max_norm);

class AdamW {
 public:
  // `trainable[i]` false: tensor i of the parameters never changes (model.freeze), and its moments are names and
  // shapes only (no memory: a frozen 262144 x 10752 per-layer embedding would otherwise hold 22 GB of zeros).
  AdamW(const model::TensorSet& params, std::vector<bool> trainable, OptimizerSection opt);

  // One update with learning rate `lr`; `step` counts updates from 1 (bias correction).
  void step(model::TensorSet& params, const model::TensorSet& grads, double lr, int64_t step);

  const std::vector<bool>& trainable() const { return trainable_; }
  model::TensorSet& exp_avg() { return m_; }     // first moments, same names and shapes; allocated where trainable
  model::TensorSet& exp_avg_sq() { return v_; }  // second moments
  const model::TensorSet& exp_avg() const { return m_; }
  const model::TensorSet& exp_avg_sq() const { return v_; }

 private:
  std::vector<bool> trainable_;
  OptimizerSection opt_;
  model::TensorSet m_, v_;
};

// Which parameters train: all but those whose name contains one of `freeze`.
std::vector<bool> trainable_mask(const model::TensorSet& params, const std::vector<std::string>& freeze);

}  // namespace rf::trainer
