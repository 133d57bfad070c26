// ringflex model: Gemma 4's vision encoder forward (see vision_encoder.h).
#include "model/vision_encoder.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/attention_args.h"
#include "core/error.h"
#include "cpu/attention.h"
#include "io/tensor_access.h"
#include "model/ops.h"

namespace rf::model {

namespace {

constexpr int64_t kChannels = 3;  // RGB: a patch is 3 * patch_size^2 values
constexpr int kAxes = 2;          // (x, y): the position table's and the rotary embedding's two axes
constexpr int32_t kPaddingPosition = -1;

}  // namespace

std::vector<float> VisionEncoder::take(const io::Passthrough& tensors, const std::string& name,
                                       const std::vector<int64_t>& shape) const {
  const std::string full = kVisionTowerPrefix + name;
  const io::Passthrough::Entry* e = tensors.find(full);
  RF_CHECK(e != nullptr, "vision tower: no tensor `", full, "` in the checkpoint");
  RF_CHECK(e->shape == shape, "vision tower: tensor `", full, "` has shape ", io::shape_string(e->shape),
           ", the vision_config implies ", io::shape_string(shape));
  return io::to_float32(io::TensorView{full, e->dtype, e->shape, e->bytes});
}

VisionEncoder::Linear VisionEncoder::take_linear(const io::Passthrough& tensors, const std::string& name, int64_t in,
                                                 int64_t out) const {
  Linear l;
  l.w = take(tensors, name + ".linear.weight", {out, in});
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

VisionEncoder::VisionEncoder(VisionConfig c, const io::Passthrough& tensors) : cfg_(std::move(c)) {
  const int64_t H = cfg_.hidden_size, D = cfg_.head_dim, I = cfg_.intermediate_size;
  // The 2-D rotary embedding rotates each half of a head by one axis, in pairs (i, i + D/4) within the half.
  RF_CHECK(D % (2 * kAxes) == 0, "vision tower: head_dim = ", D, " must be a multiple of 4 (2-D rotary embedding)");
  RF_CHECK(cfg_.num_heads % cfg_.num_kv_heads == 0, "vision tower: num_attention_heads = ", cfg_.num_heads,
           " is not a multiple of num_key_value_heads = ", cfg_.num_kv_heads);
  for (int l = 0; l < cfg_.num_layers; ++l) {
    const std::string p = "encoder.layers." + std::to_string(l) + ".";
    Layer layer;
    layer.input_norm = take(tensors, p + "input_layernorm.weight", {H});
    layer.post_attention_norm = take(tensors, p + "post_attention_layernorm.weight", {H});
    layer.pre_feedforward_norm = take(tensors, p + "pre_feedforward_layernorm.weight", {H});
    layer.post_feedforward_norm = take(tensors, p + "post_feedforward_layernorm.weight", {H});
    layer.q = take_linear(tensors, p + "self_attn.q_proj", H, cfg_.num_heads * D);
    layer.k = take_linear(tensors, p + "self_attn.k_proj", H, cfg_.num_kv_heads * D);
    layer.v = take_linear(tensors, p + "self_attn.v_proj", H, cfg_.num_kv_heads * D);
    layer.o = take_linear(tensors, p + "self_attn.o_proj", cfg_.num_heads * D, H);
    layer.q_norm = take(tensors, p + "self_attn.q_norm.weight", {D});
    layer.k_norm = take(tensors, p + "self_attn.k_norm.weight", {D});
    layer.gate = take_linear(tensors, p + "mlp.gate_proj", H, I);
    layer.up = take_linear(tensors, p + "mlp.up_proj", H, I);
    layer.down = take_linear(tensors, p + "mlp.down_proj", I, H);
    layers_.push_back(std::move(layer));
  }
  const int64_t patch = cfg_.patch_size;
  input_proj_ = take(tensors, "patch_embedder.input_proj.weight", {H, kChannels * patch * patch});
  pos_table_ = take(tensors, "patch_embedder.position_embedding_table", {kAxes, cfg_.position_embedding_size, H});
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

void VisionEncoder::clipped_linear(const Linear& l, const float* x, float* y, int64_t T, int64_t in,
                                   int64_t out) const {
  const Matmul mm;
  if (!cfg_.use_clipped_linears) {
    linear_forward(mm, x, l.w.data(), y, T, in, out);
    return;
  }
  std::vector<float> clamped(x, x + T * in);
  for (float& v : clamped) v = std::clamp(v, l.in_min, l.in_max);
  linear_forward(mm, clamped.data(), l.w.data(), y, T, in, out);
  for (int64_t i = 0; i < T * out; ++i) y[i] = std::clamp(y[i], l.out_min, l.out_max);
}

VisionOutput VisionEncoder::forward(const VisionBatch& b, const std::string& source) const {
  const int64_t H = cfg_.hidden_size, D = cfg_.head_dim, I = cfg_.intermediate_size, P = b.P;
  const int Hq = cfg_.num_heads, Hkv = cfg_.num_kv_heads, n = b.n;
  const int64_t k = cfg_.pooling_kernel_size, patch_values = kChannels * cfg_.patch_size * cfg_.patch_size;
  RF_CHECK(n > 0 && P > 0 && b.pixels && b.positions, source, ": a vision batch needs n > 0 images of P > 0 patches");
  RF_CHECK(P % (k * k) == 0, source, ": ", P, " patches per image cannot pool to soft tokens: not a multiple of ",
           "pooling_kernel_size^2 = ", k * k);
  RF_CHECK(P <= std::numeric_limits<int32_t>::max(), source, ": ", P, " patches per image is too many");
  const int64_t T = int64_t{n} * P;
  const int64_t length = P / (k * k);  // soft tokens an image of P patches pools to (Gemma4VisionModel's output_length)

  // Padding and positions, checked once: everything below indexes with them.
  std::vector<bool> pad(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) {
    const int32_t x = b.positions[2 * t], y = b.positions[2 * t + 1];
    pad[t] = x == kPaddingPosition && y == kPaddingPosition;
    RF_CHECK(pad[t] || (x >= 0 && y >= 0 && x < cfg_.position_embedding_size && y < cfg_.position_embedding_size),
             source, ": image ", t / P, " patch ", t % P, " has position (", x, ", ", y, "), outside [0, ",
             cfg_.position_embedding_size, ") (position_embedding_size), and not the padding (-1, -1)");
  }

  // 1. Patch embedding.
  std::vector<float> h(static_cast<size_t>(T * H));
  {
    std::vector<float> scaled(static_cast<size_t>(T * patch_values));
    for (int64_t i = 0; i < T * patch_values; ++i) scaled[i] = 2.f * (b.pixels[i] - 0.5f);
    linear_forward(Matmul{}, scaled.data(), input_proj_.data(), h.data(), T, patch_values, H);
  }
  const int64_t table = int64_t{cfg_.position_embedding_size} * H;  // one axis of the position table
  for (int64_t t = 0; t < T; ++t) {
    if (pad[t]) continue;
    const float* ex = pos_table_.data() + int64_t{b.positions[2 * t]} * H;
    const float* ey = pos_table_.data() + table + int64_t{b.positions[2 * t + 1]} * H;
    for (int64_t c = 0; c < H; ++c) h[t * H + c] += ex[c] + ey[c];
  }

  // The rotary angles of each token and axis: [T, 2, D/4] cos and sin.
  const int64_t quarter = D / (2 * kAxes);
  std::vector<float> cosv(static_cast<size_t>(T * kAxes * quarter)), sinv(cosv.size());
  for (int64_t t = 0; t < T; ++t)
    for (int a = 0; a < kAxes; ++a)
      for (int64_t i = 0; i < quarter; ++i) {
        const float angle = static_cast<float>(b.positions[2 * t + a]) * inv_freq_[i];
        cosv[(t * kAxes + a) * quarter + i] = std::cos(angle);
        sinv[(t * kAxes + a) * quarter + i] = std::sin(angle);
      }
  // In place on x[T, heads, D]: each half a of a head rotated by axis a, pairs (i, i + D/4) within the half.
  const auto rope = [&](std::vector<float>& x, int heads) {
    for (int64_t t = 0; t < T; ++t)
      for (int hd = 0; hd < heads; ++hd)
        for (int a = 0; a < kAxes; ++a) {
          float* part = x.data() + (t * heads + hd) * D + a * 2 * quarter;
          for (int64_t i = 0; i < quarter; ++i) {
            const float c = cosv[(t * kAxes + a) * quarter + i], s = sinv[(t * kAxes + a) * quarter + i];
            const float x1 = part[i], x2 = part[i + quarter];
            part[i] = x1 * c - x2 * s;
            part[i + quarter] = x2 * c + x1 * s;
          }
        }
  };
  // [n, P, heads, D] token-major <-> [n, heads, P, D] head-major (the attention kernels' layout).
  const auto to_heads = [&](const std::vector<float>& x, int heads) {
    std::vector<float> y(x.size());
    for (int img = 0; img < n; ++img)
      for (int64_t p = 0; p < P; ++p)
        for (int hd = 0; hd < heads; ++hd)
          std::copy_n(x.data() + ((img * P + p) * heads + hd) * D, D, y.data() + ((img * heads + hd) * P + p) * D);
    return y;
  };

  // Attention within each image over its valid patches: one row per image, doc 1 for a valid patch, 0 for padding
  // (a padding query sees nothing and gets 0; its output never reaches a soft token).
  std::vector<TokenMeta> meta(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) meta[t] = TokenMeta{static_cast<int32_t>(t % P), pad[t] ? kPaddingDoc : 1, kNoGroup};
  AttnChunk chunk;
  chunk.shape = AttnShape{n, Hq, Hkv, static_cast<int>(P), static_cast<int>(P), static_cast<int>(D)};
  chunk.dtype = DType::F32;
  chunk.q_meta = chunk.k_meta = meta.data();
  chunk.mask = LayerMask{false, 0, false};
  chunk.scale = 1.f;  // Gemma4VisionAttention.scaling: q and k are RMS-normalised per head instead

  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  std::vector<float> a(static_cast<size_t>(T * H)), inv(static_cast<size_t>(T * std::max(Hq, 1)));
  std::vector<float> q(static_cast<size_t>(T * Hq * D)), kk(static_cast<size_t>(T * Hkv * D)), v(kk.size());
  std::vector<float> o(q.size()), lse(static_cast<size_t>(T * Hq)), out(static_cast<size_t>(T * H));
  std::vector<float> g(static_cast<size_t>(T * I)), u(g.size()), gu(g.size());
  for (const Layer& L : layers_) {
    // 2a. Attention.
    rmsnorm_forward(h.data(), L.input_norm.data(), eps, a.data(), inv.data(), T, H);
    clipped_linear(L.q, a.data(), q.data(), T, H, Hq * D);
    clipped_linear(L.k, a.data(), kk.data(), T, H, Hkv * D);
    clipped_linear(L.v, a.data(), v.data(), T, H, Hkv * D);
    rmsnorm_forward(q.data(), L.q_norm.data(), eps, q.data(), inv.data(), T * Hq, D);
    rmsnorm_forward(kk.data(), L.k_norm.data(), eps, kk.data(), inv.data(), T * Hkv, D);
    rmsnorm_forward(v.data(), nullptr, eps, v.data(), inv.data(), T * Hkv, D);
    rope(q, Hq);
    rope(kk, Hkv);
    const std::vector<float> qh = to_heads(q, Hq), kh = to_heads(kk, Hkv), vh = to_heads(v, Hkv);
    chunk.q = qh.data();
    chunk.k = kh.data();
    chunk.v = vh.data();
    validate(chunk);
    cpu::attention_forward(chunk, o.data(), lse.data());
    for (int img = 0; img < n; ++img)  // back to token-major [T, Hq * D] for o_proj
      for (int hd = 0; hd < Hq; ++hd)
        for (int64_t p = 0; p < P; ++p)
          std::copy_n(o.data() + ((img * Hq + hd) * P + p) * D, D, q.data() + ((img * P + p) * Hq + hd) * D);
    clipped_linear(L.o, q.data(), out.data(), T, Hq * D, H);
    rmsnorm_forward(out.data(), L.post_attention_norm.data(), eps, out.data(), inv.data(), T, H);
    for (int64_t i = 0; i < T * H; ++i) h[i] += out[i];
    // 2b. MLP.
    rmsnorm_forward(h.data(), L.pre_feedforward_norm.data(), eps, a.data(), inv.data(), T, H);
    clipped_linear(L.gate, a.data(), g.data(), T, H, I);
    clipped_linear(L.up, a.data(), u.data(), T, H, I);
    geglu_forward(g.data(), u.data(), gu.data(), T * I);
    clipped_linear(L.down, gu.data(), out.data(), T, I, H);
    rmsnorm_forward(out.data(), L.post_feedforward_norm.data(), eps, out.data(), inv.data(), T, H);
    for (int64_t i = 0; i < T * H; ++i) h[i] += out[i];
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
      // transformers clamps padding to (0, 0) before taking the widest x, and pools padding (zeroed) into cell 0.
      int64_t max_x = 0;
      for (int64_t p = 0; p < P; ++p) max_x = std::max<int64_t>(max_x, std::max(b.positions[2 * (base + p)], 0) + 1);
      const float weight = 1.f / static_cast<float>(k * k);
      for (int64_t p = 0; p < P; ++p) {
        const int64_t x = std::max(b.positions[2 * (base + p)], 0), y = std::max(b.positions[2 * (base + p) + 1], 0);
        const int64_t cell = x / k + (max_x / k) * (y / k);
        RF_CHECK(cell < length, source, ": image ", img, " patch ", p, " at (", x, ", ", y, ") pools into cell ", cell,
                 " of ", length, ": the image's grid holds more patches than its ", P, " slots");
        used[cell] = true;
        if (pad[base + p]) continue;
        for (int64_t c = 0; c < H; ++c) pooled[cell * H + c] += weight * h[(base + p) * H + c];
      }
    }
    int64_t count = 0;
    for (int64_t cell = 0; cell < length; ++cell) {
      if (!used[cell]) continue;
      ++count;
      for (int64_t c = 0; c < H; ++c) {
        float x = pooled[cell * H + c] * root;
        if (cfg_.standardize) x = (x - std_bias_[c]) * std_scale_[c];
        r.soft_tokens.push_back(x);
      }
    }
    r.counts.push_back(count);
  }
  return r;
}

}  // namespace rf::model
