// ringflex cpu: the register-blocked inner loops of the attention kernels, and a vectorised exp2, for one ISA.
//
// Internal to src/cpu: compiled once per ISA (isa_target.h), everything in rf::cpu::RF_ISA_NS::detail. Every
// matrix product in flash attention (forward and backward) is one of two shapes on a tile of kTileK keys:
//   abt: C[M, kTileK]  = A[M, Dp] . Bt[Dp, kTileK]   (S = Q K^T, dP = dO V^T; B packed transposed once per tile)
//   acc: O[M, Dp]     += A[M, N]  . X[N, Dp]         (O += P V, dV += P^T dO, dK += dS^T Q, dQ += dS K)
// Both are written for one 64-key tile: the attention loops call them per (query tile, key tile) pair.
// Dp is the head dimension padded with zeros to a multiple of kPadFloats, so a generic D (8, 72 ...) runs the same
// loops as the fast ones; the zero lanes add exact zeros. kDp > 0 fixes Dp at compile time (the fast paths: the
// d loops unroll and the tile buffers' strides are constants); kDp = 0 reads it at run time.
//
// The vector paths share one register-blocked loop, written on the thin VecF layer below; only the block shape
// differs, sized to the register file (R rows x CV vectors of accumulators, CV operand vectors, 1 broadcast):
//   AVX-512, 32 zmm x 16 floats: 6 rows x 4 vectors (all 64 columns) = 24 accumulators + 4 + 1 = 29 registers;
//   AVX2,    16 ymm x  8 floats: 6 rows x 2 vectors (a 16-column strip) = 12 accumulators + 2 + 1 = 15 registers.
// Per step the block does CV vector loads and R broadcasts for R·CV FMAs (24 FMAs per 10 loads on AVX-512, 12 per
// 8 on AVX2): with 2 loads and 2 FMAs per cycle (Zen 2-4, Haswell and later) the FMAs, not the loads, bound it.
// bfloat16 inputs are widened to float32 while packing (exact) on the Widen path (isa.h: Bf16Product). On the
// Dpbf16 path (AVX-512 with AVX512_BF16) both shapes run on vdpbf16ps instead, on bf16 pairs: each 32-bit lane
// multiplies two adjacent bf16 pairs exactly and adds both products to its float32 accumulator, so one
// instruction does the work of two FMAs. abt pairs along d (A rows broadcast as 32-bit words, Bt packed as
// [Dp/2, kTileK] words); acc pairs along its sum index n (A's pair (n, n+1) broadcast, X packed as [N/2, Dp]
// words). On CPUs with AMX-BF16 the bf16 abt products run on AMX tiles instead (amx.h).
// The scalar ISA runs plain loops, so the code compiles and runs everywhere.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "core/dtype.h"
#include "cpu/isa_target.h"

#if RF_ISA_AVX512 || RF_ISA_AVX2
#include <immintrin.h>
#endif

RF_ISA_BEGIN
namespace rf::cpu::RF_ISA_NS::detail {

constexpr int kTileCols = 64;   // keys per tile (= kTileK)
constexpr int kRowBlock = 6;    // rows per register block (see the register counts above)
constexpr int kPadFloats = 16;  // Dp is a multiple of this: whole vectors on every ISA (16 = 1 zmm = 2 ymm)

// ---------------------------------------------------------------------------------------------------------------
// exp2 of a vector, for x <= 0 (softmax exponents after subtracting the running max) and x = -inf.
// x = n + f with n = round(x), |f| <= 1/2; 2^f by its degree-7 Taylor polynomial in f·ln2, whose truncation error
// is (ln2/2)^8 / 8! < 5.2e-9 relative, far below float32's 6e-8; Horner rounding adds at most ~2 ulp. Measured
// against std::exp2 over [-126, 0] the relative error is below 3e-7 on every ISA (tests/cpu, VectorExp2Accuracy).
// x is first raised to a floor so that x = -inf gives exactly 0 instead of -inf - (-inf) = NaN; a NaN input stays
// NaN (vmaxps returns its second operand when one is NaN).
// ---------------------------------------------------------------------------------------------------------------
constexpr float kExp2Coef[8] = {1.0f,
                                0.693147180559945309f,
                                0.240226506959100712f,
                                0.0555041086648215800f,
                                0.00961812910762847716f,
                                0.00133335581464284434f,
                                0.000154035303933816099f,
                                0.0000152527338040598403f};

#if RF_ISA_AVX512
constexpr bool kVector = true;
constexpr int kLanes = 16;      // float32 lanes in a zmm register
constexpr int kAbtColVecs = 4;  // abt block: all 64 columns
constexpr int kAccVecs = 4;     // acc block: 64 columns of Dp
using VecF = __m512;
using LaneMask = __mmask16;  // one bit per lane
// GCC 12's unmasked vmaxps, vrndscaleps, vscalefps and _mm512_reduce_* intrinsics pass _mm512_undefined_ps() as
// the unused merge source, which -Werror=uninitialized rejects once inlined (a false positive). The zero-masked
// forms with an all-ones mask compile to the same unmasked instructions without that operand.
constexpr __mmask16 kAll = 0xffff;

inline VecF vzero() { return _mm512_setzero_ps(); }
inline VecF vset1(float x) { return _mm512_set1_ps(x); }
inline VecF vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, VecF x) { _mm512_storeu_ps(p, x); }
inline VecF vfmadd(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
inline VecF vfmsub(VecF a, VecF b, VecF c) { return _mm512_fmsub_ps(a, b, c); }
inline VecF vadd(VecF a, VecF b) { return _mm512_add_ps(a, b); }
inline VecF vsub(VecF a, VecF b) { return _mm512_sub_ps(a, b); }
inline VecF vmul(VecF a, VecF b) { return _mm512_mul_ps(a, b); }
inline VecF vmax(VecF a, VecF b) { return _mm512_maskz_max_ps(kAll, a, b); }
inline VecF vmin(VecF a, VecF b) { return _mm512_maskz_min_ps(kAll, a, b); }  // b where either is NaN, as vmax

// Lanes v·kLanes .. of a 64-key row mask, as a lane mask.
inline LaneMask lane_mask(uint64_t bits, int v) { return static_cast<LaneMask>(bits >> (v * kLanes)); }
inline VecF select(LaneMask m, VecF yes, VecF no) { return _mm512_mask_blend_ps(m, no, yes); }
inline VecF zero_unless(LaneMask m, VecF x) { return _mm512_maskz_mov_ps(m, x); }

// 2^n by vscalefps, which underflows through the denormals to 0 (to 0 directly under the kernels' FTZ, fp_mode.h).
constexpr float kExp2Floor = -200.f;
inline VecF exp2_ps(VecF x) {
  x = vmax(vset1(kExp2Floor), x);
  const VecF n = _mm512_maskz_roundscale_ps(kAll, x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const VecF f = vsub(x, n);
  VecF p = vset1(kExp2Coef[7]);
  for (int i = 6; i >= 0; --i) p = vfmadd(p, f, vset1(kExp2Coef[i]));
  return _mm512_maskz_scalef_ps(kAll, p, n);
}

// Horizontal max and sum of 16 lanes, halving the width with AVX ops that take no merge source.
inline __m256 low_half(VecF x) { return _mm512_maskz_extractf32x8_ps(0xff, x, 0); }
inline __m256 high_half(VecF x) { return _mm512_maskz_extractf32x8_ps(0xff, x, 1); }
#elif RF_ISA_AVX2
constexpr bool kVector = true;
constexpr int kLanes = 8;       // float32 lanes in a ymm register
constexpr int kAbtColVecs = 2;  // abt block: a 16-column strip of the 64-key tile
constexpr int kAccVecs = 2;     // acc block: 16 columns of Dp
using VecF = __m256;
using LaneMask = __m256;  // all-ones or all-zeros lanes (AVX2 has no mask registers)

inline VecF vzero() { return _mm256_setzero_ps(); }
inline VecF vset1(float x) { return _mm256_set1_ps(x); }
inline VecF vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, VecF x) { _mm256_storeu_ps(p, x); }
inline VecF vfmadd(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
inline VecF vfmsub(VecF a, VecF b, VecF c) { return _mm256_fmsub_ps(a, b, c); }
inline VecF vadd(VecF a, VecF b) { return _mm256_add_ps(a, b); }
inline VecF vsub(VecF a, VecF b) { return _mm256_sub_ps(a, b); }
inline VecF vmul(VecF a, VecF b) { return _mm256_mul_ps(a, b); }
inline VecF vmax(VecF a, VecF b) { return _mm256_max_ps(a, b); }
inline VecF vmin(VecF a, VecF b) { return _mm256_min_ps(a, b); }  // b where either is NaN, as vmax

// Lanes v·kLanes .. of a 64-key row mask: lane i is all ones when bit i of the byte is set.
inline LaneMask lane_mask(uint64_t bits, int v) {
  const __m256i select_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i byte = _mm256_set1_epi32(static_cast<int>((bits >> (v * kLanes)) & 0xffu));
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(byte, select_bit), select_bit));
}
inline VecF select(LaneMask m, VecF yes, VecF no) { return _mm256_blendv_ps(no, yes, m); }
inline VecF zero_unless(LaneMask m, VecF x) { return _mm256_and_ps(m, x); }

// 2^n built in the exponent field, (n + 127) << 23, valid for n >= -126. The floor -127 makes n = -127 the bit
// pattern of +0, so x = -inf gives exactly 0; results below 2^-126.5 flush to 0, as AVX-512's vscalefps does under
// the kernels' flush-to-zero mode (fp_mode.h) — below float32 resolution next to the row maximum's term 2^0 = 1.
constexpr float kExp2Floor = -127.f;
constexpr int kExponentBias = 127;
constexpr int kMantissaBits = 23;
inline VecF exp2_ps(VecF x) {
  x = vmax(vset1(kExp2Floor), x);
  const VecF n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const VecF f = vsub(x, n);
  VecF p = vset1(kExp2Coef[7]);
  for (int i = 6; i >= 0; --i) p = vfmadd(p, f, vset1(kExp2Coef[i]));
  const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(kExponentBias));
  return vmul(p, _mm256_castsi256_ps(_mm256_slli_epi32(biased, kMantissaBits)));
}

inline __m256 low_half(VecF x) { return x; }  // the 8-lane reductions below start at 256 bits
inline __m256 high_half(VecF x) { return x; }
#else
constexpr bool kVector = false;
#endif

#if RF_ISA_AVX512 || RF_ISA_AVX2
inline float reduce_max(VecF x) {
  __m256 h = _mm256_max_ps(low_half(x), high_half(x));
  __m128 q = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_max_ps(q, _mm_movehl_ps(q, q));
  q = _mm_max_ss(q, _mm_shuffle_ps(q, q, 1));
  return _mm_cvtss_f32(q);
}

inline float reduce_add(VecF x) {
#if RF_ISA_AVX512
  __m256 h = _mm256_add_ps(low_half(x), high_half(x));
#else
  __m256 h = x;
#endif
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
  return _mm_cvtss_f32(q);
}
#endif

inline float exp2_scalar(float x) { return std::exp2(x); }

// Calls f.template operator()<R>(r) for row blocks r = 0, kRowBlock, ... of `rows`, the last one shorter.
template <typename F>
inline void for_row_blocks(int rows, F&& f) {
  int r = 0;
  for (; r + kRowBlock <= rows; r += kRowBlock) f.template operator()<kRowBlock>(r);
  switch (rows - r) {
    case 5:
      f.template operator()<5>(r);
      break;
    case 4:
      f.template operator()<4>(r);
      break;
    case 3:
      f.template operator()<3>(r);
      break;
    case 2:
      f.template operator()<2>(r);
      break;
    case 1:
      f.template operator()<1>(r);
      break;
    default:
      break;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// abt: c[r, j] = sum_d a[r, d] * bt[d, j] for r < rows, j < kTileCols. a: [rows, Dp] (stride lda);
// bt: [Dp, kTileCols]; c: [rows, kTileCols]. Operand type T = float, or uint32_t (bf16 pairs, Dp/2 words a row).
// The d range is split into chunks of kDChunk so the slice of bt being read (kDChunk x 64 floats = 32 KiB) stays
// in L1/L2 across all row blocks; at D = 512 the whole K^T tile (128 KiB) would otherwise stream from L2 per block.
// On AVX2 the tile's 64 columns are four 16-column strips, each a pass over the row blocks whose bt slice
// (kDChunk x 16 floats = 8 KiB) stays in L1.
// ---------------------------------------------------------------------------------------------------------------
constexpr int kDChunk = 128;

#if RF_ISA_AVX512 || RF_ISA_AVX2
// One R-row x CV-vector block of c (column offset already applied to bt and c). kLen > 0: the chunk length is a
// compile-time constant (the fast paths), else len_rt. accumulate: add to c (later d chunks) instead of storing.
template <int kLen, int R, int CV>
inline void abt_block_f32(const float* a, int lda, const float* bt, int len_rt, bool accumulate, float* c) {
  const int len = kLen > 0 ? kLen : len_rt;
  VecF acc[R][CV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < CV; ++v) acc[r][v] = accumulate ? vload(c + r * kTileCols + v * kLanes) : vzero();
  for (int d = 0; d < len; ++d) {
    VecF b[CV];
    for (int v = 0; v < CV; ++v) b[v] = vload(bt + d * kTileCols + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const VecF ar = vset1(a[r * lda + d]);
      for (int v = 0; v < CV; ++v) acc[r][v] = vfmadd(ar, b[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < CV; ++v) vstore(c + r * kTileCols + v * kLanes, acc[r][v]);
}
#endif

#if RF_ISA_AVX512
// vdpbf16ps needs AVX512_BF16 on top of the region's ISA (isa_target.h: RF_BF16_TARGET).
// Pairs of d per pass of abt_bf16 over the row blocks: a 128-pair slice of bt is 32 KiB, the slice size of the
// float32 abt's kDChunk, which keeps it in L1/L2 across the row blocks; at D = 512 the whole bt (64 KiB) would
// otherwise stream from L2 for every block. (A 64-pair slice measured no different at D = 256 and 512 on the
// loaded Zen 4, within its noise.)
constexpr int kPairChunk = 128;

// One R-row block of c over pairs [0, len) of a chunk (a and bt already offset to it). kLen > 0: the chunk length
// is a compile-time constant, else len_rt. accumulate: add to c (later chunks) instead of storing.
template <int kLen, int R>
RF_BF16_TARGET inline void abt_block_bf16(const uint32_t* a, int lda, const uint32_t* bt, int len_rt, bool accumulate,
                                          float* c) {
  constexpr int kColVecs = kTileCols / kLanes;
  const int len = kLen > 0 ? kLen : len_rt;
  __m512 acc[R][kColVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kColVecs; ++v)
      acc[r][v] = accumulate ? _mm512_loadu_ps(c + r * kTileCols + v * kLanes) : _mm512_setzero_ps();
  for (int d = 0; d < len; ++d) {
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

// c: [rows, kTileCols] = a · bt on bf16 pairs, chunk by chunk of kPairChunk pairs, whole row blocks then the tail
// (no lambda: a lambda would not inherit this function's target attribute).
template <int kDp>
RF_BF16_TARGET inline void abt_bf16(const uint32_t* a, int lda, const uint32_t* bt, int Dp, int rows, float* c) {
  constexpr int kLen = kDp > 0 ? std::min(kDp / 2, kPairChunk) : 0;  // chunk length when it is a constant
  const int pairs = Dp / 2;
  for (int p0 = 0; p0 < pairs; p0 += kPairChunk) {
    const int len = std::min(kPairChunk, pairs - p0);
    const bool accumulate = p0 > 0;
    const uint32_t* b = bt + p0 * kTileCols;
    int r = 0;
    for (; r + kRowBlock <= rows; r += kRowBlock)
      abt_block_bf16<kLen, kRowBlock>(a + r * lda + p0, lda, b, len, accumulate, c + r * kTileCols);
    const uint32_t* ar = a + r * lda + p0;
    float* cr = c + r * kTileCols;
    switch (rows - r) {
      case 5:
        abt_block_bf16<kLen, 5>(ar, lda, b, len, accumulate, cr);
        break;
      case 4:
        abt_block_bf16<kLen, 4>(ar, lda, b, len, accumulate, cr);
        break;
      case 3:
        abt_block_bf16<kLen, 3>(ar, lda, b, len, accumulate, cr);
        break;
      case 2:
        abt_block_bf16<kLen, 2>(ar, lda, b, len, accumulate, cr);
        break;
      case 1:
        abt_block_bf16<kLen, 1>(ar, lda, b, len, accumulate, cr);
        break;
      default:
        break;
    }
  }
}
#endif

// Scalar forms: the scalar ISA's kernels (the pair form only type-checks the generic abt below: pairs are
// instantiated on the AVX-512 kernels only).
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
#if RF_ISA_AVX512 || RF_ISA_AVX2
  if constexpr (std::is_same_v<T, float>) {
    constexpr int kLen = kDp > 0 ? std::min(kDp, kDChunk) : 0;  // chunk length when it is a compile-time constant
    constexpr int kStrip = kAbtColVecs * kLanes;                // columns per block
    for (int d0 = 0; d0 < Dp; d0 += kDChunk) {
      const int len = std::min(kDChunk, Dp - d0);
      for (int col = 0; col < kTileCols; col += kStrip)
        for_row_blocks(rows, [&]<int R>(int r) {
          abt_block_f32<kLen, R, kAbtColVecs>(a + r * lda + d0, lda, bt + d0 * kTileCols + col, len, d0 > 0,
                                              c + r * kTileCols + col);
        });
    }
    return;
  }
#endif
#if RF_ISA_AVX512
  if constexpr (std::is_same_v<T, uint32_t>) {
    abt_bf16<kDp>(a, lda, bt, Dp, rows, c);
    return;
  }
#endif
  abt_scalar(a, lda, bt, Dp, rows, c);
}

// ---------------------------------------------------------------------------------------------------------------
// acc: out[r, d] += sum_n a[r, n] * x[n, d] for r < rows, n < N, d < Dp. a[r, n] is read at a[r·ars + n·ans], so
// a transposed operand (dV += P^T dO, dK += dS^T Q) is read in place, without a transpose; x: [N, ldx];
// out: [rows, Dp]. Packed x rows use ldx = Dp + kPadFloats: with a power-of-two stride (2 KiB at D = 512) the 64
// rows of one column slice would map onto a few of L1's sets and evict each other. The d range is the outer loop,
// kAccVecs vectors at a time (64 floats on AVX-512, 16 on AVX2) with a shorter tail, so the slice of x it reads
// (N x 64 floats = 16 KiB for a key tile, or 4 KiB on AVX2) stays in L1 while every row block passes over it.
// ---------------------------------------------------------------------------------------------------------------
#if RF_ISA_AVX512 || RF_ISA_AVX2
template <int kDp, int R, int V>
inline void acc_block(const float* a, int ars, int ans, int N, const float* x, int ldx, int dp_rt, float* out) {
  const int Dp = kDp > 0 ? kDp : dp_rt;
  VecF acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = vload(out + r * Dp + v * kLanes);
  for (int n = 0; n < N; ++n) {
    VecF xv[V];
    for (int v = 0; v < V; ++v) xv[v] = vload(x + n * ldx + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const VecF ar = vset1(a[r * ars + n * ans]);
      for (int v = 0; v < V; ++v) acc[r][v] = vfmadd(ar, xv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) vstore(out + r * Dp + v * kLanes, acc[r][v]);
}

template <int kDp, int V>
inline void acc_cols(const float* a, int ars, int ans, int N, const float* x, int ldx, int Dp, int rows, float* out) {
  for_row_blocks(rows, [&]<int R>(int r) { acc_block<kDp, R, V>(a + r * ars, ars, ans, N, x, ldx, Dp, out + r * Dp); });
}
#endif

template <int kDp>
inline void acc(const float* a, int ars, int ans, int N, const float* x, int ldx, int dp_rt, int rows, float* out) {
  const int Dp = kDp > 0 ? kDp : dp_rt;
#if RF_ISA_AVX512 || RF_ISA_AVX2
  static_assert(kPadFloats % kLanes == 0, "Dp is whole vectors");
  constexpr int kWidth = kAccVecs * kLanes;
  for (int d = 0; d < Dp; d += kWidth) {
    switch (std::min(kWidth, Dp - d) / kLanes) {
      case 4:
        if constexpr (kAccVecs >= 4) acc_cols<kDp, 4>(a, ars, ans, N, x + d, ldx, Dp, rows, out + d);
        break;
      case 3:
        if constexpr (kAccVecs >= 3) acc_cols<kDp, 3>(a, ars, ans, N, x + d, ldx, Dp, rows, out + d);
        break;
      case 2:
        acc_cols<kDp, 2>(a, ars, ans, N, x + d, ldx, Dp, rows, out + d);
        break;
      case 1:  // only where one vector is the whole padding unit (AVX-512); AVX2 strips are always 2 vectors
        if constexpr (kLanes == kPadFloats) acc_cols<kDp, 1>(a, ars, ans, N, x + d, ldx, Dp, rows, out + d);
        break;
      default:
        break;
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

// ---------------------------------------------------------------------------------------------------------------
// acc on bf16 pairs (the Dpbf16 path): out[r, d] += sum over pairs m of a(r, m).lo · x[m, d].lo + a(r, m).hi ·
// x[m, d].hi, for r < rows, m < pairs, d < Dp. A word holds two bf16 (low half first), the pair (n, n + 1) = (2m,
// 2m + 1) of the sum index. a(r, m) is read at a[r·ars + m·ams], so the transposed weights of dV += P^T dO and
// dK += dS^T Q are packed in the layout their conversion writes fastest (tiles.h); x: [pairs, ldx] words (VNNI
// pairs of two rows of the summed operand); out: [rows, Dp] float32. The block shape and d-outer order are acc's:
// 6 rows x 4 vectors of 16 float32 accumulators, each vdpbf16ps summing two rows of x. Every output element
// takes its pair steps in the order m = 0, 1, ... whatever the block shape, which acc_masked_pairs relies on.
// ---------------------------------------------------------------------------------------------------------------
#if RF_ISA_AVX512
template <int kDp, int R, int V>
RF_BF16_TARGET inline void acc_block_bf16(const uint32_t* a, int ars, int ams, int pairs, const uint32_t* x, int ldx,
                                          int dp_rt, float* out) {
  const int Dp = kDp > 0 ? kDp : dp_rt;
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_loadu_ps(out + r * Dp + v * kLanes);
  for (int m = 0; m < pairs; ++m) {
    __m512bh xv[V];
    for (int v = 0; v < V; ++v) xv[v] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + m * ldx + v * kLanes));
    for (int r = 0; r < R; ++r) {
      const __m512bh ar = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(a[r * ars + m * ams])));
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], ar, xv[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(out + r * Dp + v * kLanes, acc[r][v]);
}

// Row blocks of one V-vector column strip (no lambda: a lambda would not inherit the target attribute).
template <int kDp, int V>
RF_BF16_TARGET inline void acc_cols_bf16(const uint32_t* a, int ars, int ams, int pairs, const uint32_t* x, int ldx,
                                         int Dp, int rows, float* out) {
  int r = 0;
  for (; r + kRowBlock <= rows; r += kRowBlock)
    acc_block_bf16<kDp, kRowBlock, V>(a + r * ars, ars, ams, pairs, x, ldx, Dp, out + r * Dp);
  const uint32_t* ar = a + r * ars;
  float* o = out + r * Dp;
  switch (rows - r) {
    case 5:
      acc_block_bf16<kDp, 5, V>(ar, ars, ams, pairs, x, ldx, Dp, o);
      break;
    case 4:
      acc_block_bf16<kDp, 4, V>(ar, ars, ams, pairs, x, ldx, Dp, o);
      break;
    case 3:
      acc_block_bf16<kDp, 3, V>(ar, ars, ams, pairs, x, ldx, Dp, o);
      break;
    case 2:
      acc_block_bf16<kDp, 2, V>(ar, ars, ams, pairs, x, ldx, Dp, o);
      break;
    case 1:
      acc_block_bf16<kDp, 1, V>(ar, ars, ams, pairs, x, ldx, Dp, o);
      break;
    default:
      break;
  }
}

template <int kDp>
RF_BF16_TARGET inline void acc_bf16(const uint32_t* a, int ars, int ams, int pairs, const uint32_t* x, int ldx,
                                    int dp_rt, int rows, float* out) {
  const int Dp = kDp > 0 ? kDp : dp_rt;
  constexpr int kWidth = kAccVecs * kLanes;
  for (int d = 0; d < Dp; d += kWidth) {
    switch (std::min(kWidth, Dp - d) / kLanes) {
      case 4:
        acc_cols_bf16<kDp, 4>(a, ars, ams, pairs, x + d, ldx, Dp, rows, out + d);
        break;
      case 3:
        acc_cols_bf16<kDp, 3>(a, ars, ams, pairs, x + d, ldx, Dp, rows, out + d);
        break;
      case 2:
        acc_cols_bf16<kDp, 2>(a, ars, ams, pairs, x + d, ldx, Dp, rows, out + d);
        break;
      case 1:
        acc_cols_bf16<kDp, 1>(a, ars, ams, pairs, x + d, ldx, Dp, rows, out + d);
        break;
      default:
        break;
    }
  }
}

// float32 -> bf16 with round to nearest even, 16 lanes (vcvtneps2bf16: NaN stays NaN, overflow rounds to inf;
// float32 denormals become zeros of their sign, as vdpbf16ps would read them anyway).
RF_BF16_TARGET inline __m256i to_bf16(__m512 x) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)); }

// Rows of float32 weights w: [rows, kTileCols] as acc_bf16's A operand in row layout: dst [rows, kTileCols / 2]
// words, word (r, m) = (w[r, 2m], w[r, 2m + 1]) — which is just w rounded to bf16 in place order.
RF_BF16_TARGET inline void weights_to_pair_rows(const float* w, int rows, uint32_t* dst) {
  for (int r = 0; r < rows; ++r)
    for (int v = 0; v < kTileCols / kLanes; ++v)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + r * (kTileCols / 2) + v * (kLanes / 2)),
                          to_bf16(_mm512_loadu_ps(w + r * kTileCols + v * kLanes)));
}

// The transpose for dV += P^T dO and dK += dS^T Q, whose rows are keys and sum runs over queries: w: [rows,
// kTileCols] (rows = queries) -> dst [ceil(rows / 2), kTileCols] words, word (m, j) = (w[2m, j], w[2m + 1, j]),
// read by acc_bf16 with ars = 1, ams = kTileCols. An odd last row pairs with zero.
RF_BF16_TARGET inline void weights_to_pair_cols(const float* w, int rows, uint32_t* dst) {
  for (int m = 0; 2 * m < rows; ++m) {
    const float* even = w + 2 * m * kTileCols;
    const bool has_odd = 2 * m + 1 < rows;
    for (int v = 0; v < kTileCols / kLanes; ++v) {
      // Zero-masked forms with an all-ones mask: see kAll (GCC 12's unmasked ones trip -Werror=uninitialized).
      const __m512i lo = _mm512_maskz_cvtepu16_epi32(kAll, to_bf16(_mm512_loadu_ps(even + v * kLanes)));
      const __m512i hi =
          has_odd ? _mm512_maskz_cvtepu16_epi32(kAll, to_bf16(_mm512_loadu_ps(even + kTileCols + v * kLanes)))
                  : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + m * kTileCols + v * kLanes, _mm512_or_si512(lo, _mm512_maskz_slli_epi32(kAll, hi, 16)));
    }
  }
}
#endif

}  // namespace rf::cpu::RF_ISA_NS::detail
RF_ISA_END
