// Tests of the memory check: a claim beyond the machine is an error that says how much it needs, an overflowed
// (negative) size is an error too, and a small claim passes.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "common/memory_limit.h"
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

using ScopedLimit = rf::testing::ScopedMemoryLimit;

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

// A fake cgroup tree in a temporary directory: the /proc/self/cgroup list and the files under the mount.
class FakeCgroups {
 public:
  explicit FakeCgroups(const std::string& name)
      : root_(std::filesystem::temp_directory_path() / ("rf_cgroup_" + name + "_" + std::to_string(::getpid()))) {
    std::filesystem::remove_all(root_);
    std::filesystem::create_directories(mount());
  }
  ~FakeCgroups() { std::filesystem::remove_all(root_); }
  FakeCgroups(const FakeCgroups&) = delete;
  FakeCgroups& operator=(const FakeCgroups&) = delete;

  std::string list() const { return (root_ / "cgroup").string(); }
  std::string mount() const { return (root_ / "fs").string(); }
  void write(const std::string& relative, const std::string& text) const {
    const std::filesystem::path path = root_ / relative;
    std::filesystem::create_directories(path.parent_path());
    std::ofstream(path) << text;
  }
  int64_t headroom() const { return cgroup_memory_headroom(list(), mount()); }

 private:
  std::filesystem::path root_;
};

constexpr int64_t kMiB = int64_t{1} << 20;

TEST(MemoryCgroup, V2TakesTheLeastHeadroomOfTheGroupAndItsAncestors) {
  const FakeCgroups cg("v2");
  cg.write("cgroup", "0::/job/step\n");
  // The group itself has no limit ("max"); its parent allows 100 MiB and uses 70 MiB, of which 10 MiB is
  // inactive page cache the kernel would reclaim first: 100 - (70 - 10) = 40 MiB.
  cg.write("fs/job/step/memory.max", "max\n");
  cg.write("fs/job/step/memory.current", std::to_string(50 * kMiB) + "\n");
  cg.write("fs/job/memory.max", std::to_string(100 * kMiB) + "\n");
  cg.write("fs/job/memory.current", std::to_string(70 * kMiB) + "\n");
  cg.write("fs/job/memory.stat", "anon 1\ninactive_file " + std::to_string(10 * kMiB) + "\nactive_file 5\n");
  EXPECT_EQ(cg.headroom(), 40 * kMiB);
  // A tighter limit lower down wins: the step may use 60 MiB and uses 50 (no page cache listed).
  cg.write("fs/job/step/memory.max", std::to_string(60 * kMiB) + "\n");
  EXPECT_EQ(cg.headroom(), 10 * kMiB);
  // Usage past the limit (it can be, briefly) is no headroom, not a negative one.
  cg.write("fs/job/step/memory.current", std::to_string(80 * kMiB) + "\n");
  EXPECT_EQ(cg.headroom(), 0);
}

TEST(MemoryCgroup, V2ContainerSeesItsGroupAsTheRoot) {
  const FakeCgroups cg("v2root");
  cg.write("cgroup", "0::/\n");
  cg.write("fs/memory.max", std::to_string(8 * kMiB) + "\n");
  cg.write("fs/memory.current", std::to_string(3 * kMiB) + "\n");
  EXPECT_EQ(cg.headroom(), 5 * kMiB);
}

TEST(MemoryCgroup, V1ReadsTheMemoryControllersGroupAndHierarchicalLimit) {
  const FakeCgroups cg("v1");
  cg.write("cgroup", "9:name=systemd:/\n5:cpu,memory:/batch/42\n1:cpu:/\n0::/\n");
  cg.write("fs/memory/batch/42/memory.limit_in_bytes", "9223372036854771712\n");  // v1's "no limit"
  cg.write("fs/memory/batch/42/memory.usage_in_bytes", std::to_string(30 * kMiB) + "\n");
  cg.write("fs/memory/batch/42/memory.stat", "cache 7\nhierarchical_memory_limit " + std::to_string(64 * kMiB) +
                                                 "\ntotal_inactive_file " + std::to_string(6 * kMiB) + "\n");
  EXPECT_EQ(cg.headroom(), 40 * kMiB);  // 64 - (30 - 6)
  cg.write("fs/memory/batch/42/memory.limit_in_bytes", std::to_string(32 * kMiB) + "\n");
  EXPECT_EQ(cg.headroom(), 8 * kMiB);  // 32 - (30 - 6)
}

TEST(MemoryCgroup, V1GroupOutsideTheMountIsReadAtTheMount) {
  // An older container without a cgroup namespace lists the host's path, but its mount shows its own group.
  const FakeCgroups cg("v1container");
  cg.write("cgroup", "4:memory:/docker/0123abcd\n");
  cg.write("fs/memory/memory.limit_in_bytes", std::to_string(16 * kMiB) + "\n");
  cg.write("fs/memory/memory.usage_in_bytes", std::to_string(4 * kMiB) + "\n");
  EXPECT_EQ(cg.headroom(), 12 * kMiB);
}

TEST(MemoryCgroup, NoLimitOrNothingReadableIsMinusOne) {
  const FakeCgroups cg("none");
  EXPECT_EQ(cg.headroom(), -1);  // no /proc/self/cgroup at all
  cg.write("cgroup", "4:memory:/x\n0::/y\nnot a cgroup line\n");
  EXPECT_EQ(cg.headroom(), -1);  // groups listed, no files
  cg.write("fs/memory/x/memory.limit_in_bytes", "9223372036854771712\n");
  cg.write("fs/memory/x/memory.usage_in_bytes", "1000\n");
  cg.write("fs/y/memory.max", "max\n");
  cg.write("fs/y/memory.current", "1000\n");
  EXPECT_EQ(cg.headroom(), -1);  // both say "no limit"
  cg.write("fs/y/memory.max", "garbage\n");
  EXPECT_EQ(cg.headroom(), -1);  // an unreadable limit is no limit, never a zero
}

TEST(MemoryCgroup, TheMachinesFigureIsAtMostItsCgroupsHeadroom) {
  const int64_t cgroup = cgroup_memory_headroom("/proc/self/cgroup", "/sys/fs/cgroup");
  // The group's usage moves between the two reads (this process, the page cache); 64 MiB is far more than it moves
  // in microseconds, far less than any limit a job runs under.
  constexpr int64_t kUsageDrift = 64 * kMiB;
  if (cgroup >= 0) {
    EXPECT_LE(available_memory_bytes(), cgroup + kUsageDrift);
  }
  EXPECT_GT(available_memory_bytes(), 0);
}

}  // namespace
}  // namespace rf
