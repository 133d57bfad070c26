// ringflex io: the checks behind tensor_access.h and the float widening of checkpoint dtypes.
#include "io/tensor_access.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>

namespace rf::io {

namespace {

std::string dtype_list(const std::vector<StDType>& dtypes) {
  std::string s;
  for (size_t i = 0; i < dtypes.size(); ++i) {
    if (i) s += i + 1 == dtypes.size() ? " or " : ", ";
    s += dtype_name(dtypes[i]);
  }
  return s;
}

std::string dims_string(const std::vector<std::string>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + dims[i];
  return s + "]";
}

// IEEE half to float: the exponent is rebiased (15 -> 127), subnormal halves become normal floats, Inf/NaN keep
// their class. Exact: every half is representable as a float.
float half_to_float(uint16_t h) {
  constexpr int kHalfBias = 15, kFloatBias = 127, kHalfMantissaBits = 10, kFloatMantissaBits = 23;
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const int exponent = (h >> kHalfMantissaBits) & 0x1f;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f)
    return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << (kFloatMantissaBits - kHalfMantissaBits)));
  if (exponent == 0) {
    const float magnitude = std::ldexp(static_cast<float>(mantissa), 1 - kHalfBias - kHalfMantissaBits);
    return sign ? -magnitude : magnitude;
  }
  const uint32_t e = static_cast<uint32_t>(exponent - kHalfBias + kFloatBias);
  return std::bit_cast<float>(sign | (e << kFloatMantissaBits) |
                              (mantissa << (kFloatMantissaBits - kHalfMantissaBits)));
}

}  // namespace

void DimSizes::bind(const TensorView& v, const TensorSpec& spec, const std::string& file) {
  RF_CHECK(v.rank() == static_cast<int>(spec.dims.size()), file, ": tensor `", v.name, "` has shape ",
           shape_string(v.shape), ", expected rank ", spec.dims.size(), " ", dims_string(spec.dims));
  for (size_t axis = 0; axis < spec.dims.size(); ++axis) {
    const std::string& letter = spec.dims[axis];
    const int64_t size = v.shape[axis];
    const auto it = sizes_.find(letter);
    if (it == sizes_.end()) {
      sizes_.emplace(letter, Bound{size, v.name});
      continue;
    }
    RF_CHECK(it->second.size == size, file, ": tensor `", v.name, "` has shape ", shape_string(v.shape), " ",
             dims_string(spec.dims), ", but its ", letter, " = ", size, " differs from ", letter, " = ",
             it->second.size, " of tensor `", it->second.tensor, "`");
  }
}

int64_t DimSizes::operator[](std::string_view letter) const {
  const auto it = sizes_.find(letter);
  RF_CHECK(it != sizes_.end(), "internal error: dimension ", letter, " was never bound");
  return it->second.size;
}

const TensorView* optional(const SafetensorsFile& f, const TensorSpec& spec, DimSizes& dims) {
  const TensorView* v = f.find(spec.name);
  if (!v) return nullptr;
  bool dtype_ok = false;
  for (StDType t : spec.dtypes) dtype_ok = dtype_ok || v->dtype == t;
  RF_CHECK(dtype_ok, f.path(), ": tensor `", v->name, "` has dtype ", dtype_name(v->dtype), ", expected ",
           dtype_list(spec.dtypes), spec.dtype_reason.empty() ? "" : " ", spec.dtype_reason);
  dims.bind(*v, spec, f.path());
  return v;
}

const TensorView& require(const SafetensorsFile& f, const TensorSpec& spec, DimSizes& dims) {
  const TensorView* v = optional(f, spec, dims);
  RF_CHECK(v, f.path(), ": missing tensor `", spec.name, "` ", dims_string(spec.dims));
  return *v;
}

void widen_into(const TensorView& v, std::span<float> out) {
  const size_t n = static_cast<size_t>(v.numel());
  RF_CHECK(out.size() == n, "tensor `", v.name, "`: ", n, " elements widened into ", out.size());
  if (n == 0) return;  // an empty tensor's bytes may be a null span, which memcpy must not see
  // The file's bytes (a mapping: no alignment promised) pass through a typed chunk on the stack, so the widening
  // holds no copy of the tensor beside `out` (a Gemma 4 per-layer embedding table is 4.7 GB of bf16).
  const auto widen = [&]<typename T>(T /*type*/, auto&& convert) {
    constexpr size_t kChunk = (size_t{64} << 10) / sizeof(T);
    std::array<T, kChunk> chunk;
    for (size_t first = 0; first < n; first += kChunk) {
      const size_t m = std::min(kChunk, n - first);
      std::memcpy(chunk.data(), v.bytes.data() + first * sizeof(T), m * sizeof(T));
      for (size_t i = 0; i < m; ++i) out[first + i] = convert(chunk[i]);
    }
  };
  switch (v.dtype) {
    case StDType::F32:
      std::memcpy(out.data(), v.bytes.data(), v.bytes.size());
      break;
    case StDType::BF16:
      widen(bf16{}, [](bf16 x) { return bf16_to_float(x); });
      break;
    case StDType::F16:
      widen(uint16_t{}, [](uint16_t h) { return half_to_float(h); });
      break;
    case StDType::F64:
      widen(double{}, [](double d) { return static_cast<float>(d); });
      break;
    default:
      fail("tensor `", v.name, "` has dtype ", dtype_name(v.dtype), ", expected a floating-point dtype");
  }
}

std::vector<float> to_float32(const TensorView& v) {
  std::vector<float> out(static_cast<size_t>(v.numel()));
  widen_into(v, out);
  return out;
}

}  // namespace rf::io
