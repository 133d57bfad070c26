// ringflex core: splitmix64's finaliser, the one integer mixer behind every counter-based draw that must not depend
// on the grid, the thread count or the order things are made in (LoRA's initial values, its dropout masks); and
// FNV-1a, the one running hash of names and of the inputs ranks compare before they start.
#pragma once

#include <cstdint>
#include <vector>

namespace rf {

// One well-mixed 64-bit value per input (Steele, Lea and Flood's splitmix64 output function).
inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// 64-bit FNV-1a, fed one word at a time (a name's bytes, an array's length then its values).
struct Fnv1a {
  static constexpr uint64_t kOffset = 0xcbf29ce484222325ULL, kPrime = 0x100000001b3ULL;
  uint64_t h = kOffset;
  void add(uint64_t word) { h = (h ^ word) * kPrime; }
  void add(const std::vector<int32_t>& v) {
    add(v.size());
    for (int32_t x : v) add(static_cast<uint32_t>(x));
  }
};

}  // namespace rf
