// ringflex cli: Watchdog (see watchdog.h).
#include "cli/watchdog.h"

#include <cstdio>
#include <cstdlib>

namespace rf::cli {

namespace {
constexpr int kStalledExit = 1;
}  // namespace

Watchdog::Watchdog(comm::Timeout limit, std::string what)
    : thread_([this, limit, what = std::move(what)] {
        std::unique_lock<std::mutex> lock(mutex_);
        if (done_cv_.wait_for(lock, limit, [this] { return done_; })) return;
        std::fprintf(stderr,
                     "ringflex: error: %s did not complete within %.3g s (--timeout): a peer rank stopped "
                     "answering\n",
                     what.c_str(), static_cast<double>(limit.count()) / 1000.0);
        std::fflush(stderr);
        // The guarded call still holds MPI's locks on the main thread: nothing can be unwound or finalised, so
        // the process ends here (the only exit outside main, and only in the command-line layer).
        std::_Exit(kStalledExit);
      }) {}

Watchdog::~Watchdog() {
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    done_ = true;
  }
  done_cv_.notify_one();
  thread_.join();
}

}  // namespace rf::cli
