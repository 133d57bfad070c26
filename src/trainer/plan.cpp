// ringflex trainer: the layouts of a job that fit (see plan.h).
#include "trainer/plan.h"

#include <algorithm>
#include <memory>
#include <tuple>

#include "core/error.h"
#include "trainer/run.h"
#include "trainer/state/state.h"
#include "trainer/trainer.h"

namespace rf::trainer {

namespace {

std::vector<int> divisors(int n) {
  std::vector<int> out;
  for (int d = 1; d <= n; ++d)
    if (n % d == 0) out.push_back(d);
  return out;
}

// Why `rc` cannot run on `ranks` ranks of `shapes`' model (empty: it can), in the words validate and set_up use.
std::string refusal(const TrainConfig& rc, int ranks, const model::Gemma4Multimodal& shapes) {
  const detail::Support support = detail::plan_state(rc)->supports(rc);
  if (!support) return "config: " + support.refusal;
  try {
    validate_parallelism(rc, ranks);
    detail::check_expert_parallelism(rc, shapes.config());
  } catch (const rf::Error& e) {
    return e.what();
  }
  return {};
}

// plan.h's order: a smaller key is better.
auto rank_key(const PlanRow& r, bool config_lora) {
  const int64_t total = r.need.total() < 0 ? INT64_MAX : r.need.total();
  if (!r.fits) return std::make_tuple(1, 0, 0, 0, 0, 0, total);
  return std::make_tuple(0, r.lora != config_lora ? 1 : 0, static_cast<int>(r.shard), r.ep,
                         static_cast<int>(r.param_dtype), r.cp, total);
}

}  // namespace

TrainConfig row_config(const TrainConfig& c, const PlanRow& row) {
  TrainConfig rc = c;
  rc.parallelism.cp = row.cp;
  rc.parallelism.dp = row.dp;
  rc.parallelism.ep = row.ep;
  rc.parallelism.shard = row.shard;
  rc.model.param_dtype = row.param_dtype;
  if (!row.lora) rc.model.lora_rank = 0;
  return rc;
}

Plan plan_training(const TrainConfig& c, const PlanMachine& machine) {
  RF_CHECK(machine.ranks >= 1, "train --plan: --ranks = ", machine.ranks, " must be >= 1");
  RF_CHECK(machine.ranks_per_node >= 1 && machine.ranks_per_node <= machine.ranks,
           "train --plan: --ranks-per-node = ", machine.ranks_per_node, " must be in [1, --ranks = ", machine.ranks,
           "]");
  RF_CHECK(machine.rank_bytes > 0, "train --plan: ", format_bytes(machine.rank_bytes),
           " per rank leaves nothing to train in (--node-memory / --ranks-per-node)");
  // The registry the check counts, shapes only: model.path's config.json (no weights read) or the built-in.
  const std::unique_ptr<model::Gemma4Multimodal> shapes = detail::model_shapes(c);
  // train.samples' prompts, read as `ringflex train` reads them (their images' slots laid out by the processor, no
  // tower run): their generation's KV cache is in every row. One CP rank reads them: the CP size only decides
  // whether an image prompt is long enough to split, which `ringflex train` checks at its own.
  const std::vector<int64_t> sample_tokens =
      c.train.samples_prompts.empty() ? std::vector<int64_t>{} : prompt_lengths(read_sample_prompts(c, *shapes, 1));
  Plan plan;
  plan.parameters = shapes->params().total_elements();
  const bool config_lora = c.model.lora_rank != 0;
  // LoRA rows take the config's adapters (rank, targets): the plan never invents them, so they come with a
  // model.lora block, beside full fine-tuning.
  std::vector<bool> trainings = {false};
  if (config_lora) trainings.insert(trainings.begin(), true);
  const ShardMode shards[] = {ShardMode::None, ShardMode::Optimizer, ShardMode::Gradients, ShardMode::Full};
  const model::ParamDtype dtypes[] = {model::ParamDtype::Float32, model::ParamDtype::Bfloat16};
  const auto refuse = [&](const std::string& why) {
    const auto at =
        std::find_if(plan.refused.begin(), plan.refused.end(), [&](const auto& r) { return r.first == why; });
    if (at == plan.refused.end()) {
      plan.refused.emplace_back(why, 1);
    } else {
      ++at->second;
    }
  };
  for (const bool lora : trainings)
    for (const int cp : divisors(machine.ranks))
      for (const int ep : divisors(machine.ranks))
        for (const ShardMode shard : shards)
          for (const model::ParamDtype dtype : dtypes) {
            PlanRow row;
            row.cp = cp;
            row.dp = machine.ranks / cp;
            row.ep = ep;
            row.shard = shard;
            row.param_dtype = dtype;
            row.lora = lora;
            TrainConfig rc = row_config(c, row);
            // ep > 1 on a dense model, or one its experts do not divide, is no layout at all: left out unsaid.
            if (ep > 1 && (!shapes->config().enable_moe || shapes->config().num_experts % ep != 0)) continue;
            if (const std::string why = refusal(rc, machine.ranks, *shapes); !why.empty()) {
              refuse(why);
              continue;
            }
            // What `ringflex train` would check for this row: its recompute fields left at auto chosen first.
            rc =
                choose_recompute(rc, *shapes, machine.ranks, machine.ranks_per_node, sample_tokens, machine.rank_bytes);
            row.need = train_memory_at_least(rc, *shapes, machine.ranks, machine.ranks_per_node, sample_tokens);
            row.fits = row.need.total() >= 0 && row.need.total() <= machine.rank_bytes;
            plan.rows.push_back(std::move(row));
          }
  RF_CHECK(!plan.rows.empty(), "train --plan: no layout of ", machine.ranks,
           " rank(s) is supported: ", plan.refused.empty() ? std::string("none to try") : plan.refused.front().first);
  std::stable_sort(plan.rows.begin(), plan.rows.end(), [&](const PlanRow& a, const PlanRow& b) {
    return rank_key(a, config_lora) < rank_key(b, config_lora);
  });
  return plan;
}

}  // namespace rf::trainer
