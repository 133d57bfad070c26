// ringflex cpu: the instruction set one kernel translation unit is compiled for.
//
// src/cpu/CMakeLists.txt compiles the kernel sources (attention_forward.cpp, attention_backward.cpp,
// kernel_set.cpp) once per ISA, defining exactly one of RF_KERNEL_AVX512, RF_KERNEL_AVX2, RF_KERNEL_SCALAR.
// Everything that differs per ISA then lives between RF_ISA_BEGIN and RF_ISA_END, in namespace
// rf::cpu::RF_ISA_NS (avx512, avx2, scalar):
//
// - The namespace keeps the ISA copies of every inline function and template apart. Without it the linker would
//   keep one copy of, say, tiles.h's softmax_step, possibly the AVX-512 one, and run it on an AVX2-only CPU.
// - The ISA comes from `#pragma GCC target` over that region, not from -m flags on the whole file: with -mavx512f
//   on the command line every inline function and template the file instantiates from the standard library and
//   src/core (std::vector, rf::classify, ...) would also be compiled for AVX-512 and could be the copy the linker
//   keeps for the whole program. Under the pragma only functions defined inside the region get the ISA; those
//   defined outside it keep the baseline even when instantiated from inside (the scheme of Highway and simdjson).
//   So every header a kernel file needs is included before its region opens.
#pragma once

#if defined(RF_KERNEL_AVX512) + defined(RF_KERNEL_AVX2) + defined(RF_KERNEL_SCALAR) != 1
#error "a kernel translation unit defines exactly one of RF_KERNEL_AVX512, RF_KERNEL_AVX2, RF_KERNEL_SCALAR"
#endif

#if defined(RF_KERNEL_AVX512)
#define RF_ISA_NS avx512
#define RF_ISA_KIND Avx512  // the cpu::Isa enumerator (cpu/isa.h) of this unit's target
#define RF_ISA_AVX512 1
#define RF_ISA_AVX2 0
// F/DQ/BW/VL: the AVX-512 subset of every AVX-512 server CPU since Skylake-SP (isa.cpp checks exactly these).
#define RF_ISA_TARGET_AVX512 "avx512f,avx512dq,avx512bw,avx512vl,avx2,fma,f16c,bmi,bmi2"
#define RF_ISA_TARGET RF_ISA_TARGET_AVX512
// The functions that execute AVX512_BF16 instructions (vdpbf16ps, vcvtneps2bf16) carry this attribute on top of
// the region's ISA; they are reached only on the Dpbf16 path, which isa.cpp chooses only with AVX512_BF16 (a
// Skylake-SP has AVX-512 without it). The region's whole target is repeated so the region's inline helpers
// (vload, exp2_ps ...) still inline into them: GCC inlines only into a caller whose target includes the callee's.
#define RF_BF16_TARGET __attribute__((target(RF_ISA_TARGET_AVX512 ",avx512bf16")))
#elif defined(RF_KERNEL_AVX2)
#define RF_ISA_NS avx2
#define RF_ISA_KIND Avx2  // the cpu::Isa enumerator (cpu/isa.h) of this unit's target
#define RF_ISA_AVX512 0
#define RF_ISA_AVX2 1
#define RF_ISA_TARGET "avx2,fma"
#else
#define RF_ISA_NS scalar
#define RF_ISA_KIND Scalar  // the cpu::Isa enumerator (cpu/isa.h) of this unit's target
#define RF_ISA_AVX512 0
#define RF_ISA_AVX2 0
#endif

// The exporter of this unit's table `name` (isa_table.h): avx512_<name>, avx2_<name> or scalar_<name>.
#define RF_ISA_EXPORT_(ns, name) ns##_##name
#define RF_ISA_EXPORT_NS_(ns, name) RF_ISA_EXPORT_(ns, name)
#define RF_ISA_EXPORT(name) RF_ISA_EXPORT_NS_(RF_ISA_NS, name)

#define RF_ISA_PRAGMA_(x) _Pragma(#x)
#define RF_ISA_PRAGMA(x) RF_ISA_PRAGMA_(x)

#if !defined(RF_ISA_TARGET)
// The scalar kernels are compiled for the build's baseline.
#define RF_ISA_BEGIN
#define RF_ISA_END
#elif defined(__clang__)
#define RF_ISA_BEGIN RF_ISA_PRAGMA(clang attribute push(__attribute__((target(RF_ISA_TARGET))), apply_to = function))
#define RF_ISA_END RF_ISA_PRAGMA(clang attribute pop)
#elif defined(__GNUC__)
#define RF_ISA_BEGIN RF_ISA_PRAGMA(GCC push_options) RF_ISA_PRAGMA(GCC target(RF_ISA_TARGET))
#define RF_ISA_END RF_ISA_PRAGMA(GCC pop_options)
#else
#error "per-ISA kernels need GCC or Clang target pragmas"
#endif
