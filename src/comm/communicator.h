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
//   - a request completes only through wait() or test() (a stream query, for NCCL); there is no callback;
//   - messages between one pair of ranks with one tag are matched in the order they were posted (MPI's and
//     NCCL's stream-order guarantee), and both sides post the same buffer sizes in the same order.
// Collectives reduce in rank order, so every backend gives the same bits. The small ones (int64 and double
// all-reduce, barrier) are an allgather and a local reduction: a few numbers, where one message per peer is
// cheapest. The large ones (collectives.cpp: reduce-scatter, all-gather of slices, the float all-reduce built from
// them, all-to-all-v) are written once over each backend's private point-to-point channel, each rank sending and
// receiving about (P - 1)/P of the buffer per phase.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
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
  // Never blocks: true once the transfer completed (a later wait() returns at once). It also lets the backend move
  // data (MPI advances a large message only while some call is inside the library), which is what a collective
  // posted before a computation needs between its steps. Throws like wait() when the transfer cannot complete.
  virtual bool test() = 0;
};
using RequestPtr = std::unique_ptr<Request>;

// The part of a buffer of n elements that rank r of P owns in the sliced collectives (reduce_scatter,
// allgather_slices, the float all-reduce) and in anything sharded like them: the buffer is cut, in rank order,
// into P slices of ceil(n / P) elements each (FSDP's padded shards: every slice fits a buffer of that size), the
// last ones clipped at n. So n need not divide by P: at n = 10, P = 4 the slices are [0, 3) [3, 6) [6, 9)
// [9, 10), and at n = 2, P = 4 ranks 2 and 3 own empty slices [2, 2). Rank 0's slice is never smaller than any
// other's.
struct Slice {
  size_t begin = 0, end = 0;
  size_t size() const { return end - begin; }
  bool empty() const { return begin == end; }
};
Slice slice_of(size_t n, int P, int r);

// A collective started with Communicator::post_*: its transfers travel while the caller computes (a layer's weights
// gathered, or its gradients reduced, while another layer computes). Until wait() returned or progress() returned
// true the caller
// must not touch the collective's buffers. Every rank posts its collectives on a communicator in the same order
// (they are matched by that order, as MPI's non-blocking collectives are), and at most kMaxPosted may be in flight.
// Destroying one that is not finished (an error path) abandons its transfers.
class PostedCollective {
 public:
  virtual ~PostedCollective() = default;
  // Advances without blocking: takes what arrived, does the local work of finished chunks (the rank-order sums)
  // and posts the next chunks. True once the collective is complete.
  virtual bool progress() = 0;
  // Blocks until complete. Each wait for one transfer is bounded by `timeout`: a peer silent that long turns into
  // an rf::Error naming this rank, the peer, and what was being moved.
  virtual void wait(Timeout timeout = default_timeout()) = 0;
  static constexpr int kMaxPosted = 4096;
};
using PostedPtr = std::unique_ptr<PostedCollective>;

namespace detail {
class Channel;  // collectives.cpp: one posted collective's view of the backend's private point-to-point channel
}

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
  // In-place elementwise reduction over ranks, combined in rank order 0..P-1 (deterministic on every backend).
  // These two carry a few numbers (loss sums, token counts, flags): one allgather of the whole buffer, each rank
  // receiving (P - 1) x n values, is cheapest at that size, so they stay on it.
  void allreduce(double* data, size_t n, ReduceOp op, Timeout timeout = default_timeout());
  void allreduce(int64_t* data, size_t n, ReduceOp op, Timeout timeout = default_timeout());

  // --- Collectives that scale (collectives.cpp): parameter gradients and sharded state, hundreds of MB -----------
  // float32 data [n], in place: afterwards this rank's slice (slice_of(n, size(), rank())) holds, for each element,
  // its P values combined in rank order 0..P-1 in double and rounded once: the same bits on every rank and backend
  // and no worse than one rounding. The rest of `data` is left as it was. Each rank sends the other owners their
  // slices, (n - own slice) elements, and receives the P - 1 contributions to its own slice: each about
  // (P - 1)/P of the buffer. Extra memory stays under kReduceSliceBytes whatever n is.
  void reduce_scatter(float* data, size_t n, ReduceOp op, Timeout timeout = default_timeout());
  // data [n elements of elem_bytes each] (float32: 4, bfloat16 working weights: 2), in place: each rank holds its
  // slice (slice_of) and afterwards every rank holds the whole buffer. Each rank sends its slice to P - 1 ranks and
  // receives the other slices: about (P - 1)/P of the buffer each way.
  void allgather_slices(void* data, size_t n, size_t elem_bytes, Timeout timeout = default_timeout());
  // data [sum of part_bytes] in place, with parts of any sizes: rank p's part, part_bytes[p] bytes, starts after
  // those of ranks 0..p-1. Every rank passes the same part_bytes; afterwards every rank holds every part.
  void allgatherv(void* data, std::span<const size_t> part_bytes, Timeout timeout = default_timeout());
  // float32 all-reduce = reduce_scatter then allgather_slices, each element combined as reduce_scatter says (the
  // same bits as the allgather-then-sum it replaced, at every P); each rank sends and receives about
  // 2 (P - 1)/P of the buffer instead of (P - 1) x.
  void allreduce(float* data, size_t n, ReduceOp op, Timeout timeout = default_timeout());
  // The same over several buffers taken as their concatenation (a model's gradient tensors): one collective and one
  // set of messages for all of them, with no flat copy. Every rank passes the same number of buffers and sizes.
  void allreduce(std::span<const std::span<float>> buffers, ReduceOp op, Timeout timeout = default_timeout());
  // Personalised exchange (expert parallelism's dispatch and combine). This rank sends send_bytes[p] bytes to each
  // rank p, taken from `send` in rank order (rank 0's part first), and receives recv_bytes[p] bytes from each p
  // into `recv` in rank order: where a byte lands depends on the counts alone, never on the order of arrival. Its
  // own part is copied. recv_bytes[p] must be what rank p sends here (known, or from alltoall_counts first); `send`
  // and `recv` must not overlap.
  void alltoallv(const void* send, std::span<const size_t> send_bytes, void* recv, std::span<const size_t> recv_bytes,
                 Timeout timeout = default_timeout());
  // What every rank will send here in an alltoallv whose send counts here are `send_bytes` (one count per pair).
  std::vector<size_t> alltoall_counts(std::span<const size_t> send_bytes, Timeout timeout = default_timeout());

  // The same collectives started without waiting (PostedCollective: wait, or progress between computations).
  PostedPtr post_reduce_scatter(float* data, size_t n, ReduceOp op);
  PostedPtr post_allreduce(std::span<const std::span<float>> buffers, ReduceOp op);
  PostedPtr post_allgatherv(void* data, std::span<const size_t> part_bytes);
  PostedPtr post_alltoallv(const void* send, std::span<const size_t> send_bytes, void* recv,
                           std::span<const size_t> recv_bytes);

  // A reduction onto owners' parts of any sizes, some contributions sparse (the sharded store's gradients: a layer's
  // pieces, the head's, a token table's gradient rows). Rank q owns part_elems[q] elements (every rank passes the
  // same part_elems). This rank contributes to owner q's part the runs to[q] (sorted, disjoint, in the coordinates of
  // q's part), their values packed in `send` owner after owner, run after run; from[p] are the runs rank p
  // contributes to this rank's part (what p passes as its to[rank()]; from[rank()] == to[rank()]). A rank's missing
  // element counts as +0. Each element of this rank's part gets its P values combined in rank order 0..P-1 in double
  // and rounded once (reduce_scatter's combination), handed to `done(begin, sums)` chunk by chunk in element order
  // (from progress() or wait()). Traffic: each rank sends its runs' values and receives the others' contributions
  // to its part, nothing more. Memory: the owner receives its part in rounds of reduce_parts_chunk elements, two in
  // flight, so its buffers (reduce_parts_bytes) stay within `budget_bytes` whatever the parts' sizes (a part may
  // be a whole tensor: a head inside one rank's slice).
  using PartSums = std::function<void(size_t begin, std::span<const float> sums)>;
  PostedPtr post_reduce_parts(const float* send, std::span<const size_t> part_elems, std::vector<std::vector<Slice>> to,
                              std::vector<std::vector<Slice>> from, PartSums done,
                              size_t budget_bytes = kReduceSliceBytes);
  // Elements of one round's chunk of a part at P ranks within `budget_bytes` (at least one), and the bytes of the
  // buffers post_reduce_parts holds on a rank whose own part has `part` elements: [rounds in flight (2, or 1 for a
  // part of one chunk), P, chunk clipped at the part] floats, the P contributions (this rank's own copied into its
  // row); none at P = 1, where a rank covers its part whole (the store's case) and hands its values over as they are.
  static size_t reduce_parts_chunk(int P, size_t budget_bytes);
  static size_t reduce_parts_bytes(int P, size_t part, size_t budget_bytes);

  // The extra memory of a reduction whatever its n: two chunks in flight of the P - 1 contributions to this rank's
  // slice, plus a double accumulator (collectives.cpp). post_reduce_parts' default budget too: at N = 32 a chunk of
  // 32K elements (128 KiB from each rank), messages long enough that their latency stays small beside their bytes.
  static constexpr size_t kReduceSliceBytes = size_t{8} << 20;
  // Elements of one chunk of a rank's slice in reduce_scatter and allreduce at P ranks: what fits the budget above.
  static size_t reduce_chunk(int P);

  // Bytes this rank handed to other ranks and took from them through this communicator since it was made: every
  // transfer, point-to-point and collective (a rank's copies to itself are not traffic). Counted by the backend
  // where each message meets the transport; the tests and bench_collectives measure a collective as the
  // difference across the call.
  struct Traffic {
    uint64_t bytes_sent = 0, bytes_received = 0;
  };
  virtual Traffic traffic() const = 0;

  static constexpr int kMaxTag = 1 << 15;  // MPI guarantees tags up to 32767

 protected:
  // The backend's private point-to-point channel for the collectives of collectives.cpp: it never matches the
  // users' isend/irecv, nor allgather/broadcast. Tags in [0, kChannelTags); messages between a pair with one tag
  // are matched in posting order, and a message of several buffers matches a receive of as many buffers of the
  // same sizes (as isend/irecv). Requests' timeout errors name the rank, the peer and the label.
  static constexpr int kChannelTags = 2 * PostedCollective::kMaxPosted;
  virtual RequestPtr channel_isend(int peer, int tag, std::span<const SendBuffer> buffers, std::string label) = 0;
  virtual RequestPtr channel_irecv(int peer, int tag, std::span<const RecvBuffer> buffers, std::string label) = 0;

 private:
  friend class detail::Channel;
  uint64_t collectives_posted_ = 0;  // every rank counts the same: its channel messages' tags come from it
};

}  // namespace rf::comm
