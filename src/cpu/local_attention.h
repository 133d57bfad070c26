// ringflex cpu: the attention seam (core/attention_backend.h) on one rank, P = 1.
//
// The rank holds every token: the shard is the whole row in order (L = S, no padding) and each layer's attention
// is one call of the cpu kernels on the row as a single chunk, whose partial result is then already final.
#pragma once

#include "core/attention_backend.h"

namespace rf::cpu {

class LocalAttention final : public AttentionBackend {
 public:
  int rank() const override { return 0; }
  int ranks() const override { return 1; }
  RowShard begin_batch(const TokenMeta* rows, int B, int S, const std::vector<MaskLayers>& mix) override;
  void forward(const ShardAttention& x, float* o, float* lse) override;
  void backward(const ShardAttention& x, const float* o, const float* lse, const void* dout, float* dq, float* dk,
                float* dv) override;
  void sum_over_ranks(double*, size_t) override {}  // one rank: the sum is the value
};

}  // namespace rf::cpu
