// ringflex core: what a job may allocate, checked before it allocates.
//
// Sizes come from what inputs claim (a config's vocabulary, a tensor's shape, a rank count); a claim the machine
// cannot hold must end the job with a message saying how much it needs, not with std::bad_alloc or the kernel's
// OOM killer half-way through. The figure compared against is Linux's MemAvailable (what can be allocated without
// swapping), shared evenly between the ranks mpirun placed on this machine, since they all allocate at once.
#pragma once

#include <cstdint>
#include <string>

namespace rf {

// Bytes this process may allocate: MemAvailable from /proc/meminfo (or the free physical pages where it is
// missing) divided by the number of ranks on this node (OMPI_COMM_WORLD_LOCAL_SIZE, 1 without mpirun).
int64_t available_memory_bytes();

// Throws rf::Error "<what> needs X GiB of memory, but only Y GiB is available to this rank" when `bytes` exceeds
// available_memory_bytes(). Negative `bytes` (an overflowed size) is an error too.
void check_memory(int64_t bytes, const std::string& what);

// "1.5 GiB", "12.0 MiB", "812 B": a byte count for messages.
std::string format_bytes(int64_t bytes);

}  // namespace rf
