// ringflex core: the model's parallel context, the one seam through which a model meets the other ranks: its
// attention (local kernels at P = 1, the CP engine at P > 1), the sums over ranks (the loss's counts), the
// experts' dispatch of expert parallelism (core/expert_parallel.h) and the vision tower's images shared over the CP
// group (core/image_split.h). A job gets it from one factory,
// cp::make_parallel_context (cp/parallel_context.h).
//
// A model never sees a communicator. Once per batch it hands the backend the full rows' token metadata and its
// layer masks; the backend chooses which tokens of the rows this rank holds (a RowShard, equal length L on every
// rank) and prepares whatever the masks need (the CP engine builds its communication plan once here, shared by
// every layer of a mask). Then, per layer, the model calls forward/backward on this rank's tokens only, with the
// shard's global TokenMeta, and every rank makes the same sequence of calls (they are collective under CP).
// Implementations: rf::cpu::LocalAttention (cpu/local_attention.h) and rf::cp::CpAttention (cp/cp_backend.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "core/attention_args.h"
#include "core/expert_parallel.h"
#include "core/image_split.h"
#include "core/mask.h"

namespace rf {

// `layers` layers of the model use `mask`; a model lists each distinct mask once.
struct MaskLayers {
  LayerMask mask;
  int layers = 1;
};

// Which tokens of a batch's rows each rank holds. Every rank holds L tokens of each of the B rows (the rows share
// one map); the row is padded to P * L, and positions >= S are that padding (doc = 0: they see and are seen by
// nothing, carry no label and no gradient).
struct RowShard {
  int S = 0;                                    // tokens per row before sharding
  int L = 0;                                    // tokens per rank per row
  int P = 1;                                    // ranks
  int rank = 0;                                 // this rank
  std::vector<std::vector<int32_t>> positions;  // [P][L]: padded-row position of each rank's local tokens

  const std::vector<int32_t>& mine() const { return positions[static_cast<size_t>(rank)]; }
  bool is_pad(int32_t position) const { return position >= S; }
};

// One layer's attention on this rank's tokens: shape.Lq == shape.Lk == L. dtype says what q, k, v (and the
// backward's dout) hold: float32, or bf16 where the model computes in bf16 on bf16 units (model/ops.h
// ComputeDtype; cpu::bf16_attention_on_bf16_units decides). The outputs are float32 either way.
struct ShardAttention : AttnShard {
  LayerMask mask;
  std::optional<float> scale;  // unset: 1/sqrt(D); any finite value, 0 included, is used as it is
};

class ParallelContext {
 public:
  virtual ~ParallelContext() = default;
  virtual int rank() const = 0;
  virtual int ranks() const = 0;

  // Chooses this rank's tokens of the batch and prepares every mask of `mix` (collective). rows: [B, S], the full
  // rows' metadata, identical on every rank. Throws rf::Error (on every rank alike) when the row cannot be split,
  // e.g. fewer tokens than ranks.
  virtual RowShard begin_batch(const TokenMeta* rows, int B, int S, const std::vector<MaskLayers>& mix) = 0;

  // o: [B, Hq, L, D], lse: [B, Hq, L] float32, written (-inf and o = 0 where a query sees nothing). Collective.
  virtual void forward(const ShardAttention& x, float* o, float* lse) = 0;

  // In place of forward, for a layer whose K/V a run needs and whose attention it does not (the last layer of
  // generation's prefill, model/gemma4.h RunOptions::run_layers: its output feeds nothing). x.q is not read. A
  // context that keeps keys (core/decode_context.h) keeps them as its forward would have; the others have nothing to
  // do. Every rank makes the same calls.
  virtual void keep_keys(const ShardAttention&) {}

  // o, lse: forward's outputs; dout: [B, Hq, L, D] in x.dtype. Writes (not accumulates) float32 dq: [B, Hq, L, D] and
  // dk, dv: [B, Hkv, L, D] for this rank's keys, summed over every rank's queries. Collective.
  virtual void backward(const ShardAttention& x, const float* o, const float* lse, const void* dout, float* dq,
                        float* dk, float* dv) = 0;

  // In place: each value summed over the ranks in rank order 0..P-1, the same bits on every rank. Collective.
  virtual void sum_over_ranks(double* values, size_t n) = 0;

  // The experts' dispatch: every expert on this rank unless the job's factory gave the context an EP group's.
  ExpertParallel& experts() { return experts_ ? *experts_ : local_experts_; }
  void set_experts(std::unique_ptr<ExpertParallel> experts) { experts_ = std::move(experts); }
  // The vision tower's images: every one this rank's unless the job's factory gave the context its CP group's split.
  ImageSplit& images() { return images_ ? *images_ : local_images_; }
  void set_images(std::unique_ptr<ImageSplit> images) { images_ = std::move(images); }

 private:
  LocalExperts local_experts_;
  std::unique_ptr<ExpertParallel> experts_;
  LocalImages local_images_;
  std::unique_ptr<ImageSplit> images_;
};

// The seam's first name (it began as attention alone); the model's code still says it.
using AttentionBackend = ParallelContext;

}  // namespace rf
