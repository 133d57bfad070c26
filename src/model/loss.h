// ringflex model: the LM head, final logit softcap and cross-entropy, fused and computed in chunks of tokens.
//
// A [T, V] float32 logits tensor would be 8 GiB at T = 8K, V = 262144. Here at most one chunk of logits,
// [chunk, V], exists at a time: the chunk's logits are formed by one sgemm, capped, reduced to a log-sum-exp
// and a per-token loss, and (when gradients are wanted) turned into that chunk's gradient right away, which is
// pushed through the head into dx and dW before the next chunk reuses the buffer. The forward and the backward
// of a chunk share its logits, so nothing is recomputed and nothing of size T x V is kept.
#pragma once

#include <cstdint>

#include "model/ops.h"

namespace rf::model {

constexpr int32_t kIgnoreLabel = -100;

struct LmHeadLossArgs {
  const float* x = nullptr;         // [T, H] final-normed hidden states
  const float* W = nullptr;         // [V, H] head weight (the tied embedding)
  const int32_t* labels = nullptr;  // [T] target of each position; kIgnoreLabel = no loss (null: no loss at all)
  int64_t T = 0, H = 0, V = 0;
  float softcap = 0.f;     // logits = softcap * tanh(logits / softcap); 0 = no cap
  float loss_scale = 0.f;  // the loss is sum(token_loss) * loss_scale (1 / number of label tokens)
  int64_t chunk = 0;       // tokens per chunk (> 0)
  Matmul matmul;           // what the head's two matmuls multiply in (the run's compute dtype)
};

struct LmHeadLossOut {
  float* token_loss = nullptr;  // [T] (0 where ignored); may be null
  float* logits = nullptr;      // [T, V] capped logits, written only when the caller wants them; may be null
  float* dx = nullptr;          // [T, H] += d loss / d x; null: no backward
  float* dW = nullptr;          // [V, H] += d loss / d W; null: no backward
};

// Returns the loss, sum over label tokens of token_loss times loss_scale. Throws rf::Error on a label outside
// [0, V) that is not kIgnoreLabel.
double lm_head_loss(const LmHeadLossArgs& a, const LmHeadLossOut& out);

// Tokens per chunk so that one chunk of float32 logits stays within `budget_bytes` (at least one token).
int64_t loss_chunk_tokens(int64_t V, int64_t budget_bytes);

}  // namespace rf::model
