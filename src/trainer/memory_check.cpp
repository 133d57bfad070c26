// ringflex trainer: the memory check before anything is allocated, train_memory_at_least (trainer.h).
#include <omp.h>

#include <filesystem>

#include "core/error.h"
#include "core/memory.h"
#include "io/checkpoint.h"
#include "model/expert_store.h"
#include "model/lora_store.h"
#include "model/memory.h"
#include "model/vision_encoder.h"
#include "trainer/held_expert_store.h"
#include "trainer/run.h"
#include "trainer/runtime_memory.h"
#include "trainer/sharded_store.h"
#include "trainer/trainer.h"

namespace rf::trainer {

namespace fs = std::filesystem;

namespace detail {

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

}  // namespace detail

using detail::lora_config;

namespace {

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

// Terms, each counting buffers train() surely holds through a step (float32 unless said):
//   weights          the parameters (and buffers), Gemma4Multimodal::params()/buffers(); with model.param_dtype =
//                    bfloat16 under shard optimizer or gradients the float32 masters of this rank's slice instead
//                    (ShardedStore::master_bytes_for), beside the bf16 working weights below;
//   bf16 copies      with model.compute_dtype = bfloat16, the matrices' bf16 copies (the model's bf16_weight_bytes);
//                    with model.param_dtype = bfloat16 the bf16 working weights instead
//                    (ShardedStore::working_bytes_for);
//   gradients        the parameter store's gradient arena: the trainable parameters only;
//   AdamW moments    exp_avg and exp_avg_sq, two more such arenas;
//   the step's rows  this replica's global_batch / dp rows of seq_len tokens, five int32 arrays each (their image
//                    features not counted), built before the step's micro-batches run;
//   validation rows  this replica's share of data.val_rows (every dp-th row), the same arrays, which validate_now
//                    builds all at once while the step's rows are still held;
//   then the larger of what one micro-batch's run holds (model::run_memory_at_least: train.micro_batch rows of
//   ceil(seq_len / cp) tokens, a shard is never shorter, with train.recompute: "activations", "one layer" or
//   "loss chunk"). The gradient reduction runs in place over the gradient arena (the communicator's own slices of at
//   most comm::Communicator::kReduceSliceBytes not counted);
//   vision tower activations  with model.train_vision, the tower's tape (VisionEncoder::tape_bytes), alive from its
//                    forward through the decoder's run to its own backward: every layer's activations, or with
//                    train.recompute each layer's input only; for one image of the data's P = soft tokens x k^2
//                    patches (the mock's drawings of data.mock_image_tokens, a file's image padded to
//                    data.image_soft_tokens'), the fewest a step that trains the tower on images hands some rank;
//   runtime baseline the rank's resident set when the first check ran, before the run allocated its state (its
//                    libraries, MPI's segments, the start-up heap: trainer/runtime_memory.h);
//   OpenBLAS packing buffers  128 MiB for each of the rank's threads (trainer/runtime_memory.h).
// Left out, so the figure stays a lower bound: the ring's receive buffers (what a rank receives depends on each
// batch's documents; packed short documents need almost none), the data set's packed rows, the plan, the
// checkpoint writer's copies, validation's forward (smaller than the training step's), and the staging of the bf16
// working weights' gather after an update (one group's trainable elements at 2 bytes, held after the step's
// activations are freed).
MemoryBreakdown train_memory_at_least(const TrainConfig& c, const model::Gemma4Multimodal& m, int world_size) {
  int64_t params = m.params().weight_bytes();
  int64_t trainable_bytes = 0;
  MemoryBreakdown lora_base;
  int64_t lora_layer_bytes = 0, lora_head_bytes = 0;  // widened for a phase of the run (RunMemoryArgs)
  if (c.model.lora_rank > 0) {
    // LoRA: the adapters train (their weights, gradients and moments), the base is frozen.
    const std::vector<model::LoraTarget> targets = model::lora_targets(m.params(), lora_config(c));
    // Expert parallelism (shard none or optimizer): each rank's experts' adapters only (LoraStore::place_experts).
    trainable_bytes = model::lora_adapter_bytes(targets, c.model.lora_rank, c.parallelism.ep);
    const int64_t mapped = mapped_base_bytes(c, m.params());
    if (mapped >= 0) {
      // The base stays in the files' dtype, mapped: the page cache holds one copy for every rank of this machine
      // (each maps the same files), counted here as this rank's share of the machine, as available_memory_bytes()
      // counts the machine. What the hooks widen to float32: the global group's other matmul operands for the whole
      // run; one layer's base while a layer runs; and the loss's panel of the head (the run's phases, below).
      params = trainable_bytes;
      const int ranks_here = local_ranks();
      lora_base.add(rf::concat("LoRA base, mapped (shared by the ", ranks_here, " ranks of this machine)"),
                    (mapped + ranks_here - 1) / ranks_here);
      lora_base.add("LoRA: the global base widened", model::lora_global_buffer_bytes(m.params()));
      lora_layer_bytes = model::lora_layer_buffer_bytes(m.params());
      lora_head_bytes = model::lora_head_buffer_bytes(m.params());
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
    // The tables' rows: every rank's micro-batch's tokens (the CP group's ranks share rows), as below.
    const int64_t step_tokens = int64_t{c.train.micro_batch} * c.train.seq_len * c.parallelism.dp;
    const HeldBytes b =
        held_expert_bytes(m.params(), m.params().trainable_after(c.model.freeze), full,
                          c.parallelism.shard == ShardMode::Gradients, world_size, c.parallelism.ep, step_tokens);
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
  } else if (full || c.parallelism.shard == ShardMode::Gradients) {
    // The sharded store's state by kind (ShardedStore::bytes_for says what each holds; LoRA is none or optimizer).
    // The tables' rows: every rank's micro-batch's tokens (the CP group's ranks share rows).
    const int64_t step_tokens = int64_t{c.train.micro_batch} * c.train.seq_len * c.parallelism.dp;
    // A rank reads the rows of its own tokens (a cp-th of each of its micro-batch's rows) from the other tables.
    const int64_t rank_tokens =
        int64_t{c.train.micro_batch} * ((c.train.seq_len + c.parallelism.cp - 1) / c.parallelism.cp);
    const ShardedStore::Bytes b =
        ShardedStore::bytes_for(m.params(), m.params().trainable_after(c.model.freeze),
                                full ? ShardedStore::Mode::Full : ShardedStore::Mode::Gradients, world_size,
                                step_tokens, rank_tokens);
    // Under gradients with bf16 working weights the float32 masters are sharded as under full.
    const bool bf16_masters = !full && c.model.param_dtype == model::ParamDtype::Bfloat16;
    const int64_t masters =
        bf16_masters
            ? ShardedStore::master_bytes_for(m.params(), m.params().trainable_after(c.model.freeze), world_size)
            : b.weight_shard;
    need.add(full           ? "weight shard"
             : bf16_masters ? "float32 masters (this rank's slice)"
                            : "weights",
             masters + m.buffers().total_bytes());
    need.add(full ? "gathered weights" : "the tables' rows", b.gathered);
    need.add("gradients", b.gradients);
    need.add("AdamW moments", b.moments);
    need.add("communication buffers", b.comm_buffers);
    if (c.model.param_dtype == model::ParamDtype::Bfloat16)
      need.add("bf16 working weights", ShardedStore::working_bytes_for(m.params(), full ? b.gathered : -1));
    else if (c.model.compute_dtype == model::ComputeDtype::Bfloat16)
      need.add("bf16 weight copies",
               full ? b.gathered / static_cast<int64_t>(sizeof(float) / sizeof(bf16)) : m.bf16_weight_bytes());
  } else {                       // shard none or optimizer: replicated weights and gradients
    constexpr int kMoments = 2;  // exp_avg, exp_avg_sq
    // Expert parallelism holding each rank's experts only (shard none, no LoRA; trainer/expert_state.h): the experts'
    // weights, gradients, moments and bf16 copies are E / ep experts' worth. (A load reads a rank's rows alone and a
    // save gathers one tensor at a time on rank 0, trainer/held_checkpoint.h: no whole copy, as for the other
    // transients one tensor is not counted.)
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
    // Shard optimizer with bf16 working weights: a ShardedStore keeps this rank's slice of the float32 masters.
    if (c.parallelism.shard == ShardMode::Optimizer && c.model.param_dtype == model::ParamDtype::Bfloat16)
      need.add("float32 masters (this rank's slice)",
               ShardedStore::master_bytes_for(m.params(), m.params().trainable_after(c.model.freeze), world_size) +
                   m.buffers().total_bytes());
    else
      need.add("weights", params + m.buffers().total_bytes());
    need.add("gradients", trainable_bytes);
    need.add(lora_base);
    // parallelism.shard = optimizer: a rank holds the moments of its shard, ceil(trainable / N) elements; LoRA with
    // its experts' adapters placed, of its EDP slice (N / ep ranks) of its held adapters (trainer/expert_state.h).
    const int64_t trainable_elements = trainable_bytes / static_cast<int64_t>(sizeof(float));
    const bool adapters_placed = c.model.lora_rank > 0 && !c.model.lora_target_parameters.empty();
    const int moment_ranks = adapters_placed ? world_size / c.parallelism.ep : world_size;
    const int64_t moment_elements = c.parallelism.shard == ShardMode::Optimizer
                                        ? model::shard_of(trainable_elements, 0, moment_ranks).padded
                                        : trainable_elements;
    need.add("AdamW moments", checked_bytes({kMoments, moment_elements, static_cast<int64_t>(sizeof(float))}));
    // (A LoRA base has none: the matmuls read a bf16 base as it is mapped, and round another per call.)
    if (c.model.param_dtype == model::ParamDtype::Bfloat16)
      need.add("bf16 working weights", ShardedStore::working_bytes_for(m.params(), -1));
    else if (c.model.compute_dtype == model::ComputeDtype::Bfloat16 && c.model.lora_rank == 0)
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
  run.keep_o_proj_output = c.train.keep_o_proj;
  run.keep_down_proj_output = c.train.keep_down_proj;
  run.layer_weight_bytes = lora_layer_bytes;
  run.head_weight_bytes = lora_head_bytes;
  need.add(model::run_memory_at_least(m.decoder(), run));
  if (c.model.train_vision && m.parts().vision) {
    const model::VisionConfig& vc = *m.parts().vision;
    const int64_t soft_tokens = c.data.source == SourceKind::Mock ? c.data.mock_image_tokens : c.data.image_soft_tokens;
    const int64_t patches = checked_bytes({soft_tokens, vc.pooling_kernel_size, vc.pooling_kernel_size});
    need.add(kVisionActivations, model::VisionEncoder::tape_bytes(vc, 1, patches, c.train.recompute));
  }
  need.add(kRuntimeBaseline, runtime_baseline_bytes());
  need.add(kBlasBuffers, blas_buffer_bytes(c.train.threads > 0 ? c.train.threads : omp_get_max_threads()));
  return need;
}

}  // namespace rf::trainer
