// ringflex trainer: checkpoints of held experts without a whole copy (see held_checkpoint.h).
#include "trainer/state/held_checkpoint.h"

#include <algorithm>
#include <cstddef>
#include <utility>

#include "core/error.h"
#include "model/expert_store.h"
#include "trainer/checkpoint.h"
#include "trainer/state/sharded_store.h"

namespace rf::trainer {

using model::ParamInfo;
using model::Role;

namespace {

constexpr int kWriter = 0;  // the world rank that writes the files
// The tag of the parts' messages on the world communicator (nothing else travels on it during a save).
constexpr int kPartTag = 2511;
// MPI counts a buffer's bytes in int: a part travels as buffers of at most this many bytes, cut alike on both sides.
constexpr size_t kMaxBufferBytes = size_t{1} << 30;

template <typename Buffer, typename Byte>
std::vector<Buffer> cut(Byte* data, size_t bytes) {
  std::vector<Buffer> out;
  for (size_t at = 0; at < bytes; at += kMaxBufferBytes)
    out.push_back({data + at, std::min(bytes - at, kMaxBufferBytes)});
  return out;
}

// `h`: `held` when it is a HeldExpertStore, else null.
void register_files_layout(const model::ParamStore& held, const HeldExpertStore* h, model::ParamStore& into) {
  std::vector<bool> trainable(held.size());
  for (size_t i = 0; i < held.size(); ++i) {
    const ParamInfo& p = held.info(i);
    into.add(p.name, p.whole_shape(), p.layer, p.matmul);
    const int64_t e = h != nullptr ? h->expert_slot(i) : -1;
    trainable[i] = e < 0 ? p.trainable : h->experts().info(static_cast<size_t>(e)).trainable;
  }
  into.set_trainable(trainable);
}

}  // namespace

std::unique_ptr<model::ParamStore> files_layout(const model::ParamStore& rows) {
  auto layout = std::make_unique<model::ReplicatedStore>();
  register_files_layout(rows, nullptr, *layout);
  return layout;
}

std::unique_ptr<model::ParamStore> files_layout(const HeldExpertStore& held) {
  auto layout = std::make_unique<model::ReplicatedStore>();
  register_files_layout(held, &held, *layout);
  return layout;
}

HeldWriter::HeldWriter(model::ParamStore& rows, const HeldGroups& g) : HeldWriter(rows, nullptr, g) {}

HeldWriter::HeldWriter(HeldExpertStore& held, const HeldGroups& g) : HeldWriter(held, &held, g) {}

HeldWriter::HeldWriter(model::ParamStore& held, HeldExpertStore* apart, const HeldGroups& g)
    : held_(held), sharded_(apart), g_(g) {
  register_files_layout(held, apart, *this);
}

std::vector<HeldWriter::Part> HeldWriter::parts(size_t slot, Role role) const {
  const int P = g_.world.size(), ep = g_.ep.size(), me = g_.world.rank();
  const bool weights = role == Role::Weights;
  std::vector<Part> out;
  if (sharded_ == nullptr) {  // shard none: EP rank a's rows on world rank a, the rest whole on every rank
    const ParamInfo& p = held_.info(slot);
    const auto values = [&] { return weights ? held_.weight(slot) : held_.moment(role, slot); };
    if (!p.holds_part()) {
      out.push_back({kWriter, 0, p.numel, me == kWriter ? values() : nullptr});
      return out;
    }
    for (int a = 0; a < ep; ++a) out.push_back({a, a * p.numel, p.numel, me == a ? values() : nullptr});
    return out;
  }
  const int64_t e = sharded_->expert_slot(slot);
  if (e < 0) {  // a moment of the rest: world rank w keeps slice_of(their trainable layout, P, w)
    RF_CHECK(!weights, "held experts: the inner store reads its own weights");
    const model::ParamStore& in = sharded_->inner();
    const ParamInfo& p = in.info(slot);
    for (int w = 0; w < P; ++w) {
      const model::Shard r = model::shard_of(in.trainable_elements(), w, P);
      const int64_t lo = std::max(p.train_offset, r.begin), hi = std::min(p.train_offset + p.numel, r.end);
      if (lo < hi)
        out.push_back({w, lo - p.train_offset, hi - lo, w == me ? in.flat(role).data() + (lo - r.begin) : nullptr});
    }
    return out;
  }
  const ExpertSlices& ex = sharded_->experts();
  const ParamInfo& p = ex.info(static_cast<size_t>(e));
  if (weights) {  // EP rank a's rows, whole on each rank of its EDP group: sent by world rank a
    for (int a = 0; a < ep; ++a)
      out.push_back({a, a * p.numel, p.numel, me == a ? ex.weight(static_cast<size_t>(e)) : nullptr});
    return out;
  }
  // EP rank a's moments: EDP rank b (world rank b * ep + a) keeps slice_of(the experts' trainable layout, Q, b).
  const int Q = P / ep;
  const auto total = static_cast<size_t>(ex.trainable_elements());
  for (int b = 0; b < Q; ++b) {
    const comm::Slice s = comm::slice_of(total, Q, b);
    const int64_t lo = std::max(p.train_offset, static_cast<int64_t>(s.begin));
    const int64_t hi = std::min(p.train_offset + p.numel, static_cast<int64_t>(s.end));
    if (lo >= hi) continue;
    for (int a = 0; a < ep; ++a) {
      const int w = b * ep + a;
      const float* values = w == me ? ex.flat(role).data() + (lo - static_cast<int64_t>(s.begin)) : nullptr;
      out.push_back({w, a * p.numel + (lo - p.train_offset), hi - lo, values});
    }
  }
  return out;
}

void HeldWriter::gather(const std::vector<Part>& parts, std::span<float> out) const {
  const int me = g_.world.rank();
  std::vector<comm::RequestPtr> requests;
  std::vector<std::vector<comm::SendBuffer>> sends;
  std::vector<std::vector<comm::RecvBuffer>> recvs;
  for (const Part& part : parts) {
    if (part.n == 0) continue;
    const size_t bytes = static_cast<size_t>(part.n) * sizeof(float);
    if (part.rank == kWriter) {
      if (me == kWriter) std::copy_n(part.values, part.n, out.data() + part.first);
      continue;
    }
    if (me == kWriter) {
      recvs.push_back(cut<comm::RecvBuffer>(reinterpret_cast<std::byte*>(out.data() + part.first), bytes));
      requests.push_back(g_.world.irecv(part.rank, kPartTag, recvs.back(), "a part of a checkpoint tensor"));
    } else if (me == part.rank) {
      sends.push_back(cut<comm::SendBuffer>(reinterpret_cast<const std::byte*>(part.values), bytes));
      requests.push_back(g_.world.isend(kWriter, kPartTag, sends.back(), "a part of a checkpoint tensor"));
    }
  }
  comm::wait_all(requests, g_.timeout);
}

void HeldWriter::read_weight(size_t slot, std::span<float> out) {
  RF_CHECK(static_cast<int64_t>(out.size()) == info(slot).numel, "read_weight: ", out.size(), " elements for ",
           info(slot).name, " of ", info(slot).numel);
  if (sharded_ != nullptr && sharded_->expert_slot(slot) < 0) {
    model::ParamStore& in = sharded_->inner();
    const ShardedStore* pieces = sharded_->inner_sharded();
    if ((pieces != nullptr && pieces->sharded()) || g_.world.rank() == kWriter) in.read_weight(slot, out);
    return;
  }
  gather(parts(slot, Role::Weights), out);
}

void HeldWriter::read_moment(Role role, size_t slot, std::span<float> out) {
  RF_CHECK(role != Role::Weights && role != Role::Grads && info(slot).trainable,
           "held experts: read_moment of a moment of a trainable parameter, not ", info(slot).name, "'s ",
           model::role_name(role));
  RF_CHECK(static_cast<int64_t>(out.size()) == info(slot).numel, "read_moment: ", out.size(), " elements for ",
           info(slot).name, " of ", info(slot).numel);
  gather(parts(slot, role), out);
}

void load_held_moments(const std::string& dir, HeldExpertStore& held) {
  const std::unique_ptr<model::ParamStore> layout = files_layout(std::as_const(held));
  held.allocate_moments();
  std::vector<MomentTarget> targets;
  // The rest: the inner store registers every slot (the experts' with no rows), in the files' order.
  model::ParamStore& in = held.inner();
  const model::Shard rest = in.moment_range();
  float* const m = in.mutable_flat(Role::ExpAvg).data();
  float* const v = in.mutable_flat(Role::ExpAvgSq).data();
  for (const model::ParamStore::Segment& seg : in.trainable_segments(rest.begin, rest.end)) {
    const int64_t at = seg.train_index - rest.begin;
    targets.push_back({seg.slot, seg.first, seg.n, m + at, v + at});
  }
  // The experts: their rows of the whole tensor.
  ExpertSlices& ex = held.experts();
  std::vector<size_t> files_slot(ex.size());
  for (size_t i = 0; i < held.size(); ++i)
    if (held.expert_slot(i) >= 0) files_slot[static_cast<size_t>(held.expert_slot(i))] = i;
  const model::Shard own = ex.moment_range();
  float* const em = ex.mutable_flat(Role::ExpAvg).data();
  float* const ev = ex.mutable_flat(Role::ExpAvgSq).data();
  for (const model::ParamStore::Segment& seg : ex.trainable_segments(own.begin, own.end)) {
    const ParamInfo& p = ex.info(seg.slot);
    const int64_t at = seg.train_index - own.begin;
    targets.push_back(
        {files_slot[seg.slot], p.rows_begin * model::row_elements(p) + seg.first, seg.n, em + at, ev + at});
  }
  load_moments_into(dir, *layout, targets);
}

}  // namespace rf::trainer
