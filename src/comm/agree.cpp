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

void agree(Communicator& comm, const std::function<void()>& step, Timeout timeout) {
  std::string message;
  int32_t failed = kNoFailure;
  try {
    step();
  } catch (const std::exception& e) {  // rf::Error, and any library's own (yaml-cpp, json, std::filesystem, bad_alloc)
    message = e.what();
    failed = comm.rank();
  }
  std::vector<int32_t> flags(static_cast<size_t>(comm.size()));
  comm.allgather(&failed, flags.data(), sizeof failed, timeout);
  const int32_t first = *std::min_element(flags.begin(), flags.end());
  if (first == kNoFailure) return;
  uint64_t length = message.size();
  comm.broadcast(&length, sizeof length, first, default_timeout());
  message.resize(length);
  comm.broadcast(message.data(), length, first, default_timeout());
  // A failure of some ranks only (rank 0's write, one rank's rows) names the rank, so the one line every rank prints
  // says where it happened; one that every rank met (a config error) is the job's, not a rank's.
  const auto failing = std::count_if(flags.begin(), flags.end(), [](int32_t f) { return f != kNoFailure; });
  if (failing < comm.size()) throw AgreedError(concat("rank ", first, ": ", message));
  throw AgreedError(message);
}

void agree_equal(Communicator& comm, std::span<const int64_t> values, const std::string& what) {
  std::vector<int64_t> lo(values.begin(), values.end()), hi(values.begin(), values.end());
  comm.allreduce(lo.data(), lo.size(), ReduceOp::Min);
  comm.allreduce(hi.data(), hi.size(), ReduceOp::Max);
  if (lo != hi) throw AgreedError(concat("ranks disagree on ", what));
}

void agree_command_line(Communicator& comm, const std::vector<std::string>& args) {
  // Arguments NUL-terminated, so `--a b` and `--a\0b`-style splits cannot collide; padded to the longest
  // rank's length, which the first allgather finds, so the second moves equal sizes on every rank.
  std::string mine;
  for (const std::string& a : args) mine.append(a).push_back('\0');
  const int P = comm.size();
  const int64_t length = static_cast<int64_t>(mine.size());
  std::vector<int64_t> lengths(static_cast<size_t>(P));
  comm.allgather(&length, lengths.data(), sizeof length, default_timeout());
  const size_t width = static_cast<size_t>(*std::max_element(lengths.begin(), lengths.end()));
  mine.resize(width, '\0');
  std::string all(width * static_cast<size_t>(P), '\0');
  comm.allgather(mine.data(), all.data(), width, default_timeout());

  // A rank's command line as one readable string: arguments separated by spaces.
  const auto shown = [&](int r) {
    std::string s = all.substr(static_cast<size_t>(r) * width, static_cast<size_t>(lengths[r]));
    if (!s.empty()) s.pop_back();
    std::replace(s.begin(), s.end(), '\0', ' ');
    return s;
  };
  for (int r = 1; r < P; ++r) {
    if (all.compare(static_cast<size_t>(r) * width, width, all, 0, width) == 0) continue;
    throw AgreedError(
        concat("ranks were started with different options (every rank needs the same command line): "
               "rank 0 has `",
               shown(0), "`, rank ", r, " has `", shown(r), "`"));
  }
}

}  // namespace rf::comm
