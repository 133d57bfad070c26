// ringflex info: the version, this CPU's vector features and the kernel path in use with the reason it was chosen
// (src/cpu/isa.h; RINGFLEX_ISA forces a path). Under mpirun each rank reports its own, as nodes of one job may
// differ.
#include <mpi.h>
#include <omp.h>

#include <cstdio>
#include <string>

#include "cli/command.h"
#include "cpu/blas_core.h"
#include "cpu/isa.h"
#include "model/matmul_bf16.h"

namespace rf::cli {

namespace {

const char* yes_no(bool x) { return x ? "yes" : "no"; }

int run_info() {
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  const std::string prefix = ranks > 1 ? "rank " + std::to_string(rank) + ": " : "";
  const cpu::CpuFeatures f = cpu::detect_cpu();
  const cpu::KernelPath& path = cpu::kernel_path();
  std::printf("%sringflex %s\n", prefix.c_str(), RF_VERSION);
  std::printf("%scpu: %s (avx2+fma %s, avx512 f/dq/bw/vl %s, avx512_bf16 %s, amx %s)\n", prefix.c_str(),
              f.cpu_name.empty() ? "unknown" : f.cpu_name.c_str(), yes_no(f.avx2), yes_no(f.avx512),
              yes_no(f.avx512_bf16), yes_no(f.amx));
  std::printf("%skernels: %s\n", prefix.c_str(), cpu::describe(path).c_str());
  std::printf("%smodel bf16 matmuls (--compute-dtype bf16): %s\n", prefix.c_str(),
              model::bf16_matmul_path().description.c_str());
  std::printf("%smodel bf16 attention (--compute-dtype bf16): %s\n", prefix.c_str(),
              cpu::describe_bf16_attention(path).c_str());
  std::printf("%smodel float32 matmuls: %s\n", prefix.c_str(), cpu::describe_openblas_core().c_str());
  std::printf("%sopenmp threads: %d\n", prefix.c_str(), omp_get_max_threads());
  return 0;
}

}  // namespace

void add_info_command(CLI::App& app, Runner& run) {
  CLI::App* cmd = app.add_subcommand(
      "info",
      "print the version, this CPU's vector features and the attention kernel path in use, bf16 products "
      "included (RINGFLEX_ISA = amx, avx512-dpbf16, avx512-widen, avx2 or scalar forces one)");
  cmd->callback([&run] { run = run_info; });
}

}  // namespace rf::cli
