// ringflex model: the MoE block beside a Gemma 4 layer's MLP (enable_moe_block), forward and backward
// (gemma4_run.h). The router sees this rank's tokens only (no expert parallelism): each expert runs the tokens
// routed to it as one batch of sgemms.
#include <algorithm>
#include <numeric>

#include "model/gemma4_run.h"

namespace rf::model {

void Gemma4Model::Run::moe_forward(int l, const float* x1, const float* mo, MoeActs& a) {
  const LayerSlots& sl = m.slots_[l];
  const int64_t E = cfg.num_experts, K = cfg.top_k_experts, Im = cfg.moe_intermediate_size;
  a.h1 = zeros(T * H);
  a.r_pf1 = zeros(T);
  rmsnorm_forward(mo, W(sl.post_ff_norm_1), eps, a.h1.data(), a.r_pf1.data(), T, H);

  // Router on the residual x1: scale-free RMSNorm, * scale * H^-1/2, projection, softmax, top-k renormalised,
  // times the chosen experts' per_expert_scale.
  a.rn = zeros(T * H);
  a.r_rn = zeros(T);
  rmsnorm_forward(x1, nullptr, eps, a.rn.data(), a.r_rn.data(), T, H);
  const float root = static_cast<float>(1.0 / std::sqrt(static_cast<double>(H)));
  const float* scale = W(sl.router_scale);
  a.rs = zeros(T * H);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < H; ++i) a.rs[t * H + i] = a.rn[t * H + i] * scale[i] * root;
  a.probs = zeros(T * E);
  linear_forward(a.rs.data(), W(sl.router_proj), a.probs.data(), T, H, E);
  a.top_idx.assign(static_cast<size_t>(T * K), 0);
  a.top_wn = zeros(T * K);
  a.top_sum = zeros(T);
  a.top_w = zeros(T * K);
  const float* pes = W(sl.per_expert_scale);
  for (int64_t t = 0; t < T; ++t) {
    float* p = a.probs.data() + t * E;
    const float mx = *std::max_element(p, p + E);
    float sum = 0.f;
    for (int64_t e = 0; e < E; ++e) sum += p[e] = std::exp(p[e] - mx);
    for (int64_t e = 0; e < E; ++e) p[e] /= sum;
    // Top-k by probability, ties to the lower expert index (torch.topk's choice is unspecified on ties).
    std::vector<int32_t> order(static_cast<size_t>(E));
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + K, order.end(),
                      [p](int32_t x, int32_t y) { return p[x] > p[y] || (p[x] == p[y] && x < y); });
    float top = 0.f;
    for (int64_t j = 0; j < K; ++j) top += p[order[j]];
    a.top_sum[t] = top;
    for (int64_t j = 0; j < K; ++j) {
      a.top_idx[t * K + j] = order[j];
      a.top_wn[t * K + j] = p[order[j]] / top;
      a.top_w[t * K + j] = a.top_wn[t * K + j] * pes[order[j]];
    }
  }

  // Experts on their own pre-norm of x1; each expert runs its tokens as one batch of sgemms.
  a.e_in = zeros(T * H);
  a.r_pre2 = zeros(T);
  rmsnorm_forward(x1, W(sl.pre_ff_norm_2), eps, a.e_in.data(), a.r_pre2.data(), T, H);
  a.routed.assign(static_cast<size_t>(E), {});
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < K; ++j) a.routed[a.top_idx[t * K + j]].push_back(t * K + j);
  a.e_x.assign(E, {});
  a.e_gu.assign(E, {});
  a.e_hm.assign(E, {});
  a.e_eo.assign(E, {});
  a.out2 = zeros(T * H);
  const float* GU = W(sl.experts_gate_up);
  const float* DN = W(sl.experts_down);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = static_cast<int64_t>(a.routed[e].size());
    if (n == 0) continue;
    Vec& X = a.e_x[e];
    X = zeros(n * H);
    for (int64_t r = 0; r < n; ++r) std::copy_n(a.e_in.data() + (a.routed[e][r] / K) * H, H, X.data() + r * H);
    a.e_gu[e] = zeros(n * 2 * Im);
    linear_forward(X.data(), GU + e * 2 * Im * H, a.e_gu[e].data(), n, H, 2 * Im);
    a.e_hm[e] = zeros(n * Im);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t i = 0; i < Im; ++i)
        a.e_hm[e][r * Im + i] = gelu_tanh(a.e_gu[e][r * 2 * Im + i]) * a.e_gu[e][r * 2 * Im + Im + i];
    a.e_eo[e] = zeros(n * H);
    linear_forward(a.e_hm[e].data(), DN + e * H * Im, a.e_eo[e].data(), n, Im, H);
    // Experts in index order, as transformers' index_add_ loop, so each token sums its experts in that order.
    for (int64_t r = 0; r < n; ++r) {
      const int64_t tj = a.routed[e][r];
      const float w = a.top_w[tj];
      float* o = a.out2.data() + (tj / K) * H;
      for (int64_t i = 0; i < H; ++i) o[i] += a.e_eo[e][r * H + i] * w;
    }
  }
  Vec h2 = zeros(T * H);
  a.r_pf2 = zeros(T);
  rmsnorm_forward(a.out2.data(), W(sl.post_ff_norm_2), eps, h2.data(), a.r_pf2.data(), T, H);
  a.ff = a.h1;
  add_into(a.ff.data(), h2.data(), T * H);
}

void Gemma4Model::Run::moe_backward(int l, MoeActs& a, const float* x1, const float* mo, const float* dff, float* dmo,
                                    float* dx1) {
  const LayerSlots& sl = m.slots_[l];
  const int64_t E = cfg.num_experts, K = cfg.top_k_experts, Im = cfg.moe_intermediate_size;
  std::fill_n(dmo, T * H, 0.f);
  rmsnorm_backward(mo, W(sl.post_ff_norm_1), a.r_pf1.data(), dff, dmo, G(sl.post_ff_norm_1), T, H);
  Vec dout2_buf = zeros(T * H);
  rmsnorm_backward(a.out2.data(), W(sl.post_ff_norm_2), a.r_pf2.data(), dff, dout2_buf.data(), G(sl.post_ff_norm_2),
                   T, H);
  const float* dout2 = dout2_buf.data();
  const float* GU = W(sl.experts_gate_up);
  const float* DN = W(sl.experts_down);
  float* gGU = G(sl.experts_gate_up);
  float* gDN = G(sl.experts_down);
  Vec de_in = zeros(T * H);
  Vec dw = zeros(T * K);  // d loss / d top_w
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = static_cast<int64_t>(a.routed[e].size());
    if (n == 0) continue;
    Vec dY = zeros(n * H);
    for (int64_t r = 0; r < n; ++r) {
      const int64_t tj = a.routed[e][r];
      const float* g = dout2 + (tj / K) * H;
      float dot = 0.f;
      for (int64_t i = 0; i < H; ++i) {
        dY[r * H + i] = g[i] * a.top_w[tj];
        dot += g[i] * a.e_eo[e][r * H + i];
      }
      dw[tj] = dot;
    }
    Vec dhm = zeros(n * Im);
    linear_backward(a.e_hm[e].data(), DN + e * H * Im, dY.data(), dhm.data(), gDN ? gDN + e * H * Im : nullptr, n,
                    Im, H);
    Vec dgu = zeros(n * 2 * Im);
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t i = 0; i < Im; ++i) {
        const float gate = a.e_gu[e][r * 2 * Im + i], up = a.e_gu[e][r * 2 * Im + Im + i];
        dgu[r * 2 * Im + i] = dhm[r * Im + i] * up * gelu_tanh_grad(gate);
        dgu[r * 2 * Im + Im + i] = dhm[r * Im + i] * gelu_tanh(gate);
      }
    }
    Vec dX = zeros(n * H);
    linear_backward(a.e_x[e].data(), GU + e * 2 * Im * H, dgu.data(), dX.data(), gGU ? gGU + e * 2 * Im * H : nullptr,
                    n, H, 2 * Im);
    for (int64_t r = 0; r < n; ++r) add_into(de_in.data() + (a.routed[e][r] / K) * H, dX.data() + r * H, H);
  }
  rmsnorm_backward(x1, W(sl.pre_ff_norm_2), a.r_pre2.data(), de_in.data(), dx1, G(sl.pre_ff_norm_2), T, H);

  // Router: top_w = wn * pes[e], wn = p / sum_topk(p); gradients reach the probabilities of chosen experts only.
  const float* pes = W(sl.per_expert_scale);
  float* gpes = G(sl.per_expert_scale);
  Vec dlogits = zeros(T * E);
  for (int64_t t = 0; t < T; ++t) {
    const float* p = a.probs.data() + t * E;
    float s = 0.f;
    std::vector<float> dwn(static_cast<size_t>(K));
    for (int64_t j = 0; j < K; ++j) {
      const int64_t e = a.top_idx[t * K + j];
      if (gpes) gpes[e] += dw[t * K + j] * a.top_wn[t * K + j];
      dwn[j] = dw[t * K + j] * pes[e];
      s += dwn[j] * a.top_wn[t * K + j];
    }
    float* dz = dlogits.data() + t * E;
    float dot = 0.f;  // sum_e dp_e p_e over chosen experts
    for (int64_t j = 0; j < K; ++j) {
      const int64_t e = a.top_idx[t * K + j];
      const float dp = (dwn[j] - s) / a.top_sum[t];
      dz[e] = dp;
      dot += dp * p[e];
    }
    for (int64_t e = 0; e < E; ++e) dz[e] = p[e] * (dz[e] - dot);
  }
  Vec drs = zeros(T * H);
  linear_backward(a.rs.data(), W(sl.router_proj), dlogits.data(), drs.data(), G(sl.router_proj), T, H, E);
  const float root = static_cast<float>(1.0 / std::sqrt(static_cast<double>(H)));
  const float* scale = W(sl.router_scale);
  float* gscale = G(sl.router_scale);
  Vec drn = zeros(T * H);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < H; ++i) {
      if (gscale) gscale[i] += drs[t * H + i] * a.rn[t * H + i] * root;
      drn[t * H + i] = drs[t * H + i] * scale[i] * root;
    }
  }
  rmsnorm_backward(x1, nullptr, a.r_rn.data(), drn.data(), dx1, nullptr, T, H);
}

}  // namespace rf::model
