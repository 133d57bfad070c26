// ringflex comm: the small collectives every backend shares, written on top of allgather so they reduce in rank
// order (the large ones: collectives.cpp).
#include "comm/communicator.h"
#include "comm/blocked_time.h"

#include <algorithm>
#include <atomic>
#include <string>
#include <utility>

namespace rf::comm {

namespace {
// Set once by the executable before any rank communicates, read by every wait; atomic so a reader on another
// thread (the loopback backend's ranks) never sees a torn value.
std::atomic<int64_t> g_default_timeout_ms{kDefaultTimeout.count()};
}  // namespace

namespace {
thread_local std::string t_step;
thread_local double t_blocked_seconds = 0.0;
}  // namespace

detail::BlockedTime::BlockedTime() : start_(std::chrono::steady_clock::now()) {}
detail::BlockedTime::~BlockedTime() {
  t_blocked_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}
double blocked_seconds() { return t_blocked_seconds; }

Step::Step(std::string what) : previous_(std::exchange(t_step, std::move(what))) {}
Step::~Step() { t_step = std::move(previous_); }
std::string Step::current() { return t_step; }

Timeout default_timeout() { return Timeout(g_default_timeout_ms.load(std::memory_order_relaxed)); }

void set_default_timeout(Timeout timeout) { g_default_timeout_ms.store(timeout.count(), std::memory_order_relaxed); }

void wait_all(std::span<RequestPtr> requests, Timeout timeout) {
  for (RequestPtr& r : requests) {
    if (!r) continue;
    r->wait(timeout);
    r.reset();
  }
}

void Communicator::barrier(Timeout timeout) {
  const uint8_t token = 1;
  std::vector<uint8_t> all(static_cast<size_t>(size()));
  allgather(&token, all.data(), 1, timeout);
}

namespace {

// data[i] = op over ranks 0..P-1 of every rank's data[i], accumulated in Acc in rank order, so every backend and
// every rank gets the same bits. The exchange goes in slices whose gathered copies take at most kReduceSliceBytes:
// every rank derives the same slice length from P alone, so all post the same allgather sizes, and memory stays [P,
// slice] however large n is.
template <typename T, typename Acc>
void reduce_in_rank_order(Communicator& c, T* data, size_t n, ReduceOp op, Timeout timeout) {
  const size_t P = static_cast<size_t>(c.size());
  const size_t slice = std::max<size_t>(1, Communicator::kReduceSliceBytes / (P * sizeof(T)));
  std::vector<T> all(P * std::min(slice, n));  // [P, slice]
  for (size_t begin = 0; begin < n; begin += slice) {
    const size_t len = std::min(slice, n - begin);
    c.allgather(data + begin, all.data(), len * sizeof(T), timeout);
    for (size_t i = 0; i < len; ++i) {
      Acc acc = all[i];
      for (size_t r = 1; r < P; ++r) {
        const Acc x = all[r * len + i];
        switch (op) {
          case ReduceOp::Sum:
            acc += x;
            break;
          case ReduceOp::Min:
            acc = std::min(acc, x);
            break;
          case ReduceOp::Max:
            acc = std::max(acc, x);
            break;
        }
      }
      data[begin + i] = static_cast<T>(acc);
    }
  }
}

}  // namespace

void Communicator::allreduce(double* data, size_t n, ReduceOp op, Timeout timeout) {
  reduce_in_rank_order<double, double>(*this, data, n, op, timeout);
}

void Communicator::allreduce(int64_t* data, size_t n, ReduceOp op, Timeout timeout) {
  reduce_in_rank_order<int64_t, int64_t>(*this, data, n, op, timeout);
}

}  // namespace rf::comm
