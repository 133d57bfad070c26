// ringflex trainer: the sharded parameter store (see sharded_store.h).
#include <algorithm>
#include <chrono>
#include <cstring>
#include <utility>

#include "core/error.h"
#include "io/tensor_access.h"
#include "model/ops.h"
#include "trainer/state/sharded_store_parts.h"

namespace rf::trainer {

using model::ParamInfo;
using model::Role;

ShardedStore::ShardedStore(std::unique_ptr<comm::Communicator> comm, Mode mode, comm::Timeout timeout,
                           std::vector<std::string> freeze, model::ParamDtype param_dtype)
    : comm_(std::move(comm)),
      mode_(mode),
      timeout_(timeout),
      freeze_(std::move(freeze)),
      P_(comm_->size()),
      me_(comm_->rank()) {
  ReplicatedStore::set_param_dtype(param_dtype);
}

ShardedStore::~ShardedStore() = default;

ShardedStore::Group& ShardedStore::group_of(int layer) {
  return const_cast<Group&>(std::as_const(*this).group_of(layer));
}

const ShardedStore::Group& ShardedStore::group_of(int layer) const {
  RF_CHECK(adopted_ && layer < layers_ && (!model::is_tower_group(layer) || model::tower_index(layer) < towers_),
           "sharded store: group ", layer, " outside its ", layers_, " layers and ", towers_,
           " tower groups (or no weights adopted yet)");
  return groups_[index_of(layer)];
}

size_t ShardedStore::index_of(int layer) const {
  return static_cast<size_t>(model::is_tower_group(layer) ? layers_ + 1 + model::tower_index(layer) : layer + 1);
}

ShardedStore::Piece ShardedStore::piece(size_t slot, int q) const { return layout_.piece(slot, q); }

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
  if (!own_masters()) {
    ReplicatedStore::allocate_weights();
    const std::span<const float> all = whole.flat(Role::Weights);
    RF_CHECK(static_cast<int64_t>(all.size()) == total_elements(), "sharded store: the source's weights are not flat");
    std::copy(all.begin(), all.end(), ReplicatedStore::mutable_flat(Role::Weights).begin());
    return;
  }
  release_weights();
  own_trainable_.assign(layout_.trainable_slice(me_).size(), 0.f);
  own_frozen_.assign(layout_.frozen_slice(me_).size(), 0.f);
  if (whole_working()) working_.resize(static_cast<size_t>(total_elements()));
  for (size_t i = 0; i < size(); ++i) {
    const Piece pc = piece(i, me_);
    float* own = (info(i).trainable ? own_trainable_.data() : own_frozen_.data()) + pc.local;
    std::copy_n(whole.weight(i) + pc.first, pc.n, own);
    if (whole_working()) model::round_to_bf16(whole.weight(i), working_.data() + info(i).offset, info(i).numel);
  }
  weights_changed();
  if (whole_working()) working_version_ = version();
}

void ShardedStore::allocate_weights() {
  if (weights_allocated()) return;
  freeze(freeze_);
  lay_out();
  if (!own_masters()) {
    ReplicatedStore::allocate_weights();
    return;
  }
  own_trainable_.assign(layout_.trainable_slice(me_).size(), 0.f);
  own_frozen_.assign(layout_.frozen_slice(me_).size(), 0.f);
  if (whole_working()) working_.assign(static_cast<size_t>(total_elements()), bf16{});  // the zero masters' bits
  weights_changed();
  if (whole_working()) working_version_ = version();
}

bool ShardedStore::masters_sharded() const {
  return adopted_ && own_masters() && !ReplicatedStore::weights_allocated();
}

// A rank's pieces are its slices of the trainable and of the frozen layout, ceil(n / N) elements each at most:
// together at most one element over its slice of all the parameters, whichever flags freeze() sets later.
int64_t ShardedStore::resident_weight_bytes() const {
  if (!own_masters()) return weight_bytes();
  const int64_t masters = (model::shard_of(total_elements(), me_, P_).padded + 1) * static_cast<int64_t>(sizeof(float));
  return masters + (whole_working() ? total_elements() * static_cast<int64_t>(sizeof(bf16)) : 0);
}

void ShardedStore::write_weight(size_t slot, std::span<const float> in) {
  if (!masters_sharded()) {
    ReplicatedStore::write_weight(slot, in);
    return;
  }
  const ParamInfo& p = info(slot);
  RF_CHECK(static_cast<int64_t>(in.size()) == p.numel, "write_weight: ", in.size(), " elements for ", p.name, " of ",
           p.numel);
  const Piece pc = piece(slot, me_);
  std::copy_n(in.data() + pc.first, pc.n, (p.trainable ? own_trainable_.data() : own_frozen_.data()) + pc.local);
  // Every rank passes the whole tensor: its working copy is rounded here, with no communication.
  const bool current = working_version_ == version();
  if (whole_working()) model::round_to_bf16(in.data(), working_.data() + p.offset, p.numel);
  weights_changed();
  if (whole_working() && current) working_version_ = version();
  global_stale_ = true;
}

void ShardedStore::load_weight(size_t slot, const io::TensorView& v) {
  if (!masters_sharded())
    ReplicatedStore::load_weight(slot, v);
  else
    write_weight(slot, io::to_float32(v));  // the whole tensor: the working bf16 copy is rounded from all of it
}

std::span<const float> ShardedStore::own_piece(size_t slot, int64_t* first) const {
  RF_CHECK(masters_sharded(), "sharded store: own_piece while the weights are whole");
  const Piece pc = piece(slot, me_);
  *first = pc.first;
  const float* own = (info(slot).trainable ? own_trainable_.data() : own_frozen_.data()) + pc.local;
  return {own, static_cast<size_t>(pc.n)};
}

void ShardedStore::lay_out() {
  RF_CHECK(mode_ != Mode::Optimizer || whole_working(), "sharded store: shard optimizer keeps the masters in the ",
           "shards only with model.param_dtype bfloat16 (with float32 the replicated store serves it)");
  std::vector<bool> trainable(size());
  layers_ = 0;
  towers_ = 0;
  for (size_t i = 0; i < size(); ++i) {
    trainable[i] = info(i).trainable;
    if (model::is_tower_group(info(i).layer))
      towers_ = std::max(towers_, model::tower_index(info(i).layer) + 1);
    else
      layers_ = std::max(layers_, info(i).layer + 1);
  }
  layout_ = ShardLayout(*this, trainable, P_);
  groups_.assign(static_cast<size_t>(layers_ + 1 + towers_), Group{});
  group_of_slot_.assign(size(), 0);
  at_in_group_.assign(size(), 0);
  for (size_t i = 0; i < size(); ++i) {
    size_t gi = index_of(info(i).layer);
    if (info(i).streamed) {
      gi = groups_.size();
      groups_.emplace_back();
    }
    group_of_slot_[i] = gi;
    Group& g = groups_[gi];
    at_in_group_[i] = g.slots.size();
    g.layer = info(i).layer;
    g.slots.push_back(i);
    g.at.push_back(g.elements);
    g.elements += info(i).numel;
    g.grad_at.push_back(info(i).trainable ? g.grad_elements : -1);
    if (info(i).trainable) g.grad_elements += info(i).numel;
  }
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

// Every rank packs its pieces of the group's slots (its own masters) and posts one all-gather of the parts.
// working: the run's working weights (param_dtype bfloat16: rounded to bf16 before they travel, half the bytes);
// false: the float32 masters (unshard). (after_update gathers in place: gather_updated.)
std::unique_ptr<ShardedStore::Gathered> ShardedStore::post_gather(const Group& g, bool working) {
  auto t = std::make_unique<Gathered>();
  t->group = &g;
  t->working16 = working && param_dtype() == model::ParamDtype::Bfloat16;
  const size_t element_bytes = t->working16 ? sizeof(bf16) : sizeof(float);
  t->part_bytes.assign(static_cast<size_t>(P_), 0);
  size_t total = 0, at_mine = 0;
  for (int q = 0; q < P_; ++q) {
    if (q == me_) at_mine = total;
    for (size_t slot : g.slots) t->part_bytes[static_cast<size_t>(q)] += piece(slot, q).n;
    total += t->part_bytes[static_cast<size_t>(q)];
    t->part_bytes[static_cast<size_t>(q)] *= element_bytes;
  }
  if (t->working16)
    t->staging16.resize(total);
  else
    t->staging.resize(total);
  size_t out = at_mine;
  for (size_t slot : g.slots) {
    const Piece pc = piece(slot, me_);
    const float* src = own(slot, pc);
    if (t->working16)
      model::round_to_bf16(src, t->staging16.data() + out, pc.n);
    else
      std::copy_n(src, pc.n, t->staging.data() + out);
    out += static_cast<size_t>(pc.n);
  }
  void* buffer = t->working16 ? static_cast<void*>(t->staging16.data()) : static_cast<void*>(t->staging.data());
  if (P_ > 1) t->posted = comm_->post_allgatherv(buffer, t->part_bytes);
  return t;
}

// Puts every rank's pieces in place: in the group's buffer (full, sharded), or in the whole weights (unshard).
void ShardedStore::finish_gather(Gathered& t) {
  if (t.posted) {
    wait(*t.posted);
    t.posted.reset();
  }
  const Group& g = *t.group;
  const bool into_whole = ReplicatedStore::weights_allocated();
  if (t.working16) {
    // The working copy in place, then widened (exact) for the float32 readers.
    RF_CHECK(!into_whole, "sharded store: bf16 working weights gathered into the float32 masters");
    t.b16.resize(static_cast<size_t>(g.elements));
    const bf16* in = t.staging16.data();
    for (int q = 0; q < P_; ++q) {
      for (size_t k = 0; k < g.slots.size(); ++k) {
        const Piece pc = piece(g.slots[k], q);
        std::copy_n(in, pc.n, t.b16.data() + g.at[k] + pc.first);
        in += pc.n;
      }
    }
    t.staging16 = {};
    t.w.resize(t.b16.size());
    model::widen(model::HeldWeight{model::HeldDType::BF16, t.b16.data()}, 0, g.elements, t.w.data());
    return;
  }
  if (!into_whole) t.w.resize(static_cast<size_t>(g.elements));
  const float* in = t.staging.data();
  for (int q = 0; q < P_; ++q) {
    for (size_t k = 0; k < g.slots.size(); ++k) {
      const size_t slot = g.slots[k];
      const Piece pc = piece(slot, q);
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
  std::unique_ptr<Gathered>& slot = live_[index_of(layer)];
  if (!slot) slot = post_gather(group_of(layer), true);
  if (slot->posted || slot->staged()) finish_gather(*slot);
}

void ShardedStore::unshard() {
  RF_CHECK(adopted_, "sharded store: unshard before adopt");
  if (!masters_sharded()) return;
  ReplicatedStore::allocate_weights();
  for (const Group& g : groups_) {
    std::unique_ptr<Gathered> t = post_gather(g, false);
    finish_gather(*t);
  }
  live_.clear();
  live_.resize(groups_.size());
}

void ShardedStore::reshard() {
  if (!own_masters() || masters_sharded()) return;
  // The working copy of the whole weights outlives them (release_weights drops both).
  std::vector<bf16> working;
  if (whole_working()) {
    working.resize(static_cast<size_t>(total_elements()));
    model::round_to_bf16(ReplicatedStore::flat(Role::Weights).data(), working.data(), total_elements());
  }
  release_weights();
  if (whole_working()) {
    working_ = std::move(working);
    working_version_ = version();
  }
  global_stale_ = true;
}

void ShardedStore::after_update() {
  if (mode_ == Mode::Full) {
    global_stale_ = true;
    return;
  }
  // With the whole bf16 working copy: every rank's updated trainable pieces rounded to bf16, half the bytes; the
  // frozen ones never change.
  const bool working16 = whole_working() && masters_sharded();
  for (const Group& g : groups_) gather_updated(g, working16);
  if (working16) working_version_ = version();
}

// The group's trainable pieces all-gathered in place, in the whole copy every rank holds (the bf16 working weights,
// or the float32 weights): no staging buffer of the group's size (a streamed table is a group: E2B's per-layer table
// is 4.4 GiB in bf16).
// A run of the group's slots that are trainable and registered one after another lies in one range of the trainable
// layout and of the whole one, so rank q's pieces of it are one range of the whole copy, right after rank q - 1's:
// one all-gather of parts a run (a decoder layer with nothing frozen is one run). This rank's pieces are put in place
// first (rounded to bf16, or copied from its masters; where the whole float32 weights are the masters the optimizer
// updated them there).
void ShardedStore::gather_updated(const Group& g, bool working16) {
  const size_t element_bytes = working16 ? sizeof(bf16) : sizeof(float);
  bf16* whole16 = working16 ? working_.data() : nullptr;
  float* whole32 = working16 ? nullptr : ReplicatedStore::mutable_flat(Role::Weights).data();
  for (size_t slot : g.slots) {
    if (!info(slot).trainable || !own_masters()) continue;
    const Piece pc = piece(slot, me_);
    const float* src = own_trainable_.data() + pc.local;
    const int64_t at = info(slot).offset + pc.first;
    if (working16)
      model::round_to_bf16(src, whole16 + at, pc.n);
    else
      std::copy_n(src, pc.n, whole32 + at);
  }
  if (P_ == 1) return;
  uint8_t* whole = working16 ? reinterpret_cast<uint8_t*>(whole16) : reinterpret_cast<uint8_t*>(whole32);
  std::vector<comm::PostedPtr> posted;
  for (size_t k = 0; k < g.slots.size();) {
    if (posted.size() == static_cast<size_t>(comm::PostedCollective::kMaxPosted)) {  // no more may be in flight
      for (comm::PostedPtr& c : posted) wait(*c);
      posted.clear();
    }
    if (!info(g.slots[k]).trainable) {
      ++k;
      continue;
    }
    const ParamInfo& first = info(g.slots[k]);
    std::vector<size_t> part_bytes(static_cast<size_t>(P_), 0);
    for (const ParamInfo* prev = nullptr; k < g.slots.size(); ++k) {
      const ParamInfo& p = info(g.slots[k]);
      if (!p.trainable ||
          (prev && (p.offset != prev->offset + prev->numel || p.train_offset != prev->train_offset + prev->numel)))
        break;
      for (int q = 0; q < P_; ++q)
        part_bytes[static_cast<size_t>(q)] += static_cast<size_t>(piece(g.slots[k], q).n) * element_bytes;
      prev = &p;
    }
    posted.push_back(comm_->post_allgatherv(whole + static_cast<size_t>(first.offset) * element_bytes, part_bytes));
  }
  for (comm::PostedPtr& c : posted) wait(*c);
}

const bf16* ShardedStore::working(size_t slot) {
  if (!whole_working() || !masters_sharded()) return ReplicatedStore::working(slot);
  RF_CHECK(working_version_ == version(), "sharded store: the bf16 working copy of ", info(slot).name,
           " is read after the optimizer updated the masters and before after_update gathered them");
  return working_.data() + info(slot).offset;
}

const float* ShardedStore::weight(size_t slot) const {
  if (!sharded() && masters_sharded()) {  // the working copy: a group's widened values between its hooks
    const float* w = widened(slot);
    RF_CHECK(w != nullptr, "sharded store: ", info(slot).name,
             " is read outside its hooks (with model.param_dtype bfloat16 the float32 masters are sharded and the "
             "run reads the bf16 working copy, widened a group at a time)");
    return w;
  }
  if (!sharded()) return ReplicatedStore::weight(slot);
  const ParamInfo& p = info(slot);
  const Gathered* g = live_[group_of_slot_[slot]].get();
  RF_CHECK(g != nullptr && !g->posted && !g->staged(), "sharded store: ", p.name,
           p.streamed ? " is read outside acquire_head (a streamed table's rows come from rows())"
                      : " is read outside its layer's hooks (its weights are not gathered)");
  return g->w.data() + groups_[group_of_slot_[slot]].at[at_in_group_[slot]];
}

float* ShardedStore::mutable_weight(size_t slot) {
  RF_CHECK(!masters_sharded(), "sharded store: ", info(slot).name,
           " written while sharded (the optimizer writes masters; a loader writes whole tensors through write_weight)");
  return ReplicatedStore::mutable_weight(slot);
}

void ShardedStore::read_weight(size_t slot, std::span<float> out) {
  if (!masters_sharded()) {
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
  if (!own_masters()) return ReplicatedStore::mutable_weight(slot) + first;
  RF_CHECK(masters_sharded(),
           "sharded store: the optimizer stepped while the weights were gathered whole (reshard first)");
  const ParamInfo& p = info(slot);
  RF_CHECK(p.trainable, "sharded store: ", p.name, " is frozen and has no master to update");
  const int64_t at = p.train_offset + first - static_cast<int64_t>(layout_.trainable_slice(me_).begin);
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

void ShardedStore::set_param_dtype(model::ParamDtype t) {
  if (t == param_dtype()) return;
  RF_CHECK(mode_ == Mode::Full || !adopted_, "sharded store: model.param_dtype ", model::param_dtype_name(t),
           " after the weights were laid out for ", model::param_dtype_name(param_dtype()),
           " (under shard optimizer and gradients it decides where the float32 masters live)");
  ReplicatedStore::set_param_dtype(t);
}

bool ShardedStore::has_grads() const {
  return mode_ == Mode::Optimizer ? ReplicatedStore::has_grads() : grads_allocated_;
}

int64_t ShardedStore::grads_begin() const {
  return mode_ == Mode::Optimizer ? 0 : static_cast<int64_t>(layout_.trainable_slice(me_).begin);
}

void ShardedStore::allocate_grads() {
  if (mode_ == Mode::Optimizer) {  // whole, reduce-scattered by the trainer (step.cpp)
    ReplicatedStore::allocate_grads();
    return;
  }
  if (grads_allocated_) return;
  RF_CHECK(adopted_, "sharded store: gradients before adopt");
  grads_.assign(layout_.trainable_slice(me_).size(), 0.f);
  global_grads_.assign(static_cast<size_t>(group_of(model::kGlobalGroup).grad_elements), 0.f);
  grads_allocated_ = true;
}

void ShardedStore::zero_grads() {
  if (mode_ == Mode::Optimizer) {
    ReplicatedStore::zero_grads();
    return;
  }
  std::fill(grads_.begin(), grads_.end(), 0.f);
  std::fill(global_grads_.begin(), global_grads_.end(), 0.f);
}

void ShardedStore::release_training_state() {
  ReplicatedStore::release_training_state();
  grads_ = {};
  global_grads_ = {};
  layer_grads_ = {};
  head_grads_ = {};
  tables_.clear();
  grads_allocated_ = false;
}

const float* ShardedStore::grad(size_t slot) const {
  if (mode_ == Mode::Optimizer) return ReplicatedStore::grad(slot);
  const ParamInfo& p = info(slot);
  if (!grads_allocated_ || !p.trainable) return nullptr;
  if (p.streamed) {
    RF_CHECK(slot == head_, "sharded store: the gradient of ", p.name,
             " is asked for outside acquire_head (a streamed table's gradient rows come from rows())");
    return head_grads_.empty() ? nullptr : head_grads_.data();
  }
  RF_CHECK(p.layer == model::kGlobalGroup || p.layer == grad_layer_, "sharded store: the gradient of ", p.name,
           " is asked for outside its layer's backward");
  const Group& g = groups_[group_of_slot_[slot]];
  return (p.layer == model::kGlobalGroup ? global_grads_.data() : layer_grads_.data()) + g.grad_at[at_in_group_[slot]];
}

// The head's gradient buffer is made when the loss asks for it (a run without a backward never does).
float* ShardedStore::grad(size_t slot) {
  if (mode_ == Mode::Optimizer) return ReplicatedStore::grad(slot);
  if (grads_allocated_ && slot == head_ && info(slot).trainable && head_grads_.empty())
    head_grads_.assign(static_cast<size_t>(info(slot).numel), 0.f);
  return const_cast<float*>(std::as_const(*this).grad(slot));
}

std::span<const float> ShardedStore::flat(Role role) const {
  if (role == Role::Grads && mode_ != Mode::Optimizer) return grads_;
  return ReplicatedStore::flat(role);
}

std::span<float> ShardedStore::mutable_flat(Role role) {
  if (role == Role::Grads && mode_ != Mode::Optimizer) return grads_;
  return ReplicatedStore::mutable_flat(role);
}

namespace {

// Every rank contributes to every element of every owner's part: to[q] = q's part whole, from[p] = this rank's.
std::vector<std::vector<comm::Slice>> whole_parts(const std::vector<size_t>& parts) {
  std::vector<std::vector<comm::Slice>> runs(parts.size());
  for (size_t q = 0; q < parts.size(); ++q)
    if (parts[q] > 0) runs[q].push_back(comm::Slice{0, parts[q]});
  return runs;
}

}  // namespace

void ShardedStore::post_parts(Reduction& t, const float* send, const std::vector<size_t>& parts) {
  std::vector<std::vector<comm::Slice>> to = whole_parts(parts);
  std::vector<std::vector<comm::Slice>> from(static_cast<size_t>(P_), to[static_cast<size_t>(me_)]);
  post_parts(t, send, parts, std::move(to), std::move(from));
}

void ShardedStore::post_parts(Reduction& t, const float* send, const std::vector<size_t>& parts,
                              std::vector<std::vector<comm::Slice>> to, std::vector<std::vector<comm::Slice>> from) {
  t.part = parts[static_cast<size_t>(me_)];
  largest_reduce_buffer_ =
      std::max(largest_reduce_buffer_,
               static_cast<int64_t>(comm::Communicator::reduce_parts_bytes(P_, t.part, reduce_budget_)));
  Reduction* r = &t;
  t.posted = comm_->post_reduce_parts(
      send, parts, std::move(to), std::move(from),
      [this, r](size_t begin, std::span<const float> sums) {
        const int64_t b = static_cast<int64_t>(begin), e = b + static_cast<int64_t>(sums.size());
        auto it =
            std::partition_point(r->into.begin(), r->into.end(), [b](const Span& sp) { return sp.at + sp.n <= b; });
        for (; it != r->into.end() && it->at < e; ++it) {
          const int64_t lo = std::max(b, it->at), hi = std::min(e, it->at + it->n);
          float* dst = grads_.data() + it->elem + (lo - it->at);
          const float* src = sums.data() + (lo - b);
          for (int64_t i = 0; i < hi - lo; ++i) dst[i] += src[i];
        }
      },
      reduce_budget_);
}

// Sends each owner its pieces of the group's gradients `grads` [g.grad_elements] (this rank's own piece is copied);
// this rank's part is its pieces of the group's trainable slots, in order. The send buffer is `grads` itself, packed in
// place owner after owner, slot after slot, and kept by the reduction until it finished: an element never moves up,
// so never over one not yet read (a rank's pieces precede the next rank's in the trainable layout, whose order the
// group's slots keep, so no earlier rank owns a part of a later slot). With every slot of the group trainable and
// registered together (a decoder layer), the owners' pieces already lie in that order and nothing moves.
std::unique_ptr<ShardedStore::Reduction> ShardedStore::post_reduce(const Group& g, std::vector<float> grads) {
  auto t = std::make_unique<Reduction>();
  RF_CHECK(static_cast<int64_t>(grads.size()) == g.grad_elements, "sharded store: ", grads.size(),
           " gradient elements for a group of ", g.grad_elements);
  t->send = std::move(grads);
  float* src = t->send.data();
  std::vector<size_t> parts(static_cast<size_t>(P_), 0);
  size_t packed = 0;
  for (int q = 0; q < P_; ++q) {
    for (size_t k = 0; k < g.slots.size(); ++k) {
      if (g.grad_at[k] < 0) continue;
      const Piece pc = piece(g.slots[k], q);
      const size_t at = static_cast<size_t>(g.grad_at[k] + pc.first);
      if (packed != at) std::memmove(src + packed, src + at, static_cast<size_t>(pc.n) * sizeof(float));
      packed += static_cast<size_t>(pc.n);
      if (q == me_ && pc.n > 0)
        t->into.push_back(Span{static_cast<int64_t>(parts[static_cast<size_t>(q)]), pc.local, pc.n});
      parts[static_cast<size_t>(q)] += static_cast<size_t>(pc.n);
    }
  }
  post_parts(*t, t->send.data(), parts);
  return t;
}

// Each element of this rank's pieces got the P contributions summed in rank order in double, rounded once (the
// combination of Communicator::reduce_scatter), added into the slice as its chunk arrived.
void ShardedStore::finish_reduce(Reduction& t) {
  if (t.posted) {
    wait(*t.posted);
    t.posted.reset();
  }
}

void ShardedStore::before_forward(int layer) {
  if (pending_ && pending_->posted) pending_->posted->progress();
  if (!sharded()) {
    ReplicatedStore::before_forward(layer);
    return;
  }
  if (model::is_tower_group(layer)) {  // gathered now, alone (the tower runs before the decoder's layers)
    acquire(layer);
    return;
  }
  if (layer == model::kGlobalGroup) {
    std::unique_ptr<Gathered>& global = live_[0];
    if (global_stale_) global.reset();
    acquire(model::kGlobalGroup);
    global_stale_ = false;
    if (layers_ > 0 && !live_[1]) live_[1] = post_gather(group_of(0), true);
    return;
  }
  acquire(layer);
  if (layer + 1 < layers_ && !live_[static_cast<size_t>(layer + 2)])
    live_[static_cast<size_t>(layer + 2)] = post_gather(group_of(layer + 1), true);
  // The last layer computes while the head (the previous run's) travels.
  if (layer + 1 == layers_ && last_head_ != SIZE_MAX && !live_[group_of_slot_[last_head_]])
    live_[group_of_slot_[last_head_]] = post_gather(groups_[group_of_slot_[last_head_]], true);
}

void ShardedStore::after_forward(int layer) {
  if (layer == model::kGlobalGroup) tables_.clear();
  if (!sharded()) {
    ReplicatedStore::after_forward(layer);
    return;
  }
  // The last layer stays gathered for its backward, which comes next (after the loss): one gather fewer a step, and
  // none waiting behind the loss, where no layer computes. A forward-only run ends with kGlobalGroup: no backward
  // will read it then.
  if (model::is_tower_group(layer)) {
    live_[index_of(layer)].reset();
    return;
  }
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
      live_[static_cast<size_t>(layer)] = post_gather(group_of(layer - 1), true);
  } else {
    ReplicatedStore::before_backward(layer);
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
      std::unique_ptr<Reduction> t = post_reduce(group_of(layer), std::move(global_grads_));
      finish_reduce(*t);
      global_grads_ = std::move(t->send);  // packed for the send: zeroed for the next run
      std::fill(global_grads_.begin(), global_grads_.end(), 0.f);
      for (const std::unique_ptr<Table>& table : tables_) {
        if (!table->grads) continue;
        reduce_rows(*table);
      }
    } else {
      pending_ = post_reduce(group_of(layer), std::move(layer_grads_));
      layer_grads_ = {};
      grad_layer_ = model::kNoParamGroup;
      // A tower group's backward follows the decoder's whole backward, and the last of the step may be the tower's:
      // its reduction ends here, as the global group's does.
      if (model::is_tower_group(layer)) {
        finish_reduce(*pending_);
        pending_.reset();
      }
    }
  }
  if (layer == model::kGlobalGroup) tables_.clear();
  if (sharded() && layer != model::kGlobalGroup) live_[index_of(layer)].reset();
  if (!sharded()) ReplicatedStore::after_backward(layer);
}

bool ShardedStore::progress() {
  bool done = true;
  for (const std::unique_ptr<Gathered>& g : live_)
    if (g && g->posted) done = g->posted->progress() && done;
  if (pending_ && pending_->posted) done = pending_->posted->progress() && done;
  return done;
}

float* ShardedStore::own(size_t slot, const Piece& pc) {
  return (info(slot).trainable ? own_trainable_.data() : own_frozen_.data()) + pc.local;
}

template <class SpansOf>
void ShardedStore::reduce_spans(size_t slot, float* src, SpansOf spans_of) {
  // Every owner's spans packed to the front of `src`, in rank order: the send buffer, with no copy. The spans of
  // rank q follow those of q - 1 in `src` (pieces ascend with the rank, the rows of a table with their ids), so an
  // element moves down, never over one not yet read. Owner q's part: its spans, in order.
  std::vector<size_t> parts(static_cast<size_t>(P_), 0);
  size_t packed = 0;
  for (int q = 0; q < P_; ++q) {
    const size_t before = packed;
    for (const Span& sp : spans_of(q)) {
      if (packed != static_cast<size_t>(sp.at))
        std::memmove(src + packed, src + sp.at, static_cast<size_t>(sp.n) * sizeof(float));
      packed += static_cast<size_t>(sp.n);
    }
    parts[static_cast<size_t>(q)] = packed - before;
  }
  const Piece pc = piece(slot, me_);
  Reduction t;
  int64_t at = 0;
  for (const Span& sp : spans_of(me_)) {  // element e of the parameter at grads_[pc.local - pc.first + e]
    t.into.push_back(Span{at, pc.local - pc.first + sp.elem, sp.n});
    at += sp.n;
  }
  post_parts(t, src, parts);
  finish_reduce(t);
}

void ShardedStore::acquire_head(size_t slot) {
  if (!adopted_) return;
  RF_CHECK(info(slot).streamed && head_ == SIZE_MAX, "sharded store: acquire_head(", info(slot).name,
           ") of a parameter that is not streamed, or while another head is acquired");
  head_ = slot;
  last_head_ = slot;
  if (!sharded()) {
    ReplicatedStore::acquire_head(slot);
    return;
  }
  std::unique_ptr<Gathered>& g = live_[group_of_slot_[slot]];
  if (!g) g = post_gather(groups_[group_of_slot_[slot]], true);  // not posted during the last layer
  if (g->posted || g->staged()) finish_gather(*g);
}

// The head's gradient to its owners. Tied to a token table whose rows this run reads with gradients, the rows of
// that table's ids stay here: they seed the table's gradient rows, which its backward adds to (shard none adds the
// embedding's rows onto the head's gradient in one buffer, so the same float32 sums), and travel with them.
void ShardedStore::release_head(size_t slot) {
  if (!adopted_) return;
  RF_CHECK(slot == head_, "sharded store: release_head(", info(slot).name, ") without its acquire_head");
  if (sharded()) live_[group_of_slot_[slot]].reset();  // the weights first: the reduction needs room
  ReplicatedStore::release_head(slot);
  if (!head_grads_.empty()) {
    static const std::vector<int32_t> kNoRows;
    const std::vector<int32_t>* kept = &kNoRows;
    for (const std::unique_ptr<Table>& t : tables_) {
      if (t->slot != slot || !t->grads) continue;
      RF_CHECK(is_trained_head_table(slot), "sharded store: ", info(slot).name,
               " is the head, but its rows were fetched as a table's that is not (head_slot names another)");
      kept = &t->ids;
      for (size_t u = 0; u < t->ids.size(); ++u)
        std::copy_n(head_grads_.data() + int64_t{t->ids[u]} * t->width, t->width,
                    t->g.data() + static_cast<int64_t>(u) * t->width);
    }
    reduce_spans(slot, head_grads_.data(), [&](int q) { return spans_outside(slot, *kept, piece(slot, q)); });
    head_grads_ = {};
  }
  head_ = SIZE_MAX;
}

ShardedStore::Bytes ShardedStore::held() const {
  constexpr int64_t kF = sizeof(float), kB = sizeof(bf16);
  const auto bytes = [](const std::vector<float>& v) { return static_cast<int64_t>(v.size()) * kF; };
  Bytes b;
  b.weight_shard = bytes(own_trainable_) + bytes(own_frozen_) +
                   static_cast<int64_t>(ReplicatedStore::flat(Role::Weights).size()) * kF;
  for (const std::unique_ptr<Gathered>& g : live_) {
    if (!g) continue;
    b.gathered += bytes(g->w) + static_cast<int64_t>(g->b16.size()) * kB;
    b.comm_buffers += bytes(g->staging) + static_cast<int64_t>(g->staging16.size()) * kB;
  }
  b.gradients = bytes(grads_) + bytes(global_grads_) + bytes(layer_grads_) + bytes(head_grads_);
  if (mode_ == Mode::Optimizer) b.gradients += static_cast<int64_t>(ReplicatedStore::flat(Role::Grads).size()) * kF;
  b.working = static_cast<int64_t>(working_.size()) * kB;
  for (const std::unique_ptr<Table>& t : tables_) {
    b.gathered += bytes(t->w) + static_cast<int64_t>(t->w16.size()) * kB;
    b.gradients += bytes(t->g);
  }
  b.moments = static_cast<int64_t>(flat(Role::ExpAvg).size() + flat(Role::ExpAvgSq).size()) * kF;
  if (pending_) {
    b.comm_buffers += bytes(pending_->send) +
                      static_cast<int64_t>(comm::Communicator::reduce_parts_bytes(P_, pending_->part, reduce_budget_));
  }
  return b;
}

int64_t ShardedStore::working_bytes_for(const model::ParamStore& registry, int64_t full_gathered) {
  constexpr int64_t kF = sizeof(float), kB = sizeof(bf16);
  if (full_gathered >= 0) return full_gathered / kF * kB;
  std::vector<int64_t> layer(1, 0);  // the decoder's layers, then the tower's groups (widened one at a time too)
  int64_t global = 0, streamed = 0;
  int64_t layers = 0;
  for (const ParamInfo& p : registry.infos())
    if (!model::is_tower_group(p.layer)) layers = std::max<int64_t>(layers, p.layer + 1);
  for (const ParamInfo& p : registry.infos()) {
    if (p.streamed) {
      streamed = std::max(streamed, p.numel);
    } else if (p.layer == model::kGlobalGroup) {
      global += p.numel;
    } else {
      const size_t at =
          static_cast<size_t>(model::is_tower_group(p.layer) ? layers + model::tower_index(p.layer) : p.layer);
      if (at >= layer.size()) layer.resize(at + 1, 0);
      layer[at] += p.numel;
    }
  }
  const int64_t widened = *std::max_element(layer.begin(), layer.end()) + global + streamed;
  return registry.total_elements() * kB + widened * kF;
}

int64_t ShardedStore::master_bytes_for(const model::ParamStore& registry, const std::vector<bool>& trainable,
                                       int ranks) {
  return ShardLayout(registry, trainable, ranks).largest_masters() * static_cast<int64_t>(sizeof(float));
}

ShardedStore::Bytes ShardedStore::bytes_for(const model::ParamStore& registry, const std::vector<bool>& trainable,
                                            Mode mode, int ranks, int64_t step_tokens, int64_t rank_tokens) {
  constexpr int64_t kF = sizeof(float);
  constexpr int kMoments = 2;  // exp_avg, exp_avg_sq
  if (rank_tokens < 0) rank_tokens = step_tokens;
  const size_t P = static_cast<size_t>(ranks);
  const size_t head = head_slot(registry);
  const ShardLayout layout(registry, trainable, ranks);
  // The groups as lay_out() makes them: [0] the global group's unstreamed parameters, [1 + l] decoder layer l, then
  // one a streamed parameter. Each: its elements, its trainable ones, and per rank its elements of the layout's
  // pieces, trainable ones and all.
  struct Group {
    int64_t all = 0, train = 0;
    std::vector<int64_t> mine_train, mine_all;  // [P]
    size_t slot = SIZE_MAX;                     // a streamed parameter's
  };
  std::vector<Group> groups(1);
  std::vector<Group> streamed, tower;  // tower: the vision tower's groups (model::tower_group), gathered alone
  for (size_t i = 0; i < registry.size(); ++i) {
    const ParamInfo& p = registry.info(i);
    Group* g = nullptr;
    if (p.streamed) {
      streamed.emplace_back();
      g = &streamed.back();
      g->slot = i;
    } else if (model::is_tower_group(p.layer)) {
      const size_t ti = static_cast<size_t>(model::tower_index(p.layer));
      if (ti >= tower.size()) tower.resize(ti + 1);
      g = &tower[ti];
    } else {
      const size_t gi = static_cast<size_t>(p.layer + 1);
      if (gi >= groups.size()) groups.resize(gi + 1);
      g = &groups[gi];
    }
    g->mine_train.resize(P, 0);
    g->mine_all.resize(P, 0);
    g->all += p.numel;
    for (int q = 0; q < ranks; ++q) {
      const int64_t n = layout.piece(i, q).n;
      g->mine_all[static_cast<size_t>(q)] += n;
      if (trainable[i]) g->mine_train[static_cast<size_t>(q)] += n;
    }
    if (trainable[i]) g->train += p.numel;
  }
  const auto most = [](const std::vector<int64_t>& v) { return v.empty() ? 0 : *std::max_element(v.begin(), v.end()); };
  // A reduction's receive buffers on the rank with the largest part of `part` elements: the N contributions to two
  // chunks of it in flight (Communicator::post_reduce_parts), bounded whatever the part; none at N = 1.
  const auto receive = [&](int64_t part) {
    const size_t bytes =
        comm::Communicator::reduce_parts_bytes(ranks, static_cast<size_t>(part), comm::Communicator::kReduceSliceBytes);
    return static_cast<int64_t>(bytes) / kF;
  };
  // A reduction's buffers: the receive buffers, and a layer's gradient buffer, which its reduction sends from (packed
  // in place) and keeps until it finished, during the next layer's backward, which fills a buffer of its own. The
  // global group's, the head's and the tables' rows' are packed in place too, and finish before their buffers are
  // reused: counted with the gradients.
  const auto reduction = [&](const Group& g, bool in_flight_buffer) {
    return (in_flight_buffer ? g.train : 0) + receive(most(g.mine_train));
  };
  int64_t largest = 0, largest_train = 0, reductions = reduction(groups[0], false);
  for (size_t gi = 1; gi < groups.size(); ++gi) {
    largest = std::max(largest, groups[gi].all);
    largest_train = std::max(largest_train, groups[gi].train);
    reductions = std::max(reductions, reduction(groups[gi], true));
  }
  for (const Group& g : tower) {  // a tower group's reduction finishes at its after_backward
    largest = std::max(largest, g.all);
    largest_train = std::max(largest_train, g.train);
    reductions = std::max(reductions, reduction(g, false));
  }
  const int64_t last_layer = groups.size() > 1 ? groups.back().all : 0;
  // The streamed parameters: the head gathered whole around the loss (its gradient beside it, then reduced); the
  // token tables read by row, a rank's own tokens' rows (the table tied to a trained head: every rank's).
  int64_t head_all = 0, head_train = 0, rows = 0, rows_train = 0, row_fetch = 0;
  for (const Group& g : streamed) {
    const ParamInfo& p = registry.info(g.slot);
    const bool trained = g.train > 0;
    if (g.slot == head) {
      head_all = g.all;
      head_train = g.train;
      reductions = std::max(reductions, reduction(g, false));
      if (registry.info(head).name == "lm_head.weight") continue;  // an untied head is not read by row
    }
    const int64_t width = p.numel / p.shape[0];
    const int64_t tokens = g.slot == head && trained ? step_tokens : rank_tokens;
    const int64_t held = std::min(tokens, p.shape[0]) * width;
    rows += held;
    if (trained) rows_train += held;
    // Each owner receives every rank's gradient rows inside its piece (its part: their union, the rows of the step's
    // tokens at most). Under full the rows are fetched (fetch_rows): the table tied to a trained head, whose rows are
    // the same on every rank, is all-gathered in place (no send buffer); another's owner sends each rank its rows
    // inside its piece in rounds, two ranks' parts in flight (one at N = 2, none at N = 1).
    const int64_t step_rows = std::min(step_tokens, p.shape[0]) * width;
    if (trained) reductions = std::max(reductions, receive(std::min(step_rows, most(g.mine_train))));
    const bool shared = g.slot == head && trained;
    const int64_t sends_in_flight = shared ? 0 : std::min<int64_t>(kRowRoundsInFlight, ranks - 1);
    row_fetch = std::max(row_fetch, sends_in_flight * std::min(held, most(g.mine_all)));
  }
  const int64_t slice = model::shard_of(layout.trainable_elements(), 0, ranks).padded;
  Bytes b;
  if (mode == Mode::Full) {
    b.weight_shard = layout.largest_masters() * kF;
    // One layer gathered (the next one's gather in flight is a staging buffer), or the head beside the last layer
    // (which stays gathered from its forward to its backward); the tables' rows for the whole run.
    b.gathered = (groups[0].all + std::max(largest, head_all + last_layer) + rows) * kF;
    // One gather in flight: the next layer's or the head's staging; at the run's start the first layer's beside the
    // rows this rank is sending the other ranks.
    b.comm_buffers = std::max(head_all, largest + row_fetch) * kF;
  } else {
    b.weight_shard = (layout.trainable_elements() + layout.frozen_elements()) * kF;
    b.gathered = rows * kF;  // the tables' rows, copied from the whole weights
  }
  // The head's whole gradient lives from the loss to its reduction, before any layer's backward.
  b.gradients = (slice + groups[0].train + std::max(largest_train, head_train) + rows_train) * kF;
  b.moments = kMoments * slice * kF;
  // One reduction at a time: a layer's (the last one's finished before the next is posted), the global group's,
  // the head's or a table's.
  b.comm_buffers += reductions * kF;
  return b;
}

}  // namespace rf::trainer
