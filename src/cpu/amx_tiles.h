// ringflex cpu: the AMX tile plans (the score product and the accumulating one), written once against a tile unit
// so that they run on the hardware (amx.cpp, HwTiles) and on a software model of the tiles (tests/cpu/soft_tiles.h)
// from the same source. No CPU this project is developed on has AMX on every day; the model lets the addressing,
// the tail handling and the tile plans be tested everywhere, while the kernel tests check the hardware where CPUID
// reports it.
//
// A tile unit T offers, with tile numbers as template arguments (the instructions encode them):
//   t.template zero<c>()                  tilezero
//   t.template load<i>(base, stride)      tileloadd: 16 rows of 64 bytes, `stride` bytes apart
//   t.template store<i>(base, stride)     tilestored
//   t.template dot<c, a, b>()             tdpbf16ps: C[16 x 16 float32] += A[16 rows x 16 bf16 pairs] · B[16 pairs x
//                                         16 columns, each word a pair], both products of a pair summed in float32
// configured as AmxTileScope does (amx.cpp): palette 1, tiles 0-7 all 16 rows x 64 bytes.
//
// Internal to src/cpu: include only where T's instructions may be compiled (amx.cpp's AMX target, or a test).
#pragma once

#include <algorithm>
#include <cstdint>
#include <iterator>

#include "cpu/amx.h"

namespace rf::cpu::detail {

// 64-byte tile rows: 16 float32 of C, 16 bf16 pairs of A, 16 pair columns of B.
constexpr int kAmxTileWords = kAmxPairs;
// Keys of one score tile (kTileK), and bytes between rows of the score product's bt and c.
constexpr int kAmxKeyCols = 4 * kAmxTileWords;
constexpr int kAmxKeyStride = kAmxKeyCols * 4;

// The score product amx_abt (amx.h has the layouts). Tile plan for one 16-row block of C = A · B over a 64-key
// tile: tiles 0-3 hold C's four 16 x 16 float32 column blocks (keys 0-15, 16-31, 32-47, 48-63); tile 4 holds 16
// rows x 32 bf16 of A; tiles 5-7 take turns holding a 16-pair x 16-key B block, so a B load does not wait on the
// tdpbf16ps still reading the previous one. Each A tile is loaded once and used against the four B blocks.
template <class T>
void amx_abt_rows(T& t, const uint32_t* a, int lda, const uint32_t* bt, int Dp, int rows, float* c) {
  const int pairs = Dp / 2;
  const int a_stride = lda * 4;
  for (int r0 = 0; r0 < rows; r0 += kAmxRows) {
    t.template zero<0>();
    t.template zero<1>();
    t.template zero<2>();
    t.template zero<3>();
    for (int p0 = 0; p0 < pairs; p0 += kAmxPairs) {
      const uint32_t* b = bt + p0 * kAmxKeyCols;
      t.template load<4>(a + int64_t{r0} * lda + p0, a_stride);
      t.template load<5>(b, kAmxKeyStride);
      t.template dot<0, 4, 5>();
      t.template load<6>(b + kAmxTileWords, kAmxKeyStride);
      t.template dot<1, 4, 6>();
      t.template load<7>(b + 2 * kAmxTileWords, kAmxKeyStride);
      t.template dot<2, 4, 7>();
      t.template load<5>(b + 3 * kAmxTileWords, kAmxKeyStride);
      t.template dot<3, 4, 5>();
    }
    float* out = c + int64_t{r0} * kAmxKeyCols;
    t.template store<0>(out, kAmxKeyStride);
    t.template store<1>(out + kAmxTileWords, kAmxKeyStride);
    t.template store<2>(out + 2 * kAmxTileWords, kAmxKeyStride);
    t.template store<3>(out + 3 * kAmxTileWords, kAmxKeyStride);
  }
}

// out[r, d] += sum over m < pairs of a(r, m).lo · x[m, d].lo + a(r, m).hi · x[m, d].hi, for r < rows, d < Dp,
// on tiles: the accumulating products of the attention kernels (O += P V, dQ += dS K, dV += Pᵀ dO, dK += dSᵀ Q).
// a: [rows, lda] words, a(r, m) = a[r · lda + m], each a pair of bf16 weights along the sum (low half first).
// x: [pairs, ldx] words, word (m, d) = the pair (x[2m, d], x[2m + 1, d]): exactly tdpbf16ps's B layout.
// out: [rows, Dp] float32, row-major. Requires pairs a multiple of kAmxTileWords and at most kAmxAccMaxPairs, Dp
// a multiple of 2 · kAmxTileWords. Reads and writes only rows [0, rows) of a and out (a last block of fewer than
// 16 rows goes through zeroed bounce tiles), so any row count, a single row included, is safe.
//
// Tile plan, per block of 16 rows: tiles 4 and 5 hold the block's weights (one per 16 pairs), loaded once; then
// for each 32 columns of out, tiles 0 and 1 hold the two 16 x 16 float32 blocks of out, and tiles 2, 3 (first 16
// pairs) and 6, 7 (next 16) the matching blocks of x, so each B load has its own tile and need not wait for the
// tdpbf16ps still reading the previous one.
template <class T>
void amx_acc_rows(T& t, const uint32_t* a, int lda, int pairs, const uint32_t* x, int ldx, int Dp, int rows,
                  float* out) {
  constexpr int kColsPerStep = 2 * kAmxTileWords;  // out columns per step: C tiles 0 and 1
  const bool second_half = pairs > kAmxTileWords;
  const int x_stride = ldx * 4, x_half = kAmxTileWords * ldx;
  // Bounce tiles for a last block of fewer than 16 rows: weights [16, kAmxAccMaxPairs] words, out [16, 32] floats.
  alignas(64) uint32_t a_tail[kAmxRows * kAmxAccMaxPairs];
  alignas(64) float c_tail[kAmxRows * kColsPerStep];

  for (int r0 = 0; r0 < rows; r0 += kAmxRows) {
    const int n = std::min(kAmxRows, rows - r0);
    const bool tail = n < kAmxRows;
    const uint32_t* a_block = a + int64_t{r0} * lda;
    int a_stride = lda * 4;
    if (tail) {
      std::fill(std::begin(a_tail), std::end(a_tail), 0u);
      for (int r = 0; r < n; ++r) std::copy_n(a_block + int64_t{r} * lda, pairs, a_tail + r * kAmxAccMaxPairs);
      a_block = a_tail;
      a_stride = kAmxAccMaxPairs * 4;
    }
    t.template load<4>(a_block, a_stride);
    if (second_half) t.template load<5>(a_block + kAmxTileWords, a_stride);

    for (int c0 = 0; c0 < Dp; c0 += kColsPerStep) {
      float* c_block = out + int64_t{r0} * Dp + c0;
      int c_stride = Dp * 4;
      if (tail) {
        std::fill(std::begin(c_tail), std::end(c_tail), 0.f);
        for (int r = 0; r < n; ++r) std::copy_n(c_block + int64_t{r} * Dp, kColsPerStep, c_tail + r * kColsPerStep);
        c_block = c_tail;
        c_stride = kColsPerStep * 4;
      }
      t.template load<0>(c_block, c_stride);
      t.template load<1>(c_block + kAmxTileWords, c_stride);
      const uint32_t* xb = x + c0;
      t.template load<2>(xb, x_stride);
      t.template dot<0, 4, 2>();
      t.template load<3>(xb + kAmxTileWords, x_stride);
      t.template dot<1, 4, 3>();
      if (second_half) {
        t.template load<6>(xb + x_half, x_stride);
        t.template dot<0, 5, 6>();
        t.template load<7>(xb + x_half + kAmxTileWords, x_stride);
        t.template dot<1, 5, 7>();
      }
      t.template store<0>(c_block, c_stride);
      t.template store<1>(c_block + kAmxTileWords, c_stride);
      if (tail)
        for (int r = 0; r < n; ++r)
          std::copy_n(c_tail + r * kColsPerStep, kColsPerStep, out + int64_t{r0 + r} * Dp + c0);
    }
  }
}

}  // namespace rf::cpu::detail
