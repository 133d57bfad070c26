// ringflex cp: the model's parallel context for a job (see parallel_context.h).
#include "cp/parallel_context.h"

#include "cp/ep_experts.h"
#include "cp/image_split.h"
#include "cpu/local_attention.h"

namespace rf::cp {

JobContext make_parallel_context(comm::Communicator& cp_group, const CpAttentionOptions& options,
                                 comm::Communicator* ep_group, bool split_images) {
  JobContext made;
  if (cp_group.size() == 1) {
    made.model = std::make_unique<cpu::LocalAttention>();
  } else {
    auto engine = std::make_unique<CpAttention>(cp_group, options);
    made.cp = engine.get();
    made.model = std::move(engine);
  }
  if (ep_group && ep_group->size() > 1)
    made.model->set_experts(std::make_unique<EpExperts>(*ep_group, options.timeout));
  if (split_images && cp_group.size() > 1)
    made.model->set_images(std::make_unique<SplitImages>(cp_group, options.timeout));
  return made;
}

}  // namespace rf::cp
