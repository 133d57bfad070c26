// The AMX tile plans (src/cpu/amx_tiles.h: amx_acc_rows and amx_abt_rows) on the software tile model, on every
// CPU, and the accumulating product on the hardware where CPUID offers AMX (test_attention.cpp has the score
// product's hardware test). The kernel sweep (test_attention.cpp) runs the whole bf16 kernels on the AMX path
// wherever it is active, and on this model in its `.amx-model` runs; this file pins the tile plans themselves:
// layouts, strides, the 16-row blocks and the bounce tiles of a last partial block, for every shape the kernels
// use and the awkward ones around them.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "cpu/amx.h"
#include "cpu/amx_tiles.h"
#include "cpu/isa.h"
#include "soft_tiles.h"

namespace rf::testing {
namespace {

struct AccCase {
  int rows, pairs, Dp, lda;
};

std::vector<AccCase> acc_cases() {
  std::vector<AccCase> cases;
  for (int rows : {1, 5, 16, 17, 40, 64})
    for (int pairs : {16, 32})
      for (int Dp : {32, 96, 512})
        for (int lda_extra : {0, 3}) cases.push_back({rows, pairs, Dp, pairs + lda_extra});
  return cases;
}

uint32_t bf16_word(float x) { return uint32_t{float_to_bf16(x).bits}; }

// Operands sized exactly as the call may touch them (the sanitizer build catches a read or write past them):
// a: [rows, lda] words, x: [pairs, ldx] words, out: [rows, Dp] float32.
struct AccOperands {
  std::vector<uint32_t> a, x;
  std::vector<float> out;
  int ldx;
};

// Small integers: every bf16 value, product and float32 sum below is exact (|sums| < 2^24), so the result must
// equal the integer sum exactly and any layout slip shows as a mismatch, whatever order the tiles add in.
AccOperands integer_operands(const AccCase& c) {
  AccOperands o{.a = std::vector<uint32_t>(static_cast<size_t>(c.rows) * c.lda, 0xdeadbeefu),
                .x = {},
                .out = std::vector<float>(static_cast<size_t>(c.rows) * c.Dp),
                .ldx = c.Dp + 16};
  o.x.assign(static_cast<size_t>(c.pairs) * o.ldx, 0xdeadbeefu);  // columns Dp..ldx are never read
  for (int r = 0; r < c.rows; ++r)
    for (int m = 0; m < c.pairs; ++m)
      o.a[static_cast<size_t>(r) * c.lda + m] = bf16_word(static_cast<float>((r * 7 + m * 3) % 9 - 4)) |
                                                bf16_word(static_cast<float>((r * 5 + m) % 7 - 3)) << 16;
  for (int m = 0; m < c.pairs; ++m)
    for (int d = 0; d < c.Dp; ++d)
      o.x[static_cast<size_t>(m) * o.ldx + d] = bf16_word(static_cast<float>((m * 11 + d * 3) % 13 - 6)) |
                                                bf16_word(static_cast<float>((m + d * 5) % 5 - 2)) << 16;
  for (int r = 0; r < c.rows; ++r)
    for (int d = 0; d < c.Dp; ++d) o.out[static_cast<size_t>(r) * c.Dp + d] = static_cast<float>((r + d) % 17 - 8);
  return o;
}

float lo(uint32_t w) { return bf16_to_float(bf16{static_cast<uint16_t>(w & 0xffffu)}); }
float hi(uint32_t w) { return bf16_to_float(bf16{static_cast<uint16_t>(w >> 16)}); }

// out0 + sum over pairs, in int64 (exact for the integer operands).
void expect_exact(const AccCase& c, const AccOperands& before, const std::vector<float>& got) {
  for (int r = 0; r < c.rows; ++r)
    for (int d = 0; d < c.Dp; ++d) {
      double want = before.out[static_cast<size_t>(r) * c.Dp + d];
      for (int m = 0; m < c.pairs; ++m) {
        const uint32_t a = before.a[static_cast<size_t>(r) * c.lda + m],
                       x = before.x[static_cast<size_t>(m) * before.ldx + d];
        want += static_cast<double>(lo(a)) * lo(x) + static_cast<double>(hi(a)) * hi(x);
      }
      ASSERT_EQ(got[static_cast<size_t>(r) * c.Dp + d], static_cast<float>(want))
          << "rows " << c.rows << " pairs " << c.pairs << " Dp " << c.Dp << " lda " << c.lda << ": row " << r
          << " column " << d;
    }
}

TEST(AmxTiles, AccumulatingProductIsExactOnTheTileModel) {
  for (const AccCase& c : acc_cases()) {
    const AccOperands o = integer_operands(c);
    std::vector<float> out = o.out;
    SoftTiles tiles;
    cpu::detail::amx_acc_rows(tiles, o.a.data(), c.lda, c.pairs, o.x.data(), o.ldx, c.Dp, c.rows, out.data());
    expect_exact(c, o, out);
  }
}

// The kernels' mixed-tile path (src/cpu/tiles.h: acc_masked_pairs) runs one row at a time through the bounce
// tiles and relies on each row coming out with the bits the whole-block call gives it. Random non-integer values,
// so the float32 sums round and a different order of additions would show.
TEST(AmxTiles, OneRowAtATimeKeepsTheWholeBlocksBits) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  for (const AccCase& c : acc_cases()) {
    AccOperands o = integer_operands(c);
    for (uint32_t& w : o.a) w = bf16_word(normal(rng)) | bf16_word(normal(rng)) << 16;
    for (uint32_t& w : o.x) w = bf16_word(normal(rng)) | bf16_word(normal(rng)) << 16;
    for (float& v : o.out) v = normal(rng);
    std::vector<float> whole = o.out, by_row = o.out;
    SoftTiles tiles;
    cpu::detail::amx_acc_rows(tiles, o.a.data(), c.lda, c.pairs, o.x.data(), o.ldx, c.Dp, c.rows, whole.data());
    for (int r = 0; r < c.rows; ++r)
      cpu::detail::amx_acc_rows(tiles, o.a.data() + static_cast<size_t>(r) * c.lda, c.lda, c.pairs, o.x.data(), o.ldx,
                                c.Dp, 1, by_row.data() + static_cast<size_t>(r) * c.Dp);
    ASSERT_EQ(std::memcmp(whole.data(), by_row.data(), whole.size() * sizeof(float)), 0)
        << "rows " << c.rows << " pairs " << c.pairs << " Dp " << c.Dp << " lda " << c.lda;
  }
}

// The score product (amx_abt_rows) on the tile model: small integers, exact sums (as AmxScoreTileIsExact in
// test_attention.cpp checks the hardware), 20 rows so the second 16-row block is partial (amx_abt computes whole
// blocks: a and c hold 32 rows), Dp 64 and 512 (2 and 16 pair tiles along d).
TEST(AmxTiles, ScoreProductIsExactOnTheTileModel) {
  constexpr int kRows = 20, kPadRows = 32, kKeys = cpu::detail::kAmxKeyCols;
  auto a_val = [](int r, int d) { return static_cast<float>((r * 3 + d) % 11 - 5); };
  auto b_val = [](int d, int j) { return static_cast<float>((d * 5 + j * 7) % 13 - 6); };
  for (int Dp : {64, 512}) {
    std::vector<uint32_t> a(static_cast<size_t>(kPadRows) * Dp / 2, 0), bt(static_cast<size_t>(Dp) / 2 * kKeys);
    for (int r = 0; r < kRows; ++r)
      for (int p = 0; p < Dp / 2; ++p)
        a[static_cast<size_t>(r) * Dp / 2 + p] = bf16_word(a_val(r, 2 * p)) | bf16_word(a_val(r, 2 * p + 1)) << 16;
    for (int p = 0; p < Dp / 2; ++p)
      for (int j = 0; j < kKeys; ++j)
        bt[static_cast<size_t>(p) * kKeys + j] = bf16_word(b_val(2 * p, j)) | bf16_word(b_val(2 * p + 1, j)) << 16;
    std::vector<float> c(static_cast<size_t>(kPadRows) * kKeys);
    SoftTiles tiles;
    cpu::detail::amx_abt_rows(tiles, a.data(), Dp / 2, bt.data(), Dp, kRows, c.data());
    for (int r = 0; r < kRows; ++r)
      for (int j = 0; j < kKeys; ++j) {
        int64_t want = 0;
        for (int d = 0; d < Dp; ++d) want += static_cast<int64_t>(a_val(r, d)) * static_cast<int64_t>(b_val(d, j));
        ASSERT_EQ(c[static_cast<size_t>(r) * kKeys + j], static_cast<float>(want))
            << "Dp " << Dp << " row " << r << " key " << j;
      }
  }
}

// The same exact sums on the hardware tiles (amx_acc: the instructions the model stands for).
TEST(AmxTiles, AccumulatingProductIsExactOnTheHardware) {
  if (!cpu::detect_cpu().amx)
    GTEST_SKIP() << "this CPU lacks AMX (AMX-TILE/AMX-BF16), or Linux refused the tile state; the tile model above "
                    "ran the same tile plan";
  const cpu::detail::AmxTileScope scope(true);
  for (const AccCase& c : acc_cases()) {
    const AccOperands o = integer_operands(c);
    std::vector<float> out = o.out;
    cpu::detail::amx_acc(o.a.data(), c.lda, c.pairs, o.x.data(), o.ldx, c.Dp, c.rows, out.data());
    expect_exact(c, o, out);
  }
}

}  // namespace
}  // namespace rf::testing
