// ringflex trainer: the training state of experts held apart (parallelism.ep > 1, shard none, no LoRA; see
// model/expert_store.h; the other shard modes: trainer/held_expert_store.h). EP rank r of an EP group (ep
// consecutive world ranks) holds and trains experts [r * E / ep, (r + 1) * E / ep) of every MoE layer; the world ranks
// holding the same experts (world rank % ep the same, N / ep of them) form its expert-data-parallel (EDP) group.
//   gradients  the experts' over the EDP group, every other parameter's over the world, each element summed in rank
//              order (Communicator::allreduce), so every rank's non-expert gradients are ep 1's bits
//   clipping   the global norm counts each expert once: the non-expert sum of squares (the same on every rank),
//              plus each EP rank's experts' sum, gathered over the EP group and added in EP rank order
//   saving     every expert written once in the Hugging Face layout, each tensor gathered onto the writer (world
//              rank 0) from world ranks 0 .. ep - 1 as its turn comes (trainer/held_checkpoint.h): no whole copy.
//   loading    the store is placed before the weights are read (model::hold_expert_rows of the loader's registry):
//              each rank reads its experts' rows of the files alone, and their moments (load_optimizer_state), so
//              any EP resumes any EP.
// LoRA (shard none or optimizer) holds its experts' adapters apart the same way (model::LoraStore::place_experts: A's
// and B's expert rows, ParamInfo::rows_begin) over a whole frozen base: the gradients and the norm as above; the writer
// takes a LoraStore of whole adapters (gather_held_adapters) and writes PEFT's files from it; a resume reads each
// adapter tensor and moment whole and keeps its rows (load_peft_adapter, load_optimizer_state, which also reads a
// sharded checkpoint's moment files by rows).
// Under shard optimizer a rank's AdamW moments are its EDP slice (slice_of over the EDP group) of its held trainable
// layout: the experts' adapters of its EP rank, sharded over the ranks holding them, and every non-expert adapter,
// sharded over the EDP group as well (so each non-expert element's moments are kept by ep ranks, one an EDP group,
// which update it to the same bits). One contiguous range of a layout every rank of an EDP group shares, so the
// update is ZeRO-1's: the gradients summed as above (whole on every rank), AdamW over the range, the updated slices
// all-gathered over the EDP group; shard none's bits. The non-expert adapters' moments cost ep times their world
// share: LoRA's adapters are a few MB (a few per mille of the base), against one collective and one layout. The
// writer's EP group gathers the moments whole first (WholeAdapterMoments), and writes optimizer.safetensors whole,
// as under shard none.
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
std::unique_ptr<model::ParamStore> gather_held_adapters(const model::LoraStore& part, const ExpertGroups& g);

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
