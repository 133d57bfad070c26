// ringflex cpu: AMX tile configuration, the bf16 score product, and the hardware tile unit that runs amx_tiles.h's
// accumulating product (see amx.h for layouts; detection: isa.cpp).
//
// The score product's tile plan for one 16-row block of C = A · B over a 64-key tile: tiles 0-3 hold C's four
// 16 x 16 float32 column blocks (keys 0-15, 16-31, 32-47, 48-63); tile 4 holds 16 rows x 32 bf16 of A; tiles 5-7
// take turns holding a 16-pair x 16-key B block, so a B load does not wait on the tdpbf16ps still reading the
// previous one. Each A tile is loaded once and used against the four B blocks. tdpbf16ps multiplies bf16 pairs
// exactly and accumulates in float32 (denormal inputs are treated as zero, as with vdpbf16ps).
#include "cpu/amx.h"

#include "core/error.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define RF_AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16")))

#include "cpu/amx_tiles.h"
#endif

namespace rf::cpu::detail {

namespace {

#if defined(__x86_64__)
constexpr int kTileBytes = 64;                           // bytes of one tile row (16 floats, 32 bf16)
constexpr int kKeyCols = 64;                             // keys per tile (kTileK)
constexpr int kKeyStride = kKeyCols * sizeof(uint32_t);  // bytes between bt rows and c rows
constexpr int kColBlock = kTileBytes / sizeof(float);    // keys per C / B tile

// The 64-byte LDTILECFG operand, palette 1.
struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static_assert(sizeof(TileConfig) == 64);

constexpr TileConfig make_config() {
  TileConfig cfg{};
  cfg.palette = 1;
  constexpr int kUsedTiles = 8;  // C 0-3, A 4, B 5-7
  for (int t = 0; t < kUsedTiles; ++t) {
    cfg.rows[t] = kAmxRows;
    cfg.colsb[t] = kTileBytes;
  }
  return cfg;
}

// A constant in static storage, not a stack object: GCC 12 does not treat _tile_loadconfig as reading all 64
// bytes of its operand and dropped the stores of a local configuration (the loaded one then faulted).
constexpr TileConfig kTileConfig = make_config();

RF_AMX_TARGET void load_config() { _tile_loadconfig(&kTileConfig); }

RF_AMX_TARGET void release() { _tile_release(); }

// The tile unit of amx_tiles.h on the hardware, as the instructions themselves: GCC's tile intrinsics stringize
// their tile argument into the register name, so they take only literal numbers, not a template parameter; here
// the "n" operand printed with %c gives the same register names. The "memory" clobbers keep program order between
// plain stores and the tile loads that read them (a bounce tile is otherwise dead to the compiler), and between
// tile stores and the plain loads after them. AT&T operand order: tdpbf16ps B, A, C.
struct HwTiles {
  template <int kTile>
  void load(const void* base, int stride) {
    asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(base), "r"(static_cast<long>(stride)), "n"(kTile) : "memory");
  }
  template <int kTile>
  void store(void* base, int stride) {
    asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(base), "r"(static_cast<long>(stride)), "n"(kTile) : "memory");
  }
  template <int kTile>
  void zero() {
    asm volatile("tilezero %%tmm%c0" ::"n"(kTile));
  }
  template <int kC, int kA, int kB>
  void dot() {
    asm volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"n"(kC), "n"(kA), "n"(kB));
  }
};
#endif

}  // namespace

AmxTileScope::AmxTileScope(bool active) : active_(active) {
#if defined(__x86_64__)
  if (active_) load_config();
#endif
}

AmxTileScope::~AmxTileScope() {
#if defined(__x86_64__)
  if (active_) release();
#endif
}

#if defined(__x86_64__)
RF_AMX_TARGET void amx_abt(const uint32_t* a, int lda, const uint32_t* bt, int Dp, int rows, float* c) {
  const int pairs = Dp / 2;
  const int a_stride = lda * static_cast<int>(sizeof(uint32_t));
  for (int r0 = 0; r0 < rows; r0 += kAmxRows) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int p0 = 0; p0 < pairs; p0 += kAmxPairs) {
      const uint32_t* b = bt + p0 * kKeyCols;
      _tile_loadd(4, a + r0 * lda + p0, a_stride);
      _tile_loadd(5, b, kKeyStride);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, b + kColBlock, kKeyStride);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(7, b + 2 * kColBlock, kKeyStride);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, b + 3 * kColBlock, kKeyStride);
      _tile_dpbf16ps(3, 4, 5);
    }
    float* out = c + r0 * kKeyCols;
    _tile_stored(0, out, kKeyStride);
    _tile_stored(1, out + kColBlock, kKeyStride);
    _tile_stored(2, out + 2 * kColBlock, kKeyStride);
    _tile_stored(3, out + 3 * kColBlock, kKeyStride);
  }
}

RF_AMX_TARGET void amx_acc(const uint32_t* a, int lda, int pairs, const uint32_t* x, int ldx, int Dp, int rows,
                           float* out) {
  RF_ASSERT(pairs % kAmxPairs == 0 && pairs > 0 && pairs <= kAmxAccMaxPairs && Dp % (2 * kAmxPairs) == 0);
  HwTiles tiles;
  amx_acc_rows(tiles, a, lda, pairs, x, ldx, Dp, rows, out);
}
#else
void amx_abt(const uint32_t*, int, const uint32_t*, int, int, float*) {}
void amx_acc(const uint32_t*, int, int, const uint32_t*, int, int, int, float*) {}
#endif

}  // namespace rf::cpu::detail
