// ringflex cp: the CP attention backend (cp_backend.h).
#include "cp/cp_backend.h"

#include <algorithm>

#include "core/error.h"
#include "cp/balance.h"
#include "cp/work.h"

namespace rf::cp {

CpAttention::CpAttention(comm::Communicator& comm, CpAttentionOptions options)
    : comm_(comm), options_(std::move(options)) {}

RowShard CpAttention::begin_batch(const TokenMeta* rows, int B, int S, const std::vector<MaskLayers>& mix) {
  const int P = comm_.size();
  RF_CHECK(rows != nullptr && B > 0 && S > 0, "attention: a batch needs B > 0 rows of S > 0 tokens, got B = ", B,
           ", S = ", S);
  RF_CHECK(P <= S, "context parallelism over ", P, " ranks needs at least ", P, " tokens per row, the row has ", S);
  RF_CHECK(!mix.empty(), "attention: the model lists no layer masks");
  LayerMix layer_mix;
  for (const MaskLayers& m : mix) layer_mix.push_back(LayerKind{m.mask, m.layers});
  map_ = shard_map_for(options_.scheme, rows, B, S, P, layer_mix);
  const std::vector<TokenMeta> meta = shard_meta(map_, comm_.rank(), rows, B);  // [B, L]
  have_plan_ = options_.algo == Algo::Ring && options_.traffic == RingTraffic::Planned;
  if (have_plan_) {
    const PlanGeometry g{P, B, map_.L, kPlanBlock};
    plan_ = make_comm_plan(comm_, meta.data(), g, layer_mix, options_.timeout);
  }
  RowShard s;
  s.S = S;
  s.L = map_.L;
  s.P = P;
  s.rank = comm_.rank();
  s.positions = map_.positions;
  return s;
}

CpParams CpAttention::params_for(const ShardAttention& x, CpStats* stats) const {
  CpParams p;
  p.mask = x.mask;
  p.scale = x.scale;
  p.algo = options_.algo;
  p.scheme = map_.scheme;
  p.timeout = options_.timeout;
  p.stats = stats;
  p.traffic = options_.traffic;
  p.plan = have_plan_ ? &plan_ : nullptr;
  return p;
}

void CpAttention::add(const CpStats& s) {
  ++totals_.calls;
  totals_.peak_attention_bytes = std::max(totals_.peak_attention_bytes, s.peak_attention_bytes);
  totals_.bytes_sent += s.bytes_sent;
  totals_.bytes_received += s.bytes_received;
  totals_.work += s.work;
  totals_.compute_seconds += s.compute_seconds;
  totals_.wall_seconds += s.wall_seconds;
}

void CpAttention::forward(const ShardAttention& x, float* o, float* lse) {
  CpStats stats;
  cp_attention_forward(comm_, x, params_for(x, &stats), o, lse);
  add(stats);
}

void CpAttention::backward(const ShardAttention& x, const float* o, const float* lse, const void* dout, float* dq,
                           float* dk, float* dv) {
  CpStats stats;
  cp_attention_backward(comm_, x, params_for(x, &stats), o, lse, dout, dq, dk, dv);
  add(stats);
}

void CpAttention::sum_over_ranks(double* values, size_t n) {
  comm_.allreduce(values, n, comm::ReduceOp::Sum, options_.timeout);
}

}  // namespace rf::cp
