// ringflex model: the Gemma 4 text decoder's forward and backward (see gemma4.h for the memory plan).
#include "model/gemma4.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>

#include "core/attention_args.h"
#include "core/error.h"
#include "core/row_meta.h"
#include "cpu/attention.h"
#include "model/loss.h"
#include "model/ops.h"

namespace rf::model {

namespace {

using Vec = std::vector<float>;

Vec zeros(int64_t n) { return Vec(static_cast<size_t>(n), 0.f); }

void add_into(float* y, const float* x, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMinElements)
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

// Gemma 4 attention does not scale q.k (q and k are RMS-normalised per head instead).
constexpr float kAttentionScale = 1.0f;
// transformers' (projection + token part) * 2^-1/2 when combining the two halves of a per-layer input.
const float kPleCombineScale = static_cast<float>(std::sqrt(0.5));

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// Parameter registration (Hugging Face names and shapes).
// ---------------------------------------------------------------------------------------------------------------

Gemma4Model::Gemma4Model(Gemma4Config config, int vision_feature_dim, TensorSet::Storage storage)
    : cfg_(std::move(config)), vision_dim_(vision_feature_dim), params_(storage) {
  cfg_.validate();
  RF_CHECK(vision_dim_ >= 0, "vision feature dim must be non-negative");
  const int64_t H = cfg_.hidden_size, V = cfg_.vocab_size, L = cfg_.num_layers, P = cfg_.ple_dim;
  std::vector<size_t> ones;  // slots initialised to 1 (norm scales, router scales)
  embed_ = params_.add("model.embed_tokens.weight", {V, H});
  if (P > 0) {
    ple_embed_ = params_.add("model.embed_tokens_per_layer.weight", {cfg_.ple_vocab_size, L * P});
    ple_proj_ = params_.add("model.per_layer_model_projection.weight", {L * P, H});
    ple_norm_ = params_.add("model.per_layer_projection_norm.weight", {P});
    ones.push_back(ple_norm_);
  }
  for (int i = 0; i < L; ++i) {
    const LayerSpec s = cfg_.layer(i);
    specs_.push_back(s);
    const std::string p = "model.layers." + std::to_string(i) + ".";
    const int64_t D = s.head_dim, qd = int64_t{cfg_.num_heads} * D, kd = int64_t{s.kv_heads} * D, I = s.intermediate;
    LayerSlots l;
    l.q_proj = params_.add(p + "self_attn.q_proj.weight", {qd, H});
    l.q_norm = params_.add(p + "self_attn.q_norm.weight", {D});
    ones.push_back(l.q_norm);
    if (s.kv_source < 0) {
      l.k_proj = params_.add(p + "self_attn.k_proj.weight", {kd, H});
      if (s.has_v_proj) l.v_proj = params_.add(p + "self_attn.v_proj.weight", {kd, H});
      l.k_norm = params_.add(p + "self_attn.k_norm.weight", {D});
      ones.push_back(l.k_norm);
    }
    l.o_proj = params_.add(p + "self_attn.o_proj.weight", {H, qd});
    l.gate_proj = params_.add(p + "mlp.gate_proj.weight", {I, H});
    l.up_proj = params_.add(p + "mlp.up_proj.weight", {I, H});
    l.down_proj = params_.add(p + "mlp.down_proj.weight", {H, I});
    l.input_norm = params_.add(p + "input_layernorm.weight", {H});
    l.post_attn_norm = params_.add(p + "post_attention_layernorm.weight", {H});
    l.pre_ff_norm = params_.add(p + "pre_feedforward_layernorm.weight", {H});
    l.post_ff_norm = params_.add(p + "post_feedforward_layernorm.weight", {H});
    ones.insert(ones.end(), {l.input_norm, l.post_attn_norm, l.pre_ff_norm, l.post_ff_norm});
    if (cfg_.enable_moe) {
      const int64_t E = cfg_.num_experts, Im = cfg_.moe_intermediate_size;
      l.router_proj = params_.add(p + "router.proj.weight", {E, H});
      l.router_scale = params_.add(p + "router.scale", {H});
      l.per_expert_scale = params_.add(p + "router.per_expert_scale", {E});
      l.experts_gate_up = params_.add(p + "experts.gate_up_proj", {E, 2 * Im, H});
      l.experts_down = params_.add(p + "experts.down_proj", {E, H, Im});
      l.post_ff_norm_1 = params_.add(p + "post_feedforward_layernorm_1.weight", {H});
      l.post_ff_norm_2 = params_.add(p + "post_feedforward_layernorm_2.weight", {H});
      l.pre_ff_norm_2 = params_.add(p + "pre_feedforward_layernorm_2.weight", {H});
      ones.insert(ones.end(), {l.router_scale, l.per_expert_scale, l.post_ff_norm_1, l.post_ff_norm_2, l.pre_ff_norm_2});
    }
    if (P > 0) {
      l.ple_gate = params_.add(p + "per_layer_input_gate.weight", {P, H});
      l.ple_proj = params_.add(p + "per_layer_projection.weight", {H, P});
      l.ple_post_norm = params_.add(p + "post_per_layer_input_norm.weight", {H});
      ones.push_back(l.ple_post_norm);
    }
    l.layer_scalar = buffers_.add(p + "layer_scalar", {1});
    buffers_[l.layer_scalar].data[0] = 1.f;
    slots_.push_back(l);
  }
  final_norm_ = params_.add("model.norm.weight", {H});
  ones.push_back(final_norm_);
  lm_head_ = cfg_.tie_word_embeddings ? embed_ : params_.add("lm_head.weight", {V, H});
  if (vision_dim_ > 0) vision_proj_ = params_.add("model.embed_vision.embedding_projection.weight", {H, vision_dim_});
  for (size_t s : ones) std::fill(params_[s].data.begin(), params_[s].data.end(), 1.f);
}

void Gemma4Model::init_random(uint64_t seed, float stddev) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, stddev);
  for (Tensor& t : params_) {
    // 1-D tensors are scales (norms, router): keep them near 1 so activations stay O(1).
    const bool scale = t.shape.size() == 1;
    for (float& v : t.data) v = (scale ? 1.f : 0.f) + normal(rng);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// One run: the batch's metadata, the kept activations, and the per-layer forward/backward.
// ---------------------------------------------------------------------------------------------------------------

// Activations of one layer, alive while that layer is computed (forward) or recomputed and differentiated.
struct LayerActs {
  Vec a, r_in;                    // input norm: [T, H], [T]
  Vec q_raw, q_rms, Q;            // [T, Hq*D], [T*Hq], [B, Hq, S, D] (normed, rotated)
  Vec k_raw, k_rms, v_raw, v_rms; // [T, Hkv*D], [T*Hkv] (v_raw only with a v_proj)
  Vec K, V;                       // [B, Hkv, S, D] own K/V (empty on KV-shared layers)
  Vec O, lse;                     // [B, Hq, S, D], [B, Hq, S]
  Vec o_tok, ao, r_pa, x1;        // [T, Hq*D], [T, H], [T], [T, H]
  Vec m_in, r_pf, g, u, hmid, mo; // MLP: [T, H], [T], [T, I] x3, [T, H]
  // MoE block
  Vec h1, r_pf1, rn, r_rn, rs, probs, top_wn, top_sum, top_w, e_in, r_pre2, out2, r_pf2;
  std::vector<int32_t> top_idx;               // [T, K]
  std::vector<std::vector<int64_t>> routed;   // per expert: t * K + j of its (token, choice) pairs, t ascending
  std::vector<Vec> e_x, e_gu, e_hm, e_eo;     // per expert: [n, H], [n, 2*Im], [n, Im], [n, H]
  Vec ff, r_pff, x2;              // [T, H], [T], [T, H]
  // per-layer input
  Vec ple_l, gp, gm, pp, r_ppn;   // [T, P] x3, [T, H], [T]

  int64_t bytes() const {
    int64_t n = 0;
    for (const Vec* v : {&a, &r_in, &q_raw, &q_rms, &Q, &k_raw, &k_rms, &v_raw, &v_rms, &K, &V, &O, &lse, &o_tok, &ao,
                         &r_pa, &x1, &m_in, &r_pf, &g, &u, &hmid, &mo, &h1, &r_pf1, &rn, &r_rn, &rs, &probs, &top_wn,
                         &top_sum, &top_w, &e_in, &r_pre2, &out2, &r_pf2, &ff, &r_pff, &x2, &ple_l, &gp, &gm, &pp,
                         &r_ppn})
      n += static_cast<int64_t>(v->size());
    for (const auto* group : {&e_x, &e_gu, &e_hm, &e_eo})
      for (const Vec& v : *group) n += static_cast<int64_t>(v.size());
    return n * static_cast<int64_t>(sizeof(float));
  }
};

struct Gemma4Model::Run {
  const Gemma4Model& m;
  const Gemma4Config& cfg;
  const Batch& b;
  const RunOptions& opt;
  TensorSet* grads;
  int B, S;
  int64_t T, H;
  float eps;
  std::vector<TokenMeta> meta;        // [B, S]
  std::vector<int32_t> positions;     // [T]
  RopeTable rope_sliding, rope_full;
  std::vector<int64_t> feature_of;    // [T] index into image_features, -1 for a text token
  std::vector<int32_t> ple_ids;       // [T] token ids for the per-layer embedding (pad on vision slots)
  Vec feat_in, feat_rms;              // projected features: [N, F] normed input, [N]
  Vec h0;                             // [T, H] embedded row
  Vec ple, ple_raw, ple_rms;          // [T, L*P] per-layer inputs; the projection half before its norm, [T*L]
  Vec dple;                           // [T, L*P]
  Vec d_image_features;               // [N, F]
  std::vector<Vec> x_in;              // [L][T, H] layer inputs (training)
  std::vector<Vec> saved_O, saved_lse;
  std::vector<Vec> kv_K, kv_V, kv_dK, kv_dV;  // [L] K/V (and their gradients) of layers others read

  Run(const Gemma4Model& model, const Batch& batch, const RunOptions& options, TensorSet* g)
      : m(model), cfg(model.cfg_), b(batch), opt(options), grads(g), B(batch.B), S(batch.S),
        T(int64_t{batch.B} * batch.S), H(model.cfg_.hidden_size), eps(static_cast<float>(model.cfg_.rms_norm_eps)) {}

  const float* W(size_t s) const { return s == kNoSlot ? nullptr : m.params_.data(s); }
  float* G(size_t s) const { return grads == nullptr || s == kNoSlot ? nullptr : grads->data(s); }
  const RopeTable& rope(const LayerSpec& s) const { return s.sliding ? rope_sliding : rope_full; }

  AttnChunk chunk(const LayerSpec& s, const float* Q, const float* K, const float* V) const {
    AttnChunk c;
    c.shape = AttnShape{B, cfg.num_heads, s.kv_heads, S, S, s.head_dim};
    c.dtype = DType::F32;
    c.q = Q;
    c.k = K;
    c.v = V;
    c.q_meta = meta.data();
    c.k_meta = meta.data();
    c.mask = s.mask;
    c.scale = kAttentionScale;
    return c;
  }

  void prepare();
  void embed();
  void embed_backward(const float* dh0);
  void layer_forward(int l, const float* x, float* out, LayerActs& a, bool reuse_attention);
  void layer_backward(int l, LayerActs& a, const float* x, const float* dout, float* dx);
  void moe_forward(int l, LayerActs& a);
  void moe_backward(int l, LayerActs& a, const float* dout2, float* dx1);
};

void Gemma4Model::Run::prepare() {
  RF_CHECK(B > 0 && S > 0, "batch: B = ", B, " and S = ", S, " must be positive");
  RF_CHECK(b.input_ids != nullptr, "batch: input_ids is required");
  meta.resize(static_cast<size_t>(T));
  for (int r = 0; r < B; ++r) {
    const int64_t o = int64_t{r} * S;
    std::vector<int32_t> group;
    if (b.mm_token_type) {
      for (int s = 0; s < S; ++s) {
        const int32_t t = b.mm_token_type[o + s];
        RF_CHECK(t >= 0 && t <= 2, "mm_token_type_ids: value ", t, " at [", r, ", ", s, "] is not 0, 1 or 2");
      }
      group = group_ids_from_token_types(b.mm_token_type + o, S);
    }
    const std::vector<TokenMeta> row = make_row_meta(S, b.doc ? b.doc + o : nullptr, group.empty() ? nullptr : group.data());
    std::copy(row.begin(), row.end(), meta.begin() + o);
  }
  positions.resize(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) positions[t] = b.position_ids ? b.position_ids[t] : static_cast<int32_t>(t % S);
  for (int i = 0; i < cfg.num_layers; ++i) {
    const LayerSpec& s = m.specs_[i];
    RopeTable& r = s.sliding ? rope_sliding : rope_full;
    if (r.D == 0)
      r = make_rope_table(positions.data(), T, s.head_dim, s.rope->proportional, s.rope->theta,
                          s.rope->partial_rotary_factor, s.rope->factor);
  }
  // Vision slots take the image features in row-major order.
  feature_of.assign(static_cast<size_t>(T), -1);
  ple_ids.assign(b.input_ids, b.input_ids + T);
  if (b.image_features) {
    RF_CHECK(b.mm_token_type != nullptr, "image_features given without mm_token_type_ids to place them");
    int64_t n = 0;
    for (int64_t t = 0; t < T; ++t) {
      if (b.mm_token_type[t] == 0) continue;
      feature_of[t] = n++;
      // As Gemma4Model: multimodal slots read the pad id's per-layer embedding, so they need a pad id.
      RF_CHECK(cfg.pad_token_id || cfg.ple_dim == 0, "config.json: pad_token_id is null, but image/video slots read "
               "the pad token's per-layer embedding (as transformers 5.24 does); set pad_token_id");
      ple_ids[t] = cfg.pad_token_id.value_or(0);
    }
    RF_CHECK(n == b.n_image_features, "image_features has ", b.n_image_features, " rows for ", n,
             " image/video token slots in mm_token_type_ids");
  }
  for (int64_t t = 0; t < T; ++t) {
    RF_CHECK(b.input_ids[t] >= 0 && b.input_ids[t] < cfg.vocab_size, "input_ids: token ", b.input_ids[t], " at ", t,
             " is outside [0, vocab_size = ", cfg.vocab_size, ")");
    if (cfg.ple_dim > 0)
      RF_CHECK(ple_ids[t] < cfg.ple_vocab_size, "input_ids: token ", ple_ids[t], " at ", t,
               " is outside the per-layer embedding's vocabulary (", cfg.ple_vocab_size, ")");
  }
}

void Gemma4Model::Run::embed() {
  // transformers casts sqrt(H) to the weight dtype before multiplying.
  const float scale = static_cast<float>(std::sqrt(static_cast<double>(H)));
  h0 = zeros(T * H);
  const float* E = W(m.embed_);
#pragma omp parallel for schedule(static) if (T * H >= kParallelMinElements)
  for (int64_t t = 0; t < T; ++t) {
    const float* e = E + int64_t{b.input_ids[t]} * H;
    for (int64_t i = 0; i < H; ++i) h0[t * H + i] = e[i] * scale;
  }
  if (b.image_features) {
    const int64_t N = b.n_image_features;
    Vec projected;
    const float* feats = b.image_features;
    if (m.vision_dim_ > 0) {
      const int64_t F = m.vision_dim_;
      feat_in = zeros(N * F);
      feat_rms = zeros(N);
      rmsnorm_forward(b.image_features, nullptr, static_cast<float>(cfg.vision_rms_norm_eps), feat_in.data(),
                      feat_rms.data(), N, F);
      projected = zeros(N * H);
      linear_forward(feat_in.data(), W(m.vision_proj_), projected.data(), N, F, H);
      feats = projected.data();
    }
    for (int64_t t = 0; t < T; ++t)
      if (feature_of[t] >= 0) std::copy_n(feats + feature_of[t] * H, H, h0.data() + t * H);
  }
  if (cfg.ple_dim == 0) return;
  // Per-layer inputs: (RMSNorm(h0 Wp^T * H^-1/2) + E_ple[id] * sqrt(P)) * 2^-1/2, [T, L, P].
  const int64_t P = cfg.ple_dim, LP = int64_t{cfg.num_layers} * P;
  ple_raw = zeros(T * LP);
  linear_forward(h0.data(), W(m.ple_proj_), ple_raw.data(), T, H, LP);
  const float proj_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(H)));
  for (float& v : ple_raw) v *= proj_scale;
  ple = zeros(T * LP);
  ple_rms = zeros(T * cfg.num_layers);
  rmsnorm_forward(ple_raw.data(), W(m.ple_norm_), eps, ple.data(), ple_rms.data(), T * cfg.num_layers, P);
  const float tok_scale = static_cast<float>(std::sqrt(static_cast<double>(P)));
  const float* Ep = W(m.ple_embed_);
#pragma omp parallel for schedule(static) if (T * LP >= kParallelMinElements)
  for (int64_t t = 0; t < T; ++t) {
    const float* e = Ep + int64_t{ple_ids[t]} * LP;
    for (int64_t i = 0; i < LP; ++i) ple[t * LP + i] = (ple[t * LP + i] + e[i] * tok_scale) * kPleCombineScale;
  }
}

void Gemma4Model::Run::embed_backward(const float* dh0_in) {
  Vec dh0(dh0_in, dh0_in + T * H);
  if (cfg.ple_dim > 0) {
    const int64_t P = cfg.ple_dim, LP = int64_t{cfg.num_layers} * P;
    Vec dnormed(dple);
    for (float& v : dnormed) v *= kPleCombineScale;
    Vec draw = zeros(T * LP);
    rmsnorm_backward(ple_raw.data(), W(m.ple_norm_), ple_rms.data(), dnormed.data(), draw.data(), G(m.ple_norm_),
                     T * cfg.num_layers, P);
    const float proj_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(H)));
    for (float& v : draw) v *= proj_scale;
    linear_backward(h0.data(), W(m.ple_proj_), draw.data(), dh0.data(), G(m.ple_proj_), T, H, LP);
    // Token half: nn.Embedding(padding_idx = pad) gives the pad row no gradient.
    const float tok_scale = static_cast<float>(std::sqrt(static_cast<double>(P)));
    float* gE = G(m.ple_embed_);
    for (int64_t t = 0; t < T; ++t) {
      if (ple_ids[t] == cfg.pad_token_id) continue;
      float* g = gE + int64_t{ple_ids[t]} * LP;
      for (int64_t i = 0; i < LP; ++i) g[i] += dnormed[t * LP + i] * tok_scale;  // dnormed = dple * 2^-1/2
    }
  }
  if (b.image_features) {
    const int64_t N = b.n_image_features;
    Vec dfeat = zeros(N * H);
    for (int64_t t = 0; t < T; ++t)
      if (feature_of[t] >= 0) std::copy_n(dh0.data() + t * H, H, dfeat.data() + feature_of[t] * H);
    if (m.vision_dim_ > 0) {
      const int64_t F = m.vision_dim_;
      Vec dnorm = zeros(N * F);
      linear_backward(feat_in.data(), W(m.vision_proj_), dfeat.data(), dnorm.data(), G(m.vision_proj_), N, F, H);
      dfeat = zeros(N * F);
      rmsnorm_backward(b.image_features, nullptr, feat_rms.data(), dnorm.data(), dfeat.data(), nullptr, N, F);
    }
    d_image_features = std::move(dfeat);
  }
  const float scale = static_cast<float>(std::sqrt(static_cast<double>(H)));
  float* gE = G(m.embed_);
  // Columns in parallel, tokens in order: each gradient element sums its tokens in one fixed order.
#pragma omp parallel for schedule(static) if (T * H >= kParallelMinElements)
  for (int64_t i = 0; i < H; ++i) {
    for (int64_t t = 0; t < T; ++t) {
      if (feature_of[t] >= 0 || b.input_ids[t] == cfg.pad_token_id) continue;
      gE[int64_t{b.input_ids[t]} * H + i] += dh0[t * H + i] * scale;
    }
  }
}

void Gemma4Model::Run::layer_forward(int l, const float* x, float* out, LayerActs& a, bool reuse_attention) {
  const LayerSpec& sp = m.specs_[l];
  const LayerSlots& sl = m.slots_[l];
  const int Hq = cfg.num_heads, Hkv = sp.kv_heads, D = sp.head_dim;
  const int64_t qd = int64_t{Hq} * D, kd = int64_t{Hkv} * D, I = sp.intermediate;

  // Attention block: q/k get a scaled RMSNorm per head then RoPE; v a scale-free RMSNorm and no RoPE.
  a.a = zeros(T * H);
  a.r_in = zeros(T);
  rmsnorm_forward(x, W(sl.input_norm), eps, a.a.data(), a.r_in.data(), T, H);
  a.q_raw = zeros(T * qd);
  linear_forward(a.a.data(), W(sl.q_proj), a.q_raw.data(), T, H, qd);
  Vec tmp = zeros(T * qd);
  a.q_rms = zeros(T * Hq);
  rmsnorm_forward(a.q_raw.data(), W(sl.q_norm), eps, tmp.data(), a.q_rms.data(), T * Hq, D);
  rope_apply(tmp.data(), rope(sp), T, Hq, false);
  a.Q = zeros(T * qd);
  to_head_major(tmp.data(), a.Q.data(), B, S, Hq, D);

  const float* K = nullptr;
  const float* V = nullptr;
  if (sp.kv_source < 0) {
    a.k_raw = zeros(T * kd);
    linear_forward(a.a.data(), W(sl.k_proj), a.k_raw.data(), T, H, kd);
    if (sp.has_v_proj) {
      a.v_raw = zeros(T * kd);
      linear_forward(a.a.data(), W(sl.v_proj), a.v_raw.data(), T, H, kd);
    }
    const Vec& v_src = sp.has_v_proj ? a.v_raw : a.k_raw;  // attention_k_eq_v: V is the raw K projection
    Vec kt = zeros(T * kd), vt = zeros(T * kd);
    a.k_rms = zeros(T * Hkv);
    a.v_rms = zeros(T * Hkv);
    rmsnorm_forward(a.k_raw.data(), W(sl.k_norm), eps, kt.data(), a.k_rms.data(), T * Hkv, D);
    rope_apply(kt.data(), rope(sp), T, Hkv, false);
    rmsnorm_forward(v_src.data(), nullptr, eps, vt.data(), a.v_rms.data(), T * Hkv, D);
    a.K = zeros(T * kd);
    a.V = zeros(T * kd);
    to_head_major(kt.data(), a.K.data(), B, S, Hkv, D);
    to_head_major(vt.data(), a.V.data(), B, S, Hkv, D);
    if (sp.stores_kv && !reuse_attention) {
      kv_K[l] = a.K;
      kv_V[l] = a.V;
    }
    K = a.K.data();
    V = a.V.data();
  } else {
    K = kv_K[sp.kv_source].data();
    V = kv_V[sp.kv_source].data();
  }
  if (!reuse_attention) {
    a.O = zeros(T * qd);
    a.lse = zeros(T * Hq);
    cpu::attention_forward(chunk(sp, a.Q.data(), K, V), a.O.data(), a.lse.data());
  }
  a.o_tok = zeros(T * qd);
  to_token_major(a.O.data(), a.o_tok.data(), B, S, Hq, D);
  a.ao = zeros(T * H);
  linear_forward(a.o_tok.data(), W(sl.o_proj), a.ao.data(), T, qd, H);
  a.x1 = zeros(T * H);
  a.r_pa = zeros(T);
  rmsnorm_forward(a.ao.data(), W(sl.post_attn_norm), eps, a.x1.data(), a.r_pa.data(), T, H);
  add_into(a.x1.data(), x, T * H);

  // Feed-forward: GeGLU MLP, plus the MoE block beside it.
  a.m_in = zeros(T * H);
  a.r_pf = zeros(T);
  rmsnorm_forward(a.x1.data(), W(sl.pre_ff_norm), eps, a.m_in.data(), a.r_pf.data(), T, H);
  a.g = zeros(T * I);
  a.u = zeros(T * I);
  a.hmid = zeros(T * I);
  linear_forward(a.m_in.data(), W(sl.gate_proj), a.g.data(), T, H, I);
  linear_forward(a.m_in.data(), W(sl.up_proj), a.u.data(), T, H, I);
  geglu_forward(a.g.data(), a.u.data(), a.hmid.data(), T * I);
  a.mo = zeros(T * H);
  linear_forward(a.hmid.data(), W(sl.down_proj), a.mo.data(), T, I, H);
  if (cfg.enable_moe) {
    moe_forward(l, a);
  } else {
    a.ff = a.mo;
  }
  a.x2 = zeros(T * H);
  a.r_pff = zeros(T);
  rmsnorm_forward(a.ff.data(), W(sl.post_ff_norm), eps, a.x2.data(), a.r_pff.data(), T, H);
  add_into(a.x2.data(), a.x1.data(), T * H);

  Vec x3;
  if (cfg.ple_dim > 0) {
    const int64_t P = cfg.ple_dim, LP = int64_t{cfg.num_layers} * P;
    a.ple_l = zeros(T * P);
    for (int64_t t = 0; t < T; ++t) std::copy_n(ple.data() + t * LP + l * P, P, a.ple_l.data() + t * P);
    a.gp = zeros(T * P);
    linear_forward(a.x2.data(), W(sl.ple_gate), a.gp.data(), T, H, P);
    a.gm = zeros(T * P);
    for (int64_t i = 0; i < T * P; ++i) a.gm[i] = gelu_tanh(a.gp[i]) * a.ple_l[i];
    a.pp = zeros(T * H);
    linear_forward(a.gm.data(), W(sl.ple_proj), a.pp.data(), T, P, H);
    x3 = zeros(T * H);
    a.r_ppn = zeros(T);
    rmsnorm_forward(a.pp.data(), W(sl.ple_post_norm), eps, x3.data(), a.r_ppn.data(), T, H);
    add_into(x3.data(), a.x2.data(), T * H);
  }
  const float* x_last = cfg.ple_dim > 0 ? x3.data() : a.x2.data();
  const float scalar = m.buffers_.data(sl.layer_scalar)[0];
#pragma omp parallel for schedule(static) if (T * H >= kParallelMinElements)
  for (int64_t i = 0; i < T * H; ++i) out[i] = x_last[i] * scalar;
}

void Gemma4Model::Run::moe_forward(int l, LayerActs& a) {
  const LayerSlots& sl = m.slots_[l];
  const int64_t E = cfg.num_experts, K = cfg.top_k_experts, Im = cfg.moe_intermediate_size;
  a.h1 = zeros(T * H);
  a.r_pf1 = zeros(T);
  rmsnorm_forward(a.mo.data(), W(sl.post_ff_norm_1), eps, a.h1.data(), a.r_pf1.data(), T, H);

  // Router on the residual x1: scale-free RMSNorm, * scale * H^-1/2, projection, softmax, top-k renormalised,
  // times the chosen experts' per_expert_scale.
  a.rn = zeros(T * H);
  a.r_rn = zeros(T);
  rmsnorm_forward(a.x1.data(), nullptr, eps, a.rn.data(), a.r_rn.data(), T, H);
  const float root = static_cast<float>(1.0 / std::sqrt(static_cast<double>(H)));
  const float* scale = W(sl.router_scale);
  a.rs = zeros(T * H);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < H; ++i) a.rs[t * H + i] = a.rn[t * H + i] * scale[i] * root;
  a.probs = zeros(T * E);
  linear_forward(a.rs.data(), W(sl.router_proj), a.probs.data(), T, H, E);
  a.top_idx.assign(static_cast<size_t>(T * K), 0);
  a.top_wn = zeros(T * K);
  a.top_sum = zeros(T);
  a.top_w = zeros(T * K);
  const float* pes = W(sl.per_expert_scale);
  for (int64_t t = 0; t < T; ++t) {
    float* p = a.probs.data() + t * E;
    const float mx = *std::max_element(p, p + E);
    float sum = 0.f;
    for (int64_t e = 0; e < E; ++e) sum += p[e] = std::exp(p[e] - mx);
    for (int64_t e = 0; e < E; ++e) p[e] /= sum;
    // Top-k by probability, ties to the lower expert index (torch.topk's choice is unspecified on ties).
    std::vector<int32_t> order(static_cast<size_t>(E));
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + K, order.end(),
                      [p](int32_t x, int32_t y) { return p[x] > p[y] || (p[x] == p[y] && x < y); });
    float top = 0.f;
    for (int64_t j = 0; j < K; ++j) top += p[order[j]];
    a.top_sum[t] = top;
    for (int64_t j = 0; j < K; ++j) {
      a.top_idx[t * K + j] = order[j];
      a.top_wn[t * K + j] = p[order[j]] / top;
      a.top_w[t * K + j] = a.top_wn[t * K + j] * pes[order[j]];
    }
  }

  // Experts on their own pre-norm of x1; each expert runs its tokens as one batch of sgemms.
  a.e_in = zeros(T * H);
  a.r_pre2 = zeros(T);
  rmsnorm_forward(a.x1.data(), W(sl.pre_ff_norm_2), eps, a.e_in.data(), a.r_pre2.data(), T, H);
  a.routed.assign(static_cast<size_t>(E), {});
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < K; ++j) a.routed[a.top_idx[t * K + j]].push_back(t * K + j);
  a.e_x.assign(E, {});
  a.e_gu.assign(E, {});
  a.e_hm.assign(E, {});
  a.e_eo.assign(E, {});
  a.out2 = zeros(T * H);
  const float* GU = W(sl.experts_gate_up);
  const float* DN = W(sl.experts_down);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = static_cast<int64_t>(a.routed[e].size());
    if (n == 0) continue;
    Vec& X = a.e_x[e];
    X = zeros(n * H);
    for (int64_t r = 0; r < n; ++r) std::copy_n(a.e_in.data() + (a.routed[e][r] / K) * H, H, X.data() + r * H);
    a.e_gu[e] = zeros(n * 2 * Im);
    linear_forward(X.data(), GU + e * 2 * Im * H, a.e_gu[e].data(), n, H, 2 * Im);
    a.e_hm[e] = zeros(n * Im);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t i = 0; i < Im; ++i)
        a.e_hm[e][r * Im + i] = gelu_tanh(a.e_gu[e][r * 2 * Im + i]) * a.e_gu[e][r * 2 * Im + Im + i];
    a.e_eo[e] = zeros(n * H);
    linear_forward(a.e_hm[e].data(), DN + e * H * Im, a.e_eo[e].data(), n, Im, H);
    // Experts in index order, as transformers' index_add_ loop, so each token sums its experts in that order.
    for (int64_t r = 0; r < n; ++r) {
      const int64_t tj = a.routed[e][r];
      const float w = a.top_w[tj];
      float* o = a.out2.data() + (tj / K) * H;
      for (int64_t i = 0; i < H; ++i) o[i] += a.e_eo[e][r * H + i] * w;
    }
  }
  Vec h2 = zeros(T * H);
  a.r_pf2 = zeros(T);
  rmsnorm_forward(a.out2.data(), W(sl.post_ff_norm_2), eps, h2.data(), a.r_pf2.data(), T, H);
  a.ff = a.h1;
  add_into(a.ff.data(), h2.data(), T * H);
}

void Gemma4Model::Run::moe_backward(int l, LayerActs& a, const float* dout2, float* dx1) {
  const LayerSlots& sl = m.slots_[l];
  const int64_t E = cfg.num_experts, K = cfg.top_k_experts, Im = cfg.moe_intermediate_size;
  const float* GU = W(sl.experts_gate_up);
  const float* DN = W(sl.experts_down);
  float* gGU = G(sl.experts_gate_up);
  float* gDN = G(sl.experts_down);
  Vec de_in = zeros(T * H);
  Vec dw = zeros(T * K);  // d loss / d top_w
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = static_cast<int64_t>(a.routed[e].size());
    if (n == 0) continue;
    Vec dY = zeros(n * H);
    for (int64_t r = 0; r < n; ++r) {
      const int64_t tj = a.routed[e][r];
      const float* g = dout2 + (tj / K) * H;
      float dot = 0.f;
      for (int64_t i = 0; i < H; ++i) {
        dY[r * H + i] = g[i] * a.top_w[tj];
        dot += g[i] * a.e_eo[e][r * H + i];
      }
      dw[tj] = dot;
    }
    Vec dhm = zeros(n * Im);
    linear_backward(a.e_hm[e].data(), DN + e * H * Im, dY.data(), dhm.data(), gDN ? gDN + e * H * Im : nullptr, n,
                    Im, H);
    Vec dgu = zeros(n * 2 * Im);
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t i = 0; i < Im; ++i) {
        const float gate = a.e_gu[e][r * 2 * Im + i], up = a.e_gu[e][r * 2 * Im + Im + i];
        dgu[r * 2 * Im + i] = dhm[r * Im + i] * up * gelu_tanh_grad(gate);
        dgu[r * 2 * Im + Im + i] = dhm[r * Im + i] * gelu_tanh(gate);
      }
    }
    Vec dX = zeros(n * H);
    linear_backward(a.e_x[e].data(), GU + e * 2 * Im * H, dgu.data(), dX.data(), gGU ? gGU + e * 2 * Im * H : nullptr,
                    n, H, 2 * Im);
    for (int64_t r = 0; r < n; ++r) add_into(de_in.data() + (a.routed[e][r] / K) * H, dX.data() + r * H, H);
  }
  rmsnorm_backward(a.x1.data(), W(sl.pre_ff_norm_2), a.r_pre2.data(), de_in.data(), dx1, G(sl.pre_ff_norm_2), T, H);

  // Router: top_w = wn * pes[e], wn = p / sum_topk(p); gradients reach the probabilities of chosen experts only.
  const float* pes = W(sl.per_expert_scale);
  float* gpes = G(sl.per_expert_scale);
  Vec dlogits = zeros(T * E);
  for (int64_t t = 0; t < T; ++t) {
    const float* p = a.probs.data() + t * E;
    float s = 0.f;
    std::vector<float> dwn(static_cast<size_t>(K));
    for (int64_t j = 0; j < K; ++j) {
      const int64_t e = a.top_idx[t * K + j];
      if (gpes) gpes[e] += dw[t * K + j] * a.top_wn[t * K + j];
      dwn[j] = dw[t * K + j] * pes[e];
      s += dwn[j] * a.top_wn[t * K + j];
    }
    float* dz = dlogits.data() + t * E;
    float dot = 0.f;  // sum_e dp_e p_e over chosen experts
    for (int64_t j = 0; j < K; ++j) {
      const int64_t e = a.top_idx[t * K + j];
      const float dp = (dwn[j] - s) / a.top_sum[t];
      dz[e] = dp;
      dot += dp * p[e];
    }
    for (int64_t e = 0; e < E; ++e) dz[e] = p[e] * (dz[e] - dot);
  }
  Vec drs = zeros(T * H);
  linear_backward(a.rs.data(), W(sl.router_proj), dlogits.data(), drs.data(), G(sl.router_proj), T, H, E);
  const float root = static_cast<float>(1.0 / std::sqrt(static_cast<double>(H)));
  const float* scale = W(sl.router_scale);
  float* gscale = G(sl.router_scale);
  Vec drn = zeros(T * H);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < H; ++i) {
      if (gscale) gscale[i] += drs[t * H + i] * a.rn[t * H + i] * root;
      drn[t * H + i] = drs[t * H + i] * scale[i] * root;
    }
  }
  rmsnorm_backward(a.x1.data(), nullptr, a.r_rn.data(), drn.data(), dx1, nullptr, T, H);
}

void Gemma4Model::Run::layer_backward(int l, LayerActs& a, const float* x, const float* dout, float* dx) {
  const LayerSpec& sp = m.specs_[l];
  const LayerSlots& sl = m.slots_[l];
  const int Hq = cfg.num_heads, Hkv = sp.kv_heads, D = sp.head_dim;
  const int64_t qd = int64_t{Hq} * D, kd = int64_t{Hkv} * D, I = sp.intermediate;

  const float scalar = m.buffers_.data(sl.layer_scalar)[0];
  Vec dx2 = zeros(T * H);
  for (int64_t i = 0; i < T * H; ++i) dx2[i] = dout[i] * scalar;
  if (cfg.ple_dim > 0) {
    const int64_t P = cfg.ple_dim, LP = int64_t{cfg.num_layers} * P;
    Vec dpp = zeros(T * H);
    rmsnorm_backward(a.pp.data(), W(sl.ple_post_norm), a.r_ppn.data(), dx2.data(), dpp.data(), G(sl.ple_post_norm),
                     T, H);
    Vec dgm = zeros(T * P);
    linear_backward(a.gm.data(), W(sl.ple_proj), dpp.data(), dgm.data(), G(sl.ple_proj), T, P, H);
    Vec dgp = zeros(T * P);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t i = 0; i < P; ++i) {
        const int64_t k = t * P + i;
        dgp[k] = dgm[k] * a.ple_l[k] * gelu_tanh_grad(a.gp[k]);
        dple[t * LP + l * P + i] += dgm[k] * gelu_tanh(a.gp[k]);
      }
    }
    linear_backward(a.x2.data(), W(sl.ple_gate), dgp.data(), dx2.data(), G(sl.ple_gate), T, H, P);
  }
  Vec dff = zeros(T * H);
  rmsnorm_backward(a.ff.data(), W(sl.post_ff_norm), a.r_pff.data(), dx2.data(), dff.data(), G(sl.post_ff_norm), T, H);
  Vec dx1 = dx2;
  Vec dmo;
  if (cfg.enable_moe) {
    dmo = zeros(T * H);
    rmsnorm_backward(a.mo.data(), W(sl.post_ff_norm_1), a.r_pf1.data(), dff.data(), dmo.data(), G(sl.post_ff_norm_1),
                     T, H);
    Vec dout2 = zeros(T * H);
    rmsnorm_backward(a.out2.data(), W(sl.post_ff_norm_2), a.r_pf2.data(), dff.data(), dout2.data(),
                     G(sl.post_ff_norm_2), T, H);
    moe_backward(l, a, dout2.data(), dx1.data());
  } else {
    dmo = std::move(dff);
  }
  Vec dh = zeros(T * I);
  linear_backward(a.hmid.data(), W(sl.down_proj), dmo.data(), dh.data(), G(sl.down_proj), T, I, H);
  Vec dg = zeros(T * I), du = zeros(T * I);
  geglu_backward(a.g.data(), a.u.data(), dh.data(), dg.data(), du.data(), T * I);
  Vec dm = zeros(T * H);
  linear_backward(a.m_in.data(), W(sl.gate_proj), dg.data(), dm.data(), G(sl.gate_proj), T, H, I);
  linear_backward(a.m_in.data(), W(sl.up_proj), du.data(), dm.data(), G(sl.up_proj), T, H, I);
  rmsnorm_backward(a.x1.data(), W(sl.pre_ff_norm), a.r_pf.data(), dm.data(), dx1.data(), G(sl.pre_ff_norm), T, H);

  // Attention block.
  Vec dao = zeros(T * H);
  rmsnorm_backward(a.ao.data(), W(sl.post_attn_norm), a.r_pa.data(), dx1.data(), dao.data(), G(sl.post_attn_norm), T,
                   H);
  Vec tmp = zeros(T * qd);
  linear_backward(a.o_tok.data(), W(sl.o_proj), dao.data(), tmp.data(), G(sl.o_proj), T, qd, H);
  Vec dO = zeros(T * qd);
  to_head_major(tmp.data(), dO.data(), B, S, Hq, D);
  Vec delta = zeros(T * Hq);
  const AttnShape shape{B, Hq, Hkv, S, S, D};
  cpu::attention_delta(shape, DType::F32, dO.data(), a.O.data(), delta.data());
  Vec dQ = zeros(T * qd);
  Vec dK_own, dV_own;
  float* dK = nullptr;
  float* dV = nullptr;
  const float* K = nullptr;
  const float* V = nullptr;
  if (sp.kv_source >= 0) {
    // KV-shared layer: its K/V gradients belong to the layer that produced them (reached later in the backward).
    dK = kv_dK[sp.kv_source].data();
    dV = kv_dV[sp.kv_source].data();
    K = kv_K[sp.kv_source].data();
    V = kv_V[sp.kv_source].data();
  } else {
    dK_own = sp.stores_kv ? kv_dK[l] : zeros(T * kd);
    dV_own = sp.stores_kv ? kv_dV[l] : zeros(T * kd);
    dK = dK_own.data();
    dV = dV_own.data();
    K = a.K.data();
    V = a.V.data();
  }
  cpu::attention_backward(chunk(sp, a.Q.data(), K, V), dO.data(), a.lse.data(), delta.data(), dQ.data(), dK, dV);

  to_token_major(dQ.data(), tmp.data(), B, S, Hq, D);
  rope_apply(tmp.data(), rope(sp), T, Hq, true);
  Vec dq_raw = zeros(T * qd);
  rmsnorm_backward(a.q_raw.data(), W(sl.q_norm), a.q_rms.data(), tmp.data(), dq_raw.data(), G(sl.q_norm), T * Hq, D);
  Vec da = zeros(T * H);
  linear_backward(a.a.data(), W(sl.q_proj), dq_raw.data(), da.data(), G(sl.q_proj), T, H, qd);
  if (sp.kv_source < 0) {
    Vec kt = zeros(T * kd), vt = zeros(T * kd);
    to_token_major(dK, kt.data(), B, S, Hkv, D);
    to_token_major(dV, vt.data(), B, S, Hkv, D);
    rope_apply(kt.data(), rope(sp), T, Hkv, true);
    Vec dk_raw = zeros(T * kd);
    rmsnorm_backward(a.k_raw.data(), W(sl.k_norm), a.k_rms.data(), kt.data(), dk_raw.data(), G(sl.k_norm), T * Hkv, D);
    if (sp.has_v_proj) {
      Vec dv_raw = zeros(T * kd);
      rmsnorm_backward(a.v_raw.data(), nullptr, a.v_rms.data(), vt.data(), dv_raw.data(), nullptr, T * Hkv, D);
      linear_backward(a.a.data(), W(sl.v_proj), dv_raw.data(), da.data(), G(sl.v_proj), T, H, kd);
    } else {
      rmsnorm_backward(a.k_raw.data(), nullptr, a.v_rms.data(), vt.data(), dk_raw.data(), nullptr, T * Hkv, D);
    }
    linear_backward(a.a.data(), W(sl.k_proj), dk_raw.data(), da.data(), G(sl.k_proj), T, H, kd);
  }
  std::copy(dx1.begin(), dx1.end(), dx);
  rmsnorm_backward(x, W(sl.input_norm), a.r_in.data(), da.data(), dx, G(sl.input_norm), T, H);
}

// ---------------------------------------------------------------------------------------------------------------
// The whole model.
// ---------------------------------------------------------------------------------------------------------------

Result Gemma4Model::run(const Batch& batch, const RunOptions& opt, TensorSet* grads) const {
  RF_CHECK(!opt.want_grad || grads != nullptr, "run: gradients requested without a gradient set");
  if (grads) {
    RF_CHECK(grads->size() == params_.size(), "run: the gradient set does not match the parameters");
  }
  Run r(*this, batch, opt, opt.want_grad ? grads : nullptr);
  r.prepare();
  r.embed();
  const int L = cfg_.num_layers;
  const int64_t T = r.T, H = r.H;
  r.kv_K.assign(L, {});
  r.kv_V.assign(L, {});
  r.kv_dK.assign(L, {});
  r.kv_dV.assign(L, {});
  if (opt.want_grad) {
    r.x_in.assign(L, {});
    r.saved_O.assign(L, {});
    r.saved_lse.assign(L, {});
  }

  Vec x = r.h0;
  Vec next = zeros(T * H);
  for (int l = 0; l < L; ++l) {
    LayerActs a;
    r.layer_forward(l, x.data(), next.data(), a, false);
    if (opt.want_grad) {
      r.x_in[l] = std::move(x);
      r.saved_O[l] = std::move(a.O);
      r.saved_lse[l] = std::move(a.lse);
    }
    x = next;
  }

  // Final norm, then the fused chunked head + softcap + cross-entropy (its backward runs in the same pass).
  Vec xf = zeros(T * H), r_final = zeros(T);
  rmsnorm_forward(x.data(), r.W(final_norm_), r.eps, xf.data(), r_final.data(), T, H);
  Result res;
  int64_t label_tokens = 0;
  if (batch.labels)
    for (int64_t t = 0; t < T; ++t) label_tokens += batch.labels[t] != kIgnoreLabel;
  res.label_tokens = label_tokens;
  const double normalizer = opt.loss_normalizer > 0 ? opt.loss_normalizer : static_cast<double>(label_tokens);
  res.token_loss.assign(static_cast<size_t>(T), 0.f);
  if (opt.want_logits) res.logits.assign(static_cast<size_t>(T * cfg_.vocab_size), 0.f);
  Vec dxf = opt.want_grad ? zeros(T * H) : Vec{};
  LmHeadLossArgs la;
  la.x = xf.data();
  la.W = r.W(lm_head_);
  la.labels = batch.labels;
  la.T = T;
  la.H = H;
  la.V = cfg_.vocab_size;
  la.softcap = static_cast<float>(cfg_.final_logit_softcapping);
  la.loss_scale = normalizer > 0 ? static_cast<float>(1.0 / normalizer) : 0.f;
  la.chunk = opt.loss_chunk_tokens > 0 ? opt.loss_chunk_tokens : loss_chunk_tokens(la.V, kLossChunkBytes);
  LmHeadLossOut lo;
  lo.token_loss = res.token_loss.data();
  lo.logits = opt.want_logits ? res.logits.data() : nullptr;
  if (opt.want_grad) {
    lo.dx = dxf.data();
    lo.dW = r.G(lm_head_);
  }
  res.loss = lm_head_loss(la, lo);
  if (!opt.want_grad) return res;
  int64_t kept = static_cast<int64_t>(r.h0.size() + r.ple.size() + r.ple_raw.size() + r.ple_rms.size());
  for (int l = 0; l < L; ++l)
    kept += static_cast<int64_t>(r.x_in[l].size() + r.saved_O[l].size() + r.saved_lse[l].size() + r.kv_K[l].size() +
                                 r.kv_V[l].size());
  res.kept_activation_bytes = kept * static_cast<int64_t>(sizeof(float));

  // Backward, one layer at a time: recompute the layer's activations from its kept input (attention output and
  // LSE are kept, so attention itself is not recomputed), then differentiate it.
  Vec dx = zeros(T * H);
  rmsnorm_backward(x.data(), r.W(final_norm_), r_final.data(), dxf.data(), dx.data(), r.G(final_norm_), T, H);
  if (cfg_.ple_dim > 0) r.dple = zeros(T * int64_t{L} * cfg_.ple_dim);
  for (int l = 0; l < L; ++l) {
    if (specs_[l].stores_kv) {
      r.kv_dK[l] = zeros(static_cast<int64_t>(r.kv_K[l].size()));
      r.kv_dV[l] = zeros(static_cast<int64_t>(r.kv_V[l].size()));
    }
  }
  Vec dprev = zeros(T * H);
  for (int l = L - 1; l >= 0; --l) {
    LayerActs a;
    a.O = std::move(r.saved_O[l]);
    a.lse = std::move(r.saved_lse[l]);
    r.layer_forward(l, r.x_in[l].data(), next.data(), a, true);
    res.layer_recompute_bytes = std::max(res.layer_recompute_bytes, a.bytes());
    r.layer_backward(l, a, r.x_in[l].data(), dx.data(), dprev.data());
    std::swap(dx, dprev);
    r.x_in[l] = Vec{};
  }
  r.embed_backward(dx.data());
  res.d_image_features = std::move(r.d_image_features);
  return res;
}

}  // namespace rf::model
