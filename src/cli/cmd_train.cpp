// ringflex train: Gemma 4 fine-tuning over a cp x dp grid of ranks (docs/spec.md §8.1).
//
//     [mpirun -n N] ringflex train --config FILE.yaml [--set section.key=value ...] [--metrics FILE.jsonl]
//                                  [--resume DIR] [--loss-svg FILE.svg] [--stats FILE.json] [--print-config]
//                                  [--timeout SECONDS]
//
// The config (src/trainer/config.h) is read and validated on every rank before anything runs; a bad field, bad
// data, an unreadable checkpoint or a run that needs more memory than a rank has (trainer::train_memory_at_least,
// checked before the weights are allocated) fails every rank with the same one-line error. Rank 0 prints progress,
// writes the metrics, the loss picture and the checkpoints.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "cli/command.h"
#include "comm/agree.h"
#include "comm/mpi_comm.h"
#include "trainer/config.h"
#include "trainer/trainer.h"

namespace rf::cli {

namespace {

struct TrainCliOptions {
  std::string config, metrics, resume, loss_svg, stats;
  std::vector<std::string> sets;
  bool print_config = false;
};

int run_train(const TrainCliOptions& opt) {
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
  cmd->add_option("--metrics", opt->metrics, "Write one JSON object per optimizer step to this JSONL file");
  cmd->add_option("--resume", opt->resume,
                  "Continue from a checkpoint directory, or the newest one under a checkpoint root");
  cmd->add_option("--loss-svg", opt->loss_svg, "Where to draw the loss curve (default: <checkpoint.dir>/loss.svg)");
  cmd->add_option("--stats", opt->stats,
                  "Write the memory check's per-rank bytes by kind (weight shard, gathered weights, gradients, "
                  "moments, activations, communication buffers) and each rank's peak RSS as JSON at the end");
  cmd->add_flag(
      "--print-config", opt->print_config,
      "Print the resolved config (defaults filled in) and exit, without checking it against this job (ranks, files)");
  cmd->callback([&run, opt] { run = [opt] { return run_train(*opt); }; });
}

}  // namespace rf::cli
