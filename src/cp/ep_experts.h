// ringflex cp: expert parallelism's dispatch over a communicator (core/expert_parallel.h). The EP group's rank r
// holds experts [r * E / P, (r + 1) * E / P) of every MoE layer; route exchanges the rows per expert (one
// alltoallv of counts), dispatch and combine move the rows (one alltoallv each). alltoallv places every byte by the
// counts alone, never by the order of arrival, so the rows an expert runs, and the rows a token combines, are the
// same at any EP and any timing.
#pragma once

#include <vector>

#include "comm/communicator.h"
#include "core/expert_parallel.h"

namespace rf::cp {

class EpExperts final : public ExpertParallel {
 public:
  // group: the EP group; it must outlive this object.
  explicit EpExperts(comm::Communicator& group, comm::Timeout timeout = comm::default_timeout());

  int rank() const override { return group_.rank(); }
  int ranks() const override { return group_.size(); }
  void route(ExpertRouting& routing) override;
  void dispatch(const ExpertRouting& routing, const float* sent, float* received, int64_t width) override;
  void combine(const ExpertRouting& routing, const float* received, float* sent, int64_t width) override;
  // A posted alltoallv (Communicator::post_alltoallv): only its wait counts as exposed time.
  void start_dispatch(const ExpertRouting& routing, const float* sent, float* received, int64_t width) override;
  void progress_dispatch() override;
  void finish_dispatch() override;
  void start_combine(const ExpertRouting& routing, const float* received, float* sent, int64_t width) override;
  void progress_combine() override { progress_dispatch(); }
  void finish_combine() override { finish_dispatch(); }
  ExpertTraffic traffic() const override { return traffic_; }

 private:
  comm::Communicator& group_;
  comm::Timeout timeout_;
  ExpertTraffic traffic_;
  // The started dispatch or combine: its byte counts (the posted collective reads them) and the collective.
  std::vector<size_t> send_bytes_, recv_bytes_;
  comm::PostedPtr posted_;
};

}  // namespace rf::cp
