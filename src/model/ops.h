// ringflex model: the float32 building blocks of the decoder, each with its backward.
//
// Every op works on token-major activations [T, n] (T = B*S tokens, row-major) so the linear layers are plain
// sgemm calls. Backward functions *accumulate* (+=) into their input gradients and parameter gradients; the
// caller zeroes once. Reductions over tokens (weight gradients) are split into fixed-size token blocks summed
// in block order, so the bits do not depend on the thread count.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "core/dtype.h"

namespace rf::model {

// What the model's matmuls multiply in. Float32: sgemm. Bfloat16: both operands rounded to bfloat16 (nearest even,
// a relative error of at most 2^-9 each), their products accumulated in float32 into float32 results; weights stay
// float32 masters (the optimizer updates those) and are rounded once after each change (Bf16Lookup), activations
// when a call packs them.
enum class ComputeDtype { Float32, Bfloat16 };
std::string_view compute_dtype_name(ComputeDtype t);  // "float32" / "bfloat16"
// Parses "float32" or "bfloat16" (also "f32", "bf16"); throws rf::Error naming the value and the choices.
ComputeDtype parse_compute_dtype(std::string_view s);

// What the run reads the weights as (model.param_dtype). Float32: the float32 masters themselves. Bfloat16: a working
// copy of every weight rounded to bf16 (nearest even) from the float32 masters, which the optimizer keeps updating in
// float32; the gradients are taken against the working values and stay float32 (model/param_store.h).
enum class ParamDtype { Float32, Bfloat16 };
std::string_view param_dtype_name(ParamDtype t);  // "float32" / "bfloat16"

// Where a matmul finds the bf16 copy of a float32 operand that is a weight, so the bf16 mode rounds a weight once per
// change instead of once per call: the parameter store's compute copies (model/param_store.h), or Bf16Copies.
class Bf16Lookup {
 public:
  virtual ~Bf16Lookup() = default;
  // The copy of src[0, extent) if it lies inside one copied tensor, else null.
  virtual const bf16* find(const float* src, int64_t extent) const = 0;
};

// bfloat16 copies of float32 tensors anywhere in memory, made once by add() (after every change to the originals),
// found again by the float32 address an operand starts at.
class Bf16Copies final : public Bf16Lookup {
 public:
  void clear() { copies_.clear(); }
  // Rounds src[0, n) now (in parallel) and remembers it.
  void add(const float* src, int64_t n);
  const bf16* find(const float* src, int64_t extent) const override;
  int64_t bytes() const;

 private:
  struct Copy {
    const float* src;
    int64_t n;
    std::vector<bf16> bits;
  };
  std::vector<Copy> copies_;  // sorted by src
};

// Rounds src[0, n) to bf16 into dst (nearest even), in parallel above kParallelMinElements.
void round_to_bf16(const float* src, bf16* dst, int64_t n);

// How one run multiplies: the dtype, and the weights' bf16 copies when it is Bfloat16 (null: every operand is
// rounded as it is packed).
struct Matmul {
  ComputeDtype dtype = ComputeDtype::Float32;
  const Bf16Lookup* weights = nullptr;
};

// Operands that several matmuls of one op read in the bf16 mode (an activation every head's projection multiplies,
// the gradient both products of a linear layer take): add() rounds each once, and the matmuls find them through
// matmul()'s lookup (before the weights' copies) instead of rounding them again in every call. The same bits as
// rounding per call. In the float32 mode add() does nothing and matmul() is the run's own.
class SharedOperands final : public Bf16Lookup {
 public:
  explicit SharedOperands(const Matmul& mm) : base_(mm) {}
  void add(const float* src, int64_t n);
  const bf16* find(const float* src, int64_t extent) const override;
  Matmul matmul() const { return base_.dtype == ComputeDtype::Bfloat16 ? Matmul{base_.dtype, this} : base_; }

 private:
  Matmul base_;
  Bf16Copies copies_;
};

// Loops over fewer elements than this run on one thread: a parallel region's fork and barrier cost microseconds
// on an idle machine and milliseconds on a loaded one, more than ~32K elements of simple work.
constexpr int64_t kParallelMinElements = int64_t{1} << 15;
// The same for sgemm, in multiply-adds.
constexpr int64_t kParallelMinMultiplyAdds = int64_t{1} << 21;

// Row-major C[M, N] = alpha * op(A) op(B) + beta * C with op = transpose when the flag is set; A is [M, K] (or
// [K, M] transposed), B is [K, N] (or [N, K]). OpenMP splits M into one block per thread (or N, when M is small, into
// fixed panels), each a single-threaded sgemm (OpenBLAS's own threading does not scale on the dev VM; docs/machine.md);
// called inside a parallel region it runs as one sgemm on the calling thread.
//
// With mm.dtype = Bfloat16 the same split runs oneDNN's bf16 matmul per block (model/matmul_bf16.h) on operands
// rounded to bf16 (A and B from mm.weights where they lie in a copied tensor, else rounded here once per call, before
// the split), still never cutting K.
void gemm(const Matmul& mm, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
          int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// Where an op writes one of attention's inputs (q, k, v, or the backward's dout) in the storage the run's attention
// reads (core/attention_backend.h ShardAttention::dtype): float32 as computed; float32 rounded to bf16 values (the
// bf16 mode on float32 attention kernels); or bf16 (the bf16 mode on the bf16 kernels). The op that produces the
// values rounds them as it writes them, so no separate pass over the tensor converts it.
struct AttnOut {
  float* f32 = nullptr;  // float32 storage, or null
  bf16* b16 = nullptr;   // bf16 storage (rounded to nearest even), or null
  bool round = false;    // with f32: store bf16-rounded values

  bool empty() const { return !f32 && !b16; }
  AttnOut at(int64_t offset) const;  // the same storage from element `offset` on
  // Stores src[0, n) at elements [0, n) (src may be f32 itself).
  void store(const float* src, int64_t n) const;
};

// gemm with beta = 0 into an attention input [M, N] (leading dimension N): a bf16 C is written by oneDNN's bf16 matmul
// directly where the model's matmuls run there (bf16_matmul_on_onednn), else rounded block by block as it is written.
void gemm_into(const Matmul& mm, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
               const float* A, int64_t lda, const float* B, int64_t ldb, const AttnOut& C);

// The rows of a token tile cut from a longer product (the tiled MLP): `rows` at most, a whole number of the row
// blocks gemm keeps every row's offset in (ops.cpp kGemmQuantum; one block at least), so each row sums in the order
// it has when the whole product is one call, on the AVX2 kernels too; `total` when the tile covers it.
int64_t gemm_tile_rows(int64_t rows, int64_t total);

// Float32.
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// The functions below take the run's Matmul first; each multiplies through gemm(mm, ...).

// y[T, N] = x[T, K] W[N, K]^T (nn.Linear without bias).
void linear_forward(const Matmul& mm, const float* x, const float* W, float* y, int64_t T, int64_t K, int64_t N);
// dx[T, K] += dy W (skipped when dx is null); dW[N, K] += dy^T x (skipped when dW is null).
void linear_backward(const Matmul& mm, const float* x, const float* W, const float* dy, float* dx, float* dW, int64_t T,
                     int64_t K, int64_t N);

// y[R, n] = x * (mean(x^2) + eps)^-1/2 * w per row (w null: no scale). inv_rms: [R], kept for the backward.
void rmsnorm_forward(const float* x, const float* w, float eps, float* y, float* inv_rms, int64_t R, int64_t n);
// dx[R, n] += ...; dw[n] += sum_rows dy * x * inv_rms (skipped when w or dw is null).
void rmsnorm_backward(const float* x, const float* w, const float* inv_rms, const float* dy, float* dx, float* dw,
                      int64_t R, int64_t n);

// GeGLU: h[T, I] = gelu(g) * u, with the tanh-approximated GELU (gelu_pytorch_tanh).
void geglu_forward(const float* g, const float* u, float* h, int64_t n);
// dg += dh * u * gelu'(g); du += dh * gelu(g) when `accumulate`; written otherwise, when dg may be g and du may be
// u (each element is read before it is written).
void geglu_backward(const float* g, const float* u, const float* dh, float* dg, float* du, int64_t n, bool accumulate);

// RoPE angles for one layer type: cos/sin [T, D/2] from float32 position ids, the way transformers builds them
// (inv_freq in float32, angle = pos * inv_freq in float32). Pairs past the rotated fraction (proportional RoPE)
// have frequency 0, i.e. cos 1 and sin 0.
struct RopeTable {
  int D = 0;
  std::vector<float> cos, sin;  // [T, D/2]
};
RopeTable make_rope_table(const int32_t* positions, int64_t T, int D, bool proportional, double theta,
                          double partial_rotary_factor, double factor);
// In place on x[T, heads, D]: rotate_half pairs (i, i + D/2). inverse = true applies the transpose (backward).
void rope_apply(float* x, const RopeTable& r, int64_t T, int heads, bool inverse);

// The same on head-major x[B, heads, L, D] (the attention kernels' layout); the table is token-major [B * L, D/2].
void rope_apply_head_major(float* x, const RopeTable& r, int B, int heads, int64_t L, bool inverse);

// rmsnorm_forward over the R = B * heads * L head vectors x[B, heads, L, D] (w: [D], or null for no scale), then RoPE
// (rope_apply_head_major; rope null: none), written to y in one pass (q and k: norm and RoPE; v: norm alone).
// inv_rms: [R]. Each row is normed, rotated and stored while it is in cache, so y is the one tensor written.
void rmsnorm_rope_forward(const float* x, const float* w, float eps, const RopeTable* rope, int B, int heads, int64_t L,
                          int64_t D, float* inv_rms, const AttnOut& y);

// Attention projections straight into and out of the head-major layout [B, heads, L, D] the attention kernels
// read, so no full-tensor transpose happens per layer: head h's slice of a projection is its own sgemm (the
// weight rows, or columns, of that head), writing a contiguous [L, D] block. Reductions never cut K inside an
// sgemm and sum heads and rows in a fixed order, so the bits do not depend on the thread count.

// y[B, heads, L, D] = x[B, L, K] W[heads*D, K]^T (q/k/v_proj).
void heads_forward(const Matmul& mm, const float* x, const float* W, float* y, int B, int64_t L, int64_t K, int heads,
                   int64_t D);
// dx[B, L, K] += sum_h dy[b, h] W_h (skipped when dx is null); dW_h[D, K] += sum_b dy[b, h]^T x[b] (skipped when
// dW is null). dy: [B, heads, L, D].
void heads_backward(const Matmul& mm, const float* x, const float* W, const float* dy, float* dx, float* dW, int B,
                    int64_t L, int64_t K, int heads, int64_t D);
// y[B, L, N] = sum_h x[B, h, L, D] W[N, heads*D][:, h*D : (h+1)*D]^T (o_proj), written (not accumulated).
void merge_heads_forward(const Matmul& mm, const float* x, const float* W, float* y, int B, int64_t L, int heads,
                         int64_t D, int64_t N);
// dx[B, heads, L, D] = dy[b] W_h (written; skipped when dx is empty); dW[:, h*D : (h+1)*D] += sum_b dy[b]^T x[b, h]
// (skipped when dW is null). dx is attention's dout, so it is written in the attention's storage.
void merge_heads_backward(const Matmul& mm, const float* x, const float* W, const float* dy, const AttnOut& dx,
                          float* dW, int B, int64_t L, int heads, int64_t D, int64_t N);
inline void merge_heads_backward(const Matmul& mm, const float* x, const float* W, const float* dy, float* dx,
                                 float* dW, int B, int64_t L, int heads, int64_t D, int64_t N) {
  merge_heads_backward(mm, x, W, dy, AttnOut{dx}, dW, B, L, heads, D, N);
}

}  // namespace rf::model
