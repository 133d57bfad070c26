// Tests for src/cpu/openmp_wait.h: which settings of the OpenMP runtime count as idle threads sleeping soon. The
// decode step forks its products over the threads only then (model/ops.cpp), so a setting read wrongly either forks
// beside spinning threads (2-3x slower decode at 2 threads, BENCHMARKS.md) or never forks.
#include "cpu/openmp_wait.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <string>

namespace rf::cpu {
namespace {

// Sets (or, with nullopt, removes) an environment variable for the test's scope and puts the old value back.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, std::optional<std::string> value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value)
      setenv(name, value->c_str(), 1);
    else
      unsetenv(name);
  }
  ~ScopedEnv() {
    if (old_)
      setenv(name_, old_->c_str(), 1);
    else
      unsetenv(name_);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

bool sleeps_soon(std::optional<std::string> policy, std::optional<std::string> spins) {
  const ScopedEnv p("OMP_WAIT_POLICY", std::move(policy));
  const ScopedEnv s("GOMP_SPINCOUNT", std::move(spins));
  return idle_threads_sleep_soon();
}

TEST(OpenMpWait, ReadsTheRuntimesSettings) {
  EXPECT_FALSE(sleeps_soon(std::nullopt, std::nullopt));  // libgomp's default: 300000 spins
  EXPECT_TRUE(sleeps_soon("passive", std::nullopt));
  EXPECT_TRUE(sleeps_soon("PASSIVE", std::nullopt));  // the runtime compares without case
  EXPECT_FALSE(sleeps_soon("active", std::nullopt));
  EXPECT_TRUE(sleeps_soon(std::nullopt, kBriefSpinCount));  // what `ringflex generate` sets
  EXPECT_TRUE(sleeps_soon(std::nullopt, "0"));
  EXPECT_TRUE(sleeps_soon(std::nullopt, "10000"));
  EXPECT_FALSE(sleeps_soon(std::nullopt, "10001"));
  EXPECT_FALSE(sleeps_soon(std::nullopt, "300000"));
  EXPECT_FALSE(sleeps_soon(std::nullopt, "infinite"));  // libgomp's word for spinning forever
  EXPECT_FALSE(sleeps_soon(std::nullopt, ""));          // unset, as the runtime reads it
  EXPECT_FALSE(sleeps_soon(std::nullopt, "12abc"));     // malformed: the runtime keeps its default
  EXPECT_TRUE(sleeps_soon(std::nullopt, " 5k "));       // 5000, with the spaces libgomp skips
  EXPECT_FALSE(sleeps_soon(std::nullopt, "1M"));
  EXPECT_TRUE(sleeps_soon("passive", "abc"));        // a malformed count is ignored: the policy decides
  EXPECT_FALSE(sleeps_soon("passive", "infinite"));  // a valid count decides, whatever the policy
  EXPECT_TRUE(sleeps_soon("active", "100"));
}

}  // namespace
}  // namespace rf::cpu
