// Probe of this machine's one-thread matmul rates, the figures the bf16 step's targets are ratios to (issue 27,
// BENCHMARKS.md): float32 sgemm (OpenBLAS, as model::gemm calls it per thread) and bf16 x bf16 -> float32 through
// the same oneDNN primitive the model's bf16 mode runs (model::bf16_gemm_on_this_thread), square N x N x N, one
// thread each. Prints the CPU, its bf16 units and the paths `ringflex info` reports, then per N the best of
// --reps timings of each and their ratio:
//   OMP_NUM_THREADS=1 BUILD/bench/model/bench_matmul_rate --sizes 1024 2048 4096 --reps 5
// The oneDNN figure is its kernel on this CPU whatever the model's choice (bf16_matmul_on_onednn) is: where that
// choice is sgemm, the line says so, and the ratio tells how far the bf16 units (or oneDNN's emulation) lag.
#include <cblas.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "cpu/blas_core.h"
#include "cpu/isa.h"
#include "model/matmul_bf16.h"

namespace {

using Clock = std::chrono::steady_clock;

// Seconds of the fastest of `reps` calls: the rate when nothing else on the machine interfered.
template <typename F>
double best_seconds(int reps, F&& call) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    call();
    best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return best;
}

const char* yes_no(bool x) { return x ? "yes" : "no"; }

}  // namespace

int main(int argc, char** argv) {
  rf::cpu::restart_on_best_openblas_core(argv);  // the OpenBLAS kernels the model's sgemm runs on (blas_core.h)
  CLI::App app{"one-thread sgemm and oneDNN bf16 matmul GFLOP/s on square N x N x N"};
  std::vector<int> sizes{1024, 2048, 4096};
  int reps = 5;
  app.add_option("--sizes", sizes, "N of each square matmul")->check(CLI::PositiveNumber);
  app.add_option("--reps", reps, "timings per size and kind; the best is reported")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  openblas_set_num_threads(1);

  const rf::cpu::CpuFeatures f = rf::cpu::detect_cpu();
  const rf::cpu::KernelPath& path = rf::cpu::kernel_path();
  std::printf("cpu: %s (avx512 %s, avx512_bf16 %s, amx %s)\n", f.cpu_name.empty() ? "unknown" : f.cpu_name.c_str(),
              yes_no(f.avx512), yes_no(f.avx512_bf16), yes_no(f.amx));
  std::printf("attention kernels: %s\n", rf::cpu::describe(path).c_str());
  std::printf("model bf16 matmuls: %s\n", rf::model::bf16_matmul_path().description.c_str());
  std::printf("model float32 matmuls: %s\n", rf::cpu::describe_openblas_core().c_str());
  std::printf("%6s %12s %12s %10s\n", "N", "sgemm GF/s", "bf16 GF/s", "bf16/f32");

  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (const int n : sizes) {
    const size_t elems = static_cast<size_t>(n) * static_cast<size_t>(n);
    std::vector<float> a(elems), b(elems), c(elems);  // [N, N] each, row-major
    for (float& x : a) x = u(rng);
    for (float& x : b) x = u(rng);
    std::vector<rf::bf16> ab(elems), bb(elems);
    rf::from_float(ab.data(), a.data(), elems, rf::DType::BF16);
    rf::from_float(bb.data(), b.data(), elems, rf::DType::BF16);
    const double flops = 2.0 * n * n * static_cast<double>(n);
    const double f32 = best_seconds(reps, [&] {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.f, a.data(), n, b.data(), n, 0.f, c.data(), n);
    });
    double bf = 0;
    try {
      bf = best_seconds(reps, [&] {
        rf::model::bf16_gemm_on_this_thread(false, false, n, n, n, 1.f, ab.data(), n, bb.data(), n, 0.f, c.data(), n);
      });
    } catch (const std::exception& e) {
      std::printf("%6d %12.1f %12s %10s  (%s)\n", n, flops / f32 * 1e-9, "-", "-", e.what());
      continue;
    }
    std::printf("%6d %12.1f %12.1f %10.2f\n", n, flops / f32 * 1e-9, flops / bf * 1e-9, f32 / bf);
  }
  return 0;
}
