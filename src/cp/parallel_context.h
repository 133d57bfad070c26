// ringflex cp: the one place a job chooses the model's parallel context (core/attention_backend.h): the local kernels
// when its CP group is one rank, the CP engine over the group otherwise. The trainer and `ringflex forward` both
// build theirs here, so the choice and its options live in one function; with an EP group of several ranks the
// context's experts are dispatched over it (cp/ep_experts.h), and with a CP group of several ranks the vision tower's
// images are split over it (cp/image_split.h) unless split_images is false (parallelism.split_vision).
#pragma once

#include <memory>

#include "comm/communicator.h"
#include "core/attention_backend.h"
#include "cp/cp_backend.h"

namespace rf::cp {

struct JobContext {
  std::unique_ptr<ParallelContext> model;  // what the model is handed
  const CpAttention* cp = nullptr;         // the same object when the group has several ranks (its totals, its
                                           // shard map), else null
};

// cp_group: the ranks that share the rows' tokens; ep_group: the ranks that divide the experts of every MoE layer
// among them (null or one rank: every expert local). Both must outlive the context. split_images false: every rank
// of the CP group encodes every image itself (the context's images() are local).
JobContext make_parallel_context(comm::Communicator& cp_group, const CpAttentionOptions& options = {},
                                 comm::Communicator* ep_group = nullptr, bool split_images = true);

}  // namespace rf::cp
