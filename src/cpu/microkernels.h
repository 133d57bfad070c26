// ringflex cpu: the register-blocked inner loops of the attention kernels, and a vectorised exp2.
//
// Internal to src/cpu. Every matrix product in flash attention (forward and backward) is one of two shapes on a
// tile of kTileK keys:
//   abt: C[M, kTileK]  = A[M, Dp] . Bt[Dp, kTileK]   (S = Q K^T, dP = dO V^T; B packed transposed once per tile)
//   acc: O[M, Dp]     += A[M, N]  . X[N, Dp]         (O += P V, dV += P^T dO, dK += dS^T Q, dQ += dS K)
// Both are written for one 64-key tile: the attention loops call them per (query tile, key tile) pair.
// Dp is the head dimension padded with zeros to a multiple of the vector width, so a generic D (8, 72 ...) runs
// the same loops as the fast ones; the zero lanes add exact zeros. kDp > 0 fixes Dp at compile time (the fast
// paths: the d loops unroll and the tile buffers' strides are constants); kDp = 0 reads it at run time.
//
// With AVX-512 each call keeps a block of up to kRowBlock rows x 64 floats in 24 zmm accumulators:
// per step 4 vector loads of B (or X) and kRowBlock broadcasts feed 4·kRowBlock FMAs, so the loads are not the
// bottleneck (Zen 4 and current Xeons issue 2 or more loads per cycle). bfloat16 inputs are widened to float32 while packing (exact);
// optionally (kHaveBf16Dot) the abt product uses vdpbf16ps instead, two multiply-adds per float32 lane (pairs of
// adjacent d) with float32 accumulation: A's rows are bf16 pairs broadcast as 32-bit words, Bt is packed as
// [Dp/2, kTileK] pairs.
// On CPUs with AMX-BF16 the bf16 abt products run on AMX tiles instead (amx.h, chosen at run time in dispatch.h).
// Without AVX-512 the same functions are plain loops, so the code compiles and runs everywhere.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/dtype.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace rf::cpu::detail {

constexpr int kLanes = 16;      // float32 lanes in a 512-bit vector
constexpr int kTileCols = 64;   // keys per tile (= kTileK); 4 vectors wide
constexpr int kColVecs = kTileCols / kLanes;
constexpr int kRowBlock = 6;    // rows per register block: 6 x 4 accumulators + 4 operands + 1 broadcast <= 32 zmm

// Whether bf16 inputs use vdpbf16ps for the abt products (operands kept as bf16 pairs) instead of being widened
// to float32 while packing. Opt-in (CMake RINGFLEX_BF16_DOT): on the development VM (2 vCPU; lscpu reports an
// Intel Xeon with AVX-512 BF16) one 64 x 64 x 128 tile product, timed alone in a loop, ran at 112 GFLOP/s with
// vdpbf16ps against 198 GFLOP/s with float32 FMAs — the instruction retires ~3.5x less often than vfmadd231ps —
// so it does not pay there (see BENCHMARKS.md).
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(RF_BF16_DOT)
constexpr bool kHaveBf16Dot = true;
#else
constexpr bool kHaveBf16Dot = false;
#endif

// ---------------------------------------------------------------------------------------------------------------
// exp2 of a vector, for x <= 0 (softmax exponents after subtracting the running max) and x = -inf.
// x = n + f with n = round(x), |f| <= 1/2; 2^f by its degree-7 Taylor polynomial in f·ln2, whose truncation error
// is (ln2/2)^8 / 8! < 5.2e-9 relative, far below float32's 6e-8; Horner rounding adds at most ~2 ulp. Measured
// against std::exp2 over [-126, 0] the relative error is below 3e-7 (test_attention.cpp, VectorExp2Accuracy). 2^n is applied with
// vscalefps, which underflows gracefully to 0; x is first raised to kExp2Floor so that x = -inf gives exactly 0
// (n = -200, f = 0) instead of -inf - (-inf) = NaN. A NaN input stays NaN (vmaxps returns its second operand).
// ---------------------------------------------------------------------------------------------------------------
constexpr float kExp2Floor = -200.f;
constexpr float kExp2Coef[8] = {1.0f,
                                0.693147180559945309f,
                                0.240226506959100712f,
                                0.0555041086648215800f,
                                0.00961812910762847716f,
                                0.00133335581464284434f,
                                0.000154035303933816099f,
                                0.0000152527338040598403f};

#ifdef __AVX512F__
// GCC 12's unmasked vmaxps, vrndscaleps, vscalefps and _mm512_reduce_* intrinsics pass _mm512_undefined_ps() as
// the unused merge source, which -Werror=uninitialized rejects once inlined (a false positive). The zero-masked
// forms with an all-ones mask compile to the same unmasked instructions without that operand.
constexpr __mmask16 kAll = 0xffff;

inline __m512 max_ps(__m512 a, __m512 b) { return _mm512_maskz_max_ps(kAll, a, b); }

inline __m512 exp2_ps(__m512 x) {
  x = max_ps(_mm512_set1_ps(kExp2Floor), x);
  const __m512 n = _mm512_maskz_roundscale_ps(kAll, x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(kExp2Coef[7]);
  for (int i = 6; i >= 0; --i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Coef[i]));
  return _mm512_maskz_scalef_ps(kAll, p, n);
}

// Horizontal max and sum of 16 lanes, halving the width with AVX ops that take no merge source.
inline float reduce_max(__m512 x) {
  __m256 h = _mm256_max_ps(_mm512_maskz_extractf32x8_ps(0xff, x, 0), _mm512_maskz_extractf32x8_ps(0xff, x, 1));
  __m128 q = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_max_ps(q, _mm_movehl_ps(q, q));
  q = _mm_max_ss(q, _mm_shuffle_ps(q, q, 1));
  return _mm_cvtss_f32(q);
}

inline float reduce_add(__m512 x) {
  __m256 h = _mm256_add_ps(_mm512_maskz_extractf32x8_ps(0xff, x, 0), _mm512_maskz_extractf32x8_ps(0xff, x, 1));
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
  return _mm_cvtss_f32(q);
}
#endif

inline float exp2_scalar(float x) { return std::exp2(x); }

// ---------------------------------------------------------------------------------------------------------------
// abt: c[r, j] = sum_d a[r, d] * bt[d, j] for r < rows, j < kTileCols. a: [rows, Dp] (stride lda);
// bt: [Dp, kTileCols]; c: [rows, kTileCols]. Operand type T = float, or uint32_t (bf16 pairs, Dp/2 words a row).
// The d range is split into chunks of kDChunk so the slice of bt being read (kDChunk x 64 floats = 32 KiB) stays
// in L1 across all row blocks; at D = 512 the whole K^T tile (128 KiB) would otherwise stream from L2 per block.
// ---------------------------------------------------------------------------------------------------------------
constexpr int kDChunk = 128;

#ifdef __AVX512F__
// kLen > 0: the chunk length is a compile-time constant (the fast paths), else len.
template <int kLen, int R>
inline void abt_block_f32(const float* a, int lda, const float* bt, int len_rt, bool accumulate, float* c) {
  const int len = kLen > 0 ? kLen : len_rt;
  __m512 acc[R][kColVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kColVecs; ++v)
      acc[r][v] = accumulate ? _mm512_loadu_ps(c + r * kTileCols + v * kLanes) : _mm512_setzero_ps();
  for (int d = 0; d < len; ++d) {
    __m512 b[kColVecs];
    for (int v = 0; v < kColVecs; ++v) b[v] = _mm512_loadu_ps(bt + d * kTileCols + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const __m512 ar = _mm512_set1_ps(a[r * lda + d]);
      for (int v = 0; v < kColVecs; ++v) acc[r][v] = _mm512_fmadd_ps(ar, b[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kColVecs; ++v) _mm512_storeu_ps(c + r * kTileCols + v * kLanes, acc[r][v]);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
template <int kDp, int R>
inline void abt_block_bf16(const uint32_t* a, int lda, const uint32_t* bt, int dp_rt, float* c) {
  const int pairs = (kDp > 0 ? kDp : dp_rt) / 2;
  __m512 acc[R][kColVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kColVecs; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int d = 0; d < pairs; ++d) {
    __m512bh b[kColVecs];
    for (int v = 0; v < kColVecs; ++v)
      b[v] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(bt + d * kTileCols + v * kLanes));
    for (int r = 0; r < R; ++r) {
      const __m512bh ar = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(a[r * lda + d])));
      for (int v = 0; v < kColVecs; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], ar, b[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kColVecs; ++v) _mm512_storeu_ps(c + r * kTileCols + v * kLanes, acc[r][v]);
}
#endif

// Calls f.template operator()<R>(r) for row blocks r = 0, kRowBlock, ... of `rows`, the last one shorter.
template <typename F>
inline void for_row_blocks(int rows, F&& f) {
  int r = 0;
  for (; r + kRowBlock <= rows; r += kRowBlock) f.template operator()<kRowBlock>(r);
  switch (rows - r) {
    case 5: f.template operator()<5>(r); break;
    case 4: f.template operator()<4>(r); break;
    case 3: f.template operator()<3>(r); break;
    case 2: f.template operator()<2>(r); break;
    case 1: f.template operator()<1>(r); break;
    default: break;
  }
}

// Scalar forms: the portable fallback (and nothing else).
inline void abt_scalar(const float* a, int lda, const float* bt, int Dp, int rows, float* c) {
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < kTileCols; ++j) {
      float s = 0.f;
      for (int d = 0; d < Dp; ++d) s += a[r * lda + d] * bt[d * kTileCols + j];
      c[r * kTileCols + j] = s;
    }
}

inline float bf16_lo(uint32_t w) { return bf16_to_float(bf16{static_cast<uint16_t>(w & 0xffffu)}); }
inline float bf16_hi(uint32_t w) { return bf16_to_float(bf16{static_cast<uint16_t>(w >> 16)}); }

inline void abt_scalar(const uint32_t* a, int lda, const uint32_t* bt, int Dp, int rows, float* c) {
  const int pairs = Dp / 2;
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < kTileCols; ++j) {
      float s = 0.f;
      for (int d = 0; d < pairs; ++d) {
        const uint32_t x = a[r * lda + d], y = bt[d * kTileCols + j];
        s += bf16_lo(x) * bf16_lo(y) + bf16_hi(x) * bf16_hi(y);
      }
      c[r * kTileCols + j] = s;
    }
}

// c: [rows, kTileCols] = a: [rows, Dp] (row stride lda elements of T) . bt: [Dp, kTileCols].
template <int kDp, typename T>
inline void abt(const T* a, int lda, const T* bt, int dp_rt, int rows, float* c) {
  const int Dp = kDp > 0 ? kDp : dp_rt;
#ifdef __AVX512F__
  if constexpr (std::is_same_v<T, float>) {
    constexpr int kLen = kDp > 0 ? std::min(kDp, kDChunk) : 0;  // chunk length when it is a compile-time constant
    for (int d0 = 0; d0 < Dp; d0 += kDChunk) {
      const int len = std::min(kDChunk, Dp - d0);
      for_row_blocks(rows, [&]<int R>(int r) {
        abt_block_f32<kLen, R>(a + r * lda + d0, lda, bt + d0 * kTileCols, len, d0 > 0, c + r * kTileCols);
      });
    }
    return;
  }
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, uint32_t>) {
    for_row_blocks(rows, [&]<int R>(int r) { abt_block_bf16<kDp, R>(a + r * lda, lda, bt, Dp, c + r * kTileCols); });
    return;
  }
#endif
#endif
  abt_scalar(a, lda, bt, Dp, rows, c);
}

// ---------------------------------------------------------------------------------------------------------------
// acc: out[r, d] += sum_n a[r, n] * x[n, d] for r < rows, n < N, d < Dp. a[r, n] is read at a[r·ars + n·ans], so
// a transposed operand (dV += P^T dO, dK += dS^T Q) is read in place, without a transpose; x: [N, ldx];
// out: [rows, Dp]. Packed x rows use ldx = Dp + kLanes: with a power-of-two stride (2 KiB at D = 512) the 64 rows
// of one 64-float slice would map onto 8 of L1's 64 sets and evict each other. The d range is the outer loop, 64 floats (4 vectors) at a time with a 1-3 vector tail, so the
// slice of x it reads (N x 64 floats, 16 KiB for a key tile) stays in L1 while every row block passes over it.
// ---------------------------------------------------------------------------------------------------------------
#ifdef __AVX512F__
template <int kDp, int R, int V>
inline void acc_block(const float* a, int ars, int ans, int N, const float* x, int ldx, int dp_rt, float* out) {
  const int Dp = kDp > 0 ? kDp : dp_rt;
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_loadu_ps(out + r * Dp + v * kLanes);
  for (int n = 0; n < N; ++n) {
    __m512 xv[V];
    for (int v = 0; v < V; ++v) xv[v] = _mm512_loadu_ps(x + n * ldx + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const __m512 ar = _mm512_set1_ps(a[r * ars + n * ans]);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(ar, xv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(out + r * Dp + v * kLanes, acc[r][v]);
}

template <int kDp, int V>
inline void acc_cols(const float* a, int ars, int ans, int N, const float* x, int ldx, int Dp, int rows,
                     float* out) {
  for_row_blocks(rows,
                 [&]<int R>(int r) { acc_block<kDp, R, V>(a + r * ars, ars, ans, N, x, ldx, Dp, out + r * Dp); });
}
#endif

template <int kDp>
inline void acc(const float* a, int ars, int ans, int N, const float* x, int ldx, int dp_rt, int rows, float* out) {
  const int Dp = kDp > 0 ? kDp : dp_rt;
#ifdef __AVX512F__
  constexpr int kWidth = kColVecs * kLanes;
  for (int d = 0; d < Dp; d += kWidth) {
    switch (std::min(kWidth, Dp - d) / kLanes) {
      case 4: acc_cols<kDp, 4>(a, ars, ans, N, x + d, ldx, Dp, rows, out + d); break;
      case 3: acc_cols<kDp, 3>(a, ars, ans, N, x + d, ldx, Dp, rows, out + d); break;
      case 2: acc_cols<kDp, 2>(a, ars, ans, N, x + d, ldx, Dp, rows, out + d); break;
      case 1: acc_cols<kDp, 1>(a, ars, ans, N, x + d, ldx, Dp, rows, out + d); break;
      default: break;
    }
  }
#else
  for (int r = 0; r < rows; ++r)
    for (int n = 0; n < N; ++n) {
      const float w = a[r * ars + n * ans];
      for (int d = 0; d < Dp; ++d) out[r * Dp + d] += w * x[n * ldx + d];
    }
#endif
}

}  // namespace rf::cpu::detail
