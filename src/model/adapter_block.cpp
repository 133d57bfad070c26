// ringflex model: a LoRA adapter beside a frozen linear weight, forward and backward (gemma4_run.h, held_weight.h).
//
// The adapter's part of y = x W^T + scale * (x A^T) B^T runs as two thin float32 products through u = x A^T [T, r],
// whatever the run's compute dtype (r is 8 to 64: their cost is 2 r / min(in, out) of the base's, and float32 keeps
// the adapters' gradients exact where PEFT's float32 adapters have them). Head-major inputs and outputs (q/k/v's
// output, o_proj's input) are brought to token-major [T, n] for it and back: one [T, n] buffer alive per call. In
// training runs with model.lora.dropout the adapter's input goes through PEFT's dropout first, its masks drawn from
// (RunOptions::dropout_key, the adapter, the row, the token's global position, the feature) alone.
#include "model/gemma4_run.h"

namespace rf::model {

namespace {

// x [B, heads, S, D] (head-major) -> out [B*S, heads*D] (token-major), or a plain copy of [T, n].
Vec to_token_major(const float* x, int heads, int64_t D, int B, int64_t S, int64_t n) {
  Vec out = uninit(B * S * n);
  if (heads == 0) {
    std::copy_n(x, B * S * n, out.data());
    return out;
  }
#pragma omp parallel for collapse(2) schedule(static) if (B * S * n >= kParallelMinElements)
  for (int b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      for (int h = 0; h < heads; ++h)
        std::copy_n(x + ((int64_t{b} * heads + h) * S + s) * D, D, out.data() + (b * S + s) * n + h * D);
  return out;
}

// y (layout l) += delta [B*S, n] (token-major).
void add_token_major(float* y, int heads, int64_t D, const float* delta, int B, int64_t S, int64_t n) {
  if (heads == 0) {
    add_into(y, delta, B * S * n);
    return;
  }
#pragma omp parallel for collapse(2) schedule(static) if (B * S * n >= kParallelMinElements)
  for (int b = 0; b < B; ++b)
    for (int64_t s = 0; s < S; ++s)
      for (int h = 0; h < heads; ++h) {
        float* yy = y + ((int64_t{b} * heads + h) * S + s) * D;
        const float* d = delta + (b * S + s) * n + h * D;
        for (int64_t i = 0; i < D; ++i) yy[i] += d[i];
      }
}

}  // namespace

bool Gemma4Model::Run::adapter_dropout(const LinearAdapter& ad) const { return opt.want_grad && ad.dropout > 0.f; }

void Gemma4Model::Run::apply_adapter_dropout(const LinearAdapter& ad, float* x, int64_t K, TokenRows rows) const {
  const float keep_scale = 1.f / (1.f - ad.dropout);
  const int64_t n = rows.count(T);
#pragma omp parallel for schedule(static) if (n * K >= kParallelMinElements)
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = rows.first + i;
    const int64_t row = t / S, pos = meta[static_cast<size_t>(t)].idx;
    float* xt = x + i * K;
    for (int64_t k = 0; k < K; ++k)
      xt[k] = lora_dropout_keeps(opt.dropout_key, ad.salt, row, pos, k, ad.dropout) ? xt[k] * keep_scale : 0.f;
  }
}

void Gemma4Model::Run::adapter_forward(size_t slot, const float* x, Layout in, float* y, Layout out, TokenRows rows) {
  if (slot == kNoSlot) return;
  const std::optional<LinearAdapter> ad = store.adapter(slot);
  if (!ad) return;
  const int64_t r = ad->rank, K = ad->in, N = ad->out, n = rows.count(T);
  RF_ASSERT(rows.all(T) || (in.heads == 0 && out.heads == 0));  // a token range is token-major
  const bool dropout = adapter_dropout(*ad);
  Vec xt;
  if (in.heads != 0) xt = to_token_major(x, in.heads, in.D, B, S, K);
  if (in.heads == 0 && dropout) xt = copy_of(x, n * K);
  if (dropout) apply_adapter_dropout(*ad, xt.data(), K, rows);
  const float* xs = in.heads != 0 || dropout ? xt.data() : x;
  Vec u = uninit(n * r);  // x A^T [T, r] (x after PEFT's dropout)
  gemm(false, true, n, r, K, 1.f, xs, K, ad->A, K, 0.f, u.data(), r);
  if (out.heads == 0) {
    gemm(false, true, n, N, r, ad->scale, u.data(), r, ad->B, r, 1.f, y, N);
    return;
  }
  Vec delta = uninit(n * N);
  gemm(false, true, n, N, r, ad->scale, u.data(), r, ad->B, r, 0.f, delta.data(), N);
  add_token_major(y, out.heads, out.D, delta.data(), B, S, N);
}

void Gemma4Model::Run::adapter_backward(size_t slot, const float* x, Layout in, const float* dy, Layout out, float* dx,
                                        TokenRows rows) {
  if (slot == kNoSlot) return;
  const std::optional<LinearAdapter> ad = store.adapter(slot);
  if (!ad) return;
  const int64_t r = ad->rank, K = ad->in, N = ad->out, n = rows.count(T);
  RF_ASSERT(rows.all(T) || (in.heads == 0 && out.heads == 0));  // a token range is token-major
  const bool dropout = adapter_dropout(*ad);
  Vec xt, dyt;
  if (in.heads != 0) xt = to_token_major(x, in.heads, in.D, B, S, K);
  if (in.heads == 0 && dropout) xt = copy_of(x, n * K);
  if (dropout) apply_adapter_dropout(*ad, xt.data(), K, rows);  // the forward's masks again
  if (out.heads != 0) dyt = to_token_major(dy, out.heads, out.D, B, S, N);
  const float* xs = in.heads != 0 || dropout ? xt.data() : x;
  const float* dys = out.heads != 0 ? dyt.data() : dy;
  Vec v = uninit(n * r);  // dy B [T, r]
  gemm(false, false, n, r, N, 1.f, dys, N, ad->B, r, 0.f, v.data(), r);
  if (ad->dA != nullptr && opt.want_grad) {
    Vec u = uninit(n * r);  // x A^T [T, r], recomputed (r floats a token)
    gemm(false, true, n, r, K, 1.f, xs, K, ad->A, K, 0.f, u.data(), r);
    gemm(true, false, N, r, n, ad->scale, dys, N, u.data(), r, 1.f, ad->dB, r);  // dB [N, r] += s dy^T u
    gemm(true, false, r, K, n, ad->scale, v.data(), r, xs, K, 1.f, ad->dA, K);   // dA [r, K] += s v^T x
  }
  if (dx == nullptr) return;
  if (in.heads == 0 && !dropout) {
    gemm(false, false, n, K, r, ad->scale, v.data(), r, ad->A, K, 1.f, dx, K);  // dx [T, K] += s v A
    return;
  }
  Vec dxt = uninit(n * K);
  gemm(false, false, n, K, r, ad->scale, v.data(), r, ad->A, K, 0.f, dxt.data(), K);
  if (dropout) apply_adapter_dropout(*ad, dxt.data(), K, rows);  // through the mask and its 1 / (1 - p)
  if (in.heads == 0) {
    add_into(dx, dxt.data(), n * K);
    return;
  }
  add_token_major(dx, in.heads, in.D, dxt.data(), B, S, K);
}

}  // namespace rf::model
