// The work model against brute force (the predicate over every (q, k) pair) and the layer-mix syntax against
// hand-written expectations. Integer counts: every assertion is exact.
#include <gtest/gtest.h>

#include <random>

#include "common/random_case.h"
#include "core/error.h"
#include "cp/shard.h"
#include "cp/work.h"

namespace rf::cp {
namespace {

using rf::testing::MetaKind;

TEST(Work, AllowedKeysMatchBruteForce) {
  std::mt19937_64 rng(7);
  const LayerMask masks[] = {{true, 0, false}, {true, 0, true}, {true, 4, true}, {false, 0, true}, {false, 3, false}};
  for (const MetaKind kind :
       {MetaKind::OneDoc, MetaKind::Packed, MetaKind::PackedImages, MetaKind::Padded, MetaKind::AllPadding}) {
    for (const int block : {1, 5, 16, 64}) {
      const int S = std::uniform_int_distribution<int>(1, 150)(rng);
      const std::vector<TokenMeta> row = rf::testing::random_row(S, kind, rng());
      for (const LayerMask& m : masks) {
        const std::vector<int64_t> got = allowed_keys_per_query(row.data(), S, m, block);
        for (int q = 0; q < S; ++q) {
          int64_t expect = 0;
          for (int k = 0; k < S; ++k) expect += allowed(m, row[q], row[k]) ? 1 : 0;
          ASSERT_EQ(got[q], expect) << rf::testing::kind_name(kind) << " block=" << block << " " << m.name();
        }
      }
    }
  }
}

// Per-rank work through token_work + rank_work equals the count of allowed pairs of each rank's queries, times
// each mask's layer count, summed over rows.
TEST(Work, RankWorkMatchesBruteForce) {
  constexpr int kB = 2, kS = 90, kP = 3;
  const std::vector<TokenMeta> rows = rf::testing::random_meta(kB, kS, MetaKind::PackedImages, 11);
  const LayerMix mix = {{{true, 6, true}, 5}, {{true, 0, true}, 1}};
  const ShardMap map = make_shard_map(Scheme::Zigzag, kS, kP, 4);
  const std::vector<int64_t> got = rank_work(token_work(rows.data(), kB, kS, map.S_padded, mix, 8), map);
  for (int r = 0; r < kP; ++r) {
    int64_t expect = 0;
    for (const LayerKind& kind : mix) {
      for (int b = 0; b < kB; ++b) {
        for (const int32_t q : map.positions[r]) {
          if (map.is_pad(q)) continue;
          for (int k = 0; k < kS; ++k)
            expect += kind.count * (allowed(kind.mask, rows[b * kS + q], rows[b * kS + k]) ? 1 : 0);
        }
      }
    }
    EXPECT_EQ(got[r], expect) << "r=" << r;
  }
}

TEST(Work, ImbalanceIsMaxOverMean) {
  EXPECT_DOUBLE_EQ(imbalance({1, 1, 4, 2}), 4.0 / 2.0);
  EXPECT_DOUBLE_EQ(imbalance({0, 0}), 1.0);
}

TEST(LayerMix, ParsesGemma4Pattern) {
  const LayerMix mix = parse_layer_mix("5xsliding:1024:groups,1xfull:groups");
  ASSERT_EQ(mix.size(), 2u);
  EXPECT_EQ(mix[0].mask, (LayerMask{true, 1024, true}));
  EXPECT_EQ(mix[0].count, 5);
  EXPECT_EQ(mix[1].mask, (LayerMask{true, 0, true}));
  EXPECT_EQ(mix[1].count, 1);
}

TEST(LayerMix, DefaultsAndMerging) {
  const LayerMix mix = parse_layer_mix("full,bidir:7,2xfull,bidir");
  ASSERT_EQ(mix.size(), 3u);
  EXPECT_EQ(mix[0].mask, LayerMask{});
  EXPECT_EQ(mix[0].count, 3);
  EXPECT_EQ(mix[1].mask, (LayerMask{false, 7, false}));
  EXPECT_EQ(mix[2].mask, (LayerMask{false, 0, false}));
}

TEST(LayerMix, RejectsMalformedItems) {
  for (const char* bad : {"", "full,", "sliding", "sliding:0", "sliding:-3", "sliding:12x", "full:512", "0xfull",
                          "5xwindow:3", "bidir:1:2", "full:groups:groups", "3x"}) {
    EXPECT_THROW(parse_layer_mix(bad), rf::Error) << bad;
  }
}

}  // namespace
}  // namespace rf::cp
