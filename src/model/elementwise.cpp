// ringflex model: which ISA's elementwise kernels run (elementwise.h), the same choice as the attention kernels'.
#include "model/elementwise.h"

#include "core/error.h"

namespace rf::model {

const ElementwiseKernels& elementwise_for(cpu::Isa isa) {
  switch (isa) {
#if defined(__x86_64__)
    case cpu::Isa::Avx512:
      return avx512_elementwise();
    case cpu::Isa::Avx2:
      return avx2_elementwise();
#else
    case cpu::Isa::Avx512:
    case cpu::Isa::Avx2:
      fail("the ", cpu::isa_name(isa), " elementwise kernels exist only in x86-64 builds");
#endif
    case cpu::Isa::Scalar:
      return scalar_elementwise();
  }
  fail("internal error: unknown ISA");
}

const ElementwiseKernels& elementwise() {
  static const ElementwiseKernels& chosen = elementwise_for(cpu::kernel_path().isa);
  return chosen;
}

}  // namespace rf::model
