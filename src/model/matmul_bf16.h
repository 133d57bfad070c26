// ringflex model: the bfloat16 products of the optional bf16 compute mode (RunOptions::compute_dtype), through
// oneDNN's matmul primitive.
//
// oneDNN picks its kernel at run time (AMX tiles, avx512_core_bf16's vdpbf16ps, or avx512_core with the products
// emulated in float32) and never needs a build flag. Each call runs on the calling thread alone: model::gemm splits C
// over OpenMP threads itself and calls this once per block, so the bits do not depend on the thread count as long as
// oneDNN's reduction over K for one element does not depend on how many rows or columns share the call (checked by
// tests/model/test_ops.cpp, Bf16Gemm.SameBitsForAnySplit).
#pragma once

#include <cstdint>
#include <string>

#include "core/dtype.h"

namespace rf::model {

// C[m, n] = alpha * op(A) op(B) + beta * C (row-major, float32 C with leading dimension ldc), op = transpose when
// flagged; A and B are bfloat16: A is [m, k] (or [k, m] transposed) with leading dimension lda, B is [k, n] (or
// [n, k] transposed) with leading dimension ldb. Products of bf16 pairs are exact in float32; the sum over k
// accumulates in float32. With beta = 0, C is written without being read. Runs on this thread only, whatever the OpenMP
// settings.
void bf16_gemm_on_this_thread(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const bf16* A,
                              int64_t lda, const bf16* B, int64_t ldb, float beta, float* C, int64_t ldc);
// The same with C stored in c_dtype: bf16 C gets the float32 result rounded to nearest even by oneDNN as it is written
// (no float32 copy of C exists), which only beta = 0 allows.
void bf16_gemm_on_this_thread(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const bf16* A,
                              int64_t lda, const bf16* B, int64_t ldb, float beta, void* C, DType c_dtype, int64_t ldc);

// Whether model::gemm sends bf16 products to oneDNN: where oneDNN multiplies bf16 on bf16 units (AMX tiles or
// vdpbf16ps) and the attention kernels' choice of units (cpu::kernel_path) did not find them slower than float32
// FMAs. An Intel CPU with AVX512_BF16 but no AMX runs vdpbf16ps at 0.5-0.64x the FMAs' rate (BENCHMARKS.md), where
// oneDNN's bf16 matmul made the 100m step 1.58x slower than float32. Elsewhere model::gemm multiplies the
// bf16-rounded operands with float32 sgemm: the same products (exact in float32) and the same float32 accumulation,
// at float32's speed. RINGFLEX_ISA=avx512-widen chooses that too; ONEDNN_MAX_CPU_ISA below avx512_core_bf16 as well.
bool bf16_matmul_on_onednn();

// What the bf16 products run on, for `ringflex info` and the run's log line, e.g. "oneDNN avx512_core_bf16
// (vdpbf16ps)"; `on_onednn` is bf16_matmul_on_onednn().
struct Bf16MatmulPath {
  std::string description;
  bool on_onednn = false;
};
Bf16MatmulPath bf16_matmul_path();

}  // namespace rf::model
