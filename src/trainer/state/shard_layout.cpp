// ringflex trainer: the sharded store's layout (see shard_layout.h).
#include "trainer/state/shard_layout.h"

#include <algorithm>

#include "core/error.h"

namespace rf::trainer {

ShardLayout::ShardLayout(const model::ParamStore& registry, const std::vector<bool>& trainable, int ranks)
    : ranks_(ranks), trainable_(trainable) {
  RF_CHECK(ranks >= 1 && trainable.size() == registry.size(), "shard layout: ", trainable.size(), " flags for ",
           registry.size(), " parameters over ", ranks, " ranks");
  offset_.resize(registry.size());
  numel_.resize(registry.size());
  for (size_t i = 0; i < registry.size(); ++i) {
    int64_t& total = trainable[i] ? trainable_total_ : frozen_total_;
    offset_[i] = total;
    numel_[i] = registry.info(i).numel;
    total += numel_[i];
  }
}

comm::Slice ShardLayout::trainable_slice(int q) const {
  return comm::slice_of(static_cast<size_t>(trainable_total_), ranks_, q);
}

comm::Slice ShardLayout::frozen_slice(int q) const {
  return comm::slice_of(static_cast<size_t>(frozen_total_), ranks_, q);
}

ShardLayout::Piece ShardLayout::piece(size_t slot, int q) const {
  const int64_t base = offset_.at(slot);
  const comm::Slice s = trainable_[slot] ? trainable_slice(q) : frozen_slice(q);
  const int64_t lo = std::max(base, static_cast<int64_t>(s.begin));
  const int64_t hi = std::min(base + numel_[slot], static_cast<int64_t>(s.end));
  if (lo >= hi) return {};
  return Piece{lo - base, hi - lo, lo - static_cast<int64_t>(s.begin)};
}

int64_t ShardLayout::largest_masters() const {
  return model::shard_of(trainable_total_, 0, ranks_).padded + model::shard_of(frozen_total_, 0, ranks_).padded;
}

}  // namespace rf::trainer
