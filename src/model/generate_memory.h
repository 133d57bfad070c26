// ringflex model: the memory `ringflex generate` checks before it allocates anything, on one rank.
#pragma once

#include <cstdint>
#include <span>

#include "core/dtype.h"
#include "core/memory.h"
#include "model/multimodal.h"
#include "model/ops.h"

namespace rf::model {

// The weights and buffers of the loaded shapes, their bf16 copies when computing in `dtype` bf16, and
// generate_memory_at_least (model/generate.h: the KV caches of prompts of `prompt_tokens` [n] tokens with
// `max_new_tokens` each over P ranks, and the larger of the longest prefill's buffers and a decode step's). What
// ringflex generate checks, and what bench/model's longest-prompt search asks. ep > 1: the rank holds 1 / ep of the
// experts (model/expert_store.h), the others' weights and bf16 copies not counted.
MemoryBreakdown generate_job_memory_at_least(const Gemma4Multimodal& shapes, std::span<const int64_t> prompt_tokens,
                                             int max_new_tokens, int P, int rank, ComputeDtype dtype, DType cache_dtype,
                                             int ep = 1);

}  // namespace rf::model
