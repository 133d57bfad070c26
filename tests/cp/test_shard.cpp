// Shard maps and moving arrays in and out of shards (docs/spec.md §5). Oracles: the schemes' definitions written out
// by hand for small cases, and the round trip unshard(shard(x)) == x for every S and P.
#include <gtest/gtest.h>

#include <numeric>
#include <set>

#include "core/error.h"
#include "cp/shard.h"

namespace rf::cp {
namespace {

TEST(Shard, ContiguousAndZigzagByHand) {
  const ShardMap c = make_shard_map(Scheme::Contiguous, 10, 3);
  EXPECT_EQ(c.L, 4);
  EXPECT_EQ(c.S_padded, 12);
  EXPECT_EQ(c.positions[1], (std::vector<int32_t>{4, 5, 6, 7}));
  const ShardMap z = make_shard_map(Scheme::Zigzag, 10, 3);  // 6 chunks of 2
  EXPECT_EQ(z.L, 4);
  EXPECT_EQ(z.positions[0], (std::vector<int32_t>{0, 1, 10, 11}));
  EXPECT_EQ(z.positions[1], (std::vector<int32_t>{2, 3, 8, 9}));
  EXPECT_EQ(z.positions[2], (std::vector<int32_t>{4, 5, 6, 7}));
  EXPECT_TRUE(z.is_pad(10));
  EXPECT_FALSE(z.is_pad(9));
}

TEST(Shard, EveryPositionOnceForAnySAndP) {
  for (Scheme s : {Scheme::Contiguous, Scheme::Zigzag})
    for (int P : {1, 2, 3, 4, 8})
      for (int S : {1, 2, 3, 7, 8, 63, 64, 65, 300})
        for (int multiple : {1, 4}) {
          const ShardMap m = make_shard_map(s, S, P, multiple);
          EXPECT_EQ(m.L % multiple, 0);
          EXPECT_EQ(m.S_padded, P * m.L);
          EXPECT_GE(m.S_padded, S);
          std::set<int32_t> seen;
          for (const auto& pos : m.positions) {
            EXPECT_EQ(static_cast<int>(pos.size()), m.L);
            seen.insert(pos.begin(), pos.end());
          }
          EXPECT_EQ(static_cast<int>(seen.size()), m.S_padded) << scheme_name(s) << " S=" << S << " P=" << P;
          EXPECT_EQ(*seen.rbegin(), m.S_padded - 1);
        }
}

TEST(Shard, RoundTripAndPadValues) {
  const int B = 2, H = 3, D = 5;
  for (Scheme s : {Scheme::Contiguous, Scheme::Zigzag})
    for (int P : {1, 3, 8})
      for (int S : {1, 5, 17}) {
        const ShardMap m = make_shard_map(s, S, P);
        std::vector<float> full(static_cast<size_t>(B) * H * S * D), back(full.size(), -7.f);
        std::iota(full.begin(), full.end(), 1.f);  // no zeros: padding is recognisable
        std::vector<int32_t> ids(static_cast<size_t>(B) * S);
        std::iota(ids.begin(), ids.end(), 100);
        std::vector<TokenMeta> meta;
        for (int b = 0; b < B; ++b)
          for (int t = 0; t < S; ++t) meta.push_back({t, 1 + t / 3, t % 2 ? 0 : -1});
        for (int r = 0; r < P; ++r) {
          std::vector<float> shard(static_cast<size_t>(B) * H * m.L * D);
          shard_tensor(m, r, full.data(), shard.data(), B, H, D, sizeof(float));
          std::vector<int32_t> sid(static_cast<size_t>(B) * m.L);
          shard_row_array(m, r, ids.data(), sid.data(), B, -100);
          const std::vector<TokenMeta> sm = shard_meta(m, r, meta.data(), B);
          for (int b = 0; b < B; ++b)
            for (int i = 0; i < m.L; ++i) {
              const int32_t pos = m.positions[r][i];
              const TokenMeta& t = sm[static_cast<size_t>(b) * m.L + i];
              const int32_t id = sid[static_cast<size_t>(b) * m.L + i];
              if (m.is_pad(pos)) {
                EXPECT_EQ(t.idx, pos);
                EXPECT_EQ(t.doc, kPaddingDoc);
                EXPECT_EQ(t.group, kNoGroup);
                EXPECT_EQ(id, -100);
                for (int h = 0; h < H; ++h)
                  for (int d = 0; d < D; ++d)
                    EXPECT_EQ(shard[((static_cast<size_t>(b) * H + h) * m.L + i) * D + d], 0.f);
              } else {
                EXPECT_EQ(t.idx, pos);
                EXPECT_EQ(id, 100 + b * S + pos);
              }
            }
          unshard_tensor(m, r, shard.data(), back.data(), B, H, D, sizeof(float));
        }
        EXPECT_EQ(back, full) << scheme_name(s) << " S=" << S << " P=" << P;
      }
}

TEST(Shard, NamesAndErrors) {
  EXPECT_EQ(parse_scheme("zigzag"), Scheme::Zigzag);
  EXPECT_EQ(parse_scheme("contiguous"), Scheme::Contiguous);
  EXPECT_EQ(parse_scheme("balanced"), Scheme::Balanced);
  EXPECT_EQ(scheme_name(Scheme::Zigzag), "zigzag");
  EXPECT_THROW(parse_scheme("striped"), Error);
  EXPECT_THROW(make_shard_map(Scheme::Contiguous, 0, 2), Error);
  EXPECT_THROW(make_shard_map(Scheme::Contiguous, 4, 0), Error);
  EXPECT_THROW(make_shard_map(Scheme::Balanced, 4, 2), Error);
}

}  // namespace
}  // namespace rf::cp
