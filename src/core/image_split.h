// ringflex core: the vision tower's images over a CP group, the parallel context's third member
// (core/attention_backend.h). The ranks of a CP group hold the same rows, so the same images. The tower's work on them
// is shared: each image is encoded and back-propagated by its owner rank alone, the soft tokens [N, F] then summed
// over the group (the other ranks add zeros, x + 0 = x: the bits of encoding it everywhere), and their gradients
// summed likewise, so that the owner back-propagates each image's whole gradient once. The model runs the tower
// through this seam (model/image_run.h) and never sees the group. Implementations: LocalImages below (every image this
// rank's, no sums: a one-rank group, or parallelism.split_vision false) and rf::cp::SplitImages (cp/image_split.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace rf {

class ImageSplit {
 public:
  virtual ~ImageSplit() = default;
  virtual int rank() const = 0;  // in the group; owners() names ranks of it
  // [n] the rank that encodes each image; patches: [n] each image's valid patches, the same on every rank.
  virtual std::vector<int> owners(const std::vector<int64_t>& patches) const = 0;
  // In place: [n] values summed over the group, the same bits on every rank (collective). Nothing without a split.
  virtual void sum(float* values, size_t n) = 0;
};

class LocalImages final : public ImageSplit {
 public:
  int rank() const override { return 0; }
  std::vector<int> owners(const std::vector<int64_t>& patches) const override {
    return std::vector<int>(patches.size(), 0);
  }
  void sum(float* values, size_t n) override {
    (void)values;
    (void)n;
  }
};

}  // namespace rf
