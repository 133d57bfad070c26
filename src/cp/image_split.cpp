// ringflex cp: the vision tower's images split over a CP group (see image_split.h).
#include "cp/image_split.h"

#include <algorithm>
#include <numeric>

#include "core/error.h"

namespace rf::cp {

std::vector<int> split_images_by_patches(const std::vector<int64_t>& patches, int ranks) {
  RF_CHECK(ranks >= 1, "split_images_by_patches: ", ranks, " ranks");
  std::vector<size_t> order(patches.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t x, size_t y) { return patches[x] > patches[y]; });
  std::vector<int64_t> load(static_cast<size_t>(ranks), 0);
  std::vector<int> owner(patches.size(), 0);
  for (size_t i : order) {
    const auto least = std::min_element(load.begin(), load.end());
    owner[i] = static_cast<int>(least - load.begin());
    *least += patches[i];
  }
  return owner;
}

void SplitImages::sum(float* values, size_t n) { group_.allreduce(values, n, comm::ReduceOp::Sum, timeout_); }

}  // namespace rf::cp
