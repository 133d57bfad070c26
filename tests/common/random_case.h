// Test helpers shared by every layer's tests: random token metadata in the awkward shapes the sweeps need, and
// random tensors. Header-only so each test binary stays self-contained.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/mask.h"
#include "core/row_meta.h"

namespace rf::testing {

enum class MetaKind {
  OneDoc,        // a single document over the whole row
  Packed,        // packed documents, one-token documents included
  PackedImages,  // packed documents with image groups that cross windows and block boundaries
  Padded,        // packed documents, images, and a padded tail
  AllPadding,    // nothing valid
};

inline std::string kind_name(MetaKind k) {
  switch (k) {
    case MetaKind::OneDoc:
      return "one_doc";
    case MetaKind::Packed:
      return "packed";
    case MetaKind::PackedImages:
      return "packed_images";
    case MetaKind::Padded:
      return "padded";
    case MetaKind::AllPadding:
      return "all_padding";
  }
  return "?";
}

// Metadata for one row of S tokens: [S].
inline std::vector<TokenMeta> random_row(int S, MetaKind kind, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> doc(static_cast<size_t>(S), 1), types(static_cast<size_t>(S), 0);
  if (kind == MetaKind::AllPadding) return make_row_meta(S, std::vector<int32_t>(S, 0).data(), nullptr);
  if (kind != MetaKind::OneDoc) {
    // Document lengths 1..max(2, S/3): short ones (and one-token ones) are common.
    std::uniform_int_distribution<int> len(1, std::max(2, S / 3));
    int32_t d = 1;
    for (int t = 0; t < S;) {
      const int n = std::min(S - t, len(rng) % 4 == 0 ? 1 : len(rng));
      for (int i = 0; i < n; ++i) doc[t + i] = d;
      ++d;
      t += n;
    }
  }
  if (kind == MetaKind::PackedImages || kind == MetaKind::Padded) {
    // Image runs of 1..S/4 tokens, about a third of the row.
    std::uniform_int_distribution<int> len(1, std::max(1, S / 4));
    std::bernoulli_distribution image(0.35);
    for (int t = 0; t < S;) {
      const int n = std::min(S - t, len(rng));
      const int32_t type = image(rng) ? 1 : 0;
      for (int i = 0; i < n; ++i) types[t + i] = type;
      t += n + 1;  // a text token between runs
    }
  }
  if (kind == MetaKind::Padded) {
    std::uniform_int_distribution<int> pad(1, std::max(1, S / 3));
    for (int t = S - std::min(S, pad(rng)); t < S; ++t) doc[t] = 0;
  }
  const std::vector<int32_t> group = group_ids_from_token_types(types.data(), S);
  return make_row_meta(S, doc.data(), group.data());
}

// B rows of metadata: [B, S]; rows differ by seed.
inline std::vector<TokenMeta> random_meta(int B, int S, MetaKind kind, uint64_t seed) {
  std::vector<TokenMeta> all;
  for (int b = 0; b < B; ++b) {
    const std::vector<TokenMeta> row = random_row(S, kind, seed * 1000003 + b);
    all.insert(all.end(), row.begin(), row.end());
  }
  return all;
}

// n values uniform in [-amplitude, amplitude), stored in dtype t; returned as raw bytes.
inline std::vector<uint8_t> random_tensor(int64_t n, DType t, uint64_t seed, float amplitude = 1.f) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-amplitude, amplitude);
  std::vector<float> f(static_cast<size_t>(n));
  for (float& x : f) x = u(rng);
  std::vector<uint8_t> bytes(static_cast<size_t>(n) * dtype_size(t));
  if (n > 0) from_float(bytes.data(), f.data(), f.size(), t);
  return bytes;
}

}  // namespace rf::testing
