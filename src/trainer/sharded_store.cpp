// ringflex trainer: the sharded parameter store (see sharded_store.h).
#include "trainer/sharded_store.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "core/error.h"
#include "model/ops.h"

namespace rf::trainer {

using model::ParamInfo;
using model::Role;

// One hook group (a decoder layer, or the global group): its slots and where each lies in the group's buffers.
struct ShardedStore::Group {
  int layer = model::kGlobalGroup;
  std::vector<size_t> slots;     // registration order
  std::vector<int64_t> at;       // [slots]: first element in the gathered weights buffer
  std::vector<int64_t> grad_at;  // [slots]: first element in the gradient buffer; -1 when frozen
  int64_t elements = 0, grad_elements = 0;
};

// A group's weights gathered (or on their way): every rank's pieces land in `staging` in rank order, then are put
// in place in `w` [elements] (and their bf16 copies in `b16`).
struct ShardedStore::Gathered {
  const Group* group = nullptr;
  bool trainable_only = false;
  std::vector<float> staging;
  std::vector<size_t> part_bytes;  // [P]
  comm::PostedPtr posted;          // null once finished
  std::vector<float> w;
  std::vector<bf16> b16;
};

// A group's gradients on their way to their owners: `send` holds every owner's pieces in rank order, `recv` [P, n]
// the N contributions to this rank's n elements.
struct ShardedStore::Reduction {
  const Group* group = nullptr;
  std::vector<float> send, recv;
  std::vector<size_t> send_bytes, recv_bytes;  // [P]
  comm::PostedPtr posted;
};

ShardedStore::ShardedStore(std::unique_ptr<comm::Communicator> comm, Mode mode, comm::Timeout timeout,
                           std::vector<std::string> freeze)
    : comm_(std::move(comm)),
      mode_(mode),
      timeout_(timeout),
      freeze_(std::move(freeze)),
      P_(comm_->size()),
      me_(comm_->rank()) {}

ShardedStore::~ShardedStore() = default;

ShardedStore::Group& ShardedStore::group_of(int layer) {
  return const_cast<Group&>(std::as_const(*this).group_of(layer));
}

const ShardedStore::Group& ShardedStore::group_of(int layer) const {
  RF_CHECK(adopted_ && layer >= model::kGlobalGroup && layer < layers_, "sharded store: layer ", layer, " outside its ",
           layers_, " layers (or no weights adopted yet)");
  return groups_[static_cast<size_t>(layer + 1)];
}

ShardedStore::Piece ShardedStore::piece(size_t slot, int q) const {
  const ParamInfo& p = info(slot);
  const int64_t base = p.trainable ? p.train_offset : frozen_offset_[slot];
  const comm::Slice s = comm::slice_of(static_cast<size_t>(p.trainable ? trainable_elements() : frozen_total_), P_, q);
  const int64_t lo = std::max(base, static_cast<int64_t>(s.begin));
  const int64_t hi = std::min(base + p.numel, static_cast<int64_t>(s.end));
  if (lo >= hi) return {};
  return Piece{lo - base, hi - lo, lo - static_cast<int64_t>(s.begin)};
}

void ShardedStore::adopt(const model::ParamStore& whole) {
  RF_CHECK(whole.size() == size() && whole.weights_allocated(), "sharded store: adopting a store of ", whole.size(),
           " parameters (weights allocated: ", whole.weights_allocated(), ") into one of ", size());
  std::vector<bool> trainable(size());
  for (size_t i = 0; i < size(); ++i) {
    RF_CHECK(whole.info(i).name == info(i).name && whole.info(i).numel == info(i).numel, "sharded store: parameter ", i,
             " is ", info(i).name, " here and ", whole.info(i).name, " in the source");
    trainable[i] = whole.info(i).trainable;
  }
  set_trainable(trainable);
  lay_out();
  if (mode_ == Mode::Gradients) {
    ReplicatedStore::allocate_weights();
    const std::span<const float> all = whole.flat(Role::Weights);
    RF_CHECK(static_cast<int64_t>(all.size()) == total_elements(), "sharded store: the source's weights are not flat");
    std::copy(all.begin(), all.end(), ReplicatedStore::mutable_flat(Role::Weights).begin());
    return;
  }
  release_weights();
  own_trainable_.assign(mine_trainable_.size(), 0.f);
  own_frozen_.assign(mine_frozen_.size(), 0.f);
  for (size_t i = 0; i < size(); ++i) {
    const Piece pc = piece(i, me_);
    float* own = (info(i).trainable ? own_trainable_.data() : own_frozen_.data()) + pc.local;
    std::copy_n(whole.weight(i) + pc.first, pc.n, own);
  }
  weights_changed();
}

void ShardedStore::allocate_weights() {
  if (weights_allocated()) return;
  freeze(freeze_);
  lay_out();
  if (mode_ == Mode::Gradients) {
    ReplicatedStore::allocate_weights();
    return;
  }
  own_trainable_.assign(mine_trainable_.size(), 0.f);
  own_frozen_.assign(mine_frozen_.size(), 0.f);
  weights_changed();
}

// Under full a rank's pieces are its slices of the trainable and of the frozen layout, ceil(n / N) elements each at
// most: together at most one element over its slice of all the parameters, whichever flags freeze() sets later.
int64_t ShardedStore::resident_weight_bytes() const {
  if (mode_ == Mode::Gradients) return weight_bytes();
  return (model::shard_of(total_elements(), me_, P_).padded + 1) * static_cast<int64_t>(sizeof(float));
}

void ShardedStore::write_weight(size_t slot, std::span<const float> in) {
  if (!sharded()) {
    ReplicatedStore::write_weight(slot, in);
    return;
  }
  const ParamInfo& p = info(slot);
  RF_CHECK(static_cast<int64_t>(in.size()) == p.numel, "write_weight: ", in.size(), " elements for ", p.name, " of ",
           p.numel);
  const Piece pc = piece(slot, me_);
  std::copy_n(in.data() + pc.first, pc.n, (p.trainable ? own_trainable_.data() : own_frozen_.data()) + pc.local);
  weights_changed();
  global_stale_ = true;
}

std::span<const float> ShardedStore::own_piece(size_t slot, int64_t* first) const {
  RF_CHECK(sharded(), "sharded store: own_piece while the weights are whole");
  const Piece pc = piece(slot, me_);
  *first = pc.first;
  const float* own = (info(slot).trainable ? own_trainable_.data() : own_frozen_.data()) + pc.local;
  return {own, static_cast<size_t>(pc.n)};
}

void ShardedStore::lay_out() {
  frozen_offset_.assign(size(), -1);
  frozen_total_ = 0;
  layers_ = 0;
  for (size_t i = 0; i < size(); ++i) {
    if (!info(i).trainable) {
      frozen_offset_[i] = frozen_total_;
      frozen_total_ += info(i).numel;
    }
    layers_ = std::max(layers_, info(i).layer + 1);
  }
  groups_.assign(static_cast<size_t>(layers_ + 1), Group{});
  for (size_t i = 0; i < size(); ++i) {
    Group& g = groups_[static_cast<size_t>(info(i).layer + 1)];
    g.layer = info(i).layer;
    g.slots.push_back(i);
    g.at.push_back(g.elements);
    g.elements += info(i).numel;
    g.grad_at.push_back(info(i).trainable ? g.grad_elements : -1);
    if (info(i).trainable) g.grad_elements += info(i).numel;
  }
  mine_trainable_ = comm::slice_of(static_cast<size_t>(trainable_elements()), P_, me_);
  mine_frozen_ = comm::slice_of(static_cast<size_t>(frozen_total_), P_, me_);
  live_.clear();
  live_.resize(groups_.size());
  adopted_ = true;
  global_stale_ = true;
}

void ShardedStore::wait(comm::PostedCollective& c) {
  const auto start = std::chrono::steady_clock::now();
  c.wait(timeout_);
  exposed_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double ShardedStore::take_exposed_seconds() { return std::exchange(exposed_seconds_, 0.0); }

// Every rank packs its pieces of the group's slots (its own masters in full; its part of the whole weights in
// gradients, where only trainable pieces travel) and posts one all-gather of the parts.
std::unique_ptr<ShardedStore::Gathered> ShardedStore::post_gather(const Group& g, bool trainable_only) {
  auto t = std::make_unique<Gathered>();
  t->group = &g;
  t->trainable_only = trainable_only;
  t->part_bytes.assign(static_cast<size_t>(P_), 0);
  size_t total = 0, at_mine = 0;
  for (int q = 0; q < P_; ++q) {
    if (q == me_) at_mine = total;
    for (size_t slot : g.slots)
      if (!trainable_only || info(slot).trainable) t->part_bytes[static_cast<size_t>(q)] += piece(slot, q).n;
    total += t->part_bytes[static_cast<size_t>(q)];
    t->part_bytes[static_cast<size_t>(q)] *= sizeof(float);
  }
  t->staging.resize(total);
  float* out = t->staging.data() + at_mine;
  for (size_t slot : g.slots) {
    if (trainable_only && !info(slot).trainable) continue;
    const Piece pc = piece(slot, me_);
    const float* src = mode_ == Mode::Full
                           ? (info(slot).trainable ? own_trainable_.data() : own_frozen_.data()) + pc.local
                           : ReplicatedStore::weight(slot) + pc.first;
    out = std::copy_n(src, pc.n, out);
  }
  if (P_ > 1) t->posted = comm_->post_allgatherv(t->staging.data(), t->part_bytes);
  return t;
}

// Puts every rank's pieces in place: in the group's buffer (full, sharded), or in the whole weights.
void ShardedStore::finish_gather(Gathered& t) {
  if (t.posted) {
    wait(*t.posted);
    t.posted.reset();
  }
  const Group& g = *t.group;
  const bool into_whole = ReplicatedStore::weights_allocated();
  if (!into_whole) t.w.resize(static_cast<size_t>(g.elements));
  const float* in = t.staging.data();
  for (int q = 0; q < P_; ++q) {
    for (size_t k = 0; k < g.slots.size(); ++k) {
      const size_t slot = g.slots[k];
      if (t.trainable_only && !info(slot).trainable) continue;
      const Piece pc = piece(slot, q);
      if (into_whole && mode_ == Mode::Gradients && q == me_) {  // this rank's pieces are in place already
        in += pc.n;
        continue;
      }
      float* dst = into_whole ? ReplicatedStore::mutable_weight(slot) : t.w.data() + g.at[k];
      std::copy_n(in, pc.n, dst + pc.first);
      in += pc.n;
    }
  }
  t.staging = {};
  if (into_whole || !bf16_wanted_) return;
  t.b16.resize(t.w.size());
  for (size_t k = 0; k < g.slots.size(); ++k)
    if (info(g.slots[k]).matmul)
      model::round_to_bf16(t.w.data() + g.at[k], t.b16.data() + g.at[k], info(g.slots[k]).numel);
}

// The layer's weights gathered and in place: waits for the posted gather, or gathers now.
void ShardedStore::acquire(int layer) {
  if (!sharded()) return;
  std::unique_ptr<Gathered>& slot = live_[static_cast<size_t>(layer + 1)];
  if (!slot) slot = post_gather(group_of(layer), false);
  if (slot->posted || !slot->staging.empty()) finish_gather(*slot);
}

void ShardedStore::unshard() {
  RF_CHECK(adopted_, "sharded store: unshard before adopt");
  if (mode_ != Mode::Full || !sharded()) return;
  ReplicatedStore::allocate_weights();
  for (const Group& g : groups_) {
    std::unique_ptr<Gathered> t = post_gather(g, false);
    finish_gather(*t);
  }
  live_.clear();
  live_.resize(groups_.size());
}

void ShardedStore::reshard() {
  if (mode_ != Mode::Full || sharded()) return;
  release_weights();
  global_stale_ = true;
}

void ShardedStore::after_update() {
  if (mode_ == Mode::Full) {
    global_stale_ = true;
    return;
  }
  for (const Group& g : groups_) {
    std::unique_ptr<Gathered> t = post_gather(g, true);
    finish_gather(*t);
  }
}

const float* ShardedStore::weight(size_t slot) const {
  if (!sharded()) return ReplicatedStore::weight(slot);
  const ParamInfo& p = info(slot);
  const Gathered* g = live_[static_cast<size_t>(p.layer + 1)].get();
  RF_CHECK(g != nullptr && !g->posted && g->staging.empty(), "sharded store: ", p.name,
           " is read outside its layer's hooks (its weights are not gathered)");
  const Group& grp = group_of(p.layer);
  const auto k = std::find(grp.slots.begin(), grp.slots.end(), slot) - grp.slots.begin();
  return g->w.data() + grp.at[static_cast<size_t>(k)];
}

float* ShardedStore::mutable_weight(size_t slot) {
  RF_CHECK(!sharded(), "sharded store: ", info(slot).name,
           " written while sharded (the optimizer writes masters; a loader writes before adopt)");
  return ReplicatedStore::mutable_weight(slot);
}

void ShardedStore::read_weight(size_t slot, std::span<float> out) {
  if (!sharded()) {
    ReplicatedStore::read_weight(slot, out);
    return;
  }
  const ParamInfo& p = info(slot);
  RF_CHECK(static_cast<int64_t>(out.size()) == p.numel, "read_weight: ", out.size(), " elements for ", p.name, " of ",
           p.numel);
  std::vector<size_t> part_bytes(static_cast<size_t>(P_));
  int64_t at_mine = 0;
  for (int q = 0; q < P_; ++q) {
    const Piece pc = piece(slot, q);
    if (q < me_) at_mine += pc.n;
    part_bytes[static_cast<size_t>(q)] = static_cast<size_t>(pc.n) * sizeof(float);
  }
  // The pieces of one tensor are consecutive ranks' in element order: the gathered parts are the tensor itself.
  const Piece mine = piece(slot, me_);
  const float* own = (p.trainable ? own_trainable_.data() : own_frozen_.data()) + mine.local;
  std::copy_n(own, mine.n, out.data() + at_mine);
  if (P_ > 1) {
    comm::PostedPtr c = comm_->post_allgatherv(out.data(), part_bytes);
    wait(*c);
  }
}

float* ShardedStore::mutable_master(size_t slot, int64_t first) {
  if (mode_ == Mode::Gradients) return ReplicatedStore::mutable_weight(slot) + first;
  RF_CHECK(sharded(), "sharded store: the optimizer stepped while the weights were gathered whole (reshard first)");
  const ParamInfo& p = info(slot);
  RF_CHECK(p.trainable, "sharded store: ", p.name, " is frozen and has no master to update");
  const int64_t at = p.train_offset + first - static_cast<int64_t>(mine_trainable_.begin);
  RF_CHECK(at >= 0 && at < static_cast<int64_t>(own_trainable_.size()), "sharded store: element ", first, " of ",
           p.name, " is not this rank's");
  weights_changed();
  global_stale_ = true;
  return own_trainable_.data() + at;
}

const model::Bf16Lookup& ShardedStore::bf16_weights() {
  if (!sharded()) return ReplicatedStore::bf16_weights();
  bf16_wanted_ = true;
  return *this;
}

const bf16* ShardedStore::find(const float* src, int64_t extent) const {
  if (!sharded()) return ReplicatedStore::find(src, extent);
  const uintptr_t at = reinterpret_cast<uintptr_t>(src);
  for (const std::unique_ptr<Gathered>& g : live_) {
    if (!g || g->b16.empty()) continue;
    const uintptr_t base = reinterpret_cast<uintptr_t>(g->w.data());
    if (at < base || (at - base) % sizeof(float) != 0) continue;
    const int64_t offset = static_cast<int64_t>((at - base) / sizeof(float));
    if (offset >= static_cast<int64_t>(g->w.size())) continue;
    const Group& grp = *g->group;
    const auto it = std::upper_bound(grp.at.begin(), grp.at.end(), offset);
    const size_t k = static_cast<size_t>(it - grp.at.begin()) - 1;
    const ParamInfo& p = info(grp.slots[k]);
    if (!p.matmul || offset + extent > grp.at[k] + p.numel) return nullptr;
    return g->b16.data() + offset;
  }
  return nullptr;
}

void ShardedStore::allocate_grads() {
  if (grads_allocated_) return;
  RF_CHECK(adopted_, "sharded store: gradients before adopt");
  grads_.assign(mine_trainable_.size(), 0.f);
  global_grads_.assign(static_cast<size_t>(group_of(model::kGlobalGroup).grad_elements), 0.f);
  grads_allocated_ = true;
}

void ShardedStore::zero_grads() {
  std::fill(grads_.begin(), grads_.end(), 0.f);
  std::fill(global_grads_.begin(), global_grads_.end(), 0.f);
}

void ShardedStore::release_training_state() {
  ReplicatedStore::release_training_state();
  grads_ = {};
  global_grads_ = {};
  layer_grads_ = {};
  grads_allocated_ = false;
}

const float* ShardedStore::grad(size_t slot) const {
  const ParamInfo& p = info(slot);
  if (!grads_allocated_ || !p.trainable) return nullptr;
  RF_CHECK(p.layer == model::kGlobalGroup || p.layer == grad_layer_, "sharded store: the gradient of ", p.name,
           " is asked for outside its layer's backward");
  const Group& g = group_of(p.layer);
  const auto k = static_cast<size_t>(std::find(g.slots.begin(), g.slots.end(), slot) - g.slots.begin());
  return (p.layer == model::kGlobalGroup ? global_grads_.data() : layer_grads_.data()) + g.grad_at[k];
}

float* ShardedStore::grad(size_t slot) { return const_cast<float*>(std::as_const(*this).grad(slot)); }

std::span<const float> ShardedStore::flat(Role role) const {
  if (role == Role::Grads) return grads_;
  return ReplicatedStore::flat(role);
}

std::span<float> ShardedStore::mutable_flat(Role role) {
  if (role == Role::Grads) return grads_;
  return ReplicatedStore::mutable_flat(role);
}

// Sends each owner its pieces of the group's gradients (this rank's own piece is copied).
std::unique_ptr<ShardedStore::Reduction> ShardedStore::post_reduce(const Group& g, const float* grads) {
  auto t = std::make_unique<Reduction>();
  t->group = &g;
  t->send.resize(static_cast<size_t>(g.grad_elements));
  t->send_bytes.assign(static_cast<size_t>(P_), 0);
  float* out = t->send.data();
  int64_t mine = 0;
  for (int q = 0; q < P_; ++q) {
    for (size_t k = 0; k < g.slots.size(); ++k) {
      if (g.grad_at[k] < 0) continue;
      const Piece pc = piece(g.slots[k], q);
      out = std::copy_n(grads + g.grad_at[k] + pc.first, pc.n, out);
      t->send_bytes[static_cast<size_t>(q)] += static_cast<size_t>(pc.n) * sizeof(float);
      if (q == me_) mine += pc.n;
    }
  }
  t->recv_bytes.assign(static_cast<size_t>(P_), static_cast<size_t>(mine) * sizeof(float));
  if (P_ == 1) {
    t->recv = std::move(t->send);
    return t;
  }
  t->recv.resize(static_cast<size_t>(mine) * static_cast<size_t>(P_));
  t->posted = comm_->post_alltoallv(t->send.data(), t->send_bytes, t->recv.data(), t->recv_bytes);
  return t;
}

// Each element of this rank's pieces: the P contributions summed in rank order in double, rounded once (the
// combination of Communicator::reduce_scatter), then added into the slice.
void ShardedStore::finish_reduce(Reduction& t) {
  if (t.posted) {
    wait(*t.posted);
    t.posted.reset();
  }
  const Group& g = *t.group;
  const size_t n = t.recv.size() / static_cast<size_t>(P_);
  size_t i = 0;
  for (size_t k = 0; k < g.slots.size(); ++k) {
    if (g.grad_at[k] < 0) continue;
    const Piece pc = piece(g.slots[k], me_);
    float* dst = grads_.data() + pc.local;
    for (int64_t e = 0; e < pc.n; ++e, ++i) {
      double sum = t.recv[i];
      for (int q = 1; q < P_; ++q) sum += t.recv[static_cast<size_t>(q) * n + i];
      dst[e] += static_cast<float>(sum);
    }
  }
}

void ShardedStore::before_forward(int layer) {
  if (pending_ && pending_->posted) pending_->posted->progress();
  if (!sharded()) return;
  if (layer == model::kGlobalGroup) {
    std::unique_ptr<Gathered>& global = live_[0];
    if (global_stale_) global.reset();
    acquire(model::kGlobalGroup);
    global_stale_ = false;
    if (layers_ > 0 && !live_[1]) live_[1] = post_gather(group_of(0), false);
    return;
  }
  acquire(layer);
  if (layer + 1 < layers_ && !live_[static_cast<size_t>(layer + 2)])
    live_[static_cast<size_t>(layer + 2)] = post_gather(group_of(layer + 1), false);
}

void ShardedStore::after_forward(int layer) {
  if (!sharded()) return;
  // The last layer stays gathered for its backward, which comes next (after the loss): one gather fewer a step, and
  // none waiting behind the loss, where no layer computes. A forward-only run ends with kGlobalGroup: no backward
  // will read it then.
  if (layer == model::kGlobalGroup) {
    if (layers_ > 0) live_[static_cast<size_t>(layers_)].reset();
    return;
  }
  if (layer + 1 < layers_) live_[static_cast<size_t>(layer + 1)].reset();
}

void ShardedStore::before_backward(int layer) {
  if (pending_ && pending_->posted) pending_->posted->progress();
  if (layer == model::kGlobalGroup) return;
  if (sharded()) {
    acquire(layer);
    if (layer > 0 && !live_[static_cast<size_t>(layer)])
      live_[static_cast<size_t>(layer)] = post_gather(group_of(layer - 1), false);
  }
  if (!grads_allocated_) return;
  grad_layer_ = layer;
  layer_grads_.assign(static_cast<size_t>(group_of(layer).grad_elements), 0.f);
}

void ShardedStore::after_backward(int layer) {
  if (grads_allocated_) {
    if (pending_) finish_reduce(*pending_);
    pending_.reset();
    if (layer == model::kGlobalGroup) {
      std::unique_ptr<Reduction> t = post_reduce(group_of(layer), global_grads_.data());
      finish_reduce(*t);
      std::fill(global_grads_.begin(), global_grads_.end(), 0.f);
    } else {
      pending_ = post_reduce(group_of(layer), layer_grads_.data());
      layer_grads_ = {};
      grad_layer_ = model::kGlobalGroup - 1;
    }
  }
  if (sharded() && layer != model::kGlobalGroup) live_[static_cast<size_t>(layer + 1)].reset();
}

bool ShardedStore::progress() {
  bool done = true;
  for (const std::unique_ptr<Gathered>& g : live_)
    if (g && g->posted) done = g->posted->progress() && done;
  if (pending_ && pending_->posted) done = pending_->posted->progress() && done;
  return done;
}

ShardedStore::Bytes ShardedStore::bytes_for(const model::ParamStore& registry, const std::vector<bool>& trainable,
                                            Mode mode, int ranks) {
  constexpr int64_t kF = sizeof(float);
  int64_t train = 0, frozen = 0, global = 0, global_train = 0, largest = 0, largest_train = 0;
  std::vector<int64_t> layer(1, 0), layer_train(1, 0);
  for (size_t i = 0; i < registry.size(); ++i) {
    const ParamInfo& p = registry.info(i);
    (trainable[i] ? train : frozen) += p.numel;
    if (p.layer == model::kGlobalGroup) {
      global += p.numel;
      if (trainable[i]) global_train += p.numel;
      continue;
    }
    if (static_cast<size_t>(p.layer) >= layer.size()) {
      layer.resize(static_cast<size_t>(p.layer) + 1, 0);
      layer_train.resize(static_cast<size_t>(p.layer) + 1, 0);
    }
    layer[static_cast<size_t>(p.layer)] += p.numel;
    if (trainable[i]) layer_train[static_cast<size_t>(p.layer)] += p.numel;
  }
  largest = *std::max_element(layer.begin(), layer.end());
  largest_train = *std::max_element(layer_train.begin(), layer_train.end());
  const int64_t slice = model::shard_of(train, 0, ranks).padded;
  Bytes b;
  constexpr int kLayersGathered = 2;  // the layer computing and the next one, posted
  constexpr int kMoments = 2;         // exp_avg, exp_avg_sq
  if (mode == Mode::Full) {
    b.weight_shard = (slice + model::shard_of(frozen, 0, ranks).padded) * kF;
    b.gathered = (global + kLayersGathered * largest) * kF;
    // Staging of the gathers in flight; each layer's staging is freed once it is put in place.
    b.comm_buffers = kLayersGathered * largest * kF;
  } else {
    b.weight_shard = (train + frozen) * kF;
  }
  b.gradients = (slice + global_train + largest_train) * kF;
  b.moments = kMoments * slice * kF;
  // One reduction in flight and the one being posted: a send copy of a layer's gradients and P slices received.
  constexpr int kReductions = 2;
  b.comm_buffers += kReductions * (largest_train + ranks * model::shard_of(largest_train, 0, ranks).padded) * kF;
  return b;
}

}  // namespace rf::trainer
