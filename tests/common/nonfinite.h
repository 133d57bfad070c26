// Test helpers for non-finite inputs (docs/numerics.md): which tokens a mask lets be read, and writing NaN or
// infinities into the values of tokens no result may depend on. Header-only, shared by the kernel, CP and CLI
// tests.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "core/mask.h"

namespace rf::testing {

// The three non-finite float32 values (bf16 holds them too: its exponent field is float32's).
inline float nonfinite_value(int which) {
  switch (which % 3) {
    case 0:
      return std::numeric_limits<float>::quiet_NaN();
    case 1:
      return std::numeric_limits<float>::infinity();
    default:
      return -std::numeric_limits<float>::infinity();
  }
}

// Element i of a raw tensor of dtype t, set to x.
inline void set_element(std::vector<uint8_t>& bytes, int64_t i, DType t, float x) {
  from_float(bytes.data() + i * static_cast<int64_t>(dtype_size(t)), &x, 1, t);
}

// Which tokens the mask lets anything read, and which read anything, for one row pair of metadata.
// q_meta: [Lq]; k_meta: [Lk]. key_read: [Lk] (some query of q_meta reads the key); row_reads: [Lq].
struct Reach {
  std::vector<char> key_read, row_reads;
};

inline Reach reach(const LayerMask& mask, const TokenMeta* q_meta, int Lq, const TokenMeta* k_meta, int Lk) {
  Reach r{std::vector<char>(static_cast<size_t>(Lk), 0), std::vector<char>(static_cast<size_t>(Lq), 0)};
  for (int i = 0; i < Lq; ++i)
    for (int j = 0; j < Lk; ++j)
      if (allowed(mask, q_meta[i], k_meta[j])) r.key_read[j] = r.row_reads[i] = 1;
  return r;
}

// Writes a random non-finite value into every element of the tokens no result may depend on:
// k and v of keys nobody reads, q and dout of query rows that read nothing (padding among them).
// q, dout: [B, Hq, Lq, D]; k, v: [B, Hkv, Lk, D]; metadata [B, Lq] and [B, Lk]. Returns how many it wrote.
struct Tokens {
  std::vector<uint8_t>*q, *k, *v, *dout;  // dout may be null
};

inline int64_t poison_unread(const LayerMask& mask, const TokenMeta* q_meta, const TokenMeta* k_meta, int B, int Hq,
                             int Hkv, int Lq, int Lk, int D, DType t, Tokens x, uint64_t seed) {
  std::mt19937_64 rng(seed);
  int64_t written = 0;
  for (int b = 0; b < B; ++b) {
    const Reach r = reach(mask, q_meta + int64_t{b} * Lq, Lq, k_meta + int64_t{b} * Lk, Lk);
    for (int j = 0; j < Lk; ++j) {
      if (r.key_read[j]) continue;
      for (int g = 0; g < Hkv; ++g)
        for (int d = 0; d < D; ++d) {
          const int64_t e = ((int64_t{b} * Hkv + g) * Lk + j) * D + d;
          set_element(*x.k, e, t, nonfinite_value(static_cast<int>(rng())));
          set_element(*x.v, e, t, nonfinite_value(static_cast<int>(rng())));
          written += 2;
        }
    }
    for (int i = 0; i < Lq; ++i) {
      if (r.row_reads[i]) continue;
      for (int h = 0; h < Hq; ++h)
        for (int d = 0; d < D; ++d) {
          const int64_t e = ((int64_t{b} * Hq + h) * Lq + i) * D + d;
          set_element(*x.q, e, t, nonfinite_value(static_cast<int>(rng())));
          ++written;
          if (x.dout) set_element(*x.dout, e, t, nonfinite_value(static_cast<int>(rng()))), ++written;
        }
    }
  }
  return written;
}

inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Index of the first element whose bits differ, or -1.
inline int64_t first_difference(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) return static_cast<int64_t>(i);
  return -1;
}

}  // namespace rf::testing
