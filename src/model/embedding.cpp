// ringflex model: batch preparation, the embedding and the per-layer embeddings (PLE) of Gemma 4, forward and
// backward (gemma4_run.h).
//
// Preparation follows issue 8: the full rows' token metadata (global idx, doc, image group) is built first, the
// attention backend chooses this rank's tokens from it, and every sequence-resident array (ids, labels, positions,
// metadata, image slots) is gathered to those tokens. The embedding, the image features' projection and the PLE
// inputs are then computed for this rank's tokens only: they are per-token maps, so this is the same math as
// embedding the full row and sharding the result, in O(L) instead of O(S) work and memory.
#include <algorithm>

#include "core/row_meta.h"
#include "model/elementwise.h"
#include "model/gemma4_run.h"
#include "model/loss.h"
#include "model/multimodal.h"

namespace rf::model {

namespace {

// Columns per block of the embedding's gradient: one 64-byte cache line of float32.
constexpr int64_t kEmbedColumnsPerBlock = 16;

}  // namespace

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
  // (Token 0 when the config has no pad id; check_batch has made sure no image slot then needs one.)
  const int32_t pad_id = cfg.pad_token_id.value_or(0);
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
      // Padding (doc 0) is not trained on, whatever label the batch gives it (docs/model-fidelity.md).
      if (b.labels) labels[t] = meta[t].doc == kPaddingDoc ? kIgnoreLabel : b.labels[g];
      // An image slot on padding takes no feature: nothing reads a padding token, so its feature could only reach
      // the results through 0 · x in the weight gradients, which a non-finite feature would turn into NaN.
      if (row_feature[g] >= 0 && meta[t].doc != kPaddingDoc) {
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
  // The tables' rows are read in the dtype the store holds them in (a LoRA base: the checkpoint's; held_weight.h),
  // where the store keeps them (ParamStore::rows: a sharded store fetches the rows of the batch's ids alone).
  embed_rows = store.rows(m.embed_, ids, opt.want_grad);
  const HeldWeight E = embed_rows.values;
#pragma omp parallel for schedule(static) if (T * H >= kParallelMinElements)
  for (int64_t t = 0; t < T; ++t) {
    float* e = h0.data() + t * H;
    widen(E, embed_rows.row[t] * H, H, e);
    for (int64_t i = 0; i < H; ++i) e[i] *= scale;
  }
  if (!used_features.empty()) {
    // Only the features of this rank's tokens are projected: the same per-row math as projecting all N, O(L).
    const int64_t n = static_cast<int64_t>(used_features.size());
    const VisionEmbedder* e = m.embed_vision_;
    const int64_t F = e ? e->feature_dim() : H;
    feat_raw = zeros(n * F);
    for (int64_t i = 0; i < n; ++i) std::copy_n(b.image_features + used_features[i] * F, F, feat_raw.data() + i * F);
    Vec projected;
    const float* feats = feat_raw.data();
    if (e) {
      feat_in = zeros(n * F);
      feat_rms = zeros(n);
      projected = zeros(n * H);
      e->forward(mm, W(e->slot()), feat_raw.data(), n, feat_in.data(), feat_rms.data(), projected.data());
      feats = projected.data();
    }
    for (int64_t t = 0; t < T; ++t)
      if (local_feature[t] >= 0) std::copy_n(feats + local_feature[t] * H, H, h0.data() + t * H);
  }
  if (cfg.ple_dim == 0) return;
  // Per-layer inputs: (RMSNorm(h0 Wp^T * H^-1/2) + E_ple[id] * sqrt(P)) * 2^-1/2, [T, L, P].
  const int64_t P = cfg.ple_dim, LP = int64_t{cfg.num_layers} * P;
  ple_raw = zeros(T * LP);
  linear_forward(mm, h0.data(), W(m.ple_proj_), ple_raw.data(), T, H, LP);
  const float proj_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(H)));
  for (float& v : ple_raw) v *= proj_scale;
  ple = zeros(T * LP);
  ple_rms = zeros(T * cfg.num_layers);
  rmsnorm_forward(ple_raw.data(), W(m.ple_norm_), eps, ple.data(), ple_rms.data(), T * cfg.num_layers, P);
  const float tok_scale = static_cast<float>(std::sqrt(static_cast<double>(P)));
  ple_rows = store.rows(m.ple_embed_, ple_ids, opt.want_grad);
  const HeldWeight Ep = ple_rows.values;
#pragma omp parallel for schedule(static) if (T * LP >= kParallelMinElements)
  for (int64_t t = 0; t < T; ++t) {
    std::vector<float> e(static_cast<size_t>(LP));  // the row widened
    widen(Ep, ple_rows.row[t] * LP, LP, e.data());
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
    linear_backward(mm, h0.data(), W(m.ple_proj_), draw.data(), dh0.data(), G(m.ple_proj_), T, H, LP);
    // Token half: nn.Embedding(padding_idx = pad) gives the pad row no gradient.
    const float tok_scale = static_cast<float>(std::sqrt(static_cast<double>(P)));
    if (float* gE = ple_rows.grads) {  // nullptr: the table is frozen
      for (int64_t t = 0; t < T; ++t) {
        if (is_pad[t] || ple_ids[t] == cfg.pad_token_id) continue;
        float* g = gE + ple_rows.row[t] * LP;
        for (int64_t i = 0; i < LP; ++i) g[i] += dnormed[t * LP + i] * tok_scale;  // dnormed = dple * 2^-1/2
      }
    }
  }
  if (b.image_features) {
    // This rank's rows of d image_features; the other ranks hold the rest (Result::d_image_features).
    const int64_t N = b.n_image_features, n = static_cast<int64_t>(used_features.size());
    const VisionEmbedder* e = m.embed_vision_;
    const int64_t F = e ? e->feature_dim() : H;
    Vec dfeat = zeros(n * H);  // [n, H]
    for (int64_t t = 0; t < T; ++t)
      if (local_feature[t] >= 0) std::copy_n(dh0.data() + t * H, H, dfeat.data() + local_feature[t] * H);
    if (e && n > 0) {
      Vec draw = zeros(n * F);
      e->backward(mm, W(e->slot()), feat_raw.data(), feat_in.data(), feat_rms.data(), dfeat.data(), n, draw.data(),
                  G(e->slot()));
      dfeat = std::move(draw);
    }
    d_image_features = zeros(N * F);
    for (int64_t i = 0; i < n; ++i)
      std::copy_n(dfeat.data() + i * F, F, d_image_features.data() + used_features[i] * F);
  }
  const float scale = static_cast<float>(std::sqrt(static_cast<double>(H)));
  float* gE = embed_rows.grads;
  if (gE == nullptr) return;  // the table is frozen
  // Blocks of columns in parallel, tokens in order within each: each gradient element sums its tokens in one fixed
  // order, and a block of a row is one cache line (a single-column sweep would load a line per token for 4 bytes).
  const int64_t blocks = (H + kEmbedColumnsPerBlock - 1) / kEmbedColumnsPerBlock;
#pragma omp parallel for schedule(static) if (T * H >= kParallelMinElements)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t i0 = blk * kEmbedColumnsPerBlock, i1 = std::min(H, i0 + kEmbedColumnsPerBlock);
    for (int64_t t = 0; t < T; ++t) {
      if (feature_of[t] >= 0 || is_pad[t] || ids[t] == cfg.pad_token_id) continue;
      float* g = gE + embed_rows.row[t] * H;
      for (int64_t i = i0; i < i1; ++i) g[i] += dh0[t * H + i] * scale;
    }
  }
}

void Gemma4Model::Run::ple_forward(int l, const float* x2, PleActs& a, float* x3) {
  const LayerSlots& sl = m.slots_[l];
  const int64_t P = cfg.ple_dim, LP = int64_t{cfg.num_layers} * P;
  a.ple_l = uninit(T * P);
  for (int64_t t = 0; t < T; ++t) std::copy_n(ple.data() + t * LP + l * P, P, a.ple_l.data() + t * P);
  a.gp = uninit(T * P);
  linear_forward(mm, x2, W(sl.ple_gate), a.gp.data(), T, H, P);
  a.gm = uninit(T * P);
  geglu_forward(a.gp.data(), a.ple_l.data(), a.gm.data(), T * P);
  a.pp = uninit(T * H);
  linear_forward(mm, a.gm.data(), W(sl.ple_proj), a.pp.data(), T, P, H);
  a.r_ppn = uninit(T);
  rmsnorm_forward(a.pp.data(), W(sl.ple_post_norm), eps, x3, a.r_ppn.data(), T, H);
  add_into(x3, x2, T * H);
}

void Gemma4Model::Run::ple_backward(int l, PleActs& a, const float* x2, const float* dx3, float* dx2) {
  const LayerSlots& sl = m.slots_[l];
  const int64_t P = cfg.ple_dim, LP = int64_t{cfg.num_layers} * P;
  Vec dpp = zeros(T * H);
  rmsnorm_backward(a.pp.data(), W(sl.ple_post_norm), a.r_ppn.data(), dx3, dpp.data(), G(sl.ple_post_norm), T, H);
  Vec dgm = zeros(T * P);
  linear_backward(mm, a.gm.data(), W(sl.ple_proj), dpp.data(), dgm.data(), G(sl.ple_proj), T, P, H);
  Vec dgp = zeros(T * P);
  // d gate and d per-layer input: a GeGLU's backward, the per-layer input's gradient landing in its slice of dple.
  const ElementwiseKernels& ew = elementwise();
#pragma omp parallel for schedule(static) if (T * P >= kParallelMinElements)
  for (int64_t t = 0; t < T; ++t)
    ew.geglu_backward(a.gp.data() + t * P, a.ple_l.data() + t * P, dgm.data() + t * P, dgp.data() + t * P,
                      dple.data() + t * LP + l * P, P, true);
  linear_backward(mm, x2, W(sl.ple_gate), dgp.data(), dx2, G(sl.ple_gate), T, H, P);
}

}  // namespace rf::model
