// The fixture of the kernel tests CTest runs once per kernel path (tests/cpu/CMakeLists.txt: RINGFLEX_ISA = amx,
// avx512-dpbf16, avx512-widen, avx2, scalar, and unset). A path this CPU lacks skips every test and says why (the
// error names the missing hardware, which scripts/check_skips.py accepts only on a CPU without it); a misspelt
// name fails.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <string_view>

#include "core/error.h"
#include "cpu/isa.h"

namespace rf::testing {

class KernelPathTest : public ::testing::Test {
 protected:
  void SetUp() override {
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
};

}  // namespace rf::testing
