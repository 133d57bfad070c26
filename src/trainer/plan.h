// ringflex trainer: which layouts of a job fit its machines, before anything is downloaded or allocated
// (`ringflex train --plan`, docs/training.md "Will it fit").
//
// Every cp x dp x ep layout of the ranks, shard mode, param dtype and (with a model.lora block) LoRA or full
// fine-tuning is asked of the trainer's own rules: the training state's supports, validate_parallelism and the
// model's experts over ep; each supported one is priced by train_memory_at_least, the figure `ringflex train`
// checks before it allocates, so a row that fits here passes that check on such a machine and one that does not is
// refused by it with the same terms.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/memory.h"
#include "model/ops.h"
#include "trainer/config.h"

namespace rf::trainer {

struct PlanMachine {
  int ranks = 1;           // N = cp x dp, the job's ranks
  int ranks_per_node = 1;  // of them on each machine (they share its memory, and a LoRA base's mapped pages)
  int64_t rank_bytes = 0;  // what one rank may allocate: rank_share_bytes(node memory, ranks_per_node)
};

struct PlanRow {
  int cp = 1, dp = 1, ep = 1;
  ShardMode shard = ShardMode::None;
  model::ParamDtype param_dtype = model::ParamDtype::Float32;
  bool lora = false;     // the config's model.lora adapters over a frozen base, or every parameter trained
  MemoryBreakdown need;  // train_memory_at_least of row_config
  bool fits = false;     // need.total() within PlanMachine::rank_bytes
};

struct Plan {
  int64_t parameters = 0;  // the model's parameter count (the registry: decoder, and the tower with train_vision)
  // Best first: the rows that fit, the simplest first (the config's own LoRA or full training, then shard none,
  // optimizer, gradients, full: each shares more of the state and adds collectives; ep 1 before expert
  // parallelism's all-to-alls; float32 weights before bfloat16's rounding; the fewest CP ranks, whose ring runs every
  // layer where DP reduces once a step; then the fewest bytes). Then the rows that do not fit, nearest first.
  std::vector<PlanRow> rows;
  // The combinations no training state runs (or the layout rules refuse): each reason once, with how many.
  std::vector<std::pair<std::string, int>> refused;
};

// The plan for `c`'s model, seq_len, batch and options on `machine` (`c`'s own parallelism, shard, param_dtype are
// what the rows vary). Throws rf::Error when the model cannot be read (model.path's config.json) or no combination
// is supported at all (the first reason).
Plan plan_training(const TrainConfig& c, const PlanMachine& machine);

// `c` with the row's layout: what `ringflex train` runs for that row.
TrainConfig row_config(const TrainConfig& c, const PlanRow& row);

}  // namespace rf::trainer
