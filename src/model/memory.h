// ringflex model: how much memory one Gemma4Model::run needs on a rank, known before it allocates anything.
//
// The figure is a lower bound of the run's peak: only buffers that gemma4.cpp and its blocks surely hold at the
// same moment are counted, so a job that would fit is never refused. Each term is derived in memory.cpp from the
// allocation it stands for; tests/model/test_memory.cpp checks the terms against the sizes a run reports
// (Result::kept_activation_bytes, layer_recompute_bytes) and the total against a run's peak RSS growth.
#pragma once

#include <cstdint>

#include "core/memory.h"
#include "model/gemma4.h"

namespace rf::model {

struct RunMemoryArgs {
  int64_t tokens = 0;                 // T = B * L: the tokens this rank holds (L >= ceil(S / P) under CP)
  bool training = false;              // RunOptions::want_grad
  bool recompute_layers = true;       // RunOptions::recompute_layers (only matters when training)
  bool keep_mlp_projections = false;  // RunOptions::keep_mlp_projections (only with recompute_layers)
  bool keep_o_proj_output = true;     // RunOptions::keep_o_proj_output (only with recompute_layers)
  bool keep_down_proj_output = true;  // RunOptions::keep_down_proj_output (only with recompute_layers)
  bool spill = false;                 // RunOptions::spill_dir set (only with recompute_layers): kept layers on disk
  int64_t mlp_tile_tokens = 2048;     // RunOptions::mlp_tile_tokens
  bool tile_mlp = false;              // RunOptions::tile_mlp
  bool logits = false;                // RunOptions::want_logits: Result::logits [T, V]
  int64_t loss_chunk_tokens = 0;      // RunOptions::loss_chunk_tokens (0: loss_chunk_tokens(V, kLossChunkBytes))
  // Weights a store widens to float32 for a phase only (a LoRA base held in bf16, model/lora_store.h): the largest
  // layer's, alive while a layer is computed or recomputed and differentiated, and the LM head's float32 panel
  // scratch (loss.h head_panel_bytes: the loss reads a held head by panels, never widened whole), alive for the loss.
  int64_t layer_weight_bytes = 0;
  int64_t head_weight_bytes = 0;
};

// Named terms (bytes, float32), the largest phase of the run (a layer of the forward, the loss, each layer's MLP
// backward and attention backward, the embedding's backward), any of which may be absent:
//   "activations"   what the backward keeps from the forward (layer inputs, attention outputs and LSE, the o_proj
//                   and down_proj outputs unless told otherwise, the MLP projections with keep_mlp_projections, and
//                   with recompute off every layer's whole activations) of the layers not yet differentiated, the
//                   embedded row and the per-layer inputs, K/V that later layers read, and the [T, H] hidden-state
//                   buffers alive at that moment; with spill, of the layers' kept activations only the
//                   differentiated layer's, read back from the file (the rest are on disk: run_spill_bytes);
//   "one layer"     one layer's activations while it is computed or recomputed (its norms' outputs and RMS factors,
//                   q/k/v, attention output, o_proj, MLP, residuals, per-layer-input block), past what "activations"
//                   holds already;
//   "backward buffers"  the gradients the backward holds: the per-layer inputs' and the stored K/V's for the whole
//                   backward, and in a layer's MLP backward its residual-stream gradients and one token tile's dh
//                   [min(T, mlp_tile_tokens), I], in its attention's backward the one residual gradient left; in
//                   the embedding's backward its own;
//   "the attention's gradients"  in a layer's attention backward (the MLP's buffers are freed by then),
//                   attention_grad_widths' buffers, T tokens each;
//   "the MLP's tile"  with tile_mlp, the [tile, I] gate, up and GeGLU products of one tile (the forward's largest
//                   layer's, or a layer's in its backward), which "one layer" then leaves out;
// Entries are -1 (MemoryBreakdown's overflow) when a product does not fit int64.
MemoryBreakdown run_memory_at_least(const Gemma4Model& m, const RunMemoryArgs& args);

// Floats per token of each gradient buffer a layer's attention backward holds (attention_block.cpp sizes them with
// this, the memory model sums them): all are alive together while the K/V projections are differentiated, after
// the attention's own backward. The attention-storage ones (dO) are counted as float32, as Q, K, V are here.
struct AttentionGradWidths {
  int64_t dao = 0;     // [H] the o_proj output's gradient
  int64_t dO = 0;      // [Hq*D] the attention output's, in the attention's storage
  int64_t dQ = 0;      // [Hq*D]
  int64_t dKV = 0;     // [Hkv*D] each of dK, dV (this layer's share; KV-shared layers add it to the source's)
  int64_t dq_raw = 0;  // [Hq*D] before q_norm
  int64_t da = 0;      // [H] the input norm's output's
  int64_t dk_raw = 0;  // [Hkv*D] before k_norm, own K/V only
  int64_t dv_raw = 0;  // [Hkv*D] before v_norm, own K/V with a v_proj only
  int64_t total() const { return dao + dO + dQ + 2 * dKV + dq_raw + da + dk_raw + dv_raw; }
};
AttentionGradWidths attention_grad_widths(const Gemma4Config& c, const LayerSpec& s);

// Disk bytes the run's spill file takes (RunOptions::spill_dir, a training run with recompute_layers and
// args.spill): every layer's kept activations, each layer's block rounded up to whole pages
// (io::SpillFile::block_bytes); 0 without spill. What Gemma4Model::run reserves, and Result::spilled_bytes after it.
int64_t run_spill_bytes(const Gemma4Model& m, const RunMemoryArgs& args);

}  // namespace rf::model
