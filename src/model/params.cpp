// ringflex model: the named tensor set.
#include "model/params.h"

#include "core/error.h"

namespace rf::model {

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

size_t TensorSet::add(const std::string& name, std::vector<int64_t> shape) {
  RF_CHECK(!contains(name), "tensor '", name, "' registered twice");
  // The byte count must fit int64 too (total_bytes and every allocation size are computed from it).
  int64_t bytes = static_cast<int64_t>(sizeof(float));
  for (int64_t d : shape) {
    RF_CHECK(d >= 0 && !__builtin_mul_overflow(bytes, d, &bytes), "tensor '", name,
             "': its shape implies more than 2^63 bytes");
  }
  Tensor t{name, std::move(shape), {}};
  if (storage_ == Storage::Allocated) t.data.assign(static_cast<size_t>(t.numel()), 0.f);
  tensors_.push_back(std::move(t));
  index_[name] = tensors_.size() - 1;
  return tensors_.size() - 1;
}

void TensorSet::allocate(size_t slot) {
  Tensor& t = tensors_.at(slot);
  if (static_cast<int64_t>(t.data.size()) != t.numel()) t.data.assign(static_cast<size_t>(t.numel()), 0.f);
}

int64_t TensorSet::total_bytes() const {
  int64_t bytes = 0;
  for (const Tensor& t : tensors_) {
    RF_CHECK(!__builtin_add_overflow(bytes, t.numel() * static_cast<int64_t>(sizeof(float)), &bytes),
             "the tensors' total size overflows int64");
  }
  return bytes;
}

size_t TensorSet::slot(const std::string& name) const {
  const auto it = index_.find(name);
  RF_CHECK(it != index_.end(), "tensor '", name, "' not found");
  return it->second;
}

int64_t TensorSet::total_elements() const {
  int64_t n = 0;
  for (const Tensor& t : tensors_) n += t.numel();
  return n;
}

}  // namespace rf::model
