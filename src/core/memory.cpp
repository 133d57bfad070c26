// ringflex core: the memory a job may allocate (see memory.h).
#include "core/memory.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace rf {

namespace {

constexpr int64_t kKiB = 1024;

// MemAvailable in bytes, or -1 when /proc/meminfo does not say (old kernels, other systems).
int64_t meminfo_available() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * kKiB;
  }
  return -1;
}

int local_ranks() {
  // Open MPI's count of the ranks of this job on this node; other launchers leave it unset.
  const char* s = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  const int n = s ? std::atoi(s) : 1;
  return n >= 1 ? n : 1;
}

}  // namespace

int64_t available_memory_bytes() {
  int64_t bytes = meminfo_available();
  if (bytes < 0) bytes = static_cast<int64_t>(sysconf(_SC_AVPHYS_PAGES)) * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
  return bytes / local_ranks();
}

std::string format_bytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  char text[32];
  if (bytes >= kKiB * kKiB * kKiB) {
    std::snprintf(text, sizeof(text), "%.1f GiB", b / static_cast<double>(kKiB * kKiB * kKiB));
  } else if (bytes >= kKiB * kKiB) {
    std::snprintf(text, sizeof(text), "%.1f MiB", b / static_cast<double>(kKiB * kKiB));
  } else {
    std::snprintf(text, sizeof(text), "%lld B", static_cast<long long>(bytes));
  }
  return text;
}

void check_memory(int64_t bytes, const std::string& what) {
  RF_CHECK(bytes >= 0, what, " needs more than 2^63 bytes of memory (its sizes overflow)");
  const int64_t available = available_memory_bytes();
  RF_CHECK(bytes <= available, what, " needs ", format_bytes(bytes), " of memory, but only ", format_bytes(available),
           " is available to this rank");
}

}  // namespace rf
