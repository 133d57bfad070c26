// ringflex cp: the contiguous and zigzag shard maps, and moving arrays in and out of shards (see shard.h).
#include "cp/shard.h"

#include <cstring>

#include "core/error.h"

namespace rf::cp {
namespace {

int ceil_div(int a, int b) { return (a + b - 1) / b; }
int round_up(int a, int m) { return ceil_div(a, m) * m; }

void check_rank(const ShardMap& m, int rank) {
  RF_CHECK(rank >= 0 && rank < m.P, "rank ", rank, " is not one of the shard map's ", m.P, " ranks");
  RF_ASSERT(static_cast<int>(m.positions.size()) == m.P);
}

}  // namespace

std::string scheme_name(Scheme s) {
  switch (s) {
    case Scheme::Contiguous:
      return "contiguous";
    case Scheme::Zigzag:
      return "zigzag";
    case Scheme::Balanced:
      return "balanced";
  }
  return "?";
}

Scheme parse_scheme(const std::string& name) {
  if (name == "contiguous") return Scheme::Contiguous;
  if (name == "zigzag") return Scheme::Zigzag;
  if (name == "balanced") return Scheme::Balanced;
  fail("unknown shard scheme '", name, "' (expected contiguous, zigzag or balanced)");
}

ShardMap make_shard_map(Scheme scheme, int S, int P, int multiple) {
  RF_CHECK(S >= 1, "cannot shard a row of S = ", S, " tokens");
  RF_CHECK(P >= 1, "cannot shard over P = ", P, " ranks");
  RF_CHECK(multiple >= 1, "shard multiple must be positive, got ", multiple);
  RF_CHECK(scheme != Scheme::Balanced, "the balanced scheme needs the row's metadata; use cp::balanced_shard_map");
  ShardMap m;
  m.S = S;
  m.P = P;
  m.scheme = scheme;
  m.positions.assign(static_cast<size_t>(P), {});
  if (scheme == Scheme::Contiguous) {
    m.L = round_up(ceil_div(S, P), multiple);
    for (int r = 0; r < P; ++r)
      for (int i = 0; i < m.L; ++i) m.positions[r].push_back(r * m.L + i);
  } else {
    // 2P chunks of C tokens; rank r holds chunk r then chunk 2P-1-r, so under a causal mask every rank gets one
    // early (cheap) and one late (expensive) chunk.
    const int C = round_up(ceil_div(S, 2 * P), multiple);
    m.L = 2 * C;
    for (int r = 0; r < P; ++r) {
      for (int i = 0; i < C; ++i) m.positions[r].push_back(r * C + i);
      for (int i = 0; i < C; ++i) m.positions[r].push_back((2 * P - 1 - r) * C + i);
    }
  }
  m.S_padded = P * m.L;
  return m;
}

void shard_tensor(const ShardMap& m, int rank, const void* full, void* shard, int B, int H, int D, size_t elem_bytes) {
  check_rank(m, rank);
  const size_t row = static_cast<size_t>(D) * elem_bytes;  // one token's bytes
  const auto* src = static_cast<const uint8_t*>(full);
  auto* dst = static_cast<uint8_t*>(shard);
  const std::vector<int32_t>& pos = m.positions[rank];
  for (int64_t bh = 0; bh < int64_t{B} * H; ++bh)
    for (int i = 0; i < m.L; ++i) {
      uint8_t* out = dst + (bh * m.L + i) * row;
      if (m.is_pad(pos[i]))
        std::memset(out, 0, row);
      else
        std::memcpy(out, src + (bh * m.S + pos[i]) * row, row);
    }
}

void unshard_tensor(const ShardMap& m, int rank, const void* shard, void* full, int B, int H, int D,
                    size_t elem_bytes) {
  check_rank(m, rank);
  const size_t row = static_cast<size_t>(D) * elem_bytes;
  const auto* src = static_cast<const uint8_t*>(shard);
  auto* dst = static_cast<uint8_t*>(full);
  const std::vector<int32_t>& pos = m.positions[rank];
  for (int64_t bh = 0; bh < int64_t{B} * H; ++bh)
    for (int i = 0; i < m.L; ++i)
      if (!m.is_pad(pos[i])) std::memcpy(dst + (bh * m.S + pos[i]) * row, src + (bh * m.L + i) * row, row);
}

void shard_row_array(const ShardMap& m, int rank, const int32_t* full, int32_t* shard, int B, int32_t pad_value) {
  check_rank(m, rank);
  const std::vector<int32_t>& pos = m.positions[rank];
  for (int b = 0; b < B; ++b)
    for (int i = 0; i < m.L; ++i)
      shard[int64_t{b} * m.L + i] = m.is_pad(pos[i]) ? pad_value : full[int64_t{b} * m.S + pos[i]];
}

std::vector<TokenMeta> shard_meta(const ShardMap& m, int rank, const TokenMeta* full, int B) {
  check_rank(m, rank);
  const std::vector<int32_t>& pos = m.positions[rank];
  std::vector<TokenMeta> out(static_cast<size_t>(B) * m.L);
  for (int b = 0; b < B; ++b)
    for (int i = 0; i < m.L; ++i)
      out[static_cast<size_t>(b) * m.L + i] =
          m.is_pad(pos[i]) ? TokenMeta{pos[i], kPaddingDoc, kNoGroup} : full[int64_t{b} * m.S + pos[i]];
  return out;
}

}  // namespace rf::cp
