// ringflex model: the MoE block beside a Gemma 4 layer's MLP (enable_moe_block), forward and backward
// (gemma4_run.h). The router sees this rank's tokens only; the experts run where the parallel context's dispatch
// puts them (core/expert_parallel.h): here at EP = 1 (no copies: the received layout is the sent one), else on the
// EP rank holding each, the rows sent there and the outputs (and in the backward the input gradients) sent back
// before each token's combine. While a dispatch travels (forward: the rows; backward: their dY) a rank runs the
// rows it routed to its own experts, read from the sent layout; the other ranks' rows run once it arrived (the
// same tasks, so the same bits either way). The backward's combine (the input gradients going back) travels while
// the experts' weight gradients (and their adapters') run, which need none of it; the forward's has nothing
// independent of it to overlap (every token's sum waits for its experts' outputs, and the rest of the block for
// that sum). Either way each token sums in the same fixed order once every row is back, so the bits are those of
// the blocking combine. The store's expert tensors hold every expert, or under expert parallelism this EP rank's
// only (model/expert_store.h): a rank reads and accumulates into the rows of the experts the dispatch brings it
// either way.
//
// Threads: the router runs per token in parallel. The experts' row-local work (gather, gate/up and down sgemms,
// GeGLU, and in the backward the input gradients) is cut into tasks of one expert's rows each (up to
// kExpertStepsPerTask steps of kExpertRowsPerStep rows, a remainder alone), run in parallel, largest first; a row's
// results do not depend on which rows share its sgemm (no call cuts the reduction dimension; ops.h), so any task order
// gives the same bits. The reductions keep one fixed order: each token sums its experts' outputs (and input gradients)
// in ascending expert index, as transformers' index_add_ loop over experts does, with the tokens in parallel; each
// expert's weight gradient is one sgemm over all its rows, experts in parallel; per-expert scale and router scale
// gradients sum tokens in token order. No atomics: the bits are the same at any thread count, and every sum runs in the
// serial loop's order.
#include <omp.h>

#include <algorithm>
#include <numeric>

#include "model/elementwise.h"
#include "model/gemma4_run.h"

namespace rf::model {

namespace {

// Routed rows per step of the cut: a block of an expert's rows is cut into whole steps and a remainder of fewer
// rows. The step keeps each call's smaller sgemm (rows x Im x H) above kParallelMinMultiplyAdds, above OpenBLAS's
// small-matrix cut-off (10^6 multiply-adds in its x86-64 builds): below it OpenBLAS switches to a kernel that sums K
// in another order, so cutting a small expert into tasks would change its bits against one sgemm over all its rows.
constexpr int64_t kExpertRowsPerStep = 128;
// Whole steps per task, at most: every task's sgemms pack the expert's weights (3 * Im * H floats, a copy that is a
// large share of a call's time when its rows are few, as Im is small against H), so a task takes as many of an
// expert's whole steps as it can while an expert's rows (T * top_k / E on average) still make enough tasks to share
// out. The cut into tasks depends on the block's rows alone, so each row meets the same call at any thread count
// (a row's bits can depend on its place in its call: OpenBLAS's AVX2 kernels sum a call's last rows mod 12 in
// another order, and a call of few rows can take its small-matrix kernel or sgemm_direct); the remainder stays a
// task of its own.
constexpr int64_t kExpertStepsPerTask = 4;

// Columns per block of the router scale's gradient: one 64-byte cache line of float32.
constexpr int64_t kScaleColumnsPerBlock = 16;

// The LoRA adapter of an experts weight (held_weight.h, experts > 1; none: ad empty), expert-major: expert g's A_g
// and B_g are contiguous blocks (g a global expert index, one of the experts the adapter holds). The adapter's
// products run in float32 per task on its rows, like the base's, so they keep its bits at any thread count.
struct ExpertLora {
  std::optional<LinearAdapter> ad;
  int64_t at(int64_t g) const { return g - ad->experts_begin; }
  const float* A(int64_t g) const { return ad->A + at(g) * ad->rank * ad->in; }
  const float* B(int64_t g) const { return ad->B + at(g) * ad->out * ad->rank; }
  bool trains() const { return ad && ad->dA != nullptr; }
};

// The adapter of `slot`, which must hold the experts [first, first + here) the dispatch brings to this rank.
ExpertLora expert_lora(ParamStore& store, size_t slot, int64_t first, int64_t here) {
  ExpertLora l;
  l.ad = store.adapter(slot);
  if (l.ad)
    RF_CHECK(l.ad->experts_begin <= first && first + here <= l.ad->experts_begin + l.ad->experts,
             "expert parallelism: the LoRA adapter of ", store.info(slot).name, " holds experts [", l.ad->experts_begin,
             ", ", l.ad->experts_begin + l.ad->experts, "), the dispatch brings [", first, ", ", first + here,
             ") here");
  return l;
}

// y[n, out] += scale (x[n, in] A_g^T) B_g^T.
void expert_lora_forward(const ExpertLora& l, int64_t g, const float* x, float* y, int64_t n) {
  if (!l.ad) return;
  const int64_t r = l.ad->rank, in = l.ad->in, out = l.ad->out;
  std::vector<float> u(static_cast<size_t>(n * r));
  gemm(false, true, n, r, in, 1.f, x, in, l.A(g), in, 0.f, u.data(), r);
  gemm(false, true, n, out, r, l.ad->scale, u.data(), r, l.B(g), r, 1.f, y, out);
}

// dx[n, in] += scale (dy[n, out] B_g) A_g.
void expert_lora_input_grad(const ExpertLora& l, int64_t g, const float* dy, float* dx, int64_t n) {
  if (!l.ad) return;
  const int64_t r = l.ad->rank, in = l.ad->in, out = l.ad->out;
  std::vector<float> v(static_cast<size_t>(n * r));
  gemm(false, false, n, r, out, 1.f, dy, out, l.B(g), r, 0.f, v.data(), r);
  gemm(false, false, n, in, r, l.ad->scale, v.data(), r, l.A(g), in, 1.f, dx, in);
}

// dA_g += scale (dy B_g)^T x; dBg[out, r] += scale dy^T (x A_g^T) (expert g's block, summed over its row blocks
// first and added to dB by the caller, so dB gets one add per step of the loop over micro-batches).
void expert_lora_weight_grad(const ExpertLora& l, int64_t g, const float* x, const float* dy, int64_t n, float* dBg) {
  const int64_t r = l.ad->rank, in = l.ad->in, out = l.ad->out;
  std::vector<float> u(static_cast<size_t>(n * r)), v(static_cast<size_t>(n * r));
  gemm(false, true, n, r, in, 1.f, x, in, l.A(g), in, 0.f, u.data(), r);
  gemm(false, false, n, r, out, 1.f, dy, out, l.B(g), r, 0.f, v.data(), r);
  gemm(true, false, r, in, n, l.ad->scale, v.data(), r, x, in, 1.f, l.ad->dA + l.at(g) * r * in, in);
  gemm(true, false, out, r, n, l.ad->scale, dy, out, u.data(), r, 1.f, dBg, r);
}

// dB_g += dBg.
void expert_lora_add_dB(const ExpertLora& l, int64_t g, const float* dBg) {
  const int64_t n = l.ad->out * l.ad->rank;
  float* dB = l.ad->dB + l.at(g) * n;
  for (int64_t i = 0; i < n; ++i) dB[i] += dBg[i];
}

// A task: rows [row0, row0 + rows) of one block of the received layout (one expert's rows from one source rank).
struct ExpertTask {
  int64_t block, row0, rows;
};

// blocks: rows per block. Every block is cut alone, as the rank that routed its rows would cut that expert's rows
// with every expert local, so each row meets the same sgemm shapes at any EP; the cut depends on the block's rows
// alone, never on the thread count. The tasks come largest first, so a dynamic schedule ends on the smallest ones
// (the threads finish close together); the order changes no bits, as each task writes its own rows.
std::vector<ExpertTask> expert_tasks(const std::vector<int64_t>& blocks, int64_t madds_per_row) {
  const int64_t step = std::max(kExpertRowsPerStep,
                                (kParallelMinMultiplyAdds + madds_per_row - 1) / std::max<int64_t>(madds_per_row, 1));
  const int64_t most = kExpertStepsPerTask * step;
  std::vector<ExpertTask> tasks;
  for (int64_t b = 0; b < static_cast<int64_t>(blocks.size()); ++b) {
    const int64_t whole = blocks[b] / step * step;  // rows in whole steps
    for (int64_t r = 0; r < whole; r += most) tasks.push_back({b, r, std::min(most, whole - r)});
    if (whole < blocks[b]) tasks.push_back({b, whole, blocks[b] - whole});
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const ExpertTask& x, const ExpertTask& y) { return x.rows > y.rows; });
  return tasks;
}

// The tasks on the rows this rank routed to its own experts (block of source rank routing.rank), which can run
// before the dispatch ends, and the others; each in task order.
struct OwnSplit {
  std::vector<size_t> own, others;
};
OwnSplit split_own(const std::vector<ExpertTask>& tasks, const ExpertRouting& routing) {
  OwnSplit s;
  const int64_t here = routing.experts_here();
  for (size_t k = 0; k < tasks.size(); ++k) (tasks[k].block / here == routing.rank ? s.own : s.others).push_back(k);
  return s;
}

std::vector<int64_t> starts_of(const std::vector<int64_t>& counts) {
  std::vector<int64_t> at(counts.size() + 1, 0);
  std::partial_sum(counts.begin(), counts.end(), at.begin() + 1);
  return at;
}

// Index in the store's expert tensors of the first of the `here` experts the dispatch brings to this rank (from
// `first` on): the tensors hold every expert (index = expert), or under expert parallelism this EP rank's experts
// only (model/expert_store.h), which must then be these.
int64_t held_index_of(const ParamStore& ps, const LayerSlots& sl, int64_t first, int64_t here) {
  for (size_t slot : {sl.experts_gate_up, sl.experts_down}) {
    const ParamInfo& p = ps.info(slot);
    RF_CHECK(p.rows_begin <= first && first + here <= p.rows_begin + p.shape.at(0), "expert parallelism: ", p.name,
             " holds experts [", p.rows_begin, ", ", p.rows_begin + p.shape.at(0), "), the dispatch brings [", first,
             ", ", first + here, ") here");
  }
  return first - ps.info(sl.experts_gate_up).rows_begin;
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
  // times the chosen experts' per_expert_scale. The experts take their own pre-norm of the same x1, whose 1/rms is
  // the router's: one pass over x1 writes both norms and the router's scaled input while each row is in cache (the
  // same operations per element as rmsnorm_forward, so the same bits).
  a.rn = uninit(T * H);
  a.r_rn = uninit(T);
  a.rs = uninit(T * H);
  a.e_in = uninit(T * H);
  a.r_pre2 = uninit(T);
  const float root = static_cast<float>(1.0 / std::sqrt(static_cast<double>(H)));
  const float* scale = W(sl.router_scale);
  const float* pre_norm = W(sl.pre_ff_norm_2);
  const ElementwiseKernels& ew = elementwise();
#pragma omp parallel for schedule(static) if (T * H >= kParallelMinElements)
  for (int64_t t = 0; t < T; ++t) {
    const float* x = x1 + t * H;
    const float inv = 1.f / std::sqrt(ew.sum_squares(x, H) / static_cast<float>(H) + eps);
    a.r_rn[t] = inv;
    a.r_pre2[t] = inv;
    float* rn = a.rn.data() + t * H;
    ew.scale_row(x, nullptr, inv, rn, H);
    for (int64_t i = 0; i < H; ++i) a.rs[t * H + i] = rn[i] * scale[i] * root;
    ew.scale_row(x, pre_norm, inv, a.e_in.data() + t * H, H);
  }
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

  a.routed.assign(static_cast<size_t>(E), {});
  a.row_of.assign(static_cast<size_t>(T * K), 0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < K; ++j) {
      std::vector<int64_t>& rows = a.routed[a.top_idx[t * K + j]];
      a.row_of[t * K + j] = static_cast<int64_t>(rows.size());
      rows.push_back(t * K + j);
    }
  }
  // Dispatch: this rank's routed rows to the ranks holding their experts (every expert local at EP = 1).
  ExpertParallel& ep = attn.experts();
  a.routing = ExpertRouting{};
  a.routing.experts = E;
  for (const auto& rows : a.routed) a.routing.sent.push_back(static_cast<int64_t>(rows.size()));
  ep.route(a.routing);
  a.sent_at = starts_of(a.routing.sent);
  a.recv_at = starts_of(a.routing.received);
  const int64_t sent = a.routing.sent_rows(), R = a.routing.received_rows();
  // With every expert here (EP = 1) the received layout is the sent one: the rows stay where they were gathered, and
  // no dispatch or combine copies them (here or in the backward).
  const bool local = a.routing.ranks == 1;
  Vec x_sent = uninit(sent * H);  // [sent, H] the rows' expert inputs in the sent layout
#pragma omp parallel for schedule(static) if (sent * H >= kParallelMinElements)
  for (int64_t tj = 0; tj < T * K; ++tj)
    std::copy_n(a.e_in.data() + (tj / K) * H, H, x_sent.data() + (a.sent_at[a.top_idx[tj]] + a.row_of[tj]) * H);
  if (local) {
    a.e_x = std::move(x_sent);
  } else {
    a.e_x = uninit(R * H);
    ep.start_dispatch(a.routing, x_sent.data(), a.e_x.data(), H);  // finished below, after this rank's own rows
  }
  const float* own_rows = local ? a.e_x.data() : x_sent.data();  // this rank's own rows, in the sent layout
  // The received rows through this rank's experts; written completely by the tasks below.
  a.e_gu = uninit(R * 2 * Im);
  a.e_hm = uninit(R * Im);
  a.e_eo = uninit(R * H);
  const int64_t here = a.routing.experts_here();
  const int64_t first = held_index_of(m.params(), sl, a.routing.first_expert(), here);
  const int64_t routed_madds = R * 3 * Im * H;  // gate/up and down sgemms over every received row
  const float* GU = W(sl.experts_gate_up);
  const float* DN = W(sl.experts_down);
  const int64_t first_expert = a.routing.first_expert();
  const ExpertLora lgu = expert_lora(store, sl.experts_gate_up, first_expert, here);
  const ExpertLora ldn = expert_lora(store, sl.experts_down, first_expert, here);
  const std::vector<ExpertTask> tasks = expert_tasks(a.routing.received, Im * H);
  const auto run_task = [&](const ExpertTask& tk, const float* x) {
    // e: the expert's index in the store's expert tensors; g: the expert (its adapter's index).
    const int64_t e = first + tk.block % here, g = first_expert + tk.block % here;
    const int64_t r0 = a.recv_at[tk.block] + tk.row0, n = tk.rows;
    // x: [n, H] this task's rows; gu: [n, 2*Im]; hm: [n, Im]; eo: [n, H].
    float* gu = a.e_gu.data() + r0 * 2 * Im;
    float* hm = a.e_hm.data() + r0 * Im;
    float* eo = a.e_eo.data() + r0 * H;
    linear_forward(mm, x, GU + e * 2 * Im * H, gu, n, H, 2 * Im);
    expert_lora_forward(lgu, g, x, gu, n);
    for (int64_t r = 0; r < n; ++r) ew.geglu_forward(gu + r * 2 * Im, gu + r * 2 * Im + Im, hm + r * Im, Im);
    linear_forward(mm, hm, DN + e * H * Im, eo, n, Im, H);
    expert_lora_forward(ldn, g, hm, eo, n);
  };
  // This rank's own rows first, read where the sent layout has them, while the other ranks' travel; then theirs.
  const OwnSplit split = split_own(tasks, a.routing);
#pragma omp parallel for schedule(dynamic, 1) if (worth_threads(routed_madds) && !split.own.empty())
  for (size_t k = 0; k < split.own.size(); ++k) {
    if (omp_get_thread_num() == 0) ep.progress_dispatch();
    const ExpertTask& tk = tasks[split.own[k]];
    run_task(tk, own_rows + (a.sent_at[first_expert + tk.block % here] + tk.row0) * H);
  }
  if (!local) ep.finish_dispatch();
  x_sent = Vec{};
#pragma omp parallel for schedule(dynamic, 1) if (worth_threads(routed_madds) && !split.others.empty())
  for (size_t k = 0; k < split.others.size(); ++k) {
    const ExpertTask& tk = tasks[split.others[k]];
    run_task(tk, a.e_x.data() + (a.recv_at[tk.block] + tk.row0) * H);
  }
  // Combine: the outputs back to the ranks whose tokens they are.
  if (local) {
    a.eo_sent = std::move(a.e_eo);  // the backward's dispatch fills e_eo again (with dY)
  } else {
    a.eo_sent = uninit(sent * H);
    ep.combine(a.routing, a.e_eo.data(), a.eo_sent.data(), H);
  }
  // Each token sums its experts' weighted outputs in ascending expert index, tokens in parallel.
  a.out2 = zeros(T * H);
#pragma omp parallel for schedule(static) if (T * K * H >= kParallelMinElements)
  for (int64_t t = 0; t < T; ++t) {
    float* o = a.out2.data() + t * H;
    for (int64_t c = 0; c < K; ++c) {
      const int64_t tj = t * K + a.expert_order[t * K + c];
      const float* eo = a.eo_sent.data() + (a.sent_at[a.top_idx[tj]] + a.row_of[tj]) * H;
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
  ExpertParallel& ep = attn.experts();
  const int64_t sent = a.routing.sent_rows(), R = a.routing.received_rows();
  const int64_t here = a.routing.experts_here(), first_expert = a.routing.first_expert();
  const int64_t first = held_index_of(m.params(), sl, first_expert, here);
  const ExpertLora lgu = expert_lora(store, sl.experts_gate_up, first_expert, here);
  const ExpertLora ldn = expert_lora(store, sl.experts_down, first_expert, here);
  const bool local = a.routing.ranks == 1;  // the received layout is the sent one: no copies (as in the forward)

  // On this rank's tokens: d loss / d top_w, and d loss / d expert output (dout2 times the row's weight), per row.
  Vec dw = zeros(T * K);           // d loss / d top_w
  Vec dy_sent = uninit(sent * H);  // [sent, H] in the sent layout
  {
#pragma omp parallel for schedule(static) if (sent * H >= kParallelMinElements)
    for (int64_t tj = 0; tj < T * K; ++tj) {
      const int64_t row = a.sent_at[a.top_idx[tj]] + a.row_of[tj];
      const float* g = dout2 + (tj / K) * H;
      const float* y = a.eo_sent.data() + row * H;
      float* dy = dy_sent.data() + row * H;
      float dot = 0.f;
      for (int64_t i = 0; i < H; ++i) {
        dot += g[i] * y[i];
        dy[i] = g[i] * a.top_w[tj];
      }
      dw[tj] = dot;
    }
    // The received rows' dY, over their outputs; finished below, after this rank's own rows.
    if (local)
      a.e_eo = std::move(dy_sent);
    else
      ep.start_dispatch(a.routing, dy_sent.data(), a.e_eo.data(), H);
  }
  a.eo_sent = Vec{};  // the outputs were read by dw above only
  // This rank's own rows' dY, in the sent layout.
  const float* own_dy = local ? a.e_eo.data() : dy_sent.data();
  const int64_t routed_madds = R * 3 * Im * H;
  Vec e_dx = uninit(R * H);  // d loss / d the received rows' inputs: every row written by its task below

  // Row-local: d hm, d gate-up (into e_gu), d expert input; tasks in parallel.
  const ElementwiseKernels& ew = elementwise();
  const std::vector<ExpertTask> tasks = expert_tasks(a.routing.received, Im * H);
  // This rank's own rows first, their dY read where the sent layout has them, while the others' travel.
  const OwnSplit split = split_own(tasks, a.routing);
  for (const bool own : {true, false}) {
    if (!own && !local) ep.finish_dispatch();
    const std::vector<size_t>& part = own ? split.own : split.others;
#pragma omp parallel if (worth_threads(routed_madds) && !part.empty())
    {
      Vec dhm;  // [rows, Im] of this thread's current task
#pragma omp for schedule(dynamic, 1)
      for (size_t k = 0; k < part.size(); ++k) {
        if (own && omp_get_thread_num() == 0) ep.progress_dispatch();
        const ExpertTask& tk = tasks[part[k]];
        const int64_t e = first + tk.block % here, g = first_expert + tk.block % here;
        const int64_t r0 = a.recv_at[tk.block] + tk.row0, n = tk.rows;
        const float* dy =
            own ? own_dy + (a.sent_at[g] + tk.row0) * H : a.e_eo.data() + r0 * H;  // [n, H] d expert output
        float* gu = a.e_gu.data() + r0 * 2 * Im;  // [n, 2*Im] gate-up, then its gradient
        // The input gradients are written (beta = 0), not accumulated into zeros: the same values without a
        // zero fill of the buffers first.
        dhm.resize(static_cast<size_t>(n * Im));
        gemm(mm, false, false, n, Im, H, 1.f, dy, H, DN + e * H * Im, Im, 0.f, dhm.data(), Im);
        expert_lora_input_grad(ldn, g, dy, dhm.data(), n);
        for (int64_t r = 0; r < n; ++r) {
          float* gate_up = gu + r * 2 * Im;  // [2*Im]: gate then up, overwritten by their gradients
          ew.geglu_backward(gate_up, gate_up + Im, dhm.data() + r * Im, gate_up, gate_up + Im, Im, false);
        }
        gemm(mm, false, false, n, H, 2 * Im, 1.f, gu, 2 * Im, GU + e * 2 * Im * H, H, 0.f, e_dx.data() + r0 * H, H);
        expert_lora_input_grad(lgu, g, gu, e_dx.data() + r0 * H, n);
      }
    }
  }
  dy_sent = Vec{};
  // The input gradients back to their tokens' ranks, travelling while the weight gradients below run (they read the
  // rows' activations and dY, not e_dx or dx_sent); finished before the tokens sum them.
  Vec dx_sent;
  if (local) {
    dx_sent = std::move(e_dx);
  } else {
    dx_sent = uninit(sent * H);
    ep.start_combine(a.routing, e_dx.data(), dx_sent.data(), H);
  }
  // Weight gradients of this rank's experts: one sgemm over each block's rows (all of an expert's rows at EP = 1),
  // an expert's blocks in source order; experts in parallel when there are enough of them to share out, otherwise
  // experts in turn, each sgemm split over the threads (the same bits either way).
  const int64_t P = a.routing.ranks;
  // This rank's experts by their received rows, most first, so a dynamic schedule ends on the smallest (the threads
  // finish close together); each expert's gradient is its own sgemms, so the order changes no bits.
  std::vector<int64_t> rows_of(static_cast<size_t>(here), 0), by_rows(static_cast<size_t>(here));
  for (int64_t le = 0; le < here; ++le)
    for (int64_t s = 0; s < P; ++s) rows_of[le] += a.routing.received[s * here + le];
  std::iota(by_rows.begin(), by_rows.end(), 0);
  std::stable_sort(by_rows.begin(), by_rows.end(), [&](int64_t x, int64_t y) { return rows_of[x] > rows_of[y]; });
  const int64_t active = std::count_if(rows_of.begin(), rows_of.end(), [](int64_t n) { return n > 0; });
  if (gGU || gDN) {
#pragma omp parallel for schedule(dynamic, 1) if (worth_threads(routed_madds) && active >= omp_get_max_threads())
    for (int64_t k = 0; k < here; ++k) {
      if (omp_get_thread_num() == 0) ep.progress_combine();
      const int64_t le = by_rows[k];
      const int64_t e = first + le;
      for (int64_t s = 0; s < P; ++s) {
        const int64_t blk = s * here + le, r0 = a.recv_at[blk], n = a.routing.received[blk];
        if (n == 0) continue;
        if (gDN)
          linear_backward(mm, a.e_hm.data() + r0 * Im, DN + e * H * Im, a.e_eo.data() + r0 * H, nullptr,
                          gDN + e * H * Im, n, Im, H);
        if (gGU)
          linear_backward(mm, a.e_x.data() + r0 * H, GU + e * 2 * Im * H, a.e_gu.data() + r0 * 2 * Im, nullptr,
                          gGU + e * 2 * Im * H, n, H, 2 * Im);
      }
    }
  }
  // The experts' adapters' gradients (LoRA, frozen experts): per expert its blocks in source order, as above.
  if (opt.want_grad && (lgu.trains() || ldn.trains())) {
#pragma omp parallel for schedule(dynamic, 1) if (worth_threads(routed_madds) && active >= omp_get_max_threads())
    for (int64_t k = 0; k < here; ++k) {
      if (omp_get_thread_num() == 0) ep.progress_combine();
      const int64_t le = by_rows[k];
      const int64_t g = first_expert + le;
      std::vector<float> dB_gu(lgu.trains() ? static_cast<size_t>(2 * Im * lgu.ad->rank) : 0, 0.f);
      std::vector<float> dB_dn(ldn.trains() ? static_cast<size_t>(H * ldn.ad->rank) : 0, 0.f);
      for (int64_t s = 0; s < P; ++s) {
        const int64_t blk = s * here + le, r0 = a.recv_at[blk], n = a.routing.received[blk];
        if (n == 0) continue;
        if (ldn.trains())
          expert_lora_weight_grad(ldn, g, a.e_hm.data() + r0 * Im, a.e_eo.data() + r0 * H, n, dB_dn.data());
        if (lgu.trains())
          expert_lora_weight_grad(lgu, g, a.e_x.data() + r0 * H, a.e_gu.data() + r0 * 2 * Im, n, dB_gu.data());
      }
      if (ldn.trains()) expert_lora_add_dB(ldn, g, dB_dn.data());
      if (lgu.trains()) expert_lora_add_dB(lgu, g, dB_gu.data());
    }
  }
  // Router: top_w = wn * pes[e], wn = p / sum_topk(p); gradients reach the probabilities of chosen experts only.
  // It needs none of the input gradients, so under expert parallelism it runs while they travel back.
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
  // Each token sums its experts' input gradients in ascending expert index.
  if (!local) ep.finish_combine();
  e_dx = Vec{};
  Vec de_in = zeros(T * H);
#pragma omp parallel for schedule(static) if (T * K * H >= kParallelMinElements)
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t c = 0; c < K; ++c) {
      const int64_t tj = t * K + a.expert_order[t * K + c];
      add_into(de_in.data() + t * H, dx_sent.data() + (a.sent_at[a.top_idx[tj]] + a.row_of[tj]) * H, H);
    }
  }
  // The experts' pre-norm's weight gradient; then both norms of x1 back into dx1 in one pass, each row while it is in
  // cache: the experts' pre-norm first, then the router's (d rn = d rs * scale * H^-1/2, made per row), with the
  // operations per element of rmsnorm_backward's two calls in that order, so the same bits.
  const float* pre_norm = W(sl.pre_ff_norm_2);
  rmsnorm_backward(x1, pre_norm, a.r_pre2.data(), de_in.data(), nullptr, G(sl.pre_ff_norm_2), T, H);
#pragma omp parallel if (T * H >= kParallelMinElements)
  {
    std::vector<float> drn(static_cast<size_t>(H));  // [H] d loss / d rn of this thread's current token
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      const float* x = x1 + t * H;
      const float* dy = de_in.data() + t * H;
      float* dx = dx1 + t * H;
      const float inv_pre = a.r_pre2[t];
      const float c_pre = inv_pre * inv_pre * inv_pre * ew.dot_scaled(dy, x, pre_norm, H) / static_cast<float>(H);
      ew.rmsnorm_grad_row(x, pre_norm, dy, inv_pre, c_pre, dx, H);
      for (int64_t i = 0; i < H; ++i) drn[i] = drs[t * H + i] * scale[i] * root;
      const float inv_rn = a.r_rn[t];
      const float c_rn = inv_rn * inv_rn * inv_rn * ew.dot_scaled(drn.data(), x, nullptr, H) / static_cast<float>(H);
      ew.rmsnorm_grad_row(x, nullptr, drn.data(), inv_rn, c_rn, dx, H);
    }
  }
}

}  // namespace rf::model
