// ringflex data: what a config's data becomes before training (docs/text.md, "See what the model sees").
//
//     [mpirun -n N] ringflex data --config FILE.yaml [--set section.key=value ...] [--show N]
//
// Builds the configured source as `ringflex train` does, with the same checks and errors, but reads only the
// model's config (no weights): images are read and laid out by the processor, not encoded. Prints the first N
// conversations as rendered (trained text marked: green on a terminal, between [[ and ]] otherwise) and the totals
// of a jsonl_chat source: conversations, dropped, truncated, skipped, tokens, trained tokens, rows, padding.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "cli/command.h"
#include "comm/agree.h"
#include "comm/mpi_comm.h"
#include "core/error.h"
#include "model/builtin_configs.h"
#include "model/config.h"
#include "model/vision.h"
#include "trainer/config.h"
#include "trainer/data.h"

namespace rf::cli {

namespace {

struct DataCliOptions {
  std::string config;
  std::vector<std::string> sets;
  int show = 3;
};

std::string model_config_text(const trainer::TrainConfig& cfg, std::string& source) {
  if (cfg.model.path.empty()) {
    source = "model.builtin " + cfg.model.builtin;
    return model::builtin_config_json(cfg.model.builtin);
  }
  const std::filesystem::path p = std::filesystem::path(cfg.model.path) / "config.json";
  source = p.string();
  std::ifstream in(p);
  RF_CHECK(in.good(), p.string(), ": cannot open (the model's config)");
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

double percent(int64_t part, int64_t whole) { return whole > 0 ? 100.0 * part / whole : 0.0; }

void print_sample(const trainer::ChatReport::Shown& s, bool colour) {
  std::printf("== %s: %zu tokens, %lld trained", s.where.c_str(), s.sample.ids.size(),
              static_cast<long long>(s.sample.trained_tokens()));
  if (!s.image_slots.empty()) {
    std::printf("; each <|image|> becomes <|image>, its soft tokens, <image|>: ");
    for (size_t i = 0; i < s.image_slots.size(); ++i)
      std::printf("%s%lld", i ? ", " : "", static_cast<long long>(s.image_slots[i]));
    std::printf(" soft tokens");
  }
  std::printf("\n");
  for (const auto& seg : s.sample.segments) {
    if (!seg.trained) {
      std::fputs(seg.text.c_str(), stdout);
      continue;
    }
    std::fputs(colour ? "\x1b[32m" : "[[", stdout);
    std::fputs(seg.text.c_str(), stdout);
    std::fputs(colour ? "\x1b[0m" : "]]", stdout);
  }
  std::printf("\n");
}

int run_data(const DataCliOptions& opt) {
  const std::unique_ptr<comm::Communicator> world = comm::make_mpi_world();
  trainer::TrainConfig cfg;
  trainer::ChatReport report;
  agree(*world, [&] {
    cfg = trainer::load_config(opt.config, opt.sets);
    // Checked for the grid it names, not this job's ranks: the data is the same at any rank count.
    trainer::validate(cfg, cfg.parallelism.cp * cfg.parallelism.dp);
    RF_CHECK(opt.show >= 0, "--show ", opt.show, " must be >= 0");
    std::string source;
    const std::string text = model_config_text(cfg, source);
    const model::Gemma4Config mc = model::Gemma4Config::from_json(text, source);
    const trainer::DataContract contract{mc.vocab_size, mc.pad_token_id.value_or(0), 0, cfg.model.path};
    trainer::ImageContract images;
    images.tokens = model::MultimodalTokens::from_config_json(text, source);
    const std::optional<model::VisionConfig> tower = model::VisionConfig::from_config_json(text, source);
    model::ImageProcessorConfig proc;
    if (tower) {
      proc.patch_size = tower->patch_size;
      proc.pooling_kernel_size = tower->pooling_kernel_size;
    }
    images.processor_only = proc;
    trainer::make_data_source(cfg, contract, images, &report, opt.show);
  });
  if (world->rank() != 0) return 0;
  const bool colour = isatty(STDOUT_FILENO) != 0 && std::getenv("NO_COLOR") == nullptr;
  for (const auto& s : report.shown) print_sample(s, colour);
  if (cfg.data.source != trainer::SourceKind::JsonlChat) {
    std::printf("data.source = %s: the totals are jsonl_chat's\n", std::string(name_of(cfg.data.source)).c_str());
  }
  const int64_t kept = report.conversations - report.dropped - report.skipped;
  std::printf(
      "conversations: %lld read, %lld kept, %lld dropped (longer than train.seq_len = %d), %lld truncated, "
      "%lld skipped (nothing to train on)\n",
      static_cast<long long>(report.conversations), static_cast<long long>(kept),
      static_cast<long long>(report.dropped), cfg.train.seq_len, static_cast<long long>(report.truncated),
      static_cast<long long>(report.skipped));
  std::printf("tokens: %lld, trained %lld (%.1f%%)\n", static_cast<long long>(report.tokens),
              static_cast<long long>(report.trained_tokens), percent(report.trained_tokens, report.tokens));
  std::printf("rows: %lld of %d tokens (%lld for validation), padding %.1f%%\n", static_cast<long long>(report.rows),
              cfg.train.seq_len, static_cast<long long>(std::min<int64_t>(cfg.data.val_rows, report.rows)),
              percent(report.padding, report.row_tokens));
  return 0;
}

}  // namespace

void add_data_command(CLI::App& app, Runner& run) {
  auto opt = std::make_shared<DataCliOptions>();
  CLI::App* cmd = app.add_subcommand(
      "data",
      "Show what a training config's data becomes: the first conversations as rendered, the trained tokens "
      "marked, and the totals (conversations, dropped, skipped, tokens, rows, padding)");
  cmd->add_option("--config", opt->config, "YAML config (as `ringflex train` takes it)")->required();
  cmd->add_option("--set", opt->sets, "Override one field, section.key=value (repeatable)");
  cmd->add_option("--show", opt->show, "How many conversations to print (default 3)");
  cmd->callback([&run, opt] { run = [opt] { return run_data(*opt); }; });
}

}  // namespace rf::cli
