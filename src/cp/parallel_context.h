// ringflex cp: the one place a job chooses the model's parallel context (core/attention_backend.h): the local kernels
// when its CP group is one rank, the CP engine over the group otherwise. The trainer and `ringflex forward` both
// build theirs here, so the choice and its options live in one function; with an EP group of several ranks the
// context's experts are dispatched over it (cp/ep_experts.h).
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
// among them (null or one rank: every expert local). Both must outlive the context.
JobContext make_parallel_context(comm::Communicator& cp_group, const CpAttentionOptions& options = {},
                                 comm::Communicator* ep_group = nullptr);

}  // namespace rf::cp
