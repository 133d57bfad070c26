// ringflex: the command-line entry point. Parses the subcommand, starts MPI (a plain run is a singleton
// world of P = 1), checks that every rank got the same command line, runs the subcommand, and maps failures to
// one line on stderr and a non-zero exit.
#include <malloc.h>
#include <mpi.h>

#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "cli/command.h"
#include "cli/watchdog.h"
#include "comm/agree.h"
#include "comm/mpi_comm.h"
#include "core/error.h"
#include "cpu/blas_core.h"
#include "cpu/isa.h"
#include "cpu/openmp_wait.h"
#include "model/gemma4.h"

namespace {

constexpr int kFailure = 1;
constexpr double kMillisecondsPerSecond = 1000.0;
// --timeout's ceiling: about 30 years, so the deadline in milliseconds stays far inside int64 (an infinity or 1e300
// would not convert).
constexpr double kMaxTimeoutSeconds = 1e9;

void print_error(const char* what) { std::fprintf(stderr, "ringflex: error: %s\n", what); }

// The model allocates its large buffers (activations, gradients, the loss chunk, packed K/V) per layer and frees
// them within the step; glibc maps allocations above its mmap threshold afresh each time, and the kernel zeroes and
// faults in every page on first touch, again every layer and every step. Kept in the heap instead (no trimming, and
// an mmap threshold above those buffers), freed memory is reused without faults: on a 2-vCPU Skylake-SP the 100m
// S = 4096 forward+backward went from 1.09 M page faults and 6.3 s of system time to 0.37 M and 2.6-3.2 s (the rest
// is loading and writing files), the built-in training demo from 148 K faults to 16 K, with the same peak RSS.
// Buffers of kMapAtLeastBytes and more are still mapped, and unmapped when freed: under parallelism.shard full the
// head's whole weights and gradient (160 MiB at the 100m config, GiBs at Gemma 4's vocabulary) are allocated and freed
// around each loss, and in the heap their freed space stayed resident as holes later buffers did not fill (at N = 8,
// 990 MiB a rank against the memory check's 860; BENCHMARKS.md). The threshold sits above the loss chunk's budget
// (model::kLossChunkBytes), so the per-chunk buffers stay in the heap. A process-wide allocator policy, so the program
// sets it, not the library. No effect off glibc.
constexpr int kMapAtLeastBytes = 128 << 20;
static_assert(kMapAtLeastBytes > rf::model::kLossChunkBytes, "the loss chunk's buffers must stay in the heap");

void keep_freed_memory_in_the_heap() {
#ifdef M_MMAP_THRESHOLD
  mallopt(M_MMAP_THRESHOLD, kMapAtLeastBytes);
  mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max());
#endif
}

}  // namespace

int main(int argc, char** argv) {
  // First: each may replace this process. `generate` runs short parallel regions far apart (cpu/openmp_wait.h).
  if (argc > 1 && std::string_view(argv[1]) == "generate") rf::cpu::restart_with_brief_spin(argv);
  rf::cpu::restart_on_best_openblas_core(argv);
  keep_freed_memory_in_the_heap();
  // A write past a file-size limit (ulimit -f) then fails with EFBIG, which the writer reports in one line and
  // cleans up after, instead of the kernel's SIGXFSZ ending the process with the temporary file left behind.
  std::signal(SIGXFSZ, SIG_IGN);
  CLI::App app{"ringflex: context-parallel masked attention and Gemma 4 fine-tuning"};
  app.require_subcommand(1);
  rf::cli::Runner run;
  rf::cli::add_attn_command(app, run);
  rf::cli::add_demo_command(app, run);
  rf::cli::add_plan_command(app, run);
  rf::cli::add_forward_command(app, run);
  rf::cli::add_train_command(app, run);
  rf::cli::add_info_command(app, run);
  rf::cli::add_export_command(app, run);
  rf::cli::add_generate_command(app, run);
  rf::cli::add_data_command(app, run);
  app.set_version_flag("--version", std::string("ringflex ") + RF_VERSION);
  // Options every subcommand takes, added here so a new subcommand cannot miss them (one that declares its own
  // --timeout keeps it, and must pass it to comm::set_default_timeout itself).
  double timeout_s = static_cast<double>(rf::comm::kDefaultTimeout.count()) / kMillisecondsPerSecond;
  for (CLI::App* sub : app.get_subcommands([](CLI::App* s) { return s->get_option_no_throw("--timeout") == nullptr; }))
    sub->add_option("--timeout", timeout_s,
                    "Seconds a rank waits for a peer (a dead, hung or stopped rank) before the job fails on every rank")
        ->check(CLI::Validator(
            [](const std::string& text) {
              const double s = std::strtod(text.c_str(), nullptr);
              return s > 0 && s <= kMaxTimeoutSeconds
                         ? std::string()
                         : text + " is not a positive number of seconds (at most " +
                               std::to_string(static_cast<int64_t>(kMaxTimeoutSeconds)) + ")";
            },
            "SECONDS", "positive"))
        ->capture_default_str();
  // A command line CLI11 rejects is reported after MPI starts, through the same agreement as every other error:
  // under mpirun a rank that exited before MPI_Init would have the others killed before they printed their line.
  // --help and --version (CLI::Success) print and exit at once, on each rank.
  std::string usage_error;
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    usage_error = e.what();
  }
  const rf::comm::Timeout timeout(static_cast<int64_t>(timeout_s * kMillisecondsPerSecond));
  rf::comm::set_default_timeout(timeout);

  {
    const rf::cli::Watchdog watchdog(timeout, "MPI start-up (MPI_Init)");
    MPI_Init(&argc, &argv);
  }
  int code = kFailure;
  bool agreed = true;  // whether every rank knows this run failed (or none failed)
  try {
    {
      const rf::comm::Step step("agreeing on the command line and the kernel path");
      const std::unique_ptr<rf::comm::Communicator> world = rf::comm::make_mpi_world();
      rf::comm::agree_command_line(*world, std::vector<std::string>(argv + 1, argv + argc));
      // The tile race (isa.h) is a timing, and each rank would decide alone: on a CPU near the threshold one job
      // could split over two bf16 paths. Every rank takes part, racing where its own CPU needs the race, and all
      // decide with the slowest result. It comes before the agreement below: a rank whose check threw there would
      // leave the others waiting in this allreduce.
      double race = rf::cpu::needs_tile_race(rf::cpu::detect_cpu(), std::getenv(rf::cpu::kIsaEnv))
                        ? rf::cpu::bf16_tile_race()
                        : std::numeric_limits<double>::infinity();
      world->allreduce(&race, 1, rf::comm::ReduceOp::Min);
      rf::cpu::set_tile_race([race] { return race; });
      // Every rank checks its command line (the usage error held above) and its kernel path (isa.h) before any
      // work: the nodes of one job may differ, and a RINGFLEX_ISA one rank's CPU cannot run fails all ranks
      // together with that rank's line.
      rf::comm::agree(*world, [&] {
        if (!usage_error.empty()) throw rf::Error(usage_error);
        rf::cpu::kernel_path();
      });
      // And on one path: a rank on another (its own RINGFLEX_ISA, another CPU, the tile race deciding otherwise)
      // would compute its shard with other bits, and on bf16 another rounding. `info` is exempt: it is how each
      // rank's path is seen.
      if (!app.got_subcommand("info")) {
        const rf::cpu::KernelPath& path = rf::cpu::kernel_path();
        const int64_t mine[] = {static_cast<int64_t>(path.isa), static_cast<int64_t>(path.bf16)};
        rf::comm::agree_equal(*world, mine,
                              "the kernel path (`ringflex info` prints each rank's; start every rank with the same "
                              "RINGFLEX_ISA)");
      }
    }
    code = run();
  } catch (const rf::comm::AgreedError& e) {
    print_error(e.what());
  } catch (const std::exception& e) {
    // rf::Error from a step that only this rank ran, or a std::bad_alloc: the others may be waiting for it.
    print_error(e.what());
    agreed = false;
  }
  int ranks = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  if (!agreed && ranks > 1) MPI_Abort(MPI_COMM_WORLD, kFailure);
  {
    const rf::cli::Watchdog watchdog(timeout, "MPI shut-down (MPI_Finalize)");
    MPI_Finalize();
  }
  return code;
}
