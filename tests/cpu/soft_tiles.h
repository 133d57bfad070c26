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
    for (int m = 0; m < kRows; ++m)
      for (int k = 0; k < kWords; ++k)
        for (int n = 0; n < kWords; ++n) {
          float c = as_float(tiles_[kC][m][n]);
          const uint32_t a = tiles_[kA][m][k], b = tiles_[kB][k][n];
          c += widen(a & 0xffffu) * widen(b & 0xffffu);
          c += widen(a >> 16) * widen(b >> 16);
          std::memcpy(&tiles_[kC][m][n], &c, sizeof c);
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

}  // namespace rf::testing
