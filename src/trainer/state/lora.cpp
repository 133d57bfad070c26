// ringflex trainer: the LoRA training state (model.lora, shard none or optimizer): a LoraStore (model/lora_store.h)
// whose frozen base is mapped from the checkpoint's files and whose adapters train; with expert parallelism and the
// experts' weights adapted, each rank holds its experts' adapters only (trainer/state/expert_state.h).
// docs/parallel-state.md.
#include <filesystem>

#include "comm/agree.h"
#include "io/checkpoint.h"
#include "model/lora_store.h"
#include "model/memory.h"
#include "model/peft_files.h"
#include "trainer/run.h"
#include "trainer/runtime_memory.h"
#include "trainer/state/expert_state.h"
#include "trainer/state/state.h"

namespace rf::trainer::detail {

model::LoraConfig lora_config(const TrainConfig& cfg) {
  model::LoraConfig lc;
  lc.rank = cfg.model.lora_rank;
  lc.alpha = cfg.model.lora_alpha;
  lc.dropout = cfg.model.lora_dropout;
  lc.target = cfg.model.lora_target;
  lc.target_regex = cfg.model.lora_target_regex;
  lc.target_parameters = cfg.model.lora_target_parameters;
  lc.use_rslora = cfg.model.lora_use_rslora;
  lc.seed = cfg.train.seed;
  return lc;
}

namespace {

namespace fs = std::filesystem;

// Bytes of the model's parameters in the dtypes of model.path's files (what a LoRA store maps), or -1 without
// model.path (a built-in base), without weight files (`ringflex train --plan` on a config.json alone: the base is
// then counted as float32), or where a file's dtype is none a store can hold (the loader widens those). `base`: the
// model's parameters alone, as the memory check's shapes register them (no adapters: they are in no file).
int64_t mapped_base_bytes(const TrainConfig& c, const model::ParamStore& base) {
  if (c.model.path.empty() || !model::has_weight_files(c.model.path)) return -1;
  const io::Checkpoint files = io::Checkpoint::open(c.model.path);
  const std::string prefix = files.find(std::string(model::kMultimodalTextPrefix) + "embed_tokens.weight")
                                 ? model::kMultimodalTextPrefix
                                 : "model.";
  int64_t bytes = 0;
  for (size_t slot = 0; slot < base.size(); ++slot) {
    const model::ParamInfo& p = base.info(slot);
    const io::TensorView* v = files.find(model::file_name_of(p.name, prefix));
    if (v == nullptr) return -1;
    if (v->dtype != io::StDType::F32 && v->dtype != io::StDType::BF16 && v->dtype != io::StDType::F16) return -1;
    bytes += static_cast<int64_t>(v->bytes.size());
  }
  return bytes;
}

class LoraState final : public TrainingState {
 public:
  explicit LoraState(const TrainConfig& c)
      : zero1_(c.parallelism.shard == ShardMode::Optimizer),
        adapters_placed_(c.parallelism.ep > 1 && !c.model.lora_target_parameters.empty()) {}

  Support supports(const TrainConfig& c) const override {
    // shard optimizer shards the adapters' moments (model/param_store.h: ZeRO-1 is the trainer's, over any store).
    // gradients and full would shard state the LoRA store does not have: its frozen base is mapped read-only from
    // the checkpoint's files, whose page-cache pages every rank of a machine shares (one copy a machine, never a
    // float32 one), so a rank's piece of it would be a private copy costing more than the shared pages; and the
    // adapters' gradients are the size of the adapters, a few MB beside one layer's widened base.
    if (c.parallelism.shard != ShardMode::None && c.parallelism.shard != ShardMode::Optimizer)
      return {rf::concat("model.lora with parallelism.shard = ", name_of(c.parallelism.shard),
                         " is not implemented (none or optimizer: the frozen base is mapped and shared by the ranks of "
                         "a machine, the adapters' gradients are small)")};
    if (c.model.train_vision)
      return {
          "model.lora with model.train_vision is not implemented (LoRA adapts the decoder; the tower would "
          "train in full beside it)"};
    // A LoRA base is held in its checkpoint's dtype already and its adapters are small.
    if (c.model.param_dtype == model::ParamDtype::Bfloat16)
      return {
          "model.param_dtype = bfloat16 with model.lora is not implemented (its weights keep float32 working "
          "copies of their own)"};
    return {};
  }

  // The adapters train (their weights, gradients and moments), the base is frozen.
  StateBytes bytes(const TrainConfig& c, const model::Gemma4Multimodal& m, int world_size,
                   int ranks_on_node) const override {
    StateBytes out;
    ReplicatedBytes b;
    b.weight_bytes = m.params().weight_bytes();
    const std::vector<model::LoraTarget> targets = model::lora_targets(m.params(), lora_config(c));
    // Expert parallelism: each rank's experts' adapters only (LoraStore::place_experts).
    b.trainable_bytes = model::lora_adapter_bytes(targets, c.model.lora_rank, c.parallelism.ep);
    const int64_t mapped = mapped_base_bytes(c, m.params());
    if (mapped >= 0) {
      // The base stays in the files' dtype, mapped: the page cache holds one copy for every rank of this machine
      // (each maps the same files), counted here as this rank's share of the machine, as available_memory_bytes()
      // counts the machine. What the hooks widen to float32: the global group's other matmul operands for the whole
      // run; one layer's base while a layer runs; and the loss's panel of the head (the run's phases).
      b.weight_bytes = b.trainable_bytes;
      b.extra.add(rf::concat("LoRA base, mapped (shared by the ", ranks_on_node, " ranks of this machine)"),
                  (mapped + ranks_on_node - 1) / ranks_on_node);
      b.extra.add("LoRA: the global base widened", model::lora_global_buffer_bytes(m.params()));
      out.layer_weight_bytes = model::lora_layer_buffer_bytes(m.params());
      out.head_weight_bytes = model::lora_head_buffer_bytes(m.params());
    } else {
      // A base built in memory (model.builtin) is float32 in each rank's memory.
      b.weight_bytes += b.trainable_bytes;
    }
    // Shard optimizer with the experts' adapters placed: the moments of its EDP slice (N / ep ranks) of its held
    // adapters (trainer/state/expert_state.h).
    b.moment_ranks = adapters_placed_ ? world_size / c.parallelism.ep : world_size;
    out.terms = replicated_bytes(c, m, world_size, b);
    return out;
  }

  // The adapters added and the base frozen when the store allocates; with expert parallelism this rank's experts'
  // adapters only.
  std::unique_ptr<model::ParamStore> make_store(Run& r) override {
    auto ls = std::make_unique<model::LoraStore>(lora_config(r.cfg));
    if (adapters_placed_) ls->place_experts(r.world.rank() % r.cfg.parallelism.ep, r.cfg.parallelism.ep);
    store_ = ls.get();
    return ls;
  }

  // PEFT's initial adapters again (B = 0: the base's function).
  void drawn(Run&) override { store_->init_adapters(); }

  // A LoRA checkpoint holds the adapters (PEFT's files) and the state; the base is the config's.
  void resume(Run& r) override {
    r.state = load_train_state(r.resume_dir);
    check_resume_compatible(r.cfg, r.state.config_yaml, r.resume_dir);
    load_base(r);
    model::load_peft_adapter(*store_, r.resume_dir);
  }

  // The base's files (model.path) even when resuming: the checkpoint holds the adapters.
  std::string weights_source(const Run& r) const override { return r.cfg.model.path; }

  // Shard optimizer: this rank's slice of the trainable layout; with placed adapters its EDP slice of its held
  // layout (expert_state.h).
  void before_optimizer(Run& r) override {
    if (!zero1_) return;
    model::ParamStore& store = r.ck.model->params();
    comm::Communicator& over = adapters_placed_ ? *r.edp_group : r.world;
    const model::Shard mine = model::shard_of(store.trainable_elements(), over.rank(), over.size());
    store.set_moment_range(mine.begin, mine.end);
  }

  // Placed adapters: the experts' over their EDP group, the rest over the world; a rank updates its EDP slice of its
  // held layout, so under shard optimizer it takes the whole sums too (the adapters' gradients are small, and these
  // are shard none's bits).
  void reduce_gradients(Run& r) override {
    if (r.world.size() == 1) return;
    if (adapters_placed_) {
      reduce_held_expert_gradients(r.ck.model->params(), expert_groups(r));
      return;
    }
    const std::span<float> flat = r.ck.model->params().mutable_flat(model::Role::Grads);
    if (zero1_)
      r.world.reduce_scatter(flat.data(), flat.size(), comm::ReduceOp::Sum, r.timeout);
    else
      r.world.allreduce(flat.data(), flat.size(), comm::ReduceOp::Sum, r.timeout);
  }

  std::vector<double> norm_partials(Run& r) override {
    if (adapters_placed_) return held_expert_norm_partials(r.ck.model->params(), expert_groups(r));
    return replicated_norm_partials(r, zero1_);
  }

  // Shard optimizer: the updated slices gathered (placed adapters: over the EDP group, each holding its experts').
  void update(Run& r, double lr, int64_t step, double clip) override {
    r.adam->step(r.ck.model->params(), lr, step, clip);
    if (zero1_) gather_updated_weights(adapters_placed_ ? *r.edp_group : r.world, r.ck.model->params(), r.timeout);
  }

  // A LoRA run's weights are its adapters, in PEFT's files; the frozen base stays where model.path has it. Placed
  // adapters: gathered whole onto rank 0 (their moments' EDP slices first under shard optimizer), which writes them
  // and their moments as shard none does.
  void save(Run& r, const std::string& tmp, comm::Timeout wait, const FinishSave& finish) override {
    std::unique_ptr<model::LoraStore> whole;
    if (adapters_placed_) {
      const WholeAdapterMoments moments(*store_, zero1_ ? r.edp_group.get() : nullptr, r.timeout);
      if (r.world.rank() < r.cfg.parallelism.ep) whole = gather_held_adapters(*store_, expert_groups(r));
    }
    // The whole adapters on rank 0 (placed), or this rank's store.
    const model::LoraStore& lora = r.lead && whole ? *whole : *store_;
    std::exception_ptr failed;
    try {
      if (r.lead) model::save_peft_adapter(lora, r.ck.text_prefix, r.ck.source, tmp);
    } catch (...) {
      failed = std::current_exception();
    }
    comm::agree(
        r.world,
        [&] {
          if (failed) std::rethrow_exception(failed);
        },
        wait);
    PendingCheckpoint::MomentLayout moments;  // ZeRO-1 without placed adapters: one file a rank
    if (zero1_ && !adapters_placed_)
      moments = save_moments_per_rank(r, lora, tmp, wait);
    else
      save_moments_whole(r, lora, tmp, wait);
    finish_save(r, lora, wait, finish, moments);
  }

 private:
  bool zero1_;                         // shard optimizer: the moments cover this rank's slice
  bool adapters_placed_;               // ep > 1 with the experts' weights adapted: this rank's experts' adapters only
  model::LoraStore* store_ = nullptr;  // owned by the model (make_store)
};

}  // namespace

std::unique_ptr<TrainingState> lora_state(const TrainConfig& c) { return std::make_unique<LoraState>(c); }

}  // namespace rf::trainer::detail
