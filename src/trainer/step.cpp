// ringflex trainer: one optimizer step of the plan in trainer.h (rows, token counts, forward + backward, the gradient
// reduction, clipping and the update) and validation.
#include <algorithm>
#include <cmath>

#include "comm/agree.h"
#include "core/error.h"
#include "cp/kv_cache.h"
#include "model/image_run.h"
#include "trainer/data.h"
#include "trainer/optimizer.h"
#include "trainer/run.h"

namespace rf::trainer::detail {

// 1. This replica's rows of the step, rows [pos + d * G/dp, pos + (d + 1) * G/dp), as packed micro-batches of
// train.micro_batch rows. Reads data only (no collective): train() runs it inside comm::agree, so a row that fails
// to load on one rank fails every rank.
std::vector<PackedBatch> replica_micro_batches(const Run& r) {
  const int micro = r.cfg.train.micro_batch;
  const int64_t first = r.state.data_position + int64_t{r.dp_index} * r.cfg.global_batch_per_replica();
  std::vector<PackedBatch> batches;
  for (int a = 0; a < r.cfg.accumulation_steps(); ++a) {
    std::vector<Row> rows;
    for (int j = 0; j < micro; ++j) rows.push_back(r.data->train_row(first + int64_t{a} * micro + j));
    batches.push_back(stack_rows(rows, r.feature_dim));
    // A row the model would refuse is found here, where the ranks agree, not inside the model's collectives where
    // one DP replica's error would leave the others waiting.
    r.ck.model->check_batch(batches.back().batch(), r.cfg.parallelism.cp,
                            rf::concat("training rows ", first + int64_t{a} * micro, " to ",
                                       first + int64_t{a + 1} * micro - 1));
  }
  return batches;
}

// 2. The global batch's tokens, counted once: each replica counts its rows, one all-reduce over DP sums them (never
// over CP: CP ranks hold the same rows).
TokenCounts count_tokens(const Run& r, const std::vector<PackedBatch>& batches) {
  int64_t counts[2] = {0, 0};
  for (const PackedBatch& b : batches) {
    counts[0] += b.label_tokens();
    counts[1] += b.real_tokens();
  }
  r.dp_group->allreduce(counts, 2, comm::ReduceOp::Sum, r.timeout);
  return {counts[0], counts[1]};
}

namespace {

// One micro-batch's share of the global loss (its token losses over `label_tokens`); with `grad`, its gradients
// accumulate into the parameter store's. model.train_vision: its images run through the tower in the same call, the
// tower's work shared over the CP group by the parallel context (model/image_run.h); the training state says where
// the tower's store hooks are collective, which a rank with no images of its own then joins.
double run_micro_batch(Run& r, const PackedBatch& p, int64_t label_tokens, bool grad) {
  model::RunOptions ro = r.training;
  ro.want_grad = grad;
  ro.loss_normalizer = std::max(1.0, static_cast<double>(label_tokens));  // no label tokens: loss 0, not 0 / 0
  if (!r.tower) return r.ck.model->run(p.batch(), ro, *r.context.model).loss;
  const model::TowerHooks hooks{r.mode->forward_collective(), r.mode->tower_gradients_collective()};
  const model::ImageRun run =
      model::run_with_images(*r.ck.model, *r.tower, p.batch(), p.images.batch(), ro, hooks, *r.context.model);
  r.tower_seconds += run.tower_seconds;
  return run.result.loss;
}

// The key of one micro-batch's LoRA dropout masks.
uint64_t dropout_key(uint64_t seed, int64_t step, int replica, size_t micro_batch) {
  // Distinct for distinct (step, replica, micro-batch) at any realistic count: 32 bits of step, 16 of each other.
  constexpr int kStepShift = 32, kReplicaShift = 16;
  return seed * 0x9e3779b97f4a7c15ULL ^ (static_cast<uint64_t>(step) << kStepShift) ^
         (static_cast<uint64_t>(replica) << kReplicaShift) ^ static_cast<uint64_t>(micro_batch);
}

}  // namespace

// 3. Forward + backward of every micro-batch, the gradients accumulating; returns the global batch's loss.
double forward_backward(Run& r, const std::vector<PackedBatch>& batches, int64_t label_tokens) {
  r.ck.model->params().zero_grads();
  double loss = 0.0;
  for (size_t a = 0; a < batches.size(); ++a) {
    // LoRA dropout's masks: drawn anew for each step, replica and micro-batch, the same on the CP ranks of a row
    // (model/held_weight.h lora_dropout_keeps), and again the same when the step is run again after a resume.
    r.training.dropout_key = dropout_key(r.cfg.train.seed, r.state.step + 1, r.dp_index, a);
    loss += run_micro_batch(r, batches[a], label_tokens, true);
  }
  r.dp_group->allreduce(&loss, 1, comm::ReduceOp::Sum, r.timeout);
  return loss;
}

// 4a. Sums the gradients over every rank, in rank order (the same bits on every rank and backend), as the run's
// training state holds them (state/state.h).
void reduce_gradients(Run& r) { r.mode->reduce_gradients(r); }

// 4b. The global gradient norm, and in `factor` the one clipping to optimizer.grad_clip scales the gradients by (1
// within the limit or for a non-finite norm); returns the norm before clipping. The gradients are not scaled here:
// apply_update hands the factor to AdamW, which rounds each scaled gradient as a scaling pass would, within its own
// pass over the arena (one pass over the gradients fewer a step, the same bits). The sum of squares is taken as one
// partial sum per rank's slice of the trainable layout (comm::slice_of over the world), added in rank order: the same
// bits whichever part of the reduced gradients a rank holds.
double clip_global_norm(Run& r, double max_norm, double& factor) {
  double sum = 0.0;
  for (double x : r.mode->norm_partials(r)) sum += x;
  const double norm = std::sqrt(sum);
  factor = std::isfinite(norm) ? clip_factor(norm, max_norm) : 1.0;
  return norm;
}

// 4c. The AdamW update at `step` from the gradients times `clip` (clip_global_norm's factor), the same on every
// replica; returns the learning rate it used.
double apply_update(Run& r, int64_t step, double clip) {
  const double lr = learning_rate(r.cfg.optimizer, r.cfg.schedule, static_cast<int>(step), r.cfg.train.steps);
  r.mode->update(r, lr, step, clip);
  return lr;
}

// A non-finite loss or gradient (a diverging run, or NaN weights resumed from a damaged checkpoint) stops the run
// before the update, so neither the weights nor a checkpoint take it. Both figures are already the same bits on
// every rank (the loss summed over the CP group in the model and over DP, the norm taken from the reduced
// gradients), so every rank stops at the same step with the same line without another collective.
void check_finite_step(int64_t step, double loss, double norm, const std::string& last_checkpoint) {
  if (std::isfinite(loss) && std::isfinite(norm)) return;
  throw comm::AgreedError(rf::concat(
      "step ", step, ": the loss or the gradient is not finite (gradient norm ", norm,
      "): the run diverged (try a lower optimizer.lr) or its weights are not finite; stopped before the update",
      last_checkpoint.empty() ? "" : ", last checkpoint " + last_checkpoint));
}

// Validation: every row of the split, each DP replica running every dp-th row in micro-batches, the loss
// normalised by the label tokens of the whole split. The rows are read inside comm::agree (like a step's rows).
double validation_loss(Run& r) {
  const int dp = r.cfg.parallelism.dp;
  std::vector<PackedBatch> mine;
  std::vector<PackedBatch> filler;  // under expert parallelism or shard full: the split's first row (see below)
  const bool balanced = r.cfg.parallelism.ep > 1 || r.mode->forward_collective();
  int64_t labels = 0;
  comm::agree(r.world, [&] {
    std::vector<Row> rows;
    for (int j = 0; j < r.data->val_rows(); ++j) {
      Row row = r.data->val_row(j);
      labels += count_label_tokens(row.labels);
      if (j == 0 && balanced) filler.push_back(stack_rows({row}, r.feature_dim));
      if (j % dp == r.dp_index) rows.push_back(std::move(row));
    }
    const size_t micro = static_cast<size_t>(r.cfg.train.micro_batch);
    for (size_t at = 0; at < rows.size(); at += micro) {
      mine.push_back(
          stack_rows(std::vector<Row>(rows.begin() + static_cast<std::ptrdiff_t>(at),
                                      rows.begin() + static_cast<std::ptrdiff_t>(std::min(rows.size(), at + micro))),
                     r.feature_dim));
      r.ck.model->check_batch(mine.back().batch(), r.cfg.parallelism.cp, "validation rows");
    }
  });
  double loss = 0.0;
  for (const PackedBatch& b : mine) loss += run_micro_batch(r, b, labels, false);
  // Under expert parallelism every micro-batch is collective over the EP group, which spans DP replicas, and under
  // shard full every layer's gather spans all ranks: a replica with fewer rows (replica 0 has the most) runs its
  // first batch again, or the split's first row, its loss unused.
  if (balanced && r.data->val_rows() > 0) {
    const int64_t most_rows = (r.data->val_rows() + dp - 1) / dp;
    const int64_t most = (most_rows + r.cfg.train.micro_batch - 1) / r.cfg.train.micro_batch;
    const PackedBatch& again = mine.empty() ? filler.front() : mine.front();
    for (int64_t i = static_cast<int64_t>(mine.size()); i < most; ++i) run_micro_batch(r, again, labels, false);
  }
  r.dp_group->allreduce(&loss, 1, comm::ReduceOp::Sum, r.timeout);
  return loss;
}

// The samples run the model as validation does, on every rank: each CP group prefills the prompt over its ranks
// and decodes on its sharded cache (model/generate.h), and the prefill runs the whole model
// (GenerateOptions::prefill_whole_model), so the store's hooks (shard gradients/full gathers, held experts, LoRA
// adapters) give the weights exactly as the step left them. Every DP replica generates the same prompts: a sharded
// store's gathers and the EP group span the replicas, so all of them must run the same model runs. Under expert
// parallelism the experts go through generate's decode dispatch (cp/decode_experts.h, as `ringflex generate --ep`):
// the prefill's rows through the training all-to-all, a decode step's tokens, the same on every rank of the EP group
// (every replica decodes the same prompts with the same weights, so an EP group spanning replicas sees the same
// tokens too), each expert run on its holder alone. Images: a trained tower (model.train_vision) encodes the
// prompts' images again with this step's weights, on every rank (its store hooks may be collective); a frozen one
// encoded them at setup.
std::vector<model::Generated> generate_samples(Run& r) {
  const model::Gemma4Model& m = r.ck.model->decoder();
  if (!r.sampler) {
    cp::CpAttentionOptions co;
    co.scheme = cp::scheme_name(r.cfg.parallelism.sharding);
    co.timeout = r.timeout;
    const DType attention = model::attention_dtype(r.cfg.model.compute_dtype);
    r.sampler =
        cp::make_decode_context(*r.cp_group, model::cache_layers(m), attention, attention, co, r.ep_group.get());
  }
  if (r.tower && has_sample_images(r.samples)) encode_sample_images(r.samples, *r.tower, true);
  model::GenerateOptions o;
  o.max_new_tokens = r.cfg.train.samples_max_new_tokens;
  o.stop_ids = r.samples.stop_ids;  // the checkpoint's end tokens, as `ringflex generate` on it stops
  o.sampling.greedy = true;
  o.compute_dtype = r.cfg.model.compute_dtype;
  o.prefill_whole_model = true;
  return model::generate(m, *r.sampler, r.samples.prompts, o);  // the prompts decoded together
}

}  // namespace rf::trainer::detail
