// ringflex trainer: the training loop — Gemma 4 fine-tuning over a cp x dp grid of ranks.
//
// Ranks: N = cp * dp, world rank r = dp_index * cp + cp_index. The CP group (same dp_index) runs one row split
// over its ranks; the DP group (same cp_index) splits the global batch. Weights and optimizer state are
// replicated. One optimizer step:
//   1. DP replica d takes rows [pos + d * G/dp, pos + (d + 1) * G/dp) of the training stream (G = train.global_batch,
//      pos = the data position), in micro-batches of train.micro_batch rows (gradient accumulation fills G/dp);
//   2. the global batch's label tokens are counted once: each replica counts its rows and one int64 all-reduce
//      over DP sums them (never over CP: CP ranks hold the same rows, so summing there would count them cp times);
//   3. every micro-batch runs forward + backward with that count as the loss's denominator, accumulating
//      gradients, so the summed gradient is that of loss = (sum of token losses over the global batch) /
//      (label tokens of the global batch) — the same loss at any cp x dp;
//   4. gradients are summed over all N ranks in world-rank order (deterministic), the global norm is clipped,
//      AdamW updates every replica identically.
// Every G rows the data position advances by G, so a run at any cp x dp sees the same rows at the same step.
//
// train() (trainer.cpp) reads as this plan: set_up (set_up.cpp: model, data, optimizer state; checked on every rank
// before any step, against train_memory_at_least, memory_check.cpp), then per step (step.cpp) replica_micro_batches
// (1), count_tokens (2), forward_backward (3), reduce_gradients, clip_global_norm and apply_update (4), then
// record_step (the metrics, validation_loss) and publish_step (the metrics line, progress, save) in trainer.cpp. The
// state these share, one rank's Run, is in trainer/run.h. Every step that can fail on some ranks only (reading and
// checking rows, rank 0's writes) runs inside comm::agree, so it fails every rank together with one line naming the
// rank.
#pragma once

#include <cstdio>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/memory.h"
#include "model/checkpoint.h"
#include "trainer/config.h"
#include "trainer/metrics.h"

namespace rf::trainer {

// The slowest rate a checkpoint is taken to be written at, in bytes per second (a busy network file system or a
// USB disk writes faster). While rank 0 writes a checkpoint the other ranks wait for it --timeout plus the
// checkpoint's bytes at this rate (save_wait), so a long save of a large model is not taken for a silent rank; a
// rank that is gone still ends the job at once (mpirun stops the others), one that is stopped within that wait.
constexpr double kSlowestCheckpointWrite = 16.0 * 1024 * 1024;

struct TrainOptions {
  std::string resume;            // a checkpoint directory or a checkpoint root (its newest); empty: start fresh
  std::string metrics_path;      // JSONL, one object per optimizer step (rank 0 writes; a resume keeps the lines of
                                 // the checkpoint's steps and continues); empty: none
  std::string svg_path;          // the loss picture (end of run and every checkpoint); empty: <checkpoint.dir>/loss.svg
  std::FILE* progress = stdout;  // rank 0's progress lines; nullptr: silent
  // --stats: rank 0 writes, at the end of the run, the memory check's per-rank bytes by kind for the run's shard mode
  // (train_memory_at_least's terms) and every rank's measured peak RSS, as JSON; empty: none
  std::string stats_path;
  // Runs inside a checkpoint save after its files are written, before the rename (tests fail a save there, or
  // make it slow).
  std::function<void(const std::string&)> before_checkpoint_rename;
  // Bytes per second a checkpoint write is waited for at (kSlowestCheckpointWrite; tests change it).
  double slowest_checkpoint_write = kSlowestCheckpointWrite;
  // TrainResult::model holds whole weights. Under parallelism.shard = full every rank gathers them at the end (a
  // collective, one whole copy per rank); false leaves each rank its pieces (the CLI, which does not read them).
  bool whole_model = true;
  // The bytes each of the sharded store's reductions may receive into at once (ShardedStore::set_reduce_budget; tests
  // make it small so that a tiny model's reductions take many rounds).
  size_t shard_reduce_budget = comm::Communicator::kReduceSliceBytes;
};

// How long the other ranks wait for a checkpoint save of `bytes` written at `bytes_per_s` at the slowest:
// `timeout` (the job's --timeout) plus the bytes at that rate.
comm::Timeout save_wait(comm::Timeout timeout, int64_t bytes, double bytes_per_s);

struct TrainResult {
  std::vector<StepMetrics> steps;  // the steps this call ran
  std::unique_ptr<model::Gemma4Multimodal> model;
  std::string last_checkpoint;  // empty when none was written (the same on every rank)
  std::string svg_path;
};

// What training needs per rank at least, known before any of it is allocated (`m`'s parameters may be shapes only;
// its registry is the model's own, no LoRA adapters in it, as set_up and `ringflex train --plan` pass it):
// named terms (core/memory.h) from memory_check.cpp, where each is derived. train() checks it against the machine on
// every rank before it allocates the weights, and the error names the biggest terms.
// `ranks_on_node`: the job's ranks on each machine (local_ranks(): this job's, as mpirun placed them).
// `sample_prompt_tokens`: the train.samples prompts' lengths (prompt_lengths in samples.h), whose generation's
// KV cache and buffers it counts (samples_memory_at_least); empty without samples.
MemoryBreakdown train_memory_at_least(const TrainConfig& config, const model::Gemma4Multimodal& m, int world_size,
                                      int ranks_on_node = local_ranks(),
                                      std::span<const int64_t> sample_prompt_tokens = {});
// `c` with the recompute fields it leaves at auto (TrainSection::automatic) chosen: of the settings below, most kept
// first, the first whose train_memory_at_least (over `m`, `world_size`, `ranks_on_node`, `sample_prompt_tokens`, as
// there) fits 95% of `budget` bytes a rank, else the last, which the memory check then passes or refuses as for a
// config that set it.
//   1. no recompute (every layer's activations kept: the backward redoes no product);
//   2. recompute, keeping the MLP's gate/up projections, the o_proj and the down_proj outputs;
//   3. keeping the o_proj and down_proj outputs (what the fields read as until chosen);
//   4. keeping the down_proj output;  5. keeping neither.
// A product's output is kept before another's where it saves more work a byte: down_proj's [T, H] saves I
// multiply-adds a float, o_proj's Hq*D, the MLP's [T, 2I] H. The fields the config sets stay as set (a keep_* set
// false rules out 1: it asks for that product's recompute); with train.spill_dir only the recomputing settings, and
// with it or train.tile_mlp the MLP's projections are never kept by choice (the spill file's disk traffic, the tile's
// point). The 5% is headroom for what the check leaves out (it is a lower bound, measured within ~1% of real
// peaks), so that keeping more does not take a run to the edge that recomputing would have cleared.
TrainConfig choose_recompute(const TrainConfig& c, const model::Gemma4Multimodal& m, int world_size, int ranks_on_node,
                             std::span<const int64_t> sample_prompt_tokens, int64_t budget);
// One line for the run's announcement: what the backward recomputes, and "(auto)" where the config left it to
// choose_recompute, e.g. "recompute: each layer in the backward, keeping its o_proj and down_proj outputs (auto)".
std::string describe_recompute(const TrainConfig& c);

// What the train.samples generation of prompts of `prompt_tokens` tokens holds on a rank after a step, its terms named
// "train.samples' ..." (model::generate_memory_at_least's: "train.samples' KV cache", the runs' buffers); empty
// without prompts.
MemoryBreakdown samples_memory_at_least(const TrainConfig& config, const model::Gemma4Multimodal& m,
                                        std::span<const int64_t> prompt_tokens);
inline constexpr const char* kSamplesTerm = "train.samples' ";
// The disk one micro-batch's spill file takes per rank with train.spill_dir (model::run_spill_bytes; 0 without):
// train() checks it against the directory's free space (core/memory.h check_disk) beside the memory.
int64_t train_spill_bytes(const TrainConfig& config, const model::Gemma4Multimodal& m);
// The term of train_memory_at_least that counts a trained vision tower's tape (model.train_vision).
inline constexpr const char* kVisionActivations = "vision tower activations (one image)";

// Runs the configured training on `world` (every rank calls it). The config must have passed validate().
TrainResult train(const TrainConfig& config, comm::Communicator& world, const TrainOptions& options);

}  // namespace rf::trainer
