// ringflex cli: the up-front finiteness check of floating-point inputs (`--check-finite`, docs/numerics.md).
//
// The library propagates NaN and infinities exactly where the math puts them; the command line, whose user wants
// an answer or an error, rejects them before computing, naming the file, the tensor and the element.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "io/safetensors.h"

namespace rf::cli {

// Throws rf::Error "<where>: tensor `name` has nan at [i, j, ...] <dims>; pass --no-check-finite to compute
// with it" for the first NaN or infinity of an F32 or BF16 tensor (other dtypes hold none). `dims` names the
// axes in the message, e.g. "[B, Hkv, S, D]".
void check_finite(const std::string& where, const io::TensorView& t, const std::string& dims = "");

// The same for float32 values held in memory: values: shape, row-major.
void check_finite(const std::string& where, const std::string& name, std::span<const float> values,
                  const std::vector<int64_t>& shape);

}  // namespace rf::cli
