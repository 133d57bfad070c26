// ringflex trainer: the held-experts training state, parallelism.ep > 1 without LoRA: each rank holds and trains its
// EP rank's experts only. Shard none: a replicated store of the rank's expert rows (trainer/state/expert_state.h); the
// other shard modes: a HeldExpertStore (trainer/state/held_expert_store.h) of the shard mode's store for the rest and
// the experts' slices over their EDP group. Checkpoints stream through a HeldWriter (trainer/state/held_checkpoint.h).
// docs/parallel-state.md.
#include <utility>

#include "comm/agree.h"
#include "core/error.h"
#include "model/expert_store.h"
#include "trainer/run.h"
#include "trainer/state/expert_state.h"
#include "trainer/state/held_checkpoint.h"
#include "trainer/state/held_expert_store.h"
#include "trainer/state/sharded_store.h"
#include "trainer/state/state.h"

namespace rf::trainer::detail {

std::unique_ptr<ShardedStore> make_sharded_store(Run& r, std::unique_ptr<comm::Communicator>& comm);

namespace {

class HeldExpertsState final : public TrainingState {
 public:
  explicit HeldExpertsState(const TrainConfig& c)
      : shard_(c.parallelism.shard),
        apart_(shard_ != ShardMode::None),
        slices_only_(shard_ == ShardMode::Gradients || shard_ == ShardMode::Full) {}

  Support supports(const TrainConfig& c) const override {
    if (c.model.param_dtype == model::ParamDtype::Bfloat16)
      return {
          "model.param_dtype = bfloat16 with parallelism.ep > 1 is not implemented (its weights keep float32 "
          "working copies of their own)"};
    return {};
  }

  StateBytes bytes(const TrainConfig& c, const model::Gemma4Multimodal& m, int world_size, int) const override {
    const int ep = c.parallelism.ep;
    const std::vector<bool> trainable = m.params().trainable_after(c.model.freeze);
    if (!apart_) {
      // Shard none: the experts' weights, gradients, moments and bf16 copies are E / ep experts' worth. (A load reads
      // a rank's rows alone and a save gathers one tensor at a time on rank 0, trainer/state/held_checkpoint.h: no
      // whole copy; as for the other transients one tensor is not counted.)
      int64_t experts_elsewhere = 0, trainable_elsewhere = 0, bf16_elsewhere = 0;  // the other EP ranks' experts
      for (size_t i = 0; i < trainable.size(); ++i) {
        const model::ParamInfo& p = m.params().info(i);
        if (!model::is_expert_tensor(p)) continue;
        const int64_t others = p.numel / ep * (ep - 1);
        experts_elsewhere += others;
        if (trainable[i]) trainable_elsewhere += others;
        if (p.matmul) bf16_elsewhere += others;
      }
      ReplicatedBytes b;
      b.weight_bytes = m.params().weight_bytes() - experts_elsewhere * static_cast<int64_t>(sizeof(float));
      b.trainable_bytes = trainable_bytes(c, m.params()) - trainable_elsewhere * static_cast<int64_t>(sizeof(float));
      b.bf16_elsewhere_bytes = bf16_elsewhere * static_cast<int64_t>(sizeof(bf16));
      b.moment_ranks = world_size;
      return {replicated_bytes(c, m, world_size, b)};
    }
    // Under sharding: the shard mode's terms over the other parameters, this rank's experts whole and their state
    // over the EDP group. The tables' rows: every rank's micro-batch's tokens (the CP group's ranks share rows).
    const bool full = shard_ == ShardMode::Full;
    const int64_t step_tokens = int64_t{c.train.micro_batch} * c.train.seq_len * c.parallelism.dp;
    const HeldBytes b =
        held_expert_bytes(m.params(), trainable, full, shard_ == ShardMode::Gradients, world_size, ep, step_tokens);
    MemoryBreakdown need;
    need.add(full ? "weight shard" : "weights", b.rest_weights + m.buffers().total_bytes());
    need.add(full ? "gathered weights" : "the tables' rows", b.rest_gathered);
    need.add("gradients", b.rest_gradients);
    need.add("AdamW moments", b.rest_moments);
    need.add("communication buffers", b.rest_comm_buffers);
    need.add("experts held (E / ep)", b.expert_weights);
    need.add("experts' gradients", b.expert_gradients);
    need.add("experts' AdamW moments (EDP slice)", b.expert_moments);
    if (c.model.compute_dtype == model::ComputeDtype::Bfloat16)
      need.add("bf16 weight copies", b.rest_bf16 + b.expert_bf16);
    return {need};
  }

  // Under sharding: the inner sharded store's communicator over the world, and the experts' over their EDP group.
  void join(Run& r) override {
    if (!apart_) return;
    const int ep = r.cfg.parallelism.ep;
    if (slices_only_) store_comm_ = r.world.split(0, r.world.rank(), r.timeout);
    edp_comm_ = r.world.split(r.world.rank() % ep, r.world.rank() / ep, r.timeout);
  }

  std::unique_ptr<model::ParamStore> make_store(Run&) override { return nullptr; }

  // Held experts loaded from files (a fresh start from model.path, or a resume): the store placed before any weight
  // is allocated, so the loader reads this rank's experts' rows alone and the rest as the store keeps it
  // (held_checkpoint.h); no rank holds a whole copy.
  model::PlaceParams place(Run& r) override {
    return [this, &r](const model::Gemma4Multimodal& shapes) -> std::unique_ptr<model::ParamStore> {
      check_expert_parallelism(r.cfg, shapes.config());
      const HeldPlacement at = placement(r);
      if (!apart_) return model::hold_expert_rows(shapes.params(), at.ep_rank, at.ep);
      auto [inner, experts] = parts(r);
      std::unique_ptr<HeldExpertStore> held =
          place_held_experts(shapes.params(), shapes.params().trainable_after(r.cfg.model.freeze), std::move(inner),
                             std::move(experts), at);
      held_ = held.get();
      return held;
    };
  }

  void before_optimizer(Run& r) override {
    if (!apart_) return;
    if (held_ == nullptr) {  // model.builtin: drawn whole, then split (the whole copy dropped here)
      auto [inner, experts] = parts(r);
      std::unique_ptr<HeldExpertStore> held =
          make_held_expert_store(r.ck.model->params(), std::move(inner), std::move(experts), placement(r));
      held_ = held.get();
      r.ck.model->replace_params(std::move(held));
    }
    set_held_moment_ranges(*held_, placement(r));
    // Each part's moments from the files (a checkpoint of any EP and shard mode), by slice.
    if (!r.resume_dir.empty()) load_held_moments(r.resume_dir, *held_);
  }

  // Shard none: a store placed by the loader reads its rows' moments alone (load_optimizer_state); a model drawn
  // whole (model.builtin) keeps its rows now.
  void after_optimizer(Run& r) override {
    if (apart_) return;
    TrainingState::after_optimizer(r);
    const model::ParamStore& store = r.ck.model->params();
    const bool rows_held = std::any_of(store.infos().begin(), store.infos().end(),
                                       [](const model::ParamInfo& p) { return p.holds_part(); });
    if (!rows_held) {
      const HeldPlacement at = placement(r);
      r.ck.model->replace_params(model::hold_expert_rows(store, at.ep_rank, at.ep));
    }
  }

  // With a sharded inner store the rest's are reduced by its hooks (the HeldExpertStore registers every slot of the
  // model's in the same order, the tower's among its non-expert parameters).
  bool tower_gradients_collective() const override { return slices_only_; }
  bool forward_collective() const override { return shard_ == ShardMode::Full; }

  // Shard none: the experts' over their EDP group, the rest over the world. Optimizer: the experts' reduce-scattered
  // over their EDP group, the rest over the world. Gradients and full: reduced by the hooks.
  void reduce_gradients(Run& r) override {
    if (shard_ == ShardMode::Optimizer) held_->experts().reduce();
    if (r.world.size() == 1 || slices_only_) return;
    if (!apart_) {
      reduce_held_expert_gradients(r.ck.model->params(), expert_groups(r));
      return;
    }
    const std::span<float> flat = r.ck.model->params().mutable_flat(model::Role::Grads);
    r.world.reduce_scatter(flat.data(), flat.size(), comm::ReduceOp::Sum, r.timeout);
  }

  // The partials of a store holding every expert, from the experts' holders (expert_state.h, held_expert_store.h).
  std::vector<double> norm_partials(Run& r) override {
    if (!apart_) return held_expert_norm_partials(r.ck.model->params(), expert_groups(r));
    std::span<float> rest = r.ck.model->params().mutable_flat(model::Role::Grads);
    if (!slices_only_) {
      const comm::Slice s = comm::slice_of(rest.size(), r.world.size(), r.world.rank());
      rest = rest.subspan(s.begin, s.size());
    }
    return held_norm_partials(*held_, rest, {r.world, *r.ep_group, *r.edp_group, r.timeout});
  }

  // Under sharding the experts' slices too, then every EDP rank's updated slice into every one's experts.
  void update(Run& r, double lr, int64_t step, double clip) override {
    r.adam->step(r.ck.model->params(), lr, step, clip);
    if (!apart_) return;
    r.adam->step(held_->experts(), lr, step, clip);
    held_->experts().gather_updated();
    if (inner_sharded_ != nullptr)
      inner_sharded_->after_update();
    else
      gather_updated_weights(r.world, r.ck.model->params(), r.timeout);
  }

  std::optional<double> take_comm_wait() override {
    if (inner_sharded_ == nullptr) return std::nullopt;
    return inner_sharded_->take_exposed_seconds();
  }
  int64_t experts_held(int64_t experts, int ep) const override { return experts / ep; }
  const ShardedStore* sharded_masters() const override { return inner_sharded_; }

  // The files hold every expert, where the store registers this rank's.
  std::unique_ptr<model::ParamStore> files_registry(Run& r) override {
    return apart_ ? files_layout(std::as_const(*held_)) : files_layout(r.ck.model->params());
  }

  // The save writes from a HeldWriter on every rank, each tensor gathered onto the writer from the ranks holding its
  // parts as its turn comes (held_checkpoint.h); every rank takes part in every read.
  void save(Run& r, const std::string& tmp, comm::Timeout wait, const FinishSave& finish) override {
    const HeldGroups g{r.world, *r.ep_group, *r.edp_group, r.timeout};
    HeldWriter w = apart_ ? HeldWriter(*held_, g) : HeldWriter(r.ck.model->params(), g);
    save_weights(r, w, tmp, wait, true);
    comm::agree(
        r.world,
        [&] {
          write_moments_streamed(
              tmp, w, [&w](model::Role role, size_t slot, std::span<float> out) { w.read_moment(role, slot, out); },
              r.lead);
        },
        wait);
    finish_save(r, w, wait, finish, {});
  }

  void unshard() override {
    if (inner_sharded_ != nullptr) inner_sharded_->unshard();
  }

 private:
  static HeldPlacement placement(const Run& r) {
    const int ep = r.cfg.parallelism.ep;
    return {r.world.rank() % ep, ep, r.world.rank(), r.world.size()};
  }

  // The parts of a HeldExpertStore: the shard mode's store of the non-expert parameters and this rank's experts'.
  std::pair<HeldInner, std::unique_ptr<ExpertSlices>> parts(Run& r) {
    HeldInner inner = slices_only_ ? HeldInner::of(make_sharded_store(r, store_comm_)) : HeldInner::replicated();
    inner_sharded_ = inner.sharded;
    RF_CHECK(edp_comm_ != nullptr, "held experts: the experts' communicator was taken already");
    auto experts = std::make_unique<ExpertSlices>(std::move(edp_comm_), slices_only_, r.timeout);
    return {std::move(inner), std::move(experts)};
  }

  ShardMode shard_;
  bool apart_;        // shard optimizer, gradients, full: a HeldExpertStore (its experts' state over the EDP group)
  bool slices_only_;  // gradients and full: the inner store is a ShardedStore
  std::unique_ptr<comm::Communicator> store_comm_, edp_comm_;  // the parts', until they take them
  HeldExpertStore* held_ = nullptr;                            // owned by the model
  ShardedStore* inner_sharded_ = nullptr;                      // held_'s inner store under gradients and full
};

}  // namespace

std::unique_ptr<TrainingState> held_experts_state(const TrainConfig& c) {
  return std::make_unique<HeldExpertsState>(c);
}

}  // namespace rf::trainer::detail
