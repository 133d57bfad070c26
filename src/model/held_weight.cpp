// ringflex model: widening a held weight (see held_weight.h).
#include "model/held_weight.h"

#include <algorithm>
#include <span>

#include "core/dtype.h"
#include "core/error.h"
#include "core/mix.h"
#include "io/safetensors.h"
#include "io/tensor_access.h"

namespace rf::model {

bool lora_dropout_keeps(uint64_t key, uint64_t salt, int64_t row, int64_t pos, int64_t k, float dropout) {
  uint64_t h = splitmix64(key ^ splitmix64(salt));
  for (const int64_t v : {row, pos, k}) h = splitmix64(h ^ static_cast<uint64_t>(v));
  // The top 24 bits as a float in [0, 1): exact in float32.
  const float u = static_cast<float>(h >> 40) * 0x1.0p-24f;
  return u >= dropout;
}

int64_t held_dtype_size(HeldDType t) {
  switch (t) {
    case HeldDType::F32:
      return 4;
    case HeldDType::BF16:
    case HeldDType::F16:
      return 2;
  }
  return 0;
}

void widen(const HeldWeight& w, int64_t first, int64_t n, float* out) {
  RF_ASSERT(w.data != nullptr && first >= 0 && n >= 0);
  switch (w.dtype) {
    case HeldDType::F32:
      std::copy_n(static_cast<const float*>(w.data) + first, n, out);
      return;
    case HeldDType::BF16:
      to_float(out, static_cast<const bf16*>(w.data) + first, static_cast<size_t>(n), DType::BF16);
      return;
    case HeldDType::F16: {
      // io's conversion of half floats, on a view of just these elements.
      io::TensorView v;
      v.dtype = io::StDType::F16;
      v.shape = {n};
      v.bytes =
          std::span<const std::byte>(static_cast<const std::byte*>(w.data) + first * 2, static_cast<size_t>(n) * 2);
      const std::vector<float> f = io::to_float32(v);
      std::copy(f.begin(), f.end(), out);
      return;
    }
  }
}

Widened widened_copy(const HeldWeight& w, int64_t n) {
  Widened values(static_cast<size_t>(n));
  widen(w, 0, n, values.data());
  return values;
}

}  // namespace rf::model
