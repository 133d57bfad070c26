// ringflex cpu: the one place where the run-time head dimension and dtype become the kernels' template
// parameters (DEVELOPERS.md: one visible dispatch per kernel family).
//
// kDp is the padded head dimension fixed at compile time for the fast paths D = 64, 128, 256, 512 (Gemma 4 uses
// 256 and 512), or 0 for every other D, which runs the same code with Dp read at run time (tiles.h: padded_dim).
// The vector ISA is chosen at compile time (__AVX512F__, __AVX512BF16__ in microkernels.h). The one run-time ISA
// choice is here: kAmx is true for bf16 inputs when amx_enabled() (amx.h: CPUID, the kernel's tile permission and
// RINGFLEX_ISA), so AMX instructions are only ever reached on a machine that has granted them.
#pragma once

#include <utility>

#include "core/dtype.h"
#include "cpu/amx.h"

namespace rf::cpu::detail {

// Calls f.template operator()<kDp, kT, kAmx>() for the given (D, dtype).
template <typename F>
void dispatch(int D, DType dtype, F&& f) {
  auto with_dim = [&]<DType kT, bool kAmx>() {
    switch (D) {
      case 64: return f.template operator()<64, kT, kAmx>();
      case 128: return f.template operator()<128, kT, kAmx>();
      case 256: return f.template operator()<256, kT, kAmx>();
      case 512: return f.template operator()<512, kT, kAmx>();
      default: return f.template operator()<0, kT, kAmx>();
    }
  };
  if (dtype == DType::F32)
    with_dim.template operator()<DType::F32, false>();
  else if (amx_enabled())
    with_dim.template operator()<DType::BF16, true>();
  else
    with_dim.template operator()<DType::BF16, false>();
}

}  // namespace rf::cpu::detail
