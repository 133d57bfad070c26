// ringflex trainer: what a rank holds before training allocates its state (the memory check's baseline term).
//
// A rank's resident set is more than its buffers: its libraries' code and data (oneDNN, OpenBLAS, libstdc++,
// OpenMPI, PMIx: ~25 MiB resident), OpenMPI's shared-memory transport (vader's segment and PMIx's store, under 1 MiB
// resident at N = 4 on one machine), the runtime's heap at start-up (MPI's, the data source's). The memory check
// counts them as they are when it runs, measured, not modelled: they depend on the libraries installed, not on the
// model. Not in it: OpenBLAS's own buffers, mapped when its first large GEMM runs (~64 MiB a rank on the 100m
// config), and the heap's fragmentation (BENCHMARKS.md, shard memory).
#pragma once

#include <cstdint>

namespace rf::trainer {

// This process's resident bytes (VmRSS) the first time it is called, the same figure after it, so that every memory
// check and --stats of one process agree: the first call comes before the run allocates its state (the up-front
// check). 0 where /proc/self/status has no VmRSS (not Linux).
int64_t runtime_baseline_bytes();
// Its name among the memory check's terms.
inline constexpr const char* kRuntimeBaseline = "runtime baseline (libraries, MPI, start-up heap)";

}  // namespace rf::trainer
