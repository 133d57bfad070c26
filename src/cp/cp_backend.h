// ringflex cp: the attention seam (core/attention_backend.h) over a CP group: a model's layers through the ring.
//
// begin_batch chooses the shard map from the full rows' metadata and the model's masks (balanced by default:
// work predicted exactly for the model's layer mix, cp/balance.h), and builds the communication plan for every
// mask with one allgather (cp/plan.h); every layer's forward and backward then reuses that plan. forward and
// backward are cp_attention_forward/backward on this rank's shard. The backend knows nothing of the model.
#pragma once

#include <string>

#include "comm/communicator.h"
#include "core/attention_backend.h"
#include "cp/cp_attention.h"
#include "cp/plan.h"
#include "cp/shard.h"

namespace rf::cp {

struct CpAttentionOptions {
  std::string scheme = "balanced";  // contiguous | zigzag | balanced | auto (cp::shard_map_for)
  Algo algo = Algo::Ring;
  RingTraffic traffic = RingTraffic::Planned;
  comm::Timeout timeout = comm::default_timeout();  // the executable's --timeout, read when the options are made
};

// Every call's CpStats added up since construction.
struct CpTotals {
  int calls = 0;
  int64_t peak_attention_bytes = 0;  // the largest of any one call
  int64_t bytes_sent = 0, bytes_received = 0;
  int64_t work = 0;
  double compute_seconds = 0;  // inside attention kernels and merges
  double wall_seconds = 0;     // inside the calls, communication and planning included
};

class CpAttention final : public AttentionBackend {
 public:
  // comm: the CP group; it must outlive this object.
  explicit CpAttention(comm::Communicator& comm, CpAttentionOptions options = {});

  int rank() const override { return comm_.rank(); }
  int ranks() const override { return comm_.size(); }
  RowShard begin_batch(const TokenMeta* rows, int B, int S, const std::vector<MaskLayers>& mix) override;
  void forward(const ShardAttention& x, float* o, float* lse) override;
  void backward(const ShardAttention& x, const float* o, const float* lse, const void* dout, float* dq, float* dk,
                float* dv) override;
  void sum_over_ranks(double* values, size_t n) override;

  const ShardMap& shard_map() const { return map_; }  // of the last begin_batch
  const CpTotals& totals() const { return totals_; }

 private:
  CpParams params_for(const ShardAttention& x, CpStats* stats) const;
  void add(const CpStats& s);

  comm::Communicator& comm_;
  CpAttentionOptions options_;
  ShardMap map_;
  CommPlan plan_;
  bool have_plan_ = false;
  CpTotals totals_;
};

}  // namespace rf::cp
