// ringflex cli: rank agreement over MPI_COMM_WORLD (see agree.h). Two small collectives per step: a MIN
// all-reduce finds the lowest failing rank, which then broadcasts its message.
#include "cli/agree.h"

#include <mpi.h>

#include <climits>
#include <vector>

namespace rf::cli {

namespace {

constexpr int kNoFailure = INT_MAX;  // the MIN all-reduce's identity: no rank failed

}  // namespace

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

int world_size() {
  int p = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &p);
  return p;
}

void agree(const std::function<void()>& step) {
  std::string message;
  int failed = kNoFailure;
  try {
    step();
  } catch (const rf::Error& e) {
    message = e.what();
    failed = world_rank();
  }
  int first = kNoFailure;
  MPI_Allreduce(&failed, &first, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (first == kNoFailure) return;
  int length = static_cast<int>(message.size());
  MPI_Bcast(&length, 1, MPI_INT, first, MPI_COMM_WORLD);
  message.resize(static_cast<size_t>(length));
  MPI_Bcast(message.data(), length, MPI_CHAR, first, MPI_COMM_WORLD);
  throw AgreedError(message);
}

void agree_equal(std::span<const int64_t> values, const std::string& what) {
  const int n = static_cast<int>(values.size());
  std::vector<int64_t> lo(values.size()), hi(values.size());
  MPI_Allreduce(values.data(), lo.data(), n, MPI_INT64_T, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(values.data(), hi.data(), n, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
  if (lo != hi) throw AgreedError(concat("ranks disagree on ", what));
}

}  // namespace rf::cli
