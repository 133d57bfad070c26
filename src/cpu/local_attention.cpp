// ringflex cpu: the one-rank attention backend (local_attention.h).
#include "cpu/local_attention.h"

#include <algorithm>
#include <numeric>
#include <vector>

#include "core/error.h"
#include "cpu/attention.h"

namespace rf::cpu {

namespace {

AttnChunk whole_row(const ShardAttention& x) {
  const AttnChunk c = chunk_of(x, x.mask, x.scale.value_or(default_scale(x.shape.D)));
  validate(c);
  return c;
}

}  // namespace

RowShard LocalAttention::begin_batch(const TokenMeta* rows, int B, int S, const std::vector<MaskLayers>&) {
  RF_CHECK(rows != nullptr && B > 0 && S > 0, "attention: a batch needs B > 0 rows of S > 0 tokens, got B = ", B,
           ", S = ", S);
  RowShard s;
  s.S = S;
  s.L = S;
  s.positions.assign(1, std::vector<int32_t>(static_cast<size_t>(S)));
  std::iota(s.positions[0].begin(), s.positions[0].end(), 0);
  return s;
}

void LocalAttention::forward(const ShardAttention& x, float* o, float* lse) { attention_forward(whole_row(x), o, lse); }

void LocalAttention::backward(const ShardAttention& x, const float* o, const float* lse, const void* dout, float* dq,
                              float* dk, float* dv) {
  const AttnChunk c = whole_row(x);
  std::vector<float> delta(static_cast<size_t>(x.shape.lse_elems()));  // [B, Hq, L]
  attention_delta(x.shape, x.dtype, dout, o, delta.data());
  // The kernel accumulates; the seam writes.
  std::fill_n(dq, x.shape.q_elems(), 0.f);
  std::fill_n(dk, x.shape.kv_elems(), 0.f);
  std::fill_n(dv, x.shape.kv_elems(), 0.f);
  attention_backward(c, dout, lse, delta.data(), dq, dk, dv);
}

}  // namespace rf::cpu
