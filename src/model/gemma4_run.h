// ringflex model: one run of the Gemma 4 decoder (internal to src/model): the batch's sharded arrays, the kept
// activations, and the blocks of a layer, each a forward/backward pair with its own activations:
//   embedding.cpp        batch preparation (metadata on the full rows, sharding), embedding, image features,
//                        per-layer embeddings (PLE) and each layer's PLE block
//   attention_block.cpp  input norm, q/k/v projections head-major, RoPE, attention through the backend, o_proj
//   mlp.cpp              the dense GeGLU MLP
//   moe.cpp              the router and experts beside it (enable_moe_block)
//   gemma4.cpp           parameters, the layer (residuals, layer scalar) and the whole run
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <new>
#include <utility>
#include <vector>

#include "core/attention_backend.h"
#include "core/default_init.h"
#include "model/gemma4.h"
#include "model/ops.h"

namespace rf::model {

// Activation storage whose elements a size constructor leaves uninitialised (default-, not value-initialised).
// std::vector<float>(n) writes n zeros on the calling thread: per layer the forward, its recompute and the backward
// allocate ~100 activations of [T, H] to [T, I] floats, most of which the next call overwrites completely, and the
// serial zero fill (with the first-touch page faults it takes) left the other threads waiting. Buffers a call
// fully writes come from uninit(); buffers that are accumulated into come from zeros(), filled by all threads.
using Vec = std::vector<float, DefaultInitAllocator<float>>;

// n floats the caller writes completely before reading any.
inline Vec uninit(int64_t n) { return Vec(static_cast<size_t>(n)); }

// n zeros, written by all threads (each touching its own pages first).
inline Vec zeros(int64_t n) {
  Vec v(static_cast<size_t>(n));
  float* p = v.data();
#pragma omp parallel for schedule(static) if (n >= kParallelMinElements)
  for (int64_t i = 0; i < n; ++i) p[i] = 0.f;
  return v;
}

// A copy of x[n], written by all threads.
inline Vec copy_of(const float* x, int64_t n) {
  Vec v(static_cast<size_t>(n));
  float* p = v.data();
#pragma omp parallel for schedule(static) if (n >= kParallelMinElements)
  for (int64_t i = 0; i < n; ++i) p[i] = x[i];
  return v;
}
inline Vec copy_of(const Vec& x) { return copy_of(x.data(), static_cast<int64_t>(x.size())); }

inline void add_into(float* y, const float* x, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMinElements)
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

inline int64_t bytes_of(std::initializer_list<const Vec*> vs) {
  int64_t n = 0;
  for (const Vec* v : vs) n += static_cast<int64_t>(v->size());
  return n * static_cast<int64_t>(sizeof(float));
}

// bf16 storage, left uninitialised by a size constructor as Vec is.
using Bf16Vec = std::vector<bf16, DefaultInitAllocator<bf16>>;

// q, k, v or dout [B, heads, S, D] as the attention seam reads them: float32 (`f32`) or bf16 (`b16`), whichever the
// run's attention storage is (Run::attn_tensor); the other stays empty.
struct AttnTensor {
  DType dtype = DType::F32;
  Vec f32;
  Bf16Vec b16;

  const void* data() const { return dtype == DType::F32 ? static_cast<const void*>(f32.data()) : b16.data(); }
  int64_t size() const { return static_cast<int64_t>(dtype == DType::F32 ? f32.size() : b16.size()); }
  int64_t bytes() const { return size() * static_cast<int64_t>(dtype_size(dtype)); }
  // A copy, written by all threads.
  AttnTensor copy() const {
    AttnTensor c;
    c.dtype = dtype;
    if (dtype == DType::F32) {
      c.f32 = copy_of(f32);
      return c;
    }
    c.b16 = Bf16Vec(b16.size());
    const int64_t n = size();
#pragma omp parallel for schedule(static) if (n >= kParallelMinElements)
    for (int64_t i = 0; i < n; ++i) c.b16[static_cast<size_t>(i)] = b16[static_cast<size_t>(i)];
    return c;
  }
};

// Gemma 4 attention does not scale q.k (q and k are RMS-normalised per head instead).
constexpr float kAttentionScale = 1.0f;
// transformers' (projection + token part) * 2^-1/2 when combining the two halves of a per-layer input.
inline const float kPleCombineScale = static_cast<float>(std::sqrt(0.5));

// Activations of each block of one layer, alive while that layer is computed (forward) or recomputed and
// differentiated. T = B * S tokens of this rank.
struct AttnActs {
  Vec a, r_in;                     // input norm: [T, H], [T]
  Vec q_raw, q_rms;                // head-major: [B, Hq, S, D], [B*Hq*S]
  AttnTensor Q;                    // [B, Hq, S, D] normed, rotated, in the attention's storage
  Vec k_raw, k_rms, v_raw, v_rms;  // head-major: [B, Hkv, S, D], [B*Hkv*S] (v_raw only with a v_proj)
  AttnTensor K, V;                 // [B, Hkv, S, D] own K/V (empty on KV-shared layers)
  Vec O, lse;                      // [B, Hq, S, D], [B, Hq, S]
  Vec ao, r_pa, x1;                // [T, H], [T], [T, H]
  int64_t bytes() const {
    return bytes_of({&a, &r_in, &q_raw, &q_rms, &k_raw, &k_rms, &v_raw, &v_rms, &O, &lse, &ao, &r_pa, &x1}) +
           Q.bytes() + K.bytes() + V.bytes();
  }
};

struct MlpActs {
  Vec m_in, r_pf, g, u, hmid, mo;  // [T, H], [T], [T, I] x3, [T, H]
  int64_t bytes() const { return bytes_of({&m_in, &r_pf, &g, &u, &hmid, &mo}); }
};

class ExpertExchange;  // moe.cpp: one block's rows to and from the ranks running their experts
struct ExpertsHere;    // moe.cpp: the experts one block runs on this rank

struct MoeActs {
  Vec h1, r_pf1;                             // post_ff_norm_1 of the MLP's output: [T, H], [T]
  Vec rn, r_rn, rs, probs;                   // router: [T, H], [T], [T, H], [T, E]
  Vec top_wn, top_sum, top_w;                // [T, K], [T], [T, K]
  Vec e_in, r_pre2, out2, r_pf2;             // experts' input [T, H], [T]; their weighted sum [T, H], [T]
  Vec ff;                                    // [T, H] h1 + post_ff_norm_2(out2)
  std::vector<int32_t> top_idx;              // [T, K]
  std::vector<int32_t> expert_order;         // [T, K] each token's choices j by ascending expert index
  std::vector<int64_t> row_of;               // [T, K] row of each (token, choice) in its expert's batch
  std::vector<std::vector<int64_t>> routed;  // per expert: t * K + j of its (token, choice) pairs, t ascending
  // The experts' dispatch (core/expert_parallel.h): this rank's routed rows lie by expert (sent layout, row r of
  // expert e at sent_at[e] + r); the rows this rank's experts run lie by (source rank, own expert) block
  // (received layout, block b from recv_at[b]). With every expert local the two layouts are the same.
  ExpertRouting routing;
  std::vector<int64_t> sent_at;  // [E + 1] first sent row of each expert
  std::vector<int64_t> recv_at;  // [P * E/P + 1] first received row of each block
  Vec eo_sent;                   // [sent rows, H] this rank's rows' expert outputs, back from the experts
  Vec e_x, e_gu, e_hm, e_eo;     // received rows: [R, H], [R, 2*Im], [R, Im], [R, H]
  int64_t bytes() const {
    return bytes_of({&h1, &r_pf1, &rn, &r_rn, &rs, &probs, &top_wn, &top_sum, &top_w, &e_in, &r_pre2, &out2, &r_pf2,
                     &ff, &eo_sent, &e_x, &e_gu, &e_hm, &e_eo});
  }
};

struct PleActs {
  Vec ple_l, gp, gm, pp, r_ppn;  // [T, P] x3, [T, H], [T]
  int64_t bytes() const { return bytes_of({&ple_l, &gp, &gm, &pp, &r_ppn}); }
};

struct LayerActs {
  AttnActs attn;
  MlpActs mlp;
  MoeActs moe;
  Vec r_pff, x2;  // post_ff_norm of the feed-forward output: [T], residual [T, H]
  PleActs ple;
  int64_t bytes() const { return attn.bytes() + mlp.bytes() + moe.bytes() + bytes_of({&r_pff, &x2}) + ple.bytes(); }
};

// What the forward keeps of one layer for its backward (training): the layer's input, and either every activation
// (RunOptions::recompute_layers off) or what the recompute does not redo: attention's output O and its LSE,
// the o_proj and down_proj outputs [T, H] (keep_o_proj_output, keep_down_proj_output) and the MLP's gate and up
// projections [T, I] (keep_mlp_projections), the rest of `acts` left empty.
struct KeptLayer {
  Vec x_in;  // [T, H]
  LayerActs acts;
  int64_t bytes() const { return bytes_of({&x_in}) + acts.bytes(); }
};

// A range of a run's T tokens, token-major: rows first .. first + count(T) - 1 (rows < 0: all T of them).
struct TokenRows {
  int64_t first = 0;
  int64_t rows = -1;
  int64_t count(int64_t T) const { return rows < 0 ? T : rows; }
  bool all(int64_t T) const { return first == 0 && count(T) == T; }
};

struct Gemma4Model::Run {
  const Gemma4Model& m;
  const Gemma4Config& cfg;
  const Batch& b;
  const RunOptions& opt;
  ParamStore& store;  // the weights read and the gradients written (the model's, or a sharded one's gathered layer)
  AttentionBackend& attn;
  int B;             // rows
  int S_row;         // tokens of a full row
  int S = 0;         // tokens of a row this rank holds (the shard's L; S_row at P = 1)
  int64_t T = 0, H;  // T = B * S: this rank's tokens, token-major
  float eps;
  Matmul mm;  // how the linear layers multiply (RunOptions::compute_dtype; the weights' bf16 copies)
  // How attention's inputs are stored (gemma4.cpp: attention_storage): float32 in the float32 mode; in the bf16 mode
  // bf16 where the kernels have bf16 units that pay, else float32 holding bf16-rounded values.
  DType attn_dtype = DType::F32;
  bool attn_round = false;
  RowShard shard;
  // Sequence-resident arrays, gathered to this rank's tokens ([T], shard order): the full rows' values at the
  // shard's positions, docs/spec.md §5 pad values at sharding padding.
  std::vector<TokenMeta> meta;     // [B, S] global idx/doc/group (numbered on the full row)
  std::vector<int32_t> ids;        // [T] input ids (pad id on sharding padding)
  std::vector<int32_t> labels;     // [T] (kIgnoreLabel on sharding padding); empty without labels
  std::vector<uint8_t> is_pad;     // [T] 1 on sharding padding: no embedding gradient
  std::vector<int32_t> positions;  // [T] RoPE positions
  RopeTable rope_sliding, rope_full;
  std::vector<int64_t> feature_of;     // [T] index into image_features (global), -1 for a text token
  std::vector<int64_t> local_feature;  // [T] row of this rank's projected features, -1 for a text token
  std::vector<int64_t> used_features;  // [n] global feature rows this rank's tokens hold, in local order
  std::vector<int32_t> ple_ids;        // [T] token ids for the per-layer embedding (pad on vision slots)
  Vec feat_raw, feat_in, feat_rms;     // this rank's features: [n, F] as given, normed input, [n]
  Vec h0;                              // [T, H] embedded row
  ParamStore::TableRows embed_rows;    // the token embedding's rows of ids (and their gradients), from the store
  ParamStore::TableRows ple_rows;      // the per-layer embedding's rows of ple_ids
  Vec ple, ple_raw, ple_rms;           // [T, L*P] per-layer inputs; the projection half before its norm, [T*L]
  Vec dple;                            // [T, L*P]
  Vec d_image_features;                // [N, F]
  std::vector<AttnTensor> kv_K, kv_V;  // [L] K/V of layers others read, in the attention's storage
  std::vector<Vec> kv_dK, kv_dV;       // [L] their gradients, float32
  // RunOptions::want_router: each MoE layer's router scores [T, E] and choices [T, K], from its forward (a
  // recompute routes the same way and leaves them as they are).
  std::vector<std::vector<float>> router_logits;
  std::vector<std::vector<int32_t>> router_experts;

  Run(const Gemma4Model& model, const Batch& batch, const RunOptions& options, ParamStore& s, AttentionBackend& a)
      : m(model),
        cfg(model.cfg_),
        b(batch),
        opt(options),
        store(s),
        attn(a),
        B(batch.B),
        S_row(batch.S),
        H(model.cfg_.hidden_size),
        eps(static_cast<float>(model.cfg_.rms_norm_eps)) {}

  // A parameter's weights, from the store (between the layer's before_* and after_* hooks). Every op of a block fetches
  // its weights here just before it runs, so this is also where the store's posted transfers advance
  // (ParamStore::progress: the next layer's gather and the last layer's reduction travel while this layer computes),
  // without the blocks knowing about communication.
  const float* W(size_t s) const {
    store.progress();
    return s == kNoSlot ? nullptr : store.weight(s);
  }
  // A parameter's gradient, or nullptr where none is wanted: a run without the backward, or a frozen parameter (the
  // store has no gradient for it), so that backward skips the weight-gradient product and keeps only the input's.
  float* G(size_t s) const { return !opt.want_grad || s == kNoSlot ? nullptr : store.grad(s); }
  const RopeTable& rope(const LayerSpec& s) const { return s.sliding ? rope_sliding : rope_full; }

  // n elements of attention input in the run's storage, uninitialised, and where an op writes them.
  AttnTensor attn_tensor(int64_t n) const {
    AttnTensor t;
    t.dtype = attn_dtype;
    if (attn_dtype == DType::F32)
      t.f32 = uninit(n);
    else
      t.b16 = Bf16Vec(static_cast<size_t>(n));
    return t;
  }
  AttnOut out(AttnTensor& t) const {
    return t.dtype == DType::F32 ? AttnOut{t.f32.data(), nullptr, attn_round} : AttnOut{nullptr, t.b16.data(), false};
  }

  ShardAttention attention(const LayerSpec& s, const AttnTensor& Q, const AttnTensor& K, const AttnTensor& V) const {
    ShardAttention x;
    x.shape = AttnShape{B, cfg.num_heads, s.kv_heads, S, S, s.head_dim};
    x.dtype = attn_dtype;
    x.q = Q.data();
    x.k = K.data();
    x.v = V.data();
    x.meta = meta.data();
    x.mask = s.mask;
    x.scale = kAttentionScale;
    return x;
  }

  // Where a projection's input or output lies: token-major [T, n] (heads = 0), or head-major [B, heads, S, D].
  struct Layout {
    int heads = 0;
    int64_t D = 0;
  };
  // adapter_block.cpp: a LoRA adapter on the linear weight of `slot` (ParamStore::adapter; nothing without one).
  // Forward: y += scale * (x A^T) B^T, after the base's product into y. Backward: dx += scale * (dy B) A (dx may be
  // null) and the adapter's gradients, beside the base's backward, which gets no weight gradient (frozen).
  // `rows`: x, y, dy, dx hold only those tokens, token-major (the MLP's token tiles); the adapter's gradients are
  // accumulated over them.
  void adapter_forward(size_t slot, const float* x, Layout in, float* y, Layout out, TokenRows rows = {});
  void adapter_backward(size_t slot, const float* x, Layout in, const float* dy, Layout out, float* dx,
                        TokenRows rows = {});
  bool has_adapter(size_t slot) const { return slot != kNoSlot && store.adapter(slot).has_value(); }
  // PEFT's dropout of the adapter's input (training runs with LinearAdapter::dropout > 0): x [T, K] token-major, in
  // place, kept elements scaled by 1 / (1 - dropout); x holds the tokens `rows`.
  bool adapter_dropout(const LinearAdapter& ad) const;
  void apply_adapter_dropout(const LinearAdapter& ad, float* x, int64_t K, TokenRows rows = {}) const;

  // Batch preparation and the embedding (embedding.cpp).
  void prepare();
  void embed();
  void embed_backward(const float* dh0);
  // Blocks of one decoder layer, each a forward/backward pair over its own activations. Backwards accumulate into
  // the gradients of their inputs unless said otherwise.
  // attention_block.cpp: x -> a.x1 = x + post_attn_norm(o_proj(attention(norms and RoPE of q/k/v(input_norm(x))))).
  // reuse_attention: a recompute, handed the forward's O and LSE; an a.ao already set is taken as it is.
  void attention_forward(int l, const float* x, AttnActs& a, bool reuse_attention);
  // Only the layer's own K and V (a.a, a.K, a.V and what they are made from), handed to the seam's keep_keys: no
  // query, attention, o_proj or anything after (RunOptions::run_layers' last layer). Nothing for a KV-shared layer.
  void attention_keys_forward(int l, const float* x, AttnActs& a);
  // The input norm: x -> a.a, a.r_in.
  void attention_input(int l, const float* x, AttnActs& a);
  // A layer's own K/V from a.a through `ms` (the projections' shared operands): a.k_raw, a.v_raw, their norms, and
  // a.K, a.V normed and rotated in the attention's storage.
  void own_kv_forward(int l, const Matmul& ms, AttnActs& a);
  // dx1: d loss / d x1 (the residual included); writes dx.
  void attention_backward(int l, AttnActs& a, const float* x, const float* dx1, float* dx);
  // mlp.cpp: x1 -> a.mo = down(gelu(gate(n)) * up(n)), n = pre_ff_norm(x1); an a.mo already set (a recompute), and
  // a.g and a.u (a recompute with RunOptions::keep_mlp_projections), are taken as they are. With
  // RunOptions::tile_mlp the [T, I] products exist one tile of mlp_tile_tokens tokens at a time (a.g, a.u, a.hmid
  // stay empty).
  void mlp_forward(int l, const float* x1, MlpActs& a);
  // dmo: d loss / d mo; accumulates dx1; overwrites a.g and a.u with their gradients. Works through the tokens in
  // tiles of RunOptions::mlp_tile_tokens either way (the weight gradients summed tile by tile), recomputing each
  // tile's gate, up and GeGLU with tile_mlp.
  void mlp_backward(int l, MlpActs& a, const float* x1, const float* dmo, float* dx1);
  // One tile's gate and up projections g, u [rows, I] of the normed input m_in [T, H] (+ their adapters).
  void mlp_gate_up(int l, const float* m_in, float* g, float* u, TokenRows rows);
  // moe.cpp: (x1, mo) -> a.ff = post_ff_norm_1(mo) + post_ff_norm_2(experts(pre_ff_norm_2(x1)) routed on x1).
  void moe_forward(int l, const float* x1, const float* mo, MoeActs& a);
  // dff: d loss / d ff; writes dmo, accumulates dx1.
  void moe_backward(int l, MoeActs& a, const float* x1, const float* mo, const float* dff, float* dmo, float* dx1);
  // The MoE block's phases (moe.cpp). Forward: the router's choice of each token's experts and where their rows go
  // (a.routing); the experts on the rows the dispatch brings this rank, their outputs sent back (a.eo_sent); each
  // token's weighted sum of its experts' outputs (a.ff). Backward: d loss / d each row's weight (dw [T, K]) and
  // output (returned: [sent rows, H]); the experts' input gradients (returned: [sent rows, H], on their way back
  // through `exchange` until its finish_combine) and weight gradients; the router's (returned: d loss / d its scaled
  // input [T, H]); both norms of x1 into dx1.
  void moe_route(int l, const float* x1, MoeActs& a);
  void moe_experts_forward(int l, MoeActs& a);
  void moe_sum_forward(int l, MoeActs& a);
  Vec moe_output_grads(MoeActs& a, const float* dout2, float* dw);
  Vec moe_experts_backward(int l, MoeActs& a, Vec dy_sent, ExpertExchange& exchange);
  void moe_expert_weight_grads(int l, MoeActs& a, const ExpertsHere& ex, ExpertExchange& exchange);
  Vec moe_router_backward(int l, const MoeActs& a, const float* dw);
  void moe_input_backward(int l, const MoeActs& a, const float* x1, const float* dx_sent, const float* drs, float* dx1);
  // embedding.cpp: x2 -> x3 = x2 + post_per_layer_input_norm(proj(gelu(gate(x2)) * per-layer input l)).
  void ple_forward(int l, const float* x2, PleActs& a, float* x3);
  // dx3: d loss / d x3; accumulates dx2 (which must already hold dx3's residual part) and dple.
  void ple_backward(int l, PleActs& a, const float* x2, const float* dx3, float* dx2);
  // gemma4.cpp: the whole layer, composing the blocks with the feed-forward's residual and the layer scalar.
  void layer_forward(int l, const float* x, float* out, LayerActs& a, bool reuse_attention);
  void layer_backward(int l, LayerActs& a, const float* x, const float* dout, float* dx);
};

}  // namespace rf::model
