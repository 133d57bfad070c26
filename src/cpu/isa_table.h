// ringflex cpu: one mechanism for every table of kernels compiled once per ISA (the attention kernels, the model's
// elementwise passes, the optimizer's), as Highway's HWY_EXPORT: a source compiled per ISA (isa_target.h; CMake's
// rf_isa_objects in src/cpu/CMakeLists.txt) defines its table's exporter with RF_ISA_EXPORT(name), the owner of the
// table declares the three exporters with RF_ISA_TABLE_EXPORTS and picks among them with RF_PER_ISA: for an ISA
// (tests run every one the CPU has), or once for the path isa.h chose (CPUID, RINGFLEX_ISA), the same for all tables.
#pragma once

#include "core/error.h"
#include "cpu/isa.h"

namespace rf::cpu {

template <typename Table>
class PerIsa {
 public:
  using Exporter = const Table& (*)();
  // what: the tables' name in messages ("elementwise kernels"); a null exporter: an ISA this build lacks.
  constexpr PerIsa(const char* what, Exporter avx512, Exporter avx2, Exporter scalar)
      : what_(what), avx512_(avx512), avx2_(avx2), scalar_(scalar) {}

  // The table of `isa`; throws rf::Error for an ISA this build lacks.
  const Table& for_isa(Isa isa) const {
    const Exporter exporter = isa == Isa::Avx512 ? avx512_ : isa == Isa::Avx2 ? avx2_ : scalar_;
    RF_CHECK(exporter != nullptr, "the ", isa_name(isa), " ", what_, " exist only in x86-64 builds");
    return exporter();
  }
  // The table of the path isa.h chose (kernel_path()), decided on first use.
  const Table& chosen() const {
    static const Table& table = for_isa(kernel_path().isa);
    return table;
  }

 private:
  const char* what_;
  Exporter avx512_, avx2_, scalar_;
};

}  // namespace rf::cpu

// Declares the exporters of `Table` named avx512_<name>, avx2_<name> and scalar_<name> (in the enclosing namespace),
// each defined by the source compiled for that ISA with RF_ISA_EXPORT(name).
#define RF_ISA_TABLE_EXPORTS(Table, name) \
  const Table& avx512_##name();           \
  const Table& avx2_##name();             \
  const Table& scalar_##name()

// The PerIsa over those exporters: the vector ISAs' only in x86-64 builds, the only ones that compile them.
#if defined(__x86_64__)
#define RF_PER_ISA(Table, name, what) ::rf::cpu::PerIsa<Table>(what, &avx512_##name, &avx2_##name, &scalar_##name)
#else
#define RF_PER_ISA(Table, name, what) ::rf::cpu::PerIsa<Table>(what, nullptr, nullptr, &scalar_##name)
#endif
