// ringflex cpu: the one place where run-time choices become kernel code (DEVELOPERS.md: one visible dispatch per
// kernel family).
//
// Two steps, both here:
//  1. kernels_for(isa): the instruction set isa.h chose (CPUID + RINGFLEX_ISA) picks the KernelSet compiled for
//     it (kernels.h), as every per-ISA table is picked (isa_table.h). Called by attention.cpp, in baseline code.
//  2. dispatch(D, dtype, bf16, f), inside a kernel translation unit: the head dimension, dtype and the bf16
//     product (isa.h: Bf16Product) become the template parameters of that ISA's kernels.
// kDp is the padded head dimension fixed at compile time for the fast paths D = 64, 128, 256, 512 (Gemma 4 uses
// 256 and 512), or 0 for every other D, which runs the same code with Dp read at run time (tiles.h: padded_dim).
// The scalar kernels instantiate only kDp = 0 (they exist for correctness, not speed, and each instantiation
// costs compile time). kProd is Widen for float32 inputs and on AVX2 and scalar; the AVX-512 kernels instantiate
// Dpbf16 and Amx for bf16 too, reached only when isa.h saw the hardware (AVX512_BF16; AMX-TILE + AMX-BF16 with
// the tile state granted by Linux).
#pragma once

#include "core/dtype.h"
#include "core/error.h"
#include "cpu/isa.h"
#include "cpu/isa_table.h"
#include "cpu/kernels.h"

namespace rf::cpu {

inline const KernelSet& kernels_for(Isa isa) {
  static constexpr PerIsa<KernelSet> kSets = RF_PER_ISA(KernelSet, kernels, "kernels");
  return kSets.for_isa(isa);
}

}  // namespace rf::cpu

#if defined(RF_KERNEL_AVX512) || defined(RF_KERNEL_AVX2) || defined(RF_KERNEL_SCALAR)
#include "cpu/isa_target.h"

#include "core/attention_args.h"

RF_ISA_BEGIN
// This ISA's kernels behind its KernelSet (kernel_set.cpp): attention_forward.cpp and attention_backward.cpp.
namespace rf::cpu::RF_ISA_NS {
void forward(const AttnChunk& c, Bf16Product bf16, float* o, float* lse);
void backward(const AttnChunk& c, Bf16Product bf16, const void* dout, const float* lse, const float* delta, float* dq,
              float* dk, float* dv);
}  // namespace rf::cpu::RF_ISA_NS

namespace rf::cpu::RF_ISA_NS::detail {

// Calls f.template operator()<kDp, kT, kProd>() for the given (D, dtype, bf16).
template <typename F>
void dispatch(int D, DType dtype, Bf16Product bf16, F&& f) {
  auto with_dim = [&]<DType kT, Bf16Product kProd>() {
#if RF_ISA_AVX512 || RF_ISA_AVX2
    switch (D) {
      case 64:
        return f.template operator()<64, kT, kProd>();
      case 128:
        return f.template operator()<128, kT, kProd>();
      case 256:
        return f.template operator()<256, kT, kProd>();
      case 512:
        return f.template operator()<512, kT, kProd>();
      default:
        return f.template operator()<0, kT, kProd>();
    }
#else
    (void)D;
    return f.template operator()<0, kT, kProd>();
#endif
  };
  if (dtype == DType::F32) {
    with_dim.template operator()<DType::F32, Bf16Product::Widen>();
    return;
  }
  switch (bf16) {
#if RF_ISA_AVX512
    case Bf16Product::Dpbf16:
      with_dim.template operator()<DType::BF16, Bf16Product::Dpbf16>();
      return;
    case Bf16Product::Amx:
      with_dim.template operator()<DType::BF16, Bf16Product::Amx>();
      return;
#else
    case Bf16Product::Dpbf16:
    case Bf16Product::Amx:
      fail("internal error: bf16 products other than widening exist only in the AVX-512 kernels");
#endif
    case Bf16Product::Widen:
      with_dim.template operator()<DType::BF16, Bf16Product::Widen>();
      return;
  }
}

}  // namespace rf::cpu::RF_ISA_NS::detail
RF_ISA_END
#endif
