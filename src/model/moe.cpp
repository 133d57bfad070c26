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

// The exchange of one MoE block's rows with the ranks running their experts, chosen once (core/expert_parallel.h):
// with every expert here (EP = 1) the received layout is the sent one, so the rows stay in their buffer (moved, never
// copied) and nothing travels; otherwise the parallel context's dispatch and combine.
class ExpertExchange {
 public:
  ExpertExchange(ExpertParallel& ep, const ExpertRouting& routing) : ep_(ep), routing_(routing) {}
  // Starts `sent` [sent rows, width] on its way into `received` [received rows, width]; returns this rank's own rows
  // (the block of its experts' rows it routed itself), readable until finish_dispatch while the others travel.
  const float* start_dispatch(Vec&& sent, Vec& received, int64_t width) {
    if (local()) {
      received = std::move(sent);
      return received.data();
    }
    if (static_cast<int64_t>(received.size()) != routing_.received_rows() * width)
      received = uninit(routing_.received_rows() * width);
    in_flight_ = std::move(sent);
    ep_.start_dispatch(routing_, in_flight_.data(), received.data(), width);
    return in_flight_.data();
  }
  void progress_dispatch() { ep_.progress_dispatch(); }
  void finish_dispatch() {
    if (!local()) ep_.finish_dispatch();
    in_flight_ = Vec{};
  }
  // The rows' results `received` [received rows, width] back to their tokens' ranks, into `sent` [sent rows, width],
  // before returning; `received` keeps its values (EP > 1) or is moved into `sent` (EP = 1).
  void combine(Vec& received, Vec& sent, int64_t width) {
    if (local()) {
      sent = std::move(received);
      return;
    }
    sent = uninit(routing_.sent_rows() * width);
    ep_.combine(routing_, received.data(), sent.data(), width);
  }
  // The same started, travelling until finish_combine while work that reads neither buffer runs.
  void start_combine(Vec&& received, Vec& sent, int64_t width) {
    if (local()) {
      sent = std::move(received);
      return;
    }
    in_flight_ = std::move(received);
    sent = uninit(routing_.sent_rows() * width);
    ep_.start_combine(routing_, in_flight_.data(), sent.data(), width);
  }
  void progress_combine() { ep_.progress_combine(); }
  void finish_combine() {
    if (!local()) ep_.finish_combine();
    in_flight_ = Vec{};
  }

 private:
  bool local() const { return routing_.ranks == 1; }
  ExpertParallel& ep_;
  const ExpertRouting& routing_;
  Vec in_flight_;  // what a started dispatch or combine reads, until it finishes
};

// The experts one MoE block runs on this rank: which the dispatch brings here, where the store holds them, their LoRA
// adapters, and the received rows cut into tasks, the rows this rank routed itself apart.
struct ExpertsHere {
  int64_t here = 0;          // experts on this rank
  int64_t first_expert = 0;  // the first of them (g: an expert's global index, its adapter's)
  int64_t first = 0;         // its index in the store's expert tensors (e)
  ExpertLora gate_up, down;
  std::vector<ExpertTask> tasks;
  OwnSplit split;
  int64_t routed_madds = 0;  // gate/up and down sgemms over every received row

  ExpertsHere(ParamStore& store, const LayerSlots& sl, const ExpertRouting& routing, int64_t Im, int64_t H)
      : here(routing.experts_here()),
        first_expert(routing.first_expert()),
        first(held_index_of(store, sl, first_expert, here)),
        gate_up(expert_lora(store, sl.experts_gate_up, first_expert, here)),
        down(expert_lora(store, sl.experts_down, first_expert, here)),
        tasks(expert_tasks(routing.received, Im * H)),
        split(split_own(tasks, routing)),
        routed_madds(routing.received_rows() * 3 * Im * H) {}
  int64_t store_index(const ExpertTask& tk) const { return first + tk.block % here; }
  int64_t expert(const ExpertTask& tk) const { return first_expert + tk.block % here; }
};

void Gemma4Model::Run::moe_forward(int l, const float* x1, const float* mo, MoeActs& a) {
  const LayerSlots& sl = m.slots_[l];
  a.h1 = uninit(T * H);
  a.r_pf1 = uninit(T);
  rmsnorm_forward(mo, W(sl.post_ff_norm_1), eps, a.h1.data(), a.r_pf1.data(), T, H);
  moe_route(l, x1, a);
  moe_experts_forward(l, a);
  moe_sum_forward(l, a);
}

void Gemma4Model::Run::moe_route(int l, const float* x1, MoeActs& a) {
  const LayerSlots& sl = m.slots_[l];
  const int64_t E = cfg.num_experts, K = cfg.top_k_experts;
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
  const bool keep_router = opt.want_router && router_logits[l].empty();  // the forward's, not a recompute's
  if (keep_router) router_logits[l].assign(a.probs.begin(), a.probs.end());
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

  if (keep_router) router_experts[l].assign(a.top_idx.begin(), a.top_idx.end());

  a.routed.assign(static_cast<size_t>(E), {});
  a.row_of.assign(static_cast<size_t>(T * K), 0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < K; ++j) {
      std::vector<int64_t>& rows = a.routed[a.top_idx[t * K + j]];
      a.row_of[t * K + j] = static_cast<int64_t>(rows.size());
      rows.push_back(t * K + j);
    }
  }
  // Where the rows go: this rank's routed rows to the ranks holding their experts (every expert local at EP = 1).
  a.routing = ExpertRouting{};
  a.routing.experts = E;
  for (const auto& rows : a.routed) a.routing.sent.push_back(static_cast<int64_t>(rows.size()));
  attn.experts().route(a.routing);
  a.sent_at = starts_of(a.routing.sent);
  a.recv_at = starts_of(a.routing.received);
}

void Gemma4Model::Run::moe_experts_forward(int l, MoeActs& a) {
  const LayerSlots& sl = m.slots_[l];
  const int64_t K = cfg.top_k_experts, Im = cfg.moe_intermediate_size;
  const ElementwiseKernels& ew = elementwise();
  ExpertExchange exchange(attn.experts(), a.routing);
  const int64_t sent = a.routing.sent_rows(), R = a.routing.received_rows();
  Vec x_sent = uninit(sent * H);  // [sent, H] the rows' expert inputs in the sent layout
#pragma omp parallel for schedule(static) if (sent * H >= kParallelMinElements)
  for (int64_t tj = 0; tj < T * K; ++tj)
    std::copy_n(a.e_in.data() + (tj / K) * H, H, x_sent.data() + (a.sent_at[a.top_idx[tj]] + a.row_of[tj]) * H);
  // Dispatch, finished below after this rank's own rows, read where the sent layout has them.
  const float* own_rows = exchange.start_dispatch(std::move(x_sent), a.e_x, H);
  // The received rows through this rank's experts; written completely by the tasks below.
  a.e_gu = uninit(R * 2 * Im);
  a.e_hm = uninit(R * Im);
  a.e_eo = uninit(R * H);
  const float* GU = W(sl.experts_gate_up);
  const float* DN = W(sl.experts_down);
  const ExpertsHere ex(store, sl, a.routing, Im, H);
  const auto run_task = [&](const ExpertTask& tk, const float* x) {
    // e: the expert's index in the store's expert tensors; g: the expert (its adapter's index).
    const int64_t e = ex.store_index(tk), g = ex.expert(tk);
    const int64_t r0 = a.recv_at[tk.block] + tk.row0, n = tk.rows;
    // x: [n, H] this task's rows; gu: [n, 2*Im]; hm: [n, Im]; eo: [n, H].
    float* gu = a.e_gu.data() + r0 * 2 * Im;
    float* hm = a.e_hm.data() + r0 * Im;
    float* eo = a.e_eo.data() + r0 * H;
    linear_forward(mm, x, GU + e * 2 * Im * H, gu, n, H, 2 * Im);
    expert_lora_forward(ex.gate_up, g, x, gu, n);
    for (int64_t r = 0; r < n; ++r) ew.geglu_forward(gu + r * 2 * Im, gu + r * 2 * Im + Im, hm + r * Im, Im);
    linear_forward(mm, hm, DN + e * H * Im, eo, n, Im, H);
    expert_lora_forward(ex.down, g, hm, eo, n);
  };
  // This rank's own rows first, while the other ranks' travel; then theirs.
#pragma omp parallel for schedule(dynamic, 1) if (worth_threads(ex.routed_madds) && !ex.split.own.empty())
  for (size_t k = 0; k < ex.split.own.size(); ++k) {
    if (omp_get_thread_num() == 0) exchange.progress_dispatch();
    const ExpertTask& tk = ex.tasks[ex.split.own[k]];
    run_task(tk, own_rows + (a.sent_at[ex.expert(tk)] + tk.row0) * H);
  }
  exchange.finish_dispatch();
#pragma omp parallel for schedule(dynamic, 1) if (worth_threads(ex.routed_madds) && !ex.split.others.empty())
  for (size_t k = 0; k < ex.split.others.size(); ++k) {
    const ExpertTask& tk = ex.tasks[ex.split.others[k]];
    run_task(tk, a.e_x.data() + (a.recv_at[tk.block] + tk.row0) * H);
  }
  // Combine: the outputs back to the ranks whose tokens they are (at EP = 1 e_eo itself, which the backward's
  // dispatch then fills again, with dY).
  exchange.combine(a.e_eo, a.eo_sent, H);
}

void Gemma4Model::Run::moe_sum_forward(int l, MoeActs& a) {
  const LayerSlots& sl = m.slots_[l];
  const int64_t K = cfg.top_k_experts;
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
  std::fill_n(dmo, T * H, 0.f);
  rmsnorm_backward(mo, W(sl.post_ff_norm_1), a.r_pf1.data(), dff, dmo, G(sl.post_ff_norm_1), T, H);
  Vec dout2 = zeros(T * H);
  rmsnorm_backward(a.out2.data(), W(sl.post_ff_norm_2), a.r_pf2.data(), dff, dout2.data(), G(sl.post_ff_norm_2), T, H);
  ExpertExchange exchange(attn.experts(), a.routing);
  Vec dw = zeros(T * cfg.top_k_experts);  // [T, K] d loss / d top_w
  Vec dy_sent = moe_output_grads(a, dout2.data(), dw.data());
  // The experts' input gradients go back to their tokens' ranks while their weight gradients and the router's run
  // (which need none of them); finished before the tokens sum them.
  Vec dx_sent = moe_experts_backward(l, a, std::move(dy_sent), exchange);
  const Vec drs = moe_router_backward(l, a, dw.data());
  exchange.finish_combine();
  moe_input_backward(l, a, x1, dx_sent.data(), drs.data(), dx1);
}

Vec Gemma4Model::Run::moe_output_grads(MoeActs& a, const float* dout2, float* dw) {
  const int64_t K = cfg.top_k_experts;
  const int64_t sent = a.routing.sent_rows();
  // On this rank's tokens: d loss / d top_w, and d loss / d expert output (dout2 times the row's weight), per row.
  Vec dy_sent = uninit(sent * H);  // [sent, H] in the sent layout
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
  a.eo_sent = Vec{};  // the outputs were read by dw above only
  return dy_sent;
}

Vec Gemma4Model::Run::moe_experts_backward(int l, MoeActs& a, Vec dy_sent, ExpertExchange& exchange) {
  const LayerSlots& sl = m.slots_[l];
  const int64_t Im = cfg.moe_intermediate_size;
  const float* GU = W(sl.experts_gate_up);
  const float* DN = W(sl.experts_down);
  const ExpertsHere ex(store, sl, a.routing, Im, H);
  // The received rows' dY, over their outputs; finished below, after this rank's own rows, read in the sent layout.
  const float* own_dy = exchange.start_dispatch(std::move(dy_sent), a.e_eo, H);
  Vec e_dx = uninit(a.routing.received_rows() * H);  // d loss / d the received rows' inputs: written by the tasks

  // Row-local: d hm, d gate-up (into e_gu), d expert input; tasks in parallel, this rank's own rows first while the
  // others' travel.
  const ElementwiseKernels& ew = elementwise();
  for (const bool own : {true, false}) {
    if (!own) exchange.finish_dispatch();
    const std::vector<size_t>& part = own ? ex.split.own : ex.split.others;
#pragma omp parallel if (worth_threads(ex.routed_madds) && !part.empty())
    {
      Vec dhm;  // [rows, Im] of this thread's current task
#pragma omp for schedule(dynamic, 1)
      for (size_t k = 0; k < part.size(); ++k) {
        if (own && omp_get_thread_num() == 0) exchange.progress_dispatch();
        const ExpertTask& tk = ex.tasks[part[k]];
        const int64_t e = ex.store_index(tk), g = ex.expert(tk);
        const int64_t r0 = a.recv_at[tk.block] + tk.row0, n = tk.rows;
        const float* dy =
            own ? own_dy + (a.sent_at[g] + tk.row0) * H : a.e_eo.data() + r0 * H;  // [n, H] d expert output
        float* gu = a.e_gu.data() + r0 * 2 * Im;  // [n, 2*Im] gate-up, then its gradient
        // The input gradients are written (beta = 0), not accumulated into zeros: the same values without a
        // zero fill of the buffers first.
        dhm.resize(static_cast<size_t>(n * Im));
        gemm(mm, false, false, n, Im, H, 1.f, dy, H, DN + e * H * Im, Im, 0.f, dhm.data(), Im);
        expert_lora_input_grad(ex.down, g, dy, dhm.data(), n);
        for (int64_t r = 0; r < n; ++r) {
          float* gate_up = gu + r * 2 * Im;  // [2*Im]: gate then up, overwritten by their gradients
          ew.geglu_backward(gate_up, gate_up + Im, dhm.data() + r * Im, gate_up, gate_up + Im, Im, false);
        }
        gemm(mm, false, false, n, H, 2 * Im, 1.f, gu, 2 * Im, GU + e * 2 * Im * H, H, 0.f, e_dx.data() + r0 * H, H);
        expert_lora_input_grad(ex.gate_up, g, gu, e_dx.data() + r0 * H, n);
      }
    }
  }
  // The input gradients back to their tokens' ranks, travelling while the weight gradients below run (they read the
  // rows' activations and dY, not the input gradients).
  Vec dx_sent;
  exchange.start_combine(std::move(e_dx), dx_sent, H);
  moe_expert_weight_grads(l, a, ex, exchange);
  return dx_sent;
}

void Gemma4Model::Run::moe_expert_weight_grads(int l, MoeActs& a, const ExpertsHere& ex, ExpertExchange& exchange) {
  const LayerSlots& sl = m.slots_[l];
  const int64_t Im = cfg.moe_intermediate_size, here = ex.here;
  const float* GU = W(sl.experts_gate_up);
  const float* DN = W(sl.experts_down);
  float* gGU = G(sl.experts_gate_up);
  float* gDN = G(sl.experts_down);
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
#pragma omp parallel for schedule(dynamic, 1) if (worth_threads(ex.routed_madds) && active >= omp_get_max_threads())
    for (int64_t k = 0; k < here; ++k) {
      if (omp_get_thread_num() == 0) exchange.progress_combine();
      const int64_t le = by_rows[k];
      const int64_t e = ex.first + le;
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
  const ExpertLora &lgu = ex.gate_up, &ldn = ex.down;
  if (opt.want_grad && (lgu.trains() || ldn.trains())) {
#pragma omp parallel for schedule(dynamic, 1) if (worth_threads(ex.routed_madds) && active >= omp_get_max_threads())
    for (int64_t k = 0; k < here; ++k) {
      if (omp_get_thread_num() == 0) exchange.progress_combine();
      const int64_t le = by_rows[k];
      const int64_t g = ex.first_expert + le;
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
}

Vec Gemma4Model::Run::moe_router_backward(int l, const MoeActs& a, const float* dw) {
  const LayerSlots& sl = m.slots_[l];
  const int64_t E = cfg.num_experts, K = cfg.top_k_experts;
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
  Vec drs = zeros(T * H);  // [T, H] d loss / d the router's scaled input
  linear_backward(mm, a.rs.data(), W(sl.router_proj), dlogits.data(), drs.data(), G(sl.router_proj), T, H, E);
  const float root = static_cast<float>(1.0 / std::sqrt(static_cast<double>(H)));
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
  return drs;
}

void Gemma4Model::Run::moe_input_backward(int l, const MoeActs& a, const float* x1, const float* dx_sent,
                                          const float* drs, float* dx1) {
  const LayerSlots& sl = m.slots_[l];
  const int64_t K = cfg.top_k_experts;
  // Each token sums its experts' input gradients in ascending expert index.
  Vec de_in = zeros(T * H);
#pragma omp parallel for schedule(static) if (T * K * H >= kParallelMinElements)
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t c = 0; c < K; ++c) {
      const int64_t tj = t * K + a.expert_order[t * K + c];
      add_into(de_in.data() + t * H, dx_sent + (a.sent_at[a.top_idx[tj]] + a.row_of[tj]) * H, H);
    }
  }
  // The experts' pre-norm's weight gradient; then both norms of x1 back into dx1 in one pass, each row while it is in
  // cache: the experts' pre-norm first, then the router's (d rn = d rs * scale * H^-1/2, made per row), with the
  // operations per element of rmsnorm_backward's two calls in that order, so the same bits.
  const float* pre_norm = W(sl.pre_ff_norm_2);
  rmsnorm_backward(x1, pre_norm, a.r_pre2.data(), de_in.data(), nullptr, G(sl.pre_ff_norm_2), T, H);
  const float root = static_cast<float>(1.0 / std::sqrt(static_cast<double>(H)));
  const float* scale = W(sl.router_scale);
  const ElementwiseKernels& ew = elementwise();
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
