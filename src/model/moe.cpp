// ringflex model: the MoE block beside a Gemma 4 layer's MLP (enable_moe_block), forward and backward
// (gemma4_run.h). The router sees this rank's tokens only (no expert parallelism across ranks).
//
// Threads: the router runs per token in parallel. The experts' row-local work (gather, gate/up and down sgemms,
// GeGLU, and in the backward the input gradients) is cut into tasks of at most kExpertRowsPerTask routed rows of
// one expert, run in parallel; a row's results do not depend on which rows share its sgemm (no call cuts the
// reduction dimension; ops.h), so any task order gives the same bits. The reductions keep one fixed order:
// each token sums its experts' outputs (and input gradients) in ascending expert index, as transformers'
// index_add_ loop over experts does, with the tokens in parallel; each expert's weight gradient is one sgemm over
// all its rows, experts in parallel; per-expert scale and router scale gradients sum tokens in token order. No
// atomics: the bits are the same at any thread count, and every sum runs in the serial loop's order.
#include <omp.h>

#include <algorithm>
#include <numeric>

#include "model/elementwise.h"
#include "model/gemma4_run.h"

namespace rf::model {

namespace {

// Routed rows per task, at least: enough rows that each sgemm's packing of the expert's weights (2 * Im * H
// floats) is amortised over many rows, few enough that the rows of an expert (T * top_k / E on average) make
// several tasks to share out. Each task's smaller sgemm (rows x Im x H) is also kept above
// kParallelMinMultiplyAdds, which is above OpenBLAS's small-matrix cut-off (10^6 multiply-adds in its x86-64
// builds): below it OpenBLAS switches to a kernel that sums K in another order, so cutting a small expert into
// tasks would change its bits against one sgemm over all its rows.
constexpr int64_t kExpertRowsPerTask = 128;

// Columns per block of the router scale's gradient: one 64-byte cache line of float32.
constexpr int64_t kScaleColumnsPerBlock = 16;

struct ExpertTask {
  int64_t expert, row0, rows;
};

std::vector<ExpertTask> expert_tasks(const std::vector<std::vector<int64_t>>& routed, int64_t madds_per_row) {
  const int64_t step = std::max(kExpertRowsPerTask,
                                (kParallelMinMultiplyAdds + madds_per_row - 1) / std::max<int64_t>(madds_per_row, 1));
  std::vector<ExpertTask> tasks;
  for (int64_t e = 0; e < static_cast<int64_t>(routed.size()); ++e) {
    const int64_t n = static_cast<int64_t>(routed[e].size());
    for (int64_t r = 0; r < n; r += step) tasks.push_back({e, r, std::min(step, n - r)});
  }
  return tasks;
}

// Work in multiply-adds below which a loop over tasks runs on one thread (as kParallelMinMultiplyAdds for sgemm).
bool worth_threads(int64_t multiply_adds) { return multiply_adds >= kParallelMinMultiplyAdds; }

}  // namespace

void Gemma4Model::Run::moe_forward(int l, const float* x1, const float* mo, MoeActs& a) {
  const LayerSlots& sl = m.slots_[l];
  const int64_t E = cfg.num_experts, K = cfg.top_k_experts, Im = cfg.moe_intermediate_size;
  a.h1 = uninit(T * H);
  a.r_pf1 = uninit(T);
  rmsnorm_forward(mo, W(sl.post_ff_norm_1), eps, a.h1.data(), a.r_pf1.data(), T, H);

  // Router on the residual x1: scale-free RMSNorm, * scale * H^-1/2, projection, softmax, top-k renormalised,
  // times the chosen experts' per_expert_scale.
  a.rn = uninit(T * H);
  a.r_rn = uninit(T);
  rmsnorm_forward(x1, nullptr, eps, a.rn.data(), a.r_rn.data(), T, H);
  const float root = static_cast<float>(1.0 / std::sqrt(static_cast<double>(H)));
  const float* scale = W(sl.router_scale);
  a.rs = uninit(T * H);
#pragma omp parallel for schedule(static) if (T * H >= kParallelMinElements)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < H; ++i) a.rs[t * H + i] = a.rn[t * H + i] * scale[i] * root;
  a.probs = uninit(T * E);
  linear_forward(mm, a.rs.data(), W(sl.router_proj), a.probs.data(), T, H, E);
  a.top_idx.assign(static_cast<size_t>(T * K), 0);
  a.expert_order.assign(static_cast<size_t>(T * K), 0);
  a.top_wn = zeros(T * K);
  a.top_sum = zeros(T);
  a.top_w = zeros(T * K);
  const float* pes = W(sl.per_expert_scale);
#pragma omp parallel if (T * E >= kParallelMinElements)
  {
    std::vector<int32_t> order(static_cast<size_t>(E));  // this thread's expert ranking of one token
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      float* p = a.probs.data() + t * E;
      const float mx = *std::max_element(p, p + E);
      float sum = 0.f;
      for (int64_t e = 0; e < E; ++e) sum += p[e] = std::exp(p[e] - mx);
      for (int64_t e = 0; e < E; ++e) p[e] /= sum;
      // Top-k by probability, ties to the lower expert index (torch.topk's choice is unspecified on ties).
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
      // The token's choices by ascending expert index: the order its expert outputs are summed in.
      int32_t* by_expert = a.expert_order.data() + t * K;
      std::iota(by_expert, by_expert + K, 0);
      const int32_t* idx = a.top_idx.data() + t * K;
      std::sort(by_expert, by_expert + K, [idx](int32_t x, int32_t y) { return idx[x] < idx[y]; });
    }
  }

  // Experts on their own pre-norm of x1.
  a.e_in = uninit(T * H);
  a.r_pre2 = uninit(T);
  rmsnorm_forward(x1, W(sl.pre_ff_norm_2), eps, a.e_in.data(), a.r_pre2.data(), T, H);
  a.routed.assign(static_cast<size_t>(E), {});
  a.row_of.assign(static_cast<size_t>(T * K), 0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < K; ++j) {
      std::vector<int64_t>& rows = a.routed[a.top_idx[t * K + j]];
      a.row_of[t * K + j] = static_cast<int64_t>(rows.size());
      rows.push_back(t * K + j);
    }
  }
  a.e_x.assign(E, {});
  a.e_gu.assign(E, {});
  a.e_hm.assign(E, {});
  a.e_eo.assign(E, {});
  const int64_t routed_madds = T * K * 3 * Im * H;  // gate/up and down sgemms over every routed row
  // Each expert's buffers, written completely by its tasks below (the rows they gather, and sgemm/GeGLU outputs).
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = static_cast<int64_t>(a.routed[e].size());
    if (n == 0) continue;
    a.e_x[e] = uninit(n * H);
    a.e_gu[e] = uninit(n * 2 * Im);
    a.e_hm[e] = uninit(n * Im);
    a.e_eo[e] = uninit(n * H);
  }
  const float* GU = W(sl.experts_gate_up);
  const float* DN = W(sl.experts_down);
  const ElementwiseKernels& ew = elementwise();
  const std::vector<ExpertTask> tasks = expert_tasks(a.routed, Im * H);
#pragma omp parallel for schedule(dynamic, 1) if (worth_threads(routed_madds))
  for (size_t k = 0; k < tasks.size(); ++k) {
    const ExpertTask& tk = tasks[k];
    const int64_t e = tk.expert, r0 = tk.row0, n = tk.rows;
    // x: [n, H] this task's rows of the expert's gathered inputs; gu: [n, 2*Im]; hm: [n, Im]; eo: [n, H].
    float* x = a.e_x[e].data() + r0 * H;
    float* gu = a.e_gu[e].data() + r0 * 2 * Im;
    float* hm = a.e_hm[e].data() + r0 * Im;
    float* eo = a.e_eo[e].data() + r0 * H;
    for (int64_t r = 0; r < n; ++r) std::copy_n(a.e_in.data() + (a.routed[e][r0 + r] / K) * H, H, x + r * H);
    linear_forward(mm, x, GU + e * 2 * Im * H, gu, n, H, 2 * Im);
    for (int64_t r = 0; r < n; ++r) ew.geglu_forward(gu + r * 2 * Im, gu + r * 2 * Im + Im, hm + r * Im, Im);
    linear_forward(mm, hm, DN + e * H * Im, eo, n, Im, H);
  }
  // Each token sums its experts' weighted outputs in ascending expert index, tokens in parallel.
  a.out2 = zeros(T * H);
#pragma omp parallel for schedule(static) if (T * K * H >= kParallelMinElements)
  for (int64_t t = 0; t < T; ++t) {
    float* o = a.out2.data() + t * H;
    for (int64_t c = 0; c < K; ++c) {
      const int64_t tj = t * K + a.expert_order[t * K + c];
      const float* eo = a.e_eo[a.top_idx[tj]].data() + a.row_of[tj] * H;
      const float w = a.top_w[tj];
      for (int64_t i = 0; i < H; ++i) o[i] += eo[i] * w;
    }
  }
  Vec h2 = uninit(T * H);
  a.r_pf2 = uninit(T);
  rmsnorm_forward(a.out2.data(), W(sl.post_ff_norm_2), eps, h2.data(), a.r_pf2.data(), T, H);
  a.ff = copy_of(a.h1);
  add_into(a.ff.data(), h2.data(), T * H);
}

// Overwrites the experts' activations a.e_eo (with d loss / d expert output) and a.e_gu (with d loss / d gate-up):
// the layer's activations are recomputed for its backward and dropped after it.
void Gemma4Model::Run::moe_backward(int l, MoeActs& a, const float* x1, const float* mo, const float* dff, float* dmo,
                                    float* dx1) {
  const LayerSlots& sl = m.slots_[l];
  const int64_t E = cfg.num_experts, K = cfg.top_k_experts, Im = cfg.moe_intermediate_size;
  std::fill_n(dmo, T * H, 0.f);
  rmsnorm_backward(mo, W(sl.post_ff_norm_1), a.r_pf1.data(), dff, dmo, G(sl.post_ff_norm_1), T, H);
  Vec dout2_buf = zeros(T * H);
  rmsnorm_backward(a.out2.data(), W(sl.post_ff_norm_2), a.r_pf2.data(), dff, dout2_buf.data(), G(sl.post_ff_norm_2), T,
                   H);
  const float* dout2 = dout2_buf.data();
  const float* GU = W(sl.experts_gate_up);
  const float* DN = W(sl.experts_down);
  float* gGU = G(sl.experts_gate_up);
  float* gDN = G(sl.experts_down);
  Vec dw = zeros(T * K);  // d loss / d top_w
  const int64_t routed_madds = T * K * 3 * Im * H;
  // Per expert: d loss / d its gathered inputs, [n, H], summed into de_in per token afterwards.
  std::vector<Vec> e_dx(static_cast<size_t>(E));
#pragma omp parallel for schedule(dynamic, 1) if (worth_threads(routed_madds))
  for (int64_t e = 0; e < E; ++e)
    if (!a.routed[e].empty()) e_dx[e] = zeros(static_cast<int64_t>(a.routed[e].size()) * H);

  // Row-local: dY (into e_eo), dw, d hm, d gate-up (into e_gu), d expert input; tasks in parallel.
  const ElementwiseKernels& ew = elementwise();
  const std::vector<ExpertTask> tasks = expert_tasks(a.routed, Im * H);
#pragma omp parallel if (worth_threads(routed_madds))
  {
    Vec dhm;  // [rows, Im] of this thread's current task
#pragma omp for schedule(dynamic, 1)
    for (size_t k = 0; k < tasks.size(); ++k) {
      const ExpertTask& tk = tasks[k];
      const int64_t e = tk.expert, r0 = tk.row0, n = tk.rows;
      float* dy = a.e_eo[e].data() + r0 * H;       // [n, H] expert output, then its gradient
      float* gu = a.e_gu[e].data() + r0 * 2 * Im;  // [n, 2*Im] gate-up, then its gradient
      for (int64_t r = 0; r < n; ++r) {
        const int64_t tj = a.routed[e][r0 + r];
        const float* g = dout2 + (tj / K) * H;
        float dot = 0.f;
        for (int64_t i = 0; i < H; ++i) {
          dot += g[i] * dy[r * H + i];
          dy[r * H + i] = g[i] * a.top_w[tj];
        }
        dw[tj] = dot;
      }
      dhm.assign(static_cast<size_t>(n * Im), 0.f);
      linear_backward(mm, a.e_hm[e].data() + r0 * Im, DN + e * H * Im, dy, dhm.data(), nullptr, n, Im, H);
      for (int64_t r = 0; r < n; ++r) {
        float* gate_up = gu + r * 2 * Im;  // [2*Im]: gate then up, overwritten by their gradients
        ew.geglu_backward(gate_up, gate_up + Im, dhm.data() + r * Im, gate_up, gate_up + Im, Im, false);
      }
      linear_backward(mm, a.e_x[e].data() + r0 * H, GU + e * 2 * Im * H, gu, e_dx[e].data() + r0 * H, nullptr, n, H,
                      2 * Im);
    }
  }
  // Weight gradients: one sgemm over all of an expert's rows each, experts in parallel when there are enough of
  // them to share out; otherwise experts in turn, each sgemm split over the threads (the same bits either way).
  int64_t active = 0;
  for (const auto& rows : a.routed) active += !rows.empty();
  if (gGU || gDN) {
#pragma omp parallel for schedule(dynamic, 1) if (worth_threads(routed_madds) && active >= omp_get_max_threads())
    for (int64_t e = 0; e < E; ++e) {
      const int64_t n = static_cast<int64_t>(a.routed[e].size());
      if (n == 0) continue;
      if (gDN)
        linear_backward(mm, a.e_hm[e].data(), DN + e * H * Im, a.e_eo[e].data(), nullptr, gDN + e * H * Im, n, Im, H);
      if (gGU)
        linear_backward(mm, a.e_x[e].data(), GU + e * 2 * Im * H, a.e_gu[e].data(), nullptr, gGU + e * 2 * Im * H, n, H,
                        2 * Im);
    }
  }
  // Each token sums its experts' input gradients in ascending expert index, tokens in parallel.
  Vec de_in = zeros(T * H);
#pragma omp parallel for schedule(static) if (T * K * H >= kParallelMinElements)
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t c = 0; c < K; ++c) {
      const int64_t tj = t * K + a.expert_order[t * K + c];
      add_into(de_in.data() + t * H, e_dx[a.top_idx[tj]].data() + a.row_of[tj] * H, H);
    }
  }
  rmsnorm_backward(x1, W(sl.pre_ff_norm_2), a.r_pre2.data(), de_in.data(), dx1, G(sl.pre_ff_norm_2), T, H);

  // Router: top_w = wn * pes[e], wn = p / sum_topk(p); gradients reach the probabilities of chosen experts only.
  const float* pes = W(sl.per_expert_scale);
  float* gpes = G(sl.per_expert_scale);
  if (gpes) {
    // Tokens in order into E sums: serial, T * K adds.
    for (int64_t tj = 0; tj < T * K; ++tj) gpes[a.top_idx[tj]] += dw[tj] * a.top_wn[tj];
  }
  Vec dlogits = zeros(T * E);
#pragma omp parallel if (T * E >= kParallelMinElements)
  {
    std::vector<float> dwn(static_cast<size_t>(K));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const float* p = a.probs.data() + t * E;
      float s = 0.f;
      for (int64_t j = 0; j < K; ++j) {
        const int64_t e = a.top_idx[t * K + j];
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
  }
  Vec drs = zeros(T * H);
  linear_backward(mm, a.rs.data(), W(sl.router_proj), dlogits.data(), drs.data(), G(sl.router_proj), T, H, E);
  const float root = static_cast<float>(1.0 / std::sqrt(static_cast<double>(H)));
  const float* scale = W(sl.router_scale);
  float* gscale = G(sl.router_scale);
  Vec drn = zeros(T * H);
#pragma omp parallel for schedule(static) if (T * H >= kParallelMinElements)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < H; ++i) drn[t * H + i] = drs[t * H + i] * scale[i] * root;
  if (gscale) {
    // Blocks of columns in parallel, tokens in order within each: every element sums its tokens in one fixed
    // order, and a block's rows are one cache line each (a whole-column sweep would load a line per token).
    const int64_t blocks = (H + kScaleColumnsPerBlock - 1) / kScaleColumnsPerBlock;
#pragma omp parallel for schedule(static) if (T * H >= kParallelMinElements)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t i0 = blk * kScaleColumnsPerBlock, i1 = std::min(H, i0 + kScaleColumnsPerBlock);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t i = i0; i < i1; ++i) gscale[i] += drs[t * H + i] * a.rn[t * H + i] * root;
    }
  }
  rmsnorm_backward(x1, nullptr, a.r_rn.data(), drn.data(), dx1, nullptr, T, H);
}

}  // namespace rf::model
