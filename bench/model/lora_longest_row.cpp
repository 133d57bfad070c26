// lora_longest_row: the longest row a `ringflex train` config fits in on this machine, by the memory model
// (trainer::train_memory_at_least, the figure `ringflex train` checks before it allocates anything), for the LoRA
// benchmark's driver (bench/model/bench_lora_e2b.py). Computed, not measured: the checkpoint's shapes are read the
// way `ringflex train` reads them (model::load_checkpoint, stopped before it allocates), nothing is loaded.
//
//   lora_longest_row --config FILE.yaml [--set section.key=value ...] [--granule 512] [--budget-gib G]
//
// The budget is what the check compares against, rf::available_memory_bytes(): MemAvailable (or a cgroup's headroom)
// shared by the config's cp x dp ranks on this machine, capped by RINGFLEX_MEMORY_LIMIT; or --budget-gib per rank
// (planning for another machine, or this one idle). Prints one JSON object:
//   budget_bytes, ranks, seq_len (the config's) and need_bytes / terms at it, longest_seq_len (the longest multiple
//   of --granule whose need fits the budget; 0: none does) and need_at_longest_bytes; with train.spill_dir, the
//   spill file's disk bytes per rank at both (spill_bytes, spill_at_longest_bytes: disk, not in the memory figures);
//   what the backward recomputes at both (recompute, recompute_at_longest: trainer::describe_recompute, the
//   config's auto fields chosen at that length).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/memory.h"
#include "longest_fitting.h"
#include "model/checkpoint.h"
#include "model/gemma4.h"
#include "trainer/config.h"
#include "trainer/trainer.h"

namespace {

// Thrown by the loader's before-allocating hook once it has the shapes: the loader stops there, allocating nothing.
struct ShapesTaken {};

// `c` at `seq_len` tokens a row, the recompute fields it leaves at auto chosen against `budget` as `ringflex train`
// chooses them (trainer::choose_recompute), for the shapes the loader shows (the model's type is the loader's
// BeforeAllocating argument, whatever it is).
template <typename Shapes>
rf::trainer::TrainConfig chosen_at(rf::trainer::TrainConfig c, const Shapes& shapes, int seq_len, int64_t budget) {
  c.train.seq_len = seq_len;
  const int ranks = c.parallelism.cp * c.parallelism.dp;
  return rf::trainer::choose_recompute(c, shapes, ranks, rf::local_ranks(), {}, budget);
}

// The config's need per rank at `seq_len` tokens a row, with that choice.
template <typename Shapes>
rf::MemoryBreakdown need_at(const rf::trainer::TrainConfig& c, const Shapes& shapes, int seq_len, int64_t budget) {
  return rf::trainer::train_memory_at_least(chosen_at(c, shapes, seq_len, budget), shapes,
                                            c.parallelism.cp * c.parallelism.dp);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("The longest row a ringflex train config fits in on this machine, by the memory model");
  std::string config;
  std::vector<std::string> sets;
  int granule = 512;  // the search's step: rows are cut in multiples of it (cp and the attention blocks divide it)
  double budget_gib = 0.0;
  app.add_option("--config", config, "The ringflex train config (YAML)")->required();
  app.add_option("--set", sets, "Override one field, section.key=value (repeatable), as ringflex train --set");
  app.add_option("--granule", granule, "The row lengths searched are multiples of this")->check(CLI::PositiveNumber);
  app.add_option("--budget-gib", budget_gib,
                 "Bytes per rank to fit, in GiB (default: what ringflex train's check uses)")
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  try {
    const rf::trainer::TrainConfig c = rf::trainer::load_config(config, sets);
    const int ranks = c.parallelism.cp * c.parallelism.dp;
    RF_CHECK(!c.model.path.empty(),
             "lora_longest_row: the config has no model.path (a checkpoint to read shapes from)");
    // The ranks of the job share this machine, as under mpirun (the mapped base's share and the budget's split).
    if (std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE") == nullptr)
      setenv("OMPI_COMM_WORLD_LOCAL_SIZE", std::to_string(ranks).c_str(), 1);
    constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
    const int64_t budget = budget_gib > 0 ? static_cast<int64_t>(budget_gib * kGiB) : rf::available_memory_bytes();
    rf::MemoryBreakdown at_config;
    int fits = 0;
    int64_t at_longest = 0, spill_at_config = 0, spill_at_longest = 0;
    std::string recompute_at_config, recompute_at_longest;
    bool measured = false;
    try {
      rf::model::load_checkpoint(c.model.path, [&](const auto& shapes) {
        at_config = need_at(c, shapes, c.train.seq_len, budget);
        constexpr int64_t kLongestSearched = int64_t{1} << 22;  // 4M tokens, far past any row this machine holds
        fits = static_cast<int>(rf::bench::longest_fitting(
            [&](int64_t tokens) { return need_at(c, shapes, static_cast<int>(tokens), budget).total(); }, budget,
            granule, kLongestSearched));
        at_longest = fits > 0 ? need_at(c, shapes, fits, budget).total() : 0;
        const rf::trainer::TrainConfig at = chosen_at(c, shapes, c.train.seq_len, budget);
        spill_at_config = rf::trainer::train_spill_bytes(at, shapes);
        recompute_at_config = rf::trainer::describe_recompute(at);
        if (fits > 0) {
          const rf::trainer::TrainConfig longest = chosen_at(c, shapes, fits, budget);
          spill_at_longest = rf::trainer::train_spill_bytes(longest, shapes);
          recompute_at_longest = rf::trainer::describe_recompute(longest);
        }
        measured = true;
        throw ShapesTaken{};
      });
    } catch (const ShapesTaken&) {
    }
    RF_CHECK(measured, "lora_longest_row: ", c.model.path, ": the loader allocated without showing the shapes");
    nlohmann::json terms = nlohmann::json::array();
    for (const rf::MemoryBreakdown::Term& t : at_config.terms())
      terms.push_back({{"kind", t.name}, {"bytes", t.bytes}});
    const nlohmann::json out = {{"budget_bytes", budget},
                                {"ranks", ranks},
                                {"seq_len", c.train.seq_len},
                                {"need_bytes", at_config.total()},
                                {"terms", terms},
                                {"longest_seq_len", fits},
                                {"need_at_longest_bytes", at_longest},
                                {"spill_bytes", spill_at_config},
                                {"spill_at_longest_bytes", spill_at_longest},
                                {"recompute", recompute_at_config},
                                {"recompute_at_longest", recompute_at_longest}};
    std::printf("%s\n", out.dump(2).c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lora_longest_row: error: %s\n", e.what());
    return 1;
  }
}
