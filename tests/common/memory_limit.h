// Test helper for the memory check (core/memory.h): RINGFLEX_MEMORY_LIMIT set for one scope, so a test can fake a
// small machine. Each TEST runs in its own process under CTest, so nothing leaks across tests.
#pragma once

#include <cstdlib>

namespace rf::testing {

class ScopedMemoryLimit {
 public:
  explicit ScopedMemoryLimit(const char* value) { setenv("RINGFLEX_MEMORY_LIMIT", value, 1); }
  ~ScopedMemoryLimit() { unsetenv("RINGFLEX_MEMORY_LIMIT"); }
  ScopedMemoryLimit(const ScopedMemoryLimit&) = delete;
  ScopedMemoryLimit& operator=(const ScopedMemoryLimit&) = delete;
};

}  // namespace rf::testing
