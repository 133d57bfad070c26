// ringflex core: splitmix64's finaliser, the one integer mixer behind every counter-based draw that must not depend
// on the grid, the thread count or the order things are made in (LoRA's initial values, its dropout masks).
#pragma once

#include <cstdint>

namespace rf {

// One well-mixed 64-bit value per input (Steele, Lea and Flood's splitmix64 output function).
inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace rf
