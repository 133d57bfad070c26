// ringflex cp: expert parallelism's dispatch over a communicator (see ep_experts.h).
#include "cp/ep_experts.h"

#include <chrono>
#include <vector>

#include "core/error.h"

namespace rf::cp {

namespace {

// Bytes of `rows` rows of `width` float32 each, per rank.
std::vector<size_t> row_bytes(const std::vector<int64_t>& rows, int64_t width) {
  std::vector<size_t> bytes(rows.size());
  for (size_t p = 0; p < rows.size(); ++p) bytes[p] = static_cast<size_t>(rows[p] * width) * sizeof(float);
  return bytes;
}

// Adds the seconds from its construction to its end to `into` (the exposed time of a blocking exchange).
class Timed {
 public:
  explicit Timed(double& into) : into_(into), start_(std::chrono::steady_clock::now()) {}
  ~Timed() { into_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }
  Timed(const Timed&) = delete;
  Timed& operator=(const Timed&) = delete;

 private:
  double& into_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace

EpExperts::EpExperts(comm::Communicator& group, comm::Timeout timeout) : group_(group), timeout_(timeout) {}

void EpExperts::route(ExpertRouting& routing) {
  const Timed timed(traffic_.seconds);
  const int P = group_.size();
  routing.place_on(P, group_.rank());
  const int64_t here = routing.experts_here();
  // Rank p is sent the counts of its experts: one contiguous run of `sent`; this rank receives [P][here].
  const std::vector<size_t> counts(static_cast<size_t>(P), static_cast<size_t>(here) * sizeof(int64_t));
  group_.alltoallv(routing.sent.data(), counts, routing.received.data(), counts, timeout_);
  for (int p = 0; p < P; ++p) {
    if (p == routing.rank) continue;
    traffic_.rows_sent += routing.sent_to(p);
    traffic_.rows_received += routing.received_from(p);
  }
}

void EpExperts::dispatch(const ExpertRouting& routing, const float* sent, float* received, int64_t width) {
  const Timed timed(traffic_.seconds);
  const int P = group_.size();
  std::vector<int64_t> to(static_cast<size_t>(P)), from(static_cast<size_t>(P));
  for (int p = 0; p < P; ++p) {
    to[static_cast<size_t>(p)] = routing.sent_to(p);
    from[static_cast<size_t>(p)] = routing.received_from(p);
  }
  const std::vector<size_t> send_bytes = row_bytes(to, width), recv_bytes = row_bytes(from, width);
  group_.alltoallv(sent, send_bytes, received, recv_bytes, timeout_);
  for (int p = 0; p < P; ++p)
    if (p != routing.rank) traffic_.bytes_sent += static_cast<int64_t>(send_bytes[static_cast<size_t>(p)]);
}

void EpExperts::start_dispatch(const ExpertRouting& routing, const float* sent, float* received, int64_t width) {
  RF_CHECK(posted_ == nullptr, "expert parallelism: a dispatch started before the last one finished");
  const int P = group_.size();
  std::vector<int64_t> to(static_cast<size_t>(P)), from(static_cast<size_t>(P));
  for (int p = 0; p < P; ++p) {
    to[static_cast<size_t>(p)] = routing.sent_to(p);
    from[static_cast<size_t>(p)] = routing.received_from(p);
  }
  send_bytes_ = row_bytes(to, width);
  recv_bytes_ = row_bytes(from, width);
  posted_ = group_.post_alltoallv(sent, send_bytes_, received, recv_bytes_);
  for (int p = 0; p < P; ++p)
    if (p != routing.rank) traffic_.bytes_sent += static_cast<int64_t>(send_bytes_[static_cast<size_t>(p)]);
}

void EpExperts::progress_dispatch() {
  if (posted_) posted_->progress();
}

void EpExperts::finish_dispatch() {
  if (!posted_) return;
  const Timed timed(traffic_.seconds);
  posted_->wait(timeout_);
  posted_.reset();
}

void EpExperts::start_combine(const ExpertRouting& routing, const float* received, float* sent, int64_t width) {
  RF_CHECK(posted_ == nullptr, "expert parallelism: a combine started before the last transfer finished");
  const int P = group_.size();
  std::vector<int64_t> to(static_cast<size_t>(P)), from(static_cast<size_t>(P));
  for (int p = 0; p < P; ++p) {
    to[static_cast<size_t>(p)] = routing.received_from(p);
    from[static_cast<size_t>(p)] = routing.sent_to(p);
  }
  send_bytes_ = row_bytes(to, width);
  recv_bytes_ = row_bytes(from, width);
  posted_ = group_.post_alltoallv(received, send_bytes_, sent, recv_bytes_);
  for (int p = 0; p < P; ++p)
    if (p != routing.rank) traffic_.bytes_sent += static_cast<int64_t>(send_bytes_[static_cast<size_t>(p)]);
}

void EpExperts::combine(const ExpertRouting& routing, const float* received, float* sent, int64_t width) {
  const Timed timed(traffic_.seconds);
  const int P = group_.size();
  std::vector<int64_t> to(static_cast<size_t>(P)), from(static_cast<size_t>(P));
  for (int p = 0; p < P; ++p) {
    to[static_cast<size_t>(p)] = routing.received_from(p);
    from[static_cast<size_t>(p)] = routing.sent_to(p);
  }
  const std::vector<size_t> send_bytes = row_bytes(to, width), recv_bytes = row_bytes(from, width);
  group_.alltoallv(received, send_bytes, sent, recv_bytes, timeout_);
  for (int p = 0; p < P; ++p)
    if (p != routing.rank) traffic_.bytes_sent += static_cast<int64_t>(send_bytes[static_cast<size_t>(p)]);
}

}  // namespace rf::cp
