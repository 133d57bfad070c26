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
// LoRA (shard none) holds its experts' adapters apart the same way (model::LoraStore::place_experts: A's and B's
// expert rows, ParamInfo::rows_begin) over a whole frozen base: the gradients and the norm as above; the writer takes
// a LoraStore of whole adapters (gather_held_adapters) and writes PEFT's files from it; a resume reads each adapter
// tensor and moment whole and keeps its rows (load_peft_adapter, load_optimizer_state).
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

// A whole-layout copy of the store's weights and moments on world rank 0 (null elsewhere), the expert rows gathered
// over world rank 0's EP group (its ranks call this; the other ranks need not).
std::unique_ptr<model::ParamStore> gather_held_experts(const model::ParamStore& part, const ExpertGroups& g);

// LoRA with the experts' adapters placed (model::LoraStore::place_experts): the same for the adapters alone, a
// LoraStore with every adapter whole (weights and moments; the base unread, holding no values) on world rank 0.
std::unique_ptr<model::ParamStore> gather_held_adapters(const model::LoraStore& part, const ExpertGroups& g);

}  // namespace rf::trainer
