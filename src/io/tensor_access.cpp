// ringflex io: the checks behind tensor_access.h and the float widening of checkpoint dtypes.
#include "io/tensor_access.h"

#include <bit>
#include <cmath>

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

std::vector<float> to_float32(const TensorView& v) {
  const size_t n = static_cast<size_t>(v.numel());
  std::vector<float> out(n);
  if (n == 0) return out;  // an empty tensor's bytes may be a null span, which memcpy must not see
  switch (v.dtype) {
    case StDType::F32:
      std::memcpy(out.data(), v.bytes.data(), v.bytes.size());
      break;
    case StDType::BF16:
      to_float(out.data(), copy_as<bf16>(v).data(), n, DType::BF16);
      break;
    case StDType::F16: {
      std::vector<uint16_t> h(n);
      std::memcpy(h.data(), v.bytes.data(), v.bytes.size());
      for (size_t i = 0; i < n; ++i) out[i] = half_to_float(h[i]);
      break;
    }
    case StDType::F64: {
      const std::vector<double> d = copy_as<double>(v);
      for (size_t i = 0; i < n; ++i) out[i] = static_cast<float>(d[i]);
      break;
    }
    default:
      fail("tensor `", v.name, "` has dtype ", dtype_name(v.dtype), ", expected a floating-point dtype");
  }
  return out;
}

}  // namespace rf::io
