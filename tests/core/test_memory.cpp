// Tests of the memory check: a claim beyond the machine is an error that says how much it needs, an overflowed
// (negative) size is an error too, and a small claim passes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
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

// Sets RINGFLEX_MEMORY_LIMIT for one scope (each TEST runs in its own process, so nothing leaks across tests).
class ScopedLimit {
 public:
  explicit ScopedLimit(const char* value) { setenv("RINGFLEX_MEMORY_LIMIT", value, 1); }
  ~ScopedLimit() { unsetenv("RINGFLEX_MEMORY_LIMIT"); }
  ScopedLimit(const ScopedLimit&) = delete;
  ScopedLimit& operator=(const ScopedLimit&) = delete;
};

TEST(Memory, LimitCapsWhatIsAvailable) {
  const int64_t machine = available_memory_bytes();
  {
    const ScopedLimit limit("3M");
    EXPECT_EQ(available_memory_bytes(), std::min<int64_t>(machine, int64_t{3} << 20));
  }
  {
    const ScopedLimit limit("1234");
    EXPECT_EQ(available_memory_bytes(), std::min<int64_t>(machine, 1234));
  }
  {
    const ScopedLimit limit("2g");
    EXPECT_EQ(available_memory_bytes(), std::min<int64_t>(machine, int64_t{2} << 30));
  }
  {
    const ScopedLimit limit("1 GiB");
    try {
      (void)available_memory_bytes();
      FAIL() << "no error";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()),
                "RINGFLEX_MEMORY_LIMIT=1 GiB is not a byte count (digits, optionally followed by K, M or G)");
    }
  }
  for (const char* bad : {"-5", "M", "99999999999999999999", "9000000000G"}) {
    const ScopedLimit limit(bad);
    EXPECT_THROW((void)available_memory_bytes(), Error) << bad;
  }
}

TEST(Memory, BreakdownAddsUpAndNamesTheLargestTerms) {
  MemoryBreakdown need;
  need.add("weights", int64_t{3} << 20);
  need.add("gradients", int64_t{3} << 20);
  need.add("nothing", 0);
  need.add("activations", int64_t{5} << 20);
  need.add("plan", 812);
  EXPECT_EQ(need.total(), (int64_t{11} << 20) + 812);
  EXPECT_EQ(need.of("gradients"), int64_t{3} << 20);
  EXPECT_EQ(need.of("absent"), 0);
  // Largest first, equal sizes in the order added, zero terms left out, a cut list ends in "...".
  EXPECT_EQ(need.describe(), "activations 5.0 MiB, weights 3.0 MiB, gradients 3.0 MiB, plan 812 B");
  EXPECT_EQ(need.describe(2), "activations 5.0 MiB, weights 3.0 MiB, ...");
  need.add("overflowed", -1);
  EXPECT_EQ(need.total(), -1);
  EXPECT_EQ(need.describe(1), "overflowed > 2^63 B, ...");
  MemoryBreakdown sum;
  sum.add("a", INT64_MAX);
  sum.add("b", 1);
  EXPECT_EQ(sum.total(), -1);  // the sum itself overflows
}

TEST(Memory, CheckedBytesOverflowsToMinusOne) {
  EXPECT_EQ(checked_bytes({2, 3, 4}), 24);
  EXPECT_EQ(checked_bytes({int64_t{1} << 32, int64_t{1} << 32}), -1);
  EXPECT_EQ(checked_bytes({-1, 4}), -1);  // an overflowed factor stays an overflow
}

TEST(Memory, BreakdownCheckSaysWhatItNeedsAndWhatIsAvailable) {
  const ScopedLimit limit("1M");
  MemoryBreakdown need;
  need.add("weights", int64_t{1} << 20);
  need.add("activations", int64_t{2} << 20);
  try {
    check_memory(need, "train", " at seq_len 8 over cp 1");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "train needs at least 3.0 MiB of memory per rank (activations 2.0 MiB, weights 1.0 MiB at seq_len 8 "
              "over cp 1), but only 1.0 MiB is available to this rank");
  }
  MemoryBreakdown small;
  small.add("weights", 1000);
  EXPECT_NO_THROW(check_memory(small, "train"));
  small.add("overflowed", -1);
  EXPECT_THROW(check_memory(small, "train"), Error);
}

}  // namespace
}  // namespace rf
