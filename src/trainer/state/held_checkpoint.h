// ringflex trainer: the checkpoints of a run holding its experts apart (state/held_experts.cpp), written and read with
// no whole copy of the model on any rank: a save writes from a HeldWriter, a store laid out as the files have it
// whose reads gather each tensor onto the writer (world rank 0) from the ranks holding its parts; a load places the
// store first and reads each rank's experts' rows alone, the moments by slice. Each takes the run's store as its
// state holds it (shard none's store of expert rows, or a HeldExpertStore): nothing asks a store which it is.
// The design: docs/parallel-state.md ("Their checkpoints").
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "model/param_store.h"
#include "trainer/state/held_expert_store.h"

namespace rf::trainer {

// The files' registry of a store holding experts apart: every parameter whole (ParamInfo::whole_shape) with the
// run's trainable flags. Nothing allocated. Shard none: `rows` (model::hold_expert_rows), its own flags; a
// HeldExpertStore: its experts' as its ExpertSlices has them.
std::unique_ptr<model::ParamStore> files_layout(const model::ParamStore& rows);
std::unique_ptr<model::ParamStore> files_layout(const HeldExpertStore& held);

// Registers `held`'s parameters as files_layout does and reads each tensor from the ranks holding its parts. Every
// rank of the world builds one and calls its reads for the same slots in the same order.
class HeldWriter final : public model::ReplicatedStore {
 public:
  // The run's store, which must outlive the writer: shard none's replicated store of expert rows (`rows`), or a
  // HeldExpertStore (`held`); `g`: the world, the EP group (ep consecutive world ranks) and the EDP group.
  HeldWriter(model::ParamStore& rows, const HeldGroups& g);
  HeldWriter(HeldExpertStore& held, const HeldGroups& g);

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
  HeldWriter(model::ParamStore& held, HeldExpertStore* apart, const HeldGroups& g);
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
