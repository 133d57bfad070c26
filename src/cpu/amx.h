// ringflex cpu: the Intel AMX (AMX-TILE + AMX-BF16) products for bfloat16 inputs: the score product (Q Kᵀ, dO Vᵀ)
// and the accumulating one (O += P V and the gradients), whose tile plan lives in amx_tiles.h.
//
// Internal to src/cpu. Everything that executes AMX instructions lives in amx.cpp behind function-level target
// attributes, so the library builds for any x86-64 and never runs them unless isa.h chose the AMX path (CPUID
// reports AMX-TILE + AMX-BF16, Linux granted the tile data state, RINGFLEX_ISA does not force another path).
#pragma once

#include <cstdint>

namespace rf::cpu::detail {

// Loads this thread's tile configuration for amx_abt on construction and releases the tiles on destruction.
// A no-op when `active` is false. One per OpenMP thread, around the loop that calls amx_abt.
class AmxTileScope {
 public:
  explicit AmxTileScope(bool active);
  ~AmxTileScope();
  AmxTileScope(const AmxTileScope&) = delete;
  AmxTileScope& operator=(const AmxTileScope&) = delete;

 private:
  bool active_;
};

// Rows of one AMX A/C tile and bf16 pairs along the reduction in one A row (64 bytes).
constexpr int kAmxRows = 16;
constexpr int kAmxPairs = 16;
// Most pairs along the sum of one amx_acc call: two A tiles, the 64 keys (or queries) of one attention tile.
constexpr int kAmxAccMaxPairs = 2 * kAmxPairs;

// c[r, j] = sum_d a[r, d] · bt[d, j] in float32, for r < round_up(rows, kAmxRows) and j < 64 (one key tile).
// a: [round_up(rows, 16), Dp] bf16, row-major, stored as Dp/2 uint32 words per row (the pair (d, d+1) in one
//    word, low half = d), row stride lda words; rows past `rows` are read and give garbage rows in c.
// bt: [Dp/2, 64] words, "VNNI" layout: word (p, j) holds the pair (d = 2p, 2p + 1) of key j — the transposed
//    key tile with pairs of bf16 along d interleaved, exactly the B operand of tdpbf16ps (16 pair rows x 16 keys
//    per tile). Dp must be a multiple of 32 (whole A tiles along d; the padding is zero).
// c: [round_up(rows, 16), 64] float32. Requires an active AmxTileScope on the calling thread.
void amx_abt(const uint32_t* a, int lda, const uint32_t* bt, int Dp, int rows, float* c);

// out[r, d] += sum over m < pairs of a(r, m).lo · x[m, d].lo + a(r, m).hi · x[m, d].hi, r < rows, d < Dp, in
// float32 on tiles (amx_tiles.h: amx_acc_rows has the layouts and the tile plan).
// a: [rows, lda] words of bf16 weight pairs along the sum; x: [pairs, ldx] words, word (m, d) = (x[2m, d],
// x[2m + 1, d]); out: [rows, Dp] float32. pairs: 16 or 32; Dp: a multiple of 32. Touches only rows < rows of a and
// out. Requires an active AmxTileScope on the calling thread.
void amx_acc(const uint32_t* a, int lda, int pairs, const uint32_t* x, int ldx, int Dp, int rows, float* out);

// A software stand-in for the tile unit: amx_abt and amx_acc run by other means, for the tests of CPUs without AMX
// (tests/cpu/soft_tiles.h runs amx_tiles.h's tile plans on a model of the tiles). While one is installed, amx_abt
// and amx_acc call it, AmxTileScope loads no tile state, and kernel_path() (isa.h) reports the AMX path, so every
// bf16 kernel call runs the AMX kernels end to end, everything around the tiles included, on any CPU with
// AVX512_BF16 (the AMX kernels round P and dS with vcvtneps2bf16). Install it before kernels run and remove it
// (nullptr) after; changing it while a kernel runs is a race. The library itself never installs one.
struct AmxTileModel {
  decltype(&amx_abt) abt;
  decltype(&amx_acc) acc;
};
void install_amx_tile_model(const AmxTileModel* model);
const AmxTileModel* amx_tile_model();  // the installed one, or nullptr (the hardware)

}  // namespace rf::cpu::detail
