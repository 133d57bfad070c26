// memory_table: the memory model's per-rank bytes for training the real Gemma 4 text models (issue 22's Benchmark
// table), computed, not measured: trainer::train_memory_at_least (what `ringflex train` checks before it allocates)
// over each model's parameter registry, built from its config.json as shapes only (nothing is allocated).
//
//   memory_table CONFIG.json... [--ranks 8,16,32,64] [--tokens 32768,65536,131072] [--breakdown N,S] [--mib]
//
// Each config is a Gemma 4 text config.json (bench/trainer/configs: the shapes of E2B, E4B, 26B-A4B and 31B from
// transformers' convert_gemma4_weights.py variants). A row of S tokens is split over N = cp ranks (dp 1, one row a
// step, train.recompute on, float32 compute, every parameter trainable); each cell is the total per rank in GiB for
// parallelism.shard none | optimizer | gradients | full. After the tables, the breakdown by kind of one cell per model
// (N = 32, S = 65536, or --breakdown's N ranks and S tokens, e.g. a benchmark's own cell). Then, for each MoE config
// (26B-A4B), expert parallelism as the system it targets runs it: N = 8 ranks as cp 2 x dp 4 with the experts over EP 8
// (issue 25's EP 8 x CP 2, folded), each shard mode and LoRA (rank 16 on the attention and MLP projections and the
// experts' tensors, shard none), at EP 1 and EP 8. Prints Markdown.
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/memory.h"
#include "model/gemma4.h"
#include "trainer/config.h"
#include "trainer/trainer.h"

namespace {

using rf::trainer::ShardMode;

constexpr double kMiB = 1024.0 * 1024.0;
constexpr double kGiB = 1024.0 * kMiB;
constexpr int kDefaultBreakdownRanks = 32;
constexpr int kDefaultBreakdownTokens = 65536;
constexpr double kShownGiB = 0.05;  // the breakdown's smallest term shown, in the unit: below a rounding of 0.1
// Expert parallelism's table: EP 8 x CP 2 folded onto 8 ranks (dp 4), LoRA at rank 16 (alpha 32).
constexpr int kEpRanks = 8, kEpCp = 2, kEp = 8, kLoraRank = 16, kLoraAlpha = 32;

std::vector<int> parse_list(const std::string& text) {
  std::vector<int> out;
  std::stringstream s(text);
  std::string item;
  while (std::getline(s, item, ',')) out.push_back(std::stoi(item));
  return out;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  RF_CHECK(in.good(), path, ": cannot open");
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

rf::MemoryBreakdown need(const rf::model::Gemma4Multimodal& m, int ranks, int tokens, ShardMode mode) {
  rf::trainer::TrainConfig c;
  c.parallelism.cp = ranks;
  c.parallelism.dp = 1;
  c.parallelism.shard = mode;
  c.train.seq_len = tokens;
  c.train.global_batch = 1;
  c.train.micro_batch = 1;
  c.data.val_rows = 0;
  return rf::trainer::train_memory_at_least(c, m, ranks);
}

// One row of S tokens a step per replica over cp ranks, `ranks` ranks in all, the experts over `ep`; lora: the
// adapters of kLoraRank on the default targets and the experts' tensors, the base frozen (shard none).
rf::MemoryBreakdown need_ep(const rf::model::Gemma4Multimodal& m, int tokens, ShardMode mode, int ep, bool lora) {
  rf::trainer::TrainConfig c;
  c.parallelism.cp = kEpCp;
  c.parallelism.dp = kEpRanks / kEpCp;
  c.parallelism.ep = ep;
  c.parallelism.shard = mode;
  c.train.seq_len = tokens;
  c.train.global_batch = c.parallelism.dp;
  c.train.micro_batch = 1;
  c.data.val_rows = 0;
  if (lora) {
    c.model.lora_rank = kLoraRank;
    c.model.lora_alpha = kLoraAlpha;
    c.model.lora_target_parameters = {"experts.gate_up_proj", "experts.down_proj"};
  }
  return rf::trainer::train_memory_at_least(c, m, kEpRanks);
}

// The figures' unit: GiB to one decimal (the real models), or whole MiB with --mib (a small config beside a
// measured peak RSS, as BENCHMARKS.md's shard-memory table).
struct Unit {
  double bytes = kGiB;
  const char* name = "GiB";
  const char* format = "%.1f";
};
Unit unit;

std::string gib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, unit.format, static_cast<double>(bytes) / unit.bytes);
  return bytes < 0 ? "overflow" : buf;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    std::vector<std::string> configs;
    std::vector<int> ranks = {8, 16, 32, 64}, tokens = {32768, 65536, 131072};
    int breakdown_ranks = kDefaultBreakdownRanks, breakdown_tokens = kDefaultBreakdownTokens;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--ranks" && i + 1 < argc) {
        ranks = parse_list(argv[++i]);
      } else if (a == "--breakdown" && i + 1 < argc) {
        const std::vector<int> cell = parse_list(argv[++i]);
        RF_CHECK(cell.size() == 2, "--breakdown takes N,S (ranks and tokens), got ", argv[i]);
        breakdown_ranks = cell[0];
        breakdown_tokens = cell[1];
      } else if (a == "--tokens" && i + 1 < argc) {
        tokens = parse_list(argv[++i]);
      } else if (a == "--mib") {
        unit = Unit{kMiB, "MiB", "%.0f"};
      } else {
        configs.push_back(a);
      }
    }
    RF_CHECK(!configs.empty(),
             "usage: memory_table CONFIG.json... [--ranks 8,16,32,64] [--tokens 32768,65536,131072] [--breakdown N,S] "
             "[--mib]");
    const ShardMode modes[] = {ShardMode::None, ShardMode::Optimizer, ShardMode::Gradients, ShardMode::Full};
    std::vector<std::pair<std::string, rf::MemoryBreakdown>> breakdowns;
    for (const std::string& path : configs) {
      const rf::model::Gemma4Config cfg = rf::model::Gemma4Config::from_json(read_file(path), path);
      const rf::model::Gemma4Multimodal m(cfg, {}, rf::model::TensorSet::Storage::Deferred);
      std::string name = path.substr(path.find_last_of('/') + 1);
      name = name.substr(0, name.rfind(".json"));
      std::printf("\n%s: %.2f B parameters (%s per rank)\n\n| S | shard |", name.c_str(),
                  static_cast<double>(m.params().total_elements()) / 1e9, unit.name);
      for (int n : ranks) std::printf(" N = %d |", n);
      std::printf("\n|---|---|");
      for (size_t k = 0; k < ranks.size(); ++k) std::printf("---|");
      std::printf("\n");
      for (int s : tokens) {
        for (ShardMode mode : modes) {
          std::printf("| %dK | %s |", s / 1024, std::string(rf::trainer::name_of(mode)).c_str());
          for (int n : ranks) std::printf(" %s |", gib(need(m, n, s, mode).total()).c_str());
          std::printf("\n");
        }
      }
      for (ShardMode mode : modes)
        breakdowns.emplace_back(name + ", shard " + std::string(rf::trainer::name_of(mode)),
                                need(m, breakdown_ranks, breakdown_tokens, mode));
    }
    // Expert parallelism on the MoE configs.
    std::vector<std::pair<std::string, rf::MemoryBreakdown>> ep_breakdowns;
    for (const std::string& path : configs) {
      const rf::model::Gemma4Config cfg = rf::model::Gemma4Config::from_json(read_file(path), path);
      if (!cfg.enable_moe || cfg.num_experts % kEp != 0) continue;
      const rf::model::Gemma4Multimodal m(cfg, {}, rf::model::TensorSet::Storage::Deferred);
      std::string name = path.substr(path.find_last_of('/') + 1);
      name = name.substr(0, name.rfind(".json"));
      std::printf(
          "\n%s, N = %d ranks (cp %d x dp %d), experts over EP 1 or %d (%s per rank)\n\n| S | shard | EP 1 | EP %d |\n"
          "|---|---|---|---|\n",
          name.c_str(), kEpRanks, kEpCp, kEpRanks / kEpCp, kEp, unit.name, kEp);
      for (int s : tokens) {
        for (ShardMode mode : modes)
          std::printf("| %dK | %s | %s | %s |\n", s / 1024, std::string(rf::trainer::name_of(mode)).c_str(),
                      gib(need_ep(m, s, mode, 1, false).total()).c_str(),
                      gib(need_ep(m, s, mode, kEp, false).total()).c_str());
        std::printf("| %dK | LoRA r %d | %s | %s |\n", s / 1024, kLoraRank,
                    gib(need_ep(m, s, ShardMode::None, 1, true).total()).c_str(),
                    gib(need_ep(m, s, ShardMode::None, kEp, true).total()).c_str());
      }
      for (ShardMode mode : modes)
        ep_breakdowns.emplace_back(name + ", EP " + std::to_string(kEp) + ", shard " +
                                       std::string(rf::trainer::name_of(mode)),
                                   need_ep(m, kDefaultBreakdownTokens, mode, kEp, false));
      ep_breakdowns.emplace_back(name + ", EP " + std::to_string(kEp) + ", LoRA",
                                 need_ep(m, kDefaultBreakdownTokens, ShardMode::None, kEp, true));
    }
    std::printf(
        "\nBy kind at N = %d, S = %dK (%s per rank; terms under %.2f %s left out):\n\n| model, mode | terms |\n"
        "|---|---|\n",
        breakdown_ranks, breakdown_tokens / 1024, unit.name, kShownGiB, unit.name);
    for (const auto& [what, b] : breakdowns) {
      std::printf("| %s |", what.c_str());
      for (const rf::MemoryBreakdown::Term& t : b.terms())
        if (static_cast<double>(t.bytes) >= kShownGiB * unit.bytes)
          std::printf(" %s %s;", t.name.c_str(), gib(t.bytes).c_str());
      std::printf(" |\n");
    }
    if (!ep_breakdowns.empty()) {
      std::printf(
          "\nExpert parallelism by kind at N = %d (cp %d x dp %d), S = %dK (%s per rank):\n\n"
          "| model, EP, mode | terms |\n|---|---|\n",
          kEpRanks, kEpCp, kEpRanks / kEpCp, kDefaultBreakdownTokens / 1024, unit.name);
      for (const auto& [what, b] : ep_breakdowns) {
        std::printf("| %s |", what.c_str());
        for (const rf::MemoryBreakdown::Term& t : b.terms())
          if (static_cast<double>(t.bytes) >= kShownGiB * unit.bytes)
            std::printf(" %s %s;", t.name.c_str(), gib(t.bytes).c_str());
        std::printf(" |\n");
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "memory_table: error: %s\n", e.what());
    return 1;
  }
}
