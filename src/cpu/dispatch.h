// ringflex cpu: the one place where the run-time head dimension and dtype become the kernels' template
// parameters (DEVELOPERS.md: one visible dispatch per kernel family).
//
// kDp is the padded head dimension fixed at compile time for the fast paths D = 64, 128, 256, 512 (Gemma 4 uses
// 256 and 512), or 0 for every other D, which runs the same code with Dp read at run time (tiles.h: padded_dim).
// The ISA is chosen at compile time (__AVX512F__, __AVX512BF16__ in microkernels.h), not here.
#pragma once

#include <utility>

#include "core/dtype.h"

namespace rf::cpu::detail {

// Calls f.template operator()<kDp, kT>() for the given (D, dtype).
template <typename F>
void dispatch(int D, DType dtype, F&& f) {
  auto with_dim = [&]<DType kT>() {
    switch (D) {
      case 64: return f.template operator()<64, kT>();
      case 128: return f.template operator()<128, kT>();
      case 256: return f.template operator()<256, kT>();
      case 512: return f.template operator()<512, kT>();
      default: return f.template operator()<0, kT>();
    }
  };
  if (dtype == DType::F32)
    with_dim.template operator()<DType::F32>();
  else
    with_dim.template operator()<DType::BF16>();
}

}  // namespace rf::cpu::detail
