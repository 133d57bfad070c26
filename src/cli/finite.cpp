// ringflex cli: the up-front finiteness check (see finite.h).
#include "cli/finite.h"

#include <cmath>
#include <cstring>
#include <sstream>

#include "core/dtype.h"
#include "core/error.h"

namespace rf::cli {

namespace {

constexpr uint16_t kBf16ExponentMask = 0x7f80;  // all-ones exponent: an infinity or a NaN

[[noreturn]] void reject(const std::string& where, const std::string& name, float value, int64_t flat,
                         const std::vector<int64_t>& shape, const std::string& dims) {
  std::ostringstream at;
  at << io::index_string(flat, shape);
  if (!dims.empty()) at << " " << dims;
  fail(where, ": tensor `", name, "` has ",
       std::isnan(value) ? "nan"
       : value > 0       ? "inf"
                         : "-inf",
       " at ", at.str(), "; pass --no-check-finite to compute with it");
}

}  // namespace

void check_finite(const std::string& where, const io::TensorView& t, const std::string& dims) {
  const int64_t n = t.numel();
  if (t.dtype == io::StDType::F32) {
    for (int64_t i = 0; i < n; ++i) {
      float x;
      std::memcpy(&x, t.bytes.data() + i * sizeof(float), sizeof x);  // the mapping need not be 4-byte aligned
      if (!std::isfinite(x)) reject(where, t.name, x, i, t.shape, dims);
    }
  } else if (t.dtype == io::StDType::BF16) {
    for (int64_t i = 0; i < n; ++i) {
      bf16 x;
      std::memcpy(&x, t.bytes.data() + i * sizeof(bf16), sizeof x);
      if ((x.bits & kBf16ExponentMask) == kBf16ExponentMask) reject(where, t.name, bf16_to_float(x), i, t.shape, dims);
    }
  }
}

void check_finite(const std::string& where, const std::string& name, std::span<const float> values,
                  const std::vector<int64_t>& shape) {
  for (size_t i = 0; i < values.size(); ++i)
    if (!std::isfinite(values[i])) reject(where, name, values[i], static_cast<int64_t>(i), shape, "");
}

}  // namespace rf::cli
