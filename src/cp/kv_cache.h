// ringflex cp: generation's parallel context (core/decode_context.h) over a CP group: the prompt prefilled through the
// job's ordinary context (the local kernels at P = 1, the planned ring otherwise), the KV cache kept on the rank that
// computed each position, and one-token decode steps whose attention is merged over the ranks.
//
// Placement of a decoded position p (the prompt prefilled positions 0..prompt_tokens-1): rank
// (p - prompt_tokens) mod P, round robin, so the decoded positions spread evenly and every rank knows the owner
// without a message (every rank computes the token's K/V; only the owner keeps them). docs/generate.md.
#pragma once

#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "core/decode_context.h"
#include "core/dtype.h"
#include "cp/cp_backend.h"

namespace rf::cp {

// The rank that keeps decoded position `position` (>= prompt_tokens) among P ranks.
inline int decode_owner(int32_t position, int prompt_tokens, int P) { return (position - prompt_tokens) % P; }

// layers: the model's layers in order; dtype: the storage the model writes q/k/v in (model::attention_dtype);
// cache_dtype: what the cache keeps: dtype, or bf16 under float32 (rounded to nearest even when stored, widened to
// float32 when read: half the bytes, the keys and values rounded to 2^-9 relative). ep_group (null or one rank: every
// expert local): the ranks dividing the experts of every MoE layer (cp/decode_experts.h: the prefill's rows dispatched
// as training's, a decode step's experts each run on their holder alone); its ranks must run the same decode steps:
// it lies inside `group` (`ringflex generate --ep`), or spans groups that decode the same prompts with the same
// weights (train.samples on every DP replica). `group` and `ep_group` must outlive the context.
std::unique_ptr<DecodeContext> make_decode_context(comm::Communicator& group, std::vector<CacheLayer> layers,
                                                   DType dtype, DType cache_dtype,
                                                   const CpAttentionOptions& options = {},
                                                   comm::Communicator* ep_group = nullptr);

}  // namespace rf::cp
