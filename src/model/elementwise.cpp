// ringflex model: which ISA's elementwise kernels run (elementwise.h), the same choice as the attention kernels'
// (cpu/isa_table.h).
#include "model/elementwise.h"

namespace rf::model {

namespace {
constexpr cpu::PerIsa<ElementwiseKernels> kElementwise =
    RF_PER_ISA(ElementwiseKernels, elementwise, "elementwise kernels");
}  // namespace

const ElementwiseKernels& elementwise_for(cpu::Isa isa) { return kElementwise.for_isa(isa); }

const ElementwiseKernels& elementwise() { return kElementwise.chosen(); }

}  // namespace rf::model
