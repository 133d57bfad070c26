// The communication plan against the predicate: brute force over small random rows of every metadata kind, for
// several masks, block sizes, shard schemes and P; plus hand-computed halos, causal skips and group pulls.
// Everything is integer logic, so every assertion is exact.
#include <gtest/gtest.h>

#include <random>

#include "common/random_case.h"
#include "core/error.h"
#include "cp/balance.h"
#include "cp/plan.h"
#include "cp/shard.h"

namespace rf::cp {
namespace {

using rf::testing::MetaKind;

const MetaKind kKinds[] = {MetaKind::OneDoc, MetaKind::Packed, MetaKind::PackedImages, MetaKind::Padded,
                           MetaKind::AllPadding};

// Masks whose reach ranges from one token to the whole row, with and without groups and causality.
const LayerMask kMasks[] = {
    {true, 0, false}, {true, 0, true},  {true, 1, false}, {true, 3, true},
    {true, 7, false}, {true, 20, true}, {false, 0, true}, {false, 5, false},
};

LayerMix all_masks() {
  LayerMix mix;
  for (const LayerMask& m : kMasks) mix.push_back({m, 1});
  return mix;
}

CommPlan plan_of(const std::vector<TokenMeta>& rows, int B, const ShardMap& map, const LayerMix& mix, int block) {
  const std::vector<BlockSummary> sums = summarize_all_shards(rows.data(), B, map, block);
  return plan_from_summaries(PlanGeometry{map.P, B, map.L, block}, sums.data(), mix);
}

bool in_ranges(const std::vector<TokenRange>& ranges, int j) {
  for (const TokenRange& r : ranges) {
    if (j >= r.begin && j < r.end) return true;
  }
  return false;
}

// Every allowed (q on r, k on s) pair must be computed (its block pair not Empty) and, when s != r, the key must
// be among what r receives from s. Full block pairs must be allowed everywhere. And nothing is received that no
// pair needs.
void check_plan_covers_predicate(const std::vector<TokenMeta>& rows, int B, const ShardMap& map, const CommPlan& plan,
                                 const std::string& what) {
  const int P = map.P, L = map.L, block = plan.geometry.block;
  std::vector<std::vector<TokenMeta>> local;
  for (int r = 0; r < P; ++r) local.push_back(shard_meta(map, r, rows.data(), B));
  for (const MaskCommPlan& mp : plan.masks) {
    for (int r = 0; r < P; ++r) {
      for (int s = 0; s < P; ++s) {
        std::vector<bool> used(static_cast<size_t>(L), false);
        for (int b = 0; b < B; ++b) {
          for (int i = 0; i < L; ++i) {
            for (int j = 0; j < L; ++j) {
              const bool ok = allowed(mp.mask, local[r][b * L + i], local[s][b * L + j]);
              const BlockClass c = mp.pair_class(r, s, b, i / block, j / block);
              if (ok) {
                ASSERT_NE(c, BlockClass::Empty) << what << " " << mp.mask.name() << " r=" << r << " s=" << s;
                used[j] = true;
                if (s != r) {
                  ASSERT_TRUE(in_ranges(mp.recv_ranges(r, s), j)) << what << " " << mp.mask.name();
                }
              }
              if (c == BlockClass::Full) {
                ASSERT_TRUE(ok) << what << " " << mp.mask.name();
              }
            }
          }
        }
        if (s == r) {
          ASSERT_TRUE(mp.recv_ranges(r, s).empty());
          continue;
        }
        // Received blocks are exactly the blocks with a non-Empty pair (so the plan is no looser than its
        // classifier), and each such block was needed by the classifier's reasoning.
        for (int j = 0; j < L; ++j) {
          ASSERT_EQ(in_ranges(mp.recv_ranges(r, s), j), mp.needs_block(r, s, j / block)) << what;
        }
      }
    }
  }
}

TEST(CommPlan, NeverSkipsAnAllowedPair) {
  std::mt19937_64 rng(20261129);
  const LayerMix mix = all_masks();
  int cases = 0;
  for (const int P : {2, 3, 4, 8}) {
    for (const MetaKind kind : kKinds) {
      for (const int block : {1, 3, 4}) {
        const int S = std::uniform_int_distribution<int>(P, 9 * P)(rng);
        const int B = 1 + static_cast<int>(rng() % 2);
        const std::vector<TokenMeta> rows = rf::testing::random_meta(B, S, kind, rng());
        const std::string what = "P=" + std::to_string(P) + " S=" + std::to_string(S) + " B=" + std::to_string(B) +
                                 " block=" + std::to_string(block) + " " + rf::testing::kind_name(kind);
        for (const ShardMap& map :
             {make_shard_map(Scheme::Contiguous, S, P, block), make_shard_map(Scheme::Zigzag, S, P, block),
              balanced_shard(rows.data(), B, S, P, mix, block).map}) {
          check_plan_covers_predicate(rows, B, map, plan_of(rows, B, map, mix, block),
                                      what + " " + scheme_name(map.scheme));
          ++cases;
        }
      }
    }
  }
  EXPECT_EQ(cases, 4 * 5 * 3 * 3);
}

// One document, causal window W, contiguous shards with L a multiple of the block: rank r needs the keys with
// idx in [rL - W + 1, rL), rounded out to whole blocks, i.e. from the block holding max(0, rL - W + 1) to rL.
TEST(CommPlan, SlidingHaloIsTheWindowRoundedToBlocks) {
  constexpr int kBlock = 64, kL = 512, kB = 2;
  const KvFormat kv{16, 256, 2};  // Gemma 4 31B sliding layers, bf16
  for (const int P : {2, 4, 8}) {
    const int S = P * kL;
    const std::vector<TokenMeta> rows = rf::testing::random_meta(kB, S, MetaKind::OneDoc, 1);
    const ShardMap map = make_shard_map(Scheme::Contiguous, S, P, kBlock);
    for (const int W : {1, 100, 512, 1024, 1500}) {
      const LayerMask sliding{true, W, false};
      const CommPlan plan = plan_of(rows, kB, map, {{sliding, 5}}, kBlock);
      const MaskCommPlan& mp = plan.for_mask(sliding);
      EXPECT_EQ(mp.layers, 5);
      for (int r = 0; r < P; ++r) {
        const int first = std::max(0, r * kL - W + 1);
        const int first_block_start = first / kBlock * kBlock;
        const int64_t halo = r * kL - first_block_start;
        ASSERT_EQ(mp.recv_tokens(r), halo) << "P=" << P << " W=" << W << " r=" << r;
        // Per sender: the tail of its shard from the halo's start (W > L spans several senders).
        for (int s = 0; s < P; ++s) {
          const int begin = std::max(0, first_block_start - s * kL);
          const std::vector<TokenRange> expect =
              s < r && begin < kL ? std::vector<TokenRange>{{begin, kL}} : std::vector<TokenRange>{};
          ASSERT_EQ(mp.recv_ranges(r, s), expect) << "P=" << P << " W=" << W << " r=" << r << " s=" << s;
        }
        const int64_t bytes = kv_bytes(mp.recv_tokens(r), kB, kv);
        EXPECT_EQ(bytes, halo * kB * 16 * 256 * 2 * 2);
        // The bound, independent of P and S: (W - 1 + one block) tokens of K and V per row.
        EXPECT_LE(bytes, int64_t{W - 1 + kBlock} * kB * 16 * 256 * 2 * 2);
      }
    }
  }
}

TEST(CommPlan, CausalContiguousNeverReceivesLaterKeys) {
  constexpr int kP = 4, kL = 96, kBlock = 32;
  const std::vector<TokenMeta> rows = rf::testing::random_meta(1, kP * kL, MetaKind::OneDoc, 2);
  const ShardMap map = make_shard_map(Scheme::Contiguous, kP * kL, kP, kBlock);
  const LayerMask causal;
  const CommPlan plan = plan_of(rows, 1, map, {{causal, 1}}, kBlock);
  const MaskCommPlan& mp = plan.for_mask(causal);
  for (int r = 0; r < kP; ++r) {
    for (int s = 0; s < kP; ++s) {
      const std::vector<TokenRange> expect = s < r ? std::vector<TokenRange>{{0, kL}} : std::vector<TokenRange>{};
      EXPECT_EQ(mp.recv_ranges(r, s), expect) << "r=" << r << " s=" << s;
    }
    // Sources at steps 1..P-1 are r-1, r-2, ... wrapping round: P-1-r of them are later ranks.
    EXPECT_EQ(mp.skipped_steps(r), kP - 1 - r);
    for (int t = 1; t < kP; ++t) EXPECT_EQ(mp.sends_at(r, t), ring_dest(r, t, kP) > r);
  }
}

// One document of 16 tokens on 2 ranks (L = 8, blocks of 2); image group 0 covers tokens 5..10 across the
// boundary. With a window of 1, only the group reaches across: each side pulls exactly the group's blocks.
TEST(CommPlan, GroupAcrossBoundaryPullsItsBlocks) {
  constexpr int kS = 16, kP = 2, kBlock = 2;
  std::vector<int32_t> group(kS, kNoGroup);
  for (int t = 5; t <= 10; ++t) group[t] = 0;
  const std::vector<TokenMeta> rows = make_row_meta(kS, nullptr, group.data());
  const ShardMap map = make_shard_map(Scheme::Contiguous, kS, kP, kBlock);
  const LayerMask with_groups{true, 1, true}, without{true, 1, false};
  const CommPlan plan = plan_of(rows, 1, map, {{with_groups, 1}, {without, 1}}, kBlock);
  const MaskCommPlan& g = plan.for_mask(with_groups);
  EXPECT_EQ(g.recv_ranges(0, 1), (std::vector<TokenRange>{{0, 4}}));  // tokens 8..11: blocks of 8,9 and 10
  EXPECT_EQ(g.recv_ranges(1, 0), (std::vector<TokenRange>{{4, 8}}));  // tokens 4..7: blocks of 5 and 6,7
  EXPECT_EQ(plan.for_mask(without).recv_tokens(0), 0);
  EXPECT_EQ(plan.for_mask(without).recv_tokens(1), 0);
}

// Documents of 4 tokens never cross a rank (L = 16), so a causal layer needs nothing from anyone.
TEST(CommPlan, ShortPackedDocumentsNeedNothingRemote) {
  constexpr int kS = 64, kP = 4, kBlock = 4;
  std::vector<int32_t> doc(kS);
  for (int t = 0; t < kS; ++t) doc[t] = 1 + t / 4;
  const std::vector<TokenMeta> rows = make_row_meta(kS, doc.data(), nullptr);
  const LayerMask causal;
  const CommPlan plan = plan_of(rows, 1, make_shard_map(Scheme::Contiguous, kS, kP, kBlock), {{causal, 1}}, kBlock);
  const MaskCommPlan& mp = plan.for_mask(causal);
  for (int r = 0; r < kP; ++r) {
    EXPECT_EQ(mp.recv_tokens(r), 0);
    EXPECT_EQ(mp.skipped_steps(r), kP - 1);
  }
}

TEST(CommPlan, LayersWithOneMaskShareOnePlan) {
  const std::vector<TokenMeta> rows = rf::testing::random_meta(1, 32, MetaKind::Packed, 3);
  const LayerMask full, sliding{true, 8, false};
  const CommPlan plan =
      plan_of(rows, 1, make_shard_map(Scheme::Contiguous, 32, 2, 4), {{full, 2}, {sliding, 3}, {full, 1}}, 4);
  ASSERT_EQ(plan.masks.size(), 2u);
  EXPECT_EQ(plan.for_mask(full).layers, 3);
  EXPECT_EQ(plan.for_mask(sliding).layers, 3);
  EXPECT_THROW(plan.for_mask(LayerMask{false, 0, false}), rf::Error);
}

// The plan depends only on its inputs: rebuilding gives the same classes and ranges.
TEST(CommPlan, Deterministic) {
  const std::vector<TokenMeta> rows = rf::testing::random_meta(2, 200, MetaKind::Padded, 4);
  const ShardMap map = make_shard_map(Scheme::Zigzag, 200, 4, 8);
  const CommPlan a = plan_of(rows, 2, map, all_masks(), 8), b = plan_of(rows, 2, map, all_masks(), 8);
  ASSERT_EQ(a.masks.size(), b.masks.size());
  for (size_t k = 0; k < a.masks.size(); ++k) {
    EXPECT_EQ(a.masks[k].classes, b.masks[k].classes);
    EXPECT_EQ(a.masks[k].ranges, b.masks[k].ranges);
  }
}

}  // namespace
}  // namespace rf::cp
