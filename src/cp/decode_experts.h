// ringflex cp: expert parallelism in generation (core/expert_parallel.h). The EP group's rank r holds experts
// [r * E / P, (r + 1) * E / P) as in training (model/expert_store.h). A prefill's tokens are split over the CP group,
// so its rows travel through EpExperts' alltoallv as a training forward's do. A decode step's tokens are the same on
// every rank of the group (the step is replicated, core/decode_context.h), so no row needs to travel: each rank runs
// only its own experts' rows of those tokens (its block of the sent layout) and one allgather of the outputs, each
// rank's experts' run in expert order, gives every rank every row of the sent layout. Each expert's rows are then the
// same rows in the same order as with every expert local (the task cut depends on them alone), so each output row,
// and each token's combine in ascending expert index, has the bits of EP = 1: EP changes no bit of a decode step.
// Bytes a decode step moves per MoE layer: each rank's rows' outputs (about B K H floats in all) once.
#pragma once

#include <vector>

#include "comm/communicator.h"
#include "core/expert_parallel.h"
#include "cp/ep_experts.h"

namespace rf::cp {

class DecodeExperts final : public ExpertParallel {
 public:
  // group: the EP group; it must outlive this object. Every rank of it must run the same decode steps on the same
  // tokens (true when it lies inside the CP group whose decode steps are replicated, as in `ringflex generate`, or
  // spans CP groups that decode the same prompts with the same weights, as train.samples' DP replicas do).
  explicit DecodeExperts(comm::Communicator& group, comm::Timeout timeout = comm::default_timeout());

  // The next runs are decode steps (true: the tokens are replicated over the group) or a prefill (false).
  void set_replicated(bool replicated) { replicated_ = replicated; }

  int rank() const override { return group_.rank(); }
  int ranks() const override { return group_.size(); }
  // Replicated: no message; this rank receives its own experts' rows from itself only ([P][E / P], the other
  // sources' blocks empty).
  void route(ExpertRouting& routing) override;
  // Replicated: this rank's experts' rows copied from the sent layout.
  void dispatch(const ExpertRouting& routing, const float* sent, float* received, int64_t width) override;
  // Replicated: this rank's rows' outputs into its run of the sent layout, then one allgatherv of every rank's run.
  void combine(const ExpertRouting& routing, const float* received, float* sent, int64_t width) override;
  // A prefill's dispatch and combine travel while the caller works (EpExperts); a decode step's dispatch is a copy
  // and its combine the allgather, done at the start.
  void start_dispatch(const ExpertRouting& routing, const float* sent, float* received, int64_t width) override;
  void progress_dispatch() override;
  void finish_dispatch() override;
  void start_combine(const ExpertRouting& routing, const float* received, float* sent, int64_t width) override;
  void progress_combine() override;
  void finish_combine() override;
  ExpertTraffic traffic() const override;

 private:
  comm::Communicator& group_;
  comm::Timeout timeout_;
  EpExperts sharded_;  // the prefill's
  bool replicated_ = false;
  int64_t replicated_bytes_ = 0;  // sent by the decode steps' allgathers
};

}  // namespace rf::cp
