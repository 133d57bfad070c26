// Contiguous and zigzag ShardMaps for the planner's tests (SPEC §5), built here so these tests do not wait for
// src/cp/shard.cpp. Both pad the row to P * L with L a multiple of `multiple` (zigzag: L / 2 a multiple of it).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cp/shard.h"

namespace rf::cp::testing {

inline ShardMap contiguous_map(int S, int P, int multiple) {
  ShardMap m;
  m.S = S;
  m.P = P;
  m.L = ((S + P - 1) / P + multiple - 1) / multiple * multiple;
  m.S_padded = P * m.L;
  m.scheme = Scheme::Contiguous;
  for (int r = 0; r < P; ++r) {
    std::vector<int32_t> pos;
    for (int i = 0; i < m.L; ++i) pos.push_back(r * m.L + i);
    m.positions.push_back(pos);
  }
  return m;
}

inline ShardMap zigzag_map(int S, int P, int multiple) {
  const int half = ((S + 2 * P - 1) / (2 * P) + multiple - 1) / multiple * multiple;
  ShardMap m;
  m.S = S;
  m.P = P;
  m.L = 2 * half;
  m.S_padded = P * m.L;
  m.scheme = Scheme::Zigzag;
  for (int r = 0; r < P; ++r) {
    std::vector<int32_t> pos;
    for (const int chunk : {r, 2 * P - 1 - r}) {
      for (int i = 0; i < half; ++i) pos.push_back(chunk * half + i);
    }
    m.positions.push_back(pos);
  }
  return m;
}

inline std::string scheme_label(Scheme s) {
  switch (s) {
    case Scheme::Contiguous: return "contiguous";
    case Scheme::Zigzag: return "zigzag";
    case Scheme::Balanced: return "balanced";
  }
  return "?";
}

}  // namespace rf::cp::testing
