// Tests of the vision tower's images over a CP group (cp/image_split.h): the owners balanced by patch count, computed
// by hand, and the split's sums over loopback ranks against the plain sum of what each rank contributed.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "comm/loopback_comm.h"
#include "cp/image_split.h"

namespace rf::cp {
namespace {

// The tower's work under CP: every image to one rank, the largest first to the least loaded (the lowest on a tie).
TEST(ImageSplit, BalancedByPatchCount) {
  // Sorted: 40 (image 1), 25 (2), 25 (3), 10 (0), 5 (4); loads 40 | 25, then 40 | 50, 50 | 50, 55 | 50.
  EXPECT_EQ(split_images_by_patches({10, 40, 25, 25, 5}, 2), (std::vector<int>{0, 0, 1, 1, 0}));
  EXPECT_EQ(split_images_by_patches({10, 40, 25}, 1), (std::vector<int>{0, 0, 0}));
  EXPECT_EQ(split_images_by_patches({7}, 3), (std::vector<int>{0}));  // fewer images than ranks: the rest idle
  const std::vector<int64_t> many = {900, 120, 630, 630, 252, 70, 280, 2520, 35, 630};
  for (int ranks : {2, 3, 4}) {
    const std::vector<int> owner = split_images_by_patches(many, ranks);
    std::vector<int64_t> load(static_cast<size_t>(ranks), 0);
    for (size_t i = 0; i < many.size(); ++i) {
      ASSERT_TRUE(owner[i] >= 0 && owner[i] < ranks);
      load[static_cast<size_t>(owner[i])] += many[i];
    }
    EXPECT_LE(*std::max_element(load.begin(), load.end()) - *std::min_element(load.begin(), load.end()), 2520)
        << ranks << " ranks";
  }
}

// Each rank contributes its own rows (small integers, exact in any order); every rank reads the same sums, and a
// one-rank context's images (LocalImages) are every image, unsummed.
TEST(ImageSplit, SumsOverTheGroup) {
  for (int ranks : {1, 2, 3}) {
    comm::run_ranks(ranks, [&](comm::Communicator& group) {
      SplitImages split(group);
      EXPECT_EQ(split.rank(), group.rank());
      EXPECT_EQ(split.owners({10, 40, 25}), split_images_by_patches({10, 40, 25}, ranks));
      std::vector<float> values = {static_cast<float>(group.rank() + 1), 0.f, static_cast<float>(10 * group.rank())};
      split.sum(values.data(), values.size());
      const float n = static_cast<float>(ranks);
      EXPECT_EQ(values, (std::vector<float>{n * (n + 1) / 2, 0.f, 10 * n * (n - 1) / 2})) << ranks << " ranks";
    });
  }
  LocalImages local;
  EXPECT_EQ(local.owners({10, 40, 25}), (std::vector<int>{0, 0, 0}));
  std::vector<float> values = {1.f, 2.f};
  local.sum(values.data(), values.size());
  EXPECT_EQ(values, (std::vector<float>{1.f, 2.f}));
}

}  // namespace
}  // namespace rf::cp
