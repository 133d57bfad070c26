// The choice of kernel path (src/cpu/isa.h) on made-up CPUs: the best path when nothing is forced (CPUID, and the
// tile race where CPUID cannot tell), RINGFLEX_ISA's values, and the errors for a misspelt value or a path the
// CPU lacks. The real CPU's run of each path is test_attention.cpp under CTest's RINGFLEX_ISA environments.
#include <gtest/gtest.h>

#include <iterator>
#include <string>

#include "core/error.h"
#include "cpu/blas_core.h"
#include "cpu/isa.h"

namespace rf::testing {
namespace {

using cpu::Bf16Product;
using cpu::CpuFeatures;
using cpu::Isa;
using cpu::select_path;

CpuFeatures cpu_with(bool avx2, bool avx512, bool avx512_bf16, bool amx, bool amd) {
  CpuFeatures f;
  f.avx2 = avx2, f.avx512 = avx512, f.avx512_bf16 = avx512_bf16, f.amx = amx, f.amd = amd;
  return f;
}
CpuFeatures baseline_cpu() { return cpu_with(false, false, false, false, false); }
CpuFeatures avx2_cpu() { return cpu_with(true, false, false, false, true); }       // Zen 2/3, Haswell
CpuFeatures skylake_cpu() { return cpu_with(true, true, false, false, false); }    // AVX-512 without BF16
CpuFeatures zen4_cpu() { return cpu_with(true, true, true, false, true); }         // AMD with AVX512_BF16
CpuFeatures intel_bf16_cpu() { return cpu_with(true, true, true, false, false); }  // Cooper Lake, SPR sans AMX
CpuFeatures amx_cpu() { return cpu_with(true, true, true, true, false); }          // Sapphire Rapids

// A tile race that reports `speedup` and counts its calls.
struct FakeRace {
  double speedup;
  int calls = 0;
  cpu::Bf16Race fn() {
    return [this] {
      ++calls;
      return speedup;
    };
  }
};

// The error message of select_path, or "" when it did not throw.
std::string error_of(const CpuFeatures& f, const char* forced) {
  try {
    select_path(f, forced);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(CpuIsa, BestPathWhenNotForced) {
  EXPECT_EQ(select_path(baseline_cpu(), nullptr).isa, Isa::Scalar);
  EXPECT_EQ(select_path(avx2_cpu(), nullptr).isa, Isa::Avx2);
  EXPECT_EQ(select_path(avx2_cpu(), nullptr).bf16, Bf16Product::Widen);
  EXPECT_EQ(select_path(skylake_cpu(), "").isa, Isa::Avx512);
  EXPECT_EQ(select_path(skylake_cpu(), "").bf16, Bf16Product::Widen);
  const cpu::KernelPath zen4 = select_path(zen4_cpu(), nullptr);
  EXPECT_EQ(zen4.isa, Isa::Avx512);
  EXPECT_EQ(zen4.bf16, Bf16Product::Dpbf16);
  EXPECT_EQ(zen4.reason, "best this CPU supports");
  const cpu::KernelPath amx = select_path(amx_cpu(), nullptr);
  EXPECT_EQ(amx.isa, Isa::Avx512);
  EXPECT_EQ(amx.bf16, Bf16Product::Amx);
  EXPECT_EQ(amx.reason, "best this CPU supports");
}

// CPUID decides where it can (AMX, AMD with AVX512_BF16, no AVX512_BF16) and the race runs nowhere else.
TEST(CpuIsa, TileRaceRunsOnlyWhereCpuidCannotTell) {
  FakeRace race{3.0};
  for (const CpuFeatures& f : {baseline_cpu(), avx2_cpu(), skylake_cpu(), zen4_cpu(), amx_cpu()})
    select_path(f, nullptr, race.fn());
  for (const char* forced : {"avx512-widen", "avx512-dpbf16", "amx", "avx2"}) select_path(amx_cpu(), forced, race.fn());
  EXPECT_EQ(race.calls, 0);
  EXPECT_EQ(select_path(intel_bf16_cpu(), nullptr, race.fn()).bf16, Bf16Product::Dpbf16);
  EXPECT_EQ(race.calls, 1);
}

// On an Intel AVX512_BF16 CPU without AMX the race decides, with a margin (kDpbf16MinSpeedup), and says so.
TEST(CpuIsa, TileRaceDecidesWithAMargin) {
  FakeRace fast{1.9}, parity{1.1}, slow{0.57};  // Zen 4-like, near parity, Sapphire Rapids-like (BENCHMARKS.md)
  const cpu::KernelPath won = select_path(intel_bf16_cpu(), nullptr, fast.fn());
  EXPECT_EQ(won.bf16, Bf16Product::Dpbf16);
  EXPECT_EQ(won.reason, "tile race: vdpbf16ps 1.90x float32 FMA GFLOP/s, at least 1.25x");
  EXPECT_EQ(select_path(intel_bf16_cpu(), nullptr, parity.fn()).bf16, Bf16Product::Widen);
  const cpu::KernelPath lost = select_path(intel_bf16_cpu(), nullptr, slow.fn());
  EXPECT_EQ(lost.isa, Isa::Avx512);
  EXPECT_EQ(lost.bf16, Bf16Product::Widen);
  EXPECT_EQ(lost.reason, "tile race: vdpbf16ps 0.57x float32 FMA GFLOP/s, below 1.25x");
  EXPECT_EQ(select_path(intel_bf16_cpu(), nullptr).bf16, Bf16Product::Widen);  // no race given: the exact path
}

TEST(CpuIsa, ForcedScalarIsChosenOnEveryCpu) {
  for (const CpuFeatures& f : {baseline_cpu(), avx2_cpu(), zen4_cpu(), amx_cpu()}) {
    const cpu::KernelPath p = select_path(f, "scalar");
    EXPECT_EQ(p.isa, Isa::Scalar);
    EXPECT_EQ(p.bf16, Bf16Product::Widen);
    EXPECT_EQ(p.reason, "forced by RINGFLEX_ISA=scalar");
  }
}

TEST(CpuIsa, ForcedPathsStepDown) {
  for (const char* widen : {"avx512", "avx512-widen"}) {  // avx512: the name before issue 12, still the same path
    EXPECT_EQ(select_path(amx_cpu(), widen).isa, Isa::Avx512);
    EXPECT_EQ(select_path(amx_cpu(), widen).bf16, Bf16Product::Widen);
    EXPECT_EQ(select_path(zen4_cpu(), widen).bf16, Bf16Product::Widen);
  }
  EXPECT_EQ(select_path(amx_cpu(), "amx").bf16, Bf16Product::Amx);
  EXPECT_EQ(select_path(amx_cpu(), "avx512-dpbf16").bf16, Bf16Product::Dpbf16);
  EXPECT_EQ(select_path(zen4_cpu(), "avx512-dpbf16").isa, Isa::Avx512);
  EXPECT_EQ(select_path(intel_bf16_cpu(), "avx512-dpbf16").bf16, Bf16Product::Dpbf16);
  EXPECT_EQ(select_path(amx_cpu(), "avx2").isa, Isa::Avx2);
  EXPECT_EQ(select_path(zen4_cpu(), "avx2").isa, Isa::Avx2);
  EXPECT_EQ(select_path(zen4_cpu(), "avx2").bf16, Bf16Product::Widen);
}

TEST(CpuIsa, ForcingAMissingPathNamesWhatIsMissing) {
  EXPECT_EQ(error_of(avx2_cpu(), "avx512"), "RINGFLEX_ISA=avx512 but this CPU or OS lacks AVX-512 F/DQ/BW/VL");
  EXPECT_EQ(error_of(avx2_cpu(), "avx512-widen"),
            "RINGFLEX_ISA=avx512-widen but this CPU or OS lacks AVX-512 F/DQ/BW/VL");
  EXPECT_EQ(error_of(skylake_cpu(), "avx512-dpbf16"),
            "RINGFLEX_ISA=avx512-dpbf16 but this CPU or OS lacks AVX-512 F/DQ/BW/VL with AVX512_BF16");
  EXPECT_EQ(error_of(baseline_cpu(), "avx2"), "RINGFLEX_ISA=avx2 but this CPU or OS lacks AVX2 + FMA");
  EXPECT_NE(error_of(zen4_cpu(), "amx").find("RINGFLEX_ISA=amx but this CPU or OS offers no AMX"), std::string::npos);
}

TEST(CpuIsa, MisspeltPathIsAnError) {
  const std::string names = " is not a kernel path: use amx, avx512-dpbf16, avx512-widen (or avx512), avx2 or scalar";
  EXPECT_EQ(error_of(amx_cpu(), "AVX2"), "RINGFLEX_ISA=AVX2" + names);
  EXPECT_EQ(error_of(amx_cpu(), "sse"), "RINGFLEX_ISA=sse" + names);
  EXPECT_EQ(error_of(amx_cpu(), "dpbf16"), "RINGFLEX_ISA=dpbf16" + names);
}

TEST(CpuIsa, DescribeNamesPathAndReason) {
  EXPECT_EQ(cpu::describe(select_path(avx2_cpu(), "scalar")),
            "scalar, bf16 products: widen to float32 (forced by RINGFLEX_ISA=scalar)");
  EXPECT_EQ(cpu::describe(select_path(zen4_cpu(), nullptr)),
            "avx512, bf16 products: vdpbf16ps (P and dS rounded to bf16) (best this CPU supports)");
}

// The real race on this machine, where it can run: a positive, finite speed ratio (never asserted as a speed).
TEST(CpuIsa, TileRaceMeasuresOnAvx512Bf16) {
  if (!cpu::detect_cpu().avx512_bf16) GTEST_SKIP() << "this CPU lacks AVX512_BF16 (avx512_bf16): no vdpbf16ps to race";
  const double speedup = cpu::bf16_tile_race();
  EXPECT_GT(speedup, 0);
  EXPECT_LT(speedup, 1e3);
}

// The machine running the test: detection is consistent (AVX-512 implies AVX2, AMX implies AVX-512).
TEST(CpuIsa, DetectedFeaturesAreConsistent) {
  const CpuFeatures f = cpu::detect_cpu();
  EXPECT_TRUE(!f.avx512 || f.avx2);
  EXPECT_TRUE(!f.avx512_bf16 || f.avx512);
  EXPECT_TRUE(!f.amx || f.avx512_bf16);
}

// needs_tile_race says exactly where select_path would call its race (the CLI's ranks race together on it).
TEST(CpuIsa, NeedsTileRaceMatchesSelectPath) {
  const CpuFeatures cpus[] = {baseline_cpu(), avx2_cpu(), skylake_cpu(), zen4_cpu(), intel_bf16_cpu(), amx_cpu()};
  for (size_t i = 0; i < std::size(cpus); ++i)
    for (const char* forced : {static_cast<const char*>(nullptr), "", "scalar"}) {
      FakeRace race{0.5};
      select_path(cpus[i], forced, race.fn());
      EXPECT_EQ(cpu::needs_tile_race(cpus[i], forced), race.calls == 1)
          << "cpu " << i << ", RINGFLEX_ISA " << (forced ? forced : "unset");
    }
}

// OpenBLAS's core (src/cpu/blas_core.h): only a fallback older than AVX2 is replaced, by the widest core the CPU
// runs; a core OpenBLAS chose knowingly stays, whatever its spelling's case, and a CPU without AVX2 keeps any core.
TEST(CpuBlasCore, OnlyAPreAvx2FallbackIsReplaced) {
  EXPECT_STREQ(cpu::better_openblas_core("Prescott", intel_bf16_cpu()), "SkylakeX");  // 0.3.21 on model 207
  EXPECT_STREQ(cpu::better_openblas_core("Sandybridge", skylake_cpu()), "SkylakeX");
  EXPECT_STREQ(cpu::better_openblas_core("Nehalem", avx2_cpu()), "Haswell");
  EXPECT_STREQ(cpu::better_openblas_core("Core2", avx2_cpu()), "Haswell");
  for (const char* chosen : {"Haswell", "Zen", "SkylakeX", "skylakex", "Cooperlake", "SapphireRapids"})
    EXPECT_EQ(cpu::better_openblas_core(chosen, zen4_cpu()), nullptr) << chosen;
  EXPECT_EQ(cpu::better_openblas_core("Prescott", baseline_cpu()), nullptr);
  EXPECT_EQ(cpu::better_openblas_core("", amx_cpu()), nullptr);  // not OpenBLAS
}

}  // namespace
}  // namespace rf::testing
