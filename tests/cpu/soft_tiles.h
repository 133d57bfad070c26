// A software model of the AMX tile unit that src/cpu/amx_tiles.h is written against, so its tile plans run (and
// are checked) on CPUs without AMX. Eight tiles of 16 rows x 64 bytes, the configuration AmxTileScope loads;
// tdpbf16ps as Intel's pseudo-code states it: per row of C, per pair k along the sum, per column n,
// c += a.lo · b.lo, then c += a.hi · b.hi, in float32 (a bf16 product is exact in float32), bf16 denormals read as
// zero. The model also checks what the hardware would fault on or leave undefined: a tile read before anything
// was loaded into it, and C, A and B not three distinct tiles.
#pragma once

#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <cstring>

#include "cpu/amx.h"
#include "cpu/amx_tiles.h"

namespace rf::testing {

class SoftTiles {
 public:
  static constexpr int kTiles = 8, kRows = 16, kRowBytes = 64, kWords = kRowBytes / 4;

  template <int kTile>
  void load(const void* base, int stride) {
    static_assert(kTile >= 0 && kTile < kTiles);
    for (int r = 0; r < kRows; ++r)
      std::memcpy(tiles_[kTile][r].data(), static_cast<const char*>(base) + int64_t{r} * stride, kRowBytes);
    defined_[kTile] = true;
  }
  template <int kTile>
  void store(void* base, int stride) {
    static_assert(kTile >= 0 && kTile < kTiles);
    EXPECT_TRUE(defined_[kTile]) << "tile " << kTile << " stored before it held anything";
    for (int r = 0; r < kRows; ++r)
      std::memcpy(static_cast<char*>(base) + int64_t{r} * stride, tiles_[kTile][r].data(), kRowBytes);
  }
  template <int kTile>
  void zero() {
    static_assert(kTile >= 0 && kTile < kTiles);
    tiles_[kTile] = {};
    defined_[kTile] = true;
  }
  template <int kC, int kA, int kB>
  void dot() {
    static_assert(kC != kA && kC != kB && kA != kB, "tdpbf16ps raises #UD unless C, A and B are distinct tiles");
    EXPECT_TRUE(defined_[kC] && defined_[kA] && defined_[kB]) << "tdpbf16ps read a tile that was never loaded";
    // The operands widened once (the same values the pseudo-code widens per use), so the whole-kernel runs on the
    // model (kSoftAmx below) stay affordable; the order of the float32 additions is the pseudo-code's.
    float b_lo[kWords][kWords], b_hi[kWords][kWords];
    for (int k = 0; k < kWords; ++k)
      for (int n = 0; n < kWords; ++n) {
        b_lo[k][n] = widen(tiles_[kB][k][n] & 0xffffu);
        b_hi[k][n] = widen(tiles_[kB][k][n] >> 16);
      }
    for (int m = 0; m < kRows; ++m) {
      float c[kWords];
      std::memcpy(c, tiles_[kC][m].data(), sizeof c);
      for (int k = 0; k < kWords; ++k) {
        const float a_lo = widen(tiles_[kA][m][k] & 0xffffu), a_hi = widen(tiles_[kA][m][k] >> 16);
        for (int n = 0; n < kWords; ++n) {
          c[n] += a_lo * b_lo[k][n];
          c[n] += a_hi * b_hi[k][n];
        }
      }
      std::memcpy(tiles_[kC][m].data(), c, sizeof c);
    }
  }

 private:
  static float as_float(uint32_t w) {
    float f;
    std::memcpy(&f, &w, sizeof f);
    return f;
  }
  // A bf16 as float32, a denormal (zero exponent) read as a zero of its sign.
  static float widen(uint32_t bf16) {
    constexpr uint32_t kExponent = 0x7f80u, kSign = 0x8000u;
    return as_float(((bf16 & kExponent) == 0 ? bf16 & kSign : bf16) << 16);
  }

  std::array<std::array<std::array<uint32_t, kWords>, kRows>, kTiles> tiles_{};
  std::array<bool, kTiles> defined_{};
};

// amx.h's AmxTileModel on SoftTiles: with it installed the AMX kernels run end to end on any CPU with AVX512_BF16
// (kernel_path_test.h installs it for the kernel tests' `.amx-model` runs). Each call gets a fresh unit, so a tile
// plan that relied on tiles left over from an earlier call would read undefined tiles and fail.
inline void soft_amx_abt(const uint32_t* a, int lda, const uint32_t* bt, int Dp, int rows, float* c) {
  SoftTiles tiles;
  cpu::detail::amx_abt_rows(tiles, a, lda, bt, Dp, rows, c);
}
inline void soft_amx_acc(const uint32_t* a, int lda, int pairs, const uint32_t* x, int ldx, int Dp, int rows,
                         float* out) {
  SoftTiles tiles;
  cpu::detail::amx_acc_rows(tiles, a, lda, pairs, x, ldx, Dp, rows, out);
}
inline constexpr cpu::detail::AmxTileModel kSoftAmx{soft_amx_abt, soft_amx_acc};

}  // namespace rf::testing
