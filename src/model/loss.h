// ringflex model: the LM head, final logit softcap and cross-entropy, fused and computed in chunks of tokens.
//
// A [T, V] float32 logits tensor would be 8 GiB at T = 8K, V = 262144. Here at most one chunk of logits,
// [chunk, V], exists at a time: the chunk's logits are formed by one sgemm, capped, reduced to a log-sum-exp
// and a per-token loss, and (when gradients are wanted) turned into that chunk's gradient right away, which is
// pushed through the head into dx and dW before the next chunk reuses the buffer. The forward and the backward
// of a chunk share its logits, so nothing is recomputed and nothing of size T x V is kept.
//
// A frozen head held in another dtype than float32 (a LoRA base's bf16 token table, model/lora_store.h) is never
// widened whole: each chunk's two products run over panels of vocabulary rows, widened into one small float32
// scratch [panel, H] (or, in the bf16 compute mode, a bf16 panel handed to the bf16 matmul as it is held), so the
// head costs the loss head_panel_bytes(H) instead of V * H * 4 (1.5 GiB for Gemma 4 E2B's tied table).
#pragma once

#include <cstdint>

#include "model/held_weight.h"
#include "model/ops.h"

namespace rf::model {

constexpr int32_t kIgnoreLabel = -100;

struct LmHeadLossArgs {
  const float* x = nullptr;         // [T, H] final-normed hidden states
  const float* W = nullptr;         // [V, H] head weight (the tied embedding); null: `head` holds it
  const int32_t* labels = nullptr;  // [T] target of each position; kIgnoreLabel = no loss (null: no loss at all)
  int64_t T = 0, H = 0, V = 0;
  float softcap = 0.f;     // logits = softcap * tanh(logits / softcap); 0 = no cap
  float loss_scale = 0.f;  // the loss is sum(token_loss) * loss_scale (1 / number of label tokens)
  int64_t chunk = 0;       // tokens per chunk (> 0)
  Matmul matmul;           // what the head's two matmuls multiply in (the run's compute dtype)
  // With W null: the frozen head [V, H] in its held dtype (bf16, f16 or f32), read by panels of `panel_rows`
  // vocabulary rows (0: head_panel_rows(H)). No dW then (LmHeadLossOut::dW must be null: the head is frozen).
  HeldWeight head;
  int64_t panel_rows = 0;
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

// The fewest tokens a default chunk holds. Each of the head's three products (z = x W^T, dx = dz W, dW += dz^T x)
// packs a [V, H]-sized operand once per call (OpenBLAS copies it into its panel layout), work of V*H against the
// chunk's C*V*H multiply-adds, so the copies' share falls as 1/C. Measured, 1-thread OpenBLAS SkylakeX on an Intel
// Xeon (model 207), the three products at H = 1536, V = 262144: C = 64 ran 82-84 GFLOP/s, 128 80-103, 256 90-112,
// 512 109-114; at H = 640, V = 65536, C = 256 and 1024 read the same within the machine's noise.
constexpr int64_t kMinLossChunkTokens = 256;

// Bytes of the float32 panel a frozen held head is widened into, per chunk and product. OpenBLAS packs the [panel, H]
// operand into its own layout on every call anyway, so the whole head is packed once per chunk however it is cut; what
// a smaller panel adds is the other operand's packing (the chunk's x, or its dz columns) once per panel, C * H
// against the panel's C * panel * H multiply-adds: below 0.2% from panel = 512 rows on. 4 MiB is 682 rows at
// Gemma 4's H = 1536 (2730 at H = 384).
constexpr int64_t kHeadPanelBytes = int64_t{4} << 20;

// Vocabulary rows of a panel at hidden size H (at least 1), and the float32 scratch's bytes for a head of V rows.
int64_t head_panel_rows(int64_t H);
int64_t head_panel_bytes(int64_t V, int64_t H);

// Tokens per chunk: as many as keep one chunk of float32 logits within `budget_bytes`, but at least
// kMinLossChunkTokens, so a large vocabulary gets a chunk beyond the budget (Gemma 4's V = 262144: 256 tokens,
// 256 MiB, at a 64 MiB budget) rather than a head that runs at three quarters of its speed.
int64_t loss_chunk_tokens(int64_t V, int64_t budget_bytes);

}  // namespace rf::model
