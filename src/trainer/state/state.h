// ringflex trainer: the training state of a run, one mode a file (docs/parallel-state.md): what a rank holds of the
// weights, gradients and moments, and the operations that depend on it (the store, the gradient reduction, the
// norm's partials, the update, a save's parts, the bytes by kind). plan_state is the only place that maps a config
// to a mode; the trainer calls the interface and never asks which mode it runs.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/memory.h"
#include "model/checkpoint.h"
#include "model/multimodal.h"
#include "model/param_store.h"
#include "trainer/checkpoint.h"
#include "trainer/config.h"

namespace rf::trainer {
class ShardedStore;
}

namespace rf::trainer::detail {

struct Run;

// Whether a mode runs a config: an empty refusal, or the reason it does not (validate's line after "config: ").
struct Support {
  std::string refusal;
  explicit operator bool() const { return refusal.empty(); }
};

// The mode's terms of the memory check (train_memory_at_least adds the step's rows and activations after them), and
// what a LoRA base widens for a phase of the run (model::RunMemoryArgs).
struct StateBytes {
  MemoryBreakdown terms;
  int64_t layer_weight_bytes = 0, head_weight_bytes = 0;
};

// A save's last part, on every rank, given the store as the files have it: rank 0 renames the directory into place
// with the store's trainer_state.json and the moment files' layout.
using FinishSave = std::function<void(const model::ParamStore& store, const PendingCheckpoint::MomentLayout& moments)>;

class TrainingState {
 public:
  virtual ~TrainingState() = default;

  // Whether this mode runs `c` (checked by validate before anything is built).
  virtual Support supports(const TrainConfig& c) const = 0;
  // The mode's per-rank bytes by kind for `m` over `world_size` ranks, `ranks_on_node` of them on each machine (they
  // share what a machine maps once). `m`: the config's model, its registry the model's own parameters (shapes
  // suffice; no LoRA adapters: model_shapes, or the loader's shapes before its store allocates).
  virtual StateBytes bytes(const TrainConfig& c, const model::Gemma4Multimodal& m, int world_size,
                           int ranks_on_node) const = 0;

  // join_groups: the communicators the mode's store takes (collective: every rank, in the same order).
  virtual void join(Run& r) { (void)r; }
  // The store the loader fills (null: a replicated store), and the placing hook of a store that must exist before
  // the weights are read (held experts).
  virtual std::unique_ptr<model::ParamStore> make_store(Run& r) = 0;
  virtual model::PlaceParams place(Run& r) {
    (void)r;
    return {};
  }
  // A model drawn in memory (model.builtin) after init_random filled every slot.
  virtual void drawn(Run& r) { (void)r; }
  // --resume (r.resume_dir resolved): the model and where the run stands (r.ck, r.state) from the checkpoint.
  virtual void resume(Run& r);
  // Where the loaded weights came from, which set_up checks finite (empty: drawn in memory, nothing to check).
  virtual std::string weights_source(const Run& r) const;
  // set_up's last part: the store's final layout and moment range before AdamW allocates the moments, then a
  // resumed run's moments and what the layout becomes once they are read.
  virtual void before_optimizer(Run& r) = 0;
  virtual void after_optimizer(Run& r);

  // model.train_vision: whether the store's hooks of the tower's backward are collective (a reduction a group),
  // which every rank joins, with no images of its own too (VisionEncoder::join_hooks).
  virtual bool tower_gradients_collective() const { return false; }
  // Whether every micro-batch's forward is a collective over the world (every rank runs as many).
  virtual bool forward_collective() const { return false; }

  // A step: the gradients summed over the ranks, the norm's per-rank partial sums of squares (added in rank order by
  // the caller), the AdamW update at learning rate `lr` from the gradients times `clip`.
  virtual void reduce_gradients(Run& r) = 0;
  virtual std::vector<double> norm_partials(Run& r) = 0;
  virtual void update(Run& r, double lr, int64_t step, double clip) = 0;

  // The step's seconds waiting on the store's collectives (null: the store posts none), taken (reset).
  virtual std::optional<double> take_comm_wait() { return std::nullopt; }
  // The experts a rank holds of `experts` over `ep` EP ranks.
  virtual int64_t experts_held(int64_t experts, int ep) const {
    (void)ep;
    return experts;
  }

  // The store whose float32 masters are this rank's pieces (read piece by piece: ShardedStore::own_piece), or null.
  virtual const ShardedStore* sharded_masters() const { return nullptr; }
  // The registry as the files have it, which a save's wait is sized by (null: the store's own), e.g. every expert
  // whole.
  virtual std::unique_ptr<model::ParamStore> files_registry(Run& r) {
    (void)r;
    return nullptr;
  }
  // A save into `tmp` (rank 0 made it): the weights, then the moments, then `finish`, each part ended by an
  // agreement over the world (a failure on any rank ends every rank).
  virtual void save(Run& r, const std::string& tmp, comm::Timeout wait, const FinishSave& finish) = 0;
  // The whole weights on every rank at the end of a run (TrainOptions::whole_model).
  virtual void unshard() {}
};

// The config's mode (the only mapping from a config to a mode; nothing is built): replicated (shard none and
// optimizer), sharded (gradients, full, and optimizer with bfloat16 working weights), held experts (ep > 1 without
// LoRA) or LoRA.
std::unique_ptr<TrainingState> plan_state(const TrainConfig& c);

// The modes (state/<mode>.cpp).
std::unique_ptr<TrainingState> replicated_state(const TrainConfig& c);
std::unique_ptr<TrainingState> sharded_state(const TrainConfig& c);
std::unique_ptr<TrainingState> held_experts_state(const TrainConfig& c);
std::unique_ptr<TrainingState> lora_state(const TrainConfig& c);

// Shared by the modes (state/common.cpp).
// The bytes of a replicated weight and gradient layout (shard none or optimizer) for `trainable_bytes` of trainable
// parameters and `weight_bytes` of weights: "weights" (or bf16 masters), "gradients", `extra`, "AdamW moments" over
// `moment_ranks` ranks under shard optimizer, and the bf16 copies.
struct ReplicatedBytes {
  int64_t weight_bytes = 0, trainable_bytes = 0, bf16_elsewhere_bytes = 0;
  int moment_ranks = 1;
  MemoryBreakdown extra;
};
MemoryBreakdown replicated_bytes(const TrainConfig& c, const model::Gemma4Multimodal& m, int world_size,
                                 const ReplicatedBytes& b);
// Bytes of `m`'s trainable parameters after model.freeze.
int64_t trainable_bytes(const TrainConfig& c, const model::ParamStore& registry);
// One save part on every rank: `write` runs, then the world agrees (a failure anywhere ends every rank).
void agreed_part(Run& r, comm::Timeout wait, const std::function<void()>& write);
// `store`'s weights into `tmp` (the files' layout: every parameter whole): rank 0 writes, the ranks in
// `all_take_part` take part in collective reads.
void save_weights(Run& r, model::ParamStore& store, const std::string& tmp, comm::Timeout wait, bool all_take_part);
// ZeRO-1's moments of `store`: one file a rank; returns every rank's range.
PendingCheckpoint::MomentLayout save_moments_per_rank(Run& r, const model::ParamStore& store, const std::string& tmp,
                                                      comm::Timeout wait);
// `store`'s moments whole in one file, written by rank 0.
void save_moments_whole(Run& r, const model::ParamStore& store, const std::string& tmp, comm::Timeout wait);
// The last part (finish) in an agreement, with `store` as the files have it.
void finish_save(Run& r, const model::ParamStore& store, comm::Timeout wait, const FinishSave& finish,
                 const PendingCheckpoint::MomentLayout& m);
// Sum of squares of the replicated store's reduced gradients: under shard optimizer each rank's own slice,
// gathered; otherwise every slice here.
std::vector<double> replicated_norm_partials(Run& r, bool slices_gathered);
// ZeRO-1 after the update: every rank's updated slice of the trainable layout over `c` into every rank's weights.
void gather_updated_weights(comm::Communicator& c, model::ParamStore& store, comm::Timeout timeout);

}  // namespace rf::trainer::detail
