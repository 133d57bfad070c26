// ringflex cpu: which instruction set the attention kernels run on, and which units the bf16 kernels multiply
// on, decided once per process at run time.
//
// The library is compiled for the x86-64 baseline; the kernels are compiled once per ISA (kernels.h) and this
// file chooses among them from CPUID, the operating system's saved-state support (XGETBV), where CPUID cannot tell
// a one-time micro-benchmark of the score tile, and the environment variable RINGFLEX_ISA. The choice is the only
// run-time ISA decision in the library (dispatch.h applies it).
#pragma once

#include <functional>
#include <string>

namespace rf::cpu {

// Kernel instruction sets, best last. Avx512 needs AVX-512 F/DQ/BW/VL (Skylake-SP, Ice Lake, Sapphire Rapids,
// Zen 4 and later); Avx2 needs AVX2 + FMA (Haswell, Zen 1 and later); Scalar runs on any CPU.
enum class Isa { Scalar, Avx2, Avx512 };

// Which units the bf16 kernels multiply on (float32 inputs always use float32 FMAs). Only the AVX-512 kernels
// have Dpbf16 and Amx; the other ISAs always widen.
enum class Bf16Product {
  // bf16 widened to float32 while packing, every product on float32 FMAs: exact products, float32 sums.
  Widen,
  // Every product on vdpbf16ps (AVX512_BF16: two bf16 products per float32 lane, float32 accumulation). The
  // score products (Q K^T, dO V^T) read the bf16 inputs as they are (exact products); the accumulating ones
  // (O += P V, dV += P^T dO, dK += dS^T Q, dQ += dS K) round the float32 P and dS to bf16 first, a relative error
  // of at most 2^-8 per weight (docs/numerics.md; tests/cpu/attention_check.h holds the bound).
  Dpbf16,
  // Every product on Intel AMX tiles (tdpbf16ps: exact bf16 pair products summed in float32), with P and dS
  // rounded to bf16 as on Dpbf16 (amx.h, amx_tiles.h). Not vdpbf16ps: on the AMX CPUs measured it runs at about
  // half the float32 FMAs' rate (BENCHMARKS.md). AVX-512 kernels only.
  Amx,
};

// Whether bf16 inputs on this product path have their float32 attention weights P and dS rounded to bf16 before
// the accumulating products (Dpbf16 and Amx): the error terms the tests and the demo's bounds add for it.
constexpr bool rounds_bf16_weights(Bf16Product bf16) { return bf16 != Bf16Product::Widen; }

// What this CPU and operating system offer the kernels.
struct CpuFeatures {
  bool avx2 = false;         // AVX2 + FMA, with the OS saving ymm state
  bool avx512 = false;       // AVX-512 F/DQ/BW/VL, with the OS saving zmm and opmask state
  bool avx512_bf16 = false;  // AVX512_BF16 (vdpbf16ps), with AVX-512
  bool amx = false;          // AMX-TILE + AMX-BF16 with AVX512_BF16, and Linux granted the tile data state
  bool amd = false;          // vendor AuthenticAMD: Zen 4 and later run vdpbf16ps at the FMAs' instruction rate
  std::string cpu_name;      // CPUID brand string, for `ringflex info`
};

struct KernelPath {
  Isa isa = Isa::Scalar;
  Bf16Product bf16 = Bf16Product::Widen;
  std::string reason;  // why, in one line: "best this CPU supports", the race's result, or "forced by ..."
};

// Reads CPUID and XGETBV (and asks Linux for the AMX tile state when CPUID reports AMX). Cheap; not cached.
CpuFeatures detect_cpu();

// The tile race, run when CPUID cannot tell whether vdpbf16ps beats float32 FMAs (an AVX512_BF16 CPU that is
// not an AMD one and offers no AMX: Cooper Lake, or a Sapphire Rapids whose OS refused the tile state, where
// vdpbf16ps runs at about half the FMAs' rate). Returns vdpbf16ps GFLOP/s over float32 FMA GFLOP/s on one
// 64 x 64 x 128 score tile; bf16_tile_race() is the real one, tests pass made-up ones.
using Bf16Race = std::function<double()>;
// Dpbf16 wins the race only at this speed-up or more: it also rounds P and dS to bf16, worth it for a real gain,
// and the margin keeps a noisy measurement on a CPU near parity from flipping the choice between runs.
constexpr double kDpbf16MinSpeedup = 1.25;

// The path for `features`: the best one, or the one `forced` names (RINGFLEX_ISA; null or empty = not forced):
//   amx            AVX-512 kernels, bf16 score products on AMX tiles
//   avx512-dpbf16  AVX-512 kernels, every bf16 product on vdpbf16ps
//   avx512-widen   AVX-512 kernels, bf16 widened to float32 (also spelt avx512, its name before issue 12)
//   avx2, scalar   those kernels (bf16 widened to float32)
// Not forced: AVX-512 > AVX2 > scalar, and for bf16 AMX > vdpbf16ps > widen: AMX when the CPU and OS offer it,
// vdpbf16ps on AMD CPUs with AVX512_BF16 (Zen 4 measured 1.9x the FMAs' GFLOP/s, BENCHMARKS.md), `race` on the
// other AVX512_BF16 CPUs (called only there; null = widen). Throws rf::Error when `forced` is not one of those
// names, or names a path this CPU cannot run.
KernelPath select_path(const CpuFeatures& features, const char* forced, const Bf16Race& race = nullptr);

// vdpbf16ps over float32 FMA GFLOP/s of the AVX-512 score-tile micro-kernels (kernels.h), best of several short
// timings (a few milliseconds in all). Call only on a CPU with AVX512_BF16.
double bf16_tile_race();

// The environment variable that forces a kernel path (select_path's `forced`).
constexpr const char* kIsaEnv = "RINGFLEX_ISA";

// Whether select_path(features, forced) consults its race: not forced (null or empty), AVX-512 with AVX512_BF16,
// no AMX, not AMD. Never throws, whatever `forced` holds.
bool needs_tile_race(const CpuFeatures& features, const char* forced);

// Has kernel_path() take the tile race's result from `race` instead of running bf16_tile_race() itself: for a
// program whose processes must decide together (the CLI's ranks race each and agree on the slowest result, so a
// timing near the threshold cannot split a job over two paths). Call before the first kernel_path(); later calls
// change nothing that was decided.
void set_tile_race(Bf16Race race);

// select_path(detect_cpu(), getenv("RINGFLEX_ISA"), the race set_tile_race installed or bf16_tile_race), decided
// on first use and fixed for the process. Throws rf::Error (again on every call) when RINGFLEX_ISA is bad. While a test
// has a software tile unit installed (amx.h: install_amx_tile_model), the AVX-512 kernels with AMX products instead.
const KernelPath& kernel_path();

// Whether bf16 operands pay on `path`: its bf16 products run on bf16 units (AMX tiles, or vdpbf16ps where the
// choice above found them faster than float32 FMAs). On Widen every bf16 element is widened to float32 while packing
// and multiplied on the same FMAs as float32 operands, so bf16 saves nothing but memory. This is the one place the
// bf16 compute mode (model.compute_dtype = bfloat16) takes its hardware decision from, for attention and matmuls:
// true: q, k, v and dout are stored bf16 and run on the bf16 attention kernels, the linear layers on oneDNN's bf16
// matmul; false: the float32 kernels and sgemm run on operands rounded to bf16 (the same numbers, float32's speed).
constexpr bool bf16_units_pay(const KernelPath& path) { return path.bf16 != Bf16Product::Widen; }

// One line for `ringflex info`: what the bf16 compute mode's attention runs on, given `path`.
std::string describe_bf16_attention(const KernelPath& path);

const char* isa_name(Isa isa);            // "scalar", "avx2", "avx512"
const char* bf16_name(Bf16Product bf16);  // what each product runs on, e.g. "vdpbf16ps (P and dS rounded to bf16)"
// One line for `ringflex info`: "avx512, bf16 products: vdpbf16ps ... (best this CPU supports)".
std::string describe(const KernelPath& path);

}  // namespace rf::cpu
