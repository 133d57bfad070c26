// ringflex cpu: which instruction set the attention kernels run on, decided once per process at run time.
//
// The library is compiled for the x86-64 baseline; the kernels are compiled once per ISA (kernels.h) and this
// file chooses among them from CPUID, the operating system's saved-state support (XGETBV) and the environment
// variable RINGFLEX_ISA. The choice is the only run-time ISA decision in the library (dispatch.h applies it).
#pragma once

#include <string>

namespace rf::cpu {

// Kernel instruction sets, best last. Avx512 needs AVX-512 F/DQ/BW/VL (Skylake-SP, Ice Lake, Sapphire Rapids,
// Zen 4 and later); Avx2 needs AVX2 + FMA (Haswell, Zen 1 and later); Scalar runs on any CPU.
enum class Isa { Scalar, Avx2, Avx512 };

// How the bf16 kernels compute their score products (Q K^T, dO V^T). Issue 12 adds vdpbf16ps as a run-time choice
// here; today it is a build option (RINGFLEX_BF16_DOT) inside the Widen entry of the AVX-512 kernels.
enum class Bf16Product {
  Widen,  // bf16 widened to float32 while packing, float32 FMAs (exact products)
  Amx,    // Intel AMX tiles (tdpbf16ps), AVX-512 kernels only
};

// What this CPU and operating system offer the kernels.
struct CpuFeatures {
  bool avx2 = false;         // AVX2 + FMA, with the OS saving ymm state
  bool avx512 = false;       // AVX-512 F/DQ/BW/VL, with the OS saving zmm and opmask state
  bool avx512_bf16 = false;  // AVX512_BF16 (vdpbf16ps)
  bool amx = false;          // AMX-TILE + AMX-BF16, and Linux granted the tile data state to this process
  std::string cpu_name;      // CPUID brand string, for `ringflex info`
};

struct KernelPath {
  Isa isa = Isa::Scalar;
  Bf16Product bf16 = Bf16Product::Widen;
  std::string reason;  // why, in one line: "best this CPU supports" or "forced by RINGFLEX_ISA=..."
};

// Reads CPUID and XGETBV (and asks Linux for the AMX tile state when CPUID reports AMX). Cheap; not cached.
CpuFeatures detect_cpu();

// The path for `features`: the best one, or the one `forced` names (RINGFLEX_ISA: amx, avx512, avx2 or scalar;
// null or empty = not forced). Throws rf::Error when `forced` is not one of those names, or names a path this
// CPU (or this build: RINGFLEX_BF16_DOT makes the AVX-512 kernels need AVX512_BF16) cannot run.
KernelPath select_path(const CpuFeatures& features, const char* forced);

// select_path(detect_cpu(), getenv("RINGFLEX_ISA")), decided on first use and fixed for the process.
// Throws rf::Error (again on every call) when RINGFLEX_ISA is bad.
const KernelPath& kernel_path();

const char* isa_name(Isa isa);            // "scalar", "avx2", "avx512"
const char* bf16_name(Bf16Product bf16);  // "widen to float32", "amx"
// One line for `ringflex info`: "avx512, bf16 score products: widen to float32 (best this CPU supports)".
std::string describe(const KernelPath& path);

}  // namespace rf::cpu
