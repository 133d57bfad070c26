// ringflex trainer: what a rank holds before training allocates its state (the memory check's baseline term).
//
// A rank's resident set is more than its buffers: its libraries' code and data (oneDNN, OpenBLAS, libstdc++,
// OpenMPI, PMIx: ~25 MiB resident), OpenMPI's shared-memory transport (vader's segment and PMIx's store, under 1 MiB
// resident at N = 4 on one machine), the runtime's heap at start-up (MPI's, the data source's). The memory check
// counts them as they are when it runs, measured, not modelled: they depend on the libraries installed, not on the
// model. Not in it: OpenBLAS's packing buffers, mapped when the first large GEMM runs (blas_buffer_bytes, a term
// of its own), and the heap's fragmentation (BENCHMARKS.md, shard memory).
#pragma once

#include <cstdint>

namespace rf::trainer {

// This process's resident bytes (VmRSS) the first time it is called, the same figure after it, so that every memory
// check and --stats of one process agree: the first call comes before the run allocates its state (the up-front
// check). 0 where /proc/self/status has no VmRSS (not Linux).
int64_t runtime_baseline_bytes();
// Its name among the memory check's terms.
inline constexpr const char* kRuntimeBaseline = "runtime baseline (libraries, MPI, start-up heap)";

// OpenBLAS gives every thread that calls it a packing buffer of its BUFFER_SIZE, 128 MiB on x86-64, and touches it as
// far as a call's packed panels reach: all of it for a vocabulary-sized head's weight gradient, about half of it for
// the 100m config's (65536 x 640 x 256: 64 MiB under the Haswell kernels, 1 MiB under Cooperlake's; measured with
// Debian's 0.3.21). The check counts the whole buffer for each of a rank's `threads` OpenMP threads (each runs its
// own sgemm: model/ops.h), or nothing when the BLAS linked is not OpenBLAS.
inline constexpr int64_t kOpenBlasBufferBytes = int64_t{128} << 20;
int64_t blas_buffer_bytes(int threads);
inline constexpr const char* kBlasBuffers = "OpenBLAS packing buffers (one a thread)";

}  // namespace rf::trainer
