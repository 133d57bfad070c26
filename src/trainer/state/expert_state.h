// ringflex trainer: the training state of experts held apart under shard none (and LoRA's placed expert adapters):
// EP rank r of an EP group holds and trains experts [r * E / ep, (r + 1) * E / ep) of every MoE layer; the world ranks
// holding the same experts form its expert-data-parallel (EDP) group. The gradients' sums, the norm's partials (each
// expert counted once, shard none's bits) and the adapters' save live here.
// The design: docs/parallel-state.md ("Held experts").
#pragma once

#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "model/param_store.h"

namespace rf::model {
class LoraStore;
}

namespace rf::trainer {

struct ExpertGroups {
  comm::Communicator& world;
  comm::Communicator& ep;   // the EP group: the ranks that divide the experts
  comm::Communicator& edp;  // the ranks holding the same experts
  comm::Timeout timeout;
};

// Sums the gradients in place: a held-apart expert tensor's over g.edp, every other trainable parameter's over
// g.world (collectives: every rank of the world, in the same order).
void reduce_held_expert_gradients(model::ParamStore& store, const ExpertGroups& g);

// The sum of squares of the reduced gradients as the shard-none trainer takes it from the whole layout: one
// partial sum per world rank's slice (comm::slice_of over the whole trainable layout), each element added in order
// (sum_of_squares'), so the norm counts each expert once and has the bits of a store holding every expert. A
// slice's running sum passes through the EP rank holding each expert tensor's rows (a broadcast over g.ep per
// piece: about 2 x ep per MoE layer, 8 bytes each). The same bits on every rank.
std::vector<double> held_expert_norm_partials(const model::ParamStore& store, const ExpertGroups& g);

// LoRA with the experts' adapters placed (model::LoraStore::place_experts): a LoraStore with every adapter whole
// (weights and moments, the expert rows gathered over world rank 0's EP group; the base unread, holding no values) on
// world rank 0, null elsewhere (world rank 0's EP group calls this; the other ranks need not).
std::unique_ptr<model::LoraStore> gather_held_adapters(const model::LoraStore& part, const ExpertGroups& g);

// LoRA's placed adapters under shard optimizer, for a save: while it lives the store's moments cover its whole held
// layout, every EDP rank's slice gathered (a collective over `edp`: every rank builds one), so that
// gather_held_adapters finds them; then this rank's slice again. `edp` null: nothing changes.
class WholeAdapterMoments {
 public:
  WholeAdapterMoments(model::ParamStore& store, comm::Communicator* edp, comm::Timeout timeout);
  ~WholeAdapterMoments();
  WholeAdapterMoments(const WholeAdapterMoments&) = delete;
  WholeAdapterMoments& operator=(const WholeAdapterMoments&) = delete;

 private:
  model::ParamStore* store_ = nullptr;  // null: nothing to give back
  model::Shard mine_;                   // this rank's EDP slice of the held layout
};

}  // namespace rf::trainer
