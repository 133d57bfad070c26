// ringflex model: the memory of one run (see memory.h). Every term below names the buffers of gemma4.cpp,
// attention_block.cpp, mlp.cpp and embedding.cpp it counts; buffers whose lifetime is unclear, MoE's routed
// batches, the PLE block's and the backward's temporaries are left out, which keeps the sum a lower bound.
#include "model/memory.h"

#include <algorithm>

#include "io/spill_file.h"
#include "model/loss.h"

namespace rf::model {

namespace {

constexpr int64_t kFloat = sizeof(float);
constexpr const char* kLayerWeights = "one layer's weights widened";
constexpr const char* kHeadWeights = "the head's panel widened";
constexpr const char* kMlpTile = "the MLP's tile";

// Floats per token of layer l's LayerActs as layer_forward fills them (the whole struct is alive until the layer
// ends): input norm a [H]; q_raw and Q [Hq*D] each; with its own K/V k_raw, K, V [Hkv*D] each (and v_raw with a
// v_proj); O [Hq*D] and LSE [Hq]; ao and x1 [H] each; the MLP's m_in and mo [H] and g, u, hmid [I] each. The
// per-token RMS factors ([1] or [heads]) and everything of MoE and PLE are not counted. With the tiled MLP
// (RunOptions::tile_mlp) g, u, hmid are not per token: mlp_tile_floats.
int64_t layer_floats(const Gemma4Model& m, int l, bool with_attention_output, bool tiled_mlp) {
  const LayerSpec& s = m.spec(l);
  const int64_t H = m.config().hidden_size, Hq = m.config().num_heads;
  const int64_t qd = Hq * s.head_dim, kvd = int64_t{s.kv_heads} * s.head_dim;
  int64_t n = H + 2 * qd + 2 * H;                              // a; q_raw, Q; ao, x1
  if (s.kv_source < 0) n += (s.has_v_proj ? 4 : 3) * kvd;      // k_raw, K, V (v_raw)
  if (with_attention_output) n += qd + Hq;                     // O, lse
  n += 2 * H + (tiled_mlp ? 0 : 3 * int64_t{s.intermediate});  // m_in, mo; g, u, hmid
  return n;
}

// What the forward keeps for a recompute besides each layer's input, attention output and LSE (RunOptions).
struct Handed {
  bool mlp = false;       // keep_mlp_projections
  bool o_proj = true;     // keep_o_proj_output
  bool down_proj = true;  // keep_down_proj_output
};

// Floats per token of layer l's products that a recompute is handed instead of redoing them: the o_proj and
// down_proj outputs ao, mo [H] (RunOptions::keep_*_output), and the MLP's g, u [I] with keep_mlp_projections.
int64_t handed_floats(const Gemma4Model& m, int l, Handed h) {
  const int64_t H = m.config().hidden_size;
  return (h.o_proj ? H : 0) + (h.down_proj ? H : 0) + (h.mlp ? 2 * int64_t{m.spec(l).intermediate} : 0);
}

// Floats per token that Run keeps for the backward from layer l (gemma4.cpp): its input x_in [H], and either the
// attention output O [Hq*D] and LSE [Hq] with the products handed to the recompute (recompute on) or its whole
// LayerActs (recompute off).
int64_t kept_floats(const Gemma4Model& m, int l, bool recompute, Handed handed, bool tiled_mlp) {
  const LayerSpec& s = m.spec(l);
  const int64_t H = m.config().hidden_size, Hq = m.config().num_heads;
  if (!recompute) return H + layer_floats(m, l, true, tiled_mlp);
  return H + Hq * s.head_dim + Hq + handed_floats(m, l, handed);
}

// Floats per token of the K/V [Hkv*D] x 2 that layer l stores for the KV-shared layers (kv_K, kv_V).
int64_t shared_kv_floats(const Gemma4Model& m, int l) {
  const LayerSpec& s = m.spec(l);
  return s.stores_kv ? 2 * int64_t{s.kv_heads} * s.head_dim : 0;
}

// Floats of the tiled MLP's [tile, I] buffers of layer l (mlp.cpp, tile = min(T, mlp_tile_tokens)): its forward's
// or recompute's g, u, hmid, or its backward's g, u, hmid recomputed (the forward's hmid: dh is counted among the
// backward buffers).
int64_t mlp_tile_floats(const Gemma4Model& m, int l, int64_t tile) { return 3 * tile * m.spec(l).intermediate; }

// The phase that needs more (an overflowed one, total -1, counts as the larger).
const MemoryBreakdown& larger(const MemoryBreakdown& a, const MemoryBreakdown& b) {
  if (a.total() < 0) return a;
  if (b.total() < 0) return b;
  return a.total() >= b.total() ? a : b;
}

}  // namespace

AttentionGradWidths attention_grad_widths(const Gemma4Config& c, const LayerSpec& s) {
  const int64_t qd = int64_t{c.num_heads} * s.head_dim, kd = int64_t{s.kv_heads} * s.head_dim;
  const bool own_kv = s.kv_source < 0;
  AttentionGradWidths w;
  w.dao = w.da = c.hidden_size;
  w.dO = w.dQ = w.dq_raw = qd;
  w.dKV = kd;
  w.dk_raw = own_kv ? kd : 0;
  w.dv_raw = own_kv && s.has_v_proj ? kd : 0;
  return w;
}

MemoryBreakdown run_memory_at_least(const Gemma4Model& m, const RunMemoryArgs& args) {
  const Gemma4Config& c = m.config();
  const int64_t T = args.tokens, H = c.hidden_size, V = c.vocab_size, layers = c.num_layers;
  const auto bytes = [&](int64_t floats_per_token) { return checked_bytes({T, floats_per_token, kFloat}); };
  // The MLP's token tile (mlp.cpp): its backward's dh, and with tile_mlp every [., I] product, are that long.
  const int64_t tile = std::min(std::max<int64_t>(T, 1), std::max<int64_t>(args.mlp_tile_tokens, 1));
  const bool tiled = args.tile_mlp;
  const auto tile_bytes = [&](int l) { return tiled ? checked_bytes({mlp_tile_floats(m, l, tile), kFloat}) : 0; };

  // Alive for the whole run: the embedded row h0 [T, H] and the per-layer inputs ple, ple_raw [T, layers * P]
  // (embedding.cpp), and the layer loop's x and next [T, H] (gemma4.cpp).
  const int64_t run_floats = 3 * H + 2 * layers * c.ple_dim;
  // The loss (gemma4.cpp, loss.h): xf [T, H], then one chunk of [C, V] logits, C = min(T, chunk tokens).
  const int64_t chunk_tokens =
      args.loss_chunk_tokens > 0 ? args.loss_chunk_tokens : loss_chunk_tokens(V, kLossChunkBytes);
  const int64_t chunk = std::min(std::max<int64_t>(T, 1), chunk_tokens);
  const int64_t chunk_bytes = checked_bytes({chunk, V, kFloat});
  const int64_t logit_bytes = args.logits ? checked_bytes({T, V, kFloat}) : 0;

  MemoryBreakdown out;
  if (!args.training) {
    // Forward: at layer l, its whole LayerActs with the K/V stored by the layers before it; at the loss, every
    // stored K/V, xf and the chunk. Whichever is larger is the bound.
    int64_t stored = 0, layer_phase = 0, largest_tile = 0;
    for (int l = 0; l < layers; ++l) {
      layer_phase = std::max(layer_phase, stored + layer_floats(m, l, true, tiled));
      largest_tile = std::max(largest_tile, tile_bytes(l));
      stored += shared_kv_floats(m, l);
    }
    const int64_t loss_phase = stored + H;  // + xf
    MemoryBreakdown at_layer, at_loss;
    at_layer.add("activations", bytes(run_floats + stored));
    at_layer.add("one layer", bytes(layer_phase - stored));
    if (tiled) at_layer.add(kMlpTile, largest_tile);
    if (args.layer_weight_bytes != 0) at_layer.add(kLayerWeights, args.layer_weight_bytes);
    at_loss.add("activations", bytes(run_floats + loss_phase));
    at_loss.add("loss chunk", chunk_bytes);
    if (args.head_weight_bytes != 0) at_loss.add(kHeadWeights, args.head_weight_bytes);
    out = larger(at_layer, at_loss);
    out.add("logits", logit_bytes);
    return out;
  }
  // Training. Kept until the backward reaches them: every layer's kept_floats and stored K/V. At the loss and
  // through the backward, xf and its gradient dxf [T, H] are alive too; the backward adds dx and dprev [T, H] and,
  // at its first layer (the last one, whose kept activations are all still there), that layer's recomputed
  // activations past what it is handed (recompute on; off, they are among the kept ones).
  const Handed handed{args.recompute_layers && args.keep_mlp_projections, args.keep_o_proj_output,
                      args.keep_down_proj_output};
  // With spill only the shared K/V stay; the backward's first layer's kept floats come back from the file before it
  // is recomputed (alive at the backward's peak, not at the loss).
  const bool spill = args.spill && args.recompute_layers;
  int64_t kept = 0, read_back = 0;
  for (int l = 0; l < layers; ++l)
    kept += (spill ? 0 : kept_floats(m, l, args.recompute_layers, handed, tiled)) + shared_kv_floats(m, l);
  if (spill && layers > 0) read_back = kept_floats(m, layers - 1, true, handed, tiled);
  // The products the recomputed layer is handed come from the kept ones, not allocated again.
  const int64_t recomputed = args.recompute_layers && layers > 0
                                 ? layer_floats(m, layers - 1, false, tiled) - handed_floats(m, layers - 1, handed)
                                 : 0;
  MemoryBreakdown at_loss, at_mlp_backward, at_attention_backward;
  at_loss.add("activations", bytes(run_floats + kept + 2 * H));  // + xf, dxf
  at_loss.add("loss chunk", chunk_bytes);
  if (args.head_weight_bytes != 0) at_loss.add(kHeadWeights, args.head_weight_bytes);
  // The backward's first layer: in its MLP's backward, then in its attention's (the MLP's buffers freed by then).
  // Gradients the backward holds beside the activations (gemma4.cpp, embedding.cpp, mlp.cpp, attention_block.cpp):
  // the per-layer inputs' dple [T, layers * P] and the shared K/V's kv_dK, kv_dV for the whole backward, and
  // layer_backward's dx3, dx2, dff (dmo), dx1 [T, H] for the whole layer; in the MLP's backward mlp_backward's dh
  // [tile, I] and dm [T, H], in the attention's attention_grad_widths' buffers.
  int64_t shared_kv_grads = 0;
  for (int l = 0; l < layers; ++l) shared_kv_grads += shared_kv_floats(m, l);
  const int64_t layer_grads = layers * int64_t{c.ple_dim} + shared_kv_grads + 4 * H;
  const int64_t last_mlp = layers > 0 ? int64_t{m.spec(layers - 1).intermediate} : 0;
  for (MemoryBreakdown* at : {&at_mlp_backward, &at_attention_backward}) {
    at->add("activations", bytes(run_floats + kept + read_back + 4 * H));  // + xf, dxf, dx, dprev
    at->add("one layer", bytes(recomputed));
  }
  at_mlp_backward.add("backward buffers",
                      checked_sum({bytes(layer_grads + H), checked_bytes({tile, last_mlp, kFloat})}));  // + dm, dh
  if (tiled && layers > 0) at_mlp_backward.add(kMlpTile, tile_bytes(layers - 1));
  at_attention_backward.add("backward buffers", bytes(layer_grads));
  if (layers > 0)
    at_attention_backward.add("the attention's gradients", bytes(attention_grad_widths(c, m.spec(layers - 1)).total()));
  for (MemoryBreakdown* at : {&at_mlp_backward, &at_attention_backward})
    if (args.layer_weight_bytes != 0) at->add(kLayerWeights, args.layer_weight_bytes);
  out = larger(at_loss, larger(at_mlp_backward, at_attention_backward));
  out.add("logits", logit_bytes);
  return out;
}

int64_t run_spill_bytes(const Gemma4Model& m, const RunMemoryArgs& args) {
  if (!args.training || !args.recompute_layers || !args.spill) return 0;
  const Handed handed{args.keep_mlp_projections, args.keep_o_proj_output, args.keep_down_proj_output};
  int64_t sum = 0;
  for (int l = 0; l < m.config().num_layers; ++l) {
    const int64_t block = checked_bytes({args.tokens, kept_floats(m, l, true, handed, false), kFloat});
    sum = checked_sum({sum, block < 0 ? -1 : io::SpillFile::block_bytes(block)});
  }
  return sum;
}

}  // namespace rf::model
