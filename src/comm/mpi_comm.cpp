// ringflex comm: the MPI backend (see mpi_comm.h).
#include "comm/mpi_comm.h"

#include <mpi.h>

#include <climits>
#include <thread>
#include <vector>

#include "core/error.h"

namespace rf::comm {
namespace {

// How long a waiting rank sleeps between MPI_Test polls. Short enough to add no visible latency to a ring step
// (which computes for milliseconds or more), long enough that an oversubscribed core goes to the rank that
// is computing instead of to a spinning one.
constexpr std::chrono::microseconds kPollSleep{20};

void check_mpi(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  rf::fail(what, " failed: ", std::string(text, static_cast<size_t>(len)));
}

int to_count(size_t bytes, const std::string& label) {
  RF_CHECK(bytes <= static_cast<size_t>(INT_MAX), label, ": a buffer of ", bytes,
           " bytes exceeds MPI's int count; split it");
  return static_cast<int>(bytes);
}

// Polls until every request completed or the deadline passed; returns false on timeout.
bool poll_until(std::vector<MPI_Request>& reqs, Timeout timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    int done = 0;
    check_mpi(MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &done, MPI_STATUSES_IGNORE), "MPI_Testall");
    if (done) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(kPollSleep);
  }
}

class MpiRequest final : public Request {
 public:
  MpiRequest(std::vector<MPI_Request> reqs, int self, int peer, int tag, bool is_send, std::string label)
      : reqs_(std::move(reqs)), self_(self), peer_(peer), tag_(tag), is_send_(is_send), label_(std::move(label)) {}

  ~MpiRequest() override {
    // Abandoned on an error path: cancel what is pending so MPI does not write into freed memory later.
    for (MPI_Request& r : reqs_) {
      if (r == MPI_REQUEST_NULL) continue;
      MPI_Cancel(&r);
      MPI_Request_free(&r);
    }
  }

  void wait(Timeout timeout) override {
    RF_CHECK(poll_until(reqs_, timeout), "rank ", self_, ": timed out after ", timeout.count(), " ms waiting to ",
             is_send_ ? "send " : "receive ", label_, is_send_ ? " to rank " : " from rank ", peer_, " (tag ", tag_,
             ")");
  }

 private:
  std::vector<MPI_Request> reqs_;
  int self_, peer_, tag_;
  bool is_send_;
  std::string label_;
};

class MpiComm final : public Communicator {
 public:
  // Takes ownership of `comm` (a duplicate of the world, or the result of a split).
  explicit MpiComm(MPI_Comm comm) : comm_(comm) {
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  ~MpiComm() override { MPI_Comm_free(&comm_); }
  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "mpi"; }

  RequestPtr isend(int peer, int tag, std::span<const SendBuffer> buffers, std::string label) override {
    check_user(peer, tag, label);
    std::vector<MPI_Request> reqs(buffers.size(), MPI_REQUEST_NULL);
    for (size_t i = 0; i < buffers.size(); ++i)
      check_mpi(MPI_Isend(buffers[i].data, to_count(buffers[i].bytes, label), MPI_BYTE, peer, tag, comm_, &reqs[i]),
                "MPI_Isend");
    return std::make_unique<MpiRequest>(std::move(reqs), rank_, peer, tag, true, std::move(label));
  }

  RequestPtr irecv(int peer, int tag, std::span<const RecvBuffer> buffers, std::string label) override {
    check_user(peer, tag, label);
    std::vector<MPI_Request> reqs(buffers.size(), MPI_REQUEST_NULL);
    for (size_t i = 0; i < buffers.size(); ++i)
      check_mpi(MPI_Irecv(buffers[i].data, to_count(buffers[i].bytes, label), MPI_BYTE, peer, tag, comm_, &reqs[i]),
                "MPI_Irecv");
    return std::make_unique<MpiRequest>(std::move(reqs), rank_, peer, tag, false, std::move(label));
  }

  void allgather(const void* send, void* recv, size_t bytes, Timeout timeout) override {
    std::vector<MPI_Request> req(1, MPI_REQUEST_NULL);
    const int n = to_count(bytes, "allgather");
    check_mpi(MPI_Iallgather(send, n, MPI_BYTE, recv, n, MPI_BYTE, comm_, req.data()), "MPI_Iallgather");
    RF_CHECK(poll_until(req, timeout), "rank ", rank_, ": timed out after ", timeout.count(),
             " ms in allgather (some rank never joined)");
  }

  void broadcast(void* data, size_t bytes, int root, Timeout timeout) override {
    std::vector<MPI_Request> req(1, MPI_REQUEST_NULL);
    check_mpi(MPI_Ibcast(data, to_count(bytes, "broadcast"), MPI_BYTE, root, comm_, req.data()), "MPI_Ibcast");
    RF_CHECK(poll_until(req, timeout), "rank ", rank_, ": timed out after ", timeout.count(),
             " ms in broadcast from rank ", root);
  }

  std::unique_ptr<Communicator> split(int color, int key, Timeout timeout) override {
    RF_CHECK(color >= 0, "rank ", rank_, ": split color ", color, " must be >= 0");
    // MPI_Comm_split has no non-blocking form; a barrier with a deadline first makes sure every rank arrived, so
    // the blocking split cannot wait forever on a rank that never calls it.
    barrier(timeout);
    MPI_Comm sub = MPI_COMM_NULL;
    check_mpi(MPI_Comm_split(comm_, color, key, &sub), "MPI_Comm_split");
    return std::make_unique<MpiComm>(sub);
  }

 private:
  void check_user(int peer, int tag, const std::string& label) const {
    RF_CHECK(peer >= 0 && peer < size_, "rank ", rank_, ": ", label, ": peer ", peer, " is not a rank of ", size_);
    RF_CHECK(tag >= 0 && tag < kMaxTag, "rank ", rank_, ": ", label, ": tag ", tag, " outside [0, ", kMaxTag, ")");
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_world() {
  int initialised = 0;
  MPI_Initialized(&initialised);
  RF_CHECK(initialised, "the MPI communicator needs MPI_Init first");
  MPI_Comm world = MPI_COMM_NULL;
  check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &world), "MPI_Comm_dup");
  return std::make_unique<MpiComm>(world);
}

}  // namespace rf::comm
