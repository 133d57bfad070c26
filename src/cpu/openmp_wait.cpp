// ringflex cpu: the OpenMP runtime's idle-thread spin (openmp_wait.h).
#include "cpu/openmp_wait.h"

#include <cctype>
#include <charconv>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string_view>
#include <system_error>

#include "cpu/restart.h"

namespace rf::cpu {

namespace {

constexpr const char* kWaitPolicyEnv = "OMP_WAIT_POLICY";
constexpr const char* kSpinCountEnv = "GOMP_SPINCOUNT";
// The most spins for which a thread counts as sleeping soon: libgomp reckons about 10^5 spins a millisecond, so 10^4
// is ~0.1 ms, the time one of a decode step's products takes to read its weight.
constexpr uint64_t kSleepsSoonSpins = 10000;

bool is_set(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0';
}

bool same_word(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(a[i])) != std::tolower(static_cast<unsigned char>(b[i]))) return false;
  return true;
}

// GOMP_SPINCOUNT as libgomp reads it: a count with an optional k, M, G or T (powers of 1000), or "infinite" /
// "infinity" (the most); nullopt when unset or malformed (the runtime then ignores it).
std::optional<uint64_t> spin_count(const char* text) {
  if (text == nullptr) return std::nullopt;
  std::string_view s(text);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  if (same_word(s, "infinite") || same_word(s, "infinity")) return std::numeric_limits<uint64_t>::max();
  uint64_t count = 0;
  const auto [end, error] = std::from_chars(s.data(), s.data() + s.size(), count);
  if (error != std::errc() || end == s.data()) return std::nullopt;
  std::string_view unit(end, static_cast<size_t>(s.data() + s.size() - end));
  if (unit.empty()) return count;
  if (unit.size() != 1) return std::nullopt;
  constexpr std::string_view kUnits = "kmgt";
  const size_t power = kUnits.find(static_cast<char>(std::tolower(static_cast<unsigned char>(unit[0]))));
  if (power == std::string_view::npos) return std::nullopt;
  for (size_t i = 0; i <= power; ++i)
    count = count > std::numeric_limits<uint64_t>::max() / 1000 ? std::numeric_limits<uint64_t>::max() : count * 1000;
  return count;
}

}  // namespace

void restart_with_brief_spin(char** argv) {
  if (is_set(kWaitPolicyEnv) || is_set(kSpinCountEnv)) return;
  setenv(kSpinCountEnv, kBriefSpinCount, 1);
  restart_self(argv);
  unsetenv(kSpinCountEnv);
}

bool idle_threads_sleep_soon() {
  // libgomp's reading (its env.c): a valid GOMP_SPINCOUNT decides; otherwise OMP_WAIT_POLICY=passive means no spin,
  // active or unset a long one.
  if (const std::optional<uint64_t> spins = spin_count(std::getenv(kSpinCountEnv))) return *spins <= kSleepsSoonSpins;
  const char* policy = std::getenv(kWaitPolicyEnv);
  return policy != nullptr && same_word(policy, "passive");
}

}  // namespace rf::cpu
