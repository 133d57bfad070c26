// ringflex core: the parallel context of generation, a model's attention seam (core/attention_backend.h) that keeps
// a KV cache between runs.
//
// Generation runs the model twice over: a prefill of the prompt (one run over its tokens, CP-sharded as any forward)
// and then one run per new token. The model itself is unchanged: it calls forward once per layer, in layer order,
// and never sees the cache. The context tells a layer from the order of its calls (the first call of a run is
// layer 0), which is why it is handed every layer's attention description up front (CacheLayer).
//   prefill: begin_batch/forward are the job's ordinary context's (the local kernels or the CP ring), and each
//            layer's K/V shard (this rank's tokens) is copied into the cache where prefill computed it; the last
//            layer the prefill runs hands its K/V to keep_keys instead of forward (no attention: nothing reads it).
//   decode:  begin_batch gives every rank one new token of each sequence in the step (the run is replicated: its
//            projections are computed on every rank alike); forward appends each token's K/V to its sequence's cache
//            on the one rank the placement rule names, then every rank attends each query over its own cached keys
//            of that sequence and the partials are merged by log-sum-exp (rf::merge_partial) in rank order 0..P-1,
//            so every rank holds the same output.
// docs/generate.md has the layout, the placement rule and what is exact.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "core/attention_backend.h"
#include "core/dtype.h"
#include "core/mask.h"

namespace rf {

// One decoder layer as the cache sees it.
struct CacheLayer {
  LayerMask mask;      // its mask; mask.window > 0 (a sliding layer) keeps only the last `window` positions
  int kv_source = -1;  // >= 0: the layer reads layer kv_source's cache and stores none of its own
  int kv_heads = 0;    // Hkv
  int head_dim = 0;    // D
};

// Positions one rank's cache of `layer` holds at most: a full layer every prompt token it prefilled and every decoded
// token placed on it; a sliding layer no more than its window, since a position W or more behind the newest query is
// never read again (prompt_in_window: its prefilled tokens within the last W - 1 prompt positions, the only ones
// the first decoded query can see).
inline int cache_capacity(const CacheLayer& layer, int prompt_held, int prompt_in_window, int decoded_held) {
  if (layer.mask.window == 0) return prompt_held + decoded_held;
  return std::min(layer.mask.window, prompt_in_window + decoded_held);
}

// Bytes of `capacity` positions of a layer's cache: K and V [Hkv, capacity, D] in `dtype`, and a TokenMeta a key.
inline int64_t layer_cache_bytes(const CacheLayer& layer, int capacity, DType dtype) {
  const int64_t per_position = 2 * int64_t{layer.kv_heads} * layer.head_dim * static_cast<int64_t>(dtype_size(dtype)) +
                               static_cast<int64_t>(sizeof(TokenMeta));
  return layer.kv_source >= 0 ? 0 : per_position * capacity;
}

// One row of a batched decode step: the sequence whose cache it reads and extends, and its token's position.
struct DecodeRow {
  int sequence = 0;
  int32_t position = 0;
};

class DecodeContext : public ParallelContext {
 public:
  // The ranks the cache is spread over (ranks() says 1 during a decode step, which the model sees as one rank's).
  virtual int cache_ranks() const = 0;
  // The job decodes `sequences` sequences together, each with its own cache: every cache is emptied.
  virtual void start_sequences(int sequences) = 0;
  // The next model run is the prefill of sequence `sequence`, a prompt of `prompt_tokens` tokens, after which at most
  // `decode_tokens` are decoded; its cache (sized from both, as cache_bytes says) is emptied and allocated.
  // Collective.
  virtual void start_prefill(int sequence, int prompt_tokens, int decode_tokens) = 0;
  // The next model run is one token of each row (B = rows.size(), S = 1; row b of the run is rows[b]; a sequence's
  // positions follow its prompt one by one; a sequence appears at most once).
  virtual void start_decode(std::span<const DecodeRow> rows) = 0;
  // Frees a finished sequence's cache.
  virtual void release(int sequence) = 0;
  // Bytes a sequence's cache on this rank holds now (allocated: K/V in their dtype, the keys' TokenMeta).
  virtual int64_t allocated_bytes(int sequence) const = 0;
  // The most positions any of this rank's cached layers of a sequence holds now (a sliding layer never more than its
  // window).
  virtual int max_held_positions(int sequence, bool sliding) const = 0;
};

}  // namespace rf
