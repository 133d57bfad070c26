// ringflex model: chunked, fused LM head + softcap + cross-entropy (forward and backward in one pass).
#include "model/loss.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "core/error.h"
#include "core/math_constants.h"
#include "cpu/attention.h"
#include "model/elementwise.h"
#include "model/held_weight.h"
#include "model/ops.h"

namespace rf::model {

namespace {

// float32 accumulators of the blocked sum: a fixed count (not the vector width of the kernel path in use), so
// the summation order, and the bits, are the same on every CPU.
constexpr int kLanes = 16;

// Exps summed per float32 lane before the lane totals are folded into the double row total: each lane adds
// kFoldTerms terms, so a partial carries at most (kFoldTerms - 1) + log2(kLanes) = 19 roundings of 2^-24 relative
// (1.1e-6) however long the row is (V = 262144 would otherwise pile up V roundings in one float).
constexpr int64_t kFoldTerms = 16;

// e[v] = exp(z[v] - shift) for v < n, in float32. shift >= max(z), so every argument is <= 0. The attention
// kernels' exp2 on the path the CPU runs (cpu::softmax_exp2: vector paths: relative error < 3e-7, scalar:
// std::exp2) of (z - shift) * log2(e); the rounding of that product adds |z - shift| * 2^-24 relative, which matters
// only for terms already below e^-16 of the largest.
void exp_shifted(const float* z, float shift, float* e, int64_t n) {
  for (int64_t v = 0; v < n; ++v) e[v] = (z[v] - shift) * kLog2e;
  cpu::softmax_exp2(e, e, n);
}

// sum(e[0, n)) with kLanes float32 lane accumulators (independent, so the loop vectorises without reassociating
// anything), each folded into a double every kFoldTerms terms. The order is fixed by n alone.
double blocked_sum(const float* e, int64_t n) {
  constexpr int64_t kBlock = kFoldTerms * kLanes;
  double total = 0.0;
  int64_t v = 0;
  for (; v + kBlock <= n; v += kBlock) {
    float lane[kLanes] = {};
    for (int64_t k = 0; k < kFoldTerms; ++k)
      for (int l = 0; l < kLanes; ++l) lane[l] += e[v + k * kLanes + l];
    float part = 0.f;
    for (int l = 0; l < kLanes; ++l) part += lane[l];
    total += part;
  }
  for (; v < n; ++v) total += e[v];
  return total;
}

// The bf16 compute mode's lookup for a panel: the float32 scratch's address range stands for the panel's bf16 rows as
// the head holds them (so the matmul takes the mapped values, as LoraStore::find does for a widened base, and the
// scratch is never written); everything else goes to the run's own lookup.
class PanelLookup final : public Bf16Lookup {
 public:
  explicit PanelLookup(const Bf16Lookup* outer) : outer_(outer) {}
  void set(const float* scratch, const bf16* panel, int64_t n) {
    scratch_ = scratch;
    panel_ = panel;
    n_ = n;
  }
  const bf16* find(const float* src, int64_t extent) const override {
    if (src >= scratch_ && src + extent <= scratch_ + n_) return panel_ + (src - scratch_);
    return outer_ ? outer_->find(src, extent) : nullptr;
  }

 private:
  const Bf16Lookup* outer_;
  const float* scratch_ = nullptr;
  const bf16* panel_ = nullptr;
  int64_t n_ = 0;
};

// The chunk's products through a head held in another dtype, panel by panel: z[:, p] = x W_p^T into the chunk's
// logits (each element the same K = H dot product as the whole head's), or dx += dz[:, p] W_p summed over the panels
// in vocabulary order (dz null: the forward).
class HeadPanels {
 public:
  explicit HeadPanels(const LmHeadLossArgs& a)
      : a_(a),
        rows_(std::min(a.panel_rows > 0 ? a.panel_rows : head_panel_rows(a.H), std::max<int64_t>(a.V, 1))),
        scratch_(static_cast<size_t>(rows_ * a.H)),
        bf16_held_(a.matmul.dtype == ComputeDtype::Bfloat16 && a.head.dtype == HeldDType::BF16),
        lookup_(a.matmul.weights) {}

  void forward(const float* x, float* z, int64_t n) {
    // x is every panel's operand: rounded to bf16 once for the chunk (the same bits as per call).
    SharedOperands shared(a_.matmul);
    shared.add(x, n * a_.H);
    for_panels(shared.matmul(), [&](const Matmul& mm, const float* w, int64_t v0, int64_t p) {
      gemm(mm, false, true, n, p, a_.H, 1.f, x, a_.H, w, a_.H, 0.f, z + v0, a_.V);
    });
  }

  void backward(const float* dz, float* dx, int64_t n) {
    for_panels(a_.matmul, [&](const Matmul& mm, const float* w, int64_t v0, int64_t p) {
      gemm(mm, false, false, n, a_.H, p, 1.f, dz + v0, a_.V, w, a_.H, 1.f, dx, a_.H);
    });
  }

 private:
  template <typename Product>
  void for_panels(const Matmul& mm, Product&& product) {
    lookup_ = PanelLookup(mm.weights);
    const Matmul panel_mm = bf16_held_ ? Matmul{mm.dtype, &lookup_} : mm;
    for (int64_t v0 = 0; v0 < a_.V; v0 += rows_) {
      const int64_t p = std::min(rows_, a_.V - v0);
      if (bf16_held_)
        lookup_.set(scratch_.data(), static_cast<const bf16*>(a_.head.data) + v0 * a_.H, p * a_.H);
      else
        widen(a_.head, v0 * a_.H, p * a_.H, scratch_.data());
      product(panel_mm, scratch_.data(), v0, p);
    }
  }

  const LmHeadLossArgs& a_;
  int64_t rows_;
  std::vector<float> scratch_;  // [rows_, H] the panel widened (unwritten when the bf16 matmul takes the held rows)
  bool bf16_held_;
  PanelLookup lookup_;
};

}  // namespace

int64_t head_panel_rows(int64_t H) { return std::max<int64_t>(1, kHeadPanelBytes / (std::max<int64_t>(H, 1) * 4)); }

int64_t head_panel_bytes(int64_t V, int64_t H) {
  return std::min(head_panel_rows(H), V) * H * static_cast<int64_t>(sizeof(float));
}

int64_t loss_chunk_tokens(int64_t V, int64_t budget_bytes) {
  return std::max(kMinLossChunkTokens, budget_bytes / (V * static_cast<int64_t>(sizeof(float))));
}

double lm_head_loss(const LmHeadLossArgs& a, const LmHeadLossOut& out) {
  RF_CHECK(a.chunk > 0, "lm_head_loss: chunk must be positive");
  RF_CHECK(a.W != nullptr || a.head.data != nullptr, "lm_head_loss: no head weight (W and head are both null)");
  RF_CHECK(a.W != nullptr || out.dW == nullptr, "lm_head_loss: a held head is frozen: dW must be null");
  const bool backward = out.dx != nullptr || out.dW != nullptr;
  if (a.labels) {
    for (int64_t t = 0; t < a.T; ++t) {
      RF_CHECK(a.labels[t] == kIgnoreLabel || (a.labels[t] >= 0 && a.labels[t] < a.V), "label ", a.labels[t],
               " at token ", t, " is outside [0, vocab_size = ", a.V, ") and is not ", kIgnoreLabel);
    }
  }
  const int64_t C = std::min(a.chunk, std::max<int64_t>(a.T, 1));
  // [C, V]: the chunk's raw logits, capped in place, then overwritten in place by their gradient. The only
  // buffer of vocabulary size besides one row of exps per thread: the loss's extra memory is (C + threads) * V * 4
  // bytes.
  std::vector<float> z(static_cast<size_t>(C * a.V));
  std::vector<double> chunk_loss(static_cast<size_t>(C));
  const ElementwiseKernels& ew = elementwise();
  std::optional<HeadPanels> panels;
  if (!a.W) panels.emplace(a);
  double total = 0.0;
  for (int64_t t0 = 0; t0 < a.T; t0 += C) {
    const int64_t n = std::min(C, a.T - t0);
    const float* x = a.x + t0 * a.H;
    if (panels)
      panels->forward(x, z.data(), n);
    else
      linear_forward(a.matmul, x, a.W, z.data(), n, a.H, a.V);
    bool any_label = false;
#pragma omp parallel if (n * a.V >= kParallelMinElements)
    {
      // [V] exp(capped - max) of the row being reduced: the forward's sum and, scaled, the backward's softmax.
      std::vector<float> ex(static_cast<size_t>(a.V));
#pragma omp for schedule(static)
      for (int64_t i = 0; i < n; ++i) {
        float* cr = z.data() + i * a.V;
        float mx = -std::numeric_limits<float>::infinity();
        if (a.softcap > 0.f) {
          mx = ew.softcap_max(cr, a.V, a.softcap);
        } else {
          for (int64_t v = 0; v < a.V; ++v) mx = std::max(mx, cr[v]);
        }
        exp_shifted(cr, mx, ex.data(), a.V);
        const double sum = blocked_sum(ex.data(), a.V);
        const double lse = mx + std::log(sum);
        const int32_t label = a.labels ? a.labels[t0 + i] : kIgnoreLabel;
        chunk_loss[i] = label == kIgnoreLabel ? 0.0 : lse - cr[label];
        if (out.logits) std::copy_n(cr, a.V, out.logits + (t0 + i) * a.V);
        if (!backward) continue;
        if (label == kIgnoreLabel) {
          std::fill_n(cr, a.V, 0.f);
          continue;
        }
        // d loss / d capped = (softmax - onehot) * loss_scale; through the cap: * (1 - tanh^2).
        ew.cross_entropy_grad(cr, ex.data(), a.V, static_cast<float>(1.0 / sum), label, a.loss_scale, a.softcap);
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      total += chunk_loss[i];
      if (out.token_loss) out.token_loss[t0 + i] = static_cast<float>(chunk_loss[i]);
      any_label = any_label || (a.labels && a.labels[t0 + i] != kIgnoreLabel);
    }
    if (backward && any_label) {
      if (panels)
        panels->backward(z.data(), out.dx + t0 * a.H, n);  // dx only: dW is null (checked above)
      else
        linear_backward(a.matmul, x, a.W, z.data(), out.dx ? out.dx + t0 * a.H : nullptr, out.dW, n, a.H, a.V);
    }
  }
  return total * a.loss_scale;
}

}  // namespace rf::model
