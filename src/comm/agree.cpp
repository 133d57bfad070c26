// ringflex comm: rank agreement (see agree.h). Two small collectives per step: an all-gather of failure flags
// finds the lowest failing rank, which then broadcasts its message.
#include "comm/agree.h"

#include <algorithm>
#include <climits>
#include <vector>

namespace rf::comm {

namespace {

constexpr int32_t kNoFailure = INT32_MAX;  // a flag above every rank number: min() over flags finds the first failure

}  // namespace

void agree(Communicator& comm, const std::function<void()>& step) {
  std::string message;
  int32_t failed = kNoFailure;
  try {
    step();
  } catch (const rf::Error& e) {
    message = e.what();
    failed = comm.rank();
  }
  std::vector<int32_t> flags(static_cast<size_t>(comm.size()));
  comm.allgather(&failed, flags.data(), sizeof failed, kDefaultTimeout);
  const int32_t first = *std::min_element(flags.begin(), flags.end());
  if (first == kNoFailure) return;
  uint64_t length = message.size();
  comm.broadcast(&length, sizeof length, first, kDefaultTimeout);
  message.resize(length);
  comm.broadcast(message.data(), length, first, kDefaultTimeout);
  throw AgreedError(message);
}

void agree_equal(Communicator& comm, std::span<const int64_t> values, const std::string& what) {
  std::vector<int64_t> lo(values.begin(), values.end()), hi(values.begin(), values.end());
  comm.allreduce(lo.data(), lo.size(), ReduceOp::Min);
  comm.allreduce(hi.data(), hi.size(), ReduceOp::Max);
  if (lo != hi) throw AgreedError(concat("ranks disagree on ", what));
}

}  // namespace rf::comm
