// ringflex trainer: the choice of a run's training state (plan_state) and the parts its modes share
// (docs/parallel-state.md).
#include <exception>

#include "comm/agree.h"
#include "core/error.h"
#include "model/expert_store.h"
#include "model/memory.h"
#include "trainer/run.h"
#include "trainer/state/sharded_store.h"
#include "trainer/state/state.h"

namespace rf::trainer::detail {

std::unique_ptr<TrainingState> plan_state(const TrainConfig& c) {
  if (c.model.lora_rank != 0) return lora_state(c);
  if (c.parallelism.ep > 1) return held_experts_state(c);
  const ShardMode shard = c.parallelism.shard;
  if (shard == ShardMode::Gradients || shard == ShardMode::Full ||
      (shard == ShardMode::Optimizer && c.model.param_dtype == model::ParamDtype::Bfloat16))
    return sharded_state(c);
  return replicated_state(c);
}

// Straight into the mode's store (a sharded store's run: each rank keeping its pieces as the tensors are read).
void TrainingState::resume(Run& r) {
  LoadedCheckpoint loaded = load_train_checkpoint(
      r.resume_dir, [&](const model::Gemma4Multimodal& shapes) { check_fits(r, shapes); }, r.cfg.model.train_vision,
      make_store(r), place(r));
  check_resume_compatible(r.cfg, loaded.state.config_yaml, r.resume_dir);
  r.ck = std::move(loaded.weights);
  r.state = std::move(loaded.state);
}

std::string TrainingState::weights_source(const Run& r) const {
  return r.resume_dir.empty() ? r.cfg.model.path : r.resume_dir;
}

void TrainingState::after_optimizer(Run& r) {
  if (!r.resume_dir.empty()) load_optimizer_state(r.resume_dir, r.ck.model->params());
}

int64_t trainable_bytes(const TrainConfig& c, const model::ParamStore& registry) {
  int64_t bytes = 0;
  const std::vector<bool> trainable = registry.trainable_after(c.model.freeze);
  for (size_t i = 0; i < trainable.size(); ++i)
    if (trainable[i]) bytes += registry.info(i).numel * static_cast<int64_t>(sizeof(float));
  return bytes;
}

MemoryBreakdown replicated_bytes(const TrainConfig& c, const model::Gemma4Multimodal& m, int world_size,
                                 const ReplicatedBytes& b) {
  constexpr int kMoments = 2;  // exp_avg, exp_avg_sq
  MemoryBreakdown need;
  // Shard optimizer with bf16 working weights: a ShardedStore keeps this rank's slice of the float32 masters.
  if (c.parallelism.shard == ShardMode::Optimizer && c.model.param_dtype == model::ParamDtype::Bfloat16)
    need.add("float32 masters (this rank's slice)",
             ShardedStore::master_bytes_for(m.params(), m.params().trainable_after(c.model.freeze), world_size) +
                 m.buffers().total_bytes());
  else
    need.add("weights", b.weight_bytes + m.buffers().total_bytes());
  need.add("gradients", b.trainable_bytes);
  need.add(b.extra);
  // parallelism.shard = optimizer: a rank holds the moments of its shard, ceil(trainable / moment_ranks) elements.
  const int64_t trainable_elements = b.trainable_bytes / static_cast<int64_t>(sizeof(float));
  const int64_t moment_elements = c.parallelism.shard == ShardMode::Optimizer
                                      ? model::shard_of(trainable_elements, 0, b.moment_ranks).padded
                                      : trainable_elements;
  need.add("AdamW moments", checked_bytes({kMoments, moment_elements, static_cast<int64_t>(sizeof(float))}));
  // (A LoRA base has none: the matmuls read a bf16 base as it is mapped, and round another per call.)
  if (c.model.param_dtype == model::ParamDtype::Bfloat16)
    need.add("bf16 working weights", ShardedStore::working_bytes_for(m.params(), -1));
  else if (c.model.compute_dtype == model::ComputeDtype::Bfloat16 && c.model.lora_rank == 0)
    need.add("bf16 weight copies", m.bf16_weight_bytes() - b.bf16_elsewhere_bytes);
  return need;
}

// The sum of squares is taken as one partial sum per rank's slice (comm::slice_of over the world), added in rank
// order by the caller: the same bits whether a rank holds every reduced gradient (shard none: it computes all the
// partials) or its slice alone (shard optimizer: each computes its own, and they are gathered).
std::vector<double> replicated_norm_partials(Run& r, bool slices_gathered) {
  const std::span<float> flat = r.ck.model->params().mutable_flat(model::Role::Grads);
  const int P = r.world.size();
  const auto slice = [&](int rank) {
    const comm::Slice s = comm::slice_of(flat.size(), P, rank);
    return flat.subspan(s.begin, s.size());
  };
  std::vector<double> partial(static_cast<size_t>(P));
  if (slices_gathered) {
    const double mine = sum_of_squares(slice(r.world.rank()));
    r.world.allgather(&mine, partial.data(), sizeof(double), r.timeout);
  } else {
    for (int rank = 0; rank < P; ++rank) partial[static_cast<size_t>(rank)] = sum_of_squares(slice(rank));
  }
  return partial;
}

// After the update each rank updated its slice of the trainable parameters; every rank takes the others' (the same
// bits the whole update gives). The gradient arena, whose values are spent, carries them in the trainable layout:
// this rank's slice is copied in, one all-gather of slices fills the rest, and every trainable parameter is copied
// back.
void gather_updated_weights(comm::Communicator& c, model::ParamStore& store, comm::Timeout timeout) {
  const std::span<float> staging = store.mutable_flat(model::Role::Grads);
  const comm::Slice mine = comm::slice_of(staging.size(), c.size(), c.rank());
  const int64_t begin = static_cast<int64_t>(mine.begin), end = static_cast<int64_t>(mine.end);
  for (const model::ParamStore::Segment& seg : store.trainable_segments(begin, end))
    std::copy_n(store.weight(seg.slot) + seg.first, seg.n, staging.data() + seg.train_index);
  c.allgather_slices(staging.data(), staging.size(), sizeof(float), timeout);
  for (const model::ParamStore::Segment& seg : store.trainable_segments(0, store.trainable_elements()))
    std::copy_n(staging.data() + seg.train_index, seg.n, store.mutable_weight(seg.slot) + seg.first);
}

void save_weights(Run& r, model::ParamStore& store, const std::string& tmp, comm::Timeout wait, bool all_take_part) {
  std::exception_ptr failed;
  try {
    // The other ranks take part in the reads where they are collective (sharded masters', the held experts' gathers).
    if (r.lead || all_take_part) model::save_checkpoint(r.ck, store, tmp, {max_shard_bytes(r.cfg.checkpoint), r.lead});
  } catch (...) {
    failed = std::current_exception();  // save_checkpoint took part in every read before it threw
  }
  comm::agree(
      r.world,
      [&] {
        if (failed) std::rethrow_exception(failed);
      },
      wait);
}

PendingCheckpoint::MomentLayout save_moments_per_rank(Run& r, const model::ParamStore& store, const std::string& tmp,
                                                      comm::Timeout wait) {
  comm::agree(
      r.world, [&] { write_moments_shard(tmp, store, r.world.rank(), r.world.size()); }, wait);
  PendingCheckpoint::MomentLayout moments;  // every rank's range, as its store holds it
  moments.shard_mode = name_of(r.cfg.parallelism.shard);
  const model::Shard mine = store.moment_range();
  const int64_t range[2] = {mine.begin, mine.end};
  std::vector<int64_t> all(2 * static_cast<size_t>(r.world.size()));
  r.world.allgather(range, all.data(), sizeof range, r.timeout);
  for (int k = 0; k < r.world.size(); ++k) moments.ranges.emplace_back(all[2 * k], all[2 * k + 1]);
  return moments;
}

void save_moments_whole(Run& r, const model::ParamStore& store, const std::string& tmp, comm::Timeout wait) {
  comm::agree(
      r.world,
      [&] {
        if (r.lead) write_moments_whole(tmp, store);
      },
      wait);
}

void finish_save(Run& r, const model::ParamStore& store, comm::Timeout wait, const FinishSave& finish,
                 const PendingCheckpoint::MomentLayout& m) {
  comm::agree(
      r.world, [&] { finish(store, m); }, wait);
}

}  // namespace rf::trainer::detail
