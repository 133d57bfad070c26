// ringflex model: named float32 tensors in the Hugging Face layout: the model's buffers (layer_scalar) and copies of
// the parameter store's arenas as named tensors (ParamStore::snapshot). Where the parameters, their gradients and
// AdamW's moments live is the parameter store (model/param_store.h).
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace rf::model {

struct Tensor {
  std::string name;            // Hugging Face name, e.g. "model.layers.0.self_attn.q_proj.weight"
  std::vector<int64_t> shape;  // row-major
  std::vector<float> data;

  int64_t numel() const;
};

// An ordered set of tensors with lookup by name, in registration order.
class TensorSet {
 public:
  // Allocated: every tensor added is zero-filled memory. Deferred: tensors are names and shapes only until
  // allocate(slot), so a loader can check what a config claims against its files and the machine's memory before
  // any of it is allocated.
  enum class Storage { Allocated, Deferred };

  TensorSet() = default;
  explicit TensorSet(Storage storage) : storage_(storage) {}

  // Adds a tensor (zero, or shape only when Deferred); returns its slot. Throws rf::Error if the name exists
  // already or its element count overflows int64.
  size_t add(const std::string& name, std::vector<int64_t> shape);
  // Zero-filled memory for a Deferred tensor (no-op when it has it already).
  void allocate(size_t slot);
  // float32 bytes of every tensor, allocated or not.
  int64_t total_bytes() const;
  size_t slot(const std::string& name) const;  // throws rf::Error naming a missing tensor
  bool contains(const std::string& name) const { return index_.count(name) > 0; }
  Tensor& operator[](size_t i) { return tensors_[i]; }
  const Tensor& operator[](size_t i) const { return tensors_[i]; }
  float* data(size_t i) { return tensors_[i].data.data(); }
  const float* data(size_t i) const { return tensors_[i].data.data(); }
  size_t size() const { return tensors_.size(); }
  int64_t total_elements() const;
  std::vector<Tensor>::iterator begin() { return tensors_.begin(); }
  std::vector<Tensor>::iterator end() { return tensors_.end(); }
  std::vector<Tensor>::const_iterator begin() const { return tensors_.begin(); }
  std::vector<Tensor>::const_iterator end() const { return tensors_.end(); }

  // Whether tensor i holds its elements (always, in an Allocated set).
  bool allocated(size_t i) const { return static_cast<int64_t>(tensors_[i].data.size()) == tensors_[i].numel(); }

 private:
  Storage storage_ = Storage::Allocated;
  std::vector<Tensor> tensors_;
  std::unordered_map<std::string, size_t> index_;
};

}  // namespace rf::model
