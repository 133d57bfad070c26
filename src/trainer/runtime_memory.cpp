// ringflex trainer: what a rank holds before training allocates its state (see runtime_memory.h).
#include "trainer/runtime_memory.h"

#include <algorithm>
#include <fstream>
#include <string>

#include "cpu/blas_core.h"

namespace rf::trainer {

namespace {

// VmRSS from /proc/self/status, which Linux reports in KiB; 0 where it cannot be read.
int64_t resident_bytes_now() {
  constexpr int64_t kBytesPerKiB = 1024;
  std::ifstream status("/proc/self/status");
  std::string key;
  while (status >> key) {
    if (key == "VmRSS:") {
      int64_t kib = 0;
      status >> kib;
      return kib * kBytesPerKiB;
    }
    std::getline(status, key);
  }
  return 0;
}

}  // namespace

int64_t runtime_baseline_bytes() {
  static const int64_t first = resident_bytes_now();
  return first;
}

int64_t blas_buffer_bytes(int threads) {
  return cpu::openblas_core().empty() ? 0 : kOpenBlasBufferBytes * std::max(threads, 1);
}

}  // namespace rf::trainer
