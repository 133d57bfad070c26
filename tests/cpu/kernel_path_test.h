// The fixture of the kernel tests CTest runs once per kernel path (tests/cpu/CMakeLists.txt: RINGFLEX_ISA = amx,
// avx512-dpbf16, avx512-widen, avx2, scalar, and unset). A path this CPU lacks skips every test and says why (the
// error names the missing hardware, which scripts/check_skips.py accepts only on a CPU without it); a misspelt
// name fails.
//
// With RF_TEST_AMX_TILE_MODEL=1 (CTest's `.amx-model` runs) the fixture installs the software tile unit
// (soft_tiles.h: kSoftAmx) instead, so the tests run the AMX kernels end to end on a CPU without AMX; that needs
// AVX512_BF16 (the AMX kernels' rounding of P and dS), and a CPU without it skips saying so.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <string_view>

#include "core/error.h"
#include "cpu/amx.h"
#include "cpu/isa.h"
#include "soft_tiles.h"

namespace rf::testing {

inline bool amx_tile_model_requested() {
  const char* flag = std::getenv("RF_TEST_AMX_TILE_MODEL");
  return flag && std::string_view(flag) == "1";
}

class KernelPathTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (amx_tile_model_requested()) {
      if (!cpu::detect_cpu().avx512_bf16)
        GTEST_SKIP() << "the tile model runs the AVX-512 kernels' tile path, which rounds with AVX512_BF16; this CPU "
                        "lacks it";
      cpu::detail::install_amx_tile_model(&kSoftAmx);
      return;
    }
    try {
      cpu::kernel_path();
    } catch (const Error& e) {
      const char* forced = std::getenv("RINGFLEX_ISA");
      const std::string_view name = forced ? forced : "";
      if (name == "amx" || name == "avx512-dpbf16" || name == "avx512-widen" || name == "avx512" || name == "avx2")
        GTEST_SKIP() << e.what();
      FAIL() << e.what();
    }
  }
  void TearDown() override { cpu::detail::install_amx_tile_model(nullptr); }
};

}  // namespace rf::testing
