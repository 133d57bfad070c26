// ringflex model: Gemma 4's vision encoder forward (see vision_encoder.h).
#include "model/vision_encoder.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/attention_args.h"
#include "core/error.h"
#include "core/memory.h"
#include "cpu/attention.h"
#include "io/tensor_access.h"
#include "model/elementwise.h"
#include "model/matmul_bf16.h"
#include "model/ops.h"

namespace rf::model {

namespace {

constexpr int64_t kChannels = 3;  // RGB: a patch is 3 * patch_size^2 values
constexpr int kAxes = 2;          // (x, y): the position table's and the rotary embedding's two axes
constexpr int32_t kPaddingPosition = -1;
// Channels one thread pools over every patch of an image: 64 floats, one cache line's worth four times over.
constexpr int64_t kPoolChannels = 64;

}  // namespace

// The encoder's own float32 weights (read from a checkpoint's tensors), their bf16 copies (set_compute_dtype), and
// with a VisionGrads to fill (backward's owned form) the gradients there. No hooks: everything is always here.
class VisionEncoder::OwnedParams final : public TowerParams {
 public:
  void begin(int, bool) override {}
  void end(int, bool) override {}
  const float* weight(const std::string& name) override { return values.at(name).data(); }
  float* grad(const std::string& name) override {
    if (sink == nullptr) return nullptr;
    std::vector<float>& g = (*sink)[name];
    const size_t count = values.at(name).size();
    if (g.empty()) g.assign(count, 0.f);
    RF_CHECK(g.size() == count, "vision tower: gradient `", name, "` has ", g.size(), " elements, the tensor ", count);
    return g.data();
  }
  const Bf16Lookup* bf16() override { return &copies; }

  std::map<std::string, std::vector<float>> values;  // full name -> [numel]
  Bf16Copies copies;                                 // the matmul operands' (set_compute_dtype Bfloat16)
  VisionGrads* sink = nullptr;                       // backward's, while it runs
};

std::vector<float> VisionEncoder::take(const Lookup& find, const std::string& name,
                                       const std::vector<int64_t>& shape) const {
  const std::string full = kVisionTowerPrefix + name;
  std::optional<Found> f = find(full);
  RF_CHECK(f.has_value(), "vision tower: no tensor `", full, "` in the checkpoint");
  RF_CHECK(f->shape == shape, "vision tower: tensor `", full, "` has shape ", io::shape_string(f->shape),
           ", the vision_config implies ", io::shape_string(shape));
  return std::move(f->values);
}

VisionEncoder::Linear VisionEncoder::take_bounds(const Lookup& tensors, const std::string& name, int64_t in,
                                                 int64_t out) const {
  Linear l;
  l.n = out * in;
  l.name = kVisionTowerPrefix + name + ".linear.weight";
  const float inf = std::numeric_limits<float>::infinity();
  l.in_min = -inf, l.in_max = inf, l.out_min = -inf, l.out_max = inf;
  if (cfg_.use_clipped_linears) {
    l.in_min = take(tensors, name + ".input_min", {})[0];
    l.in_max = take(tensors, name + ".input_max", {})[0];
    l.out_min = take(tensors, name + ".output_min", {})[0];
    l.out_max = take(tensors, name + ".output_max", {})[0];
  }
  return l;
}

VisionEncoder::VisionEncoder(VisionConfig c, const io::Passthrough& kept)
    : VisionEncoder(std::move(c), [&](const std::string& name) -> std::optional<Found> {
        const io::Passthrough::Entry* e = kept.find(name);
        if (e == nullptr) return std::nullopt;
        return Found{e->shape, io::to_float32(io::TensorView{name, e->dtype, e->shape, e->bytes})};
      }) {}

VisionEncoder::VisionEncoder(VisionConfig c, const Lookup& tensors) : cfg_(std::move(c)) {
  owned_ = std::make_unique<OwnedParams>();
  for (const TowerTensor& t : vision_tower_tensors(cfg_))
    if (t.parameter) owned_->values[kVisionTowerPrefix + t.name] = take(tensors, t.name, t.shape);
  params_ = owned_.get();
  read_buffers(tensors);
}

VisionEncoder::VisionEncoder(VisionConfig c, const Lookup& buffers, TowerParams& params) : cfg_(std::move(c)) {
  params_ = &params;
  read_buffers(buffers);
}

VisionEncoder::~VisionEncoder() = default;
VisionEncoder::VisionEncoder(VisionEncoder&&) noexcept = default;
VisionEncoder& VisionEncoder::operator=(VisionEncoder&&) noexcept = default;

void VisionEncoder::read_buffers(const Lookup& tensors) {
  const int64_t H = cfg_.hidden_size, D = cfg_.head_dim, I = cfg_.intermediate_size;
  // The 2-D rotary embedding rotates each half of a head by one axis, in pairs (i, i + D/4) within the half.
  RF_CHECK(D % (2 * kAxes) == 0, "vision tower: head_dim = ", D, " must be a multiple of 4 (2-D rotary embedding)");
  RF_CHECK(cfg_.num_heads % cfg_.num_kv_heads == 0, "vision tower: num_attention_heads = ", cfg_.num_heads,
           " is not a multiple of num_key_value_heads = ", cfg_.num_kv_heads);
  for (int l = 0; l < cfg_.num_layers; ++l) {
    const std::string p = "encoder.layers." + std::to_string(l) + ".";
    Layer layer;
    layer.prefix = kVisionTowerPrefix + p;
    layer.q = take_bounds(tensors, p + "self_attn.q_proj", H, cfg_.num_heads * D);
    layer.k = take_bounds(tensors, p + "self_attn.k_proj", H, cfg_.num_kv_heads * D);
    layer.v = take_bounds(tensors, p + "self_attn.v_proj", H, cfg_.num_kv_heads * D);
    layer.o = take_bounds(tensors, p + "self_attn.o_proj", cfg_.num_heads * D, H);
    layer.gate = take_bounds(tensors, p + "mlp.gate_proj", H, I);
    layer.up = take_bounds(tensors, p + "mlp.up_proj", H, I);
    layer.down = take_bounds(tensors, p + "mlp.down_proj", I, H);
    layers_.push_back(std::move(layer));
  }
  if (cfg_.standardize) {
    std_bias_ = take(tensors, "std_bias", {H});
    std_scale_ = take(tensors, "std_scale", {H});
  }
  // As Gemma4VisionRotaryEmbedding builds them, in float32: 1 / theta^(2i / (D/2)) for i < D/4.
  const int64_t spatial = D / kAxes;
  for (int64_t i = 0; i < spatial; i += 2)
    inv_freq_.push_back(
        1.f / std::pow(static_cast<float>(cfg_.rope_theta), static_cast<float>(i) / static_cast<float>(spatial)));
}

VisionEncoder::Layer VisionEncoder::layer_view(int l) const {
  Layer L = layers_[static_cast<size_t>(l)];
  const auto w = [&](const char* name) { return params_->weight(L.prefix + name); };
  L.input_norm = w("input_layernorm.weight");
  L.post_attention_norm = w("post_attention_layernorm.weight");
  L.pre_feedforward_norm = w("pre_feedforward_layernorm.weight");
  L.post_feedforward_norm = w("post_feedforward_layernorm.weight");
  L.q_norm = w("self_attn.q_norm.weight");
  L.k_norm = w("self_attn.k_norm.weight");
  for (Linear* lin : {&L.q, &L.k, &L.v, &L.o, &L.gate, &L.up, &L.down}) lin->w = params_->weight(lin->name);
  return L;
}

namespace {
const std::string kInputProj = std::string(kVisionTowerPrefix) + "patch_embedder.input_proj.weight";
const std::string kPositionTable = std::string(kVisionTowerPrefix) + "patch_embedder.position_embedding_table";
}  // namespace

void VisionEncoder::set_compute_dtype(ComputeDtype t) {
  dtype_ = t;
  if (!owned_) return;  // the TowerParams' copies
  owned_->copies.clear();
  if (t != ComputeDtype::Bfloat16) return;
  for (const TowerTensor& tensor : vision_tower_tensors(cfg_)) {
    if (!tensor.matmul) continue;
    const std::vector<float>& w = owned_->values.at(kVisionTowerPrefix + tensor.name);
    owned_->copies.add(w.data(), static_cast<int64_t>(w.size()));
  }
}

Matmul VisionEncoder::matmul() const {
  return Matmul{dtype_, dtype_ == ComputeDtype::Bfloat16 ? params_->bf16() : nullptr};
}

namespace {

// y[0, n) = clamp(x[0, n), lo, hi) (y may be x).
void clamp_into(const float* x, float* y, int64_t n, float lo, float hi) {
#pragma omp parallel for schedule(static) if (n >= kParallelMinElements)
  for (int64_t i = 0; i < n; ++i) y[i] = std::clamp(x[i], lo, hi);
}

}  // namespace

bool VisionEncoder::widen_on_sgemm() const { return dtype_ == ComputeDtype::Bfloat16 && !bf16_matmul_on_onednn(); }

const float* VisionEncoder::rounded(const float* x, int64_t n, Widened& wide) const {
  if (!widen_on_sgemm()) return x;
  wide.x.resize(static_cast<size_t>(n));
  float* r = wide.x.data();
#pragma omp parallel for schedule(static) if (n >= kParallelMinElements)
  for (int64_t i = 0; i < n; ++i) r[i] = bf16_to_float(float_to_bf16(x[i]));
  return r;
}

void VisionEncoder::project(const Matmul& mm, const float* x, const float* W, int64_t n, float* y, int64_t T, int64_t P,
                            int64_t in, int64_t out, Widened& wide) const {
  // One matmul per image: an image's rows then meet the same calls whatever shares its batch (a rank's share of a
  // split batch, or the whole), and sgemm kernels that sum a row by its place in the call (model/ops.h) give its
  // soft tokens the same bits either way.
  const auto per_image = [&](const Matmul& m, const float* w) {
    for (int64_t t0 = 0; t0 < T; t0 += P) linear_forward(m, x + t0 * in, w, y + t0 * out, std::min(P, T - t0), in, out);
  };
  if (!widen_on_sgemm()) {
    per_image(mm, W);
    return;
  }
  const Bf16Lookup* copies = matmul().weights;  // the weights' own (mm may be a SharedOperands' lookup)
  const bf16* copy = copies != nullptr ? copies->find(W, n) : nullptr;
  RF_CHECK(copy != nullptr, "vision tower: a weight without its bf16 copy (set_compute_dtype on another encoder?)");
  wide.w.resize(static_cast<size_t>(n));
  float* w = wide.w.data();
#pragma omp parallel for schedule(static) if (n >= kParallelMinElements)
  for (int64_t i = 0; i < n; ++i) w[i] = bf16_to_float(copy[i]);
  // The products of bf16 values are exact in float32: sgemm on them is the bf16 mode's arithmetic (ops.h).
  per_image(Matmul{}, w);
}

void VisionEncoder::clipped_linear(const Matmul& mm, const Linear& l, const float* x, float* y, int64_t T, int64_t P,
                                   int64_t in, int64_t out, VisionTape::LinearTape& tape, bool keep, Widened& wide,
                                   const float* x_rounded) const {
  if (!cfg_.use_clipped_linears) {
    project(mm, x_rounded ? x_rounded : rounded(x, T * in, wide), l.w, l.n, y, T, P, in, out, wide);
    return;
  }
  tape.x.resize(static_cast<size_t>(T * in));
  clamp_into(x, tape.x.data(), T * in, l.in_min, l.in_max);
  project(mm, rounded(tape.x.data(), T * in, wide), l.w, l.n, y, T, P, in, out, wide);
  if (keep) tape.y.assign(y, y + T * out);
  clamp_into(y, y, T * out, l.out_min, l.out_max);
}

void VisionEncoder::clipped_linear_backward(const Linear& l, const float* x, const VisionTape::LinearTape& tape,
                                            const float* dy, float* dx, float* dW, int64_t T, int64_t in,
                                            int64_t out) const {
  const Matmul mm = matmul();
  if (!cfg_.use_clipped_linears) {
    linear_backward(mm, x, l.w, dy, dx, dW, T, in, out);
    return;
  }
  // torch.clamp passes the gradient where min <= value <= max, and none outside.
  std::vector<float> dy_in(dy, dy + T * out);
#pragma omp parallel for schedule(static) if (T * out >= kParallelMinElements)
  for (int64_t i = 0; i < T * out; ++i)
    if (!(tape.y[i] >= l.out_min && tape.y[i] <= l.out_max)) dy_in[i] = 0.f;
  std::vector<float> dx_in(static_cast<size_t>(T * in), 0.f);
  linear_backward(mm, tape.x.data(), l.w, dy_in.data(), dx_in.data(), dW, T, in, out);
#pragma omp parallel for schedule(static) if (T * in >= kParallelMinElements)
  for (int64_t i = 0; i < T * in; ++i)
    if (x[i] >= l.in_min && x[i] <= l.in_max) dx[i] += dx_in[i];
}

namespace {

// [n, P, heads, D] token-major <-> [n, heads, P, D] head-major (the attention kernels' layout), y written.
void to_heads_into(const float* x, float* y, int n, int64_t P, int heads, int64_t D) {
  const int64_t T = int64_t{n} * P;
#pragma omp parallel for schedule(static) if (T * heads * D >= kParallelMinElements)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t img = t / P, p = t % P;
    for (int hd = 0; hd < heads; ++hd) std::copy_n(x + (t * heads + hd) * D, D, y + ((img * heads + hd) * P + p) * D);
  }
}
void to_tokens_into(const float* x, float* y, int n, int64_t P, int heads, int64_t D) {
  const int64_t T = int64_t{n} * P;
#pragma omp parallel for schedule(static) if (T * heads * D >= kParallelMinElements)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t img = t / P, p = t % P;
    for (int hd = 0; hd < heads; ++hd) std::copy_n(x + ((img * heads + hd) * P + p) * D, D, y + (t * heads + hd) * D);
  }
}

// One head's row v[D]: each half a rotated by axis a's angle (cos, sin: [2, D/4] of its token), pairs (i, i + D/4)
// within the half; `inverse` rotates back (the backward of a rotation is its transpose).
void rotate_row(float* v, const float* cos, const float* sin, int64_t D, bool inverse) {
  const int64_t quarter = D / (2 * kAxes);
  for (int a = 0; a < kAxes; ++a) {
    float* part = v + a * 2 * quarter;
    for (int64_t i = 0; i < quarter; ++i) {
      const float c = cos[a * quarter + i];
      const float s = inverse ? -sin[a * quarter + i] : sin[a * quarter + i];
      const float x1 = part[i], x2 = part[i + quarter];
      part[i] = x1 * c - x2 * s;
      part[i + quarter] = x2 * c + x1 * s;
    }
  }
}

// In place on x[T, heads, D]: rotate_row on every head of every token (the tables: [T, 2, D/4]).
void rope_2d(std::vector<float>& x, const std::vector<float>& cosv, const std::vector<float>& sinv, int64_t T,
             int heads, int64_t D, bool inverse) {
  const int64_t table = kAxes * (D / (2 * kAxes));  // one token's entries of a table
#pragma omp parallel for schedule(static) if (T * heads * D >= kParallelMinElements)
  for (int64_t t = 0; t < T; ++t)
    for (int hd = 0; hd < heads; ++hd)
      rotate_row(x.data() + (t * heads + hd) * D, cosv.data() + t * table, sinv.data() + t * table, D, inverse);
}

// The per-head RMSNorm of q, k or v and (with tables) the 2-D rotation, in one pass that also moves each row to the
// attention kernels' layout: x[n * P, heads, D] token-major in, y[n, heads, P, D] head-major out, inv_rms[n * P *
// heads] (token-major, as rmsnorm_forward over the T * heads rows leaves it). w null: no scale; cos/sin null: no
// rotation; `round`: store bf16-rounded values (the bf16 mode's attention operands). The same bits as rmsnorm_forward,
// rope_2d and to_heads one after the other.
void norm_rope_to_heads(const float* x, const float* w, float eps, const float* cos, const float* sin, int n, int64_t P,
                        int heads, int64_t D, float* inv_rms, float* y, bool round) {
  RF_CHECK(D <= kMaxHeadDim, "vision tower: head_dim = ", D, " is above the attention kernels' ", kMaxHeadDim);
  const ElementwiseKernels& k = elementwise();
  const int64_t T = int64_t{n} * P, table = kAxes * (D / (2 * kAxes));
#pragma omp parallel for schedule(static) if (T * heads * D >= kParallelMinElements)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t img = t / P, p = t % P;
    for (int hd = 0; hd < heads; ++hd) {
      const int64_t r = t * heads + hd;
      float* out = y + ((img * heads + hd) * P + p) * D;
      const float inv = 1.f / std::sqrt(k.sum_squares(x + r * D, D) / static_cast<float>(D) + eps);
      inv_rms[r] = inv;
      k.scale_row(x + r * D, w, inv, out, D);
      if (cos) rotate_row(out, cos + t * table, sin + t * table, D, false);
      if (round)
        for (int64_t i = 0; i < D; ++i) out[i] = bf16_to_float(float_to_bf16(out[i]));
    }
  }
}

// h[R, n] += rmsnorm(x[R, n]) * w, inv_rms[R]: a post-norm and its residual add in one pass over the rows (the same
// bits as rmsnorm_forward into a buffer, then the add).
void norm_add(const float* x, const float* w, float eps, float* inv_rms, float* h, int64_t R, int64_t n) {
  const ElementwiseKernels& k = elementwise();
#pragma omp parallel if (R * n >= kParallelMinElements)
  {
    std::vector<float> row(static_cast<size_t>(n));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < R; ++r) {
      const float inv = 1.f / std::sqrt(k.sum_squares(x + r * n, n) / static_cast<float>(n) + eps);
      inv_rms[r] = inv;
      k.scale_row(x + r * n, w, inv, row.data(), n);
      for (int64_t i = 0; i < n; ++i) h[r * n + i] += row[i];
    }
  }
}

}  // namespace

void VisionEncoder::check(const VisionBatch& b, const std::string& source) const {
  const int64_t k = cfg_.pooling_kernel_size, P = b.P;
  RF_CHECK(b.n > 0 && P > 0 && b.pixels && b.positions, source, ": a vision batch needs n > 0 images of P > 0 patches");
  RF_CHECK(P % (k * k) == 0, source, ": ", P, " patches per image cannot pool to soft tokens: not a multiple of ",
           "pooling_kernel_size^2 = ", k * k);
  RF_CHECK(P <= std::numeric_limits<int32_t>::max(), source, ": ", P, " patches per image is too many");
  // Everything forward indexes with: each position in the table, or the padding.
  for (int64_t t = 0; t < int64_t{b.n} * P; ++t) {
    const int32_t x = b.positions[2 * t], y = b.positions[2 * t + 1];
    const bool pad = x == kPaddingPosition && y == kPaddingPosition;
    RF_CHECK(pad || (x >= 0 && y >= 0 && x < cfg_.position_embedding_size && y < cfg_.position_embedding_size), source,
             ": image ", t / P, " patch ", t % P, " has position (", x, ", ", y, "), outside [0, ",
             cfg_.position_embedding_size, ") (position_embedding_size), and not the padding (-1, -1)");
  }
  for (int img = 0; img < b.n; ++img)
    for (int64_t cell : pool_cells(b, img))
      RF_CHECK(P == P / (k * k) || cell < P / (k * k), source, ": image ", img, " pools into cell ", cell, " of ",
               P / (k * k), ": its grid holds more patches than its ", P, " slots");
}

namespace {

// The tower's attention over a batch of n images of P patches: within each image, over its valid patches (meta: the
// tape's, doc 1 for a valid patch, 0 for padding).
AttnChunk tower_chunk(const VisionConfig& c, const TokenMeta* meta, int n, int64_t P) {
  AttnChunk chunk;
  chunk.shape = AttnShape{n, c.num_heads, c.num_kv_heads, static_cast<int>(P), static_cast<int>(P), c.head_dim};
  chunk.dtype = DType::F32;
  chunk.q_meta = chunk.k_meta = meta;
  chunk.mask = LayerMask{false, 0, false};
  chunk.scale = 1.f;  // Gemma4VisionAttention.scaling: q and k are RMS-normalised per head instead
  return chunk;
}

}  // namespace

void VisionEncoder::layer_forward(const Layer& L, const VisionTape& tape, int n, int64_t P, std::vector<float>& h,
                                  VisionTape::Layer& S, bool keep, Widened& wide) const {
  const int64_t H = cfg_.hidden_size, D = cfg_.head_dim, I = cfg_.intermediate_size, T = int64_t{n} * P;
  const int Hq = cfg_.num_heads, Hkv = cfg_.num_kv_heads;
  const Matmul mm = matmul();
  const bool bf16 = dtype_ == ComputeDtype::Bfloat16;
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  AttnChunk chunk = tower_chunk(cfg_, tape.meta.data(), n, P);
  // Each buffer is sized once: a reused S (no tape) keeps its size from layer to layer, so no allocation and no page
  // faults after the first layer.
  const auto fit = [](std::vector<float>& v, int64_t count) { v.resize(static_cast<size_t>(count)); };
  if (keep) S.h_in = h;
  // 2a. Attention.
  fit(S.a, T * H), fit(S.inv_in, T);
  rmsnorm_forward(h.data(), L.input_norm, eps, S.a.data(), S.inv_in.data(), T, H);
  fit(S.q_raw, T * Hq * D), fit(S.k_raw, T * Hkv * D), fit(S.v_raw, T * Hkv * D);
  {
    // Without clipping q, k and v multiply the same input: rounded to bf16 once for the three (bf16 mode).
    SharedOperands shared(mm);
    const float* a = nullptr;
    if (!cfg_.use_clipped_linears) {
      if (!widen_on_sgemm()) shared.add(S.a.data(), T * H);  // for oneDNN's bf16 matmul
      a = rounded(S.a.data(), T * H, wide);
    }
    const Matmul m = shared.matmul();
    clipped_linear(m, L.q, S.a.data(), S.q_raw.data(), T, P, H, Hq * D, S.q, keep, wide, a);
    clipped_linear(m, L.k, S.a.data(), S.k_raw.data(), T, P, H, Hkv * D, S.k, keep, wide, a);
    clipped_linear(m, L.v, S.a.data(), S.v_raw.data(), T, P, H, Hkv * D, S.v, keep, wide, a);
  }
  fit(S.qh, T * Hq * D), fit(S.kh, T * Hkv * D), fit(S.vh, T * Hkv * D);
  fit(S.inv_q, T * Hq), fit(S.inv_k, T * Hkv), fit(S.inv_v, T * Hkv);
  norm_rope_to_heads(S.q_raw.data(), L.q_norm, eps, tape.cos.data(), tape.sin.data(), n, P, Hq, D, S.inv_q.data(),
                     S.qh.data(), bf16);
  norm_rope_to_heads(S.k_raw.data(), L.k_norm, eps, tape.cos.data(), tape.sin.data(), n, P, Hkv, D, S.inv_k.data(),
                     S.kh.data(), bf16);
  norm_rope_to_heads(S.v_raw.data(), nullptr, eps, nullptr, nullptr, n, P, Hkv, D, S.inv_v.data(), S.vh.data(), bf16);
  chunk.q = S.qh.data();
  chunk.k = S.kh.data();
  chunk.v = S.vh.data();
  validate(chunk);
  fit(S.out, T * Hq * D), fit(S.lse, T * Hq);
  cpu::attention_forward(chunk, S.out.data(), S.lse.data());
  fit(S.o_tok, T * Hq * D);
  to_tokens_into(S.out.data(), S.o_tok.data(), n, P, Hq, D);
  fit(S.attn, T * H), fit(S.inv_attn, T);
  clipped_linear(mm, L.o, S.o_tok.data(), S.attn.data(), T, P, Hq * D, H, S.o, keep, wide);
  norm_add(S.attn.data(), L.post_attention_norm, eps, S.inv_attn.data(), h.data(), T, H);
  // 2b. MLP.
  if (keep) S.h_mid = h;
  fit(S.m, T * H), fit(S.inv_mid, T);
  rmsnorm_forward(h.data(), L.pre_feedforward_norm, eps, S.m.data(), S.inv_mid.data(), T, H);
  fit(S.g, T * I), fit(S.u, T * I), fit(S.gu, T * I);
  {
    SharedOperands shared(mm);  // gate and up multiply the same input, as q, k and v above
    const float* m_in = nullptr;
    if (!cfg_.use_clipped_linears) {
      if (!widen_on_sgemm()) shared.add(S.m.data(), T * H);  // for oneDNN's bf16 matmul
      m_in = rounded(S.m.data(), T * H, wide);
    }
    const Matmul m = shared.matmul();
    clipped_linear(m, L.gate, S.m.data(), S.g.data(), T, P, H, I, S.gate, keep, wide, m_in);
    clipped_linear(m, L.up, S.m.data(), S.u.data(), T, P, H, I, S.up, keep, wide, m_in);
  }
  geglu_forward(S.g.data(), S.u.data(), S.gu.data(), T * I);
  fit(S.ff, T * H), fit(S.inv_ff, T);
  clipped_linear(mm, L.down, S.gu.data(), S.ff.data(), T, P, I, H, S.down, keep, wide);
  norm_add(S.ff.data(), L.post_feedforward_norm, eps, S.inv_ff.data(), h.data(), T, H);
}

VisionOutput VisionEncoder::forward(const VisionBatch& b, const std::string& source, VisionTape* keep,
                                    bool recompute_layers) const {
  const int64_t H = cfg_.hidden_size, D = cfg_.head_dim, P = b.P;
  const int n = b.n;
  const int64_t k = cfg_.pooling_kernel_size, patch_values = kChannels * cfg_.patch_size * cfg_.patch_size;
  check(b, source);
  const int64_t T = int64_t{n} * P;
  const int64_t length = P / (k * k);  // soft tokens an image of P patches pools to (Gemma4VisionModel's output_length)
  const Matmul mm = matmul();
  VisionTape local;
  VisionTape& tape = keep ? *keep : local;
  tape = VisionTape{};
  tape.recompute_layers = keep != nullptr && recompute_layers;
  tape.pad.assign(static_cast<size_t>(T), false);
  for (int64_t t = 0; t < T; ++t)
    tape.pad[t] = b.positions[2 * t] == kPaddingPosition && b.positions[2 * t + 1] == kPaddingPosition;
  const std::vector<bool>& pad = tape.pad;

  // 1. Patch embedding.
  std::vector<float> h(static_cast<size_t>(T * H));
  tape.scaled.resize(static_cast<size_t>(T * patch_values));
#pragma omp parallel for schedule(static) if (T * patch_values >= kParallelMinElements)
  for (int64_t i = 0; i < T * patch_values; ++i) tape.scaled[i] = 2.f * (b.pixels[i] - 0.5f);
  Widened wide;
  params_->begin(0, false);
  const float* pos_table = params_->weight(kPositionTable);
  project(mm, rounded(tape.scaled.data(), T * patch_values, wide), params_->weight(kInputProj), H * patch_values,
          h.data(), T, P, patch_values, H, wide);
  const int64_t table = int64_t{cfg_.position_embedding_size} * H;  // one axis of the position table
#pragma omp parallel for schedule(static) if (T * H >= kParallelMinElements)
  for (int64_t t = 0; t < T; ++t) {
    if (pad[t]) continue;
    const float* ex = pos_table + int64_t{b.positions[2 * t]} * H;
    const float* ey = pos_table + table + int64_t{b.positions[2 * t + 1]} * H;
    for (int64_t c = 0; c < H; ++c) h[t * H + c] += ex[c] + ey[c];
  }
  params_->end(0, false);

  // The rotary angles of each token and axis: [T, 2, D/4] cos and sin, in float32 as transformers computes them.
  const int64_t quarter = D / (2 * kAxes);
  tape.cos.resize(static_cast<size_t>(T * kAxes * quarter));
  tape.sin.resize(tape.cos.size());
#pragma omp parallel for schedule(static) if (T * kAxes * quarter >= kParallelMinElements)
  for (int64_t t = 0; t < T; ++t)
    for (int a = 0; a < kAxes; ++a)
      for (int64_t i = 0; i < quarter; ++i) {
        const float angle = static_cast<float>(b.positions[2 * t + a]) * inv_freq_[i];
        tape.cos[(t * kAxes + a) * quarter + i] = std::cos(angle);
        tape.sin[(t * kAxes + a) * quarter + i] = std::sin(angle);
      }

  // Attention within each image over its valid patches: one row per image, doc 1 for a valid patch, 0 for padding
  // (a padding query sees nothing and gets 0; its output never reaches a soft token).
  tape.meta.resize(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t)
    tape.meta[t] = TokenMeta{static_cast<int32_t>(t % P), pad[t] ? kPaddingDoc : 1, kNoGroup};

  // 2. The layers. Without a tape, or keeping layer inputs only, one scratch set of buffers serves every layer; a
  // tape that keeps everything gets each layer's own.
  const bool keep_all = keep != nullptr && !recompute_layers;
  VisionTape::Layer scratch;
  if (keep) tape.layers.reserve(layers_.size());
  for (int l = 0; l < static_cast<int>(layers_.size()); ++l) {
    params_->begin(1 + l, false);
    if (tape.recompute_layers) tape.layers.emplace_back().h_in = h;
    layer_forward(layer_view(l), tape, n, P, h, keep_all ? tape.layers.emplace_back() : scratch, keep_all, wide);
    params_->end(1 + l, false);
  }

  // 3. Pooling per image, the scale and standardize.
  VisionOutput r;
  const float root = static_cast<float>(std::sqrt(static_cast<double>(H)));
  std::vector<float> pooled(static_cast<size_t>(length * H));
  std::vector<bool> used(static_cast<size_t>(length));
  for (int img = 0; img < n; ++img) {
    const int64_t base = int64_t{img} * P;
    std::fill(pooled.begin(), pooled.end(), 0.f);
    std::fill(used.begin(), used.end(), false);
    if (P == length) {  // nothing to pool: the valid patches themselves
      for (int64_t p = 0; p < P; ++p) {
        if (pad[base + p]) continue;
        used[p] = true;
        std::copy_n(h.data() + (base + p) * H, H, pooled.data() + p * H);
      }
    } else {
      const float weight = 1.f / static_cast<float>(k * k);
      const std::vector<int64_t> cells = pool_cells(b, img);
      for (int64_t p = 0; p < P; ++p) {
        RF_CHECK(cells[p] < length, source, ": image ", img, " patch ", p, " pools into cell ", cells[p], " of ",
                 length, ": the image's grid holds more patches than its ", P, " slots");
        used[cells[p]] = true;
      }
      // Each thread sums its own channels over every patch in patch order: the same bits for any thread count.
      const int64_t blocks = (H + kPoolChannels - 1) / kPoolChannels;
#pragma omp parallel for schedule(static) if (P * H >= kParallelMinElements)
      for (int64_t blk = 0; blk < blocks; ++blk) {
        const int64_t c0 = blk * kPoolChannels, c1 = std::min(H, c0 + kPoolChannels);
        for (int64_t p = 0; p < P; ++p) {
          if (pad[base + p]) continue;
          float* cell = pooled.data() + cells[p] * H;
          const float* x = h.data() + (base + p) * H;
          for (int64_t c = c0; c < c1; ++c) cell[c] += weight * x[c];
        }
      }
    }
    int64_t count = 0;
    for (int64_t cell = 0; cell < length; ++cell) {
      if (!used[cell]) continue;
      ++count;
      tape.cells.push_back(cell);
      for (int64_t c = 0; c < H; ++c) {
        float x = pooled[cell * H + c] * root;
        if (cfg_.standardize) x = (x - std_bias_[c]) * std_scale_[c];
        r.soft_tokens.push_back(x);
      }
    }
    r.counts.push_back(count);
  }
  tape.counts = r.counts;
  return r;
}

namespace {

// The float buffers of one tape layer (Layer's members, in its order).
std::vector<const std::vector<float>*> layer_buffers(const VisionTape::Layer& S) {
  std::vector<const std::vector<float>*> all = {&S.h_in, &S.a, &S.inv_in};
  for (const VisionTape::LinearTape* l : {&S.q, &S.k, &S.v, &S.o, &S.gate, &S.up, &S.down}) {
    all.push_back(&l->x);
    all.push_back(&l->y);
  }
  for (const std::vector<float>* v :
       {&S.q_raw, &S.k_raw, &S.v_raw,    &S.inv_q, &S.inv_k, &S.inv_v,   &S.qh, &S.kh, &S.vh, &S.out, &S.lse,
        &S.o_tok, &S.attn,  &S.inv_attn, &S.h_mid, &S.m,     &S.inv_mid, &S.g,  &S.u,  &S.gu, &S.ff,  &S.inv_ff})
    all.push_back(v);
  return all;
}

constexpr int64_t kF32 = sizeof(float);
constexpr int64_t kBitsPerByte = 8;  // std::vector<bool> packs its flags

}  // namespace

int64_t VisionTape::bytes() const {
  int64_t floats = static_cast<int64_t>(scaled.size() + cos.size() + sin.size());
  for (const Layer& S : layers)
    for (const std::vector<float>* v : layer_buffers(S)) floats += static_cast<int64_t>(v->size());
  return floats * kF32 + (static_cast<int64_t>(pad.size()) + kBitsPerByte - 1) / kBitsPerByte +
         static_cast<int64_t>(meta.size() * sizeof(TokenMeta)) +
         static_cast<int64_t>((cells.size() + counts.size()) * sizeof(int64_t));
}

int64_t VisionEncoder::tape_bytes(const VisionConfig& c, int64_t images, int64_t P, bool recompute_layers) {
  const int64_t T = checked_bytes({images, P});
  const int64_t H = c.hidden_size, I = c.intermediate_size, Q = int64_t{c.num_heads} * c.head_dim,
                KV = int64_t{c.num_kv_heads} * c.head_dim, heads = c.num_heads, kv_heads = c.num_kv_heads;
  // A layer's floats a token, as forward keeps them (Layer's members): h_in, a, inv_in; q/k/v_raw and their 1/rms;
  // qh, kh, vh, out, lse; o_tok, attn, inv_attn; h_mid, m, inv_mid; g, u, gu; ff, inv_ff.
  int64_t layer = (H + H + 1) + (Q + 2 * KV) + (heads + 2 * kv_heads) + (Q + 2 * KV + Q + heads) + (Q + H + 1) +
                  (H + H + 1) + 3 * I + (H + 1);
  // With clipped linears each linear also keeps its clamped input (x) and its output before the clamp (y): q, k, v,
  // o, gate, up, down.
  if (c.use_clipped_linears) layer += (H + Q) + (H + KV) + (H + KV) + (Q + H) + (H + I) + (H + I) + (I + H);
  const int64_t kept_a_layer = recompute_layers ? H : layer;  // recompute_layers: h_in only
  const int64_t patch_values = kChannels * c.patch_size * c.patch_size;
  const int64_t rotary = 2 * kAxes * (c.head_dim / (2 * kAxes));  // cos and sin, [2 axes, head_dim / 4] each
  const int64_t floats_a_token = checked_sum({patch_values, rotary, checked_bytes({c.num_layers, kept_a_layer})});
  if (T < 0) return -1;
  return checked_sum({checked_bytes({T, floats_a_token, kF32}), (T + kBitsPerByte - 1) / kBitsPerByte,
                      checked_bytes({T, static_cast<int64_t>(sizeof(TokenMeta))})});
}

std::vector<int64_t> VisionEncoder::pool_cells(const VisionBatch& b, int img) const {
  // transformers clamps padding to (0, 0) before taking the widest x, and pools padding (zeroed) into cell 0.
  const int64_t k = cfg_.pooling_kernel_size, base = int64_t{img} * b.P;
  int64_t max_x = 0;
  for (int64_t q = 0; q < b.P; ++q) max_x = std::max<int64_t>(max_x, std::max(b.positions[2 * (base + q)], 0) + 1);
  std::vector<int64_t> cells(static_cast<size_t>(b.P));
  for (int64_t p = 0; p < b.P; ++p) {
    const int64_t x = std::max(b.positions[2 * (base + p)], 0), y = std::max(b.positions[2 * (base + p) + 1], 0);
    cells[p] = x / k + (max_x / k) * (y / k);
  }
  return cells;
}

void VisionEncoder::backward(const VisionBatch& b, const VisionTape& tape, const float* d_soft_tokens,
                             VisionGrads& grads) const {
  RF_CHECK(owned_ != nullptr, "vision tower: backward into a VisionGrads needs an encoder holding its weights");
  owned_->sink = &grads;
  try {
    backward(b, tape, d_soft_tokens);
  } catch (...) {
    owned_->sink = nullptr;
    throw;
  }
  owned_->sink = nullptr;
}

void VisionEncoder::join_hooks(bool backward) const {
  if (!backward) params_->begin(0, false), params_->end(0, false);
  for (int i = 0; i < static_cast<int>(layers_.size()); ++i) {
    const int group = backward ? static_cast<int>(layers_.size()) - i : 1 + i;
    params_->begin(group, backward);
    params_->end(group, backward);
  }
  if (backward) params_->begin(0, true), params_->end(0, true);
}

void VisionEncoder::backward(const VisionBatch& b, const VisionTape& tape, const float* d_soft_tokens) const {
  const int64_t H = cfg_.hidden_size, D = cfg_.head_dim, I = cfg_.intermediate_size, P = b.P;
  const int Hq = cfg_.num_heads, Hkv = cfg_.num_kv_heads, n = b.n;
  const int64_t k = cfg_.pooling_kernel_size, patch_values = kChannels * cfg_.patch_size * cfg_.patch_size;
  const int64_t T = int64_t{n} * P, length = P / (k * k);
  RF_CHECK(static_cast<int64_t>(tape.pad.size()) == T && tape.layers.size() == layers_.size(),
           "vision tower: backward needs the tape of a forward on the same batch");
  const auto grad = [&](const std::string& name) { return params_->grad(name); };

  // 3. Pooling: each soft token's gradient, through standardize and the scale, spread over its cell's patches.
  std::vector<float> dh(static_cast<size_t>(T * H), 0.f);
  const float root = static_cast<float>(std::sqrt(static_cast<double>(H)));
  const float weight = P == length ? 1.f : 1.f / static_cast<float>(k * k);
  std::vector<float> d_cell(static_cast<size_t>(length * H));
  size_t row = 0;  // soft tokens are image after image, each image's kept cells in cell order
  for (int img = 0; img < n; ++img) {
    const int64_t base = int64_t{img} * P;
    std::fill(d_cell.begin(), d_cell.end(), 0.f);
    for (int64_t j = 0; j < tape.counts[img]; ++j, ++row) {
      const int64_t cell = tape.cells[row];
      for (int64_t c = 0; c < H; ++c)
        d_cell[cell * H + c] = d_soft_tokens[row * H + c] * root * (cfg_.standardize ? std_scale_[c] : 1.f);
    }
    const std::vector<int64_t> cells = P == length ? std::vector<int64_t>() : pool_cells(b, img);
    for (int64_t p = 0; p < P; ++p) {
      if (tape.pad[base + p]) continue;
      const int64_t cell = P == length ? p : cells[p];
      for (int64_t c = 0; c < H; ++c) dh[(base + p) * H + c] += weight * d_cell[cell * H + c];
    }
  }

  AttnChunk chunk = tower_chunk(cfg_, tape.meta.data(), n, P);
  // Every layer's gradients in one buffer set, zeroed (in parallel) where a backward accumulates into them: no
  // allocation, and so no page faults, after the last layer.
  const auto zero = [](std::vector<float>& v, int64_t count) {
    v.resize(static_cast<size_t>(count));
    float* d = v.data();
#pragma omp parallel for schedule(static) if (count >= kParallelMinElements)
    for (int64_t i = 0; i < count; ++i) d[i] = 0.f;
  };
  std::vector<float> d_ff, d_gu, d_g, d_u, d_m, d_attn, d_otok, d_out, delta, dqh, dkh, dvh, dq, dk, dv, dq_raw, dk_raw,
      dv_raw, d_a;
  // recompute_layers: the layer being differentiated, its forward run again from its kept input (h_out its output,
  // unused); one set of buffers for every layer, freed when the backward returns.
  VisionTape::Layer rerun;
  std::vector<float> h_out;
  Widened wide;
  for (int l = static_cast<int>(layers_.size()) - 1; l >= 0; --l) {
    params_->begin(1 + l, true);
    const Layer L = layer_view(l);
    if (tape.recompute_layers) {
      h_out = tape.layers[l].h_in;
      layer_forward(L, tape, n, P, h_out, rerun, true, wide);
    }
    const VisionTape::Layer& S = tape.recompute_layers ? rerun : tape.layers[l];
    const std::string& p = L.prefix;
    // 2b. MLP: h_out = h_mid + post_feedforward_norm(down(gelu(gate(m)) * up(m))), m = pre_feedforward_norm(h_mid).
    zero(d_ff, T * H), zero(d_gu, T * I), zero(d_m, T * H);
    d_g.resize(static_cast<size_t>(T * I)), d_u.resize(static_cast<size_t>(T * I));  // written by geglu_backward
    rmsnorm_backward(S.ff.data(), L.post_feedforward_norm, S.inv_ff.data(), dh.data(), d_ff.data(),
                     grad(p + "post_feedforward_layernorm.weight"), T, H);
    clipped_linear_backward(L.down, S.gu.data(), S.down, d_ff.data(), d_gu.data(),
                            grad(p + "mlp.down_proj.linear.weight"), T, I, H);
    geglu_backward(S.g.data(), S.u.data(), d_gu.data(), d_g.data(), d_u.data(), T * I, false);
    clipped_linear_backward(L.gate, S.m.data(), S.gate, d_g.data(), d_m.data(), grad(p + "mlp.gate_proj.linear.weight"),
                            T, H, I);
    clipped_linear_backward(L.up, S.m.data(), S.up, d_u.data(), d_m.data(), grad(p + "mlp.up_proj.linear.weight"), T, H,
                            I);
    rmsnorm_backward(S.h_mid.data(), L.pre_feedforward_norm, S.inv_mid.data(), d_m.data(), dh.data(),
                     grad(p + "pre_feedforward_layernorm.weight"), T, H);
    // 2a. Attention: h_mid = h_in + post_attention_norm(o_proj(attention(...))).
    zero(d_attn, T * H), zero(d_otok, T * Hq * D);
    rmsnorm_backward(S.attn.data(), L.post_attention_norm, S.inv_attn.data(), dh.data(), d_attn.data(),
                     grad(p + "post_attention_layernorm.weight"), T, H);
    clipped_linear_backward(L.o, S.o_tok.data(), S.o, d_attn.data(), d_otok.data(),
                            grad(p + "self_attn.o_proj.linear.weight"), T, Hq * D, H);
    d_out.resize(static_cast<size_t>(T * Hq * D)), delta.resize(static_cast<size_t>(T * Hq));  // written
    to_heads_into(d_otok.data(), d_out.data(), n, P, Hq, D);
    zero(dqh, T * Hq * D), zero(dkh, T * Hkv * D), zero(dvh, T * Hkv * D);
    chunk.q = S.qh.data();
    chunk.k = S.kh.data();
    chunk.v = S.vh.data();
    cpu::attention_delta(chunk.shape, DType::F32, d_out.data(), S.out.data(), delta.data());
    cpu::attention_backward(chunk, d_out.data(), S.lse.data(), delta.data(), dqh.data(), dkh.data(), dvh.data());
    dq.resize(dqh.size()), dk.resize(dkh.size()), dv.resize(dvh.size());  // written
    to_tokens_into(dqh.data(), dq.data(), n, P, Hq, D);
    to_tokens_into(dkh.data(), dk.data(), n, P, Hkv, D);
    to_tokens_into(dvh.data(), dv.data(), n, P, Hkv, D);
    rope_2d(dq, tape.cos, tape.sin, T, Hq, D, true);
    rope_2d(dk, tape.cos, tape.sin, T, Hkv, D, true);
    zero(dq_raw, T * Hq * D), zero(dk_raw, T * Hkv * D), zero(dv_raw, T * Hkv * D);
    rmsnorm_backward(S.q_raw.data(), L.q_norm, S.inv_q.data(), dq.data(), dq_raw.data(),
                     grad(p + "self_attn.q_norm.weight"), T * Hq, D);
    rmsnorm_backward(S.k_raw.data(), L.k_norm, S.inv_k.data(), dk.data(), dk_raw.data(),
                     grad(p + "self_attn.k_norm.weight"), T * Hkv, D);
    rmsnorm_backward(S.v_raw.data(), nullptr, S.inv_v.data(), dv.data(), dv_raw.data(), nullptr, T * Hkv, D);
    zero(d_a, T * H);
    clipped_linear_backward(L.q, S.a.data(), S.q, dq_raw.data(), d_a.data(), grad(p + "self_attn.q_proj.linear.weight"),
                            T, H, Hq * D);
    clipped_linear_backward(L.k, S.a.data(), S.k, dk_raw.data(), d_a.data(), grad(p + "self_attn.k_proj.linear.weight"),
                            T, H, Hkv * D);
    clipped_linear_backward(L.v, S.a.data(), S.v, dv_raw.data(), d_a.data(), grad(p + "self_attn.v_proj.linear.weight"),
                            T, H, Hkv * D);
    rmsnorm_backward(S.h_in.data(), L.input_norm, S.inv_in.data(), d_a.data(), dh.data(),
                     grad(p + "input_layernorm.weight"), T, H);
    params_->end(1 + l, true);
  }

  // 1. Patch embedding.
  params_->begin(0, true);
  linear_backward(matmul(), tape.scaled.data(), params_->weight(kInputProj), dh.data(), nullptr, grad(kInputProj), T,
                  patch_values, H);
  if (float* d_table = grad(kPositionTable)) {
    const int64_t table = int64_t{cfg_.position_embedding_size} * H;
    for (int64_t t = 0; t < T; ++t) {
      if (tape.pad[t]) continue;
      float* gx = d_table + int64_t{b.positions[2 * t]} * H;
      float* gy = d_table + table + int64_t{b.positions[2 * t + 1]} * H;
      for (int64_t c = 0; c < H; ++c) {
        gx[c] += dh[t * H + c];
        gy[c] += dh[t * H + c];
      }
    }
  }
  params_->end(0, true);
}

}  // namespace rf::model
