// ringflex core: element types at the public boundary and bfloat16 conversion.
//
// Inputs and outputs are float32 or bfloat16; everything accumulates in float32 (docs/spec.md §4). bfloat16 is the top
// half of an IEEE float32, so widening is a shift and narrowing rounds to nearest-even on the dropped 16 bits.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <string_view>

namespace rf {

enum class DType : uint8_t { F32, BF16 };

constexpr size_t dtype_size(DType t) { return t == DType::F32 ? 4 : 2; }
constexpr std::string_view dtype_name(DType t) { return t == DType::F32 ? "F32" : "BF16"; }

struct bf16 {
  uint16_t bits;
};

inline float bf16_to_float(bf16 x) { return std::bit_cast<float>(uint32_t{x.bits} << 16); }

// Round to nearest, ties to even; NaN stays NaN (a quiet bit is forced so truncation cannot make it Inf).
inline bf16 float_to_bf16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<uint16_t>((u >> 16) | 0x0040u)};
  const uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;
  return bf16{static_cast<uint16_t>(u >> 16)};
}

// Widen n elements of `src` (dtype t) into float32.
inline void to_float(float* dst, const void* src, size_t n, DType t) {
  if (t == DType::F32) {
    std::copy_n(static_cast<const float*>(src), n, dst);  // no memcpy: an empty tensor may have null pointers
    return;
  }
  const bf16* s = static_cast<const bf16*>(src);
  for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_float(s[i]);
}

// Narrow n float32 values into dtype t (round to nearest even for bf16).
inline void from_float(void* dst, const float* src, size_t n, DType t) {
  if (t == DType::F32) {
    std::copy_n(src, n, static_cast<float*>(dst));  // no memcpy: an empty tensor may have null pointers
    return;
  }
  bf16* d = static_cast<bf16*>(dst);
  for (size_t i = 0; i < n; ++i) d[i] = float_to_bf16(src[i]);
}

}  // namespace rf
