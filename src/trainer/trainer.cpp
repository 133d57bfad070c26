// ringflex trainer: the loop over a cp x dp grid (see trainer.h).
#include "trainer/trainer.h"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>

#include "comm/agree.h"
#include "core/error.h"
#include "core/memory.h"
#include "cp/parallel_context.h"
#include "io/atomic_file.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "io/tensor_access.h"
#include "model/builtin_configs.h"
#include "model/expert_store.h"
#include "model/lora_store.h"
#include "model/matmul_bf16.h"
#include "model/memory.h"
#include "model/vision.h"
#include "model/vision_encoder.h"
#include "trainer/checkpoint.h"
#include "trainer/data.h"
#include "trainer/expert_state.h"
#include "trainer/held_expert_store.h"
#include "trainer/optimizer.h"
#include "trainer/sharded_store.h"

namespace rf::trainer {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

model::Batch as_batch(const PackedBatch& p) {
  model::Batch b;
  b.B = p.B;
  b.S = p.S;
  b.input_ids = p.input_ids.data();
  b.labels = p.labels.data();
  b.position_ids = p.position_ids.data();
  b.doc = p.doc.data();
  b.mm_token_type = p.mm_token_type.data();
  b.image_features = p.image_features.empty() ? nullptr : p.image_features.data();
  b.n_image_features = p.n_image_features;
  return b;
}

// A resumed run must continue the same stream of rows with the same batches.
void check_resume_compatible(const TrainConfig& now, const std::string& saved_yaml, const std::string& dir) {
  const TrainConfig then = parse_config(saved_yaml, dir + "/trainer_state.json config");
  const auto same = [&](bool equal, const char* field) {
    RF_CHECK(equal, "--resume ", dir, ": ", field, " differs from the run that wrote the checkpoint");
  };
  // The weights come from the checkpoint, so another model in the config would train the checkpoint's model while
  // the new checkpoints recorded the config's.
  same(now.model.path == then.model.path && (!now.model.path.empty() || now.model.builtin == then.model.builtin),
       now.model.path.empty() && then.model.path.empty() ? "model.builtin" : "model.path");
  same(now.train.seq_len == then.train.seq_len, "train.seq_len");
  same(now.train.global_batch == then.train.global_batch, "train.global_batch");
  same(now.train.seed == then.train.seed, "train.seed");
  same(now.data.source == then.data.source, "data.source");
  same(now.data.path == then.data.path, "data.path");
  same(now.data.image_soft_tokens == then.data.image_soft_tokens, "data.image_soft_tokens");
  same(now.model.freeze == then.model.freeze, "model.freeze");
  // The tower's parameters are in the optimizer state (and written in float32) only when it trains.
  same(now.model.train_vision == then.model.train_vision, "model.train_vision");
  same(now.model.lora_rank == then.model.lora_rank && now.model.lora_alpha == then.model.lora_alpha &&
           now.model.lora_target == then.model.lora_target &&
           now.model.lora_target_regex == then.model.lora_target_regex &&
           now.model.lora_target_parameters == then.model.lora_target_parameters &&
           now.model.lora_use_rslora == then.model.lora_use_rslora,
       "model.lora");
}

// Loaded weights must be finite before step 1: a NaN would only show as a non-finite loss after the first step's
// work. Names the single-file checkpoint, or the directory of a sharded one.
void check_loaded_weights(const model::Checkpoint& ck, const std::string& dir) {
  const fs::path single = fs::path(dir) / "model.safetensors";
  std::error_code ec;
  const std::string where = fs::exists(single, ec) ? single.string() : dir;
  const model::ParamStore& store = ck.model->params();
  const auto* sharded = dynamic_cast<const ShardedStore*>(&store);
  for (size_t i = 0; i < store.size(); ++i) {  // named as in the files, where the user can look it up
    const model::ParamInfo& p = store.info(i);
    if (sharded != nullptr && sharded->sharded()) {  // shard full: each rank checks the piece it keeps
      int64_t first = 0;
      const std::span<const float> piece = sharded->own_piece(i, &first);
      for (size_t k = 0; k < piece.size(); ++k)
        if (!std::isfinite(piece[k]))
          rf::fail(where, ": tensor `", model::file_name_of(p.name, ck.text_prefix), "` has ", piece[k], " at ",
                   io::index_string(first + static_cast<int64_t>(k), p.shape));
      continue;
    }
    const std::string name = model::file_name_of(p.name, ck.text_prefix);
    const model::HeldWeight held = store.held_weight(i);
    if (held.dtype == model::HeldDType::F32) {
      check_loaded_tensor(where, name, std::span<const float>(store.weight(i), static_cast<size_t>(p.numel)), p.shape);
      continue;
    }
    // A base held in the files' dtype (a LoRA store): widened a block of rows at a time, not the whole tensor.
    constexpr int64_t kBlockElements = int64_t{1} << 22;
    const int64_t row = p.shape.size() >= 2 ? p.numel / p.shape[0] : p.numel;
    const int64_t rows_per_block = std::max<int64_t>(1, kBlockElements / std::max<int64_t>(row, 1));
    std::vector<float> block;
    for (int64_t r0 = 0; r0 * row < p.numel; r0 += rows_per_block) {
      const int64_t n = std::min(p.numel - r0 * row, rows_per_block * row);
      block.resize(static_cast<size_t>(n));
      model::widen(held, r0 * row, n, block.data());
      check_loaded_tensor(where, rf::concat(name, " (rows from ", r0, ")"), block,
                          {n / std::max<int64_t>(row, 1), row});
    }
  }
}

std::string default_svg_path(const TrainConfig& c, const TrainOptions& o) {
  if (!o.svg_path.empty()) return o.svg_path;
  if (!c.checkpoint.dir.empty()) return (fs::path(c.checkpoint.dir) / "loss.svg").string();
  if (!o.metrics_path.empty()) return fs::path(o.metrics_path).replace_extension(".svg").string();
  return "";
}

// checkpoint.dir need not exist (the first save creates it and its parents), but its nearest existing ancestor
// must be a directory this process can write.
void check_creatable_directory(const std::string& dir, const char* field) {
  std::error_code ec;
  fs::path at = fs::absolute(dir, ec);
  while (!fs::exists(at, ec) && at.has_parent_path() && at != at.parent_path()) at = at.parent_path();
  RF_CHECK(fs::is_directory(at, ec), field, " = '", dir, "': ", at.string(), " is not a directory");
  RF_CHECK(::access(at.c_str(), W_OK | X_OK) == 0, field, " = '", dir, "': cannot write in ", at.string(), ": ",
           std::strerror(errno));
}

// The run's outputs, checked before any step: a metrics file, loss picture or checkpoint directory that cannot be
// written would otherwise fail only at its first write, after the steps before it. The default loss picture lives
// in checkpoint.dir, which the checkpoint check covers.
void check_outputs(const TrainConfig& c, const TrainOptions& o) {
  if (!o.metrics_path.empty()) io::check_writable(o.metrics_path);
  if (!o.svg_path.empty()) io::check_writable(o.svg_path);
  if (!o.stats_path.empty()) io::check_writable(o.stats_path);
  if (!c.checkpoint.dir.empty()) check_creatable_directory(c.checkpoint.dir, "checkpoint.dir");
}

}  // namespace

// Terms, each counting buffers train() surely holds through a step (float32 unless said):
//   weights          the parameters (and buffers), Gemma4Multimodal::params()/buffers();
//   bf16 copies      with model.compute_dtype = bfloat16, the matrices' bf16 copies (the model's bf16_weight_bytes);
//   gradients        the parameter store's gradient arena: the trainable parameters only;
//   AdamW moments    exp_avg and exp_avg_sq, two more such arenas;
//   the step's rows  this replica's global_batch / dp rows of seq_len tokens, five int32 arrays each (their image
//                    features not counted), built before the step's micro-batches run;
//   validation rows  this replica's share of data.val_rows (every dp-th row), the same arrays, which validate_now
//                    builds all at once while the step's rows are still held;
//   then the larger of what one micro-batch's run holds (model::run_memory_at_least: train.micro_batch rows of
//   ceil(seq_len / cp) tokens, a shard is never shorter, with train.recompute: "activations", "one layer" or
//   "loss chunk"). The gradient reduction runs in place over the gradient arena (the communicator's own slices of at
//   most comm::Communicator::kReduceSliceBytes not counted).
// Left out, so the figure stays a lower bound: the ring's receive buffers (what a rank receives depends on each
// batch's documents; packed short documents need almost none), the data set's packed rows, the plan, the
// checkpoint writer's copies, and validation's forward (smaller than the training step's).
namespace {

// The model.lora fields as the LoRA store takes them.
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

// Bytes of the model's parameters in the dtypes of model.path's files (what a LoRA store maps), or -1 without
// model.path (a built-in base) or where a file's dtype is none a store can hold (the loader widens those). `shapes`
// is the registry before the adapters exist (the check before loading) or a LoraStore with them (--stats at the
// end): its adapters are in no file and are skipped.
int64_t mapped_base_bytes(const TrainConfig& c, const model::ParamStore& shapes) {
  if (c.model.path.empty() || !fs::is_directory(c.model.path)) return -1;
  const io::Checkpoint files = io::Checkpoint::open(c.model.path);
  const std::string prefix = files.find(std::string(model::kMultimodalTextPrefix) + "embed_tokens.weight")
                                 ? model::kMultimodalTextPrefix
                                 : "model.";
  std::vector<bool> adapter(shapes.size(), false);
  if (const auto* lora = dynamic_cast<const model::LoraStore*>(&shapes))
    for (const model::LoraStore::Adapter& a : lora->adapters()) adapter[a.a] = adapter[a.b] = true;
  int64_t bytes = 0;
  for (size_t slot = 0; slot < shapes.size(); ++slot) {
    if (adapter[slot]) continue;
    const model::ParamInfo& p = shapes.info(slot);
    const io::TensorView* v = files.find(model::file_name_of(p.name, prefix));
    if (v == nullptr) return -1;
    if (v->dtype != io::StDType::F32 && v->dtype != io::StDType::BF16 && v->dtype != io::StDType::F16) return -1;
    bytes += static_cast<int64_t>(v->bytes.size());
  }
  return bytes;
}

}  // namespace

MemoryBreakdown train_memory_at_least(const TrainConfig& c, const model::Gemma4Multimodal& m, int world_size) {
  int64_t params = m.params().weight_bytes();
  int64_t trainable_bytes = 0;
  MemoryBreakdown lora_base;
  if (c.model.lora_rank > 0) {
    // LoRA: the adapters train (their weights, gradients and moments), the base is frozen.
    const std::vector<model::LoraTarget> targets = model::lora_targets(m.params(), lora_config(c));
    // Expert parallelism under shard none: each rank's experts' adapters only (LoraStore::place_experts).
    const int adapters_ep = c.parallelism.shard == ShardMode::None ? c.parallelism.ep : 1;
    trainable_bytes = model::lora_adapter_bytes(targets, c.model.lora_rank, adapters_ep);
    const int64_t mapped = mapped_base_bytes(c, m.params());
    if (mapped >= 0) {
      // The base stays in the files' dtype, mapped: the page cache holds one copy for every rank of this machine
      // (each maps the same files), counted here as this rank's share of the machine, as available_memory_bytes()
      // counts the machine. What the hooks widen to float32: one layer's base, and the head for the whole run.
      params = trainable_bytes;
      const int ranks_here = local_ranks();
      lora_base.add(rf::concat("LoRA base, mapped (shared by the ", ranks_here, " ranks of this machine)"),
                    (mapped + ranks_here - 1) / ranks_here);
      lora_base.add("LoRA: one layer's base widened", model::lora_layer_buffer_bytes(m.params()));
      lora_base.add("LoRA: the head widened", model::lora_global_buffer_bytes(m.params()));
    } else {
      // A base built in memory (model.builtin) is float32 in each rank's memory.
      params += trainable_bytes;
    }
  } else {
    const std::vector<bool> trainable = m.params().trainable_after(c.model.freeze);
    for (size_t i = 0; i < trainable.size(); ++i)
      if (trainable[i]) trainable_bytes += m.params().info(i).numel * static_cast<int64_t>(sizeof(float));
  }
  MemoryBreakdown need;
  const bool full = c.parallelism.shard == ShardMode::Full;
  if (c.parallelism.ep > 1 && c.parallelism.shard != ShardMode::None && c.model.lora_rank == 0) {
    // Held experts under sharding (held_expert_store.h): the shard mode's terms over the other parameters, this
    // rank's experts whole and their state over the EDP group.
    const HeldBytes b = held_expert_bytes(m.params(), m.params().trainable_after(c.model.freeze), full,
                                          c.parallelism.shard == ShardMode::Gradients, world_size, c.parallelism.ep);
    need.add(full ? "weight shard" : "weights", b.rest_weights + m.buffers().total_bytes());
    if (full) need.add("gathered weights", b.rest_gathered);
    need.add("gradients", b.rest_gradients);
    need.add("AdamW moments", b.rest_moments);
    need.add("communication buffers", b.rest_comm_buffers);
    need.add("experts held (E / ep)", b.expert_weights);
    need.add("experts' gradients", b.expert_gradients);
    need.add("experts' AdamW moments (EDP slice)", b.expert_moments);
    if (c.model.compute_dtype == model::ComputeDtype::Bfloat16)
      need.add("bf16 weight copies", b.rest_bf16 + b.expert_bf16);
  } else if (full || c.parallelism.shard == ShardMode::Gradients) {
    // The sharded store's state by kind (ShardedStore::bytes_for says what each holds; LoRA is none or optimizer).
    // The tables' rows: every rank's micro-batch's tokens (the CP group's ranks share rows).
    const int64_t step_tokens = int64_t{c.train.micro_batch} * c.train.seq_len * c.parallelism.dp;
    const ShardedStore::Bytes b =
        ShardedStore::bytes_for(m.params(), m.params().trainable_after(c.model.freeze),
                                full ? ShardedStore::Mode::Full : ShardedStore::Mode::Gradients, world_size,
                                step_tokens);
    need.add(full ? "weight shard" : "weights", b.weight_shard + m.buffers().total_bytes());
    need.add(full ? "gathered weights" : "the tables' rows", b.gathered);
    need.add("gradients", b.gradients);
    need.add("AdamW moments", b.moments);
    need.add("communication buffers", b.comm_buffers);
    if (c.model.compute_dtype == model::ComputeDtype::Bfloat16)
      need.add("bf16 weight copies",
               full ? b.gathered / static_cast<int64_t>(sizeof(float) / sizeof(bf16)) : m.bf16_weight_bytes());
  } else {                       // shard none or optimizer: replicated weights and gradients
    constexpr int kMoments = 2;  // exp_avg, exp_avg_sq
    // Expert parallelism holding each rank's experts only (shard none, no LoRA; trainer/expert_state.h): the experts'
    // weights, gradients, moments and bf16 copies are E / ep experts' worth. (A resume still loads the files whole
    // before keeping its rows, and a save gathers them whole on rank 0: one whole copy for that while.)
    int64_t experts_elsewhere = 0, trainable_elsewhere = 0, bf16_elsewhere = 0;  // the other EP ranks' experts
    if (c.parallelism.ep > 1 && c.parallelism.shard == ShardMode::None && c.model.lora_rank == 0) {
      const std::vector<bool> trainable = m.params().trainable_after(c.model.freeze);
      for (size_t i = 0; i < trainable.size(); ++i) {
        const model::ParamInfo& p = m.params().info(i);
        if (!model::is_expert_tensor(p)) continue;
        const int64_t others = p.numel / c.parallelism.ep * (c.parallelism.ep - 1);
        experts_elsewhere += others;
        if (trainable[i]) trainable_elsewhere += others;
        if (p.matmul) bf16_elsewhere += others;
      }
    }
    params -= experts_elsewhere * static_cast<int64_t>(sizeof(float));
    trainable_bytes -= trainable_elsewhere * static_cast<int64_t>(sizeof(float));
    need.add("weights", params + m.buffers().total_bytes());
    need.add("gradients", trainable_bytes);
    need.add(lora_base);
    // parallelism.shard = optimizer: a rank holds the moments of its shard, ceil(trainable / N) elements.
    const int64_t trainable_elements = trainable_bytes / static_cast<int64_t>(sizeof(float));
    const int64_t moment_elements = c.parallelism.shard == ShardMode::Optimizer
                                        ? model::shard_of(trainable_elements, 0, world_size).padded
                                        : trainable_elements;
    need.add("AdamW moments", checked_bytes({kMoments, moment_elements, static_cast<int64_t>(sizeof(float))}));
    // (A LoRA base has none: the matmuls read a bf16 base as it is mapped, and round another per call.)
    if (c.model.compute_dtype == model::ComputeDtype::Bfloat16 && c.model.lora_rank == 0)
      need.add("bf16 weight copies", m.bf16_weight_bytes() - bf16_elsewhere * static_cast<int64_t>(sizeof(bf16)));
  }
  // A step builds all of this replica's rows before its micro-batches run: five int32 arrays a token (ids, labels,
  // positions, documents, image slots); image features not counted.
  constexpr int64_t kRowArrays = 5;
  need.add("the step's rows", checked_bytes({c.global_batch_per_replica(), c.train.seq_len,
                                             kRowArrays * static_cast<int64_t>(sizeof(int32_t))}));
  const int64_t val_rows_here = (int64_t{c.data.val_rows} + c.parallelism.dp - 1) / c.parallelism.dp;
  need.add("validation rows (data.val_rows)",
           checked_bytes({val_rows_here, c.train.seq_len, kRowArrays * static_cast<int64_t>(sizeof(int32_t))}));
  const int64_t L = (int64_t{c.train.seq_len} + c.parallelism.cp - 1) / c.parallelism.cp;
  model::RunMemoryArgs run;
  run.tokens = int64_t{c.train.micro_batch} * L;
  run.training = true;
  run.recompute_layers = c.train.recompute;
  run.keep_mlp_projections = c.train.keep_mlp;
  need.add(model::run_memory_at_least(m.decoder(), run));
  return need;
}

namespace {

// Everything one rank's run holds: built by set_up (the plan's setup), used by every step after it.
struct Run {
  Run(const TrainConfig& c, comm::Communicator& w, const TrainOptions& o)
      : cfg(c), world(w), options(o), cp_index(w.rank() % c.parallelism.cp), dp_index(w.rank() / c.parallelism.cp) {}

  const TrainConfig& cfg;
  comm::Communicator& world;
  const TrainOptions& options;
  const comm::Timeout timeout = comm::default_timeout();  // `ringflex ... --timeout SECONDS`
  const int cp_index, dp_index;
  // ZeRO-2 (parallelism.shard = gradients): each layer's gradients are reduce-scattered as soon as its backward
  // ends, and a rank accumulates its slice alone. ZeRO-3 (full): besides, a rank holds its pieces of the weights and
  // gathers each layer around its forward and backward. Both live in a ShardedStore (sharded_store.h).
  const bool shard_gradients = cfg.parallelism.shard == ShardMode::Gradients;
  const bool shard_full = cfg.parallelism.shard == ShardMode::Full;
  const bool store_shards = shard_gradients || shard_full;
  // ZeRO-1 and up over the world's ranks: the moments, clipping and the update cover this rank's slice.
  const bool shard_optimizer = cfg.parallelism.shard == ShardMode::Optimizer || store_shards;
  const bool lead = world.rank() == 0;  // writes the metrics, the loss picture and the checkpoints
  // Expert parallelism without LoRA: each rank holds and trains only its EP rank's experts, under shard none in a
  // replicated store of its rows (trainer/expert_state.h), under the other shard modes in a HeldExpertStore whose
  // experts' state is sharded over their EDP group (trainer/held_expert_store.h); with LoRA every rank keeps every
  // expert's base (frozen, mapped) and, under shard none, only its experts' adapters (LoraStore::place_experts;
  // their state as held experts', expert_state.h); under shard optimizer every expert's adapters.
  const bool hold_experts =
      cfg.parallelism.ep > 1 && cfg.parallelism.shard == ShardMode::None&& cfg.model.lora_rank == 0;
  const bool hold_expert_adapters =
      cfg.parallelism.ep > 1 && cfg.parallelism.shard == ShardMode::None&& cfg.model.lora_rank > 0;
  const bool hold_experts_sharded =
      cfg.parallelism.ep > 1 && cfg.parallelism.shard != ShardMode::None&& cfg.model.lora_rank == 0;
  std::unique_ptr<comm::Communicator> cp_group, dp_group, ep_group;
  std::unique_ptr<comm::Communicator> edp_group;  // the ranks holding this rank's experts (world rank % ep alike)
  // hold_experts_sharded: the experts' own communicator over the EDP group (until set_up hands it to the store),
  // and the store, owned by the model.
  std::unique_ptr<comm::Communicator> held_edp_comm;
  HeldExpertStore* held = nullptr;
  cp::JobContext context;  // the model's parallel context: the local kernels, or the ring over this rank's CP group
  model::Checkpoint ck;
  TrainState state;
  std::string resume_dir;  // empty: a fresh run
  std::unique_ptr<DataSource> data;
  std::unique_ptr<AdamW> adam;  // its state (the moments) and the gradients live in the model's parameter store
  model::RunOptions training;   // how a micro-batch runs (its string options parsed once)
  int feature_dim = 0;          // F of the batches' image features (0: the data has none)
  // model.train_vision: the model's tower of the current weights (Gemma4Multimodal::vision_tower), made again after
  // every update, on every rank at the same point (apply_update); null otherwise.
  const model::VisionEncoder* tower = nullptr;
  double tower_seconds = 0.0;  // this rank's time in the tower (forward, backward, the group's sums) this step
  // shard gradients / full: the sharded store's own communicator over the world (until set_up hands it over), and
  // the store, owned by the model.
  std::unique_ptr<comm::Communicator> store_comm;
  ShardedStore* sharded = nullptr;
};

// The run's groups and the model's parallel context (collectives: every rank, in the same order).
void join_groups(Run& r) {
  r.cp_group = r.world.split(r.dp_index, r.cp_index, r.timeout);
  r.dp_group = r.world.split(r.cp_index, r.dp_index, r.timeout);
  const int ep = r.cfg.parallelism.ep;  // EP groups: ep consecutive world ranks
  r.ep_group = r.world.split(r.world.rank() / ep, r.world.rank() % ep, r.timeout);
  r.edp_group = r.world.split(r.world.rank() % ep, r.world.rank() / ep, r.timeout);
  cp::CpAttentionOptions co;
  co.scheme = cp::scheme_name(r.cfg.parallelism.sharding);  // cp's options also take `auto`, a spelling
  co.timeout = r.timeout;
  r.context = cp::make_parallel_context(*r.cp_group, co, r.ep_group.get());
  if (r.store_shards) r.store_comm = r.world.split(0, r.world.rank(), r.timeout);
  if (r.hold_experts_sharded) r.held_edp_comm = r.world.split(r.world.rank() % ep, r.world.rank() / ep, r.timeout);
}

// shard gradients / full: a fresh sharded store (it takes the run's communicator over the world) that freezes
// model.freeze when its weights are allocated.
std::unique_ptr<ShardedStore> sharded_store(Run& r) {
  RF_CHECK(r.store_comm != nullptr, "shard: the sharded store's communicator was taken already");
  return std::make_unique<ShardedStore>(std::move(r.store_comm),
                                        r.shard_full ? ShardedStore::Mode::Full : ShardedStore::Mode::Gradients,
                                        r.timeout, r.cfg.model.freeze);
}

// Held experts under sharding: the loaded whole store (frozen already; moments whole when resumed) split into the
// shard mode's store of the non-expert parameters and this rank's experts (held_expert_store.h). The whole copy is
// dropped when this returns.
void hold_experts_sharded(Run& r) {
  const int ep = r.cfg.parallelism.ep;
  std::unique_ptr<model::ParamStore> inner;
  if (r.store_shards) {
    std::unique_ptr<ShardedStore> s = sharded_store(r);
    r.sharded = s.get();
    inner = std::move(s);
  } else {
    inner = std::make_unique<model::ReplicatedStore>();
  }
  RF_CHECK(r.held_edp_comm != nullptr, "held experts: the experts' communicator was taken already");
  auto experts = std::make_unique<ExpertSlices>(std::move(r.held_edp_comm), r.store_shards, r.timeout);
  const HeldPlacement at{r.world.rank() % ep, ep, r.world.rank(), r.world.size()};
  std::unique_ptr<HeldExpertStore> held =
      make_held_expert_store(r.ck.model->params(), std::move(inner), std::move(experts), at);
  r.held = held.get();
  r.ck.model->replace_params(std::move(held));
}

// parallelism.ep against the model: its MoE layers' experts must divide over the EP ranks.
void check_expert_parallelism(const TrainConfig& cfg, const model::Gemma4Config& mc) {
  const int ep = cfg.parallelism.ep;
  if (ep == 1) return;
  RF_CHECK(mc.enable_moe, "config: parallelism.ep = ", ep, " needs a model with MoE layers (enable_moe_block)");
  RF_CHECK(mc.num_experts % ep == 0, "config: parallelism.ep = ", ep, " does not divide the model's ", mc.num_experts,
           " experts");
}

// Setup: the model (fresh, from model.path or resumed), the data, the optimizer state and where the run stands.
// Everything here can fail on bad input and runs no collective, so train() runs it inside comm::agree.
void set_up(Run& r) {
  const TrainConfig& cfg = r.cfg;
  if (r.lead) {
    check_outputs(cfg, r.options);
    std::error_code ec;
    if (!cfg.checkpoint.dir.empty() && fs::is_directory(cfg.checkpoint.dir, ec)) remove_leftovers(cfg.checkpoint.dir);
  }
  // What the run needs, checked on every rank before the weights, gradients and moments are allocated.
  const auto check_fits = [&](const model::Gemma4Multimodal& shapes) {
    check_memory(train_memory_at_least(cfg, shapes, r.world.size()), "train",
                 rf::concat(" at seq_len ", cfg.train.seq_len, " over cp ", cfg.parallelism.cp));
  };
  const bool lora = cfg.model.lora_rank > 0;
  // LoRA: the parameters live in a LoraStore, which adds the adapters and freezes the base when it allocates.
  // shard gradients / full: in a ShardedStore, each rank keeping its pieces of every tensor as it is loaded.
  const auto lora_store = [&]() -> std::unique_ptr<model::ParamStore> {
    if (r.store_shards && !r.hold_experts_sharded) return sharded_store(r);
    if (!lora) return nullptr;
    auto ls = std::make_unique<model::LoraStore>(lora_config(cfg));
    if (r.hold_expert_adapters) ls->place_experts(r.world.rank() % cfg.parallelism.ep, cfg.parallelism.ep);
    return ls;
  };
  // The base: from model.path, or the built-in model from train.seed (a LoRA resume builds it again: it never trains).
  const auto load_base = [&] {
    if (!cfg.model.path.empty()) {
      r.ck = model::load_checkpoint(cfg.model.path, check_fits, lora_store(), cfg.model.train_vision);
      return;
    }
    const std::string text = model::builtin_config_json(cfg.model.builtin);
    const std::string source = "model.builtin " + cfg.model.builtin;
    const model::Gemma4Config builtin = model::Gemma4Config::from_json(text, source);
    const model::VisionConfig tower = model::VisionConfig::from_config_json(text, source).value();
    // With model.train_vision the tower's parameters are registered after the decoder's, before the store allocates.
    const auto shapes = [&](std::unique_ptr<model::ParamStore> store) {
      model::MultimodalParts parts(model::kBuiltinFeatureDim, tower, cfg.model.train_vision);
      return std::make_unique<model::Gemma4Multimodal>(builtin, std::move(parts), model::TensorSet::Storage::Deferred,
                                                       std::move(store));
    };
    check_fits(*shapes(nullptr));
    r.ck.model = shapes(lora_store());
    r.ck.model->params().allocate_weights();
    // Every slot, the tower's last (so the decoder draws the same values with and without model.train_vision).
    r.ck.model->init_random(cfg.train.seed, static_cast<float>(cfg.model.init_std));
    // init_random filled every slot, the adapters too: PEFT's initial adapters again (B = 0: the base's function).
    if (auto* ls = dynamic_cast<model::LoraStore*>(&r.ck.model->params())) ls->init_adapters();
    r.ck.text_prefix = model::kMultimodalTextPrefix;
    // transformers sizes the projection's input by the tower's width: the two must agree.
    RF_CHECK(tower.hidden_size == model::kBuiltinFeatureDim, source,
             ": vision_config.hidden_size = ", tower.hidden_size, ", the projection takes ", model::kBuiltinFeatureDim);
    r.ck.model->kept() = model::init_vision_tower(tower, cfg.train.seed);
    if (cfg.model.train_vision) r.ck.model->adopt_tower_parameters();
  };
  if (!r.options.resume.empty()) {
    r.resume_dir = resolve_checkpoint(r.options.resume);
    if (lora) {
      // A LoRA checkpoint holds the adapters (PEFT's files) and the state; the base is the config's.
      r.state = load_train_state(r.resume_dir);
      check_resume_compatible(cfg, r.state.config_yaml, r.resume_dir);
      load_base();
      model::load_peft_adapter(dynamic_cast<model::LoraStore&>(r.ck.model->params()), r.resume_dir);
    } else {
      // shard gradients / full: straight into a sharded store, each rank keeping its pieces as the tensors are read.
      LoadedCheckpoint loaded =
          load_train_checkpoint(r.resume_dir, check_fits, cfg.model.train_vision,
                                r.store_shards && !r.hold_experts_sharded ? sharded_store(r) : nullptr);
      check_resume_compatible(cfg, loaded.state.config_yaml, r.resume_dir);
      r.ck = std::move(loaded.weights);
      r.state = std::move(loaded.state);
    }
    RF_CHECK(r.state.step < cfg.train.steps, "--resume ", r.resume_dir, ": the checkpoint is at step ", r.state.step,
             " and train.steps = ", cfg.train.steps, " leaves nothing to do");
  } else {
    load_base();
  }
  if (!cfg.model.path.empty() && (lora || r.resume_dir.empty()))
    check_loaded_weights(r.ck, cfg.model.path);
  else if (!r.resume_dir.empty() && !lora)
    check_loaded_weights(r.ck, r.resume_dir);
  const model::Gemma4Multimodal& m = *r.ck.model;
  check_expert_parallelism(cfg, m.config());
  const int width = m.vision_feature_dim() > 0 ? m.vision_feature_dim() : m.config().hidden_size;
  // Unfilled row positions are doc 0 with ignored labels (masked everywhere), so a config without a pad id
  // (pad_token_id null) fills them with token 0: any in-vocabulary id would do.
  const DataContract contract{m.config().vocab_size, m.config().pad_token_id.value_or(0), width, cfg.model.path};
  const std::string& config_json = m.config().source_json;
  ImageContract images;
  images.tokens = model::MultimodalTokens::from_config_json(config_json, "the model's config.json");
  images.rank = r.world.rank();
  images.ranks = r.world.size();
  images.train_vision = cfg.model.train_vision;
  // A frozen tower encodes the data's images once, here; its float32 copy of the weights goes with it. A trained one
  // (model.train_vision) is kept and encodes every micro-batch's images.
  images.vision = [&]() -> const model::VisionEncoder* { return r.ck.model->vision_tower(); };
  r.data = make_data_source(cfg, contract, images);
  if (cfg.model.train_vision)
    RF_CHECK(images.vision() != nullptr, "config: model.train_vision, but the model has no vision tower");
  else
    r.ck.model->drop_vision_tower();
  r.feature_dim = r.data->feature_dim() > 0 ? width : 0;
  r.ck.model->params().freeze(cfg.model.freeze);
  if (r.hold_experts_sharded) {
    // The moments whole (a checkpoint of any EP and shard mode), then each part keeps its own.
    if (!r.resume_dir.empty()) load_optimizer_state(r.resume_dir, r.ck.model->params());
    hold_experts_sharded(r);
  } else if (r.store_shards) {
    r.sharded = dynamic_cast<ShardedStore*>(&r.ck.model->params());
    RF_CHECK(r.sharded != nullptr, "shard: the model was loaded into a replicated store");
  }
  model::ParamStore& store = r.ck.model->params();
  if (r.shard_optimizer && !r.held) {
    const model::Shard mine = model::shard_of(store.trainable_elements(), r.world.rank(), r.world.size());
    store.set_moment_range(mine.begin, mine.end);
  }
  r.adam = std::make_unique<AdamW>(store, cfg.optimizer);
  if (!r.resume_dir.empty() && !r.held) load_optimizer_state(r.resume_dir, store);
  // Held experts: the weights and moments were loaded whole (a checkpoint of any EP), this rank keeps its rows.
  if (r.hold_experts)
    r.ck.model->replace_params(model::hold_expert_rows(store, r.world.rank() % cfg.parallelism.ep, cfg.parallelism.ep));
  model::ParamStore& held = r.ck.model->params();
  held.allocate_grads();  // the trainable parameters' gradients, accumulated over a step's micro-batches
  if (cfg.model.train_vision) r.tower = r.ck.model->vision_tower();  // the final model's: shard_model replaces it
  r.state.seed = cfg.train.seed;
  r.state.config_yaml = to_yaml(cfg);
  r.training.want_grad = true;
  r.training.recompute_layers = cfg.train.recompute;
  r.training.keep_mlp_projections = cfg.train.keep_mlp;
  r.training.compute_dtype = cfg.model.compute_dtype;
}

void announce(const Run& r, Progress& progress) {
  const TrainConfig& cfg = r.cfg;
  progress.note(
      rf::concat("ringflex train: ", cfg.model.path.empty() ? "built-in " + cfg.model.builtin : cfg.model.path, ", ",
                 r.ck.model->params().total_elements(), " parameters, data ", name_of(cfg.data.source),
                 ", S = ", cfg.train.seq_len, ", global batch ", cfg.train.global_batch, " rows (dp ",
                 cfg.parallelism.dp, " x ", cfg.accumulation_steps(), " micro-batches of ", cfg.train.micro_batch,
                 "), cp ", cfg.parallelism.cp, r.resume_dir.empty() ? "" : ", resumed from " + r.resume_dir));
  if (r.training.compute_dtype == model::ComputeDtype::Bfloat16)
    progress.note(rf::concat("ringflex train: bf16 matmuls: ", model::bf16_matmul_path().description));
}

// 1. This replica's rows of the step, rows [pos + d * G/dp, pos + (d + 1) * G/dp), as packed micro-batches of
// train.micro_batch rows. Reads data only (no collective): train() runs it inside comm::agree, so a row that fails
// to load on one rank fails every rank.
std::vector<PackedBatch> replica_micro_batches(const Run& r) {
  const int micro = r.cfg.train.micro_batch;
  const int64_t first = r.state.data_position + int64_t{r.dp_index} * r.cfg.global_batch_per_replica();
  std::vector<PackedBatch> batches;
  for (int a = 0; a < r.cfg.accumulation_steps(); ++a) {
    std::vector<Row> rows;
    for (int j = 0; j < micro; ++j) rows.push_back(r.data->train_row(first + int64_t{a} * micro + j));
    batches.push_back(stack_rows(rows, r.feature_dim));
    // A row the model would refuse is found here, where the ranks agree, not inside the model's collectives where
    // one DP replica's error would leave the others waiting.
    r.ck.model->check_batch(as_batch(batches.back()), r.cfg.parallelism.cp,
                            rf::concat("training rows ", first + int64_t{a} * micro, " to ",
                                       first + int64_t{a + 1} * micro - 1));
  }
  return batches;
}

struct TokenCounts {
  int64_t labels = 0;  // label tokens of the global batch: the loss's denominator
  int64_t real = 0;    // non-padding tokens of the global batch: the throughput's numerator
};

// 2. The global batch's tokens, counted once: each replica counts its rows, one all-reduce over DP sums them (never
// over CP: CP ranks hold the same rows).
TokenCounts count_tokens(const Run& r, const std::vector<PackedBatch>& batches) {
  int64_t counts[2] = {0, 0};
  for (const PackedBatch& b : batches) {
    counts[0] += b.label_tokens();
    counts[1] += b.real_tokens();
  }
  r.dp_group->allreduce(counts, 2, comm::ReduceOp::Sum, r.timeout);
  return {counts[0], counts[1]};
}

// model.train_vision: the micro-batch's images through the tower of the current weights, its soft tokens the slots'
// features, and with gradients the tower's backward from the decoder's d image_features, accumulated into the
// store's gradients of the tower's parameters (frozen ones, model.freeze, have none).
// Under CP the tower's work is split over the group (split_images_by_patches, balanced by patch count): each rank
// encodes its images only, places their soft tokens at their slots' rows of [N, F] and leaves the others zero; one sum
// over the group gives every rank all of them (x + 0 = x: the bits of encoding them everywhere), where the rows its
// positions hold are read. In the backward each rank's d image_features holds its own tokens' rows
// (Result::d_image_features); one sum over the group routes each image's whole gradient to its owner, which
// back-propagates it through the tower once; the gradient reduction over the world then sums the owners' tower
// gradients as it sums the decoder's.
double seconds_since(Clock::time_point start);  // below, with the step's other timing

double run_with_tower(Run& r, const PackedBatch& p, const model::RunOptions& ro) {
  const auto start = Clock::now();
  model::ParamStore& store = r.ck.model->params();
  comm::Communicator& group = *r.cp_group;
  const int64_t F = r.feature_dim, P = p.images.P, k = r.tower->config().pooling_kernel_size;
  const int n = p.images.n;
  std::vector<int64_t> valid(static_cast<size_t>(n), 0), first(static_cast<size_t>(n) + 1, 0);  // first: slot rows
  for (int i = 0; i < n; ++i) {
    for (int64_t q = 0; q < P; ++q) valid[i] += p.images.positions[static_cast<size_t>((i * P + q) * 2)] >= 0;
    first[i + 1] = first[i] + valid[i] / (k * k);  // whole pooling cells: the processor's and the drawings' grids
  }
  RF_CHECK(first[n] == p.n_image_features, "the micro-batch's ", n, " images make ", first[n], " soft tokens for ",
           p.n_image_features, " image slots");
  const std::vector<int> owner = split_images_by_patches(valid, group.size());
  ImagePatches mine;  // this rank's share, in batch order
  std::vector<int> mine_index;
  const size_t patch_values = p.images.pixels.size() / static_cast<size_t>(std::max(n, 1));  // one image's values
  for (int i = 0; i < n; ++i) {
    if (owner[i] != group.rank()) continue;
    ImagePatches one;
    one.n = 1;
    one.P = P;
    one.pixels.assign(p.images.pixels.begin() + static_cast<std::ptrdiff_t>(i * patch_values),
                      p.images.pixels.begin() + static_cast<std::ptrdiff_t>((i + 1) * patch_values));
    one.positions.assign(p.images.positions.begin() + i * P * 2, p.images.positions.begin() + (i + 1) * P * 2);
    mine.append(one);
    mine_index.push_back(i);
  }
  model::VisionTape tape;
  std::vector<float> soft(static_cast<size_t>(p.n_image_features * F), 0.f);  // [N, F]
  if (mine.n > 0) {
    const model::VisionOutput out =
        r.tower->forward(mine.batch(), "the micro-batch's images", ro.want_grad ? &tape : nullptr);
    int64_t at = 0;
    for (size_t j = 0; j < mine_index.size(); ++j) {
      const int i = mine_index[j];
      RF_CHECK(out.counts[j] == first[i + 1] - first[i], "the micro-batch's image ", i, ": the tower made ",
               out.counts[j], " soft tokens for ", first[i + 1] - first[i], " slots");
      std::copy_n(out.soft_tokens.begin() + at * F, out.counts[j] * F, soft.begin() + first[i] * F);
      at += out.counts[j];
    }
  }
  if (group.size() > 1) group.allreduce(soft.data(), soft.size(), comm::ReduceOp::Sum, r.timeout);
  r.tower_seconds += seconds_since(start);
  model::Batch b = as_batch(p);
  b.image_features = soft.data();
  model::Result res = r.ck.model->run(b, ro, *r.context.model);
  if (ro.want_grad) {
    const auto back = Clock::now();
    std::vector<float>& d = res.d_image_features;  // [N, F]
    if (group.size() > 1) group.allreduce(d.data(), d.size(), comm::ReduceOp::Sum, r.timeout);
    if (mine.n > 0) {
      std::vector<float> d_mine;  // [this rank's soft tokens, F]
      for (int i : mine_index) d_mine.insert(d_mine.end(), d.begin() + first[i] * F, d.begin() + first[i + 1] * F);
      model::VisionGrads grads;
      r.tower->backward(mine.batch(), tape, d_mine.data(), grads);
      for (const auto& [name, g] : grads) {
        float* dst = store.grad(store.slot(name));
        if (dst == nullptr) continue;
        for (size_t e = 0; e < g.size(); ++e) dst[e] += g[e];
      }
    }
    r.tower_seconds += seconds_since(back);
  }
  return res.loss;
}

// One micro-batch's share of the global loss (its token losses over `label_tokens`); with `grad`, its gradients
// accumulate into the parameter store's.
double run_micro_batch(Run& r, const PackedBatch& p, int64_t label_tokens, bool grad) {
  model::RunOptions ro = r.training;
  ro.want_grad = grad;
  ro.loss_normalizer = std::max(1.0, static_cast<double>(label_tokens));  // no label tokens: loss 0, not 0 / 0
  if (!r.tower || p.images.n == 0) return r.ck.model->run(as_batch(p), ro, *r.context.model).loss;
  return run_with_tower(r, p, ro);
}

// The key of one micro-batch's LoRA dropout masks.
uint64_t dropout_key(uint64_t seed, int64_t step, int replica, size_t micro_batch) {
  // Distinct for distinct (step, replica, micro-batch) at any realistic count: 32 bits of step, 16 of each other.
  constexpr int kStepShift = 32, kReplicaShift = 16;
  return seed * 0x9e3779b97f4a7c15ULL ^ (static_cast<uint64_t>(step) << kStepShift) ^
         (static_cast<uint64_t>(replica) << kReplicaShift) ^ static_cast<uint64_t>(micro_batch);
}

// 3. Forward + backward of every micro-batch, the gradients accumulating; returns the global batch's loss.
double forward_backward(Run& r, const std::vector<PackedBatch>& batches, int64_t label_tokens) {
  r.ck.model->params().zero_grads();
  double loss = 0.0;
  for (size_t a = 0; a < batches.size(); ++a) {
    // LoRA dropout's masks: drawn anew for each step, replica and micro-batch, the same on the CP ranks of a row
    // (model/held_weight.h lora_dropout_keeps), and again the same when the step is run again after a resume.
    r.training.dropout_key = dropout_key(r.cfg.train.seed, r.state.step + 1, r.dp_index, a);
    loss += run_micro_batch(r, batches[a], label_tokens, true);
  }
  r.dp_group->allreduce(&loss, 1, comm::ReduceOp::Sum, r.timeout);
  return loss;
}

ExpertGroups expert_groups(Run& r) { return {r.world, *r.ep_group, *r.edp_group, r.timeout}; }

// 4a. Sums the gradients over every rank, in rank order (the same bits on every rank and backend), in place in the
// store's flat gradient arena: one collective for the whole model. Shard none: every rank gets the whole sum
// (all-reduce). Shard optimizer: each rank gets the sums of its slice (reduce-scatter, half the traffic), the only
// gradients its update reads. Shard gradients and full: reduced already, layer by layer, by the sharded store's
// hooks, into this rank's slice (sharded_store.h says what accumulation changes).
void reduce_gradients(Run& r) {
  // Held experts under shard optimizer: the experts' over their EDP group (gradients, full: reduced by the hooks).
  if (r.held && !r.store_shards) r.held->experts().reduce();
  if (r.world.size() == 1 || r.store_shards) return;
  if (r.hold_experts || r.hold_expert_adapters) {  // the experts' over their EDP group, the rest over the world
    reduce_held_expert_gradients(r.ck.model->params(), expert_groups(r));
    return;
  }
  const std::span<float> flat = r.ck.model->params().mutable_flat(model::Role::Grads);
  if (r.shard_optimizer)
    r.world.reduce_scatter(flat.data(), flat.size(), comm::ReduceOp::Sum, r.timeout);
  else
    r.world.allreduce(flat.data(), flat.size(), comm::ReduceOp::Sum, r.timeout);
}

// 4b. The global gradient norm, then clipping to optimizer.grad_clip; returns the norm before clipping. The sum of
// squares is taken as one partial sum per rank's slice (comm::slice_of over the world), added in rank order: the same
// bits whether a rank holds every reduced gradient (shard none: it computes all the partials) or its slice alone
// (shard optimizer: each computes its own, and they are gathered). One rank: the sum in order over the whole arena.
double clip_global_norm(Run& r, double max_norm) {
  model::ParamStore& store = r.ck.model->params();
  const std::span<float> flat = store.mutable_flat(model::Role::Grads);
  const int P = r.world.size(), me = r.world.rank();
  const auto slice = [&](int rank) {
    if (r.store_shards) return flat;  // the sharded store's gradients are this rank's slice alone
    const comm::Slice s = comm::slice_of(flat.size(), P, rank);
    return flat.subspan(s.begin, s.size());
  };
  std::vector<double> partial(static_cast<size_t>(P));
  if (r.hold_experts || r.hold_expert_adapters) {  // the same partials from the experts' holders (expert_state.h)
    partial = held_expert_norm_partials(store, expert_groups(r));
  } else if (r.held) {
    // Held experts under sharding: the same partials from the holders of the reduced slices (held_expert_store.h).
    partial = held_norm_partials(*r.held, slice(me), {r.world, *r.ep_group, *r.edp_group, r.timeout});
  } else if (r.shard_optimizer) {
    const double mine = sum_of_squares(slice(me));
    r.world.allgather(&mine, partial.data(), sizeof(double), r.timeout);
  } else {
    for (int rank = 0; rank < P; ++rank) partial[static_cast<size_t>(rank)] = sum_of_squares(slice(rank));
  }
  double sum = 0.0;
  for (double x : partial) sum += x;
  const double norm = std::sqrt(sum);
  if (std::isfinite(norm)) {
    const double factor = clip_factor(norm, max_norm);
    if (factor != 1.0) scale(r.shard_optimizer ? slice(me) : flat, factor);
    if (factor != 1.0 && r.held) scale(r.held->experts().own_grads(), factor);
  }
  return norm;
}

// parallelism.shard = optimizer, after the update: each rank updated its slice of the trainable parameters; every
// rank takes the others' (the same bits the whole update gives, so every replica holds the same weights again). The
// gradient arena, whose values are spent, carries them in the trainable layout: this rank's slice is copied in, one
// all-gather of slices fills the rest, and every trainable parameter is copied back.
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

// 4c. The AdamW update at `step`, the same on every replica; returns the learning rate it used.
double apply_update(Run& r, int64_t step) {
  const double lr = learning_rate(r.cfg.optimizer, r.cfg.schedule, static_cast<int>(step), r.cfg.train.steps);
  r.adam->step(r.ck.model->params(), lr, step);
  if (r.held) {  // the experts' slices, then every EDP rank's updated slice into every one's experts
    r.adam->step(r.held->experts(), lr, step);
    r.held->experts().gather_updated();
  }
  if (r.sharded)
    r.sharded->after_update();
  else if (r.shard_optimizer)
    gather_updated_weights(r.world, r.ck.model->params(), r.timeout);
  if (r.tower) {  // model.train_vision: the updated tower
    r.ck.model->refresh_vision_tower();
    r.tower = r.ck.model->vision_tower();
  }
  return lr;
}

// A non-finite loss or gradient (a diverging run, or NaN weights resumed from a damaged checkpoint) stops the run
// before the update, so neither the weights nor a checkpoint take it. Both figures are already the same bits on
// every rank (the loss summed over the CP group in the model and over DP, the norm taken from the reduced
// gradients), so every rank stops at the same step with the same line without another collective.
void check_finite_step(int64_t step, double loss, double norm, const std::string& last_checkpoint) {
  if (std::isfinite(loss) && std::isfinite(norm)) return;
  throw comm::AgreedError(rf::concat(
      "step ", step, ": the loss or the gradient is not finite (gradient norm ", norm,
      "): the run diverged (try a lower optimizer.lr) or its weights are not finite; stopped before the update",
      last_checkpoint.empty() ? "" : ", last checkpoint " + last_checkpoint));
}

// Validation: every row of the split, each DP replica running every dp-th row in micro-batches, the loss
// normalised by the label tokens of the whole split. The rows are read inside comm::agree (like a step's rows).
double validation_loss(Run& r) {
  const int dp = r.cfg.parallelism.dp;
  std::vector<PackedBatch> mine;
  std::vector<PackedBatch> filler;  // under expert parallelism or shard full: the split's first row (see below)
  const bool balanced = r.cfg.parallelism.ep > 1 || r.shard_full;
  int64_t labels = 0;
  comm::agree(r.world, [&] {
    std::vector<Row> rows;
    for (int j = 0; j < r.data->val_rows(); ++j) {
      Row row = r.data->val_row(j);
      labels += count_label_tokens(row.labels);
      if (j == 0 && balanced) filler.push_back(stack_rows({row}, r.feature_dim));
      if (j % dp == r.dp_index) rows.push_back(std::move(row));
    }
    const size_t micro = static_cast<size_t>(r.cfg.train.micro_batch);
    for (size_t at = 0; at < rows.size(); at += micro) {
      mine.push_back(
          stack_rows(std::vector<Row>(rows.begin() + static_cast<std::ptrdiff_t>(at),
                                      rows.begin() + static_cast<std::ptrdiff_t>(std::min(rows.size(), at + micro))),
                     r.feature_dim));
      r.ck.model->check_batch(as_batch(mine.back()), r.cfg.parallelism.cp, "validation rows");
    }
  });
  double loss = 0.0;
  for (const PackedBatch& b : mine) loss += run_micro_batch(r, b, labels, false);
  // Under expert parallelism every micro-batch is collective over the EP group, which spans DP replicas, and under
  // shard full every layer's gather spans all ranks: a replica with fewer rows (replica 0 has the most) runs its
  // first batch again, or the split's first row, its loss unused.
  if (balanced && r.data->val_rows() > 0) {
    const int64_t most_rows = (r.data->val_rows() + dp - 1) / dp;
    const int64_t most = (most_rows + r.cfg.train.micro_batch - 1) / r.cfg.train.micro_batch;
    const PackedBatch& again = mine.empty() ? filler.front() : mine.front();
    for (int64_t i = static_cast<int64_t>(mine.size()); i < most; ++i) run_micro_batch(r, again, labels, false);
  }
  r.dp_group->allreduce(&loss, 1, comm::ReduceOp::Sum, r.timeout);
  return loss;
}

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

bool is_last(const Run& r, int64_t step) { return step == r.cfg.train.steps; }

// The step's metrics, with validation on its steps, recorded in the loss history and the result. Throughput:
// the step's non-padding tokens over its wall time, validation excluded.
StepMetrics record_step(Run& r, int64_t step, double loss, double lr, double norm, const TokenCounts& tokens,
                        double step_seconds, const ExpertTraffic& ep_moved, TrainResult& result) {
  // The step's waits on the sharded store's collectives, taken before validation runs (whose are dropped).
  const double comm_wait = r.sharded ? r.sharded->take_exposed_seconds() : 0.0;
  StepMetrics sm;
  sm.step = step;
  sm.loss = loss;
  sm.lr = lr;
  sm.grad_norm = norm;
  sm.tokens = tokens.labels;
  sm.tokens_per_s = static_cast<double>(tokens.real) / step_seconds;
  if (r.tower) {  // before validation, whose forward runs the tower too
    double share = r.tower_seconds / step_seconds;
    r.world.allreduce(&share, 1, comm::ReduceOp::Max, r.timeout);
    sm.tower_share = share;
  }
  const bool validation_step = (r.cfg.train.val_every > 0 && step % r.cfg.train.val_every == 0) || is_last(r, step);
  if (r.data->val_rows() > 0 && validation_step) sm.val_loss = validation_loss(r);
  r.tower_seconds = 0.0;  // the next step's
  sm.peak_rss_bytes = peak_rss_bytes();
  r.world.allreduce(&sm.peak_rss_bytes, 1, comm::ReduceOp::Max, r.timeout);
  if (r.cfg.parallelism.ep > 1) {  // the step's routed rows (ep_moved: this rank's), the most of any rank
    const model::Gemma4Config& mc = r.ck.model->config();
    const int64_t moe_layers = mc.enable_moe ? mc.num_layers : 0;  // every decoder layer has the MoE block
    int64_t moved[3] = {ep_moved.rows_sent, ep_moved.rows_received,
                        ep_moved.bytes_sent / std::max<int64_t>(1, moe_layers)};
    r.world.allreduce(moved, 3, comm::ReduceOp::Max, r.timeout);
    double exposed = ep_moved.seconds;
    r.world.allreduce(&exposed, 1, comm::ReduceOp::Max, r.timeout);
    sm.ep_rows_sent = moved[0];
    sm.ep_rows_received = moved[1];
    sm.ep_bytes_per_layer = moved[2];
    sm.ep_exposed_s = exposed;
    sm.ep_experts_held = r.hold_experts || r.held ? mc.num_experts / r.cfg.parallelism.ep : mc.num_experts;
  }
  if (r.sharded) {
    double most = comm_wait;
    r.world.allreduce(&most, 1, comm::ReduceOp::Max, r.timeout);
    sm.shard_comm_wait_s = most;
    r.sharded->take_exposed_seconds();  // validation's
  }
  r.state.history.steps.push_back(static_cast<int>(step));
  r.state.history.loss.push_back(loss);
  if (sm.val_loss) {
    r.state.history.val_steps.push_back(static_cast<int>(step));
    r.state.history.val_loss.push_back(*sm.val_loss);
  }
  result.steps.push_back(sm);
  return sm;
}

// While it lives, the model holds `whole` (a whole-layout store for the writer; null: nothing changes) in place of
// its held experts' store, which it gets back on every path.
class HeldExpertsWhole {
 public:
  HeldExpertsWhole(model::Gemma4Multimodal& m, std::unique_ptr<model::ParamStore> whole) : m_(m) {
    if (whole) held_ = m_.replace_params(std::move(whole));
  }
  ~HeldExpertsWhole() {
    if (held_) m_.replace_params(std::move(held_));
  }
  HeldExpertsWhole(const HeldExpertsWhole&) = delete;
  HeldExpertsWhole& operator=(const HeldExpertsWhole&) = delete;

 private:
  model::Gemma4Multimodal& m_;
  std::unique_ptr<model::ParamStore> held_;
};

// The checkpoint of the current step, every rank writing its part, then the loss picture. Rank 0 made the
// temporary directory (`pending`, in the agreement before) and writes the weights, each tensor read from the store
// only while it is written (a collective read when the weights are sharded: the other ranks take part in each);
// every rank writes its own moments when they are sharded, rank 0 all of them otherwise; rank 0 then renames the
// directory into place. Each part ends in an agreement, so a failure on any rank (a full disk, a file-size limit)
// ends every rank with its one line, and rank 0's `pending` removes the temporary directory as the error unwinds.
void save(Run& r, std::optional<PendingCheckpoint>& pending, comm::Timeout wait, Progress& progress,
          TrainResult& result) {
  const CheckpointSection& cfg = r.cfg.checkpoint;
  const std::string tmp = checkpoint_temp_path(cfg.dir, r.state.step);
  // Held experts (shard none): the writer's EP group gathers every expert's rows into the writer's whole-layout
  // store, which stands in the model while it saves (expert_state.h).
  std::unique_ptr<model::ParamStore> whole;
  if (r.hold_experts && r.world.rank() < r.cfg.parallelism.ep)
    whole = gather_held_experts(r.ck.model->params(), expert_groups(r));
  if (r.hold_expert_adapters && r.world.rank() < r.cfg.parallelism.ep)  // LoRA: the adapters whole, the base unread
    whole = gather_held_adapters(dynamic_cast<const model::LoraStore&>(r.ck.model->params()), expert_groups(r));
  if (r.held)  // under sharding too, every rank taking part (held_expert_store.h)
    whole = whole_for_writer(*r.held, {r.world, *r.ep_group, *r.edp_group, r.timeout});
  const HeldExpertsWhole while_saving(*r.ck.model, r.lead ? std::move(whole) : nullptr);
  const model::ParamStore& store = r.ck.model->params();
  std::exception_ptr failed;
  try {
    if (const auto* lora = dynamic_cast<const model::LoraStore*>(&store)) {
      // A LoRA run's weights are its adapters, in PEFT's files; the frozen base stays where model.path has it.
      if (r.lead) model::save_peft_adapter(*lora, r.ck.text_prefix, r.ck.source, tmp);
    } else if (r.lead || (r.shard_full && !r.held)) {
      // The other ranks take part in the reads only where they are collective (held experts: the writer's copy).
      model::save_checkpoint(r.ck, tmp, {max_shard_bytes(cfg), r.lead});
    }
  } catch (...) {
    failed = std::current_exception();  // save_checkpoint took part in every read before it threw
  }
  comm::agree(
      r.world,
      [&] {
        if (failed) std::rethrow_exception(failed);
      },
      wait);
  comm::agree(
      r.world,
      [&] {
        if (r.shard_optimizer && !r.held)
          write_moments_shard(tmp, store, r.world.rank(), r.world.size());
        else if (r.lead)
          write_moments_whole(tmp, store);
      },
      wait);
  PendingCheckpoint::MomentLayout moments;
  if (r.shard_optimizer && !r.held) {  // every rank's range, as its store holds it
    moments.shard_mode = name_of(r.cfg.parallelism.shard);
    const model::Shard mine = store.moment_range();
    const int64_t range[2] = {mine.begin, mine.end};
    std::vector<int64_t> all(2 * static_cast<size_t>(r.world.size()));
    r.world.allgather(range, all.data(), sizeof range, r.timeout);
    for (int k = 0; k < r.world.size(); ++k) moments.ranges.emplace_back(all[2 * k], all[2 * k + 1]);
  }
  comm::agree(
      r.world,
      [&] {
        if (!r.lead) return;
        result.last_checkpoint = pending->finish(store, r.state, moments, cfg.keep, r.options.before_checkpoint_rename);
        pending.reset();
        if (!result.svg_path.empty())
          io::write_file_atomically(result.svg_path, loss_svg(r.state.history, "ringflex train"));
        progress.note(rf::concat("step ", r.state.step, ": checkpoint ", result.last_checkpoint));
      },
      wait);
  result.last_checkpoint = checkpoint_path(cfg.dir, r.state.step);  // known to every rank
}

// The step's outputs: the metrics line and the progress, written by rank 0 in one agreement (a failed write ends
// every rank together, with its line), and on checkpoint steps (every checkpoint.every and the last) the checkpoint
// and the picture.
void publish_step(Run& r, const StepMetrics& sm, double eta_s, std::optional<MetricsFile>& metrics, Progress& progress,
                  TrainResult& result) {
  const CheckpointSection& ck = r.cfg.checkpoint;
  const bool save_now = !ck.dir.empty() && ((ck.every > 0 && sm.step % ck.every == 0) || is_last(r, sm.step));
  std::optional<PendingCheckpoint> pending;  // rank 0's, while the ranks write the checkpoint
  comm::agree(r.world, [&] {
    if (metrics) metrics->append(metrics_json_line(sm));
    progress.step(sm, eta_s, is_last(r, sm.step) || sm.val_loss.has_value());
    if (sm.val_loss) progress.note(rf::concat("step ", sm.step, ": validation loss ", *sm.val_loss));
    if (save_now && r.lead) pending.emplace(ck.dir, sm.step);
  });
  if (!save_now) return;
  // A save is waited for as long as its bytes take at the slowest write rate, beyond --timeout: only a rank that is
  // gone or silent ends the job the hard way.
  save(r, pending, save_wait(r.timeout, checkpoint_bytes(r.ck), r.options.slowest_checkpoint_write), progress, result);
}

// --stats: the memory check's terms for this run (per rank: every rank's figure is the same, shards being padded)
// beside every rank's measured peak RSS (a collective), written by rank 0 in one agreement.
void write_stats(Run& r, const std::string& path) {
  // Held experts: the check counts from the whole registry (the held store registers a rank's experts only).
  std::unique_ptr<model::ParamStore> shapes;
  if (r.hold_experts || r.held) shapes = model::whole_registry(r.ck.model->params());
  MemoryBreakdown need;
  {
    const HeldExpertsWhole while_counting(*r.ck.model, std::move(shapes));
    need = train_memory_at_least(r.cfg, *r.ck.model, r.world.size());
  }
  const int64_t mine = peak_rss_bytes();
  std::vector<int64_t> peaks(static_cast<size_t>(r.world.size()));
  r.world.allgather(&mine, peaks.data(), sizeof mine, r.timeout);
  comm::agree(r.world, [&] {
    if (!r.lead) return;
    nlohmann::json terms = nlohmann::json::array();
    for (const MemoryBreakdown::Term& t : need.terms()) terms.push_back({{"kind", t.name}, {"bytes", t.bytes}});
    const nlohmann::json j = {{"shard", name_of(r.cfg.parallelism.shard)},
                              {"ranks", r.world.size()},
                              {"ep", r.cfg.parallelism.ep},
                              {"memory_per_rank", {{"terms", terms}, {"total_bytes", need.total()}}},
                              {"peak_rss_bytes", peaks}};
    io::write_file_atomically(path, j.dump(2) + "\n");
  });
}

}  // namespace

comm::Timeout save_wait(comm::Timeout timeout, int64_t bytes, double bytes_per_s) {
  RF_CHECK(bytes >= 0 && bytes_per_s > 0, "save_wait: ", bytes, " bytes at ", bytes_per_s, " bytes/s");
  constexpr double kMsPerS = 1000.0;
  // Capped far beyond any job (a year), so that the sum cannot overflow the milliseconds' integer.
  constexpr double kLongestMs = 365.0 * 24 * 3600 * kMsPerS;
  const double write_ms = std::min(static_cast<double>(bytes) / bytes_per_s * kMsPerS, kLongestMs);
  return timeout + comm::Timeout(static_cast<int64_t>(std::ceil(write_ms)));
}

TrainResult train(const TrainConfig& cfg, comm::Communicator& world, const TrainOptions& options) {
  RF_CHECK(world.size() == cfg.parallelism.cp * cfg.parallelism.dp,
           "parallelism.cp * parallelism.dp = ", cfg.parallelism.cp * cfg.parallelism.dp, " but the job has ",
           world.size(), " rank(s)");
  if (cfg.train.threads > 0) omp_set_num_threads(cfg.train.threads);
  Run r(cfg, world, options);
  join_groups(r);
  comm::agree(world, [&] { set_up(r); });
  // Each rank encoded its share of the data's images (ImageContract): now that every rank has read the data, all
  // of them get every image's soft tokens. A collective, so outside the setup, where a rank may have failed alone.
  if (world.size() > 1)
    r.data->sum_image_features(
        [&](std::vector<float>& v) { world.allreduce(v.data(), v.size(), comm::ReduceOp::Sum, r.timeout); });

  TrainResult result;
  result.svg_path = default_svg_path(cfg, options);
  // Rank 0's metrics file, closed on every path; opening it is part of the agreement. A resume keeps the lines of
  // the steps its checkpoint holds.
  std::optional<MetricsFile> metrics;
  comm::agree(world, [&] {
    if (r.lead && !options.metrics_path.empty()) metrics.emplace(options.metrics_path, r.state.step);
  });
  Progress progress(r.lead ? options.progress : nullptr, cfg.train.steps, cfg.train.log_every);
  if (r.lead) announce(r, progress);

  const auto run_start = Clock::now();
  const int64_t first_step = r.state.step + 1;
  for (int64_t step = first_step; step <= cfg.train.steps; ++step) {
    const auto step_start = Clock::now();
    std::vector<PackedBatch> batches;
    comm::agree(world, [&] { batches = replica_micro_batches(r); });
    const TokenCounts tokens = count_tokens(r, batches);
    const ExpertTraffic ep_before = r.context.model->experts().traffic();
    const double loss = forward_backward(r, batches, tokens.labels);
    const ExpertTraffic ep_after = r.context.model->experts().traffic();
    reduce_gradients(r);
    const double norm = clip_global_norm(r, cfg.optimizer.grad_clip);
    check_finite_step(step, loss, norm, result.last_checkpoint);
    const double lr = apply_update(r, step);
    r.state.step = step;
    r.state.data_position += cfg.train.global_batch;

    const StepMetrics sm =
        record_step(r, step, loss, lr, norm, tokens, seconds_since(step_start),
                    {ep_after.rows_sent - ep_before.rows_sent, ep_after.rows_received - ep_before.rows_received,
                     ep_after.bytes_sent - ep_before.bytes_sent, ep_after.seconds - ep_before.seconds},
                    result);
    const double eta = seconds_since(run_start) / static_cast<double>(step - first_step + 1) *
                       static_cast<double>(cfg.train.steps - step);
    publish_step(r, sm, eta, metrics, progress, result);
  }
  comm::agree(world, [&] {
    if (metrics) metrics->close();
    if (r.lead && !result.svg_path.empty()) {
      io::write_file_atomically(result.svg_path, loss_svg(r.state.history, "ringflex train"));
      progress.note("loss picture: " + result.svg_path);
    }
    if (r.lead && !result.last_checkpoint.empty()) progress.note("checkpoint: " + result.last_checkpoint);
  });
  if (!options.stats_path.empty()) write_stats(r, options.stats_path);
  if (r.sharded && options.whole_model) r.sharded->unshard();  // whole weights for the caller (every rank)
  result.model = std::move(r.ck.model);
  return result;
}

}  // namespace rf::trainer
