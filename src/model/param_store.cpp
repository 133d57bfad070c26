// ringflex model: the parameter store's registry and its replicated float32 implementation (see param_store.h).
#include "model/param_store.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "core/error.h"
#include "io/tensor_access.h"

namespace rf::model {

std::string_view role_name(Role r) {
  switch (r) {
    case Role::Weights:
      return "weights";
    case Role::Grads:
      return "gradients";
    case Role::ExpAvg:
      return "exp_avg";
    case Role::ExpAvgSq:
      return "exp_avg_sq";
  }
  return "?";
}

Shard shard_of(int64_t n, int rank, int ranks) {
  RF_CHECK(ranks >= 1 && rank >= 0 && rank < ranks && n >= 0, "shard_of: rank ", rank, " of ", ranks, " over ", n,
           " elements");
  Shard s;
  s.padded = (n + ranks - 1) / ranks;
  s.begin = std::min(n, s.padded * rank);
  s.end = std::min(n, s.begin + s.padded);
  return s;
}

// ---------------------------------------------------------------------------------------------------------------
// The registry.
// ---------------------------------------------------------------------------------------------------------------

size_t ParamStore::add(const std::string& name, std::vector<int64_t> shape, int layer, bool matmul) {
  RF_CHECK(!contains(name), "parameter '", name, "' registered twice");
  RF_CHECK(!weights_allocated() && !training_state_exists(), "parameter '", name,
           "' registered after the store's memory was allocated");
  // The byte count must fit int64 too (every allocation size is computed from it).
  int64_t bytes = static_cast<int64_t>(sizeof(float));
  for (int64_t d : shape) {
    RF_CHECK(d >= 0 && !__builtin_mul_overflow(bytes, d, &bytes), "parameter '", name,
             "': its shape implies more than 2^63 bytes");
  }
  ParamInfo p;
  p.name = name;
  p.shape = std::move(shape);
  p.numel = bytes / static_cast<int64_t>(sizeof(float));
  p.offset = total_;
  RF_CHECK(!__builtin_add_overflow(total_, p.numel, &total_) &&
               total_ <= std::numeric_limits<int64_t>::max() / static_cast<int64_t>(sizeof(float)),
           "the parameters' total size overflows int64");
  p.layer = layer;
  p.matmul = matmul;
  if (matmul) {
    p.bf16_offset = bf16_total_;
    bf16_total_ += p.numel;
  }
  p.train_offset = trainable_total_;
  trainable_total_ += p.numel;
  infos_.push_back(std::move(p));
  index_[name] = infos_.size() - 1;
  return infos_.size() - 1;
}

size_t ParamStore::slot(const std::string& name) const {
  const auto it = index_.find(name);
  RF_CHECK(it != index_.end(), "parameter '", name, "' not found");
  return it->second;
}

std::vector<size_t> ParamStore::group(int layer) const {
  std::vector<size_t> out;
  for (size_t i = 0; i < infos_.size(); ++i)
    if (infos_[i].layer == layer) out.push_back(i);
  return out;
}

int64_t ParamStore::weight_bytes() const { return total_ * static_cast<int64_t>(sizeof(float)); }
int64_t ParamStore::trainable_bytes() const { return trainable_total_ * static_cast<int64_t>(sizeof(float)); }
int64_t ParamStore::bf16_bytes() const { return bf16_total_ * static_cast<int64_t>(sizeof(bf16)); }

void ParamStore::freeze(const std::vector<std::string>& patterns) { set_trainable(trainable_after(patterns)); }

std::vector<bool> ParamStore::trainable_after(const std::vector<std::string>& patterns) const {
  std::vector<bool> trainable(infos_.size());
  for (size_t i = 0; i < infos_.size(); ++i) trainable[i] = infos_[i].trainable;
  for (const std::string& pattern : patterns) {
    bool matched = false;
    for (size_t i = 0; i < infos_.size(); ++i) {
      if (infos_[i].name.find(pattern) == std::string::npos) continue;
      trainable[i] = false;
      matched = true;
    }
    RF_CHECK(matched, "config: model.freeze entry '", pattern, "' matches no parameter");
  }
  return trainable;
}

void ParamStore::set_trainable(const std::vector<bool>& trainable) {
  RF_CHECK(trainable.size() == infos_.size(), "set_trainable: ", trainable.size(), " flags for ", infos_.size(),
           " parameters");
  bool same = true;
  for (size_t i = 0; i < infos_.size(); ++i) same = same && infos_[i].trainable == trainable[i];
  if (same) return;
  release_training_state();
  for (size_t i = 0; i < infos_.size(); ++i) infos_[i].trainable = trainable[i];
  relayout();
}

Shard ParamStore::moment_range() const {
  Shard s;
  s.begin = moment_begin_;
  s.end = moment_end_ < 0 ? trainable_total_ : moment_end_;
  s.padded = s.end - s.begin;
  return s;
}

void ParamStore::record_moment_range(int64_t begin, int64_t end) {
  RF_CHECK(0 <= begin && begin <= end && end <= trainable_total_, "moment range [", begin, ", ", end, ") outside the ",
           trainable_total_, " trainable elements");
  moment_begin_ = begin;
  moment_end_ = begin == 0 && end == trainable_total_ ? -1 : end;
}

std::vector<ParamStore::Segment> ParamStore::trainable_segments(int64_t begin, int64_t end) const {
  std::vector<Segment> out;
  for (size_t i = 0; i < infos_.size(); ++i) {
    const ParamInfo& p = infos_[i];
    if (!p.trainable) continue;
    const int64_t lo = std::max(begin, p.train_offset), hi = std::min(end, p.train_offset + p.numel);
    if (lo < hi) out.push_back(Segment{i, lo - p.train_offset, hi - lo, lo});
  }
  return out;
}

void ParamStore::relayout() {
  moment_begin_ = 0;
  moment_end_ = -1;
  trainable_total_ = 0;
  for (ParamInfo& p : infos_) {
    p.train_offset = p.trainable ? trainable_total_ : -1;
    if (p.trainable) trainable_total_ += p.numel;
  }
}

WeightView ParamStore::weight_view(size_t slot, ComputeDtype dtype) {
  WeightView v;
  v.f32 = weight(slot);
  if (dtype == ComputeDtype::Bfloat16 && info(slot).matmul) v.b16 = bf16_weights().find(v.f32, info(slot).numel);
  return v;
}

void ParamStore::read_weight(size_t slot, std::span<float> out) {
  RF_CHECK(static_cast<int64_t>(out.size()) == info(slot).numel, "read_weight: ", out.size(), " elements for ",
           info(slot).name, " of ", info(slot).numel);
  std::copy_n(weight(slot), out.size(), out.data());
}

void ParamStore::write_weight(size_t slot, std::span<const float> in) {
  RF_CHECK(static_cast<int64_t>(in.size()) == info(slot).numel, "write_weight: ", in.size(), " elements for ",
           info(slot).name, " of ", info(slot).numel);
  std::copy(in.begin(), in.end(), mutable_weight(slot));
}

void ParamStore::load_weight(size_t slot, const io::TensorView& v) {
  RF_CHECK(v.numel() == info(slot).numel, "load_weight: ", v.numel(), " elements for ", info(slot).name, " of ",
           info(slot).numel);
  io::widen_into(v, std::span<float>(mutable_weight(slot), static_cast<size_t>(info(slot).numel)));
}

float* ParamStore::mutable_master(size_t slot, int64_t first) { return mutable_weight(slot) + first; }

void ParamStore::set_param_dtype(ParamDtype t) {
  RF_CHECK(t == ParamDtype::Float32, "model.param_dtype: ", param_dtype_name(t),
           " is not implemented by this parameter store (LoRA's and held experts' read float32 working weights)");
  param_dtype_ = t;
}

void ParamStore::mark_streamed(size_t slot) {
  ParamInfo& p = infos_.at(slot);
  RF_CHECK(p.layer == kGlobalGroup, "mark_streamed: ", p.name, " belongs to decoder layer ", p.layer,
           ", only global parameters are streamed");
  p.streamed = true;
}

ParamStore::TableRows ParamStore::rows(size_t slot, std::span<const int32_t> ids, bool want_grads) {
  TableRows t;
  t.values = held_weight(slot);
  t.grads = want_grads ? grad(slot) : nullptr;
  t.row.assign(ids.begin(), ids.end());
  return t;
}

std::span<float> ParamStore::shard(Role role, int rank, int ranks) {
  const std::span<float> all = mutable_flat(role);
  const Shard s = shard_of(static_cast<int64_t>(all.size()), rank, ranks);
  return all.subspan(static_cast<size_t>(s.begin), static_cast<size_t>(s.size()));
}

TensorSet ParamStore::snapshot(Role role) const {
  TensorSet out(TensorSet::Storage::Deferred);
  for (size_t i = 0; i < infos_.size(); ++i) {
    const ParamInfo& p = infos_[i];
    out.add(p.name, p.shape);
    const float* src = role == Role::Weights ? (weights_allocated() ? weight(i) : nullptr)
                       : role == Role::Grads ? grad(i)
                                             : moment(role, i);
    if (src == nullptr) continue;
    out.allocate(i);
    std::copy_n(src, p.numel, out.data(i));
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// Replicated float32 storage.
// ---------------------------------------------------------------------------------------------------------------

void ReplicatedStore::set_param_dtype(ParamDtype t) {
  param_dtype_ = t;
  widened_.clear();
  working_ = {};
  working_version_ = ~uint64_t{0};
}

void ReplicatedStore::allocate_weights() {
  if (weights_allocated_) return;
  weights_.assign(static_cast<size_t>(total_elements()), 0.f);
  weights_allocated_ = true;
  weights_changed();
}

void ReplicatedStore::release_weights() {
  weights_ = {};
  bf16_ = {};
  weights_allocated_ = false;
  bf16_version_ = ~uint64_t{0};
  working_ = {};
  working_version_ = ~uint64_t{0};
  widened_.clear();
}

const float* ReplicatedStore::weight(size_t slot) const {
  if (!widened_.empty()) {
    const auto it = widened_.find(slot);
    if (it != widened_.end()) return it->second.data();
  }
  RF_CHECK(weights_allocated_, "parameter ", info(slot).name, " is not allocated");
  return weights_.data() + info(slot).offset;
}

const bf16* ReplicatedStore::working(size_t slot) {
  RF_CHECK(param_dtype_ == ParamDtype::Bfloat16, "param store: a bf16 working copy of ", info(slot).name,
           " under param_dtype float32");
  const std::lock_guard<std::mutex> lock(bf16_mutex_);
  if (working_version_ != version()) {
    RF_CHECK(weights_allocated_, "run: the parameters are not allocated");
    working_.resize(weights_.size());
    round_to_bf16(weights_.data(), working_.data(), total_elements());
    working_version_ = version();
  }
  return working_.data() + info(slot).offset;
}

const float* ReplicatedStore::widened(size_t slot) const {
  const auto it = widened_.find(slot);
  return it == widened_.end() ? nullptr : it->second.data();
}

void ReplicatedStore::widen_slot(size_t slot) {
  if (widened_.count(slot)) return;
  widened_.emplace(slot, widened_copy(HeldWeight{HeldDType::BF16, working(slot)}, info(slot).numel));
}

void ReplicatedStore::widen_group(int layer) {
  for (size_t slot : group(layer))
    if (!info(slot).streamed) widen_slot(slot);
}

void ReplicatedStore::drop_group(int layer) {
  for (size_t slot : group(layer))
    if (!info(slot).streamed) widened_.erase(slot);
}

void ReplicatedStore::before_forward(int layer) {
  if (param_dtype_ == ParamDtype::Bfloat16) widen_group(layer);
}

void ReplicatedStore::after_forward(int layer) {
  if (param_dtype_ == ParamDtype::Bfloat16) drop_group(layer);
}

void ReplicatedStore::before_backward(int layer) {
  if (param_dtype_ == ParamDtype::Bfloat16) widen_group(layer);
}

void ReplicatedStore::after_backward(int layer) {
  if (param_dtype_ == ParamDtype::Bfloat16) drop_group(layer);
}

void ReplicatedStore::acquire_head(size_t slot) {
  if (param_dtype_ == ParamDtype::Bfloat16) widen_slot(slot);
}

void ReplicatedStore::release_head(size_t slot) { widened_.erase(slot); }

ParamStore::TableRows ReplicatedStore::rows(size_t slot, std::span<const int32_t> ids, bool want_grads) {
  if (param_dtype_ != ParamDtype::Bfloat16) return ParamStore::rows(slot, ids, want_grads);
  // The working copy alone: the float32 masters may not be here (trainer/state/sharded_store.h).
  TableRows t;
  t.values = HeldWeight{HeldDType::BF16, working(slot)};
  t.grads = want_grads ? grad(slot) : nullptr;
  t.row.assign(ids.begin(), ids.end());
  return t;
}

float* ReplicatedStore::mutable_weight(size_t slot) {
  RF_CHECK(weights_allocated_, "parameter ", info(slot).name, " is not allocated");
  weights_changed();
  return weights_.data() + info(slot).offset;
}

const Bf16Lookup& ReplicatedStore::bf16_weights() {
  if (param_dtype_ == ParamDtype::Bfloat16) return *this;  // the working copy is what the matmuls multiply
  const std::lock_guard<std::mutex> lock(bf16_mutex_);
  if (bf16_version_ != version()) {
    RF_CHECK(weights_allocated_, "run: the parameters are not allocated");
    bf16_.resize(static_cast<size_t>(bf16_bytes() / static_cast<int64_t>(sizeof(bf16))));
    for (const ParamInfo& p : infos())
      if (p.matmul) round_to_bf16(weights_.data() + p.offset, bf16_.data() + p.bf16_offset, p.numel);
    bf16_version_ = version();
  }
  return *this;
}

const bf16* ReplicatedStore::find(const float* src, int64_t extent) const {
  // In addresses, not pointer arithmetic: src may lie in another array altogether.
  const uintptr_t at = reinterpret_cast<uintptr_t>(src);
  if (param_dtype_ == ParamDtype::Bfloat16) {
    for (const auto& [slot, values] : widened_) {
      const uintptr_t base = reinterpret_cast<uintptr_t>(values.data());
      if (at < base || (at - base) % sizeof(float) != 0) continue;
      const int64_t offset = static_cast<int64_t>((at - base) / sizeof(float));
      if (offset >= static_cast<int64_t>(values.size())) continue;
      const ParamInfo& p = info(slot);
      if (!p.matmul || offset + extent > p.numel) return nullptr;
      return working_.data() + p.offset + offset;
    }
    return nullptr;
  }
  const uintptr_t base = reinterpret_cast<uintptr_t>(weights_.data());
  if (weights_.empty() || at < base || (at - base) % sizeof(float) != 0) return nullptr;
  const int64_t offset = static_cast<int64_t>((at - base) / sizeof(float));
  if (offset >= static_cast<int64_t>(weights_.size())) return nullptr;
  // The last parameter starting at or before `offset`.
  const auto it = std::upper_bound(infos().begin(), infos().end(), offset,
                                   [](int64_t o, const ParamInfo& p) { return o < p.offset; });
  const ParamInfo& p = *(it - 1);
  if (!p.matmul || offset + extent > p.offset + p.numel) return nullptr;
  return bf16_.data() + p.bf16_offset + (offset - p.offset);
}

void ReplicatedStore::allocate_grads() {
  if (grads_allocated_) return;
  // Uninitialised, then zeroed by all threads (zero_grads): the arena's first-touch page faults are shared out
  // instead of taken by one thread while the others wait.
  grads_ = decltype(grads_)(static_cast<size_t>(trainable_elements()));
  grads_allocated_ = true;
  ReplicatedStore::zero_grads();
}

void ReplicatedStore::allocate_moments() {
  if (moments_allocated_) return;
  const Shard r = moment_range();
  exp_avg_.assign(static_cast<size_t>(r.size()), 0.f);
  exp_avg_sq_.assign(static_cast<size_t>(r.size()), 0.f);
  moments_allocated_ = true;
}

void ReplicatedStore::set_moment_range(int64_t begin, int64_t end) {
  const Shard old = moment_range();
  record_moment_range(begin, end);
  if (!moments_allocated_) return;
  const int64_t lo = std::max(begin, old.begin), hi = std::min(end, old.end);
  for (std::vector<float>* a : {&exp_avg_, &exp_avg_sq_}) {
    std::vector<float> moved(static_cast<size_t>(end - begin), 0.f);
    if (lo < hi) std::copy_n(a->data() + (lo - old.begin), hi - lo, moved.data() + (lo - begin));
    *a = std::move(moved);
  }
}

void ReplicatedStore::zero_grads() {
  // Every optimizer step starts here, over the whole gradient arena (4 bytes a trainable parameter): filled by all
  // threads, as the model's accumulated buffers are (gemma4_run.h zeros), not by one while the others wait.
  float* const g = grads_.data();
  const int64_t n = static_cast<int64_t>(grads_.size());
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) g[i] = 0.f;
}

void ReplicatedStore::release_training_state() {
  grads_ = {};
  exp_avg_ = {};
  exp_avg_sq_ = {};
  grads_allocated_ = moments_allocated_ = false;
}

float* ReplicatedStore::grad(size_t slot) {
  const ParamInfo& p = info(slot);
  return grads_allocated_ && p.trainable ? grads_.data() + p.train_offset : nullptr;
}

const float* ReplicatedStore::grad(size_t slot) const {
  const ParamInfo& p = info(slot);
  return grads_allocated_ && p.trainable ? grads_.data() + p.train_offset : nullptr;
}

float* ReplicatedStore::moment(Role role, size_t slot) {
  return const_cast<float*>(std::as_const(*this).moment(role, slot));
}

const float* ReplicatedStore::moment(Role role, size_t slot) const {
  RF_ASSERT(role == Role::ExpAvg || role == Role::ExpAvgSq);
  const ParamInfo& p = info(slot);
  const Shard r = moment_range();
  const bool inside = p.trainable && p.train_offset >= r.begin && p.train_offset + p.numel <= r.end;
  return moments_allocated_ && inside ? arena(role).data() + (p.train_offset - r.begin) : nullptr;
}

std::span<const float> ReplicatedStore::flat(Role role) const { return arena(role); }

std::span<float> ReplicatedStore::mutable_flat(Role role) {
  if (role == Role::Weights) weights_changed();
  return arena(role);
}

std::span<const float> ReplicatedStore::arena(Role role) const {
  switch (role) {
    case Role::Weights:
      return weights_;
    case Role::Grads:
      return grads_;
    case Role::ExpAvg:
      return exp_avg_;
    case Role::ExpAvgSq:
      return exp_avg_sq_;
  }
  return weights_;
}

std::span<float> ReplicatedStore::arena(Role role) {
  const std::span<const float> a = std::as_const(*this).arena(role);
  return {const_cast<float*>(a.data()), a.size()};
}

}  // namespace rf::model
