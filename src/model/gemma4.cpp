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
#include "cpu/local_attention.h"
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

Gemma4Model::Gemma4Model(Gemma4Config config, int vision_feature_dim)
    : cfg_(std::move(config)), vision_dim_(vision_feature_dim) {
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
  Vec q_raw, q_rms, Q;            // head-major: [B, Hq, S, D], [B*Hq*S], [B, Hq, S, D] (normed, rotated)
  Vec k_raw, k_rms, v_raw, v_rms; // head-major: [B, Hkv, S, D], [B*Hkv*S] (v_raw only with a v_proj)
  Vec K, V;                       // [B, Hkv, S, D] own K/V (empty on KV-shared layers)
  Vec O, lse;                     // [B, Hq, S, D], [B, Hq, S]
  Vec ao, r_pa, x1;               // [T, H], [T], [T, H]
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
    for (const Vec* v : {&a, &r_in, &q_raw, &q_rms, &Q, &k_raw, &k_rms, &v_raw, &v_rms, &K, &V, &O, &lse, &ao,
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
  AttentionBackend& attn;
  int B;             // rows
  int S_row;         // tokens of a full row
  int S = 0;         // tokens of a row this rank holds (the shard's L; S_row at P = 1)
  int64_t T = 0, H;  // T = B * S: this rank's tokens, token-major
  float eps;
  RowShard shard;
  // Sequence-resident arrays, gathered to this rank's tokens ([T], shard order): the full rows' values at the
  // shard's positions, SPEC §5 pad values at sharding padding.
  std::vector<TokenMeta> meta;        // [B, S] global idx/doc/group (numbered on the full row)
  std::vector<int32_t> ids;           // [T] input ids (pad id on sharding padding)
  std::vector<int32_t> labels;        // [T] (kIgnoreLabel on sharding padding); empty without labels
  std::vector<uint8_t> is_pad;        // [T] 1 on sharding padding: no embedding gradient
  std::vector<int32_t> positions;     // [T] RoPE positions
  RopeTable rope_sliding, rope_full;
  std::vector<int64_t> feature_of;    // [T] index into image_features (global), -1 for a text token
  std::vector<int64_t> local_feature; // [T] row of this rank's projected features, -1 for a text token
  std::vector<int64_t> used_features; // [n] global feature rows this rank's tokens hold, in local order
  std::vector<int32_t> ple_ids;       // [T] token ids for the per-layer embedding (pad on vision slots)
  Vec feat_raw, feat_in, feat_rms;    // this rank's features: [n, F] as given, normed input, [n]
  Vec h0;                             // [T, H] embedded row
  Vec ple, ple_raw, ple_rms;          // [T, L*P] per-layer inputs; the projection half before its norm, [T*L]
  Vec dple;                           // [T, L*P]
  Vec d_image_features;               // [N, F]
  std::vector<Vec> x_in;              // [L][T, H] layer inputs (training)
  std::vector<Vec> saved_O, saved_lse;
  std::vector<Vec> kv_K, kv_V, kv_dK, kv_dV;  // [L] K/V (and their gradients) of layers others read

  Run(const Gemma4Model& model, const Batch& batch, const RunOptions& options, TensorSet* g, AttentionBackend& a)
      : m(model), cfg(model.cfg_), b(batch), opt(options), grads(g), attn(a), B(batch.B), S_row(batch.S),
        H(model.cfg_.hidden_size), eps(static_cast<float>(model.cfg_.rms_norm_eps)) {}

  const float* W(size_t s) const { return s == kNoSlot ? nullptr : m.params_.data(s); }
  float* G(size_t s) const { return grads == nullptr || s == kNoSlot ? nullptr : grads->data(s); }
  const RopeTable& rope(const LayerSpec& s) const { return s.sliding ? rope_sliding : rope_full; }

  ShardAttention attention(const LayerSpec& s, const float* Q, const float* K, const float* V) const {
    ShardAttention x;
    x.shape = AttnShape{B, cfg.num_heads, s.kv_heads, S, S, s.head_dim};
    x.q = Q;
    x.k = K;
    x.v = V;
    x.meta = meta.data();
    x.mask = s.mask;
    x.scale = kAttentionScale;
    return x;
  }

  void prepare();
  void embed();
  void embed_backward(const float* dh0);
  void layer_forward(int l, const float* x, float* out, LayerActs& a, bool reuse_attention);
  void layer_backward(int l, LayerActs& a, const float* x, const float* dout, float* dx);
  void moe_forward(int l, LayerActs& a);
  void moe_backward(int l, LayerActs& a, const float* dout2, float* dx1);
};

void Gemma4Model::check_batch(const Batch& b, int ranks) const {
  const int B = b.B, S = b.S;
  RF_CHECK(B > 0 && S > 0, "batch: B = ", B, " and S = ", S, " must be positive");
  RF_CHECK(b.input_ids != nullptr, "batch: input_ids is required");
  RF_CHECK(ranks >= 1 && ranks <= S, "context parallelism over ", ranks, " ranks needs at least ", ranks,
           " tokens per row, the batch's rows have ", S);
  const int64_t T = int64_t{B} * S;
  if (b.mm_token_type) {
    for (int64_t t = 0; t < T; ++t) {
      const int32_t v = b.mm_token_type[t];
      RF_CHECK(v >= 0 && v <= 2, "mm_token_type_ids: value ", v, " at [", t / S, ", ", t % S, "] is not 0, 1 or 2");
    }
  }
  if (b.image_features) {
    RF_CHECK(b.mm_token_type != nullptr, "image_features given without mm_token_type_ids to place them");
    int64_t n = 0;
    for (int64_t t = 0; t < T; ++t) n += b.mm_token_type[t] != 0;
    RF_CHECK(n == b.n_image_features, "image_features has ", b.n_image_features, " rows for ", n,
             " image/video token slots in mm_token_type_ids");
  }
  for (int64_t t = 0; t < T; ++t) {
    RF_CHECK(b.input_ids[t] >= 0 && b.input_ids[t] < cfg_.vocab_size, "input_ids: token ", b.input_ids[t], " at ", t,
             " is outside [0, vocab_size = ", cfg_.vocab_size, ")");
    const bool vision_slot = b.image_features != nullptr && b.mm_token_type[t] != 0;
    if (cfg_.ple_dim > 0 && !vision_slot)
      RF_CHECK(b.input_ids[t] < cfg_.ple_vocab_size, "input_ids: token ", b.input_ids[t], " at ", t,
               " is outside the per-layer embedding's vocabulary (", cfg_.ple_vocab_size, ")");
    if (b.labels)
      RF_CHECK(b.labels[t] == kIgnoreLabel || (b.labels[t] >= 0 && b.labels[t] < cfg_.vocab_size), "labels: ",
               b.labels[t], " at ", t, " is neither ", kIgnoreLabel, " nor in [0, vocab_size = ", cfg_.vocab_size,
               ")");
  }
}

std::vector<MaskLayers> Gemma4Model::mask_mix() const {
  std::vector<MaskLayers> mix;
  for (const LayerSpec& s : specs_) {
    auto it = std::find_if(mix.begin(), mix.end(), [&](const MaskLayers& k) { return k.mask == s.mask; });
    if (it == mix.end())
      mix.push_back(MaskLayers{s.mask, 1});
    else
      ++it->layers;
  }
  return mix;
}

void Gemma4Model::Run::prepare() {
  m.check_batch(b, attn.ranks());
  // Metadata of the full rows: groups are numbered on the whole row, so an image split across ranks keeps its id.
  const int64_t T_row = int64_t{B} * S_row;
  std::vector<TokenMeta> row_meta(static_cast<size_t>(T_row));  // [B, S_row]
  for (int r = 0; r < B; ++r) {
    const int64_t o = int64_t{r} * S_row;
    std::vector<int32_t> group;
    if (b.mm_token_type) group = group_ids_from_token_types(b.mm_token_type + o, S_row);
    const std::vector<TokenMeta> row =
        make_row_meta(S_row, b.doc ? b.doc + o : nullptr, group.empty() ? nullptr : group.data());
    std::copy(row.begin(), row.end(), row_meta.begin() + o);
  }
  // Vision slots take the image features in row-major order of the full rows.
  std::vector<int64_t> row_feature(static_cast<size_t>(T_row), -1);
  if (b.image_features) {
    int64_t n = 0;
    for (int64_t t = 0; t < T_row; ++t)
      if (b.mm_token_type[t] != 0) row_feature[t] = n++;
  }

  shard = attn.begin_batch(row_meta.data(), B, S_row, m.mask_mix());
  S = shard.L;
  T = int64_t{B} * S;
  const std::vector<int32_t>& mine = shard.mine();
  // Sharding padding takes a real token id so every lookup stays in range; it is masked out of every gradient.
  const int32_t pad_id = cfg.pad_token_id >= 0 ? cfg.pad_token_id : 0;
  meta.resize(static_cast<size_t>(T));
  ids.resize(static_cast<size_t>(T));
  is_pad.resize(static_cast<size_t>(T));
  positions.resize(static_cast<size_t>(T));
  feature_of.assign(static_cast<size_t>(T), -1);
  local_feature.assign(static_cast<size_t>(T), -1);
  if (b.labels) labels.resize(static_cast<size_t>(T));
  for (int r = 0; r < B; ++r) {
    for (int j = 0; j < S; ++j) {
      const int64_t t = int64_t{r} * S + j;
      const int32_t p = mine[static_cast<size_t>(j)];
      if (shard.is_pad(p)) {
        meta[t] = TokenMeta{p, kPaddingDoc, kNoGroup};
        ids[t] = pad_id;
        is_pad[t] = 1;
        positions[t] = 0;
        if (b.labels) labels[t] = kIgnoreLabel;
        continue;
      }
      const int64_t g = int64_t{r} * S_row + p;
      meta[t] = row_meta[g];
      ids[t] = b.input_ids[g];
      is_pad[t] = 0;
      positions[t] = b.position_ids ? b.position_ids[g] : p;
      if (b.labels) labels[t] = b.labels[g];
      if (row_feature[g] >= 0) {
        feature_of[t] = row_feature[g];
        local_feature[t] = static_cast<int64_t>(used_features.size());
        used_features.push_back(row_feature[g]);
      }
    }
  }
  for (int i = 0; i < cfg.num_layers; ++i) {
    const LayerSpec& s = m.specs_[i];
    RopeTable& r = s.sliding ? rope_sliding : rope_full;
    if (r.D == 0)
      r = make_rope_table(positions.data(), T, s.head_dim, s.rope->proportional, s.rope->theta,
                          s.rope->partial_rotary_factor, s.rope->factor);
  }
  ple_ids = ids;
  // As Gemma4Model: multimodal slots read the pad id's per-layer embedding.
  for (int64_t t = 0; t < T; ++t)
    if (feature_of[t] >= 0) ple_ids[t] = pad_id;
}

void Gemma4Model::Run::embed() {
  // transformers casts sqrt(H) to the weight dtype before multiplying.
  const float scale = static_cast<float>(std::sqrt(static_cast<double>(H)));
  h0 = zeros(T * H);
  const float* E = W(m.embed_);
#pragma omp parallel for schedule(static) if (T * H >= kParallelMinElements)
  for (int64_t t = 0; t < T; ++t) {
    const float* e = E + int64_t{ids[t]} * H;
    for (int64_t i = 0; i < H; ++i) h0[t * H + i] = e[i] * scale;
  }
  if (!used_features.empty()) {
    // Only the features of this rank's tokens are projected: the same per-row math as projecting all N, O(L).
    const int64_t n = static_cast<int64_t>(used_features.size());
    const int64_t F = m.vision_dim_ > 0 ? m.vision_dim_ : H;
    feat_raw = zeros(n * F);
    for (int64_t i = 0; i < n; ++i) std::copy_n(b.image_features + used_features[i] * F, F, feat_raw.data() + i * F);
    Vec projected;
    const float* feats = feat_raw.data();
    if (m.vision_dim_ > 0) {
      feat_in = zeros(n * F);
      feat_rms = zeros(n);
      rmsnorm_forward(feat_raw.data(), nullptr, eps, feat_in.data(), feat_rms.data(), n, F);
      projected = zeros(n * H);
      linear_forward(feat_in.data(), W(m.vision_proj_), projected.data(), n, F, H);
      feats = projected.data();
    }
    for (int64_t t = 0; t < T; ++t)
      if (local_feature[t] >= 0) std::copy_n(feats + local_feature[t] * H, H, h0.data() + t * H);
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
      if (is_pad[t] || ple_ids[t] == cfg.pad_token_id) continue;
      float* g = gE + int64_t{ple_ids[t]} * LP;
      for (int64_t i = 0; i < LP; ++i) g[i] += dnormed[t * LP + i] * tok_scale;  // dnormed = dple * 2^-1/2
    }
  }
  if (b.image_features) {
    // This rank's rows of d image_features; the other ranks hold the rest (Result::d_image_features).
    const int64_t N = b.n_image_features, n = static_cast<int64_t>(used_features.size());
    const int64_t F = m.vision_dim_ > 0 ? m.vision_dim_ : H;
    Vec dfeat = zeros(n * H);  // [n, H]
    for (int64_t t = 0; t < T; ++t)
      if (local_feature[t] >= 0) std::copy_n(dh0.data() + t * H, H, dfeat.data() + local_feature[t] * H);
    if (m.vision_dim_ > 0 && n > 0) {
      Vec dnorm = zeros(n * F);
      linear_backward(feat_in.data(), W(m.vision_proj_), dfeat.data(), dnorm.data(), G(m.vision_proj_), n, F, H);
      dfeat = zeros(n * F);
      rmsnorm_backward(feat_raw.data(), nullptr, feat_rms.data(), dnorm.data(), dfeat.data(), nullptr, n, F);
    }
    d_image_features = zeros(N * F);
    for (int64_t i = 0; i < n; ++i)
      std::copy_n(dfeat.data() + i * F, F, d_image_features.data() + used_features[i] * F);
  }
  const float scale = static_cast<float>(std::sqrt(static_cast<double>(H)));
  float* gE = G(m.embed_);
  // Columns in parallel, tokens in order: each gradient element sums its tokens in one fixed order.
#pragma omp parallel for schedule(static) if (T * H >= kParallelMinElements)
  for (int64_t i = 0; i < H; ++i) {
    for (int64_t t = 0; t < T; ++t) {
      if (feature_of[t] >= 0 || is_pad[t] || ids[t] == cfg.pad_token_id) continue;
      gE[int64_t{ids[t]} * H + i] += dh0[t * H + i] * scale;
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
  // Projections land head-major, [B, heads, S, D], the layout attention reads; norms and RoPE act per D-vector,
  // so they run on that layout as they are.
  a.q_raw = zeros(T * qd);
  heads_forward(a.a.data(), W(sl.q_proj), a.q_raw.data(), B, S, H, Hq, D);
  a.q_rms = zeros(T * Hq);
  a.Q = zeros(T * qd);
  rmsnorm_forward(a.q_raw.data(), W(sl.q_norm), eps, a.Q.data(), a.q_rms.data(), T * Hq, D);
  rope_apply_head_major(a.Q.data(), rope(sp), B, Hq, S, false);

  const float* K = nullptr;
  const float* V = nullptr;
  if (sp.kv_source < 0) {
    a.k_raw = zeros(T * kd);
    heads_forward(a.a.data(), W(sl.k_proj), a.k_raw.data(), B, S, H, Hkv, D);
    if (sp.has_v_proj) {
      a.v_raw = zeros(T * kd);
      heads_forward(a.a.data(), W(sl.v_proj), a.v_raw.data(), B, S, H, Hkv, D);
    }
    const Vec& v_src = sp.has_v_proj ? a.v_raw : a.k_raw;  // attention_k_eq_v: V is the raw K projection
    a.k_rms = zeros(T * Hkv);
    a.v_rms = zeros(T * Hkv);
    a.K = zeros(T * kd);
    a.V = zeros(T * kd);
    rmsnorm_forward(a.k_raw.data(), W(sl.k_norm), eps, a.K.data(), a.k_rms.data(), T * Hkv, D);
    rope_apply_head_major(a.K.data(), rope(sp), B, Hkv, S, false);
    rmsnorm_forward(v_src.data(), nullptr, eps, a.V.data(), a.v_rms.data(), T * Hkv, D);
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
    attn.forward(attention(sp, a.Q.data(), K, V), a.O.data(), a.lse.data());
  }
  a.ao = zeros(T * H);
  merge_heads_forward(a.O.data(), W(sl.o_proj), a.ao.data(), B, S, Hq, D, H);
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
  Vec dO = zeros(T * qd);  // [B, Hq, S, D]
  merge_heads_backward(a.O.data(), W(sl.o_proj), dao.data(), dO.data(), G(sl.o_proj), B, S, Hq, D, H);
  Vec dQ = zeros(T * qd);
  Vec dK = zeros(T * kd), dV = zeros(T * kd);  // this layer's own contribution, written by the backend
  const bool shared = sp.kv_source >= 0;
  const float* K = shared ? kv_K[sp.kv_source].data() : a.K.data();
  const float* V = shared ? kv_V[sp.kv_source].data() : a.V.data();
  attn.backward(attention(sp, a.Q.data(), K, V), a.O.data(), a.lse.data(), dO.data(), dQ.data(), dK.data(),
                dV.data());
  if (shared) {
    // KV-shared layer: its K/V gradients belong to the layer that produced them (reached later in the backward).
    add_into(kv_dK[sp.kv_source].data(), dK.data(), T * kd);
    add_into(kv_dV[sp.kv_source].data(), dV.data(), T * kd);
  } else if (sp.stores_kv) {
    // Plus what the layers that read this layer's K/V sent back.
    add_into(dK.data(), kv_dK[l].data(), T * kd);
    add_into(dV.data(), kv_dV[l].data(), T * kd);
  }

  // Everything stays head-major back to the projections' weights.
  rope_apply_head_major(dQ.data(), rope(sp), B, Hq, S, true);
  Vec dq_raw = zeros(T * qd);
  rmsnorm_backward(a.q_raw.data(), W(sl.q_norm), a.q_rms.data(), dQ.data(), dq_raw.data(), G(sl.q_norm), T * Hq, D);
  Vec da = zeros(T * H);
  heads_backward(a.a.data(), W(sl.q_proj), dq_raw.data(), da.data(), G(sl.q_proj), B, S, H, Hq, D);
  if (sp.kv_source < 0) {
    rope_apply_head_major(dK.data(), rope(sp), B, Hkv, S, true);
    Vec dk_raw = zeros(T * kd);
    rmsnorm_backward(a.k_raw.data(), W(sl.k_norm), a.k_rms.data(), dK.data(), dk_raw.data(), G(sl.k_norm), T * Hkv, D);
    if (sp.has_v_proj) {
      Vec dv_raw = zeros(T * kd);
      rmsnorm_backward(a.v_raw.data(), nullptr, a.v_rms.data(), dV.data(), dv_raw.data(), nullptr, T * Hkv, D);
      heads_backward(a.a.data(), W(sl.v_proj), dv_raw.data(), da.data(), G(sl.v_proj), B, S, H, Hkv, D);
    } else {
      rmsnorm_backward(a.k_raw.data(), nullptr, a.v_rms.data(), dV.data(), dk_raw.data(), nullptr, T * Hkv, D);
    }
    heads_backward(a.a.data(), W(sl.k_proj), dk_raw.data(), da.data(), G(sl.k_proj), B, S, H, Hkv, D);
  }
  std::copy(dx1.begin(), dx1.end(), dx);
  rmsnorm_backward(x, W(sl.input_norm), a.r_in.data(), da.data(), dx, G(sl.input_norm), T, H);
}

// ---------------------------------------------------------------------------------------------------------------
// The whole model.
// ---------------------------------------------------------------------------------------------------------------

Result Gemma4Model::run(const Batch& batch, const RunOptions& opt, TensorSet* grads) const {
  cpu::LocalAttention local;
  return run(batch, opt, grads, local);
}

Result Gemma4Model::run(const Batch& batch, const RunOptions& opt, TensorSet* grads, AttentionBackend& attn) const {
  RF_CHECK(!opt.want_grad || grads != nullptr, "run: gradients requested without a gradient set");
  if (grads) {
    RF_CHECK(grads->size() == params_.size(), "run: the gradient set does not match the parameters");
  }
  Run r(*this, batch, opt, opt.want_grad ? grads : nullptr, attn);
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
  // Every rank holds the whole batch's labels, so the global count is exact here, counted once, with no message.
  int64_t label_tokens = 0;
  if (batch.labels) {
    const int64_t T_row = int64_t{batch.B} * batch.S;
    for (int64_t t = 0; t < T_row; ++t) label_tokens += batch.labels[t] != kIgnoreLabel;
  }
  res.label_tokens = label_tokens;
  const double normalizer = opt.loss_normalizer > 0 ? opt.loss_normalizer : static_cast<double>(label_tokens);
  res.token_loss.assign(static_cast<size_t>(T), 0.f);
  if (opt.want_logits) res.logits.assign(static_cast<size_t>(T * cfg_.vocab_size), 0.f);
  Vec dxf = opt.want_grad ? zeros(T * H) : Vec{};
  LmHeadLossArgs la;
  la.x = xf.data();
  la.W = r.W(lm_head_);
  la.labels = batch.labels ? r.labels.data() : nullptr;
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
  // This rank's tokens' share of the loss, then the sum over the ranks (in rank order: the same bits everywhere).
  res.loss = lm_head_loss(la, lo);
  attn.sum_over_ranks(&res.loss, 1);
  res.shard = r.shard;
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
