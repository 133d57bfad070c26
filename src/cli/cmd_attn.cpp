// ringflex attn: masked attention of a safetensors file's q/k/v (and backward with dout), docs/spec.md §7.
//
//     ringflex attn --in IN.safetensors --out OUT.safetensors [--window W] [--no-causal] [--bidirectional-groups]
//                   [--scale X] [--shard contiguous|zigzag|balanced] [--algo ring|allgather] [--threads N]
//                   [--stats FILE.json] [--no-check-finite] [--timeout SECONDS]
//
// Run as `mpirun -n P ringflex attn ...` or plainly (P = 1). Every rank reads and validates the input itself and
// checks what the job needs against its memory before copying the tensors (attn_memory_at_least), the ranks agree
// that all of them succeeded (a bad input is one line on every rank, never a hang), the job runs through the CP
// boundary (attn_job.h), and rank 0 writes the outputs.
#include <omp.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cli/attn_job.h"
#include "cli/command.h"
#include "comm/agree.h"
#include "comm/mpi_comm.h"
#include "core/error.h"
#include "core/memory.h"
#include "io/atomic_file.h"

namespace rf::cli {

namespace {

constexpr int kMaxThreads = 1024;  // a sanity bound for --threads, far above any machine this runs on

struct AttnOptions {
  std::string in, out;
  LayerMask mask;
  bool no_causal = false;  // --no-causal; folded into mask.causal when the command runs
  std::optional<float> scale;
  CpOptions cp;
  int threads = 0;           // 0: OpenMP's default (every core)
  std::string stats;         // --stats: per-rank CP figures as JSON
  bool check_finite = true;  // reject NaN/inf in q, k, v, dout before computing (docs/numerics.md)
};

// Every output this job writes, checked before any work (on rank 0, the writer; `agree` makes every rank fail
// with its message): writable, and no two options naming one file.
void check_outputs(const AttnOptions& opt) {
  RF_CHECK(opt.stats.empty() || !io::same_destination(opt.out, opt.stats), "--stats ", opt.stats, " and --out ",
           opt.out, " name the same file");
  io::check_writable(opt.out);
  if (!opt.stats.empty()) io::check_writable(opt.stats);
}

// The outputs, all or nothing: the main output and --stats are written and synced first, then both renamed.
void write_outputs(const AttnOptions& opt, const AttnJob& job, const AttnResult& result) {
  io::AtomicFile out(opt.out);
  write_attn_result(out, job, result);
  std::vector<io::AtomicFile*> files = {&out};
  std::optional<io::AtomicFile> stats;
  if (!opt.stats.empty()) {
    stats.emplace(opt.stats);
    stats->write(result.stats_json);
    files.push_back(&*stats);
  }
  io::commit_all(files);
}

int run_attn(const AttnOptions& opt) {
  if (opt.threads > 0) omp_set_num_threads(opt.threads);
  const std::unique_ptr<comm::Communicator> world = comm::make_mpi_world();
  AttnJob job;
  {
    const comm::Step step("agreeing that every rank read the input");
    agree(*world, [&] {
      if (world->rank() == 0) check_outputs(opt);
      // What the job needs on this rank, checked before its tensors are copied (a job beyond the machine stops
      // with the figure, on every rank, instead of std::bad_alloc part-way).
      const auto check_fits = [&](const AttnJob& header) {
        const AttnShape& s = header.shape;
        check_memory(attn_memory_at_least(header, opt.cp, world->size(), world->rank()), opt.in + ": attn",
                     concat(" at B = ", s.B, ", S = ", s.Lq, " over ", world->size(), " rank(s)"));
      };
      job = read_attn_job(opt.in, opt.mask, opt.scale, opt.check_finite, check_fits);
    });
  }
  AttnResult result;
  {
    const comm::Step step("running the attention job");
    result = run_attention(job, opt.cp, *world);
  }
  const comm::Step step("agreeing that rank 0 wrote the outputs");
  agree(*world, [&] {
    if (world->rank() == 0) write_outputs(opt, job, result);
  });
  if (world->rank() == 0) {
    const AttnShape& s = job.shape;
    std::printf("ringflex attn: wrote %s (B=%d Hq=%d Hkv=%d S=%d D=%d %s, mask %s): forward %.3f s", opt.out.c_str(),
                s.B, s.Hq, s.Hkv, s.Lq, s.D, std::string(dtype_name(job.dtype)).c_str(), job.mask.name().c_str(),
                result.forward_seconds);
    if (job.has_dout) std::printf(", backward %.3f s", result.backward_seconds);
    std::printf("\n");
  }
  return 0;
}

}  // namespace

void add_attn_command(CLI::App& app, Runner& run) {
  auto opt = std::make_shared<AttnOptions>();
  CLI::App* cmd = app.add_subcommand("attn", "Masked attention (and its backward) of a safetensors file's q, k, v");
  cmd->add_option("--in", opt->in, "Input: q, k, v [, dout, doc, group]")->required();
  cmd->add_option("--out", opt->out, "Output: out, lse [, dq, dk, dv]")->required();
  cmd->add_option("--window", opt->mask.window, "Sliding window W (0 = none)");
  cmd->add_flag("--no-causal", opt->no_causal, "Let queries see later keys");
  cmd->add_flag("--bidirectional-groups", opt->mask.bidirectional_groups, "Image groups see each other fully");
  // Checked as text before conversion: a finite value beyond float32's range would otherwise arrive as an infinity
  // and be reported as one (read_attn_job rejects the typed nan and inf).
  cmd->add_option("--scale", opt->scale, "Multiplier of q.k (default 1/sqrt(D))")
      ->check(CLI::Validator(
          [](const std::string& text) {
            const double x = std::strtod(text.c_str(), nullptr);
            return std::isfinite(x) && std::fabs(x) > std::numeric_limits<float>::max()
                       ? text + " is beyond float32's range (|scale| <= 3.4e38)"
                       : std::string();
          },
          "FLOAT32", "float32 range"));
  cmd->add_option("--shard", opt->cp.shard, "Sharding scheme (default: the best one)")
      ->check(CLI::IsMember({"contiguous", "zigzag", "balanced"}));
  cmd->add_option("--algo", opt->cp.algo, "CP algorithm")->check(CLI::IsMember({"ring", "allgather"}));
  cmd->add_option("--stats", opt->stats, "Write per-rank CP figures (work, bytes, memory, times) as JSON");
  cmd->add_flag("--check-finite,!--no-check-finite", opt->check_finite,
                "Reject a NaN or infinity in q, k, v or dout before computing (default); --no-check-finite "
                "computes with them (they propagate where the math puts them)");
  cmd->add_option("--threads", opt->threads, "Threads per rank (default: every core)")
      ->check(CLI::Range(1, kMaxThreads));
  cmd->callback([&run, opt] {
    opt->mask.causal = !opt->no_causal;
    opt->cp.collect_stats = !opt->stats.empty();
    run = [opt] { return run_attn(*opt); };
  });
}

}  // namespace rf::cli
