// ringflex cpu: the one place where run-time choices become kernel code (DEVELOPERS.md: one visible dispatch per
// kernel family).
//
// Two steps, both here:
//  1. kernels_for(isa): the instruction set isa.h chose (CPUID + RINGFLEX_ISA) picks the KernelSet compiled for
//     it (kernels.h). Called by attention.cpp, in baseline code.
//  2. dispatch(D, dtype, amx, f), inside a kernel translation unit: the head dimension, dtype and the AMX choice
//     become the template parameters of that ISA's kernels.
// kDp is the padded head dimension fixed at compile time for the fast paths D = 64, 128, 256, 512 (Gemma 4 uses
// 256 and 512), or 0 for every other D, which runs the same code with Dp read at run time (tiles.h: padded_dim).
// The scalar kernels instantiate only kDp = 0 (they exist for correctness, not speed, and each instantiation
// costs compile time); kAmx = true is instantiated only in the AVX-512 kernels, and reached only when isa.h saw
// AMX-TILE + AMX-BF16 and Linux granted the tile state.
#pragma once

#include "core/dtype.h"
#include "core/error.h"
#include "cpu/isa.h"
#include "cpu/kernels.h"

namespace rf::cpu {

inline const KernelSet& kernels_for(Isa isa) {
  switch (isa) {
#if defined(__x86_64__)
    case Isa::Avx512:
      return avx512_kernels();
    case Isa::Avx2:
      return avx2_kernels();
#else
    case Isa::Avx512:
    case Isa::Avx2:
      fail("the ", isa_name(isa), " kernels exist only in x86-64 builds");
#endif
    case Isa::Scalar:
      return scalar_kernels();
  }
  fail("internal error: unknown kernel ISA");
}

}  // namespace rf::cpu

#if defined(RF_KERNEL_AVX512) || defined(RF_KERNEL_AVX2) || defined(RF_KERNEL_SCALAR)
#include "cpu/isa_target.h"

#include "core/attention_args.h"

RF_ISA_BEGIN
// This ISA's kernels behind its KernelSet (kernel_set.cpp): attention_forward.cpp and attention_backward.cpp.
namespace rf::cpu::RF_ISA_NS {
void forward(const AttnChunk& c, bool amx, float* o, float* lse);
void backward(const AttnChunk& c, bool amx, const void* dout, const float* lse, const float* delta, float* dq,
              float* dk, float* dv);
}  // namespace rf::cpu::RF_ISA_NS

namespace rf::cpu::RF_ISA_NS::detail {

// Calls f.template operator()<kDp, kT, kAmx>() for the given (D, dtype, amx).
template <typename F>
void dispatch(int D, DType dtype, bool amx, F&& f) {
  auto with_dim = [&]<DType kT, bool kAmx>() {
#if RF_ISA_AVX512 || RF_ISA_AVX2
    switch (D) {
      case 64:
        return f.template operator()<64, kT, kAmx>();
      case 128:
        return f.template operator()<128, kT, kAmx>();
      case 256:
        return f.template operator()<256, kT, kAmx>();
      case 512:
        return f.template operator()<512, kT, kAmx>();
      default:
        return f.template operator()<0, kT, kAmx>();
    }
#else
    (void)D;
    return f.template operator()<0, kT, kAmx>();
#endif
  };
  if (dtype == DType::F32) {
    with_dim.template operator()<DType::F32, false>();
    return;
  }
#if RF_ISA_AVX512
  if (amx) {
    with_dim.template operator()<DType::BF16, true>();
    return;
  }
#else
  RF_ASSERT(!amx);
#endif
  with_dim.template operator()<DType::BF16, false>();
}

}  // namespace rf::cpu::RF_ISA_NS::detail
RF_ISA_END
#endif
