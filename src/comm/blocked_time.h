// ringflex comm: how long a thread has waited on communication, for the trainer's per-step comm_wait_s.
#pragma once

#include <chrono>

namespace rf::comm {

// Seconds the calling thread has spent blocked in the backends' waits (a request's wait, and through it every
// collective's; allgather, broadcast, a split) since it started: the communication that computation did not hide,
// whatever the transport. Per thread, so that each loopback rank (a thread) counts its own; the trainer reports its
// difference across a step (comm_wait_s, docs/cluster.md).
double blocked_seconds();

namespace detail {
// Adds the seconds of its life to the calling thread's blocked_seconds(): a backend's wait holds one while it blocks
// on a transfer that has not completed.
class BlockedTime {
 public:
  BlockedTime();
  ~BlockedTime();
  BlockedTime(const BlockedTime&) = delete;
  BlockedTime& operator=(const BlockedTime&) = delete;

 private:
  std::chrono::steady_clock::time_point start_;
};
}  // namespace detail

}  // namespace rf::comm
