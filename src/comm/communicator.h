// ringflex comm: the one interface through which ranks exchange bytes (docs/spec.md §6), and its small collectives.
//
// The ring needs non-blocking point-to-point transfers of several buffers at once (K, V and their metadata
// travel together) that it can post *before* computing and complete after, each wait bounded by a deadline so a
// dead or disagreeing peer turns into an rf::Error instead of a hang. The CLI and the trainer also need a few
// small collectives (header agreement, loss counts).
//
// Backends: MPI (mpi_comm.h, between processes) and an in-process loopback with one thread per rank
// (loopback_comm.h, for fast deterministic tests). The contract is written so that a NCCL backend fits:
//   - buffers are opaque pointers the backend may hand to a device engine; the interface never reads them on the
//     host, and callers never touch a send buffer (or read a receive buffer) until its request's wait returned;
//   - a request completes only through wait(); there is no callback or host-side polling promise;
//   - messages between one pair of ranks with one tag are matched in the order they were posted (MPI's and
//     NCCL's stream-order guarantee), and both sides post the same buffer sizes in the same order.
// Collectives are built on allgather/broadcast and reduce in rank order, so every backend gives the same bits.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace rf::comm {

using Timeout = std::chrono::milliseconds;
constexpr Timeout kDefaultTimeout{120000};  // generous: a rank may be computing a long chunk meanwhile

// The deadline of every wait whose caller does not choose one: kDefaultTimeout until the executable sets it
// (`ringflex ... --timeout SECONDS`, once, before any communication). A peer that stops answering (dead, hung,
// SIGSTOPped) then ends the job within this time on every rank that waits for it.
Timeout default_timeout();
void set_default_timeout(Timeout timeout);

// Names what the calling thread is doing, for its scope, in the timeout messages of collectives (which, unlike
// point-to-point transfers, carry no label): "rank 0: timed out ... in allgather: no answer from rank 1 (while
// gathering the outputs)". Scopes nest; the innermost names the step.
class Step {
 public:
  explicit Step(std::string what);
  ~Step();
  Step(const Step&) = delete;
  Step& operator=(const Step&) = delete;
  static std::string current();  // "" outside every Step

 private:
  std::string previous_;
};

struct SendBuffer {
  const void* data;
  size_t bytes;
};
struct RecvBuffer {
  void* data;
  size_t bytes;
};

// One posted transfer. Destroying a request that was never waited for abandons it (only on error paths).
class Request {
 public:
  virtual ~Request() = default;
  // Blocks until the transfer completed; throws rf::Error naming this rank, the peer, the tag and the label
  // when `timeout` passes first.
  virtual void wait(Timeout timeout) = 0;
};
using RequestPtr = std::unique_ptr<Request>;

// Waits every non-null request in order and resets it.
void wait_all(std::span<RequestPtr> requests, Timeout timeout);

enum class ReduceOp { Sum, Min, Max };

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string backend() const = 0;  // "mpi", "loopback"

  // Non-blocking send / receive of several buffers to / from `peer` with user tag `tag` (0 <= tag < kMaxTag).
  // `label` only names the transfer in timeout errors (e.g. "K/V of step 3").
  virtual RequestPtr isend(int peer, int tag, std::span<const SendBuffer> buffers, std::string label) = 0;
  virtual RequestPtr irecv(int peer, int tag, std::span<const RecvBuffer> buffers, std::string label) = 0;

  // recv: [size(), bytes]; rank i's `send` lands at recv + i * bytes. Every rank passes the same `bytes`.
  virtual void allgather(const void* send, void* recv, size_t bytes, Timeout timeout) = 0;
  // `data` [bytes] on `root` is copied to every rank.
  virtual void broadcast(void* data, size_t bytes, int root, Timeout timeout) = 0;

  // A collective call (MPI_Comm_split): ranks passing the same `color` (>= 0) form one new communicator, ranked by
  // (`key`, rank here). The trainer's cp x dp grid is two splits of the world. The result is independent of this
  // communicator (its messages never match ours); on the loopback backend it lives as long as the run_ranks world.
  virtual std::unique_ptr<Communicator> split(int color, int key, Timeout timeout = default_timeout()) = 0;

  void barrier(Timeout timeout = default_timeout());
  // In-place elementwise reduction over ranks, summed in rank order 0..P-1 (deterministic on every backend).
  void allreduce(double* data, size_t n, ReduceOp op, Timeout timeout = default_timeout());
  void allreduce(int64_t* data, size_t n, ReduceOp op, Timeout timeout = default_timeout());
  // float32 (parameter gradients, hundreds of MB): each element's P values are combined in rank order in double
  // and rounded once, so the result is the same bits on every rank and backend and no worse than one rounding.
  // Works through slices whose gathered copies take at most kReduceSliceBytes, so the extra memory stays bounded
  // whatever n is.
  void allreduce(float* data, size_t n, ReduceOp op, Timeout timeout = default_timeout());
  static constexpr size_t kReduceSliceBytes = size_t{8} << 20;

  static constexpr int kMaxTag = 1 << 15;  // MPI guarantees tags up to 32767
};

}  // namespace rf::comm
