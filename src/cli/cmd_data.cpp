// ringflex data: what a config's data becomes before training (docs/text.md, "See what the model sees").
//
//     [mpirun -n N] ringflex data --config FILE.yaml [--set section.key=value ...] [--show N]
//
// Builds the configured source as `ringflex train` does, with the same checks and errors, but reads only the
// model's config (no weights): images are read and laid out by the processor, not encoded. Prints the first N
// conversations as rendered (trained text marked: green on a terminal, between [[ and ]] otherwise) and the totals
// of a jsonl_chat source: conversations, dropped, truncated, skipped, tokens, trained tokens, rows, padding.
//
//     ringflex data --config FILE.yaml --set model.path=CHECKPOINT --held-out PROMPT.safetensors [--answer OUT.jsonl]
//
// --held-out: a held-out document as a question for `ringflex generate --in` (trainer::held_out_prompt: the first
// validation document with a picture, cut after the text that follows it), its pictures encoded by model.path's
// tower as training encodes them; prints the prompt and the expected continuation. With --answer (generate's --out
// for that prompt) it writes nothing and prints the expected continuation beside the model's. The mock data's tokens
// are shown as words (trainer::mock::token_names).
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
#include "io/jsonl.h"
#include "io/safetensors.h"
#include "model/builtin_configs.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/vision.h"
#include "trainer/config.h"
#include "trainer/data.h"
#include "trainer/samples.h"

namespace rf::cli {

namespace {

struct DataCliOptions {
  std::string config;
  std::vector<std::string> sets;
  int show = 3;
  std::string held_out, answer;
  int expected_tokens = 12;
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

// Token ids as a reader sees them: the mock vocabulary's words, else the ids.
std::string shown(const trainer::TrainConfig& cfg, std::span<const int32_t> ids) {
  return cfg.data.source == trainer::SourceKind::Mock ? trainer::mock::token_names(ids) : trainer::ids_text(ids);
}

// --held-out (and --answer): the data built as `ringflex train` builds it on model.path's checkpoint (its tower
// encodes the pictures), one held-out document cut into a prompt and its expected continuation.
int run_held_out(const DataCliOptions& opt) {
  const std::unique_ptr<comm::Communicator> world = comm::make_mpi_world();
  trainer::TrainConfig cfg;
  trainer::HeldOutPrompt q;
  std::vector<int32_t> answer;
  int feature_dim = 0;
  agree(*world, [&] {
    cfg = trainer::load_config(opt.config, opt.sets);
    trainer::validate(cfg, cfg.parallelism.cp * cfg.parallelism.dp);
    RF_CHECK(!cfg.model.path.empty(), "--held-out needs model.path (the checkpoint whose tower encodes the pictures, ",
             "e.g. --set model.path=runs/NAME/step-00000300)");
    if (!opt.answer.empty()) {
      int lines = 0;
      io::for_each_line(opt.answer, [&](const nlohmann::json& j, const std::string& where) {
        RF_CHECK(j.contains("token_ids") && j["token_ids"].is_array(), where, ": no token_ids (not generate's --out)");
        if (lines++ == 0) answer = j["token_ids"].get<std::vector<int32_t>>();
      });
      RF_CHECK(lines > 0, opt.answer, ": no records (generate's --out has one a prompt)");
    }
    model::Checkpoint ck = model::load_checkpoint(cfg.model.path);
    model::Gemma4Multimodal& m = *ck.model;
    feature_dim = m.vision_feature_dim() > 0 ? m.vision_feature_dim() : m.config().hidden_size;
    const trainer::DataContract contract{m.config().vocab_size, m.config().pad_token_id.value_or(0), feature_dim,
                                         cfg.model.path};
    trainer::ImageContract images;
    images.tokens = model::MultimodalTokens::from_config_json(m.config().source_json, cfg.model.path);
    images.vision = [&]() -> const model::VisionEncoder* { return m.vision_tower(); };
    m.set_vision_compute_dtype(cfg.model.compute_dtype);
    q = trainer::held_out_prompt(*trainer::make_data_source(cfg, contract, images), opt.expected_tokens);
    if (world->rank() != 0 || !opt.answer.empty()) return;
    io::SafetensorsWriter w;
    const std::vector<int64_t> row{1, static_cast<int64_t>(q.ids.size())};
    w.add("input_ids", io::StDType::I32, row, std::span<const int32_t>(q.ids));
    w.add("mm_token_type_ids", io::StDType::I32, row, std::span<const int32_t>(q.mm_token_type));
    if (q.slots > 0)
      w.add("image_features", io::StDType::F32, {q.slots, static_cast<int64_t>(feature_dim)},
            std::span<const float>(q.image_features));
    w.write(opt.held_out);
  });
  if (world->rank() != 0) return 0;
  if (opt.answer.empty()) {
    std::printf("held-out document (validation row %d), the prompt: %s\n", q.row, shown(cfg, q.ids).c_str());
    std::printf("written to %s (ringflex generate --in)\n", opt.held_out.c_str());
    return 0;
  }
  std::printf("asked:    %s\nexpected: %s\nmodel:    %s\n", shown(cfg, q.ids).c_str(), shown(cfg, q.expected).c_str(),
              shown(cfg, answer).c_str());
  const size_t n = std::min(q.expected.size(), answer.size());
  size_t same = 0;
  while (same < n && q.expected[same] == answer[same]) ++same;
  std::printf("the model's first %zu of %zu tokens are the expected ones\n", same, q.expected.size());
  return 0;
}

int run_data(const DataCliOptions& opt) {
  if (!opt.held_out.empty()) return run_held_out(opt);
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
  cmd->add_option("--held-out", opt->held_out,
                  "Write a held-out document's opening as a prompt for `ringflex generate --in` (needs model.path)");
  cmd->add_option("--answer", opt->answer,
                  "With --held-out: generate's --out for that prompt; print it beside the expected continuation");
  cmd->add_option("--expected-tokens", opt->expected_tokens,
                  "With --held-out: how many tokens of the document's continuation to expect (default 12)");
  cmd->callback([&run, opt] { run = [opt] { return run_data(*opt); }; });
}

}  // namespace rf::cli
