// ringflex io: typed access to the tensors of a safetensors file, with errors that name the tensor.
//
// A command states what it expects — "tensor `q`, F32 or BF16, dimensions [B, Hq, S, D]" — and gets the view or
// one message saying what is wrong. Dimension letters are bound by the first tensor that uses them and checked
// against every later one, so "k's S differs from q's S" is found and worded here rather than by each command.
#pragma once

#include <cstdint>
#include <cstring>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "io/safetensors.h"

namespace rf::io {

struct TensorSpec {
  std::string name;
  std::vector<StDType> dtypes;    // accepted dtypes, any of them
  std::vector<std::string> dims;  // one letter per axis, e.g. {"B", "Hq", "S", "D"}; the rank is their count
  std::string dtype_reason;       // optional, appended to a dtype message, e.g. "like `q`"
};

// Sizes of the dimension letters seen so far, and which tensor fixed each.
class DimSizes {
 public:
  // Binds v's axes to spec.dims, or throws rf::Error "<file>: tensor `k` ..." when an axis disagrees with an
  // earlier binding.
  void bind(const TensorView& v, const TensorSpec& spec, const std::string& file);

  bool has(std::string_view letter) const { return sizes_.find(letter) != sizes_.end(); }
  int64_t operator[](std::string_view letter) const;  // throws rf::Error for an unbound letter

 private:
  struct Bound {
    int64_t size;
    std::string tensor;
  };
  std::map<std::string, Bound, std::less<>> sizes_;
};

// The tensor, checked for dtype, rank and dimension agreement; throws rf::Error naming file, tensor and problem.
const TensorView& require(const SafetensorsFile& f, const TensorSpec& spec, DimSizes& dims);

// Like require, but nullptr when the file has no such tensor.
const TensorView* optional(const SafetensorsFile& f, const TensorSpec& spec, DimSizes& dims);

// The safetensors dtype that stores a C++ element type exactly.
template <typename T>
constexpr StDType dtype_of();
template <>
constexpr StDType dtype_of<float>() {
  return StDType::F32;
}
template <>
constexpr StDType dtype_of<double>() {
  return StDType::F64;
}
template <>
constexpr StDType dtype_of<bf16>() {
  return StDType::BF16;
}
template <>
constexpr StDType dtype_of<int32_t>() {
  return StDType::I32;
}
template <>
constexpr StDType dtype_of<int64_t>() {
  return StDType::I64;
}
template <>
constexpr StDType dtype_of<uint8_t>() {
  return StDType::U8;
}

// The elements of `v` as T; v's dtype must be exactly dtype_of<T>(). Copies, because a tensor's bytes in a
// file need only be aligned to what the writer chose.
template <typename T>
std::vector<T> copy_as(const TensorView& v) {
  RF_CHECK(v.dtype == dtype_of<T>(), "tensor `", v.name, "` has dtype ", dtype_name(v.dtype), ", expected ",
           dtype_name(dtype_of<T>()));
  std::vector<T> out(static_cast<size_t>(v.numel()));
  std::memcpy(out.data(), v.bytes.data(), v.bytes.size());
  return out;
}

// The elements of a floating-point tensor (F32, BF16, F16 or F64) widened or rounded to float32, as checkpoints
// mix them; throws rf::Error for any other dtype.
std::vector<float> to_float32(const TensorView& v);

// The same into out [v.numel()], with no copy of the tensor on the way: a loader widens a weight straight into its
// store (the largest tensor's float32 and bf16 copies beside the store were more than a 24 GiB machine has left).
void widen_into(const TensorView& v, std::span<float> out);

}  // namespace rf::io
