// ringflex cp: the model's parallel context for a job (see parallel_context.h).
#include "cp/parallel_context.h"

#include "cpu/local_attention.h"

namespace rf::cp {

JobContext make_parallel_context(comm::Communicator& cp_group, const CpAttentionOptions& options) {
  JobContext made;
  if (cp_group.size() == 1) {
    made.model = std::make_unique<cpu::LocalAttention>();
    return made;
  }
  auto engine = std::make_unique<CpAttention>(cp_group, options);
  made.cp = engine.get();
  made.model = std::move(engine);
  return made;
}

}  // namespace rf::cp
