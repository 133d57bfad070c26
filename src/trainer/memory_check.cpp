// ringflex trainer: the memory check before anything is allocated, train_memory_at_least (trainer.h).
#include <omp.h>

#include "core/error.h"
#include "core/memory.h"
#include "model/gemma4.h"
#include "model/generate.h"
#include "model/memory.h"
#include "model/vision_encoder.h"
#include "trainer/runtime_memory.h"
#include "trainer/state/state.h"
#include "trainer/trainer.h"

namespace rf::trainer {

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
//   train.samples    with samples, what their generation holds after a step (model::generate_memory_at_least,
//                    the function `ringflex generate` checks with): every prompt's KV cache with
//                    train.samples.max_new_tokens, the prompts decoded together, in the attention's dtype, as the
//                    CP ranks share it (the last CP rank's share, the smallest: ranks before it may hold one decoded
//                    position more), and the larger of the longest prefill's run and a decode step's; they run after
//                    the step's activations are freed, so the larger of the two counts, not both;
//   runtime baseline the rank's resident set when the first check ran, before the run allocated its state (its
//                    libraries, MPI's segments, the start-up heap: trainer/runtime_memory.h);
//   OpenBLAS packing buffers  128 MiB for each of the rank's threads (trainer/runtime_memory.h).
// Left out, so the figure stays a lower bound: the ring's receive buffers (what a rank receives depends on each
// batch's documents; packed short documents need almost none), the data set's packed rows, the plan, the
// checkpoint writer's copies, validation's forward (smaller than the training step's), and the staging of the bf16
// working weights' gather after an update (one group's trainable elements at 2 bytes, held after the step's
// activations are freed).
namespace {

// One micro-batch's decoder run on a rank: train.micro_batch rows of ceil(seq_len / cp) tokens (a shard is never
// shorter), in the config's recompute mode.
model::RunMemoryArgs micro_batch_run(const TrainConfig& c) {
  const int64_t L = (int64_t{c.train.seq_len} + c.parallelism.cp - 1) / c.parallelism.cp;
  model::RunMemoryArgs run;
  run.tokens = int64_t{c.train.micro_batch} * L;
  run.training = true;
  run.recompute_layers = c.train.recompute;
  run.keep_mlp_projections = c.train.keep_mlp;
  run.keep_o_proj_output = c.train.keep_o_proj;
  run.keep_down_proj_output = c.train.keep_down_proj;
  run.spill = !c.train.spill_dir.empty();
  run.mlp_tile_tokens = c.train.mlp_tile_tokens;
  run.tile_mlp = c.train.tile_mlp;
  return run;
}

}  // namespace

int64_t train_spill_bytes(const TrainConfig& c, const model::Gemma4Multimodal& m) {
  return model::run_spill_bytes(m.decoder(), micro_batch_run(c));
}

MemoryBreakdown samples_memory_at_least(const TrainConfig& c, const model::Gemma4Multimodal& m,
                                        std::span<const int64_t> prompt_tokens) {
  MemoryBreakdown named;
  if (prompt_tokens.empty()) return named;
  const int cp = c.parallelism.cp;
  const MemoryBreakdown need =
      model::generate_memory_at_least(m.decoder(), prompt_tokens, c.train.samples_max_new_tokens, cp, cp - 1,
                                      model::attention_dtype(c.model.compute_dtype));
  for (const MemoryBreakdown::Term& t : need.terms()) named.add(kSamplesTerm + t.name, t.bytes);
  return named;
}

MemoryBreakdown train_memory_at_least(const TrainConfig& c, const model::Gemma4Multimodal& m, int world_size,
                                      int ranks_on_node, std::span<const int64_t> sample_prompt_tokens) {
  // The training state's terms (trainer/state/: what each mode holds of the weights, gradients and moments).
  const detail::StateBytes state = detail::plan_state(c)->bytes(c, m, world_size, ranks_on_node);
  MemoryBreakdown need = state.terms;
  // A step builds all of this replica's rows before its micro-batches run: five int32 arrays a token (ids, labels,
  // positions, documents, image slots); image features not counted.
  constexpr int64_t kRowArrays = 5;
  need.add("the step's rows", checked_bytes({c.global_batch_per_replica(), c.train.seq_len,
                                             kRowArrays * static_cast<int64_t>(sizeof(int32_t))}));
  const int64_t val_rows_here = (int64_t{c.data.val_rows} + c.parallelism.dp - 1) / c.parallelism.dp;
  need.add("validation rows (data.val_rows)",
           checked_bytes({val_rows_here, c.train.seq_len, kRowArrays * static_cast<int64_t>(sizeof(int32_t))}));
  model::RunMemoryArgs run = micro_batch_run(c);
  run.layer_weight_bytes = state.layer_weight_bytes;
  run.head_weight_bytes = state.head_weight_bytes;
  const MemoryBreakdown step_run = model::run_memory_at_least(m.decoder(), run);
  const MemoryBreakdown samples = samples_memory_at_least(c, m, sample_prompt_tokens);
  need.add(samples.total() > step_run.total() || samples.total() < 0 ? samples : step_run);
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
