// ringflex cp: expert parallelism in generation (see decode_experts.h).
#include "cp/decode_experts.h"

#include <algorithm>

#include "core/error.h"

namespace rf::cp {

DecodeExperts::DecodeExperts(comm::Communicator& group, comm::Timeout timeout)
    : group_(group), timeout_(timeout), sharded_(group, timeout) {}

void DecodeExperts::route(ExpertRouting& routing) {
  if (!replicated_) {
    sharded_.route(routing);
    return;
  }
  routing.place_on(group_.size(), group_.rank());
  const int64_t here = routing.experts_here();
  std::copy_n(routing.sent.begin() + routing.first_expert(), here, routing.received.begin() + routing.rank * here);
}

void DecodeExperts::dispatch(const ExpertRouting& routing, const float* sent, float* received, int64_t width) {
  if (!replicated_) {
    sharded_.dispatch(routing, sent, received, width);
    return;
  }
  int64_t before = 0;  // the rows of the experts before this rank's, in the sent layout
  for (int p = 0; p < routing.rank; ++p) before += routing.sent_to(p);
  std::copy_n(sent + before * width, routing.received_rows() * width, received);
}

void DecodeExperts::combine(const ExpertRouting& routing, const float* received, float* sent, int64_t width) {
  if (!replicated_) {
    sharded_.combine(routing, received, sent, width);
    return;
  }
  const int P = group_.size();
  std::vector<size_t> part_bytes(static_cast<size_t>(P));
  int64_t before = 0;
  for (int p = 0; p < P; ++p) {
    if (p < routing.rank) before += routing.sent_to(p);
    part_bytes[static_cast<size_t>(p)] = static_cast<size_t>(routing.sent_to(p) * width) * sizeof(float);
  }
  std::copy_n(received, routing.received_rows() * width, sent + before * width);
  group_.allgatherv(sent, part_bytes, timeout_);
  replicated_bytes_ +=
      static_cast<int64_t>(routing.received_rows() * width) * (P - 1) * static_cast<int64_t>(sizeof(float));
}

void DecodeExperts::start_dispatch(const ExpertRouting& routing, const float* sent, float* received, int64_t width) {
  if (replicated_)
    dispatch(routing, sent, received, width);
  else
    sharded_.start_dispatch(routing, sent, received, width);
}

void DecodeExperts::progress_dispatch() {
  if (!replicated_) sharded_.progress_dispatch();
}

void DecodeExperts::finish_dispatch() {
  if (!replicated_) sharded_.finish_dispatch();
}

void DecodeExperts::start_combine(const ExpertRouting& routing, const float* received, float* sent, int64_t width) {
  if (replicated_)
    combine(routing, received, sent, width);
  else
    sharded_.start_combine(routing, received, sent, width);
}

void DecodeExperts::progress_combine() {
  if (!replicated_) sharded_.progress_combine();
}

void DecodeExperts::finish_combine() {
  if (!replicated_) sharded_.finish_combine();
}

ExpertTraffic DecodeExperts::traffic() const {
  ExpertTraffic t = sharded_.traffic();
  t.bytes_sent += replicated_bytes_;
  return t;
}

}  // namespace rf::cp
