// ringflex model: chunked, fused LM head + softcap + cross-entropy (forward and backward in one pass).
#include "model/loss.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"
#include "model/ops.h"

namespace rf::model {

int64_t loss_chunk_tokens(int64_t V, int64_t budget_bytes) {
  return std::max<int64_t>(1, budget_bytes / (V * static_cast<int64_t>(sizeof(float))));
}

double lm_head_loss(const LmHeadLossArgs& a, const LmHeadLossOut& out) {
  RF_CHECK(a.chunk > 0, "lm_head_loss: chunk must be positive");
  const bool backward = out.dx != nullptr || out.dW != nullptr;
  if (a.labels) {
    for (int64_t t = 0; t < a.T; ++t) {
      RF_CHECK(a.labels[t] == kIgnoreLabel || (a.labels[t] >= 0 && a.labels[t] < a.V), "label ", a.labels[t],
               " at token ", t, " is outside [0, vocab_size = ", a.V, ") and is not ", kIgnoreLabel);
    }
  }
  const int64_t C = std::min(a.chunk, std::max<int64_t>(a.T, 1));
  // [C, V]: the chunk's raw logits, capped in place, then overwritten in place by their gradient. The only
  // buffer of vocabulary size: the loss's extra memory is C * V * 4 bytes.
  std::vector<float> z(static_cast<size_t>(C * a.V));
  std::vector<double> chunk_loss(static_cast<size_t>(C));
  double total = 0.0;
  for (int64_t t0 = 0; t0 < a.T; t0 += C) {
    const int64_t n = std::min(C, a.T - t0);
    const float* x = a.x + t0 * a.H;
    linear_forward(x, a.W, z.data(), n, a.H, a.V);
    bool any_label = false;
#pragma omp parallel for schedule(static) if (n * a.V >= kParallelMinElements)
    for (int64_t i = 0; i < n; ++i) {
      float* cr = z.data() + i * a.V;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t v = 0; v < a.V; ++v) {
        if (a.softcap > 0.f) cr[v] = a.softcap * std::tanh(cr[v] / a.softcap);
        mx = std::max(mx, cr[v]);
      }
      double sum = 0.0;
      for (int64_t v = 0; v < a.V; ++v) sum += std::exp(static_cast<double>(cr[v] - mx));
      const double lse = mx + std::log(sum);
      const int32_t label = a.labels ? a.labels[t0 + i] : kIgnoreLabel;
      chunk_loss[i] = label == kIgnoreLabel ? 0.0 : lse - cr[label];
      if (out.logits) std::copy_n(cr, a.V, out.logits + (t0 + i) * a.V);
      if (!backward) continue;
      // d loss / d capped = (softmax - onehot) * loss_scale; through the cap: * (1 - tanh^2).
      for (int64_t v = 0; v < a.V; ++v) {
        float g = 0.f;
        if (label != kIgnoreLabel) {
          g = static_cast<float>(std::exp(static_cast<double>(cr[v]) - lse)) - (v == label ? 1.f : 0.f);
          g *= a.loss_scale;
          if (a.softcap > 0.f) {
            const float th = cr[v] / a.softcap;
            g *= 1.f - th * th;
          }
        }
        cr[v] = g;
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      total += chunk_loss[i];
      if (out.token_loss) out.token_loss[t0 + i] = static_cast<float>(chunk_loss[i]);
      any_label = any_label || (a.labels && a.labels[t0 + i] != kIgnoreLabel);
    }
    if (backward && any_label) linear_backward(x, a.W, z.data(), out.dx ? out.dx + t0 * a.H : nullptr, out.dW, n,
                                               a.H, a.V);
  }
  return total * a.loss_scale;
}

}  // namespace rf::model
