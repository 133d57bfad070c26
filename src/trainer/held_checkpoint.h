// ringflex trainer: the checkpoints of a run holding its experts apart (parallelism.ep > 1 without LoRA: under shard
// none a replicated store of the rank's expert rows, trainer/expert_state.h; under the other shard modes a
// HeldExpertStore, trainer/held_expert_store.h), written and read with no whole copy of the model on any rank.
//   saving   the files are those of a store holding every expert (each expert written once in the Hugging Face
//            layout, the moments whole in optimizer.safetensors). A HeldWriter stands in the model while it saves,
//            on every rank: model::save_checkpoint and write_moments_streamed run the same fills in the same order
//            on every rank, and each fill (one tensor) is a collective over the world. The writer (world rank 0)
//            receives the tensor's parts from the ranks holding them, point to point, each part sent straight from
//            its holder's store into the one tensor the writer is writing: an EP rank's expert rows from world rank
//            a of EP rank a; a moment slice from the rank keeping it (the experts' over their EDP group, the rest's
//            over the world); a non-expert weight from the writer's own store, or under shard full by the inner
//            ShardedStore's own collective read.
//   loading  the store is placed before any weight is allocated (model::PlaceParams): shard none's rows
//            (model::hold_expert_rows of the registry) or place_held_experts. The loader reads each expert tensor's
//            held rows alone, one expert at a time, and every other tensor as the store keeps it (a ShardedStore its
//            pieces); the moments are read by slice (load_held_moments, load_optimizer_state).
// Memory beside the run's state: one tensor on the writer (and, where the fills run a collective read, on every
// rank) during a save; one non-expert tensor or one expert's rows during a load.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "model/param_store.h"
#include "trainer/held_expert_store.h"

namespace rf::trainer {

// The files' registry of a store holding experts apart: every parameter whole (ParamInfo::whole_shape) with the
// run's trainable flags (a HeldExpertStore's experts as its ExpertSlices has them). Nothing allocated.
std::unique_ptr<model::ParamStore> files_layout(const model::ParamStore& held);

// Registers `held`'s parameters as files_layout does and reads each tensor from the ranks holding its parts. Every
// rank of the world builds one and calls its reads for the same slots in the same order.
class HeldWriter final : public model::ReplicatedStore {
 public:
  // `held`: the run's store (shard none's replicated store of expert rows, or a HeldExpertStore), which must outlive
  // the writer; `g`: the world, the EP group (ep consecutive world ranks) and the EDP group.
  HeldWriter(model::ParamStore& held, const HeldGroups& g);

  // The whole tensor of `slot` into `out` [numel] on the writer (world rank 0); the other ranks send their parts
  // (`out` left as it is, or filled by a collective read). Collective over the world.
  void read_weight(size_t slot, std::span<float> out) override;
  // The same for a trainable parameter's moment (Role::ExpAvg or Role::ExpAvgSq): write_moments_streamed's reader.
  void read_moment(model::Role role, size_t slot, std::span<float> out);

 private:
  // A part of a tensor: elements [first, first + n) of it, held by world rank `rank` (values: on that rank only).
  struct Part {
    int rank = 0;
    int64_t first = 0, n = 0;
    const float* values = nullptr;
  };
  std::vector<Part> parts(size_t slot, model::Role role) const;
  void gather(const std::vector<Part>& parts, std::span<float> out) const;

  model::ParamStore& held_;
  HeldExpertStore* sharded_;  // null: shard none's replicated store
  HeldGroups g_;
};

// --resume of a HeldExpertStore placed by the loader: its parts' moments (the ranges set_held_moment_ranges set)
// allocated and read from the checkpoint's files, whichever layout wrote them (load_moments_into).
void load_held_moments(const std::string& dir, HeldExpertStore& held);

}  // namespace rf::trainer
