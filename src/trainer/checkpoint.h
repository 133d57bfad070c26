// ringflex trainer: training checkpoints — atomic directories, resume, keep-last-K.
//
// A checkpoint is `<checkpoint.dir>/step-NNNNNNNN/` holding
//   config.json, model.safetensors   the weights in the Hugging Face layout (transformers' from_pretrained and
//                                    `ringflex forward --model` load them as they are);
//   optimizer.safetensors            AdamW's moments, `exp_avg.<param>` and `exp_avg_sq.<param>` (float32), for
//                                    the trainable parameters (a resume must freeze the same, and checks it);
//   trainer_state.json               the optimizer step, the data position (next training row), the seed, the
//                                    loss history (for the loss picture) and the resolved config.
// Rank 0 writes everything into `.step-NNNNNNNN.tmp/`, fsyncs each file, renames the directory into place and
// fsyncs the parent: a crash at any moment leaves either the previous checkpoints alone or the new one complete.
// Hidden (dot) directories are never taken as checkpoints; what a hard kill leaves of a save (the temporary directory)
// is removed before the next run's first step and before every save (remove_leftovers). A save that fails removes its
// own temporaries.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "model/checkpoint.h"
#include "trainer/optimizer.h"

namespace rf::trainer {

struct LossHistory {
  std::vector<int> steps;
  std::vector<double> loss;
  std::vector<int> val_steps;
  std::vector<double> val_loss;
};

struct TrainState {
  int64_t step = 0;           // optimizer steps done
  int64_t data_position = 0;  // index of the next training row
  uint64_t seed = 0;          // train.seed the run started with (the only RNG state: data and init derive from it)
  LossHistory history;
  std::string config_yaml;  // the resolved config of the run that wrote it
};

// Writes checkpoint `state.step` under `root`, then removes all but the newest `keep`. `before_rename`, when set,
// runs after the files are written and synced but before the rename (tests fail a save there). Returns
// the checkpoint's directory. Any failure (a full disk, a quota, a file-size limit, a read-only directory) throws
// rf::Error with one line naming the file, after removing the save's temporary directory; the checkpoints already
// there stay as they were. What a hard kill left of an earlier save is removed first (remove_leftovers).
// AdamW's moments are the store's (weights.model->params()).
std::string save_train_checkpoint(const std::string& root, const model::Checkpoint& weights, const TrainState& state,
                                  int keep, const std::function<void(const std::string&)>& before_rename = {});

// What save_train_checkpoint writes of `weights`, in bytes, at most: every parameter and buffer in float32, both
// AdamW moments of the trainable ones, the tensors carried through. Known on every rank (the same on each).
int64_t checkpoint_bytes(const model::Checkpoint& weights);

// `<root>/step-NNNNNNNN`: where save_train_checkpoint puts step `step`.
std::string checkpoint_path(const std::string& root, int64_t step);

// Removes what a save interrupted by a hard kill left under `root` (its hidden temporary directories and files;
// resolve_checkpoint never takes them for checkpoints). train() calls it on rank 0 before the first step, and every
// save before it writes.
void remove_leftovers(const std::string& root);

// A checkpoint directory itself, or a root whose newest checkpoint is meant. Throws rf::Error when there is none.
std::string resolve_checkpoint(const std::string& dir_or_root);

struct LoadedCheckpoint {
  model::Checkpoint weights;
  TrainState state;
};
// Loads weights and state; load_optimizer_state puts AdamW's moments into `store` (same parameter names and shapes;
// allocated there for its trainable parameters, so freeze before).
// `before_allocating`: as model::load_checkpoint's, before the weights are allocated.
LoadedCheckpoint load_train_checkpoint(const std::string& dir, const model::BeforeAllocating& before_allocating = {});
void load_optimizer_state(const std::string& dir, model::ParamStore& store);
// trainer_state.json alone (a LoRA checkpoint's weights are its adapters: model/lora_store.h load_peft_adapter).
TrainState load_train_state(const std::string& dir);

// Throws rf::Error "<where>: tensor `name` has nan at [i, j]" for the first NaN or infinity of `values` (row-major
// of `shape`), and with `non_negative` for the first negative value too. Training checks what it loads (weights,
// AdamW's moments) before step 1: a non-finite value there would otherwise surface as a non-finite loss, or turn every
// weight NaN in the first update and be saved in the next checkpoint.
void check_loaded_tensor(const std::string& where, const std::string& name, std::span<const float> values,
                         const std::vector<int64_t>& shape, bool non_negative = false);

}  // namespace rf::trainer
