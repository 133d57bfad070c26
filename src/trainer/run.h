// ringflex trainer, inside: the state of one rank's run and the pieces train() (trainer.cpp) calls, in the order of
// trainer.h's plan. Not installed: only the trainer's own files include it.
//   set_up.cpp        join_groups and set_up: the groups, the model (fresh, from model.path or resumed) in its
//                     parameter store, the data and the optimizer state, before any step;
//   step.cpp          one optimizer step: replica_micro_batches (1), count_tokens (2), forward_backward (3),
//                     reduce_gradients, clip_global_norm and apply_update (4), and validation_loss;
//   memory_check.cpp  train_memory_at_least (trainer.h), what set_up checks against the machine;
//   trainer.cpp       train() itself, the step's metrics and outputs (record_step, publish_step, the checkpoint save).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "cp/parallel_context.h"
#include "model/checkpoint.h"
#include "model/lora_store.h"
#include "model/vision_encoder.h"
#include "trainer/data.h"
#include "trainer/expert_state.h"
#include "trainer/held_expert_store.h"
#include "trainer/optimizer.h"
#include "trainer/sharded_store.h"
#include "trainer/trainer.h"

namespace rf::trainer::detail {

using Clock = std::chrono::steady_clock;

// Everything one rank's run holds: built by set_up (the plan's setup), used by every step after it.
struct Run {
  Run(const TrainConfig& c, comm::Communicator& w, const TrainOptions& o)
      : cfg(c), world(w), options(o), cp_index(w.rank() % c.parallelism.cp), dp_index(w.rank() / c.parallelism.cp) {}

  const TrainConfig& cfg;
  comm::Communicator& world;
  const TrainOptions& options;
  const comm::Timeout timeout = comm::default_timeout();  // `ringflex ... --timeout SECONDS`
  const int cp_index, dp_index;
  // ZeRO-2 (parallelism.shard = gradients): each layer's gradients are reduce-scattered as soon as its backward
  // ends, and a rank accumulates its slice alone. ZeRO-3 (full): besides, a rank holds its pieces of the weights and
  // gathers each layer around its forward and backward. Both live in a ShardedStore (sharded_store.h).
  const bool shard_gradients = cfg.parallelism.shard == ShardMode::Gradients;
  const bool shard_full = cfg.parallelism.shard == ShardMode::Full;
  const bool store_shards = shard_gradients || shard_full;
  // ZeRO-1 and up over the world's ranks: the moments, clipping and the update cover this rank's slice.
  const bool shard_optimizer = cfg.parallelism.shard == ShardMode::Optimizer || store_shards;
  // model.param_dtype bfloat16 under shard optimizer: a ShardedStore too (its Mode::Optimizer), which keeps this
  // rank's float32 masters beside the whole bf16 working weights; its gradients stay whole, reduced by step.cpp.
  const bool bf16_optimizer =
      cfg.parallelism.shard == ShardMode::Optimizer && cfg.model.param_dtype == model::ParamDtype::Bfloat16;
  const bool uses_sharded_store = store_shards || bf16_optimizer;
  // The float32 masters are this rank's pieces (shard full; optimizer and gradients with bf16 working weights): the
  // checkpoint writer's reads are collectives, every rank taking part.
  const bool masters_sharded = shard_full || (shard_optimizer && cfg.model.param_dtype == model::ParamDtype::Bfloat16);
  const bool lead = world.rank() == 0;  // writes the metrics, the loss picture and the checkpoints
  // Expert parallelism without LoRA: each rank holds and trains only its EP rank's experts, under shard none in a
  // replicated store of its rows (trainer/expert_state.h), under the other shard modes in a HeldExpertStore whose
  // experts' state is sharded over their EDP group (trainer/held_expert_store.h); with LoRA (shard none or optimizer)
  // every rank keeps every expert's base (frozen, mapped) and, when the experts' weights take adapters
  // (model.lora.target_parameters), only its experts' adapters (LoraStore::place_experts; their gradients and norm as
  // held experts', expert_state.h; under shard optimizer the moments of the held layout sharded over the EDP group,
  // adapter_moments_edp).
  const bool hold_experts =
      cfg.parallelism.ep > 1 && cfg.parallelism.shard == ShardMode::None&& cfg.model.lora_rank == 0;
  const bool hold_expert_adapters =
      cfg.parallelism.ep > 1 && cfg.model.lora_rank > 0 && !cfg.model.lora_target_parameters.empty();
  // LoRA's placed adapters under shard optimizer: AdamW's moments cover this rank's EDP slice of its held trainable
  // layout (the experts' adapters of its EP rank, and every non-expert adapter), the update is all-gathered over the
  // EDP group (expert_state.h says why).
  const bool adapter_moments_edp = hold_expert_adapters && cfg.parallelism.shard == ShardMode::Optimizer;
  const bool hold_experts_sharded =
      cfg.parallelism.ep > 1 && cfg.parallelism.shard != ShardMode::None&& cfg.model.lora_rank == 0;
  std::unique_ptr<comm::Communicator> cp_group, dp_group, ep_group;
  std::unique_ptr<comm::Communicator> edp_group;  // the ranks holding this rank's experts (world rank % ep alike)
  // hold_experts_sharded: the experts' own communicator over the EDP group (until set_up hands it to the store),
  // and the store, owned by the model.
  std::unique_ptr<comm::Communicator> held_edp_comm;
  HeldExpertStore* held = nullptr;
  cp::JobContext context;  // the model's parallel context: the local kernels, or the ring over this rank's CP group
  model::Checkpoint ck;
  TrainState state;
  std::string resume_dir;  // empty: a fresh run
  std::unique_ptr<DataSource> data;
  std::unique_ptr<AdamW> adam;  // its state (the moments) and the gradients live in the model's parameter store
  model::RunOptions training;   // how a micro-batch runs (its string options parsed once)
  int feature_dim = 0;          // F of the batches' image features (0: the data has none)
  // model.train_vision: the model's tower of the current weights (Gemma4Multimodal::vision_tower), made again after
  // every update, on every rank at the same point (apply_update); null otherwise.
  const model::VisionEncoder* tower = nullptr;
  double tower_seconds = 0.0;  // this rank's time in the tower (forward, backward, the group's sums) this step
  // uses_sharded_store: the sharded store's own communicator over the world (until set_up hands it over), and the
  // store, owned by the model.
  std::unique_ptr<comm::Communicator> store_comm;
  ShardedStore* sharded = nullptr;
};

inline double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

inline ExpertGroups expert_groups(Run& r) { return {r.world, *r.ep_group, *r.edp_group, r.timeout}; }

// The model.lora fields as the LoRA store takes them (memory_check.cpp).
model::LoraConfig lora_config(const TrainConfig& cfg);

// set_up.cpp
void join_groups(Run& r);
void set_up(Run& r);

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

}  // namespace rf::trainer::detail
