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

// Whether oneDNN has a bf16 matmul on this CPU (avx512_core or better; ONEDNN_MAX_CPU_ISA may lower it). Without one,
// model::gemm multiplies the bf16-rounded operands with float32 sgemm: the same products (exact in float32) and the
// same float32 accumulation, at float32's speed.
bool bf16_matmul_available();

// What oneDNN runs bf16 products with on this CPU, for `ringflex info` and the run's log line, e.g.
// "oneDNN avx512_core_bf16 (vdpbf16ps)"; `native` is false where the products are emulated in float32 (no
// AVX512_BF16 or AMX: the mode works, no faster or slower than float32).
struct Bf16MatmulPath {
  std::string description;
  bool native = false;
};
Bf16MatmulPath bf16_matmul_path();

}  // namespace rf::model
