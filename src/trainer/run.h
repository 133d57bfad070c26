// ringflex trainer, inside: the state of one rank's run and the pieces train() (trainer.cpp) calls, in the order of
// trainer.h's plan. Not installed: only the trainer's own files include it.
//   set_up.cpp        join_groups and set_up: the groups, the model (fresh, from model.path or resumed) in its
//                     parameter store, the data and the optimizer state, before any step;
//   step.cpp          one optimizer step: replica_micro_batches (1), count_tokens (2), forward_backward (3),
//                     reduce_gradients, clip_global_norm and apply_update (4), and validation_loss;
//   memory_check.cpp  train_memory_at_least (trainer.h), what set_up checks against the machine;
//   recompute_choice.cpp  choose_recompute (trainer.h): train.recompute and keep_* left at auto, chosen by that check;
//   trainer.cpp       train() itself, the step's metrics and outputs (record_step, publish_step, the checkpoint save).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/memory.h"
#include "cp/parallel_context.h"
#include "model/checkpoint.h"
#include "model/lora_store.h"
#include "model/vision_encoder.h"
#include "trainer/data.h"
#include "trainer/optimizer.h"
#include "trainer/samples.h"
#include "trainer/state/expert_state.h"
#include "trainer/state/state.h"
#include "trainer/trainer.h"

namespace rf::trainer::detail {

using Clock = std::chrono::steady_clock;

// Everything one rank's run holds: built by set_up (the plan's setup), used by every step after it.
struct Run {
  Run(const TrainConfig& c, comm::Communicator& w, const TrainOptions& o)
      : cfg(c), world(w), options(o), cp_index(w.rank() % c.parallelism.cp), dp_index(w.rank() / c.parallelism.cp) {}

  // The config, its recompute fields left at auto chosen by check_fits (choose_recompute): a copy, the run's own.
  TrainConfig cfg;
  comm::Communicator& world;
  const TrainOptions& options;
  const comm::Timeout timeout = comm::default_timeout();  // `ringflex ... --timeout SECONDS`
  const int cp_index, dp_index;
  const bool lead = world.rank() == 0;  // writes the metrics, the loss picture and the checkpoints
  // What a rank holds of the weights, gradients and moments, and the step's operations on them (state/state.h).
  std::unique_ptr<TrainingState> mode = plan_state(cfg);
  std::unique_ptr<comm::Communicator> cp_group, dp_group, ep_group;
  std::unique_ptr<comm::Communicator> edp_group;  // the ranks holding this rank's experts (world rank % ep alike)
  cp::JobContext context;  // the model's parallel context: the local kernels, or the ring over this rank's CP group
  model::Checkpoint ck;
  // The memory check's figure for this run (check_fits, before anything was allocated), what --stats writes.
  MemoryBreakdown checked;
  TrainState state;
  std::string resume_dir;  // empty: a fresh run
  std::unique_ptr<DataSource> data;
  std::unique_ptr<AdamW> adam;  // its state (the moments) and the gradients live in the model's parameter store
  model::RunOptions training;   // how a micro-batch runs (its string options parsed once)
  int feature_dim = 0;          // F of the batches' image features (0: the data has none)
  // model.train_vision: the model's tower (Gemma4Multimodal::vision_tower), which reads its parameters from the
  // store as it computes; null otherwise.
  const model::VisionEncoder* tower = nullptr;
  double tower_seconds = 0.0;  // this rank's time in the tower (forward, backward, the group's sums) this step
  SamplePrompts samples;       // train.samples' prompts (none without it)
  // train.samples' KV cache over the CP group (experts over the EP group), made at the first sample step.
  std::unique_ptr<DecodeContext> sampler;
};

inline double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

inline ExpertGroups expert_groups(Run& r) { return {r.world, *r.ep_group, *r.edp_group, r.timeout}; }

// The model.lora fields as the LoRA store takes them (state/lora.cpp).
model::LoraConfig lora_config(const TrainConfig& cfg);

// set_up.cpp
void join_groups(Run& r);
void set_up(Run& r);
// The base: from model.path, or the built-in model from train.seed, into the mode's store.
void load_base(Run& r);
// The built-in model (model.builtin, with the tower's parameters under model.train_vision) as shapes only, in
// `store` (null: a replicated store).
std::unique_ptr<model::Gemma4Multimodal> builtin_shapes(const TrainConfig& cfg,
                                                        std::unique_ptr<model::ParamStore> store);
// The config's model as shapes only, the registry the memory check counts: the built-in, or model.path's config.json
// (model::checkpoint_shapes).
std::unique_ptr<model::Gemma4Multimodal> model_shapes(const TrainConfig& cfg);
// What the run needs against the machine, for the model's shapes (before anything is allocated), kept in r.checked;
// reads the train.samples prompts into r.samples first (their generation's KV cache is counted).
void check_fits(Run& r, const model::Gemma4Multimodal& shapes);
// A resumed run's config against the one that wrote the checkpoint in `dir` (`saved_yaml`).
void check_resume_compatible(const TrainConfig& now, const std::string& saved_yaml, const std::string& dir);
// parallelism.ep against the model: its MoE layers' experts must divide over the EP ranks.
void check_expert_parallelism(const TrainConfig& cfg, const model::Gemma4Config& mc);

// step.cpp
struct TokenCounts {
  int64_t labels = 0;  // label tokens of the global batch: the loss's denominator
  int64_t real = 0;    // non-padding tokens of the global batch: the throughput's numerator
};

std::vector<PackedBatch> replica_micro_batches(const Run& r);
TokenCounts count_tokens(const Run& r, const std::vector<PackedBatch>& batches);
double forward_backward(Run& r, const std::vector<PackedBatch>& batches, int64_t label_tokens);
void reduce_gradients(Run& r);
double clip_global_norm(Run& r, double max_norm, double& factor);
double apply_update(Run& r, int64_t step, double clip);
void check_finite_step(int64_t step, double loss, double norm, const std::string& last_checkpoint);
double validation_loss(Run& r);
// train.samples: every prompt generated greedily with the weights as the step left them (collective: every rank).
std::vector<model::Generated> generate_samples(Run& r);

}  // namespace rf::trainer::detail
