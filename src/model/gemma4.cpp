// ringflex model: the Gemma 4 text decoder: parameters, one layer from its blocks, and the whole run (see gemma4.h
// for the memory plan and gemma4_run.h for where each block lives).
#include "model/gemma4.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <random>
#include <span>
#include <string>

#include "core/error.h"
#include "cpu/isa.h"
#include "cpu/local_attention.h"
#include "io/spill_file.h"
#include "model/gemma4_run.h"
#include "model/loss.h"
#include "model/memory.h"

namespace rf::model {

// ---------------------------------------------------------------------------------------------------------------
// Parameter registration (Hugging Face names and shapes).
// ---------------------------------------------------------------------------------------------------------------

Gemma4Model::Gemma4Model(Gemma4Config config, TensorSet::Storage storage, std::unique_ptr<ParamStore> store)
    : cfg_(std::move(config)), store_(store ? std::move(store) : std::make_unique<ReplicatedStore>()) {
  cfg_.validate();
  RF_CHECK(store_->size() == 0, "the model's parameter store must start empty");
  const int64_t H = cfg_.hidden_size, V = cfg_.vocab_size, L = cfg_.num_layers, P = cfg_.ple_dim;
  ParamStore& ps = *store_;
  // Every matrix is a matmul operand except the lookup tables, which are read by row: the per-layer embedding (the
  // largest tensor of a Gemma 4 checkpoint) and the token embedding unless it is also the LM head.
  int group = kGlobalGroup;
  const auto add = [&](const std::string& name, std::vector<int64_t> shape) {
    const bool matrix = shape.size() >= 2;
    return ps.add(name, std::move(shape), group, matrix);
  };
  embed_ = ps.add("model.embed_tokens.weight", {V, H}, kGlobalGroup, cfg_.tie_word_embeddings);
  if (P > 0) {
    ple_embed_ = ps.add("model.embed_tokens_per_layer.weight", {cfg_.ple_vocab_size, L * P}, kGlobalGroup, false);
    ple_proj_ = add("model.per_layer_model_projection.weight", {L * P, H});
    ple_norm_ = add("model.per_layer_projection_norm.weight", {P});
    scales_.push_back(ple_norm_);
  }
  for (int i = 0; i < L; ++i) {
    group = i;
    const LayerSpec s = cfg_.layer(i);
    specs_.push_back(s);
    const std::string p = "model.layers." + std::to_string(i) + ".";
    const int64_t D = s.head_dim, qd = int64_t{cfg_.num_heads} * D, kd = int64_t{s.kv_heads} * D, I = s.intermediate;
    LayerSlots l;
    l.q_proj = add(p + "self_attn.q_proj.weight", {qd, H});
    l.q_norm = add(p + "self_attn.q_norm.weight", {D});
    scales_.push_back(l.q_norm);
    if (s.kv_source < 0) {
      l.k_proj = add(p + "self_attn.k_proj.weight", {kd, H});
      if (s.has_v_proj) l.v_proj = add(p + "self_attn.v_proj.weight", {kd, H});
      l.k_norm = add(p + "self_attn.k_norm.weight", {D});
      scales_.push_back(l.k_norm);
    }
    l.o_proj = add(p + "self_attn.o_proj.weight", {H, qd});
    l.gate_proj = add(p + "mlp.gate_proj.weight", {I, H});
    l.up_proj = add(p + "mlp.up_proj.weight", {I, H});
    l.down_proj = add(p + "mlp.down_proj.weight", {H, I});
    l.input_norm = add(p + "input_layernorm.weight", {H});
    l.post_attn_norm = add(p + "post_attention_layernorm.weight", {H});
    l.pre_ff_norm = add(p + "pre_feedforward_layernorm.weight", {H});
    l.post_ff_norm = add(p + "post_feedforward_layernorm.weight", {H});
    scales_.insert(scales_.end(), {l.input_norm, l.post_attn_norm, l.pre_ff_norm, l.post_ff_norm});
    if (cfg_.enable_moe) {
      const int64_t E = cfg_.num_experts, Im = cfg_.moe_intermediate_size;
      l.router_proj = add(p + "router.proj.weight", {E, H});
      l.router_scale = add(p + "router.scale", {H});
      l.per_expert_scale = add(p + "router.per_expert_scale", {E});
      l.experts_gate_up = add(p + "experts.gate_up_proj", {E, 2 * Im, H});
      l.experts_down = add(p + "experts.down_proj", {E, H, Im});
      l.post_ff_norm_1 = add(p + "post_feedforward_layernorm_1.weight", {H});
      l.post_ff_norm_2 = add(p + "post_feedforward_layernorm_2.weight", {H});
      l.pre_ff_norm_2 = add(p + "pre_feedforward_layernorm_2.weight", {H});
      scales_.insert(scales_.end(),
                     {l.router_scale, l.per_expert_scale, l.post_ff_norm_1, l.post_ff_norm_2, l.pre_ff_norm_2});
    }
    if (P > 0) {
      l.ple_gate = add(p + "per_layer_input_gate.weight", {P, H});
      l.ple_proj = add(p + "per_layer_projection.weight", {H, P});
      l.ple_post_norm = add(p + "post_per_layer_input_norm.weight", {H});
      scales_.push_back(l.ple_post_norm);
    }
    l.layer_scalar = buffers_.add(p + "layer_scalar", {1});
    buffers_[l.layer_scalar].data[0] = 1.f;
    slots_.push_back(l);
  }
  group = kGlobalGroup;
  final_norm_ = add("model.norm.weight", {H});
  scales_.push_back(final_norm_);
  lm_head_ = cfg_.tie_word_embeddings ? embed_ : add("lm_head.weight", {V, H});
  // The token tables are read by row and the head only around the loss (ParamInfo::streamed).
  ps.mark_streamed(embed_);
  if (P > 0) ps.mark_streamed(ple_embed_);
  ps.mark_streamed(lm_head_);
  if (storage == TensorSet::Storage::Deferred) return;
  ps.allocate_weights();
  init_scales();
}

void Gemma4Model::init_scales() {
  for (size_t s : scales_) store_->write_weight(s, std::vector<float>(static_cast<size_t>(store_->info(s).numel), 1.f));
}

void Gemma4Model::init_random(uint64_t seed, float stddev) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, stddev);
  std::vector<float> w;  // one tensor at a time: a sharded store keeps its piece of it (write_weight)
  for (size_t slot = 0; slot < store_->size(); ++slot) {
    // 1-D tensors are scales (norms, router): keep them near 1 so activations stay O(1).
    const bool scale = store_->info(slot).shape.size() == 1;
    w.resize(static_cast<size_t>(store_->info(slot).numel));
    for (float& x : w) x = (scale ? 1.f : 0.f) + normal(rng);
    store_->write_weight(slot, w);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// What the run needs to know before it starts: a batch's validity, the layer masks the attention seam plans for.
// ---------------------------------------------------------------------------------------------------------------

void Gemma4Model::check_batch(const Batch& b, int ranks, const std::string& source) const {
  const int B = b.B, S = b.S;
  RF_CHECK(B > 0 && S > 0, source, ": B = ", B, " and S = ", S, " must be positive");
  RF_CHECK(b.input_ids != nullptr, source, ": input_ids is required");
  RF_CHECK(ranks >= 1 && ranks <= S, source, ": context parallelism over ", ranks, " ranks needs at least ", ranks,
           " tokens per row, the batch's rows have ", S);
  const int64_t T = int64_t{B} * S;
  const auto at = [S](int64_t t) { return concat("[", t / S, ", ", t % S, "]"); };  // token t as [row, position]
  if (b.mm_token_type) {
    for (int64_t t = 0; t < T; ++t) {
      const int32_t v = b.mm_token_type[t];
      RF_CHECK(v >= 0 && v <= 2, source, ": mm_token_type_ids: value ", v, " at ", at(t), " is not 0, 1 or 2");
    }
  }
  if (b.image_features) {
    RF_CHECK(b.mm_token_type != nullptr, source, ": image_features given without mm_token_type_ids to place them");
    int64_t n = 0;
    for (int64_t t = 0; t < T; ++t) n += b.mm_token_type[t] != 0;
    // As Gemma4Model: multimodal slots read the pad id's per-layer embedding, so they need a pad id.
    RF_CHECK(n == 0 || cfg_.pad_token_id || cfg_.ple_dim == 0,
             "config.json: pad_token_id is null, but image/video "
             "slots read the pad token's per-layer embedding (as transformers 5.24 does); set pad_token_id");
    RF_CHECK(n == b.n_image_features, source, ": image_features has ", b.n_image_features, " rows for ", n,
             " image/video token slots in mm_token_type_ids");
  }
  for (int64_t t = 0; t < T; ++t) {
    RF_CHECK(!b.doc || b.doc[t] >= 0, source, ": doc: value ", b.doc[t], " at ", at(t),
             " is negative (0 = padding, documents are 1-based)");
    RF_CHECK(b.input_ids[t] >= 0 && b.input_ids[t] < cfg_.vocab_size, source, ": input_ids: token ", b.input_ids[t],
             " at ", at(t), " is outside [0, vocab_size = ", cfg_.vocab_size, ")");
    const bool vision_slot = b.image_features != nullptr && b.mm_token_type[t] != 0;
    if (cfg_.ple_dim > 0 && !vision_slot)
      RF_CHECK(b.input_ids[t] < cfg_.ple_vocab_size, source, ": input_ids: token ", b.input_ids[t], " at ", at(t),
               " is outside the per-layer embedding's vocabulary (", cfg_.ple_vocab_size, ")");
    if (b.labels)
      RF_CHECK(b.labels[t] == kIgnoreLabel || (b.labels[t] >= 0 && b.labels[t] < cfg_.vocab_size), source,
               ": labels: ", b.labels[t], " at ", at(t), " is neither ", kIgnoreLabel,
               " nor in [0, vocab_size = ", cfg_.vocab_size, ")");
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

// ---------------------------------------------------------------------------------------------------------------
// One layer: the blocks composed with the feed-forward's residual and the layer scalar.
// ---------------------------------------------------------------------------------------------------------------

void Gemma4Model::Run::layer_forward(int l, const float* x, float* out, LayerActs& a, bool reuse_attention) {
  const LayerSlots& sl = m.slots_[l];
  attention_forward(l, x, a.attn, reuse_attention);
  const float* x1 = a.attn.x1.data();
  // Feed-forward: GeGLU MLP, plus the MoE block beside it.
  mlp_forward(l, x1, a.mlp);
  if (cfg.enable_moe) moe_forward(l, x1, a.mlp.mo.data(), a.moe);
  const Vec& ff = cfg.enable_moe ? a.moe.ff : a.mlp.mo;
  a.x2 = uninit(T * H);
  a.r_pff = uninit(T);
  rmsnorm_forward(ff.data(), W(sl.post_ff_norm), eps, a.x2.data(), a.r_pff.data(), T, H);
  add_into(a.x2.data(), x1, T * H);
  Vec x3;
  if (cfg.ple_dim > 0) {
    x3 = uninit(T * H);
    ple_forward(l, a.x2.data(), a.ple, x3.data());
  }
  const float* x_last = cfg.ple_dim > 0 ? x3.data() : a.x2.data();
  const float scalar = m.buffers_.data(sl.layer_scalar)[0];
#pragma omp parallel for schedule(static) if (T * H >= kParallelMinElements)
  for (int64_t i = 0; i < T * H; ++i) out[i] = x_last[i] * scalar;
}

void Gemma4Model::Run::layer_backward(int l, LayerActs& a, const float* x, const float* dout, float* dx) {
  const LayerSlots& sl = m.slots_[l];
  const float scalar = m.buffers_.data(sl.layer_scalar)[0];
  Vec dx3 = uninit(T * H);
#pragma omp parallel for schedule(static) if (T * H >= kParallelMinElements)
  for (int64_t i = 0; i < T * H; ++i) dx3[i] = dout[i] * scalar;
  Vec dx2 = copy_of(dx3);  // the PLE block's residual
  if (cfg.ple_dim > 0) ple_backward(l, a.ple, a.x2.data(), dx3.data(), dx2.data());
  Vec().swap(dx3);  // the residual-stream gradients go as soon as read: fewer [T, H] at the attention's backward
  const Vec& ff = cfg.enable_moe ? a.moe.ff : a.mlp.mo;
  Vec dff = zeros(T * H);
  rmsnorm_backward(ff.data(), W(sl.post_ff_norm), a.r_pff.data(), dx2.data(), dff.data(), G(sl.post_ff_norm), T, H);
  const float* x1 = a.attn.x1.data();
  Vec dx1 = std::move(dx2);  // the feed-forward's residual
  Vec dmo;
  if (cfg.enable_moe) {
    dmo = zeros(T * H);
    moe_backward(l, a.moe, x1, a.mlp.mo.data(), dff.data(), dmo.data(), dx1.data());
    Vec().swap(dff);
  } else {
    dmo = std::move(dff);
  }
  mlp_backward(l, a.mlp, x1, dmo.data(), dx1.data());
  Vec().swap(dmo);
  attention_backward(l, a.attn, x, dx1.data(), dx);
}

// ---------------------------------------------------------------------------------------------------------------
// The whole model.
// ---------------------------------------------------------------------------------------------------------------

namespace {

// A layer's input and activations as the backward needs them (KeptLayer): all of them when it is not to recompute
// them, else what the recompute does not redo.
KeptLayer keep_for_backward(Vec&& x_in, LayerActs&& a, const RunOptions& opt) {
  KeptLayer k{std::move(x_in), {}};
  if (!opt.recompute_layers) {
    k.acts = std::move(a);
    return k;
  }
  k.acts.attn.O = std::move(a.attn.O);
  k.acts.attn.lse = std::move(a.attn.lse);
  if (opt.keep_o_proj_output) k.acts.attn.ao = std::move(a.attn.ao);
  if (opt.keep_down_proj_output) k.acts.mlp.mo = std::move(a.mlp.mo);
  if (opt.keep_mlp_projections) {
    k.acts.mlp.g = std::move(a.mlp.g);
    k.acts.mlp.u = std::move(a.mlp.u);
  }
  return k;
}

// The arrays of a KeptLayer kept with recompute on (keep_for_backward), the ones RunOptions::spill_dir sends to
// disk; those a run does not keep are empty and take no room.
std::vector<Vec*> spillable(KeptLayer& k) {
  return {&k.x_in, &k.acts.attn.O, &k.acts.attn.lse, &k.acts.attn.ao, &k.acts.mlp.mo, &k.acts.mlp.g, &k.acts.mlp.u};
}

// Where a layer's kept arrays wait in the spill file, and their sizes to read them back into.
struct SpilledLayer {
  io::SpillFile::Region region;
  std::vector<int64_t> sizes;  // floats of each spillable() array
};

// Writes k's arrays to the file and frees them.
SpilledLayer spill_layer(io::SpillFile& file, KeptLayer& k) {
  SpilledLayer s;
  std::vector<std::span<const float>> parts;
  for (Vec* v : spillable(k)) {
    s.sizes.push_back(static_cast<int64_t>(v->size()));
    parts.emplace_back(v->data(), v->size());
  }
  s.region = file.write(parts);
  for (Vec* v : spillable(k)) Vec().swap(*v);
  return s;
}

// Reads a spilled layer's arrays back into k.
void read_back_layer(const io::SpillFile& file, const SpilledLayer& s, KeptLayer& k) {
  std::vector<std::span<float>> parts;
  const std::vector<Vec*> vecs = spillable(k);
  for (size_t i = 0; i < vecs.size(); ++i) {
    *vecs[i] = uninit(s.sizes[i]);
    parts.emplace_back(vecs[i]->data(), vecs[i]->size());
  }
  file.read(s.region, parts);
}

// The batch's label tokens. Every rank holds the whole batch's labels, so the global count is exact here, counted
// once, with no message. Labels on padding (doc 0) are not counted: the embedding step ignores them.
int64_t count_label_tokens(const Batch& batch) {
  int64_t n = 0;
  if (!batch.labels) return n;
  const int64_t T_row = int64_t{batch.B} * batch.S;
  for (int64_t t = 0; t < T_row; ++t)
    n += batch.labels[t] != kIgnoreLabel && (!batch.doc || batch.doc[t] != kPaddingDoc);
  return n;
}

}  // namespace

DType attention_dtype(ComputeDtype t) {
  return t == ComputeDtype::Bfloat16 && cpu::bf16_units_pay(cpu::kernel_path()) ? DType::BF16 : DType::F32;
}

int64_t Gemma4Model::bf16_weight_bytes() const { return store_->bf16_bytes(); }

Result Gemma4Model::run(const Batch& batch, const RunOptions& opt) const {
  cpu::LocalAttention local;
  return run(batch, opt, local);
}

Result Gemma4Model::run(const Batch& batch, const RunOptions& opt, AttentionBackend& attn) const {
  ParamStore& store = *store_;
  RF_CHECK(store.weights_allocated(), "run: the parameters are not allocated");
  if (opt.want_grad) store.allocate_grads();
  Run r(*this, batch, opt, store, attn);
  r.mm.dtype = opt.compute_dtype;
  if (opt.compute_dtype == ComputeDtype::Bfloat16) r.mm.weights = &store.bf16_weights();
  r.attn_dtype = attention_dtype(opt.compute_dtype);
  r.attn_round = opt.compute_dtype == ComputeDtype::Bfloat16 && r.attn_dtype == DType::F32;
  // The global group (the final norm, the projections) is read at the run's start and at its end: acquired for all
  // of it, released after the embedding's backward (or the loss, without one). Its streamed parameters are not: the
  // tables' rows come through rows() (embed), the head is acquired around the loss.
  store.before_forward(kGlobalGroup);
  r.prepare();
  r.embed();
  const int L = cfg_.num_layers;
  RF_CHECK(opt.run_layers >= 0 && opt.run_layers <= L && (opt.run_layers == 0 || !opt.want_grad),
           "run: run_layers = ", opt.run_layers, " must be in [0, ", L, "] and without gradients");
  const int64_t T = r.T, H = r.H;
  r.kv_K.assign(L, {});
  r.kv_V.assign(L, {});
  r.kv_dK.assign(L, {});
  r.kv_dV.assign(L, {});
  if (opt.want_router) {
    r.router_logits.assign(L, {});
    r.router_experts.assign(L, {});
  }
  RF_CHECK(opt.mlp_tile_tokens > 0, "run: mlp_tile_tokens = ", opt.mlp_tile_tokens, " must be positive");
  RF_CHECK(!opt.tile_mlp || !opt.keep_mlp_projections,
           "run: the tiled MLP (train.tile_mlp) keeps no gate/up projections (train.keep_mlp)");
  std::vector<KeptLayer> kept(opt.want_grad ? static_cast<size_t>(L) : 0);  // [L], for the backward
  // RunOptions::spill_dir: the file reserved for every layer's kept arrays (run_spill_bytes), and where each lies.
  std::unique_ptr<io::SpillFile> spill;
  std::vector<SpilledLayer> spilled;
  if (opt.want_grad && !opt.spill_dir.empty()) {
    RF_CHECK(opt.recompute_layers, "run: spilling the kept activations to ", opt.spill_dir,
             " needs the layers recomputed (train.spill_dir needs train.recompute: true)");
    RunMemoryArgs need;
    need.tokens = T;
    need.training = true;
    need.keep_mlp_projections = opt.keep_mlp_projections;
    need.keep_o_proj_output = opt.keep_o_proj_output;
    need.keep_down_proj_output = opt.keep_down_proj_output;
    need.spill = true;
    spill = std::make_unique<io::SpillFile>(opt.spill_dir, run_spill_bytes(*this, need));
    spilled.resize(static_cast<size_t>(L));
  }

  Vec x = copy_of(r.h0);
  Vec next = uninit(T * H);  // layer_forward writes all of it
  for (int l = 0; l < (opt.run_layers > 0 ? opt.run_layers : L); ++l) {
    LayerActs a;
    store.before_forward(l);
    // A stopped run's last layer feeds nothing after it: of it only the K/V it hands the seam are wanted (the
    // prefill then skips that layer's query, attention, o_proj and feed-forward).
    if (l == opt.run_layers - 1) {
      r.attention_keys_forward(l, x.data(), a.attn);
      store.after_forward(l);
      break;
    }
    r.layer_forward(l, x.data(), next.data(), a, false);
    store.after_forward(l);
    if (opt.want_grad) kept[l] = keep_for_backward(std::move(x), std::move(a), opt);
    if (spill) spilled[l] = spill_layer(*spill, kept[l]);
    x = std::move(next);
    next = uninit(T * H);
  }
  if (opt.run_layers > 0) {
    Result res;
    res.shard = r.shard;
    store.after_forward(kGlobalGroup);
    return res;
  }

  // Final norm, then the fused chunked head + softcap + cross-entropy (its backward runs in the same pass).
  Vec xf = uninit(T * H), r_final = uninit(T);
  rmsnorm_forward(x.data(), r.W(final_norm_), r.eps, xf.data(), r_final.data(), T, H);
  Result res;
  res.router_logits = std::move(r.router_logits);
  res.router_experts = std::move(r.router_experts);
  const int64_t label_tokens = count_label_tokens(batch);
  res.label_tokens = label_tokens;
  const double normalizer = opt.loss_normalizer > 0 ? opt.loss_normalizer : static_cast<double>(label_tokens);
  res.token_loss.assign(static_cast<size_t>(T), 0.f);
  if (opt.want_logits) res.logits.assign(static_cast<size_t>(T * cfg_.vocab_size), 0.f);
  Vec dxf = opt.want_grad ? zeros(T * H) : Vec{};
  LmHeadLossArgs la;
  la.x = xf.data();
  la.matmul = r.mm;
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
  }
  // This rank's tokens' share of the loss, then the sum over the ranks (in rank order: the same bits everywhere).
  // The head is acquired for the loss alone (la.W and lo.dW are read after acquire_head). A head held in another
  // dtype than float32 (a LoRA base's, frozen) goes to the loss as it is held, read there by panels (loss.h).
  store.acquire_head(lm_head_);
  const HeldWeight held_head = store.held_weight(lm_head_);
  if (held_head.dtype == HeldDType::F32) {
    la.W = r.W(lm_head_);
  } else {
    store.progress();  // what r.W does besides reading the weight: the store's posted transfers advance
    la.head = held_head;
  }
  if (opt.want_grad) lo.dW = r.G(lm_head_);
  res.loss = lm_head_loss(la, lo);
  store.release_head(lm_head_);
  attn.sum_over_ranks(&res.loss, 1);
  res.shard = r.shard;
  if (!opt.want_grad) {
    store.after_forward(kGlobalGroup);
    return res;
  }
  res.kept_activation_bytes = bytes_of({&r.h0, &r.ple, &r.ple_raw, &r.ple_rms});
  for (int l = 0; l < L; ++l) res.kept_activation_bytes += kept[l].bytes() + r.kv_K[l].bytes() + r.kv_V[l].bytes();
  if (spill) res.spilled_bytes = spill->used();

  // Backward, one layer at a time: recompute the layer's activations from its kept input (attention output and
  // LSE are kept, so attention itself is not recomputed, and so are the o_proj and down_proj outputs, so their
  // sgemms are not either), or take them as the forward kept them when opt.recompute_layers is off, then
  // differentiate it.
  Vec dx = zeros(T * H);
  rmsnorm_backward(x.data(), r.W(final_norm_), r_final.data(), dxf.data(), dx.data(), r.G(final_norm_), T, H);
  // Read for the last time: three [T, H] fewer through the whole backward (the memory model counts them gone).
  for (Vec* done : {&x, &xf, &dxf, &r_final}) Vec().swap(*done);
  if (cfg_.ple_dim > 0) r.dple = zeros(T * int64_t{L} * cfg_.ple_dim);
  for (int l = 0; l < L; ++l) {
    if (specs_[l].stores_kv) {
      r.kv_dK[l] = zeros(r.kv_K[l].size());
      r.kv_dV[l] = zeros(r.kv_V[l].size());
    }
  }
  Vec dprev = zeros(T * H);
  for (int l = L - 1; l >= 0; --l) {
    store.before_backward(l);
    if (spill) {
      read_back_layer(*spill, spilled[l], kept[l]);
      if (l > 0)
        spill->prefetch(spilled[l - 1].region);  // read ahead while this layer is recomputed and differentiated
    }
    LayerActs a = std::move(kept[l].acts);
    if (opt.recompute_layers) {
      // The products handed back are counted among the kept activations already.
      const int64_t handed = bytes_of({&a.attn.ao, &a.mlp.mo, &a.mlp.g, &a.mlp.u});
      r.layer_forward(l, kept[l].x_in.data(), next.data(), a, true);
      res.layer_recompute_bytes = std::max(res.layer_recompute_bytes, a.bytes() - handed);
    }
    r.layer_backward(l, a, kept[l].x_in.data(), dx.data(), dprev.data());
    store.after_backward(l);
    std::swap(dx, dprev);
    kept[l] = KeptLayer{};
  }
  r.embed_backward(dx.data());
  store.after_backward(kGlobalGroup);
  res.d_image_features.assign(r.d_image_features.begin(), r.d_image_features.end());
  return res;
}

}  // namespace rf::model
