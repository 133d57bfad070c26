// ringflex comm: the collectives every backend shares, written on top of allgather so they reduce in rank order.
#include "comm/communicator.h"

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
}  // namespace

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

template <typename T>
void reduce_in_rank_order(Communicator& c, T* data, size_t n, ReduceOp op, Timeout timeout) {
  const size_t P = static_cast<size_t>(c.size());
  std::vector<T> all(P * n);
  c.allgather(data, all.data(), n * sizeof(T), timeout);
  for (size_t i = 0; i < n; ++i) {
    T acc = all[i];
    for (size_t r = 1; r < P; ++r) {
      const T x = all[r * n + i];
      switch (op) {
        case ReduceOp::Sum:
          acc = acc + x;
          break;
        case ReduceOp::Min:
          acc = std::min(acc, x);
          break;
        case ReduceOp::Max:
          acc = std::max(acc, x);
          break;
      }
    }
    data[i] = acc;
  }
}

}  // namespace

void Communicator::allreduce(double* data, size_t n, ReduceOp op, Timeout timeout) {
  reduce_in_rank_order(*this, data, n, op, timeout);
}

void Communicator::allreduce(int64_t* data, size_t n, ReduceOp op, Timeout timeout) {
  reduce_in_rank_order(*this, data, n, op, timeout);
}

void Communicator::allreduce(float* data, size_t n, ReduceOp op, Timeout timeout) {
  const size_t P = static_cast<size_t>(size());
  // Every rank derives the same slice length from P alone, so all post the same allgather sizes.
  const size_t slice = std::max<size_t>(1, kReduceSliceBytes / (P * sizeof(float)));
  std::vector<float> all(P * std::min(slice, n));  // [P, slice]
  for (size_t begin = 0; begin < n; begin += slice) {
    const size_t len = std::min(slice, n - begin);
    allgather(data + begin, all.data(), len * sizeof(float), timeout);
    for (size_t i = 0; i < len; ++i) {
      double acc = all[i];
      for (size_t r = 1; r < P; ++r) {
        const double x = all[r * len + i];
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
      data[begin + i] = static_cast<float>(acc);
    }
  }
}

}  // namespace rf::comm
