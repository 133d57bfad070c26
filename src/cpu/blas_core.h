// ringflex cpu: keeping OpenBLAS on this CPU's vector units.
//
// The model's float32 matmuls are OpenBLAS sgemm, and OpenBLAS chooses its kernels once, while it loads, from a
// table of CPU models. A CPU newer than the table gets its oldest x86-64 kernels: Debian 12's OpenBLAS 0.3.21
// takes an Intel Xeon of family 6, model 207 (AVX-512 with bf16) for a Prescott and runs sgemm on SSE3 at 23-32
// GFLOP/s, against 140 with the SkylakeX kernels it ships (BENCHMARKS.md). It reads OPENBLAS_CORETYPE only while
// loading, so the remedy belongs to a program, not a library: its main asks, first thing, whether the loaded
// core is such a fallback and if so starts itself again with the variable set.
#pragma once

#include <string>
#include <string_view>

#include "cpu/isa.h"

namespace rf::cpu {

// The core the loaded OpenBLAS runs ("SkylakeX", "Haswell", "Zen", "Prescott", ...), or "" when the BLAS in this
// process is not OpenBLAS (it is looked up by name, so any BLAS links).
std::string openblas_core();

// The core OpenBLAS should run instead of `core` on a CPU offering `cpu`: "SkylakeX" (AVX-512) or "Haswell"
// (AVX2 + FMA) when `core` is one whose kernels predate AVX2, else nullptr. Only a fallback is replaced: a core
// OpenBLAS chose knowingly (Zen on AMD, Haswell, SkylakeX, Cooperlake, SapphireRapids) is kept.
const char* better_openblas_core(std::string_view core, const CpuFeatures& cpu);

// For a program's main, before it starts MPI or threads: when OPENBLAS_CORETYPE is unset (or empty) and the loaded core
// is a fallback (better_openblas_core), sets the variable, records the replaced core in RINGFLEX_OPENBLAS_FALLBACK (for
// `ringflex info`) and replaces the process image with a fresh copy of itself (same pid, arguments and environment
// otherwise). Returns when there is nothing to do, or when the restart failed (the process then runs on, correct but
// slower). Tools that follow a process through exec only when asked (valgrind without
// --trace-children=yes) lose it at the restart: set OPENBLAS_CORETYPE under them.
void restart_on_best_openblas_core(char** argv);

// One line for `ringflex info`: the core and, when ringflex chose it, the fallback it replaced.
std::string describe_openblas_core();

}  // namespace rf::cpu
