// The choice of kernel path (src/cpu/isa.h) on made-up CPUs: the best path when nothing is forced, RINGFLEX_ISA's
// values, and the errors for a misspelt value or a path the CPU lacks. The real CPU's run of each path is
// test_attention.cpp under CTest's RINGFLEX_ISA environments.
#include <gtest/gtest.h>

#include <string>

#include "core/error.h"
#include "cpu/isa.h"

namespace rf::testing {
namespace {

using cpu::Bf16Product;
using cpu::CpuFeatures;
using cpu::Isa;
using cpu::select_path;

CpuFeatures cpu_with(bool avx2, bool avx512, bool avx512_bf16, bool amx) {
  CpuFeatures f;
  f.avx2 = avx2, f.avx512 = avx512, f.avx512_bf16 = avx512_bf16, f.amx = amx;
  return f;
}
CpuFeatures baseline_cpu() { return cpu_with(false, false, false, false); }
CpuFeatures avx2_cpu() { return cpu_with(true, false, false, false); }  // Zen 2/3, Haswell
CpuFeatures avx512_cpu() { return cpu_with(true, true, true, false); }  // Zen 4
CpuFeatures amx_cpu() { return cpu_with(true, true, true, true); }      // Sapphire Rapids

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
  EXPECT_EQ(select_path(avx512_cpu(), "").isa, Isa::Avx512);
  EXPECT_EQ(select_path(avx512_cpu(), nullptr).bf16, Bf16Product::Widen);
  const cpu::KernelPath amx = select_path(amx_cpu(), nullptr);
  EXPECT_EQ(amx.isa, Isa::Avx512);
  EXPECT_EQ(amx.bf16, Bf16Product::Amx);
  EXPECT_EQ(amx.reason, "best this CPU supports");
}

TEST(CpuIsa, ForcedScalarIsChosenOnEveryCpu) {
  for (const CpuFeatures& f : {baseline_cpu(), avx2_cpu(), avx512_cpu(), amx_cpu()}) {
    const cpu::KernelPath p = select_path(f, "scalar");
    EXPECT_EQ(p.isa, Isa::Scalar);
    EXPECT_EQ(p.bf16, Bf16Product::Widen);
    EXPECT_EQ(p.reason, "forced by RINGFLEX_ISA=scalar");
  }
}

TEST(CpuIsa, ForcedPathsStepDown) {
  EXPECT_EQ(select_path(amx_cpu(), "avx512").isa, Isa::Avx512);
  EXPECT_EQ(select_path(amx_cpu(), "avx512").bf16, Bf16Product::Widen);  // forces AMX off (as before this change)
  EXPECT_EQ(select_path(amx_cpu(), "amx").bf16, Bf16Product::Amx);
  EXPECT_EQ(select_path(amx_cpu(), "avx2").isa, Isa::Avx2);
  EXPECT_EQ(select_path(avx512_cpu(), "avx2").isa, Isa::Avx2);
}

TEST(CpuIsa, ForcingAMissingPathNamesWhatIsMissing) {
  EXPECT_EQ(error_of(avx2_cpu(), "avx512"), "RINGFLEX_ISA=avx512 but this CPU or OS lacks AVX-512 F/DQ/BW/VL");
  EXPECT_EQ(error_of(baseline_cpu(), "avx2"), "RINGFLEX_ISA=avx2 but this CPU or OS lacks AVX2 + FMA");
  EXPECT_NE(error_of(avx512_cpu(), "amx").find("RINGFLEX_ISA=amx but this CPU or OS offers no AMX"), std::string::npos);
}

TEST(CpuIsa, MisspeltPathIsAnError) {
  EXPECT_EQ(error_of(amx_cpu(), "AVX2"), "RINGFLEX_ISA=AVX2 is not a kernel path: use amx, avx512, avx2 or scalar");
  EXPECT_EQ(error_of(amx_cpu(), "sse"), "RINGFLEX_ISA=sse is not a kernel path: use amx, avx512, avx2 or scalar");
}

TEST(CpuIsa, DescribeNamesPathAndReason) {
  EXPECT_EQ(cpu::describe(select_path(avx2_cpu(), "scalar")),
            "scalar, bf16 score products: widen to float32 (forced by RINGFLEX_ISA=scalar)");
}

// The machine running the test: detection is consistent (AVX-512 implies AVX2, AMX implies AVX-512).
TEST(CpuIsa, DetectedFeaturesAreConsistent) {
  const CpuFeatures f = cpu::detect_cpu();
  EXPECT_TRUE(!f.avx512 || f.avx2);
  EXPECT_TRUE(!f.avx512_bf16 || f.avx512);
  EXPECT_TRUE(!f.amx || f.avx512);
}

}  // namespace
}  // namespace rf::testing
