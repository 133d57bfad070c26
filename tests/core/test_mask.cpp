// The predicate on hand-computed cases, and the block classifier against the predicate: exhaustively over small
// blocks and randomly over larger ones. Exact (integer) logic, so every assertion is exact.
#include <gtest/gtest.h>

#include <random>

#include "common/random_case.h"
#include "core/mask.h"

namespace rf {
namespace {

TokenMeta tok(int idx, int doc = 1, int group = -1) { return {idx, doc, group}; }

TEST(Predicate, CausalIncludesDiagonal) {
  const LayerMask m;  // causal, no window
  EXPECT_TRUE(allowed(m, tok(5), tok(5)));
  EXPECT_TRUE(allowed(m, tok(5), tok(0)));
  EXPECT_FALSE(allowed(m, tok(5), tok(6)));
}

TEST(Predicate, WindowSeesSelfAndWMinusOneBefore) {
  const LayerMask m{true, 3, false};
  EXPECT_TRUE(allowed(m, tok(10), tok(10)));
  EXPECT_TRUE(allowed(m, tok(10), tok(8)));
  EXPECT_FALSE(allowed(m, tok(10), tok(7)));
  EXPECT_FALSE(allowed(m, tok(10), tok(11)));
  const LayerMask w1{true, 1, false};
  EXPECT_TRUE(allowed(w1, tok(4), tok(4)));
  EXPECT_FALSE(allowed(w1, tok(4), tok(3)));
}

TEST(Predicate, BidirectionalWindowIsSymmetric) {
  const LayerMask m{false, 2, false};
  EXPECT_TRUE(allowed(m, tok(4), tok(5)));
  EXPECT_TRUE(allowed(m, tok(4), tok(3)));
  EXPECT_FALSE(allowed(m, tok(4), tok(6)));
  EXPECT_FALSE(allowed(m, tok(4), tok(2)));
}

TEST(Predicate, GroupsCrossCausalEdgeAndWindowButNotDocuments) {
  const LayerMask m{true, 2, true};
  EXPECT_TRUE(allowed(m, tok(3, 1, 0), tok(9, 1, 0)));   // future key, same image
  EXPECT_TRUE(allowed(m, tok(9, 1, 0), tok(3, 1, 0)));   // beyond the window, same image
  EXPECT_FALSE(allowed(m, tok(3, 1, 0), tok(9, 1, 1)));  // another image
  EXPECT_FALSE(allowed(m, tok(3, 1, 0), tok(3, 2, 0)));  // another document (same id cannot make it legal)
  const LayerMask no_groups{true, 2, false};
  EXPECT_FALSE(allowed(no_groups, tok(3, 1, 0), tok(9, 1, 0)));
}

TEST(Predicate, PaddingSeesNothingAndIsSeenByNothing) {
  const LayerMask m{false, 0, true};
  EXPECT_FALSE(allowed(m, tok(1, 0), tok(1, 0)));
  EXPECT_FALSE(allowed(m, tok(1, 0, 0), tok(2, 1, 0)));
  EXPECT_FALSE(allowed(m, tok(1, 1, 0), tok(2, 0, 0)));
}

// Ground truth for a block pair: whether any / every element pair is allowed.
BlockClass truth(const LayerMask& m, const std::vector<TokenMeta>& q, const std::vector<TokenMeta>& k) {
  bool any = false, all = true;
  for (const TokenMeta& a : q)
    for (const TokenMeta& b : k) {
      const bool ok = allowed(m, a, b);
      any |= ok;
      all &= ok;
    }
  return !any ? BlockClass::Empty : all ? BlockClass::Full : BlockClass::Partial;
}

// Conservative: Empty and Full only when the truth says so. Counts how often it was exact, to show the
// classifier is also useful (not "Partial" everywhere).
struct Tally {
  int cases = 0, exact = 0;
};

void check_pair(const LayerMask& m, const std::vector<TokenMeta>& q, const std::vector<TokenMeta>& k, Tally& t) {
  const BlockClass got =
      classify(m, summarize(q.data(), static_cast<int>(q.size())), summarize(k.data(), static_cast<int>(k.size())));
  const BlockClass want = truth(m, q, k);
  ++t.cases;
  t.exact += got == want;
  if (got == BlockClass::Empty) {
    ASSERT_EQ(want, BlockClass::Empty) << m.name();
  }
  if (got == BlockClass::Full) {
    ASSERT_EQ(want, BlockClass::Full) << m.name();
  }
}

std::vector<LayerMask> all_masks() {
  std::vector<LayerMask> masks;
  for (bool causal : {true, false})
    for (int window : {0, 1, 2, 3, 7})
      for (bool groups : {false, true}) masks.push_back({causal, window, groups});
  return masks;
}

TEST(Classifier, ExhaustiveOnTinyBlocks) {
  // Every block of 2 tokens with idx in 0..5, doc in {0,1,2}, group in {-1,0,1} against every other such
  // block, under every mask: 6*6*9*9 token pairs per side is too many, so tokens are drawn from a fixed list
  // that covers each field's boundary values.
  std::vector<TokenMeta> tokens;
  for (int idx : {0, 2, 3, 5})
    for (int doc : {0, 1, 2})
      for (int group : {-1, 0, 1}) tokens.push_back({idx, doc, group});
  std::vector<std::vector<TokenMeta>> blocks;
  for (const TokenMeta& a : tokens) blocks.push_back({a});
  for (size_t i = 0; i < tokens.size(); i += 3)
    for (size_t j = 0; j < tokens.size(); j += 5) blocks.push_back({tokens[i], tokens[j]});
  Tally t;
  for (const LayerMask& m : all_masks())
    for (const auto& q : blocks)
      for (const auto& k : blocks) check_pair(m, q, k, t);
  EXPECT_GT(t.exact, t.cases / 2) << "the classifier is conservative to the point of being useless";
}

TEST(Classifier, RandomRowsCutIntoBlocks) {
  const std::vector<LayerMask> masks = all_masks();
  std::mt19937 rng(7);
  Tally t;
  for (int trial = 0; trial < 60; ++trial) {
    const int S = 40 + trial;
    const auto kind = static_cast<testing::MetaKind>(trial % 4);
    const std::vector<TokenMeta> row = testing::random_row(S, kind, trial);
    for (int block : {1, 3, 8, 16}) {
      for (int q0 = 0; q0 < S; q0 += block)
        for (int k0 = 0; k0 < S; k0 += block) {
          const std::vector<TokenMeta> q(row.begin() + q0, row.begin() + std::min(S, q0 + block));
          const std::vector<TokenMeta> k(row.begin() + k0, row.begin() + std::min(S, k0 + block));
          check_pair(masks[rng() % masks.size()], q, k, t);
        }
    }
  }
  EXPECT_GT(t.exact, t.cases * 3 / 4);
}

TEST(Classifier, ImageBlockOnCausalDiagonalIsFull) {
  std::vector<TokenMeta> q, k;
  for (int i = 0; i < 4; ++i) q.push_back(tok(10 + i, 1, 3));
  for (int i = 0; i < 4; ++i) k.push_back(tok(12 + i, 1, 3));
  EXPECT_EQ(classify({true, 0, true}, summarize(q.data(), 4), summarize(k.data(), 4)), BlockClass::Full);
  EXPECT_EQ(classify({true, 0, false}, summarize(q.data(), 4), summarize(k.data(), 4)), BlockClass::Partial);
}

TEST(Classifier, SummaryOfAllPaddingIsEmptyAgainstEverything) {
  std::vector<TokenMeta> pad = {tok(0, 0), tok(1, 0)}, real = {tok(0), tok(1)};
  for (const LayerMask& m : all_masks()) {
    EXPECT_EQ(classify(m, summarize(pad.data(), 2), summarize(real.data(), 2)), BlockClass::Empty);
    EXPECT_EQ(classify(m, summarize(real.data(), 2), summarize(pad.data(), 2)), BlockClass::Empty);
  }
}

}  // namespace
}  // namespace rf
