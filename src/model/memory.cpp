// ringflex model: the memory of one run (see memory.h). Every term below names the buffers of gemma4.cpp,
// attention_block.cpp, mlp.cpp and embedding.cpp it counts; buffers whose lifetime is unclear, MoE's, the CP
// ring's (what moves depends on the batch's documents) and the short-lived temporaries of phases smaller than the
// ones counted (the PLE block's backward, o_proj's float32 dO) are left out, which keeps the sum a lower bound.
#include "model/memory.h"

#include <algorithm>
#include <vector>

#include "io/spill_file.h"
#include "model/loss.h"

namespace rf::model {

namespace {

constexpr int64_t kFloat = sizeof(float);
constexpr const char* kLayerWeights = "one layer's weights widened";
constexpr const char* kHeadWeights = "the head's panel widened";
constexpr const char* kMlpTile = "the MLP's tile";

// Floats per token of layer l's LayerActs as layer_forward fills them (the whole struct is alive until the layer
// ends, gemma4_run.h): input norm a [H] and its RMS factor [1]; q_raw and Q [Hq*D] each and q's RMS factors [Hq];
// with its own K/V k_raw, K, V [Hkv*D] each (and v_raw with a v_proj) and k's and v's RMS factors [Hkv] each; O
// [Hq*D] and LSE [Hq]; ao, x1 [H] each and post_attn_norm's factor; the MLP's m_in and mo [H] with pre_ff_norm's
// factor, and g, u, hmid [I] each; the feed-forward's residual x2 [H] with post_ff_norm's factor; with per-layer
// inputs the PLE block's ple_l, gp, gm [P] each, pp [H] and its norm's factor. MoE's are not counted. With the tiled
// MLP (RunOptions::tile_mlp) g, u, hmid are not per token: mlp_tile_floats.
int64_t layer_floats(const Gemma4Model& m, int l, bool with_attention_output, bool tiled_mlp) {
  const LayerSpec& s = m.spec(l);
  const int64_t H = m.config().hidden_size, Hq = m.config().num_heads, P = m.config().ple_dim;
  const int64_t qd = Hq * s.head_dim, kvd = int64_t{s.kv_heads} * s.head_dim;
  int64_t n = (H + 1) + 2 * qd + Hq + (2 * H + 1);                          // a, r_in; q_raw, Q, q_rms; ao, x1, r_pa
  if (s.kv_source < 0) n += (s.has_v_proj ? 4 : 3) * kvd + 2 * s.kv_heads;  // k_raw, K, V (v_raw); k_rms, v_rms
  if (with_attention_output) n += qd + Hq;                                  // O, lse
  n += (2 * H + 1) + (tiled_mlp ? 0 : 3 * int64_t{s.intermediate});         // m_in, mo, r_pf; g, u, hmid
  n += H + 1;                                                               // x2, r_pff
  if (P > 0) n += 3 * P + H + 1;                                            // ple_l, gp, gm; pp, r_ppn
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
  // Training. Kept until the backward reaches them: every layer's kept_floats and stored K/V (gemma4.cpp). At the
  // loss xf and its gradient dxf [T, H] are alive too.
  const Handed handed{args.recompute_layers && args.keep_mlp_projections, args.keep_o_proj_output,
                      args.keep_down_proj_output};
  // With spill only the stored K/V stay in memory; each layer's kept floats come back from the file before it is
  // recomputed and go after its backward.
  const bool spill = args.spill && args.recompute_layers;
  std::vector<int64_t> kept(static_cast<size_t>(layers));  // [layers] each layer's kept floats per token
  int64_t kept_in_memory = 0, stored_kv = 0;
  for (int l = 0; l < layers; ++l) {
    kept[l] = kept_floats(m, l, args.recompute_layers, handed, tiled);
    kept_in_memory += spill ? 0 : kept[l];
    stored_kv += shared_kv_floats(m, l);
  }
  MemoryBreakdown at_loss;
  at_loss.add("activations", bytes(run_floats + kept_in_memory + stored_kv + 2 * H));  // + xf, dxf
  at_loss.add("loss chunk", chunk_bytes);
  if (args.head_weight_bytes != 0) at_loss.add(kHeadWeights, args.head_weight_bytes);
  out = at_loss;
  // The backward, one layer l at a time from the last: xf, dxf and the last layer's output are freed after the
  // final norm's backward, dx and dprev [T, H] come instead; the layers after l are freed, l's kept floats are
  // here (read back with spill) and, recompute on, its activations past what it is handed. Gradients held beside
  // them (gemma4.cpp, embedding.cpp, mlp.cpp, attention_block.cpp): the per-layer inputs' dple [T, layers * P] and
  // the stored K/V's kv_dK, kv_dV for the whole backward; in l's MLP's backward layer_backward's dmo and dx1 [T, H]
  // (its dx3 and dx2 are freed by then) with mlp_backward's dm [T, H] and dh [tile, I]; in its attention's
  // backward (a phase of its own, dmo freed) dx1 with attention_grad_widths' buffers, T tokens each. Every layer's
  // two phases are compared: a layer nearer the input can need more (E2B: a full layer with its own K/V, where
  // the last ones share theirs).
  const int64_t backward_run = run_floats - H + 2 * H;  // less the last layer's output x, + dx, dprev
  const int64_t held_grads = layers * int64_t{c.ple_dim} + stored_kv;
  int64_t kept_below = 0;  // the kept floats in memory of the layers before l
  for (int l = 0; l < layers; ++l) {
    const int64_t here = backward_run + kept_below + kept[l] + stored_kv;
    const int64_t recomputed =
        args.recompute_layers ? layer_floats(m, l, false, tiled) - handed_floats(m, l, handed) : 0;
    const int64_t I = m.spec(l).intermediate;
    MemoryBreakdown at_mlp_backward, at_attention_backward;
    for (MemoryBreakdown* at : {&at_mlp_backward, &at_attention_backward}) {
      at->add("activations", bytes(here));
      at->add("one layer", bytes(recomputed));
    }
    at_mlp_backward.add("backward buffers",
                        checked_sum({bytes(held_grads + 3 * H), checked_bytes({tile, I, kFloat})}));  // dh
    if (tiled) at_mlp_backward.add(kMlpTile, tile_bytes(l));
    at_attention_backward.add("backward buffers", bytes(held_grads + H));
    at_attention_backward.add("the attention's gradients", bytes(attention_grad_widths(c, m.spec(l)).total()));
    for (MemoryBreakdown* at : {&at_mlp_backward, &at_attention_backward})
      if (args.layer_weight_bytes != 0) at->add(kLayerWeights, args.layer_weight_bytes);
    out = larger(out, larger(at_mlp_backward, at_attention_backward));
    kept_below += spill ? 0 : kept[l];
  }
  // Then the embedding's backward (embedding.cpp): the layers' buffers freed, dh0 [T, H] and, with per-layer
  // inputs, dnormed and draw [T, layers * P] beside dple.
  MemoryBreakdown at_embedding_backward;
  at_embedding_backward.add("activations", bytes(backward_run + stored_kv));
  at_embedding_backward.add("backward buffers",
                            bytes(held_grads + H + (c.ple_dim > 0 ? 2 * layers * int64_t{c.ple_dim} : 0)));
  out = larger(out, at_embedding_backward);
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
