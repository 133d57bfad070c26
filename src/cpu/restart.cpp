// ringflex cpu: restarting the executable (restart.h).
#include "cpu/restart.h"

#include <limits.h>
#include <unistd.h>

#include <array>

namespace rf::cpu {

namespace {

// Linux's link to the running executable's file, whatever path or symlink started it.
constexpr const char* kSelfExe = "/proc/self/exe";

}  // namespace

void restart_self(char** argv) {
  // The executable's own path, not /proc/self/exe itself: the kernel names a process after the file it executes,
  // and ps, top and pgrep should go on seeing "ringflex", not "exe".
  std::array<char, PATH_MAX> self{};
  const ssize_t length = readlink(kSelfExe, self.data(), self.size() - 1);
  if (length > 0) execv(self.data(), argv);
}

}  // namespace rf::cpu
