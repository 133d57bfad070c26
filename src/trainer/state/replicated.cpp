// ringflex trainer: the replicated training state, parallelism.shard none and optimizer (ZeRO-1) with float32 working
// weights: every rank holds every weight and gradient; the moments are whole (none) or this rank's slice
// (optimizer). docs/parallel-state.md.
#include "comm/agree.h"
#include "trainer/run.h"
#include "trainer/state/state.h"

namespace rf::trainer::detail {
namespace {

class ReplicatedState final : public TrainingState {
 public:
  explicit ReplicatedState(const TrainConfig& c) : zero1_(c.parallelism.shard == ShardMode::Optimizer) {}

  Support supports(const TrainConfig&) const override { return {}; }

  StateBytes bytes(const TrainConfig& c, const model::Gemma4Multimodal& m, int world_size, int) const override {
    ReplicatedBytes b;
    b.weight_bytes = m.params().weight_bytes();
    b.trainable_bytes = trainable_bytes(c, m.params());
    b.moment_ranks = world_size;
    return {replicated_bytes(c, m, world_size, b)};
  }

  std::unique_ptr<model::ParamStore> make_store(Run&) override { return nullptr; }

  void before_optimizer(Run& r) override {
    if (!zero1_) return;
    model::ParamStore& store = r.ck.model->params();
    const model::Shard mine = model::shard_of(store.trainable_elements(), r.world.rank(), r.world.size());
    store.set_moment_range(mine.begin, mine.end);
  }

  // In rank order (the same bits on every rank and backend), in place in the flat gradient arena: one collective.
  // Shard none: every rank gets the whole sum (all-reduce); shard optimizer: each rank gets the sums of its slice
  // (reduce-scatter, half the traffic), the only gradients its update reads.
  void reduce_gradients(Run& r) override {
    if (r.world.size() == 1) return;
    const std::span<float> flat = r.ck.model->params().mutable_flat(model::Role::Grads);
    if (zero1_)
      r.world.reduce_scatter(flat.data(), flat.size(), comm::ReduceOp::Sum, r.timeout);
    else
      r.world.allreduce(flat.data(), flat.size(), comm::ReduceOp::Sum, r.timeout);
  }

  std::vector<double> norm_partials(Run& r) override { return replicated_norm_partials(r, zero1_); }

  void update(Run& r, double lr, int64_t step, double clip) override {
    r.adam->step(r.ck.model->params(), lr, step, clip);
    if (zero1_) gather_updated_weights(r.world, r.ck.model->params(), r.timeout);
  }

  void save(Run& r, const std::string& tmp, comm::Timeout wait, const FinishSave& finish) override {
    model::ParamStore& store = r.ck.model->params();
    save_weights(r, store, tmp, wait, false);
    PendingCheckpoint::MomentLayout moments;  // ZeRO-1: one file a rank
    if (zero1_)
      moments = save_moments_per_rank(r, store, tmp, wait);
    else
      save_moments_whole(r, store, tmp, wait);
    finish_save(r, store, wait, finish, moments);
  }

 private:
  bool zero1_;  // shard optimizer: the moments, clipping's partials and the update cover this rank's slice
};

}  // namespace

std::unique_ptr<TrainingState> replicated_state(const TrainConfig& c) { return std::make_unique<ReplicatedState>(c); }

}  // namespace rf::trainer::detail
