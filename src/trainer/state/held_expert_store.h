// ringflex trainer: held experts under parallelism.shard optimizer, gradients or full (state/held_experts.cpp). EP
// rank r holds experts [r * E / ep, (r + 1) * E / ep) whole, their training state sharded over the EDP group
// (ExpertSlices); every other parameter lives in the shard mode's inner store. HeldExpertStore routes each slot to one
// of the two; its trainable layout is the inner store's (the experts' state is stepped beside it).
// The design: docs/parallel-state.md ("Held experts").
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "comm/communicator.h"
#include "model/param_store.h"
#include "trainer/state/sharded_store.h"

namespace rf::trainer {

// A rank's experts: the expert tensors of `whole` (its EP rank's rows) and nothing else, in registration order.
class ExpertSlices final : public model::ReplicatedStore {
 public:
  // edp: a communicator over the EDP group of its own (its collectives run inside the model's backward);
  // slice_grads: gradients and full (the gradients of this rank's slice only, reduced layer by layer).
  ExpertSlices(std::unique_ptr<comm::Communicator> edp, bool slice_grads, comm::Timeout timeout);

  // This rank's slice of the trainable layout: the elements whose moments (and with slice_grads gradients) it keeps.
  comm::Slice own() const;
  // The reduced gradients of own(): [own().size()].
  std::span<float> own_grads();
  // shard optimizer, after the step's backward: the whole gradients reduce-scattered over the EDP group.
  void reduce();
  // After AdamW updated own(): every EDP rank's updated slice into every rank's weights (collective).
  void gather_updated();
  // slice_grads: the layer's gradient buffer before its backward, reduced into the owners' slices after it.
  void begin_layer(int layer);
  void end_layer(int layer);

  void allocate_grads() override;
  bool has_grads() const override { return slice_grads_ ? grads_allocated_ : ReplicatedStore::has_grads(); }
  void zero_grads() override;
  float* grad(size_t slot) override;
  const float* grad(size_t slot) const override;
  int64_t grads_begin() const override { return slice_grads_ ? static_cast<int64_t>(own().begin) : 0; }
  std::span<const float> flat(model::Role role) const override;
  std::span<float> mutable_flat(model::Role role) override;

 protected:
  void release_training_state() override;

 private:
  // The layer's expert gradients: [begin, end) of the trainable layout (empty when it has none).
  comm::Slice layer_range(int layer) const;

  std::unique_ptr<comm::Communicator> edp_;
  bool slice_grads_;
  comm::Timeout timeout_;
  bool grads_allocated_ = false;
  std::vector<float> slice_;  // slice_grads: own()'s reduced gradients
  std::vector<float> layer_;  // slice_grads: the gradients of layer layer_at_ during its backward
  int layer_at_ = model::kNoParamGroup;
};

// The shard mode's store of the non-expert parameters, typed by whoever makes it: a ReplicatedStore (shard
// optimizer), or a ShardedStore (gradients, full) that `sharded` names as well, so that the held store and its
// checkpoints use its pieces without asking the store which it is.
struct HeldInner {
  std::unique_ptr<model::ParamStore> store;
  ShardedStore* sharded = nullptr;
  static HeldInner replicated() { return {std::make_unique<model::ReplicatedStore>(), nullptr}; }
  static HeldInner of(std::unique_ptr<ShardedStore> s) {
    ShardedStore* typed = s.get();
    return {std::move(s), typed};
  }
};

class HeldExpertStore final : public model::ParamStore {
 public:
  HeldExpertStore(HeldInner inner, std::unique_ptr<ExpertSlices> experts, std::vector<int64_t> expert_slot);

  model::ParamStore& inner() { return *inner_; }
  const model::ParamStore& inner() const { return *inner_; }
  // The inner store when it is a ShardedStore (gradients, full), else null.
  ShardedStore* inner_sharded() { return inner_sharded_; }
  const ShardedStore* inner_sharded() const { return inner_sharded_; }
  ExpertSlices& experts() { return *experts_; }
  const ExpertSlices& experts() const { return *experts_; }
  // The slot of `slot` in experts(), or -1: a parameter of the inner store.
  int64_t expert_slot(size_t slot) const { return expert_slot_.at(slot); }

  void allocate_weights() override;
  // make_held_expert_store registers the parameters, then seals the store: until then it reports no memory (the
  // registry takes no parameter once a store holds some), after it no parameter is registered.
  void seal() { sealed_ = true; }
  bool weights_allocated() const override {
    return sealed_ && inner_->weights_allocated() && experts_->weights_allocated();
  }
  const float* weight(size_t slot) const override;
  float* mutable_weight(size_t slot) override;
  void read_weight(size_t slot, std::span<float> out) override;
  void write_weight(size_t slot, std::span<const float> in) override;
  void load_weight(size_t slot, const io::TensorView& v) override;
  float* mutable_master(size_t slot, int64_t first) override;
  int64_t grads_begin() const override { return inner_->grads_begin(); }
  const model::Bf16Lookup& bf16_weights() override;
  const bf16* find(const float* src, int64_t extent) const override;

  void allocate_grads() override;
  void allocate_moments() override;
  bool has_grads() const override { return sealed_ && inner_->has_grads(); }
  bool has_moments() const override { return sealed_ && inner_->has_moments(); }
  void zero_grads() override;
  float* grad(size_t slot) override;
  const float* grad(size_t slot) const override;
  float* moment(model::Role role, size_t slot) override;
  const float* moment(model::Role role, size_t slot) const override;
  void set_moment_range(int64_t begin, int64_t end) override;
  std::span<const float> flat(model::Role role) const override { return inner_->flat(role); }
  std::span<float> mutable_flat(model::Role role) override { return inner_->mutable_flat(role); }
  model::HeldWeight held_weight(size_t slot) const override;

  // The streamed global parameters and the posted transfers are the inner store's (the token tables and the head
  // are no experts): under shard full the ShardedStore's rows(), head gather and progress, so no rank holds the
  // global group whole.
  int64_t resident_weight_bytes() const override;
  TableRows rows(size_t slot, std::span<const int32_t> ids, bool want_grads) override;
  void acquire_head(size_t slot) override;
  void release_head(size_t slot) override;
  bool progress() override { return inner_->progress(); }

  void before_forward(int layer) override { inner_->before_forward(layer); }
  void after_forward(int layer) override { inner_->after_forward(layer); }
  void before_backward(int layer) override;
  void after_backward(int layer) override;

 protected:
  void release_training_state() override;

 private:
  std::unique_ptr<model::ParamStore> inner_;
  ShardedStore* inner_sharded_;  // inner_ when it is a ShardedStore
  std::unique_ptr<ExpertSlices> experts_;
  std::vector<int64_t> expert_slot_;  // [slots]
  bool sealed_ = false;
  const model::Bf16Lookup* inner_b16_ = nullptr;
  const model::Bf16Lookup* experts_b16_ = nullptr;
};

// Where a rank's parts lie: its EP rank (which experts), its EDP rank and the world's (which slices).
struct HeldPlacement {
  int ep_rank = 0, ep = 1;
  int world_rank = 0, world_size = 1;
};

// The parameters of `registry` (every parameter whole; shapes only) placed in a HeldExpertStore with the trainable
// flags `trainable` (model.freeze applied), nothing allocated: `inner` (an empty store of the shard mode: a
// ReplicatedStore for optimizer, a ShardedStore for gradients and full; HeldInner) registers the non-expert parameters
// (the expert tensors with no rows), `experts` this EP rank's rows of the expert tensors. Its allocate_weights
// allocates the parts' weights (a ShardedStore's pieces), which a loader fills tensor by tensor (model::PlaceParams).
std::unique_ptr<HeldExpertStore> place_held_experts(const model::ParamStore& registry,
                                                    const std::vector<bool>& trainable, HeldInner inner,
                                                    std::unique_ptr<ExpertSlices> experts, const HeldPlacement& at);
// The parts' moment ranges: the experts' over this rank's EDP slice (ExpertSlices::own), the rest's over this world
// rank's slice of their trainable layout. Before the moments are allocated.
void set_held_moment_ranges(HeldExpertStore& held, const HeldPlacement& at);

// `whole` (every parameter whole, model.freeze applied, weights allocated; moments absent or over the whole
// trainable layout) split into a HeldExpertStore (a model drawn in memory, model.builtin): `inner` (an empty store of
// the shard mode: a ReplicatedStore for optimizer, a ShardedStore for gradients and full) takes the non-expert
// parameters (the expert tensors registered in it with no rows), its moments over this world rank's slice of their
// trainable layout; `experts` takes this EP rank's rows of the expert tensors. The weights and moments are copied, each
// part's only.
std::unique_ptr<HeldExpertStore> make_held_expert_store(const model::ParamStore& whole, HeldInner inner,
                                                        std::unique_ptr<ExpertSlices> experts, const HeldPlacement& at);

struct HeldGroups {
  comm::Communicator& world;
  comm::Communicator& ep;   // the EP group: world ranks (world rank / ep) * ep .. + ep - 1
  comm::Communicator& edp;  // the ranks holding the same experts
  comm::Timeout timeout;
};

// The sum of squares of the reduced gradients as shard none's whole layout takes it: one partial sum per world rank's
// slice (comm::slice_of over the whole trainable layout, every expert counted once), each element added in order,
// so the norm has the bits of shard none at the same EP (and of a store holding every expert). `rest`: this rank's
// reduced slice of the non-expert gradients (slice_of over their trainable layout). The layout is walked in runs,
// each held by one rank; a slice's running sum moves to the next run's holder by a broadcast over the world when the
// holder changes (about 2 x (ep x Q + P) per MoE layer, 8 bytes each). The same bits on every rank.
std::vector<double> held_norm_partials(HeldExpertStore& held, std::span<const float> rest, const HeldGroups& g);

// The memory check's terms for held experts under a shard mode (optimizer, gradients or full), per rank, in bytes:
// `registry` the model's parameters whole, `trainable` their flags after model.freeze, over `ranks` world ranks
// and `ep` EP ranks (Q = ranks / ep EDP ranks). The rest: the shard mode's terms over the non-expert parameters
// (ShardedStore::bytes_for's for gradients and full). The experts: E / ep experts' float32 weights, the moments of
// a padded EDP slice, and their gradients (optimizer: every held one's; gradients, full: the slice, one layer's
// buffer, and that layer's Q contributions received). Left out, as the other transients: one tensor a load widens
// (the rest's; of the experts one expert's rows) or a save gathers on the writer (no whole copy on any rank,
// trainer/state/held_checkpoint.h). step_tokens: the token tables' rows a step fetches (ShardedStore::bytes_for's).
struct HeldBytes {
  int64_t rest_weights = 0, rest_gathered = 0, rest_gradients = 0, rest_moments = 0, rest_comm_buffers = 0;
  int64_t rest_bf16 = 0;  // the bf16 copies of the non-expert matmul operands (full: of the gathered ones)
  int64_t expert_weights = 0, expert_gradients = 0, expert_moments = 0, expert_bf16 = 0;
};
HeldBytes held_expert_bytes(const model::ParamStore& registry, const std::vector<bool>& trainable, bool shard_full,
                            bool shard_gradients, int ranks, int ep, int64_t step_tokens);

}  // namespace rf::trainer
