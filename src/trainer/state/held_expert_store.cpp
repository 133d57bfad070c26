// ringflex trainer: held experts under parallelism.shard (see held_expert_store.h).
#include "trainer/state/held_expert_store.h"

#include <algorithm>
#include <utility>

#include "core/error.h"
#include "model/expert_store.h"
#include "trainer/state/sharded_store.h"

namespace rf::trainer {

using model::ParamInfo;
using model::Role;

// --- ExpertSlices ---

ExpertSlices::ExpertSlices(std::unique_ptr<comm::Communicator> edp, bool slice_grads, comm::Timeout timeout)
    : edp_(std::move(edp)), slice_grads_(slice_grads), timeout_(timeout) {}

comm::Slice ExpertSlices::own() const {
  return comm::slice_of(static_cast<size_t>(trainable_elements()), edp_->size(), edp_->rank());
}

std::span<float> ExpertSlices::own_grads() {
  if (slice_grads_) return slice_;
  const comm::Slice s = own();
  return ReplicatedStore::mutable_flat(Role::Grads).subspan(s.begin, s.size());
}

void ExpertSlices::reduce() {
  RF_CHECK(!slice_grads_, "held experts: the whole gradients are reduced under shard optimizer only");
  const std::span<float> all = ReplicatedStore::mutable_flat(Role::Grads);
  if (edp_->size() > 1) edp_->reduce_scatter(all.data(), all.size(), comm::ReduceOp::Sum, timeout_);
}

void ExpertSlices::gather_updated() {
  // The updated trainable elements in the trainable layout: this rank's slice copied in, the others' gathered.
  std::vector<float> staging(static_cast<size_t>(trainable_elements()));
  const comm::Slice mine = own();
  const auto begin = static_cast<int64_t>(mine.begin), end = static_cast<int64_t>(mine.end);
  for (const Segment& seg : trainable_segments(begin, end))
    std::copy_n(weight(seg.slot) + seg.first, seg.n, staging.data() + seg.train_index);
  if (edp_->size() > 1) edp_->allgather_slices(staging.data(), staging.size(), sizeof(float), timeout_);
  for (const Segment& seg : trainable_segments(0, trainable_elements()))
    std::copy_n(staging.data() + seg.train_index, seg.n, mutable_weight(seg.slot) + seg.first);
}

comm::Slice ExpertSlices::layer_range(int layer) const {
  comm::Slice r{0, 0};
  bool any = false;
  for (const ParamInfo& p : infos()) {
    if (p.layer != layer || !p.trainable) continue;
    const auto lo = static_cast<size_t>(p.train_offset), hi = static_cast<size_t>(p.train_offset + p.numel);
    r = any ? comm::Slice{std::min(r.begin, lo), std::max(r.end, hi)} : comm::Slice{lo, hi};
    any = true;
  }
  return r;
}

void ExpertSlices::begin_layer(int layer) {
  if (!slice_grads_ || !grads_allocated_) return;
  layer_at_ = layer;
  layer_.assign(layer_range(layer).size(), 0.f);
}

// The layer's gradients [lo, hi) of the trainable layout meet each rank's slice in one run, the runs in rank order
// tiling [lo, hi): rank q is sent its run, and this rank sums the Q runs it receives in rank order in double,
// rounded once, into its slice.
void ExpertSlices::end_layer(int layer) {
  if (!slice_grads_ || !grads_allocated_ || layer != layer_at_) return;
  const comm::Slice range = layer_range(layer);
  const int Q = edp_->size(), me = edp_->rank();
  const auto run_of = [&](int q) {
    const comm::Slice s = comm::slice_of(static_cast<size_t>(trainable_elements()), Q, q);
    const size_t lo = std::max(s.begin, range.begin), hi = std::min(s.end, range.end);
    return lo < hi ? comm::Slice{lo, hi} : comm::Slice{lo, lo};
  };
  const comm::Slice mine = run_of(me);
  const size_t n = mine.size();
  std::vector<float> recv(n * static_cast<size_t>(Q));
  if (Q > 1) {
    std::vector<size_t> send_bytes(static_cast<size_t>(Q)), recv_bytes(static_cast<size_t>(Q), n * sizeof(float));
    for (int q = 0; q < Q; ++q) send_bytes[static_cast<size_t>(q)] = run_of(q).size() * sizeof(float);
    edp_->alltoallv(layer_.data(), send_bytes, recv.data(), recv_bytes, timeout_);
  } else {
    std::copy_n(layer_.data() + (mine.begin - range.begin), n, recv.data());
  }
  float* dst = slice_.data() + (mine.begin - own().begin);
  for (size_t i = 0; i < n; ++i) {
    double sum = recv[i];
    for (int q = 1; q < Q; ++q) sum += recv[static_cast<size_t>(q) * n + i];
    dst[i] += static_cast<float>(sum);
  }
  layer_ = {};
  layer_at_ = model::kNoParamGroup;
}

void ExpertSlices::allocate_grads() {
  if (!slice_grads_) {
    ReplicatedStore::allocate_grads();
    return;
  }
  if (grads_allocated_) return;
  slice_.assign(own().size(), 0.f);
  grads_allocated_ = true;
}

void ExpertSlices::zero_grads() {
  if (!slice_grads_) {
    ReplicatedStore::zero_grads();
    return;
  }
  std::fill(slice_.begin(), slice_.end(), 0.f);
}

const float* ExpertSlices::grad(size_t slot) const {
  if (!slice_grads_) return ReplicatedStore::grad(slot);
  const ParamInfo& p = info(slot);
  if (!grads_allocated_ || !p.trainable) return nullptr;
  RF_CHECK(p.layer == layer_at_, "held experts: the gradient of ", p.name,
           " is asked for outside its layer's backward");
  return layer_.data() + (p.train_offset - static_cast<int64_t>(layer_range(p.layer).begin));
}

float* ExpertSlices::grad(size_t slot) { return const_cast<float*>(std::as_const(*this).grad(slot)); }

std::span<const float> ExpertSlices::flat(Role role) const {
  if (slice_grads_ && role == Role::Grads) return slice_;
  return ReplicatedStore::flat(role);
}

std::span<float> ExpertSlices::mutable_flat(Role role) {
  if (slice_grads_ && role == Role::Grads) return slice_;
  return ReplicatedStore::mutable_flat(role);
}

void ExpertSlices::release_training_state() {
  ReplicatedStore::release_training_state();
  slice_ = {};
  layer_ = {};
  grads_allocated_ = false;
}

// --- HeldExpertStore ---

HeldExpertStore::HeldExpertStore(HeldInner inner, std::unique_ptr<ExpertSlices> experts,
                                 std::vector<int64_t> expert_slot)
    : inner_(std::move(inner.store)),
      inner_sharded_(inner.sharded),
      experts_(std::move(experts)),
      expert_slot_(std::move(expert_slot)) {}

int64_t HeldExpertStore::resident_weight_bytes() const {
  return inner_->resident_weight_bytes() + experts_->resident_weight_bytes();
}

model::ParamStore::TableRows HeldExpertStore::rows(size_t slot, std::span<const int32_t> ids, bool want_grads) {
  RF_CHECK(expert_slot(slot) < 0, "held experts: ", info(slot).name, " is no token table");
  return inner_->rows(slot, ids, want_grads);
}

void HeldExpertStore::acquire_head(size_t slot) {
  RF_CHECK(expert_slot(slot) < 0, "held experts: ", info(slot).name, " is no head");
  inner_->acquire_head(slot);
}

void HeldExpertStore::release_head(size_t slot) {
  RF_CHECK(expert_slot(slot) < 0, "held experts: ", info(slot).name, " is no head");
  inner_->release_head(slot);
}

void HeldExpertStore::allocate_weights() {
  inner_->allocate_weights();
  experts_->allocate_weights();
}

const float* HeldExpertStore::weight(size_t slot) const {
  const int64_t e = expert_slot(slot);
  return e < 0 ? inner_->weight(slot) : experts_->weight(static_cast<size_t>(e));
}

float* HeldExpertStore::mutable_weight(size_t slot) {
  const int64_t e = expert_slot(slot);
  return e < 0 ? inner_->mutable_weight(slot) : experts_->mutable_weight(static_cast<size_t>(e));
}

void HeldExpertStore::read_weight(size_t slot, std::span<float> out) {
  const int64_t e = expert_slot(slot);
  if (e < 0)
    inner_->read_weight(slot, out);
  else
    experts_->read_weight(static_cast<size_t>(e), out);
}

void HeldExpertStore::write_weight(size_t slot, std::span<const float> in) {
  const int64_t e = expert_slot(slot);
  if (e < 0)
    inner_->write_weight(slot, in);
  else
    experts_->write_weight(static_cast<size_t>(e), in);
}

void HeldExpertStore::load_weight(size_t slot, const io::TensorView& v) {
  const int64_t e = expert_slot(slot);
  if (e < 0)
    inner_->load_weight(slot, v);
  else
    experts_->load_weight(static_cast<size_t>(e), v);
}

float* HeldExpertStore::mutable_master(size_t slot, int64_t first) {
  RF_CHECK(expert_slot(slot) < 0, "held experts: ", info(slot).name, " is updated by the experts' own step");
  return inner_->mutable_master(slot, first);
}

const model::Bf16Lookup& HeldExpertStore::bf16_weights() {
  inner_b16_ = &inner_->bf16_weights();
  experts_b16_ = &experts_->bf16_weights();
  return *this;
}

const bf16* HeldExpertStore::find(const float* src, int64_t extent) const {
  if (experts_b16_ != nullptr)
    if (const bf16* b = experts_b16_->find(src, extent)) return b;
  return inner_b16_ != nullptr ? inner_b16_->find(src, extent) : nullptr;
}

void HeldExpertStore::allocate_grads() {
  inner_->allocate_grads();
  experts_->allocate_grads();
}

void HeldExpertStore::allocate_moments() {
  inner_->allocate_moments();
  experts_->allocate_moments();
}

void HeldExpertStore::zero_grads() {
  inner_->zero_grads();
  experts_->zero_grads();
}

float* HeldExpertStore::grad(size_t slot) {
  const int64_t e = expert_slot(slot);
  return e < 0 ? inner_->grad(slot) : experts_->grad(static_cast<size_t>(e));
}

const float* HeldExpertStore::grad(size_t slot) const {
  const int64_t e = expert_slot(slot);
  return e < 0 ? std::as_const(*inner_).grad(slot) : std::as_const(*experts_).grad(static_cast<size_t>(e));
}

float* HeldExpertStore::moment(Role role, size_t slot) {
  return expert_slot(slot) < 0 ? inner_->moment(role, slot) : nullptr;
}

const float* HeldExpertStore::moment(Role role, size_t slot) const {
  return expert_slot(slot) < 0 ? std::as_const(*inner_).moment(role, slot) : nullptr;
}

void HeldExpertStore::set_moment_range(int64_t begin, int64_t end) {
  inner_->set_moment_range(begin, end);
  record_moment_range(begin, end);
}

model::HeldWeight HeldExpertStore::held_weight(size_t slot) const {
  const int64_t e = expert_slot(slot);
  return e < 0 ? inner_->held_weight(slot) : experts_->held_weight(static_cast<size_t>(e));
}

void HeldExpertStore::before_backward(int layer) {
  inner_->before_backward(layer);
  experts_->begin_layer(layer);
}

void HeldExpertStore::after_backward(int layer) {
  inner_->after_backward(layer);
  experts_->end_layer(layer);
}

void HeldExpertStore::release_training_state() {
  // Registering drops nothing (the parts hold the state); a layout change after sealing would orphan it.
  if (sealed_) rf::fail("held experts: the trainable layout is fixed once the store is split (freeze before)");
}

// --- Building and gathering ---

namespace {

// Copies the moments of `from`'s trainable elements into `to`'s moment range, both registering the same slots
// (`slot_in_from` maps `to`'s slots to `from`'s) and `from` holding its moments over its whole trainable layout;
// `row_first`: the first element of `to`'s slot in `from`'s tensor.
template <typename SlotMap, typename RowFirst>
void copy_moments(const model::ParamStore& from, model::ParamStore& to, SlotMap slot_in_from, RowFirst row_first) {
  const model::Shard range = to.moment_range();
  for (const model::ParamStore::Segment& seg : to.trainable_segments(range.begin, range.end)) {
    const size_t src_slot = slot_in_from(seg.slot);
    for (Role role : {Role::ExpAvg, Role::ExpAvgSq}) {
      const float* src = from.moment(role, src_slot);
      RF_CHECK(src != nullptr, "held experts: no moments of ", from.info(src_slot).name, " to keep");
      std::copy_n(src + row_first(seg.slot) + seg.first, seg.n,
                  to.mutable_flat(role).data() + (seg.train_index - range.begin));
    }
  }
}

}  // namespace

std::unique_ptr<HeldExpertStore> place_held_experts(const model::ParamStore& registry,
                                                    const std::vector<bool>& trainable, HeldInner inner,
                                                    std::unique_ptr<ExpertSlices> experts, const HeldPlacement& at) {
  const size_t n = registry.size();
  RF_CHECK(trainable.size() == n, "held experts: ", trainable.size(), " trainable flags for ", n, " parameters");
  std::vector<int64_t> expert_slot(n, -1);
  std::vector<size_t> whole_slot_of_expert;
  std::vector<bool> inner_trainable(n), expert_trainable;
  std::vector<std::pair<int64_t, int64_t>> rows(n);  // [slot]: held rows (begin, total) of an expert tensor
  for (size_t i = 0; i < n; ++i) {
    const ParamInfo& p = registry.info(i);
    RF_CHECK(!p.holds_part(), "held experts: ", p.name, " is held in part already");
    std::vector<int64_t> shape = p.shape;
    const bool expert = model::is_expert_tensor(p);
    if (expert) {
      const int64_t E = shape.at(0);
      RF_CHECK(E % at.ep == 0, "expert parallelism: ", p.name, "'s ", E, " experts do not divide over ", at.ep,
               " EP ranks");
      rows[i] = {at.ep_rank * (E / at.ep), E};
      shape[0] = E / at.ep;
      expert_slot[i] = static_cast<int64_t>(experts->add(p.name, shape, p.layer, p.matmul));
      whole_slot_of_expert.push_back(i);
      expert_trainable.push_back(trainable[i]);
      std::vector<int64_t> none = p.shape;
      none[0] = 0;
      inner.store->add(p.name, std::move(none), p.layer, p.matmul);
    } else {
      const size_t slot = inner.store->add(p.name, p.shape, p.layer, p.matmul);
      // The token tables and the head stay streamed: under shard full never gathered whole (sharded_store.h).
      if (p.streamed) inner.store->mark_streamed(slot);
    }
    inner_trainable[i] = !expert && trainable[i];
  }
  inner.store->set_trainable(inner_trainable);
  experts->set_trainable(expert_trainable);
  for (size_t e = 0; e < whole_slot_of_expert.size(); ++e) {
    const std::pair<int64_t, int64_t> r = rows[whole_slot_of_expert[e]];
    experts->hold_rows(e, r.first, r.second);
  }

  // The model's registry: every parameter, the experts with their held rows and marked frozen (their training state
  // is ExpertSlices').
  auto held = std::make_unique<HeldExpertStore>(std::move(inner), std::move(experts), std::move(expert_slot));
  for (size_t i = 0; i < n; ++i) {
    const ParamInfo& p = registry.info(i);
    std::vector<int64_t> shape = p.shape;
    if (held->expert_slot(i) >= 0) shape[0] = p.shape[0] / at.ep;
    held->add(p.name, std::move(shape), p.layer, p.matmul);
    if (held->expert_slot(i) >= 0) held->hold_rows(i, rows[i].first, rows[i].second);
    if (p.streamed) held->mark_streamed(i);
  }
  held->set_trainable(inner_trainable);
  held->seal();
  return held;
}

void set_held_moment_ranges(HeldExpertStore& held, const HeldPlacement& at) {
  const comm::Slice own = held.experts().own();
  held.experts().set_moment_range(static_cast<int64_t>(own.begin), static_cast<int64_t>(own.end));
  const model::Shard mine = model::shard_of(held.inner().trainable_elements(), at.world_rank, at.world_size);
  held.set_moment_range(mine.begin, mine.end);
}

std::unique_ptr<HeldExpertStore> make_held_expert_store(const model::ParamStore& whole, HeldInner inner,
                                                        std::unique_ptr<ExpertSlices> experts,
                                                        const HeldPlacement& at) {
  RF_CHECK(whole.weights_allocated(), "held experts: the whole store has no weights to split");
  const bool moments = whole.has_moments();
  RF_CHECK(!moments || whole.moment_range().size() == whole.trainable_elements(),
           "held experts: the whole store's moments must cover its whole trainable layout");
  const size_t n = whole.size();
  std::vector<bool> trainable(n);
  for (size_t i = 0; i < n; ++i) trainable[i] = whole.info(i).trainable;
  std::unique_ptr<HeldExpertStore> held =
      place_held_experts(whole, trainable, std::move(inner), std::move(experts), at);
  ExpertSlices& ex = held->experts();
  model::ParamStore& in = held->inner();
  std::vector<size_t> whole_slot_of_expert(ex.size());
  for (size_t i = 0; i < n; ++i)
    if (held->expert_slot(i) >= 0) whole_slot_of_expert[static_cast<size_t>(held->expert_slot(i))] = i;

  // The experts: this EP rank's rows.
  ex.allocate_weights();
  for (size_t e = 0; e < ex.size(); ++e) {
    const ParamInfo& p = ex.info(e);
    std::copy_n(whole.weight(whole_slot_of_expert[e]) + p.rows_begin * model::row_elements(p), p.numel,
                ex.mutable_weight(e));
  }

  // The rest: the inner store takes the whole weights of the non-expert parameters. A sharded store adopts them
  // from a replicated store of its registry.
  model::ReplicatedStore staged;
  std::vector<bool> inner_trainable(n);
  for (size_t i = 0; i < n; ++i) {
    const ParamInfo& p = in.info(i);
    const size_t slot = staged.add(p.name, p.shape, p.layer, p.matmul);
    if (p.streamed) staged.mark_streamed(slot);
    inner_trainable[i] = p.trainable;
  }
  staged.set_trainable(inner_trainable);
  staged.allocate_weights();
  for (size_t i = 0; i < n; ++i)
    if (held->expert_slot(i) < 0) std::copy_n(whole.weight(i), whole.info(i).numel, staged.mutable_weight(i));
  if (ShardedStore* sharded = held->inner_sharded()) {
    sharded->adopt(staged);
  } else {
    in.allocate_weights();
    for (size_t i = 0; i < n; ++i)
      if (held->expert_slot(i) < 0) std::copy_n(staged.weight(i), staged.info(i).numel, in.mutable_weight(i));
  }

  // The moments: the experts' over this rank's EDP slice, the rest's over this world rank's slice of their layout.
  set_held_moment_ranges(*held, at);
  if (moments) {
    ex.allocate_moments();
    copy_moments(
        whole, ex, [&](size_t e) { return whole_slot_of_expert[e]; },
        [&](size_t e) { return ex.info(e).rows_begin * model::row_elements(ex.info(e)); });
    in.allocate_moments();
    copy_moments(
        whole, in, [](size_t i) { return i; }, [](size_t) { return int64_t{0}; });
  }
  return held;
}

HeldBytes held_expert_bytes(const model::ParamStore& registry, const std::vector<bool>& trainable, bool shard_full,
                            bool shard_gradients, int ranks, int ep, int64_t step_tokens) {
  constexpr int64_t kF = sizeof(float), kB = sizeof(bf16);
  constexpr int kMoments = 2;  // exp_avg, exp_avg_sq
  const int Q = ranks / ep;
  // The rest's registry: the expert tensors with no rows, as the inner store registers them.
  model::ReplicatedStore rest;
  std::vector<bool> rest_trainable(registry.size());
  int64_t held = 0, held_trainable = 0, held_matmul = 0, largest_layer = 0;
  std::vector<int64_t> layer_trainable;
  int64_t rest_elements = 0, rest_train = 0, rest_matmul = 0;
  for (size_t i = 0; i < registry.size(); ++i) {
    const ParamInfo& p = registry.info(i);
    std::vector<int64_t> shape = p.shape;
    if (model::is_expert_tensor(p)) {
      const int64_t mine = p.numel / ep;
      held += mine;
      if (p.matmul) held_matmul += mine;
      if (trainable[i]) {
        held_trainable += mine;
        if (static_cast<size_t>(p.layer) >= layer_trainable.size())
          layer_trainable.resize(static_cast<size_t>(p.layer) + 1, 0);
        layer_trainable[static_cast<size_t>(p.layer)] += mine;
      }
      shape[0] = 0;
    } else {
      rest_elements += p.numel;
      if (trainable[i]) rest_train += p.numel;
      if (p.matmul) rest_matmul += p.numel;
      rest_trainable[i] = trainable[i];
    }
    const size_t slot = rest.add(p.name, std::move(shape), p.layer, p.matmul);
    if (p.streamed) rest.mark_streamed(slot);  // as the inner store registers it
  }
  for (int64_t n : layer_trainable) largest_layer = std::max(largest_layer, n);
  HeldBytes b;
  if (shard_full || shard_gradients) {
    const ShardedStore::Bytes s =
        ShardedStore::bytes_for(rest, rest_trainable,
                                shard_full ? ShardedStore::Mode::Full : ShardedStore::Mode::Gradients, ranks,
                                step_tokens);
    b.rest_weights = s.weight_shard;
    b.rest_gathered = s.gathered;
    b.rest_gradients = s.gradients;
    b.rest_moments = s.moments;
    b.rest_comm_buffers = s.comm_buffers;
    b.rest_bf16 = shard_full ? s.gathered / (kF / kB) : rest_matmul * kB;
  } else {
    b.rest_weights = rest_elements * kF;
    b.rest_gradients = rest_train * kF;
    b.rest_moments = kMoments * model::shard_of(rest_train, 0, ranks).padded * kF;
    b.rest_bf16 = rest_matmul * kB;
  }
  const int64_t slice = model::shard_of(held_trainable, 0, Q).padded;
  b.expert_weights = held * kF;
  b.expert_moments = kMoments * slice * kF;
  // gradients, full: the slice, the layer in backward's buffer, and the Q runs of it received (end_layer).
  b.expert_gradients = shard_full || shard_gradients ? (slice + 2 * largest_layer) * kF : held_trainable * kF;
  b.expert_bf16 = held_matmul * kB;
  return b;
}

std::vector<double> held_norm_partials(HeldExpertStore& held, std::span<const float> rest, const HeldGroups& g) {
  // A run of the whole trainable layout held by one world rank (values: null on the others).
  struct Run {
    const float* values = nullptr;
    int64_t n = 0;
    int holder = 0;
  };
  const int P = g.world.size(), me = g.world.rank(), ep = g.ep.size(), Q = g.edp.size();
  const model::ParamStore& inner = held.inner();
  ExpertSlices& experts = held.experts();
  const std::span<float> own_experts = experts.own_grads();
  const comm::Slice own = experts.own();
  const auto inner_total = static_cast<size_t>(inner.trainable_elements());
  const auto expert_total = static_cast<size_t>(experts.trainable_elements());
  const comm::Slice rest_slice = comm::slice_of(inner_total, P, me);
  RF_CHECK(rest.size() == rest_slice.size(), "held experts: ", rest.size(), " reduced gradients for a slice of ",
           rest_slice.size());
  std::vector<Run> runs;
  size_t whole = 0;
  // The part of [base, base + n) of a layout of `total` elements in each of `ranks` slices, held by world rank
  // holder(q), whose values are `mine` (the slice `mine_slice`) on this rank.
  const auto cut = [&](size_t base, size_t n, size_t total, int ranks, auto holder, const float* mine,
                       comm::Slice mine_slice) {
    for (int q = 0; q < ranks; ++q) {
      const comm::Slice s = comm::slice_of(total, ranks, q);
      const size_t lo = std::max(base, s.begin), hi = std::min(base + n, s.end);
      if (lo >= hi) continue;
      const int h = holder(q);
      runs.push_back({h == me ? mine + (lo - mine_slice.begin) : nullptr, static_cast<int64_t>(hi - lo), h});
      whole += hi - lo;
    }
  };
  for (size_t i = 0; i < held.size(); ++i) {
    const int64_t e = held.expert_slot(i);
    if (e < 0) {
      const ParamInfo& p = held.info(i);
      if (!p.trainable || p.numel == 0) continue;
      cut(
          static_cast<size_t>(p.train_offset), static_cast<size_t>(p.numel), inner_total, P, [](int q) { return q; },
          rest.data(), rest_slice);
      continue;
    }
    const ParamInfo& p = experts.info(static_cast<size_t>(e));
    if (!p.trainable || p.numel == 0) continue;
    for (int a = 0; a < ep; ++a)  // EP rank a's rows, held by its EDP group: world ranks b * ep + a
      cut(
          static_cast<size_t>(p.train_offset), static_cast<size_t>(p.numel), expert_total, Q,
          [&](int b) { return b * ep + a; }, own_experts.data(), own);
  }
  std::vector<double> partial(static_cast<size_t>(P), 0.0);
  int q = 0, last = -1;  // the world slice being summed; the holder of its running sum (-1: none yet, zero)
  size_t at = 0;
  double sum = 0.0;
  const auto close_slices = [&] {
    while (q < P && at == comm::slice_of(whole, P, q).end) {
      if (last == me || (last < 0 && me == 0)) partial[static_cast<size_t>(q)] = sum;
      ++q;
      sum = 0.0;
      last = -1;
    }
  };
  close_slices();
  for (const Run& run : runs) {
    for (int64_t off = 0; off < run.n;) {
      const int64_t k = std::min<int64_t>(run.n - off, static_cast<int64_t>(comm::slice_of(whole, P, q).end - at));
      if (last >= 0 && last != run.holder) g.world.broadcast(&sum, sizeof(double), last, g.timeout);
      last = run.holder;
      if (run.holder == me)
        for (int64_t j = off; j < off + k; ++j) sum += static_cast<double>(run.values[j]) * run.values[j];
      off += k;
      at += static_cast<size_t>(k);
      close_slices();
    }
  }
  // Each slice's sum is on the rank that closed it (zeros elsewhere): a sum of one value and zeros keeps its bits.
  g.world.allreduce(partial.data(), partial.size(), comm::ReduceOp::Sum, g.timeout);
  return partial;
}

}  // namespace rf::trainer
