// ringflex model: where expert parallelism keeps the experts' weights. Under parallelism.ep = P each EP rank holds
// and trains only its experts, rows [r * E / P, (r + 1) * E / P) of every MoE layer's `experts.gate_up_proj`
// [E, 2I, H] and `experts.down_proj` [E, H, I] (core/expert_parallel.h's split): the store registers those tensors
// with the rank's rows only (ParamInfo::rows_begin, rows_total), so their weights, gradients and AdamW moments are
// E / P experts' worth, and moe.cpp indexes them by the expert's row in what the store holds. The router (with its
// per_expert_scale [E], which every token reads) and every other parameter stay whole on every rank.
//
// The files always hold whole tensors (each expert written once in the Hugging Face layout), so a checkpoint resumes
// at any EP: a loader places a store of the rows (hold_expert_rows of its registry, model::PlaceParams) and reads those
// rows of the files alone; the trainer's writer gathers each tensor's rows as it writes it
// (trainer/state/held_checkpoint.h).
#pragma once

#include <memory>
#include <string>

#include "model/config.h"
#include "model/param_store.h"

namespace rf::model {

// A MoE layer's expert tensor, [E, ...] with one leading row per expert: what expert parallelism divides.
bool is_expert_tensor(const ParamInfo& p);

// Rows per leading index of a parameter: numel / shape[0] (1 for a 0-d tensor, 0 for an empty one).
int64_t row_elements(const ParamInfo& p);

// A ReplicatedStore registering `whole`'s parameters in its order and with its trainable flags, the expert tensors
// cut to EP rank `rank` of `ranks` (rows [rank * E / ranks, (rank + 1) * E / ranks)). The weights (when `whole`'s
// are allocated) and both moments (when allocated over the whole trainable layout) are copied, the rows held only;
// gradients are not (allocate them again). Throws rf::Error when E does not divide over the ranks.
std::unique_ptr<ParamStore> hold_expert_rows(const ParamStore& whole, int rank, int ranks);

// A ReplicatedStore registering `part`'s parameters whole, with its trainable flags, nothing allocated: the shapes
// a memory check counts from (a held store's registry counts its experts only).
std::unique_ptr<ParamStore> whole_registry(const ParamStore& part);

// Throws rf::Error "<what> needs a model with MoE layers (enable_moe_block)" or "<what> does not divide the model's
// E experts" where ep > 1 cannot divide `config`'s experts (what: the option and its value, e.g.
// "config: parallelism.ep = 2", "--ep 2").
void check_expert_parallelism(const Gemma4Config& config, int ep, const std::string& what);

// Elements of `whole`'s expert tensors (is_expert_tensor) that the other EP ranks hold under `ep` ranks: a rank holds
// 1 / ep of each, so (ep - 1) / ep of them are not in its memory. matmul_only: of those among the matmul operands
// only (what a bf16 copy is made of).
int64_t expert_elements_elsewhere(const ParamStore& whole, int ep, bool matmul_only = false);

// Copies, for every slot, the leading rows `from` and `to` both hold, of the weights and (where both have them) the
// moments. Both stores must register the same names in the same order.
void copy_held_rows(const ParamStore& from, ParamStore& to);

}  // namespace rf::model
