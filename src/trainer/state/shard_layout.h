// ringflex trainer: which rank holds which elements of which parameter under the sharded store (ShardedStore, and its
// bytes: ShardedStore::bytes_for, master_bytes_for). Rank q of N owns slice_of(trainable elements, N, q) of the
// trainable layout and slice_of(frozen elements, N, q) of the frozen one, each the parameters in registration order; a
// parameter's piece on q is where its elements meet q's slice, so nothing has to divide by N and a rank may hold parts
// of several tensors or none. The design: docs/parallel-state.md ("Sharded: ZeRO-2 and ZeRO-3", Ownership).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "comm/communicator.h"
#include "model/param_store.h"

namespace rf::trainer {

class ShardLayout {
 public:
  ShardLayout() = default;
  // `registry`'s parameters (shapes only) with the trainable flags `trainable` [slots] over `ranks` ranks.
  ShardLayout(const model::ParamStore& registry, const std::vector<bool>& trainable, int ranks);

  // A parameter's piece on rank q: elements [first, first + n) of it, at `local` in q's slice of its layout (the
  // trainable or the frozen one). n = 0: q holds none of it.
  struct Piece {
    int64_t first = 0, n = 0, local = 0;
  };
  Piece piece(size_t slot, int q) const;

  int ranks() const { return ranks_; }
  size_t size() const { return offset_.size(); }
  bool trainable(size_t slot) const { return trainable_.at(slot); }
  int64_t trainable_elements() const { return trainable_total_; }
  int64_t frozen_elements() const { return frozen_total_; }
  // Rank q's slices of the two layouts.
  comm::Slice trainable_slice(int q) const;
  comm::Slice frozen_slice(int q) const;
  // The float32 masters' elements of the rank holding the most: a padded slice of each layout (ceil(n / N)).
  int64_t largest_masters() const;

 private:
  int ranks_ = 1;
  std::vector<bool> trainable_;  // [slots]
  std::vector<int64_t> offset_;  // [slots]: the first element in its layout
  std::vector<int64_t> numel_;   // [slots]
  int64_t trainable_total_ = 0, frozen_total_ = 0;
};

}  // namespace rf::trainer
