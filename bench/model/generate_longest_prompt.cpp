// generate_longest_prompt: the longest prompt `ringflex generate` accepts on a checkpoint at P ranks, by the memory
// model (model::generate_job_memory_at_least, the figure `ringflex generate` checks before it allocates anything),
// for the generation benchmark's long-prompt mode (bench/model/bench_generate.py --long). Computed, not measured: the
// checkpoint's shapes are read the way `ringflex generate` reads them (model::load_checkpoint, stopped before it
// allocates), nothing is loaded.
//
//   generate_longest_prompt --model DIR --ranks P [--max-new-tokens N] [--granule 256] [--budget-gib G]
//                           [--compute-dtype float32|bfloat16] [--cache-dtype float32|bfloat16]
//
// The budget is what the check compares against, rf::available_memory_bytes(): MemAvailable (or a cgroup's headroom)
// shared by the P ranks on this machine, capped by RINGFLEX_MEMORY_LIMIT; or --budget-gib per rank. Rank 0's need is
// searched (its shares are the ceilings). Prints one JSON object: budget_bytes, ranks, longest_prompt (the longest
// multiple of --granule that fits; 0: none does), need_bytes and its terms there.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <span>
#include <string>

#include "core/error.h"
#include "core/memory.h"
#include "longest_fitting.h"
#include "model/checkpoint.h"
#include "model/generate_memory.h"

namespace {

// Thrown by the loader's before-allocating hook once it has the shapes: the loader stops there, allocating nothing.
struct ShapesTaken {};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("The longest prompt ringflex generate fits in on this machine, by the memory model");
  std::string model_dir, compute = "float32", cache;
  int ranks = 1, max_new_tokens = 256;
  int granule = 256;  // the search's step
  double budget_gib = 0.0;
  app.add_option("--model", model_dir, "The checkpoint directory")->required();
  app.add_option("--ranks", ranks, "P, the ranks of the job on this machine")->check(CLI::PositiveNumber);
  app.add_option("--max-new-tokens", max_new_tokens, "New tokens after the prompt")->check(CLI::PositiveNumber);
  app.add_option("--granule", granule, "The prompt lengths searched are multiples of this")->check(CLI::PositiveNumber);
  app.add_option("--budget-gib", budget_gib, "Bytes per rank to fit, in GiB (default: what ringflex generate checks)")
      ->check(CLI::PositiveNumber);
  app.add_option("--compute-dtype", compute, "float32 or bfloat16, as ringflex generate");
  app.add_option("--cache-dtype", cache, "float32 or bfloat16 (default: what attention reads)");
  CLI11_PARSE(app, argc, argv);
  try {
    const rf::model::ComputeDtype dtype = rf::model::parse_compute_dtype(compute);
    const rf::DType attention = rf::model::attention_dtype(dtype);
    // As ringflex generate's --cache-dtype: bf16 or what attention reads.
    const rf::DType cache_dtype = cache == "bfloat16" || cache == "bf16" ? rf::DType::BF16 : attention;
    // The ranks of the job share this machine, as under mpirun (the budget's split).
    if (std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE") == nullptr)
      setenv("OMPI_COMM_WORLD_LOCAL_SIZE", std::to_string(ranks).c_str(), 1);
    constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
    const int64_t budget = budget_gib > 0 ? static_cast<int64_t>(budget_gib * kGiB) : rf::available_memory_bytes();
    rf::MemoryBreakdown at_longest;
    int64_t fits = 0;
    bool measured = false;
    try {
      rf::model::load_checkpoint(model_dir, [&](const rf::model::Gemma4Multimodal& shapes) {
        const auto need_at = [&](int64_t tokens) {
          return rf::model::generate_job_memory_at_least(shapes, std::span<const int64_t>(&tokens, 1), max_new_tokens,
                                                         ranks, 0, dtype, cache_dtype);
        };
        // Up to the positions the model has, less the new tokens.
        const int64_t positions = shapes.decoder().config().max_position_embeddings;
        const int64_t longest_searched = positions > 0 ? positions - max_new_tokens : int64_t{1} << 26;
        fits = rf::bench::longest_fitting([&](int64_t tokens) { return need_at(tokens).total(); }, budget, granule,
                                          longest_searched);
        at_longest = need_at(fits > 0 ? fits : granule);
        measured = true;
        throw ShapesTaken{};
      });
    } catch (const ShapesTaken&) {
    }
    RF_CHECK(measured, "generate_longest_prompt: ", model_dir, ": the loader allocated without showing the shapes");
    nlohmann::json terms = nlohmann::json::array();
    for (const rf::MemoryBreakdown::Term& t : at_longest.terms())
      terms.push_back({{"kind", t.name}, {"bytes", t.bytes}});
    const nlohmann::json out = {{"budget_bytes", budget},           {"ranks", ranks},
                                {"max_new_tokens", max_new_tokens}, {"longest_prompt", fits},
                                {"need_bytes", at_longest.total()}, {"terms", terms}};
    std::printf("%s\n", out.dump(2).c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "generate_longest_prompt: error: %s\n", e.what());
    return 1;
  }
}
