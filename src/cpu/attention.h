// ringflex cpu: masked attention kernels for one query set against one key/value chunk.
//
// These are the ring's per-step primitive (docs/spec.md §6) and the single-rank path. They take the same AttnChunk as
// the scalar reference and must match it (tests/cpu). Per-chunk results are partial: the caller merges partials
// of several chunks with rf::merge_partial, and runs the backward with the *merged* lse and delta.
#pragma once

#include "core/attention_args.h"

namespace rf::cpu {

// Tiles of the flash-attention loops: kTileQ queries x kTileK keys. Each (query tile, key tile) pair is classified
// once from block summaries (rf::classify): empty pairs are skipped, full ones run without the predicate.
constexpr int kTileQ = 64;
constexpr int kTileK = 64;

// o: [B, Hq, Lq, D] float32, normalised over this chunk's allowed keys (0 where none);
// lse: [B, Hq, Lq] float32 natural log (-inf where none).
void attention_forward(const AttnChunk& c, float* o, float* lse);

// delta[row] = sum_d dout[row, d] * o[row, d], the softmax-backward row term.
// dout: [B, Hq, Lq, D] in `dtype`; o: [B, Hq, Lq, D] float32 (the merged output); delta: [B, Hq, Lq].
void attention_delta(const AttnShape& s, DType dtype, const void* dout, const float* o, float* delta);

// y[i] = 2^x[i] for x[i] <= 0, i < n, with the softmax's exp2 of the path isa.h chose (vector paths: relative error
// < 3e-7, scalar: std::exp2); y may be x. For other softmaxes over the same path (the model's loss).
void softmax_exp2(const float* x, float* y, int64_t n);

// Backward of one chunk, *accumulating* (+=) into float32 gradients:
// dq: [B, Hq, Lq, D]; dk, dv: [B, Hkv, Lk, D]. lse and delta: [B, Hq, Lq], the final (merged) ones.
// dout: [B, Hq, Lq, D] in c.dtype. Rows with lse = -inf contribute nothing.
void attention_backward(const AttnChunk& c, const void* dout, const float* lse, const float* delta, float* dq,
                        float* dk, float* dv);

}  // namespace rf::cpu
