// ringflex model: a parameter's values in the dtype a store holds them in, and the low-rank adapter a layer adds to a
// frozen linear weight (model/param_store.h ParamStore::held_weight, ParamStore::adapter; model/lora_store.h).
//
// Stores hold their weights in float32, except a LoRA store's frozen base, which stays in the checkpoint's own dtype
// (bfloat16, float16 or float32) where the safetensors files are mapped: readers that can take it as it is (the
// embedding's row gathers, the bf16 matmuls) read it there, the others widen it per block.
#pragma once

#include <cstdint>
#include <vector>

#include "core/default_init.h"

namespace rf::model {

enum class HeldDType { F32, BF16, F16 };
int64_t held_dtype_size(HeldDType t);  // bytes per element

struct HeldWeight {
  HeldDType dtype = HeldDType::F32;
  const void* data = nullptr;  // numel elements of `dtype`, row-major as the parameter's shape
};

// Widens elements [first, first + n) of `w` into out[n] (exact: every bf16 and f16 value is a float32 value).
void widen(const HeldWeight& w, int64_t first, int64_t n, float* out);

// A float32 copy of a held weight's first n elements. The storage is not zero-filled first (widen writes every
// element): a LoRA step widens each layer's frozen base twice (forward, backward), and the zero fill was one more
// pass over those bytes (E2B: 1.86 G base parameters in its layers, ~14 GiB of zeros a rank a step).
using Widened = std::vector<float, DefaultInitAllocator<float>>;
Widened widened_copy(const HeldWeight& w, int64_t n);

// A low-rank adapter on a frozen weight W [out, in] (PEFT's LoRA): the layer computes
//   y = x W^T + scale * (x A^T) B^T
// and its backward, besides the input gradient through W, adds
//   dx += scale * (dy B) A,   dB += scale * dy^T (x A^T),   dA += scale * (dy B)^T x
// (W itself gets no gradient: it is frozen).
struct LinearAdapter {
  const float* A = nullptr;  // [rank, in]
  const float* B = nullptr;  // [out, rank]
  float* dA = nullptr;       // [rank, in]; null: no gradients (a forward-only run)
  float* dB = nullptr;       // [out, rank]
  int64_t rank = 0, in = 0, out = 0;
  float scale = 0.f;
  // experts > 1: PEFT's ParamWrapper on a 3-D weight W [E, out, in], one adapter per expert, expert-major (the
  // store's layout, model/lora_store.h; PEFT's file interleaves B's columns): A [experts * rank, in] and
  // B [experts * out, rank] hold the adapters of experts [experts_begin, experts_begin + experts) of the E (all of
  // them, or an EP rank's under expert parallelism), expert e's A_e the rank rows from (e - experts_begin) * rank,
  // its B_e the out rows from (e - experts_begin) * out (dA, dB alike); the layer adds scale * (x A_e^T) B_e^T to the
  // rows expert e computes.
  int64_t experts = 1;
  int64_t experts_begin = 0;
  // PEFT's lora_dropout on the adapter's input in training runs (2-D adapters only, as PEFT's ParamWrapper refuses
  // it): x's elements are kept with probability 1 - dropout and scaled by 1 / (1 - dropout) where kept, by the mask
  // lora_dropout_keeps(run key, salt, ...) draws. salt: the adapter's own (its base slot).
  float dropout = 0.f;
  uint64_t salt = 0;
};

// Whether PEFT's dropout keeps feature k of the token at global position `pos` of row `row` of a run keyed `key`
// (RunOptions::dropout_key) in the adapter salted `salt`: a function of these alone, so the masks are the same at any
// CP grid and thread count, in the forward, its recompute and the backward.
bool lora_dropout_keeps(uint64_t key, uint64_t salt, int64_t row, int64_t pos, int64_t k, float dropout);

}  // namespace rf::model
