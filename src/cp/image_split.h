// ringflex cp: the vision tower's images split over a CP group (core/image_split.h): each image's owner chosen by
// patch count, the soft tokens and their gradients summed over the group. cp::make_parallel_context gives a context
// one when its CP group has several ranks and the job splits the tower's work (parallelism.split_vision).
#pragma once

#include <cstdint>
#include <vector>

#include "comm/communicator.h"
#include "core/image_split.h"

namespace rf::cp {

// Which of `ranks` ranks encodes each image, given each image's valid (non-padding) patch count: the largest first,
// each to the rank with the fewest patches so far (the lowest on a tie), so every image is encoded once and the ranks'
// patch counts differ by at most the largest image (the tower's work is about linear in patches: its attention stays
// within an image). A pure function of the counts, the same on every rank of a group.
std::vector<int> split_images_by_patches(const std::vector<int64_t>& patches, int ranks);

class SplitImages final : public ImageSplit {
 public:
  // group: the CP group; it must outlive this object.
  explicit SplitImages(comm::Communicator& group, comm::Timeout timeout = comm::default_timeout())
      : group_(group), timeout_(timeout) {}

  int rank() const override { return group_.rank(); }
  std::vector<int> owners(const std::vector<int64_t>& patches) const override {
    return split_images_by_patches(patches, group_.size());
  }
  void sum(float* values, size_t n) override;

 private:
  comm::Communicator& group_;
  comm::Timeout timeout_;
};

}  // namespace rf::cp
