// ringflex comm: the loopback backend (see loopback_comm.h).
#include "comm/loopback_comm.h"

#include <array>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>

#include "comm/blocked_time.h"
#include "core/error.h"

namespace rf::comm {
namespace {

using Message = std::vector<std::vector<uint8_t>>;  // one byte vector per buffer

// Collectives use tags outside the user range so they never match a point-to-point message.
constexpr int kAllgatherTag = Communicator::kMaxTag;
constexpr int kBroadcastTag = Communicator::kMaxTag + 1;
constexpr int kChannelTag0 = Communicator::kMaxTag + 2;  // the channel of collectives.cpp: its tags follow

// What every communicator of one run_ranks call shares, split ones included: one lock and one wake-up, so a
// rank that fails wakes the ranks blocked in any communicator.
struct Shared {
  std::mutex mutex;
  std::condition_variable arrived;
  int failed_rank = -1;  // first rank (of the run_ranks world) whose function threw
  std::exception_ptr first_error;
};

struct World {
  World(int p, Shared* s) : P(p), shared(s), mutex(s->mutex), arrived(s->arrived), failed_rank(s->failed_rank) {}
  const int P;
  Shared* shared;
  std::mutex& mutex;
  std::condition_variable& arrived;
  int& failed_rank;
  std::map<std::tuple<int, int, int>, std::deque<Message>> mail;  // (source, destination, tag) -> FIFO
  // Communicators split from this one, keyed by (the split's sequence number on every rank, color). Created by
  // the first member to arrive; owned here so they live as long as the run_ranks world.
  std::map<std::pair<int, int>, std::unique_ptr<World>> children;
};

class LoopbackRequest final : public Request {
 public:
  // A send is complete when posted (eager copy): wait() returns at once.
  LoopbackRequest() = default;
  // shown_tag: what errors print (< 0: none, for the collectives' channel); `received` counts the bytes taken.
  LoopbackRequest(World* w, int self, int peer, int tag, int shown_tag, std::vector<RecvBuffer> bufs, std::string label,
                  uint64_t* received)
      : world_(w),
        self_(self),
        peer_(peer),
        tag_(tag),
        shown_tag_(shown_tag),
        buffers_(std::move(bufs)),
        label_(std::move(label)),
        received_(received) {}

  void wait(Timeout timeout) override {
    if (!world_) return;
    std::unique_lock lock(world_->mutex);
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    const detail::BlockedTime blocked;
    const bool ok = world_->arrived.wait_until(lock, deadline, [&] { return world_->failed_rank >= 0 || arrived(); });
    if (!arrived()) {
      RF_CHECK(world_->failed_rank < 0, "rank ", self_, ": gave up receiving ", label_, " from rank ", peer_,
               shown_tag(), " because rank ", world_->failed_rank, " failed");
      RF_CHECK(ok, "rank ", self_, ": timed out after ", timeout.count(), " ms waiting to receive ", label_,
               " from rank ", peer_, shown_tag());
    }
    take(lock);
  }

  bool test() override {
    if (!world_) return true;
    std::unique_lock lock(world_->mutex);
    if (!arrived()) {
      RF_CHECK(world_->failed_rank < 0, "rank ", self_, ": gave up receiving ", label_, " from rank ", peer_,
               shown_tag(), " because rank ", world_->failed_rank, " failed");
      return false;
    }
    take(lock);
    return true;
  }

 private:
  std::string shown_tag() const { return shown_tag_ >= 0 ? concat(" (tag ", shown_tag_, ")") : ""; }
  // Under the world's lock.
  bool arrived() const {
    auto it = world_->mail.find(std::make_tuple(peer_, self_, tag_));
    return it != world_->mail.end() && !it->second.empty();
  }
  // Takes the message that arrived(), under `lock`, which it releases before copying.
  void take(std::unique_lock<std::mutex>& lock) {
    auto it = world_->mail.find(std::make_tuple(peer_, self_, tag_));
    Message msg = std::move(it->second.front());
    it->second.pop_front();
    lock.unlock();
    RF_CHECK(msg.size() == buffers_.size(), "rank ", self_, ": ", label_, " from rank ", peer_, " has ", msg.size(),
             " buffers, expected ", buffers_.size());
    for (size_t i = 0; i < msg.size(); ++i) {
      RF_CHECK(msg[i].size() == buffers_[i].bytes, "rank ", self_, ": ", label_, " from rank ", peer_, " buffer ", i,
               " has ", msg[i].size(), " bytes, expected ", buffers_[i].bytes);
      if (!msg[i].empty()) std::memcpy(buffers_[i].data, msg[i].data(), msg[i].size());
      if (received_ && peer_ != self_) *received_ += msg[i].size();
    }
    world_ = nullptr;
  }

  World* world_ = nullptr;
  int self_ = 0, peer_ = 0, tag_ = 0, shown_tag_ = 0;
  std::vector<RecvBuffer> buffers_;
  std::string label_;
  uint64_t* received_ = nullptr;
};

class LoopbackComm final : public Communicator {
 public:
  LoopbackComm(World* w, int rank) : world_(w), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return world_->P; }
  std::string backend() const override { return "loopback"; }

  RequestPtr isend(int peer, int tag, std::span<const SendBuffer> buffers, std::string label) override {
    check_user(peer, tag, label);
    post(peer, tag, buffers);
    return std::make_unique<LoopbackRequest>();
  }

  RequestPtr irecv(int peer, int tag, std::span<const RecvBuffer> buffers, std::string label) override {
    check_user(peer, tag, label);
    return receive(peer, tag, tag, buffers, std::move(label));
  }

  Traffic traffic() const override { return traffic_; }

  void allgather(const void* send, void* recv, size_t bytes, Timeout timeout) override {
    const SendBuffer s{send, bytes};
    for (int p = 0; p < world_->P; ++p) post(p, kAllgatherTag, {&s, 1});
    for (int p = 0; p < world_->P; ++p) {
      const RecvBuffer r{static_cast<uint8_t*>(recv) + p * bytes, bytes};
      receive(p, kAllgatherTag, kAllgatherTag, {&r, 1}, "allgather")->wait(timeout);
    }
  }

  void broadcast(void* data, size_t bytes, int root, Timeout timeout) override {
    RF_CHECK(root >= 0 && root < world_->P, "broadcast root ", root, " is not a rank of ", world_->P);
    if (rank_ == root) {
      const SendBuffer s{data, bytes};
      for (int p = 0; p < world_->P; ++p)
        if (p != root) post(p, kBroadcastTag, {&s, 1});
      return;
    }
    const RecvBuffer r{data, bytes};
    receive(root, kBroadcastTag, kBroadcastTag, {&r, 1}, "broadcast")->wait(timeout);
  }

  std::unique_ptr<Communicator> split(int color, int key, Timeout timeout) override {
    RF_CHECK(color >= 0, "rank ", rank_, ": split color ", color, " must be >= 0");
    const std::array<int, 2> mine{color, key};
    std::vector<std::array<int, 2>> all(static_cast<size_t>(world_->P));
    allgather(mine.data(), all.data(), sizeof mine, timeout);
    // MPI_Comm_split's ranking: by key, ties by the rank here.
    int members = 0, new_rank = 0;
    for (int p = 0; p < world_->P; ++p) {
      if (all[p][0] != color) continue;
      ++members;
      if (all[p][1] < key || (all[p][1] == key && p < rank_)) ++new_rank;
    }
    World* child = nullptr;
    {
      std::lock_guard lock(world_->mutex);
      std::unique_ptr<World>& slot = world_->children[{splits_, color}];
      if (!slot) slot = std::make_unique<World>(members, world_->shared);
      child = slot.get();
    }
    ++splits_;
    return std::make_unique<LoopbackComm>(child, new_rank);
  }

 protected:
  RequestPtr channel_isend(int peer, int tag, std::span<const SendBuffer> buffers, std::string) override {
    post(peer, kChannelTag0 + tag, buffers);
    return std::make_unique<LoopbackRequest>();
  }
  RequestPtr channel_irecv(int peer, int tag, std::span<const RecvBuffer> buffers, std::string label) override {
    return receive(peer, kChannelTag0 + tag, -1, buffers, std::move(label));
  }

 private:
  RequestPtr receive(int peer, int tag, int shown_tag, std::span<const RecvBuffer> buffers, std::string label) {
    return std::make_unique<LoopbackRequest>(world_, rank_, peer, tag, shown_tag,
                                             std::vector<RecvBuffer>(buffers.begin(), buffers.end()), std::move(label),
                                             &traffic_.bytes_received);
  }

  void check_user(int peer, int tag, const std::string& label) const {
    RF_CHECK(peer >= 0 && peer < world_->P, "rank ", rank_, ": ", label, ": peer ", peer, " is not a rank of ",
             world_->P);
    RF_CHECK(tag >= 0 && tag < kMaxTag, "rank ", rank_, ": ", label, ": tag ", tag, " outside [0, ", kMaxTag, ")");
  }

  void post(int peer, int tag, std::span<const SendBuffer> buffers) {
    Message msg;
    for (const SendBuffer& b : buffers) {
      const auto* p = static_cast<const uint8_t*>(b.data);
      msg.emplace_back(p, p + b.bytes);
      if (peer != rank_) traffic_.bytes_sent += b.bytes;
    }
    {
      std::lock_guard lock(world_->mutex);
      world_->mail[std::make_tuple(rank_, peer, tag)].push_back(std::move(msg));
    }
    world_->arrived.notify_all();
  }

  World* world_;
  int rank_;
  Traffic traffic_;  // this rank's thread alone touches it
  int splits_ = 0;   // splits made so far; every rank counts the same (split is collective)
};

}  // namespace

void run_ranks(int P, const std::function<void(Communicator&)>& fn) {
  RF_CHECK(P >= 1, "run_ranks needs at least one rank, got ", P);
  Shared shared;
  World world(P, &shared);
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r) {
    threads.emplace_back([&world, &shared, &fn, r] {
      LoopbackComm comm(&world, r);
      try {
        fn(comm);
      } catch (...) {
        {
          std::lock_guard lock(shared.mutex);
          if (shared.failed_rank < 0) {
            shared.failed_rank = r;
            shared.first_error = std::current_exception();
          }
        }
        shared.arrived.notify_all();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  if (shared.first_error) std::rethrow_exception(shared.first_error);
}

}  // namespace rf::comm
