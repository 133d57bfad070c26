// ringflex train: Gemma 4 fine-tuning over a cp x dp grid of ranks (docs/spec.md §8.1).
//
//     [mpirun -n N] ringflex train --config FILE.yaml [--set section.key=value ...] [--metrics FILE.jsonl]
//                                  [--resume DIR] [--loss-svg FILE.svg] [--stats FILE.json] [--print-config]
//                                  [--timeout SECONDS]
//     ringflex train --plan [--config FILE.yaml] [--set ...] [--ranks N] [--ranks-per-node R]
//                           [--node-memory SIZE] [--plan-json FILE.json]
//
// The config (src/trainer/config.h) is read and validated on every rank before anything runs; a bad field, bad
// data, an unreadable checkpoint or a run that needs more memory than a rank has (trainer::train_memory_at_least,
// checked before the weights are allocated) fails every rank with the same one-line error. Rank 0 prints progress,
// writes the metrics, the loss picture and the checkpoints. --plan trains nothing: it prints which layouts of N ranks
// fit R a machine of SIZE memory (trainer/plan.h, docs/training.md "Will it fit"), best first.
#include <cstdio>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli/command.h"
#include "comm/agree.h"
#include "comm/mpi_comm.h"
#include "core/memory.h"
#include "io/atomic_file.h"
#include "trainer/config.h"
#include "trainer/plan.h"
#include "trainer/trainer.h"

namespace rf::cli {

namespace {

struct TrainCliOptions {
  std::string config, metrics, resume, loss_svg, stats;
  std::vector<std::string> sets;
  bool print_config = false;
  // --plan: the job's ranks (0: the config's cp x dp), those on a machine (0: all of them) and its memory (empty:
  // this machine's, node_available_bytes), and where its JSON goes.
  bool plan = false;
  int ranks = 0, ranks_per_node = 0;
  std::string node_memory, plan_json;
};

std::string row_text(const trainer::PlanRow& row) {
  char line[160];
  std::snprintf(line, sizeof line, "%-4s %4d %4d %4d  %-9s %-9s %-5s %10s", row.fits ? "yes" : "no", row.cp, row.dp,
                row.ep, std::string(trainer::name_of(row.shard)).c_str(),
                std::string(model::param_dtype_name(row.param_dtype)).c_str(), row.lora ? "LoRA" : "full",
                row.need.total() < 0 ? "> 2^63 B" : format_bytes(row.need.total()).c_str());
  return line;
}

nlohmann::json plan_json(const trainer::Plan& plan, const trainer::PlanMachine& machine) {
  nlohmann::json rows = nlohmann::json::array();
  for (const trainer::PlanRow& row : plan.rows) {
    nlohmann::json terms = nlohmann::json::array();
    for (const MemoryBreakdown::Term& t : row.need.terms()) terms.push_back({{"kind", t.name}, {"bytes", t.bytes}});
    rows.push_back({{"cp", row.cp},
                    {"dp", row.dp},
                    {"ep", row.ep},
                    {"shard", trainer::name_of(row.shard)},
                    {"param_dtype", model::param_dtype_name(row.param_dtype)},
                    {"lora", row.lora},
                    {"fits", row.fits},
                    {"total_bytes", row.need.total()},
                    {"terms", terms}});
  }
  nlohmann::json refused = nlohmann::json::array();
  for (const auto& [why, count] : plan.refused) refused.push_back({{"reason", why}, {"count", count}});
  return {{"ranks", machine.ranks},
          {"ranks_per_node", machine.ranks_per_node},
          {"rank_bytes", machine.rank_bytes},
          {"parameters", plan.parameters},
          {"rows", rows},
          {"refused", refused}};
}

// --plan: every rank works it out (the errors agree), rank 0 prints it.
int run_plan(const TrainCliOptions& opt) {
  const std::unique_ptr<comm::Communicator> world = comm::make_mpi_world();
  trainer::TrainConfig cfg;
  trainer::PlanMachine machine;
  trainer::Plan plan;
  agree(*world, [&] {
    cfg = opt.config.empty() ? trainer::parse_config("", "(defaults)", opt.sets)
                             : trainer::load_config(opt.config, opt.sets);
    machine.ranks = opt.ranks > 0 ? opt.ranks : cfg.parallelism.cp * cfg.parallelism.dp;
    machine.ranks_per_node = opt.ranks_per_node > 0 ? opt.ranks_per_node : machine.ranks;
    const int64_t node =
        opt.node_memory.empty() ? node_available_bytes() : trainer::parse_size(opt.node_memory, "--node-memory");
    machine.rank_bytes = rank_share_bytes(node, machine.ranks_per_node);
    plan = trainer::plan_training(cfg, machine);
    if (world->rank() == 0 && !opt.plan_json.empty())
      io::write_file_atomically(opt.plan_json, plan_json(plan, machine).dump(2) + "\n");
  });
  if (world->rank() != 0) return 0;
  const std::string model = cfg.model.path.empty() ? "model.builtin " + cfg.model.builtin : cfg.model.path;
  const double params = static_cast<double>(plan.parameters);
  const bool billions = params >= 1e9;
  std::printf(
      "%s: %.2f %s parameters; seq_len %d, global_batch %d (%lld tokens a step); %d rank(s), %d a machine, %s "
      "a rank\n",
      model.c_str(), billions ? params / 1e9 : params / 1e6, billions ? "B" : "M", cfg.train.seq_len,
      cfg.train.global_batch, static_cast<long long>(cfg.train.seq_len) * cfg.train.global_batch, machine.ranks,
      machine.ranks_per_node, format_bytes(machine.rank_bytes).c_str());
  std::printf("%-4s %-4s %4s %4s %4s  %-9s %-9s %-5s %10s\n", "#", "fits", "cp", "dp", "ep", "shard", "params", "train",
              "per rank");
  int n = 0;
  for (const trainer::PlanRow& row : plan.rows) {
    std::printf("%-4d %s\n", ++n, row_text(row).c_str());
    std::printf("       %s\n", row.need.describe(std::numeric_limits<size_t>::max()).c_str());
  }
  for (const auto& [why, count] : plan.refused)
    std::printf("not supported, %d combination(s) left out: %s\n", count, why.c_str());
  return 0;
}

int run_train(const TrainCliOptions& opt) {
  if (opt.plan) return run_plan(opt);
  const std::unique_ptr<comm::Communicator> world = comm::make_mpi_world();
  trainer::TrainConfig cfg;
  agree(*world, [&] {
    cfg = opt.config.empty() ? trainer::parse_config("", "(defaults)", opt.sets)
                             : trainer::load_config(opt.config, opt.sets);
    // Printing needs names and types only: a config for another rank count, or whose files are not there yet,
    // still prints (validate checks those against this job when it trains).
    if (!opt.print_config) trainer::validate(cfg, world->size());
  });
  if (opt.print_config) {
    if (world->rank() == 0) std::fputs(trainer::to_yaml(cfg).c_str(), stdout);
    return 0;
  }
  trainer::TrainOptions to;
  to.resume = opt.resume;
  to.metrics_path = opt.metrics;
  to.svg_path = opt.loss_svg;
  to.whole_model = false;  // the weights are in the checkpoints; under shard full no rank gathers them at the end
  to.stats_path = opt.stats;
  trainer::train(cfg, *world, to);
  return 0;
}

}  // namespace

void add_train_command(CLI::App& app, Runner& run) {
  auto opt = std::make_shared<TrainCliOptions>();
  CLI::App* cmd =
      app.add_subcommand("train",
                         "Fine-tune a Gemma 4 (built-in tiny or a Hugging Face checkpoint) over cp x dp ranks");
  cmd->add_option(
      "--config", opt->config,
      "YAML config (sections model, data, optimizer, schedule, parallelism, train, checkpoint); absent: all defaults");
  cmd->add_option("--set", opt->sets, "Override one field, section.key=value (repeatable), e.g. --set train.steps=5");
  CLI::Option* metrics =
      cmd->add_option("--metrics", opt->metrics, "Write one JSON object per optimizer step to this JSONL file");
  CLI::Option* resume =
      cmd->add_option("--resume", opt->resume,
                      "Continue from a checkpoint directory, or the newest one under a checkpoint root");
  CLI::Option* loss_svg =
      cmd->add_option("--loss-svg", opt->loss_svg, "Where to draw the loss curve (default: <checkpoint.dir>/loss.svg)");
  CLI::Option* stats =
      cmd->add_option("--stats", opt->stats,
                      "Write the memory check's per-rank bytes by kind (weight shard, gathered weights, gradients, "
                      "moments, activations, communication buffers) and each rank's peak RSS as JSON at the end");
  CLI::Option* print_config = cmd->add_flag(
      "--print-config", opt->print_config,
      "Print the resolved config (defaults filled in) and exit, without checking it against this job (ranks, files)");
  CLI::Option* plan = cmd->add_flag(
      "--plan", opt->plan,
      "Train nothing: print which cp x dp x ep layouts, shard modes, param dtypes (and LoRA or full, with a "
      "model.lora block) fit the machines below, each with its per-rank bytes by kind, best first");
  // A plan trains, resumes and writes nothing of a run's: those options would be silently ignored.
  for (CLI::Option* run_only : {metrics, resume, loss_svg, stats, print_config}) plan->excludes(run_only);
  cmd->add_option("--ranks", opt->ranks, "--plan: the job's ranks N (default: the config's cp x dp)")
      ->check(CLI::PositiveNumber)
      ->needs(plan);
  cmd->add_option("--ranks-per-node", opt->ranks_per_node,
                  "--plan: the ranks on each machine, which share its memory (default: all N on one)")
      ->check(CLI::PositiveNumber)
      ->needs(plan);
  cmd->add_option("--node-memory", opt->node_memory,
                  "--plan: a machine's memory, e.g. 24GiB (default: what this machine has available; "
                  "RINGFLEX_MEMORY_LIMIT caps a rank's share as it does in training)")
      ->needs(plan);
  cmd->add_option("--plan-json", opt->plan_json, "--plan: also write every row's bytes by kind as JSON to this file")
      ->needs(plan);
  cmd->callback([&run, opt] { run = [opt] { return run_train(*opt); }; });
}

}  // namespace rf::cli
