// ringflex cpu: AMX tile configuration and the hardware tile unit that runs amx_tiles.h's tile plans (amx.h has the
// layouts, isa.cpp the detection). tdpbf16ps multiplies bf16 pairs exactly and accumulates in float32 (denormal
// inputs are treated as zero, as with vdpbf16ps).
#include "cpu/amx.h"

#include <atomic>

#include "core/error.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define RF_AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16")))

#include "cpu/amx_tiles.h"
#endif

namespace rf::cpu::detail {

namespace {

#if defined(__x86_64__)
constexpr int kTileBytes = 64;  // bytes of one tile row (16 floats, 32 bf16)

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

std::atomic<const AmxTileModel*> installed_model{nullptr};

}  // namespace

void install_amx_tile_model(const AmxTileModel* model) { installed_model.store(model); }

const AmxTileModel* amx_tile_model() { return installed_model.load(std::memory_order_relaxed); }

AmxTileScope::AmxTileScope(bool active) : active_(active && amx_tile_model() == nullptr) {
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
  if (const AmxTileModel* model = amx_tile_model()) return model->abt(a, lda, bt, Dp, rows, c);
  HwTiles tiles;
  amx_abt_rows(tiles, a, lda, bt, Dp, rows, c);
}

RF_AMX_TARGET void amx_acc(const uint32_t* a, int lda, int pairs, const uint32_t* x, int ldx, int Dp, int rows,
                           float* out) {
  RF_ASSERT(pairs % kAmxPairs == 0 && pairs > 0 && pairs <= kAmxAccMaxPairs && Dp % (2 * kAmxPairs) == 0);
  if (const AmxTileModel* model = amx_tile_model()) return model->acc(a, lda, pairs, x, ldx, Dp, rows, out);
  HwTiles tiles;
  amx_acc_rows(tiles, a, lda, pairs, x, ldx, Dp, rows, out);
}
#else
void amx_abt(const uint32_t* a, int lda, const uint32_t* bt, int Dp, int rows, float* c) {
  if (const AmxTileModel* model = amx_tile_model()) model->abt(a, lda, bt, Dp, rows, c);
}
void amx_acc(const uint32_t* a, int lda, int pairs, const uint32_t* x, int ldx, int Dp, int rows, float* out) {
  if (const AmxTileModel* model = amx_tile_model()) model->acc(a, lda, pairs, x, ldx, Dp, rows, out);
}
#endif

}  // namespace rf::cpu::detail
