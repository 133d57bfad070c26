// Row metadata builders: the Gemma 4 group rule on hand cases (the seed's own examples) and the synthetic row.
#include <gtest/gtest.h>

#include <vector>

#include "core/row_meta.h"

namespace rf {
namespace {

std::vector<int32_t> groups(std::vector<int32_t> types) {
  return group_ids_from_token_types(types.data(), static_cast<int>(types.size()));
}

TEST(GroupIds, SeedExamples) {
  EXPECT_EQ(groups({0, 0, 0}), (std::vector<int32_t>{-1, -1, -1}));
  EXPECT_EQ(groups({0, 1, 1, 0, 2, 2}), (std::vector<int32_t>{-1, 0, 0, -1, 1, 1}));
  EXPECT_EQ(groups({1, 1, 0}), (std::vector<int32_t>{0, 0, -1}));
  EXPECT_EQ(groups({1, 2, 0, 1}), (std::vector<int32_t>{0, 0, -1, 1}));  // image then video: one run
}

TEST(SyntheticRow, Gemma4VlmRowHasDocsImagesAndPadding) {
  const int S = 16384;
  const std::vector<TokenMeta> row = gemma4_vlm_row(S, 3);
  ASSERT_EQ(row.size(), static_cast<size_t>(S));
  int docs = 0, pads = 0, max_group = -1;
  for (int t = 0; t < S; ++t) {
    EXPECT_EQ(row[t].idx, t);
    pads += row[t].doc == 0;
    docs = std::max(docs, row[t].doc);
    max_group = std::max(max_group, row[t].group);
    if (row[t].doc == 0) {
      EXPECT_EQ(row[t].group, -1);
    }
  }
  EXPECT_EQ(pads, S * 3 / 100);
  EXPECT_GT(docs, 2);
  EXPECT_GE(max_group, 1);
  EXPECT_EQ(gemma4_vlm_row(S, 3)[S / 2].doc, row[S / 2].doc);  // deterministic in the seed
}

}  // namespace
}  // namespace rf
