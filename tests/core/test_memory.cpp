// Tests of the memory check: a claim beyond the machine is an error that says how much it needs, an overflowed
// (negative) size is an error too, and a small claim passes.
#include <gtest/gtest.h>

#include <string>

#include "core/error.h"
#include "core/memory.h"

namespace rf {
namespace {

TEST(Memory, AvailableIsPositive) { EXPECT_GT(available_memory_bytes(), 0); }

TEST(Memory, ClaimBeyondTheMachineSaysHowMuch) {
  constexpr int64_t kExabyte = int64_t{1} << 60;  // more than any machine this runs on
  try {
    check_memory(kExabyte, "the test's buffer");
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.rfind("the test's buffer needs 1073741824.0 GiB of memory, but only ", 0), 0u) << what;
    EXPECT_NE(what.find(" is available to this rank"), std::string::npos) << what;
  }
  EXPECT_THROW(check_memory(-1, "an overflowed size"), Error);
  EXPECT_NO_THROW(check_memory(1 << 20, "one MiB"));
}

TEST(Memory, FormatsBytes) {
  EXPECT_EQ(format_bytes(812), "812 B");
  EXPECT_EQ(format_bytes(int64_t{3} << 19), "1.5 MiB");
  EXPECT_EQ(format_bytes(int64_t{3} << 29), "1.5 GiB");
}

}  // namespace
}  // namespace rf
