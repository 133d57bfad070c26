// bench/model: the search both longest-length tools run (lora_longest_row, generate_longest_prompt) over a memory
// figure that grows with the length.
#pragma once

#include <algorithm>
#include <cstdint>

namespace rf::bench {

// The longest multiple of `granule` up to `limit` whose need(length) fits `budget` bytes (0: none does): doubling
// until a length does not fit, then bisecting in granules. need(length) returns bytes and must not fall as the
// length grows.
template <class Need>
int64_t longest_fitting(const Need& need, int64_t budget, int64_t granule, int64_t limit) {
  int64_t fits = 0, fails = granule;
  while (fails <= limit && need(fails) <= budget) {
    fits = fails;
    fails *= 2;
  }
  fails = std::min(fails, limit + granule);
  while (fails - fits > granule) {
    const int64_t mid = (fits + fails) / 2 / granule * granule;
    if (need(mid) <= budget)
      fits = mid;
    else
      fails = mid;
  }
  return fits;
}

}  // namespace rf::bench
