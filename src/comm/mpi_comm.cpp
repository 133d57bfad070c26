// ringflex comm: the MPI backend (see mpi_comm.h).
#include "comm/mpi_comm.h"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "comm/blocked_time.h"
#include "core/error.h"

namespace rf::comm {
namespace {

// How long a waiting rank sleeps between MPI_Test polls: kPollSleep first, doubled after each poll that finds the
// requests pending, up to kPollSleepMax. A short wait (a ring step's transfer) is polled every 20 us, so it ends
// within about its own length again; a long one (a peer still computing) wakes 1000 times a second, not 50000: on
// a machine with more runnable threads than cores each wake-up (MPI_Testall, a syscall, two context switches, ~20 us
// of CPU) came out of the computing rank's share, and in a profile of E2B's cut-down LoRA step at CP 2 beside other
// work the waiting rank spent 44% of its samples polling (BENCHMARKS.md, "E2B LoRA near the FLOP limit").
constexpr std::chrono::microseconds kPollSleep{20};
constexpr std::chrono::microseconds kPollSleepMax{1000};

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
// The time after a first test that found them pending counts as blocked (blocked_seconds).
bool poll_until(std::vector<MPI_Request>& reqs, Timeout timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::optional<detail::BlockedTime> blocked;
  std::chrono::microseconds sleep = kPollSleep;
  for (;;) {
    int done = 0;
    check_mpi(MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &done, MPI_STATUSES_IGNORE), "MPI_Testall");
    if (done) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    if (!blocked) blocked.emplace();
    std::this_thread::sleep_for(sleep);
    sleep = std::min(2 * sleep, kPollSleepMax);
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
             is_send_ ? "send " : "receive ", label_, is_send_ ? " to rank " : " from rank ", peer_,
             tag_ >= 0 ? concat(" (tag ", tag_, ")") : "");
  }

  bool test() override {
    int done = 0;
    check_mpi(MPI_Testall(static_cast<int>(reqs_.size()), reqs_.data(), &done, MPI_STATUSES_IGNORE), "MPI_Testall");
    return done != 0;
  }

 private:
  std::vector<MPI_Request> reqs_;
  int self_, peer_, tag_;  // tag_ < 0: a collective's message, whose channel tag means nothing to the reader
  bool is_send_;
  std::string label_;
};

class MpiComm final : public Communicator {
 public:
  MpiComm() {
    int initialised = 0;
    MPI_Initialized(&initialised);
    RF_CHECK(initialised, "the MPI communicator needs MPI_Init first");
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    // The duplicates are collectives over every rank: started non-blocking and polled, so a peer that never
    // arrives is an error after the deadline like any other wait, not a hang.
    std::vector<MPI_Request> req(2, MPI_REQUEST_NULL);
    check_mpi(MPI_Comm_idup(MPI_COMM_WORLD, &comm_, req.data()), "MPI_Comm_idup");
    check_mpi(MPI_Comm_idup(MPI_COMM_WORLD, &coll_, req.data() + 1), "MPI_Comm_idup");
    const Timeout timeout = default_timeout();
    RF_CHECK(poll_until(req, timeout), "rank ", rank_, ": timed out after ", timeout.count(),
             " ms creating the communicator (some rank never joined)");
    MPI_Comm_set_errhandler(coll_, MPI_ERRORS_RETURN);
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    map_to_world();
  }
  // A communicator made by split(): `comm` is the new group; its private collective twin is duplicated here (a
  // collective over the new group, polled with a deadline like the world's).
  MpiComm(MPI_Comm comm, Timeout timeout) : comm_(comm) {
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    map_to_world();
    std::vector<MPI_Request> req(1, MPI_REQUEST_NULL);
    check_mpi(MPI_Comm_idup(comm_, &coll_, req.data()), "MPI_Comm_idup");
    RF_CHECK(poll_until(req, timeout), "rank ", world_rank(rank_), ": timed out after ", timeout.count(),
             " ms creating a split communicator (some rank never joined)");
    MPI_Comm_set_errhandler(coll_, MPI_ERRORS_RETURN);
  }
  ~MpiComm() override {
    MPI_Comm_free(&coll_);
    MPI_Comm_free(&comm_);
  }
  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "mpi"; }

  RequestPtr isend(int peer, int tag, std::span<const SendBuffer> buffers, std::string label) override {
    check_user(peer, tag, label);
    return post_send(comm_, peer, tag, tag, buffers, std::move(label));
  }

  RequestPtr irecv(int peer, int tag, std::span<const RecvBuffer> buffers, std::string label) override {
    check_user(peer, tag, label);
    return post_recv(comm_, peer, tag, tag, buffers, std::move(label));
  }

  Traffic traffic() const override { return traffic_; }

  // The collectives are point-to-point messages on a private communicator (coll_, so they cannot match the
  // users' tags) rather than MPI_Iallgather / MPI_Ibcast: when one times out, the requests still pending say
  // exactly which peers never answered, and the error names them. Each rank sends and receives P - 1 blocks,
  // the same bytes as a ring allgather; matching is in posting order (MPI's non-overtaking rule per pair).
  void allgather(const void* send, void* recv, size_t bytes, Timeout timeout) override {
    const int n = to_count(bytes, "allgather");
    char* out = static_cast<char*>(recv);
    if (bytes > 0) std::memcpy(out + static_cast<size_t>(rank_) * bytes, send, bytes);
    std::vector<MPI_Request> reqs;
    std::vector<int> peers;  // peers[i]: the rank request i talks to
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      reqs.push_back(MPI_REQUEST_NULL);
      peers.push_back(p);
      check_mpi(MPI_Irecv(out + static_cast<size_t>(p) * bytes, n, MPI_BYTE, p, kCollectiveTag, coll_, &reqs.back()),
                "MPI_Irecv");
    }
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      reqs.push_back(MPI_REQUEST_NULL);
      peers.push_back(p);
      check_mpi(MPI_Isend(send, n, MPI_BYTE, p, kCollectiveTag, coll_, &reqs.back()), "MPI_Isend");
    }
    traffic_.bytes_sent += static_cast<uint64_t>(size_ - 1) * bytes;
    traffic_.bytes_received += static_cast<uint64_t>(size_ - 1) * bytes;
    finish_collective(reqs, peers, timeout, "allgather");
  }

  void broadcast(void* data, size_t bytes, int root, Timeout timeout) override {
    const int n = to_count(bytes, "broadcast");
    std::vector<MPI_Request> reqs;
    std::vector<int> peers;
    for (int p = 0; p < size_; ++p) {
      if (p == rank_ || (rank_ != root && p != root)) continue;
      reqs.push_back(MPI_REQUEST_NULL);
      peers.push_back(p);
      if (rank_ == root) {
        check_mpi(MPI_Isend(data, n, MPI_BYTE, p, kCollectiveTag, coll_, &reqs.back()), "MPI_Isend");
        traffic_.bytes_sent += bytes;
      } else {
        check_mpi(MPI_Irecv(data, n, MPI_BYTE, root, kCollectiveTag, coll_, &reqs.back()), "MPI_Irecv");
        traffic_.bytes_received += bytes;
      }
    }
    finish_collective(reqs, peers, timeout, concat("broadcast from rank ", root));
  }

  std::unique_ptr<Communicator> split(int color, int key, Timeout timeout) override {
    RF_CHECK(color >= 0, "rank ", world_rank(rank_), ": split color ", color, " must be >= 0");
    // MPI_Comm_split has no non-blocking form; a barrier with a deadline first makes sure every rank arrived, so
    // the blocking split cannot wait forever on a rank that never calls it.
    barrier(timeout);
    MPI_Comm sub = MPI_COMM_NULL;
    check_mpi(MPI_Comm_split(comm_, color, key, &sub), "MPI_Comm_split");
    return std::make_unique<MpiComm>(sub, timeout);
  }

 protected:
  // On coll_, above allgather's and broadcast's tag.
  RequestPtr channel_isend(int peer, int tag, std::span<const SendBuffer> buffers, std::string label) override {
    return post_send(coll_, peer, kChannelTag0 + tag, -1, buffers, std::move(label));
  }
  RequestPtr channel_irecv(int peer, int tag, std::span<const RecvBuffer> buffers, std::string label) override {
    return post_recv(coll_, peer, kChannelTag0 + tag, -1, buffers, std::move(label));
  }

 private:
  static constexpr int kCollectiveTag = 0;  // allgather's and broadcast's tag on coll_
  static constexpr int kChannelTag0 = 1;    // the channel's tags follow it
  static_assert(kChannelTag0 + kChannelTags <= kMaxTag, "MPI guarantees tags up to 32767 only");

  // One MPI message per buffer, counted as traffic when handed to MPI; `shown_tag` is what errors print (< 0: none).
  RequestPtr post_send(MPI_Comm comm, int peer, int tag, int shown_tag, std::span<const SendBuffer> buffers,
                       std::string label) {
    std::vector<MPI_Request> reqs(buffers.size(), MPI_REQUEST_NULL);
    for (size_t i = 0; i < buffers.size(); ++i) {
      check_mpi(MPI_Isend(buffers[i].data, to_count(buffers[i].bytes, label), MPI_BYTE, peer, tag, comm, &reqs[i]),
                "MPI_Isend");
      if (peer != rank_) traffic_.bytes_sent += buffers[i].bytes;
    }
    return std::make_unique<MpiRequest>(std::move(reqs), world_rank(rank_), world_rank(peer), shown_tag, true,
                                        std::move(label));
  }
  RequestPtr post_recv(MPI_Comm comm, int peer, int tag, int shown_tag, std::span<const RecvBuffer> buffers,
                       std::string label) {
    std::vector<MPI_Request> reqs(buffers.size(), MPI_REQUEST_NULL);
    for (size_t i = 0; i < buffers.size(); ++i) {
      check_mpi(MPI_Irecv(buffers[i].data, to_count(buffers[i].bytes, label), MPI_BYTE, peer, tag, comm, &reqs[i]),
                "MPI_Irecv");
      if (peer != rank_) traffic_.bytes_received += buffers[i].bytes;
    }
    return std::make_unique<MpiRequest>(std::move(reqs), world_rank(rank_), world_rank(peer), shown_tag, false,
                                        std::move(label));
  }

  // Waits for a collective's requests; on timeout names every peer whose request is still pending, then
  // abandons the requests (cancelled, so MPI never writes into the caller's buffers afterwards).
  void finish_collective(std::vector<MPI_Request>& reqs, const std::vector<int>& peers, Timeout timeout,
                         const std::string& what) {
    if (poll_until(reqs, timeout)) return;
    std::string missing;
    for (size_t i = 0; i < reqs.size(); ++i) {
      int done = 0;
      if (reqs[i] != MPI_REQUEST_NULL) MPI_Test(&reqs[i], &done, MPI_STATUS_IGNORE);
      if (reqs[i] == MPI_REQUEST_NULL || done) continue;
      const std::string peer = std::to_string(world_rank(peers[i]));
      if (missing.find(" " + peer + ",") == std::string::npos) missing += " " + peer + ",";
      MPI_Cancel(&reqs[i]);
      MPI_Request_free(&reqs[i]);
    }
    if (!missing.empty()) missing.pop_back();
    const std::string step = Step::current();
    rf::fail("rank ", world_rank(rank_), ": timed out after ", timeout.count(), " ms in ", what,
             ": no answer from rank", missing, step.empty() ? "" : " (while " + step + ")");
  }

  void check_user(int peer, int tag, const std::string& label) const {
    RF_CHECK(peer >= 0 && peer < size_, "rank ", world_rank(rank_), ": ", label, ": peer ", peer, " is not a rank of ",
             size_);
    RF_CHECK(tag >= 0 && tag < kMaxTag, "rank ", world_rank(rank_), ": ", label, ": tag ", tag, " outside [0, ",
             kMaxTag, ")");
  }

  // Errors name ranks by their number in the job (MPI_COMM_WORLD), whatever communicator timed out: a split one (the
  // trainer's CP and DP groups) numbers its ranks anew, and "rank 1" of a group would send a user to the wrong
  // process. world_[r]: the job's rank of this communicator's rank r.
  void map_to_world() {
    MPI_Group group = MPI_GROUP_NULL, world_group = MPI_GROUP_NULL;
    MPI_Comm_group(comm_, &group);
    MPI_Comm_group(MPI_COMM_WORLD, &world_group);
    std::vector<int> ranks(static_cast<size_t>(size_));
    for (int r = 0; r < size_; ++r) ranks[static_cast<size_t>(r)] = r;
    world_.assign(ranks.size(), MPI_UNDEFINED);
    check_mpi(MPI_Group_translate_ranks(group, size_, ranks.data(), world_group, world_.data()),
              "MPI_Group_translate_ranks");
    MPI_Group_free(&group);
    MPI_Group_free(&world_group);
  }
  int world_rank(int r) const { return r >= 0 && r < size_ ? world_[static_cast<size_t>(r)] : r; }

  MPI_Comm comm_ = MPI_COMM_NULL;  // the users' point-to-point traffic
  MPI_Comm coll_ = MPI_COMM_NULL;  // the collectives' (allgather, broadcast, the channel of collectives.cpp)
  int rank_ = 0, size_ = 1;
  std::vector<int> world_;
  Traffic traffic_;
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_world() { return std::make_unique<MpiComm>(); }

}  // namespace rf::comm
