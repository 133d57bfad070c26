// ringflex trainer: the sharded training state, parallelism.shard gradients (ZeRO-2) and full (ZeRO-3), and optimizer
// with bfloat16 working weights: a ShardedStore (trainer/state/sharded_store.h) over the world holds this rank's
// slices. docs/parallel-state.md.
#include "core/error.h"
#include "trainer/run.h"
#include "trainer/state/sharded_store.h"
#include "trainer/state/state.h"

namespace rf::trainer::detail {

std::unique_ptr<ShardedStore> make_sharded_store(Run& r, std::unique_ptr<comm::Communicator>& comm) {
  RF_CHECK(comm != nullptr, "shard: the sharded store's communicator was taken already");
  const ShardMode shard = r.cfg.parallelism.shard;
  const ShardedStore::Mode mode = shard == ShardMode::Full        ? ShardedStore::Mode::Full
                                  : shard == ShardMode::Gradients ? ShardedStore::Mode::Gradients
                                                                  : ShardedStore::Mode::Optimizer;
  auto s =
      std::make_unique<ShardedStore>(std::move(comm), mode, r.timeout, r.cfg.model.freeze, r.cfg.model.param_dtype);
  s->set_reduce_budget(r.options.shard_reduce_budget);
  return s;
}

namespace {

class ShardedState final : public TrainingState {
 public:
  explicit ShardedState(const TrainConfig& c)
      : full_(c.parallelism.shard == ShardMode::Full),
        slices_only_(full_ || c.parallelism.shard == ShardMode::Gradients),
        // The float32 masters are this rank's pieces: the checkpoint writer's reads are collectives.
        masters_sharded_(full_ || c.model.param_dtype == model::ParamDtype::Bfloat16) {}

  Support supports(const TrainConfig&) const override { return {}; }

  StateBytes bytes(const TrainConfig& c, const model::Gemma4Multimodal& m, int world_size, int) const override {
    if (!slices_only_) {  // optimizer with bf16 working weights: whole gradients, sharded masters and moments
      ReplicatedBytes b;
      b.weight_bytes = m.params().weight_bytes();
      b.trainable_bytes = trainable_bytes(c, m.params());
      b.moment_ranks = world_size;
      return {replicated_bytes(c, m, world_size, b)};
    }
    // The sharded store's state by kind (ShardedStore::bytes_for says what each holds).
    // The tables' rows: every rank's micro-batch's tokens (the CP group's ranks share rows).
    const int64_t step_tokens = int64_t{c.train.micro_batch} * c.train.seq_len * c.parallelism.dp;
    // A rank reads the rows of its own tokens (a cp-th of each of its micro-batch's rows) from the other tables.
    const int64_t rank_tokens =
        int64_t{c.train.micro_batch} * ((c.train.seq_len + c.parallelism.cp - 1) / c.parallelism.cp);
    const std::vector<bool> trainable = m.params().trainable_after(c.model.freeze);
    const ShardedStore::Bytes b =
        ShardedStore::bytes_for(m.params(), trainable, full_ ? ShardedStore::Mode::Full : ShardedStore::Mode::Gradients,
                                world_size, step_tokens, rank_tokens);
    // Under gradients with bf16 working weights the float32 masters are sharded as under full.
    const bool bf16_masters = !full_ && c.model.param_dtype == model::ParamDtype::Bfloat16;
    const int64_t masters =
        bf16_masters ? ShardedStore::master_bytes_for(m.params(), trainable, world_size) : b.weight_shard;
    MemoryBreakdown need;
    need.add(full_          ? "weight shard"
             : bf16_masters ? "float32 masters (this rank's slice)"
                            : "weights",
             masters + m.buffers().total_bytes());
    need.add(full_ ? "gathered weights" : "the tables' rows", b.gathered);
    need.add("gradients", b.gradients);
    need.add("AdamW moments", b.moments);
    need.add("communication buffers", b.comm_buffers);
    if (c.model.param_dtype == model::ParamDtype::Bfloat16)
      need.add("bf16 working weights", ShardedStore::working_bytes_for(m.params(), full_ ? b.gathered : -1));
    else if (c.model.compute_dtype == model::ComputeDtype::Bfloat16)
      need.add("bf16 weight copies",
               full_ ? b.gathered / static_cast<int64_t>(sizeof(float) / sizeof(bf16)) : m.bf16_weight_bytes());
    return {need};
  }

  // The store's own communicator over the world (its collectives run inside the model's hooks).
  void join(Run& r) override { comm_ = r.world.split(0, r.world.rank(), r.timeout); }

  // A fresh sharded store that freezes model.freeze when its weights are allocated; each rank keeps its pieces of
  // every tensor as it is loaded.
  std::unique_ptr<model::ParamStore> make_store(Run& r) override {
    std::unique_ptr<ShardedStore> s = make_sharded_store(r, comm_);
    store_ = s.get();
    return s;
  }

  void before_optimizer(Run& r) override {
    RF_CHECK(store_ != nullptr && &r.ck.model->params() == store_,
             "shard: the model was loaded into a replicated store");
    model::ParamStore& store = r.ck.model->params();
    const model::Shard mine = model::shard_of(store.trainable_elements(), r.world.rank(), r.world.size());
    store.set_moment_range(mine.begin, mine.end);
  }

  // Gradients and full: each tower group's gradients are reduced by its backward's hooks.
  bool tower_gradients_collective() const override { return slices_only_; }
  bool forward_collective() const override { return full_; }

  // Gradients and full: reduced already, layer by layer, by the store's hooks, into this rank's slice. Optimizer:
  // reduce-scattered here, as ZeRO-1.
  void reduce_gradients(Run& r) override {
    if (r.world.size() == 1 || slices_only_) return;
    const std::span<float> flat = r.ck.model->params().mutable_flat(model::Role::Grads);
    r.world.reduce_scatter(flat.data(), flat.size(), comm::ReduceOp::Sum, r.timeout);
  }

  std::vector<double> norm_partials(Run& r) override {
    if (!slices_only_) return replicated_norm_partials(r, true);
    // The store's gradients are this rank's slice alone.
    std::vector<double> partial(static_cast<size_t>(r.world.size()));
    const double mine = sum_of_squares(r.ck.model->params().mutable_flat(model::Role::Grads));
    r.world.allgather(&mine, partial.data(), sizeof(double), r.timeout);
    return partial;
  }

  void update(Run& r, double lr, int64_t step, double clip) override {
    r.adam->step(r.ck.model->params(), lr, step, clip);
    store_->after_update();
  }

  std::optional<double> take_comm_wait() override { return store_->take_exposed_seconds(); }
  const ShardedStore* sharded_masters() const override { return store_; }

  void save(Run& r, const std::string& tmp, comm::Timeout wait, const FinishSave& finish) override {
    model::ParamStore& store = r.ck.model->params();
    save_weights(r, store, tmp, wait, masters_sharded_);
    finish_save(r, store, wait, finish, save_moments_per_rank(r, store, tmp, wait));
  }

  void unshard() override { store_->unshard(); }

 private:
  bool full_;             // shard full: the weights too are this rank's pieces, gathered a layer at a time
  bool slices_only_;      // gradients and full: a rank's gradients are its slice, reduced by the hooks
  bool masters_sharded_;  // the float32 masters are this rank's pieces (reads are collectives)
  std::unique_ptr<comm::Communicator> comm_;  // the store's, until make_store hands it over
  ShardedStore* store_ = nullptr;             // owned by the model
};

}  // namespace

std::unique_ptr<TrainingState> sharded_state(const TrainConfig& c) { return std::make_unique<ShardedState>(c); }

}  // namespace rf::trainer::detail
