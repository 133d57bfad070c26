// ringflex model: float32 building blocks (linear, per-head projections, RMSNorm, GeGLU, RoPE) and their backwards.
#include "model/ops.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "core/attention_args.h"
#include "core/error.h"
#include "cpu/openmp_wait.h"
#include "model/elementwise.h"
#include "model/matmul_bf16.h"
#include "model/stream_rows.h"

namespace rf::model {

namespace {

// C is split into one block of rows (or columns) per thread, a multiple of this many. The split never cuts the
// K dimension, and it keeps every row at the same offset, modulo the sgemm kernels' row blocks, from the start of
// its call: OpenBLAS's AVX2 (Haswell, Zen) kernels take rows 12 at a time and sum a row in the call's tail (its
// last rows mod 12) in another order, its AVX-512 ones 16 at a time; 48 is a multiple of both, so a row's bits do
// not depend on the thread count (tests/model checks 1 against 2; at 16 the Haswell kernels changed them).
constexpr int64_t kGemmQuantum = 48;
// Columns per block when C is cut by columns (fewer than 2 * kGemmQuantum rows): the same panels at any thread count.
// Each panel's call packs all of op(A), M < 96 rows of K, against M * 256 * K multiply-adds: under 0.4% more copying.
constexpr int64_t kGemmColumnPanel = 256;
// OpenBLAS (0.3.21's AVX-512 cores, built with SMALL_MATRIX_OPT as Debian's is) hands a call of at most 100^3
// multiply-adds to its small-matrix kernels, which sum in another order than its blocked kernels: a block of a row
// split must stay above that bound, or its rows' bits would depend on the thread count that made the block small.
constexpr int64_t kBlasSmallMatrixMultiplyAdds = 1'000'000;
static_assert(kParallelMinMultiplyAdds > kBlasSmallMatrixMultiplyAdds, "a call worth splitting is above the bound");
// Tokens per partial sum in reductions over tokens (RMSNorm weight gradients), summed in block order.
constexpr int64_t kReduceBlock = 64;
// Elements per call of an elementwise kernel in a parallel loop: 64 KiB of float32 per operand, so a call's
// operands stay in L2 and the per-call overhead is amortised.
constexpr int64_t kElementwiseBlock = int64_t{1} << 14;

void single_threaded_blas() {
  // Our own OpenMP splits the work; OpenBLAS threads inside those calls would only oversubscribe the cores.
  static std::once_flag once;
  std::call_once(once, [] { openblas_set_num_threads(1); });
}

}  // namespace

std::string_view compute_dtype_name(ComputeDtype t) { return t == ComputeDtype::Float32 ? "float32" : "bfloat16"; }

std::string_view param_dtype_name(ParamDtype t) { return t == ParamDtype::Float32 ? "float32" : "bfloat16"; }

ComputeDtype parse_compute_dtype(std::string_view s) {
  if (s == "float32" || s == "f32") return ComputeDtype::Float32;
  if (s == "bfloat16" || s == "bf16") return ComputeDtype::Bfloat16;
  rf::fail("compute dtype '", s, "' is not one of float32, bfloat16");
}

void round_to_bf16(const float* src, bf16* dst, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMinElements)
  for (int64_t i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
}

void Bf16Copies::add(const float* src, int64_t n) {
  Copy c{src, n, std::vector<bf16>(static_cast<size_t>(n))};
  round_to_bf16(src, c.bits.data(), n);
  const auto at = std::upper_bound(copies_.begin(), copies_.end(), src,
                                   [](const float* p, const Copy& x) { return std::less<const float*>()(p, x.src); });
  copies_.insert(at, std::move(c));
}

const bf16* Bf16Copies::find(const float* src, int64_t extent) const {
  // The last copy starting at or before src; std::less gives pointers into different arrays a total order.
  auto at = std::upper_bound(copies_.begin(), copies_.end(), src,
                             [](const float* p, const Copy& x) { return std::less<const float*>()(p, x.src); });
  if (at == copies_.begin()) return nullptr;
  --at;
  // In addresses, not pointer arithmetic: src may lie in another array altogether.
  const uintptr_t offset_bytes = reinterpret_cast<uintptr_t>(src) - reinterpret_cast<uintptr_t>(at->src);
  const int64_t offset = static_cast<int64_t>(offset_bytes / sizeof(float));
  const bool inside = offset_bytes % sizeof(float) == 0 && offset + extent <= at->n;
  return inside ? at->bits.data() + offset : nullptr;
}

int64_t Bf16Copies::bytes() const {
  int64_t total = 0;
  for (const Copy& c : copies_) total += c.n * static_cast<int64_t>(sizeof(bf16));
  return total;
}

void SharedOperands::add(const float* src, int64_t n) {
  // Already rounded by an enclosing op's SharedOperands (or a weight): found there.
  if (base_.dtype == ComputeDtype::Bfloat16 && n > 0 && !find(src, n)) copies_.add(src, n);
}

const bf16* SharedOperands::find(const float* src, int64_t extent) const {
  if (const bf16* mine = copies_.find(src, extent)) return mine;
  return base_.weights ? base_.weights->find(src, extent) : nullptr;
}

namespace {

// How C is cut over threads: blocks of `share` rows (split_rows; a multiple of kGemmQuantum) or columns (panels).
struct GemmSplit {
  bool split_rows;
  int64_t extent, share, blocks;
  // Rows or columns of block `blk`: `share`, the last block taking what is left (up to twice a share, as a short tail
  // is folded into it).
  int64_t size(int64_t blk) const { return blk + 1 == blocks ? extent - blk * share : share; }
};

GemmSplit split_for(int64_t M, int64_t N, int64_t K) {
  GemmSplit s;
  // Split rows whenever there are enough for a block a thread: a row's bits then depend only on its offset from its
  // call's start modulo the kernel's row block and on the call's tail, which kGemmQuantum keeps. A column's bits can
  // depend on the call's width (OpenBLAS's Haswell kernels block columns by it: measured), so columns, split only when
  // rows are too few (the loss's vocabulary-wide head on a short chunk), are cut into panels of a fixed width that no
  // thread count changes. Rows split whatever the larger side: each thread then packs the whole of the other operand,
  // N * K floats against its M * N * K / threads multiply-adds.
  s.split_rows = M >= 2 * kGemmQuantum || M >= N;
  s.extent = s.split_rows ? M : N;
  const bool worth_splitting = M * N * K >= kParallelMinMultiplyAdds;
  if (s.split_rows) {
    // Inside a parallel region (callers that run independent sgemms on each thread) each call stays on its thread.
    const int64_t threads = !omp_in_parallel() && worth_splitting ? omp_get_max_threads() : 1;
    const auto whole_quanta = [](int64_t rows) { return (rows + kGemmQuantum - 1) / kGemmQuantum * kGemmQuantum; };
    // The fewest rows a block needs to stay above the small-matrix bound (the whole call is, when it is split:
    // kParallelMinMultiplyAdds is above the bound).
    const int64_t above_small = whole_quanta(kBlasSmallMatrixMultiplyAdds / (N * std::max<int64_t>(K, 1)) + 1);
    s.share = std::max({kGemmQuantum, whole_quanta((s.extent + threads - 1) / threads), above_small});
    s.blocks = (s.extent + s.share - 1) / s.share;
    if (s.blocks > 1 && (s.extent - (s.blocks - 1) * s.share) * N * K <= kBlasSmallMatrixMultiplyAdds) --s.blocks;
  } else {
    s.share = worth_splitting ? kGemmColumnPanel : s.extent;
    s.blocks = (s.extent + s.share - 1) / s.share;
  }
  return s;
}

// As BLAS with K = 0: with beta = 0, C is written without being read (it may be uninitialised; NaN * 0 would be NaN).
void scale_only(float beta, float* C, int64_t M, int64_t N, int64_t ldc) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == 0.f ? 0.f : C[i * ldc + j] * beta;
}

// A bf16 gemm operand stored [rows, cols] with leading dimension ld: the weights' copy when it lies in one (same ld),
// else rounded here into a dense [rows, cols] buffer (ld = cols), once for every block of the split.
struct Bf16Operand {
  const bf16* data = nullptr;
  int64_t ld = 0;
  std::unique_ptr<bf16[]> owned;
};

Bf16Operand bf16_operand(const Bf16Lookup* weights, const float* src, int64_t rows, int64_t cols, int64_t ld) {
  Bf16Operand op;
  if (const bf16* copy = weights ? weights->find(src, (rows - 1) * ld + cols) : nullptr) {
    op.data = copy;
    op.ld = ld;
    return op;
  }
  // Not value-initialised: every element is written below.
  op.owned.reset(new bf16[static_cast<size_t>(rows * cols)]);
  bf16* dst = op.owned.get();
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMinElements)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[r * cols + c] = float_to_bf16(src[r * ld + c]);
  op.data = dst;
  op.ld = cols;
  return op;
}

// A gemm operand stored [rows, cols] with leading dimension ld, rounded to bf16 and widened back to float32 (exact),
// dense [rows, cols]: the bf16 mode's operands for sgemm, in one pass (from the weights' bf16 copy when there is one).
// Not value-initialised: every element is written.
std::unique_ptr<float[]> rounded_to_bf16(const Bf16Lookup* weights, const float* src, int64_t rows, int64_t cols,
                                         int64_t ld) {
  std::unique_ptr<float[]> out(new float[static_cast<size_t>(rows * cols)]);
  float* dst = out.get();
  const bf16* copy = weights ? weights->find(src, (rows - 1) * ld + cols) : nullptr;
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMinElements)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      dst[r * cols + c] = bf16_to_float(copy ? copy[r * ld + c] : float_to_bf16(src[r * ld + c]));
  return out;
}

// src stored [rows, cols] with leading dimension ld, as a dense [rows, cols] (src itself when it already is; else a
// copy into `buffer`).
const bf16* dense(const bf16* src, int64_t rows, int64_t cols, int64_t ld, std::unique_ptr<bf16[]>& buffer) {
  if (ld == cols) return src;
  buffer.reset(new bf16[static_cast<size_t>(rows * cols)]);
  for (int64_t r = 0; r < rows; ++r) std::copy_n(src + r * ld, cols, buffer.get() + r * cols);
  return buffer.get();
}

}  // namespace

namespace {

// The bf16 mode's gemm on oneDNN (bf16_matmul_on_onednn): C[M, N] in c_dtype (bf16 only with beta = 0), K > 0.
void gemm_on_onednn(const Matmul& mm, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                    const float* A, int64_t lda, const float* B, int64_t ldb, float beta, void* C, DType c_dtype,
                    int64_t ldc) {
  const GemmSplit s = split_for(M, N, K);
  const Bf16Operand a = bf16_operand(mm.weights, A, trans_a ? K : M, trans_a ? M : K, lda);
  const Bf16Operand b = bf16_operand(mm.weights, B, trans_b ? N : K, trans_b ? K : N, ldb);
  const int64_t c_size = static_cast<int64_t>(dtype_size(c_dtype));
  // An exception must not leave an OpenMP region (it would end the process): the first is kept and rethrown after.
  std::exception_ptr failure;
#pragma omp parallel for schedule(static) if (s.blocks > 1)
  for (int64_t blk = 0; blk < s.blocks; ++blk) {
    try {
      const int64_t o = blk * s.share;
      const int64_t n_part = s.size(blk);
      const int64_t m = s.split_rows ? n_part : M;
      const int64_t n = s.split_rows ? N : n_part;
      const bf16* ap = s.split_rows ? (trans_a ? a.data + o : a.data + o * a.ld) : a.data;
      const bf16* bp = s.split_rows ? b.data : (trans_b ? b.data + o * b.ld : b.data + o);
      void* c = static_cast<char*>(C) + (s.split_rows ? o * ldc : o) * c_size;
      // oneDNN picks its kernel (and so its summation order) from the strides as well as the shape, and a block of a
      // split is a strided view where the whole operand is dense: every call gets dense operands, so the bits depend
      // on the shape alone. The copy is O(m K + K n), against the call's O(m n K).
      std::unique_ptr<bf16[]> a_dense, b_dense;
      ap = dense(ap, trans_a ? K : m, trans_a ? m : K, a.ld, a_dense);
      bp = dense(bp, trans_b ? n : K, trans_b ? K : n, b.ld, b_dense);
      bf16_gemm_on_this_thread(trans_a, trans_b, m, n, K, alpha, ap, trans_a ? m : K, bp, trans_b ? K : n, beta, c,
                               c_dtype, ldc);
    } catch (...) {
#pragma omp critical(rf_model_gemm_failure)
      if (!failure) failure = std::current_exception();
    }
  }
  if (failure) std::rethrow_exception(failure);
}

}  // namespace

namespace {

// Set by StreamRowsScope on the thread that runs the model, read by every thread (a product may be called inside a
// parallel region, as the experts of a MoE layer are): one flag for the process.
std::atomic<bool> stream_rows_open{false};

}  // namespace

StreamRowsScope::StreamRowsScope() {
  RF_CHECK(!stream_rows_open.exchange(true), "StreamRowsScope: one is already open (one run at a time opens it)");
}

StreamRowsScope::~StreamRowsScope() { stream_rows_open.store(false); }

bool streaming_rows() { return stream_rows_open.load(std::memory_order_relaxed); }

namespace {

// Columns of C per task of a streamed product: a panel's weight rows (64 K floats) are read from memory once, and
// the panels, not the thread count, fix which thread computes what (each element is its own dot product anyway).
constexpr int64_t kStreamPanel = 64;

// Weight elements from which a streamed product forks over the threads. Where idle threads spin only briefly
// (cpu/openmp_wait.h: `ringflex generate` sets it), the products of a step follow each other closely enough that the
// second thread is mostly still spinning at the next fork, and splitting from 2^15 elements (128 KiB of weight) paid;
// where they spin long (libgomp's default, as in training's samples), the spinning thread beside the step's serial
// work cost more than the split gained (100m decode at 2 threads, every such product forked: 19 tok/s with the long
// spin, 56-62 with the brief one; BENCHMARKS.md, "Generation alone"), so only the LM head (2^24 and more) forks.
int64_t stream_parallel_min_elements() {
  static const int64_t elements = cpu::idle_threads_sleep_soon() ? int64_t{1} << 15 : int64_t{1} << 24;
  return elements;
}

// C[M, N] = alpha A[M, K] B[N, K]^T + beta C (model/stream_rows.h): each element one dot_scaled over K, the panels
// of columns split over the threads when the weight is large enough for a fork to pay.
void gemm_stream_rows(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B,
                      int64_t ldb, float beta, float* C, int64_t ldc) {
  const ElementwiseKernels& k = elementwise();
  const int64_t panels = (N + kStreamPanel - 1) / kStreamPanel;
#pragma omp parallel for schedule(static) if (!omp_in_parallel() && N * K >= stream_parallel_min_elements())
  for (int64_t p = 0; p < panels; ++p) {
    for (int64_t n = p * kStreamPanel; n < std::min(N, (p + 1) * kStreamPanel); ++n) {
      for (int64_t m = 0; m < M; ++m) {
        const float dot = alpha * k.dot_scaled(A + m * lda, B + n * ldb, nullptr, K);
        float& c = C[m * ldc + n];
        c = beta == 0.f ? dot : dot + beta * c;  // beta = 0 writes without reading (C may be uninitialised)
      }
    }
  }
}

}  // namespace

void gemm(const Matmul& mm, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
          int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (mm.dtype == ComputeDtype::Float32 && !trans_a && trans_b && M <= kStreamRowsMax && K > 0 && streaming_rows()) {
    gemm_stream_rows(M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  if (mm.dtype == ComputeDtype::Float32) {
    gemm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  if (M == 0 || N == 0) return;
  if (K == 0) {
    scale_only(beta, C, M, N, ldc);
    return;
  }
  // Stored shapes: A is [M, K] or, transposed, [K, M]; B is [K, N] or [N, K].
  if (!bf16_matmul_on_onednn()) {
    // No bf16 units that pay (bf16_matmul_on_onednn): the rounded operands, widened back exactly, on sgemm.
    const auto a32 = rounded_to_bf16(mm.weights, A, trans_a ? K : M, trans_a ? M : K, lda);
    const auto b32 = rounded_to_bf16(mm.weights, B, trans_b ? N : K, trans_b ? K : N, ldb);
    gemm(trans_a, trans_b, M, N, K, alpha, a32.get(), trans_a ? M : K, b32.get(), trans_b ? K : N, beta, C, ldc);
    return;
  }
  gemm_on_onednn(mm, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, DType::F32, ldc);
}

AttnOut AttnOut::at(int64_t offset) const {
  AttnOut o = *this;
  if (o.f32) o.f32 += offset;
  if (o.b16) o.b16 += offset;
  return o;
}

void AttnOut::store(const float* src, int64_t n) const {
  if (b16) {
    for (int64_t i = 0; i < n; ++i) b16[i] = float_to_bf16(src[i]);
  } else if (round) {
    for (int64_t i = 0; i < n; ++i) f32[i] = bf16_to_float(float_to_bf16(src[i]));
  } else if (f32 != src) {
    std::copy_n(src, n, f32);
  }
}

void gemm_into(const Matmul& mm, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
               const float* A, int64_t lda, const float* B, int64_t ldb, const AttnOut& C) {
  if (C.b16 && mm.dtype == ComputeDtype::Bfloat16 && bf16_matmul_on_onednn() && M > 0 && N > 0 && K > 0) {
    gemm_on_onednn(mm, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, 0.f, C.b16, DType::BF16, N);
    return;
  }
  // Float32 C (rounded in place when asked), or bf16 C from a float32 block: rounded right after the gemm that wrote
  // it, while the block is the one just touched.
  std::unique_ptr<float[]> block;
  float* c = C.f32;
  if (!c) {
    block.reset(new float[static_cast<size_t>(M * N)]);
    c = block.get();
  }
  gemm(mm, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, 0.f, c, N);
  if (!C.b16 && !C.round) return;
  const int64_t n = M * N;
  const int64_t blocks = (n + kElementwiseBlock - 1) / kElementwiseBlock;
#pragma omp parallel for schedule(static) if (n >= kParallelMinElements)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t i = b * kElementwiseBlock;
    C.at(i).store(c + i, std::min(kElementwiseBlock, n - i));
  }
}

int64_t gemm_tile_rows(int64_t rows, int64_t total) {
  if (rows >= total) return total;
  return std::min(total, std::max(kGemmQuantum, rows / kGemmQuantum * kGemmQuantum));
}

void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  single_threaded_blas();
  const GemmSplit s = split_for(M, N, K);
  if (K == 0) {
    scale_only(beta, C, M, N, ldc);
    return;
  }
#pragma omp parallel for schedule(static) if (s.blocks > 1)
  for (int64_t blk = 0; blk < s.blocks; ++blk) {
    const int64_t o = blk * s.share;
    const int64_t n_part = s.size(blk);
    const int64_t m = s.split_rows ? n_part : M;
    const int64_t n = s.split_rows ? N : n_part;
    // Row o of op(A) is row o of A, or column o when transposed; column o of op(B) is column o of B, or row o.
    const float* a = s.split_rows ? (trans_a ? A + o : A + o * lda) : A;
    const float* b = s.split_rows ? B : (trans_b ? B + o * ldb : B + o);
    float* c = s.split_rows ? C + o * ldc : C + o;
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
                static_cast<int>(m), static_cast<int>(n), static_cast<int>(K), alpha, a, static_cast<int>(lda), b,
                static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
  }
}

void linear_forward(const Matmul& mm, const float* x, const float* W, float* y, int64_t T, int64_t K, int64_t N) {
  gemm(mm, false, true, T, N, K, 1.f, x, K, W, K, 0.f, y, N);
}

void linear_backward(const Matmul& mm, const float* x, const float* W, const float* dy, float* dx, float* dW, int64_t T,
                     int64_t K, int64_t N) {
  SharedOperands shared(mm);
  if (dx && dW) shared.add(dy, T * N);  // both products read dy
  const Matmul m = shared.matmul();
  if (dx) gemm(m, false, false, T, K, N, 1.f, dy, N, W, K, 1.f, dx, K);
  if (dW) gemm(m, true, false, N, K, T, 1.f, dy, N, x, K, 1.f, dW, K);
}

void rmsnorm_forward(const float* x, const float* w, float eps, float* y, float* inv_rms, int64_t R, int64_t n) {
  const ElementwiseKernels& k = elementwise();
#pragma omp parallel for schedule(static) if (R * n >= kParallelMinElements)
  for (int64_t r = 0; r < R; ++r) {
    const float inv = 1.f / std::sqrt(k.sum_squares(x + r * n, n) / static_cast<float>(n) + eps);
    inv_rms[r] = inv;
    k.scale_row(x + r * n, w, inv, y + r * n, n);
  }
}

void rmsnorm_backward(const float* x, const float* w, const float* inv_rms, const float* dy, float* dx, float* dw,
                      int64_t R, int64_t n) {
  // y = x * r * w with r = (mean(x^2) + eps)^-1/2, so dr/dx = -r^3 x / n and
  // dx = r * (dy*w) - x * r^3 * mean((dy*w) * x).
  const ElementwiseKernels& k = elementwise();
  if (dx) {
#pragma omp parallel for schedule(static) if (R * n >= kParallelMinElements)
    for (int64_t r = 0; r < R; ++r) {
      const float inv = inv_rms[r];
      const float c = inv * inv * inv * k.dot_scaled(dy + r * n, x + r * n, w, n) / static_cast<float>(n);
      k.rmsnorm_grad_row(x + r * n, w, dy + r * n, inv, c, dx + r * n, n);
    }
  }
  if (w && dw) {
    const int64_t blocks = (R + kReduceBlock - 1) / kReduceBlock;
    std::vector<float> partial(static_cast<size_t>(blocks * n), 0.f);
#pragma omp parallel for schedule(static) if (R * n >= kParallelMinElements)
    for (int64_t b = 0; b < blocks; ++b) {
      float* p = partial.data() + b * n;
      for (int64_t r = b * kReduceBlock; r < std::min(R, (b + 1) * kReduceBlock); ++r) {
        const float inv = inv_rms[r];
        for (int64_t i = 0; i < n; ++i) p[i] += dy[r * n + i] * x[r * n + i] * inv;
      }
    }
    for (int64_t b = 0; b < blocks; ++b)
      for (int64_t i = 0; i < n; ++i) dw[i] += partial[b * n + i];
  }
}

void geglu_forward(const float* g, const float* u, float* h, int64_t n) {
  const ElementwiseKernels& k = elementwise();
  const int64_t blocks = (n + kElementwiseBlock - 1) / kElementwiseBlock;
#pragma omp parallel for schedule(static) if (n >= kParallelMinElements)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t i = b * kElementwiseBlock, m = std::min(kElementwiseBlock, n - i);
    k.geglu_forward(g + i, u + i, h + i, m);
  }
}

void geglu_backward(const float* g, const float* u, const float* dh, float* dg, float* du, int64_t n, bool accumulate) {
  const ElementwiseKernels& k = elementwise();
  const int64_t blocks = (n + kElementwiseBlock - 1) / kElementwiseBlock;
#pragma omp parallel for schedule(static) if (n >= kParallelMinElements)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t i = b * kElementwiseBlock, m = std::min(kElementwiseBlock, n - i);
    k.geglu_backward(g + i, u + i, dh + i, dg + i, du + i, m, accumulate);
  }
}

RopeTable make_rope_table(const int32_t* positions, int64_t T, int D, bool proportional, double theta,
                          double partial_rotary_factor, double factor) {
  const int half = D / 2;
  const int rotated = proportional ? static_cast<int>(partial_rotary_factor * D / 2) : half;
  std::vector<float> inv_freq(half, 0.f);
  for (int i = 0; i < rotated; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(D);
    inv_freq[i] = static_cast<float>(1.0 / std::pow(static_cast<float>(theta), exponent) / factor);
  }
  RopeTable r;
  r.D = D;
  r.cos.resize(static_cast<size_t>(T * half));
  r.sin.resize(static_cast<size_t>(T * half));
#pragma omp parallel for schedule(static) if (T * half >= kParallelMinElements)
  for (int64_t t = 0; t < T; ++t) {
    for (int i = 0; i < half; ++i) {
      const float angle = static_cast<float>(positions[t]) * inv_freq[i];
      r.cos[t * half + i] = std::cos(angle);
      r.sin[t * half + i] = std::sin(angle);
    }
  }
  return r;
}

void rope_apply(float* x, const RopeTable& r, int64_t T, int heads, bool inverse) {
  const int D = r.D, half = D / 2;
  const float sign = inverse ? -1.f : 1.f;
#pragma omp parallel for schedule(static) if (T * heads * D >= kParallelMinElements)
  for (int64_t t = 0; t < T; ++t) {
    const float* c = r.cos.data() + t * half;
    const float* s = r.sin.data() + t * half;
    for (int h = 0; h < heads; ++h) {
      float* v = x + (t * heads + h) * D;
      for (int i = 0; i < half; ++i) {
        const float a = v[i], b = v[i + half];
        v[i] = a * c[i] - sign * b * s[i];
        v[i + half] = b * c[i] + sign * a * s[i];
      }
    }
  }
}

void rope_apply_head_major(float* x, const RopeTable& r, int B, int heads, int64_t L, bool inverse) {
  const int D = r.D, half = D / 2;
  const float sign = inverse ? -1.f : 1.f;
#pragma omp parallel for collapse(2) schedule(static) if (int64_t{B} * heads * L * D >= kParallelMinElements)
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < heads; ++h) {
      for (int64_t l = 0; l < L; ++l) {
        const float* c = r.cos.data() + (int64_t{b} * L + l) * half;
        const float* s = r.sin.data() + (int64_t{b} * L + l) * half;
        float* v = x + ((int64_t{b} * heads + h) * L + l) * D;
        for (int i = 0; i < half; ++i) {
          const float p = v[i], q = v[i + half];
          v[i] = p * c[i] - sign * q * s[i];
          v[i + half] = q * c[i] + sign * p * s[i];
        }
      }
    }
  }
}

void rmsnorm_rope_forward(const float* x, const float* w, float eps, const RopeTable* rope, int B, int heads, int64_t L,
                          int64_t D, float* inv_rms, const AttnOut& y) {
  RF_CHECK(D >= 1 && D <= kMaxHeadDim, "rmsnorm_rope_forward: head dimension ", D, " is outside 1..", kMaxHeadDim);
  RF_CHECK(!rope || rope->D == D, "rmsnorm_rope_forward: RoPE table for D = ", rope ? rope->D : 0, ", rows of D = ", D);
  const ElementwiseKernels& k = elementwise();
  const int64_t R = int64_t{B} * heads * L, half = D / 2;
#pragma omp parallel for schedule(static) if (R * D >= kParallelMinElements)
  for (int64_t r = 0; r < R; ++r) {
    float row[kMaxHeadDim];  // the normed (and rotated) row [D], stored once at the end
    const float inv = 1.f / std::sqrt(k.sum_squares(x + r * D, D) / static_cast<float>(D) + eps);
    inv_rms[r] = inv;
    k.scale_row(x + r * D, w, inv, row, D);
    if (rope) {
      // Row r is (b, h, l) of [B, heads, L]; the table is token-major [B * L, D/2]. As rope_apply_head_major.
      const int64_t token = r / (int64_t{heads} * L) * L + r % L;
      const float* c = rope->cos.data() + token * half;
      const float* s = rope->sin.data() + token * half;
      for (int64_t i = 0; i < half; ++i) {
        const float p = row[i], q = row[i + half];
        row[i] = p * c[i] - q * s[i];
        row[i + half] = q * c[i] + p * s[i];
      }
    }
    y.at(r * D).store(row, D);
  }
}

void heads_forward(const Matmul& mm, const float* x, const float* W, float* y, int B, int64_t L, int64_t K, int heads,
                   int64_t D) {
  SharedOperands shared(mm);
  shared.add(x, int64_t{B} * L * K);  // every head's product reads its row of x
  const Matmul m = shared.matmul();
  if (L == 1 && streaming_rows()) {
    gemm(m, false, true, B, heads * D, K, 1.f, x, K, W, K, 0.f, y, heads * D);
    return;
  }
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < heads; ++h)
      gemm(m, false, true, L, D, K, 1.f, x + b * L * K, K, W + h * D * K, K, 0.f, y + (int64_t{b} * heads + h) * L * D,
           D);
}

void heads_backward(const Matmul& mm, const float* x, const float* W, const float* dy, float* dx, float* dW, int B,
                    int64_t L, int64_t K, int heads, int64_t D) {
  SharedOperands shared(mm);
  if (dW) shared.add(x, int64_t{B} * L * K);                 // every head's weight gradient reads its row of x
  if (dx && dW) shared.add(dy, int64_t{B} * heads * L * D);  // each head's g feeds both products
  const Matmul m = shared.matmul();
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < heads; ++h) {
      const float* g = dy + (int64_t{b} * heads + h) * L * D;  // [L, D]
      if (dx) gemm(m, false, false, L, K, D, 1.f, g, D, W + h * D * K, K, 1.f, dx + b * L * K, K);
      if (dW) gemm(m, true, false, D, K, L, 1.f, g, D, x + b * L * K, K, 1.f, dW + h * D * K, K);
    }
  }
}

void merge_heads_forward(const Matmul& mm, const float* x, const float* W, float* y, int B, int64_t L, int heads,
                         int64_t D, int64_t N) {
  const int64_t ld_w = int64_t{heads} * D;
  if (L == 1 && streaming_rows()) {
    gemm(mm, false, true, B, N, ld_w, 1.f, x, ld_w, W, ld_w, 0.f, y, N);
    return;
  }
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < heads; ++h)
      gemm(mm, false, true, L, N, D, 1.f, x + (int64_t{b} * heads + h) * L * D, D, W + h * D, ld_w, h == 0 ? 0.f : 1.f,
           y + b * L * N, N);
}

void merge_heads_backward(const Matmul& mm, const float* x, const float* W, const float* dy, const AttnOut& dx,
                          float* dW, int B, int64_t L, int heads, int64_t D, int64_t N) {
  const int64_t ld_w = int64_t{heads} * D;
  SharedOperands shared(mm);
  shared.add(dy, int64_t{B} * L * N);  // every head's products read its row of dy, up to twice
  const Matmul m = shared.matmul();
  for (int b = 0; b < B; ++b) {
    const float* g = dy + b * L * N;  // [L, N]
    for (int h = 0; h < heads; ++h) {
      const int64_t o = (int64_t{b} * heads + h) * L * D;
      if (!dx.empty()) gemm_into(m, false, false, L, D, N, 1.f, g, N, W + h * D, ld_w, dx.at(o));
      if (dW) gemm(m, true, false, N, D, L, 1.f, g, N, x + o, D, 1.f, dW + h * D, ld_w);
    }
  }
}

}  // namespace rf::model
