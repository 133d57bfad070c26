// ringflex core: the one parameter struct that every attention implementation takes.
//
// Dimension letters (docs/spec.md §1): B rows, Hq query heads, Hkv key/value heads (Hq % Hkv == 0; query head h reads
// kv head h / (Hq / Hkv)), Lq queries held, Lk keys in the chunk, D head dimension. On one rank without CP,
// Lq = Lk = S. In the ring, Q is the rank's shard and K/V is whichever chunk is passing by.
//
// All buffers are dense row-major in the layouts written beside them.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/dtype.h"
#include "core/mask.h"

namespace rf {

constexpr int kMaxHeadDim = 512;

struct AttnShape {
  int B = 1, Hq = 1, Hkv = 1, Lq = 0, Lk = 0, D = 0;

  int group_size() const { return Hq / Hkv; }  // query heads sharing one kv head (GQA)
  int64_t q_elems() const { return int64_t{B} * Hq * Lq * D; }
  int64_t kv_elems() const { return int64_t{B} * Hkv * Lk * D; }
  int64_t lse_elems() const { return int64_t{B} * Hq * Lq; }
};

inline float default_scale(int D) { return 1.0f / std::sqrt(static_cast<float>(D)); }

// One query set against one key/value chunk: the ring's per-step primitive.
struct AttnChunk {
  AttnShape shape;
  DType dtype = DType::F32;           // of q, k, v (and dout in backward)
  const void* q = nullptr;            // [B, Hq, Lq, D]
  const void* k = nullptr;            // [B, Hkv, Lk, D]
  const void* v = nullptr;            // [B, Hkv, Lk, D]
  const TokenMeta* q_meta = nullptr;  // [B, Lq]
  const TokenMeta* k_meta = nullptr;  // [B, Lk]
  LayerMask mask;
  float scale = 0.f;  // multiplies q.k before the softmax; Gemma 4 uses 1.0
};

// One rank's shard of one layer's attention inputs: its queries against its own keys, shape.Lq == shape.Lk == L.
// What the model's parallel context (core/attention_backend.h, ShardAttention) and the CP engine
// (cp/cp_attention.h, CpShard) both take, so neither converts the other's copy field by field.
struct AttnShard {
  AttnShape shape;
  DType dtype = DType::F32;         // of q, k, v (and dout in backward)
  const void* q = nullptr;          // [B, Hq, L, D]
  const void* k = nullptr;          // [B, Hkv, L, D]
  const void* v = nullptr;          // [B, Hkv, L, D]
  const TokenMeta* meta = nullptr;  // [B, L], idx in the (padded) full row
};

// The shard as one chunk: its queries against its own keys (q_meta = k_meta = meta), as the one-rank path runs it.
AttnChunk chunk_of(const AttnShard& s, const LayerMask& mask, float scale);

// Throws rf::Error naming the first problem (Hq % Hkv, D out of 1..512, negative sizes or window, null buffers).
void validate(const AttnChunk& c);

}  // namespace rf
