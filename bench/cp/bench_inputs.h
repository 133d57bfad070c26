// ringflex bench/cp: input values shared by the CP benchmarks (header-only; the benchmarks are single files).
#pragma once

#include <cstdint>
#include <vector>

namespace rf::bench {

// n values uniform in [-1, 1) from a cheap deterministic xorshift64: benchmark inputs only need to be varied and
// bounded, and the same seed gives the same values on every rank. Returns [n].
inline std::vector<float> uniform(int64_t n, uint64_t seed) {
  constexpr uint64_t kSeedMix = 0x9e3779b97f4a7c15ull;  // 2^64 / golden ratio: spreads nearby seeds apart
  constexpr int kMantissaShift = 11;                    // keep the top 53 bits: exactly representable in a double
  constexpr double kTwoPow53 = 9007199254740992.0;
  std::vector<float> x(static_cast<size_t>(n));
  uint64_t s = seed * kSeedMix + 1;
  for (float& v : x) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;  // xorshift64's (13, 7, 17) triple
    v = static_cast<float>(static_cast<double>(s >> kMantissaShift) / kTwoPow53 * 2 - 1);
  }
  return x;
}

}  // namespace rf::bench
