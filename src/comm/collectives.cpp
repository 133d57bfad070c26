// ringflex comm: the collectives that scale (reduce-scatter, all-gather of slices, the float all-reduce built from
// them, all-to-all-v), written once over each backend's private point-to-point channel (communicator.h).
//
// The float all-reduce must keep its bits: every element is the rank-order sum 0..P-1 in double, rounded once.
// Two ways to cut its traffic from (P - 1) x the buffer to about 2 (P - 1)/P x were weighed:
//   - A ring reduce-scatter (P - 1 steps, each rank adding its part to a running sum and passing it on) keeps one
//     small message per link per step, but accumulates chunk c in the order c+1, c+2, ..., c: a different order
//     for every chunk, and in float32 a rounding per step. Keeping rank order on a ring means every chunk's sum
//     starting at rank 0 and carried as double partial sums through all P ranks: 8 bytes an element through every
//     rank, 2P/(P - 1) x the traffic of the direct scheme below.
//   - Direct: each rank sends every other owner the float32 values of that owner's slice, and receives the P - 1
//     contributions to its own slice. That is (P - 1)/P of the buffer each way, the least a reduce-scatter can move,
//     and the owner holds all P values of an element, so it combines them in rank order exactly as the
//     allgather-then-sum did. All of a rank's links carry data at once (posted in pairwise order, to r + s and from
//     r - s, so the first messages spread over every rank instead of all landing on rank 0); the price is P - 1
//     messages per chunk instead of one, i.e. latency, which matters for tiny buffers or hundreds of ranks (where a
//     hierarchical scheme would come next), not for gradients.
// So: direct. Summing as contributions arrive would still have to add them in rank order, waiting for rank p's
// before p+1's, so the owner keeps a chunk's P - 1 receive buffers [P - 1, C] and sums once all arrived, row after
// row into a double accumulator [C]: per element the same order, and each row a vectorisable pass.
// The all-gather that follows sends each owner's finished chunk to every rank, posted as soon as the chunk is summed
// (so it travels while the next chunk is summed), straight into the callers' buffers.
//
// Chunks and memory: a slice is worked in chunks of C = kReduceSliceBytes / (8 P) elements. Two chunks are in
// flight (chunk k+1 arrives while chunk k is summed): 2 x [P - 1, C] floats of receive buffers and [C] doubles of
// accumulator, 8 P C bytes, within kReduceSliceBytes whatever n is. Every rank derives the chunk count from n and P
// alone (rank 0's slice is the longest), so all post the same messages.
// Deadlines: every wait for one transfer is bounded by the caller's timeout, and a transfer that runs out of it
// throws from the backend naming this rank, the peer, and the collective (with the Step it ran in).
#include <algorithm>
#include <cstring>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "core/error.h"

namespace rf::comm {

Slice slice_of(size_t n, int P, int r) {
  RF_CHECK(P >= 1 && r >= 0 && r < P, "slice_of: rank ", r, " is not a rank of ", P);
  const size_t per = n / static_cast<size_t>(P) + (n % static_cast<size_t>(P) != 0 ? 1 : 0);  // ceil(n / P)
  const size_t begin = std::min(n, per * static_cast<size_t>(r));
  return {begin, std::min(n, begin + per)};
}

size_t Communicator::reduce_chunk(int P) {
  constexpr size_t kBytesPerElementAndRank = 8;  // 2 chunks in flight x 4 bytes, and the 8-byte accumulator over P
  return std::max<size_t>(1, kReduceSliceBytes / (kBytesPerElementAndRank * static_cast<size_t>(std::max(P, 1))));
}

namespace detail {

// One posted collective's access to the channel: its own pair of tags (from the communicator's count of posted
// collectives, the same on every rank), and labels that say what moves, for the timeout errors.
class Channel {
 public:
  Channel(Communicator& c, std::string what)
      : c_(c), tag_(static_cast<int>(c.collectives_posted_++ % PostedCollective::kMaxPosted) * kPhases) {
    const std::string step = Step::current();
    what_ = step.empty() ? std::move(what) : concat(what, " (while ", step, ")");
  }
  int rank() const { return c_.rank(); }
  int size() const { return c_.size(); }

  // phase: 0 or 1, so a collective's two kinds of message (contributions, finished slices) never match each other.
  RequestPtr send(int peer, int phase, std::span<const SendBuffer> buffers, const std::string& part) {
    return c_.channel_isend(peer, tag_ + phase, buffers, concat(what_, ": ", part));
  }
  RequestPtr recv(int peer, int phase, std::span<const RecvBuffer> buffers, const std::string& part) {
    return c_.channel_irecv(peer, tag_ + phase, buffers, concat(what_, ": ", part));
  }

  static constexpr int kPhases = 2;
  static_assert(Communicator::kChannelTags == PostedCollective::kMaxPosted * kPhases);

 private:
  Communicator& c_;
  int tag_;
  std::string what_;
};

}  // namespace detail

namespace {

using detail::Channel;

constexpr size_t kRoundsInFlight = 2;  // round k+1's transfers travel while round k's local work runs

// MPI counts in int; one message stays well below INT_MAX bytes, and both sides cut a part the same way.
constexpr size_t kMaxMessageBytes = size_t{1} << 30;

// A collective as rounds of transfers. Round k's messages are posted kRoundsInFlight rounds ahead; once they all
// completed, finish(k) does the round's local work and may post transfers of its own (the all-reduce's gather of a
// just-summed chunk), which are waited together with the next round's.
class RoundCollective : public PostedCollective {
 public:
  bool progress() final {
    while (!batches_.empty()) {
      for (RequestPtr& q : batches_.front().requests) {
        if (q && !q->test()) return false;
        q.reset();
      }
      complete_front();
    }
    return true;
  }

  void wait(Timeout timeout) final {
    while (!batches_.empty()) {
      wait_all(batches_.front().requests, timeout);
      complete_front();
    }
  }

 protected:
  explicit RoundCollective(size_t rounds) : rounds_(rounds) {}
  // The derived constructor calls it once its state is ready.
  void start() {
    while (posted_ < std::min(rounds_, kRoundsInFlight)) post_next();
  }
  virtual void post(size_t round, std::vector<RequestPtr>& requests) = 0;
  virtual void finish(size_t /*round*/, std::vector<RequestPtr>& /*later*/) {}

 private:
  static constexpr size_t kNoRound = ~size_t{0};  // a batch of late transfers alone, after the last round
  struct Batch {
    size_t round;
    std::vector<RequestPtr> requests;
  };

  void post_next() {
    batches_.push_back({posted_, {}});
    post(posted_, batches_.back().requests);
    ++posted_;
  }

  void complete_front() {
    const size_t round = batches_.front().round;
    batches_.pop_front();
    std::vector<RequestPtr> later;
    if (round != kNoRound) finish(round, later);
    if (posted_ < rounds_) post_next();
    if (later.empty()) return;
    if (batches_.empty()) batches_.push_back({kNoRound, {}});
    for (RequestPtr& q : later) batches_.front().requests.push_back(std::move(q));
  }

  size_t rounds_, posted_ = 0;
  std::deque<Batch> batches_;
};

// Several float buffers seen as their concatenation: element i of the whole lies in buffer j where
// offsets_[j] <= i < offsets_[j + 1].
class Pieces {
 public:
  explicit Pieces(std::span<const std::span<float>> buffers) : buffers_(buffers.begin(), buffers.end()) {
    offsets_.push_back(0);
    for (const std::span<float>& b : buffers_) offsets_.push_back(offsets_.back() + b.size());
  }
  size_t size() const { return offsets_.back(); }

  // fn(float* run, size_t length, size_t at) for the runs covering [begin, end) in order; `at` counts from begin.
  template <typename Fn>
  void for_runs(size_t begin, size_t end, Fn&& fn) const {
    size_t j = static_cast<size_t>(std::upper_bound(offsets_.begin(), offsets_.end(), begin) - offsets_.begin()) - 1;
    for (size_t i = begin; i < end; ++j) {
      const size_t stop = std::min(end, offsets_[j + 1]);
      if (stop > i) fn(buffers_[j].data() + (i - offsets_[j]), stop - i, i - begin);
      i = std::max(i, stop);
    }
  }
  std::vector<SendBuffer> send_runs(size_t begin, size_t end) const {
    std::vector<SendBuffer> out;
    for_runs(begin, end, [&](float* p, size_t len, size_t) { out.push_back({p, len * sizeof(float)}); });
    return out;
  }
  std::vector<RecvBuffer> recv_runs(size_t begin, size_t end) const {
    std::vector<RecvBuffer> out;
    for_runs(begin, end, [&](float* p, size_t len, size_t) { out.push_back({p, len * sizeof(float)}); });
    return out;
  }

 private:
  std::vector<std::span<float>> buffers_;
  std::vector<size_t> offsets_;  // [buffers + 1]
};

// A received contribution's runs land contiguously in a row of the receive buffer, cut like the sender's runs (both
// sides cut [begin, end) of the same pieces), so each message of several buffers matches its receive.
std::vector<RecvBuffer> row_runs(const Pieces& pieces, size_t begin, size_t end, float* row) {
  std::vector<RecvBuffer> out;
  pieces.for_runs(begin, end, [&](float*, size_t len, size_t at) { out.push_back({row + at, len * sizeof(float)}); });
  return out;
}

// acc[i] = op(acc[i], x[i]), the switch outside the loop so each case vectorises.
void combine(ReduceOp op, double* acc, const float* x, size_t len) {
  switch (op) {
    case ReduceOp::Sum:
      for (size_t i = 0; i < len; ++i) acc[i] += x[i];
      break;
    case ReduceOp::Min:
      for (size_t i = 0; i < len; ++i) acc[i] = std::min<double>(acc[i], x[i]);
      break;
    case ReduceOp::Max:
      for (size_t i = 0; i < len; ++i) acc[i] = std::max<double>(acc[i], x[i]);
      break;
  }
}

// reduce_scatter, and with `gather` the all-reduce (see the top of this file).
class ReduceScatter final : public RoundCollective {
 public:
  ReduceScatter(Communicator& c, std::span<const std::span<float>> buffers, ReduceOp op, bool gather,
                const std::string& what)
      : ReduceScatter(c, Pieces(buffers), op, gather, what) {}

 private:
  ReduceScatter(Communicator& c, Pieces pieces, ReduceOp op, bool gather, const std::string& what)
      : RoundCollective(rounds_for(pieces.size(), c.size())),
        ch_(c, concat(what, " of ", pieces.size(), " floats")),
        pieces_(std::move(pieces)),
        op_(op),
        gather_(gather),
        P_(c.size()),
        r_(c.rank()),
        chunk_(Communicator::reduce_chunk(P_)),
        mine_(slice_of(pieces_.size(), P_, r_)),
        stride_(std::min(chunk_, mine_.size())) {
    rows_.resize(kRoundsInFlight * static_cast<size_t>(P_ - 1) * stride_);  // [rounds in flight, P - 1, stride]
    acc_.resize(stride_);
    start();
  }

  static size_t rounds_for(size_t n, int P) {
    if (P == 1) return 0;  // one value per element: already its own rank-order combination
    const size_t longest = slice_of(n, P, 0).size(), chunk = Communicator::reduce_chunk(P);
    return (longest + chunk - 1) / chunk;
  }

  // Chunk `round` of rank p's slice (empty past its end).
  Slice chunk_of(int p, size_t round) const {
    const Slice s = slice_of(pieces_.size(), P_, p);
    const size_t begin = std::min(s.end, s.begin + round * chunk_);
    return {begin, std::min(s.end, begin + chunk_)};
  }
  // Where rank p's contribution to this round's chunk lands: one row per other rank.
  float* row(size_t round, int p) {
    const size_t index = static_cast<size_t>(p < r_ ? p : p - 1);
    return rows_.data() + ((round % kRoundsInFlight) * static_cast<size_t>(P_ - 1) + index) * stride_;
  }

  void post(size_t round, std::vector<RequestPtr>& requests) override {
    const Slice own = chunk_of(r_, round);
    for (int s = 1; s < P_ && !own.empty(); ++s) {
      const int from = (r_ - s + P_) % P_;
      requests.push_back(ch_.recv(from, kContribution, row_runs(pieces_, own.begin, own.end, row(round, from)),
                                  concat("rank ", from, "'s part of rank ", r_, "'s slice, chunk ", round)));
    }
    for (int s = 1; s < P_; ++s) {
      const int to = (r_ + s) % P_;
      const Slice theirs = chunk_of(to, round);
      if (theirs.empty()) continue;
      requests.push_back(ch_.send(to, kContribution, pieces_.send_runs(theirs.begin, theirs.end),
                                  concat("rank ", r_, "'s part of rank ", to, "'s slice, chunk ", round)));
    }
  }

  void finish(size_t round, std::vector<RequestPtr>& later) override {
    const Slice own = chunk_of(r_, round);
    sum(round, own);
    if (gather_) gather(round, own, later);
  }

  // Combines chunk `own` of this rank's slice in rank order 0..P-1, this rank's values entering at position r from
  // the caller's buffers, and writes it back there.
  void sum(size_t round, Slice own) {
    if (own.empty()) return;
    const size_t len = own.size();
    for (int p = 0; p < P_; ++p) {
      if (p == r_) {
        pieces_.for_runs(own.begin, own.end, [&](const float* x, size_t n, size_t at) {
          if (p == 0)
            std::copy(x, x + n, acc_.data() + at);
          else
            combine(op_, acc_.data() + at, x, n);
        });
      } else if (p == 0) {
        std::copy(row(round, p), row(round, p) + len, acc_.data());
      } else {
        combine(op_, acc_.data(), row(round, p), len);
      }
    }
    pieces_.for_runs(own.begin, own.end, [&](float* out, size_t n, size_t at) {
      for (size_t i = 0; i < n; ++i) out[i] = static_cast<float>(acc_[at + i]);
    });
  }

  // Sends the summed chunk to every rank and receives theirs. This rank's sends of the round's contributions
  // completed before finish(), so receiving the owners' sums over those same elements is safe now.
  void gather(size_t round, Slice own, std::vector<RequestPtr>& later) {
    for (int s = 1; s < P_; ++s) {
      const int from = (r_ - s + P_) % P_;
      const Slice theirs = chunk_of(from, round);
      if (theirs.empty()) continue;
      later.push_back(ch_.recv(from, kFinished, pieces_.recv_runs(theirs.begin, theirs.end),
                               concat("rank ", from, "'s summed slice, chunk ", round)));
    }
    for (int s = 1; s < P_ && !own.empty(); ++s) {
      const int to = (r_ + s) % P_;
      later.push_back(ch_.send(to, kFinished, pieces_.send_runs(own.begin, own.end),
                               concat("rank ", r_, "'s summed slice, chunk ", round)));
    }
  }

  static constexpr int kContribution = 0, kFinished = 1;  // the channel phases
  Channel ch_;
  Pieces pieces_;
  ReduceOp op_;
  bool gather_;
  int P_, r_;
  size_t chunk_;
  Slice mine_;
  size_t stride_;            // elements of one row: a chunk, or the whole slice when it is shorter
  std::vector<float> rows_;  // [kRoundsInFlight, P - 1, stride]: the other ranks' contributions
  std::vector<double> acc_;  // [stride]
};

// allgatherv: rounds of chunks of every part, received in place; the chunks bound what a backend that copies
// eagerly (loopback) holds at once.
class Allgatherv final : public RoundCollective {
 public:
  Allgatherv(Communicator& c, void* data, std::span<const size_t> part_bytes, const std::string& what)
      : RoundCollective(rounds_for(part_bytes, c.size())),
        ch_(c, what),
        data_(static_cast<uint8_t*>(data)),
        P_(c.size()),
        r_(c.rank()) {
    RF_CHECK(part_bytes.size() == static_cast<size_t>(P_), "rank ", r_, ": ", what, ": ", part_bytes.size(),
             " part sizes for ", P_, " ranks");
    offsets_.push_back(0);
    for (size_t b : part_bytes) offsets_.push_back(offsets_.back() + b);
    start();
  }

 private:
  static size_t chunk_bytes(int P) {
    return std::max<size_t>(1, Communicator::kReduceSliceBytes / (kRoundsInFlight * static_cast<size_t>(P)));
  }
  static size_t rounds_for(std::span<const size_t> part_bytes, int P) {
    if (P == 1 || part_bytes.empty()) return 0;
    const size_t longest = *std::max_element(part_bytes.begin(), part_bytes.end()), chunk = chunk_bytes(P);
    return (longest + chunk - 1) / chunk;
  }
  Slice chunk_of(int p, size_t round) const {
    const size_t end = offsets_[static_cast<size_t>(p) + 1], chunk = chunk_bytes(P_);
    const size_t begin = std::min(end, offsets_[static_cast<size_t>(p)] + round * chunk);
    return {begin, std::min(end, begin + chunk)};
  }

  void post(size_t round, std::vector<RequestPtr>& requests) override {
    for (int s = 1; s < P_; ++s) {
      const int from = (r_ - s + P_) % P_;
      const Slice theirs = chunk_of(from, round);
      if (theirs.empty()) continue;
      const RecvBuffer b{data_ + theirs.begin, theirs.size()};
      requests.push_back(ch_.recv(from, 0, {&b, 1}, concat("rank ", from, "'s part, chunk ", round)));
    }
    const Slice own = chunk_of(r_, round);
    for (int s = 1; s < P_ && !own.empty(); ++s) {
      const int to = (r_ + s) % P_;
      const SendBuffer b{data_ + own.begin, own.size()};
      requests.push_back(ch_.send(to, 0, {&b, 1}, concat("rank ", r_, "'s part, chunk ", round)));
    }
  }

  Channel ch_;
  uint8_t* data_;
  int P_, r_;
  std::vector<size_t> offsets_;  // [P + 1] bytes
};

// alltoallv: one round, every message posted at once (the caller's buffers hold them all anyway), a part longer
// than kMaxMessageBytes travelling as several buffers of one message, cut the same way on both sides.
class Alltoallv final : public RoundCollective {
 public:
  Alltoallv(Communicator& c, const void* send, std::span<const size_t> send_bytes, void* recv,
            std::span<const size_t> recv_bytes)
      : RoundCollective(c.size() > 1 ? 1 : 0),
        ch_(c, "alltoallv"),
        send_(static_cast<const uint8_t*>(send)),
        recv_(static_cast<uint8_t*>(recv)),
        P_(c.size()),
        r_(c.rank()) {
    const size_t P = static_cast<size_t>(P_);
    RF_CHECK(send_bytes.size() == P && recv_bytes.size() == P, "rank ", r_, ": alltoallv: ", send_bytes.size(),
             " send and ", recv_bytes.size(), " receive counts for ", P_, " ranks");
    send_at_.push_back(0);
    recv_at_.push_back(0);
    for (size_t p = 0; p < P; ++p) {
      send_at_.push_back(send_at_.back() + send_bytes[p]);
      recv_at_.push_back(recv_at_.back() + recv_bytes[p]);
    }
    const size_t self = static_cast<size_t>(r_);
    RF_CHECK(send_bytes[self] == recv_bytes[self], "rank ", r_, ": alltoallv: sends itself ", send_bytes[self],
             " bytes but expects ", recv_bytes[self]);
    if (send_bytes[self] > 0) std::memcpy(recv_ + recv_at_[self], send_ + send_at_[self], send_bytes[self]);
    start();
  }

 private:
  template <typename Buffer, typename Byte>
  static std::vector<Buffer> cut(Byte* base, size_t begin, size_t end) {
    std::vector<Buffer> out;
    for (size_t at = begin; at < end; at += kMaxMessageBytes)
      out.push_back({base + at, std::min(end - at, kMaxMessageBytes)});
    return out;
  }

  void post(size_t, std::vector<RequestPtr>& requests) override {
    for (int s = 1; s < P_; ++s) {
      const size_t from = static_cast<size_t>((r_ - s + P_) % P_);
      if (recv_at_[from + 1] == recv_at_[from]) continue;
      requests.push_back(ch_.recv(static_cast<int>(from), 0, cut<RecvBuffer>(recv_, recv_at_[from], recv_at_[from + 1]),
                                  concat(recv_at_[from + 1] - recv_at_[from], " bytes from rank ", from)));
    }
    for (int s = 1; s < P_; ++s) {
      const size_t to = static_cast<size_t>((r_ + s) % P_);
      if (send_at_[to + 1] == send_at_[to]) continue;
      requests.push_back(ch_.send(static_cast<int>(to), 0, cut<SendBuffer>(send_, send_at_[to], send_at_[to + 1]),
                                  concat(send_at_[to + 1] - send_at_[to], " bytes to rank ", to)));
    }
  }

  Channel ch_;
  const uint8_t* send_;
  uint8_t* recv_;
  int P_, r_;
  std::vector<size_t> send_at_, recv_at_;  // [P + 1] byte offsets of each rank's part
};

// A part's runs (sorted, disjoint), with the count of values packed before each.
class Runs {
 public:
  explicit Runs(std::vector<Slice> runs) : runs_(std::move(runs)) {
    prefix_.push_back(0);
    for (const Slice& r : runs_) prefix_.push_back(prefix_.back() + r.size());
  }
  size_t values() const { return prefix_.back(); }
  // Values packed before element `at` of the part.
  size_t packed_before(size_t at) const {
    const size_t k = first_ending_after(at);
    return prefix_[k] + (k < runs_.size() && runs_[k].begin < at ? at - runs_[k].begin : 0);
  }
  // The values of elements [a, b) packed at row[0..), spread in place so element x lands at row[x - a], the elements
  // outside every run zero. Backwards: each run's values move up (its packed start is never past its place), and
  // what still waits to move lies below it.
  void spread(float* row, size_t a, size_t b) const {
    const size_t base = packed_before(a), first = first_ending_after(a);
    size_t filled = b - a;  // row[filled..b - a) is in place
    for (size_t k = first_starting_at(b); k-- > first;) {
      const size_t lo = std::max(a, runs_[k].begin), hi = std::min(b, runs_[k].end);
      const size_t from = prefix_[k] + (lo - runs_[k].begin) - base;
      std::fill(row + (hi - a), row + filled, 0.0f);
      std::memmove(row + (lo - a), row + from, (hi - lo) * sizeof(float));
      filled = lo - a;
    }
    std::fill(row, row + filled, 0.0f);
  }

 private:
  size_t first_ending_after(size_t at) const {
    return static_cast<size_t>(
        std::partition_point(runs_.begin(), runs_.end(), [at](const Slice& r) { return r.end <= at; }) - runs_.begin());
  }
  size_t first_starting_at(size_t at) const {
    return static_cast<size_t>(
        std::partition_point(runs_.begin(), runs_.end(), [at](const Slice& r) { return r.begin < at; }) -
        runs_.begin());
  }
  std::vector<Slice> runs_;
  std::vector<size_t> prefix_;  // [runs + 1]
};

// post_reduce_parts: round k carries chunk k of every owner's part (elements [k C, (k + 1) C)): each rank sends each
// owner its packed values inside that chunk, the owner receives every rank's into a row of [P, C], copies its own
// into its row, spreads each row over the chunk (+0 where a rank has no run) and sums each element's P values in
// rank order in double, rounded once: the order and terms of reduce_scatter. Two rounds in flight (k + 1 arrives
// while k is summed): [2, P, C] floats within the budget. Every rank derives the round count from part_elems alone,
// so all post the same messages.
class ReduceParts final : public RoundCollective {
 public:
  ReduceParts(Communicator& c, const float* send, std::span<const size_t> part_elems,
              std::vector<std::vector<Slice>> to, std::vector<std::vector<Slice>> from, Communicator::PartSums done,
              size_t budget_bytes)
      : RoundCollective(rounds_for(part_elems, Communicator::reduce_parts_chunk(c.size(), budget_bytes))),
        ch_(c, "reduce of parts"),
        send_(send),
        parts_(part_elems.begin(), part_elems.end()),
        done_(std::move(done)),
        P_(c.size()),
        r_(c.rank()),
        chunk_(Communicator::reduce_parts_chunk(P_, budget_bytes)) {
    const size_t P = static_cast<size_t>(P_), me = static_cast<size_t>(r_);
    RF_CHECK(parts_.size() == P && to.size() == P && from.size() == P, "rank ", r_,
             ": reduce of parts: ", parts_.size(), " parts, ", to.size(), " and ", from.size(), " run lists for ", P_,
             " ranks");
    send_at_.push_back(0);
    for (size_t q = 0; q < P; ++q) {
      to_.emplace_back(std::move(to[q]));
      from_.emplace_back(std::move(from[q]));
      send_at_.push_back(send_at_.back() + to_.back().values());
    }
    RF_CHECK(to_[me].values() == from_[me].values(), "rank ", r_, ": reduce of parts: contributes ", to_[me].values(),
             " values to its own part but expects ", from_[me].values());
    // One rank covering its whole part: each element's one value is its sum, handed over from `send` as it is.
    const bool alone = P_ == 1 && from_[me].values() == parts_[me];
    if (!alone) {
      stride_ = std::min(chunk_, parts_[me]);
      const size_t own_rounds = stride_ == 0 ? 0 : (parts_[me] + chunk_ - 1) / chunk_;
      rows_.resize(std::min(kRoundsInFlight, own_rounds) * P * stride_);
    }
    start();
  }

 private:
  static size_t rounds_for(std::span<const size_t> part_elems, size_t chunk) {
    const size_t longest = part_elems.empty() ? 0 : *std::max_element(part_elems.begin(), part_elems.end());
    return (longest + chunk - 1) / chunk;
  }
  // Chunk `round` of rank q's part (empty past its end).
  Slice chunk_of(int q, size_t round) const {
    const size_t end = parts_[static_cast<size_t>(q)], begin = std::min(end, round * chunk_);
    return {begin, std::min(end, begin + chunk_)};
  }
  // [P, stride]: the rows of a round this rank's part has a chunk in (rows_ holds two such rounds, or the one).
  float* rows(size_t round) { return rows_.data() + (round % kRoundsInFlight) * static_cast<size_t>(P_) * stride_; }

  void post(size_t round, std::vector<RequestPtr>& requests) override {
    const Slice own = chunk_of(r_, round);
    for (int s = 1; s < P_ && !own.empty(); ++s) {
      const int from = (r_ - s + P_) % P_;
      const Runs& runs = from_[static_cast<size_t>(from)];
      const size_t n = runs.packed_before(own.end) - runs.packed_before(own.begin);
      if (n == 0) continue;
      const RecvBuffer b{rows(round) + static_cast<size_t>(from) * stride_, n * sizeof(float)};
      requests.push_back(
          ch_.recv(from, 0, {&b, 1}, concat("rank ", from, "'s part of rank ", r_, "'s sums, chunk ", round)));
    }
    for (int s = 1; s < P_; ++s) {
      const int to = (r_ + s) % P_;
      const Slice theirs = chunk_of(to, round);
      const Runs& runs = to_[static_cast<size_t>(to)];
      const size_t at = runs.packed_before(theirs.begin), n = runs.packed_before(theirs.end) - at;
      if (n == 0) continue;
      const SendBuffer b{send_ + send_at_[static_cast<size_t>(to)] + at, n * sizeof(float)};
      requests.push_back(
          ch_.send(to, 0, {&b, 1}, concat("rank ", r_, "'s part of rank ", to, "'s sums, chunk ", round)));
    }
  }

  void finish(size_t round, std::vector<RequestPtr>&) override {
    const Slice own = chunk_of(r_, round);
    if (own.empty()) return;
    const size_t me = static_cast<size_t>(r_), len = own.size();
    const float* mine = send_ + send_at_[me] + from_[me].packed_before(own.begin);
    if (rows_.empty()) {
      done_(own.begin, {mine, len});
      return;
    }
    float* x = rows(round);  // [P, stride]
    std::copy(mine, send_ + send_at_[me] + from_[me].packed_before(own.end), x + me * stride_);
    for (size_t p = 0; p < static_cast<size_t>(P_); ++p) from_[p].spread(x + p * stride_, own.begin, own.end);
    for (size_t i = 0; i < len; ++i) {  // row 0 becomes the sums: element i's other values are read first
      double sum = x[i];
      for (size_t p = 1; p < static_cast<size_t>(P_); ++p) sum += x[p * stride_ + i];
      x[i] = static_cast<float>(sum);
    }
    done_(own.begin, {x, len});
  }

  Channel ch_;
  const float* send_;
  std::vector<size_t> parts_;    // [P] elements of each owner's part
  std::vector<Runs> to_, from_;  // [P]
  std::vector<size_t> send_at_;  // [P + 1]: where this rank's values for owner q start in send_
  Communicator::PartSums done_;
  int P_, r_;
  size_t chunk_, stride_ = 0;  // stride: a row's elements, the chunk clipped at this rank's part
  std::vector<float> rows_;    // [min(2, this rank's rounds), P, stride]; empty for a rank alone with its part
};

}  // namespace

size_t Communicator::reduce_parts_chunk(int P, size_t budget_bytes) {
  const size_t per_element = kRoundsInFlight * static_cast<size_t>(std::max(P, 1)) * sizeof(float);
  return std::max<size_t>(1, budget_bytes / per_element);
}

size_t Communicator::reduce_parts_bytes(int P, size_t part, size_t budget_bytes) {
  if (P <= 1 || part == 0) return 0;
  const size_t chunk = reduce_parts_chunk(P, budget_bytes), stride = std::min(chunk, part);
  const size_t rounds = std::min(kRoundsInFlight, (part + chunk - 1) / chunk);
  return rounds * static_cast<size_t>(P) * stride * sizeof(float);
}

PostedPtr Communicator::post_reduce_parts(const float* send, std::span<const size_t> part_elems,
                                          std::vector<std::vector<Slice>> to, std::vector<std::vector<Slice>> from,
                                          PartSums done, size_t budget_bytes) {
  return std::make_unique<ReduceParts>(*this, send, part_elems, std::move(to), std::move(from), std::move(done),
                                       budget_bytes);
}

PostedPtr Communicator::post_reduce_scatter(float* data, size_t n, ReduceOp op) {
  const std::span<float> whole(data, n);
  return std::make_unique<ReduceScatter>(*this, std::span<const std::span<float>>(&whole, 1), op, false,
                                         "reduce_scatter");
}

PostedPtr Communicator::post_allreduce(std::span<const std::span<float>> buffers, ReduceOp op) {
  return std::make_unique<ReduceScatter>(*this, buffers, op, true, "allreduce");
}

PostedPtr Communicator::post_allgatherv(void* data, std::span<const size_t> part_bytes) {
  return std::make_unique<Allgatherv>(*this, data, part_bytes, "allgather");
}

PostedPtr Communicator::post_alltoallv(const void* send, std::span<const size_t> send_bytes, void* recv,
                                       std::span<const size_t> recv_bytes) {
  return std::make_unique<Alltoallv>(*this, send, send_bytes, recv, recv_bytes);
}

void Communicator::reduce_scatter(float* data, size_t n, ReduceOp op, Timeout timeout) {
  post_reduce_scatter(data, n, op)->wait(timeout);
}

void Communicator::allreduce(float* data, size_t n, ReduceOp op, Timeout timeout) {
  const std::span<float> whole(data, n);
  allreduce(std::span<const std::span<float>>(&whole, 1), op, timeout);
}

void Communicator::allreduce(std::span<const std::span<float>> buffers, ReduceOp op, Timeout timeout) {
  post_allreduce(buffers, op)->wait(timeout);
}

void Communicator::allgatherv(void* data, std::span<const size_t> part_bytes, Timeout timeout) {
  post_allgatherv(data, part_bytes)->wait(timeout);
}

void Communicator::allgather_slices(void* data, size_t n, size_t elem_bytes, Timeout timeout) {
  std::vector<size_t> part_bytes(static_cast<size_t>(size()));
  for (int p = 0; p < size(); ++p) part_bytes[static_cast<size_t>(p)] = slice_of(n, size(), p).size() * elem_bytes;
  allgatherv(data, part_bytes, timeout);
}

void Communicator::alltoallv(const void* send, std::span<const size_t> send_bytes, void* recv,
                             std::span<const size_t> recv_bytes, Timeout timeout) {
  post_alltoallv(send, send_bytes, recv, recv_bytes)->wait(timeout);
}

std::vector<size_t> Communicator::alltoall_counts(std::span<const size_t> send_bytes, Timeout timeout) {
  const size_t P = static_cast<size_t>(size());
  RF_CHECK(send_bytes.size() == P, "rank ", rank(), ": alltoall_counts: ", send_bytes.size(), " counts for ", P,
           " ranks");
  // Fixed 8-byte counts, whatever size_t is here, so ranks of different builds agree on the message sizes.
  std::vector<uint64_t> mine(send_bytes.begin(), send_bytes.end()), theirs(P);
  const std::vector<size_t> one(P, sizeof(uint64_t));
  alltoallv(mine.data(), one, theirs.data(), one, timeout);
  return {theirs.begin(), theirs.end()};
}

}  // namespace rf::comm
