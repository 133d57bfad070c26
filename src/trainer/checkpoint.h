// ringflex trainer: training checkpoints — atomic directories, resume, keep-last-K.
//
// A checkpoint is `<checkpoint.dir>/step-NNNNNNNN/` holding
//   config.json, model.safetensors   the weights in the Hugging Face layout (transformers' from_pretrained and
//                                    `ringflex forward --model` load them as they are); above
//                                    checkpoint.max_shard_size, model-0000k-of-0000n.safetensors and
//                                    model.safetensors.index.json instead (model/checkpoint.h);
//   optimizer.safetensors            AdamW's moments, `exp_avg.<param>` and `exp_avg_sq.<param>` (float32), for
//                                    the trainable parameters (a resume must freeze the same, and checks it),
//                                    when one rank holds them all (parallelism.shard = none); or, when they are
//                                    sharded over the ranks, one file a rank and the layout beside them:
//   optimizer.json                   {"format", "shard": the mode, "ranks": N, "trainable_elements",
//                                    "parameters": [{"name", "shape", "offset"}] (the trainable layout: each
//                                    trainable parameter's first element in it), "files": [{"file", "begin",
//                                    "end"}] (the range of the trainable layout each file holds, in rank order)};
//   optimizer-0000r-of-0000n.safetensors  rank r-1's moments: `exp_avg` and `exp_avg_sq`, float32 [end - begin];
//   trainer_state.json               the optimizer step, the data position (next training row), the seed, the
//                                    loss history (for the loss picture) and the resolved config.
// A resume reads from the optimizer files whatever range of the trainable layout its store holds (its own rank's
// shard, or all of it): a checkpoint written at one rank count and shard mode resumes at any other.
// Everything is written into `.step-NNNNNNNN.tmp/` (rank 0 creates it; every rank writes its own moments there,
// rank 0 the rest), each file fsynced; rank 0 renames the directory into place and fsyncs the parent: a crash at any
// moment leaves either the previous checkpoints alone or the new one complete.
// Hidden (dot) directories are never taken as checkpoints; what a hard kill leaves of a save (the temporary directory)
// is removed before the next run's first step and before every save (remove_leftovers). A save that fails removes its
// own temporaries.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
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
// One process holding every weight and moment: the weights and AdamW's moments are `store`'s (every parameter
// whole), the rest of the files `weights`'. (A LoRA run's files are PEFT's: its training state writes them.)
std::string save_train_checkpoint(const std::string& root, const model::Checkpoint& weights, model::ParamStore& store,
                                  const TrainState& state, int keep,
                                  const std::function<void(const std::string&)>& before_rename = {},
                                  const model::SaveOptions& options = {});

// A save in parts, for a job whose ranks write it together (trainer.cpp): a PendingCheckpoint made on the writing
// rank (it removes leftovers and creates the temporary directory), then every rank writes its part into
// checkpoint_temp_path(), then finish() on the writing rank. Until finish renames it, the temporary directory is
// removed when the PendingCheckpoint is destroyed (a save that failed anywhere, on any rank, leaves no temporary).
class PendingCheckpoint {
 public:
  PendingCheckpoint(const std::string& root, int64_t step);
  ~PendingCheckpoint();
  PendingCheckpoint(const PendingCheckpoint&) = delete;
  PendingCheckpoint& operator=(const PendingCheckpoint&) = delete;
  const std::string& temp_dir() const { return temp_; }

  // What the optimizer files hold (written by the ranks beside it); `ranges` empty: optimizer.safetensors, whole.
  struct MomentLayout {
    std::string shard_mode;                           // parallelism.shard of the run that writes it
    std::vector<std::pair<int64_t, int64_t>> ranges;  // rank r's [begin, end) of the trainable layout
  };
  // Writes trainer_state.json (and optimizer.json for sharded moments), fsyncs every file, renames the directory
  // into place and keeps the newest `keep`; returns the checkpoint's directory.
  std::string finish(const model::ParamStore& store, const TrainState& state, const MomentLayout& moments, int keep,
                     const std::function<void(const std::string&)>& before_rename = {});

 private:
  std::string root_, name_, temp_;
  bool renamed_ = false;
};

// `<root>/.step-NNNNNNNN.tmp`: where a PendingCheckpoint of step `step` is written (every rank knows it without a
// message).
std::string checkpoint_temp_path(const std::string& root, int64_t step);

// AdamW's moments of the whole trainable layout as optimizer.safetensors in `dir` (the store holds them all).
void write_moments_whole(const std::string& dir, const model::ParamStore& store);
// This rank's moments (its moment_range()) as optimizer-0000{rank+1}-of-0000{ranks}.safetensors in `dir`.
void write_moments_shard(const std::string& dir, const model::ParamStore& store, int rank, int ranks);

// What a save writes of `weights` with the parameters of `store` (the files' registry), in bytes, at most: every
// parameter and buffer in float32, both AdamW moments of the trainable ones, the tensors carried through. Known on
// every rank (the same on each).
int64_t checkpoint_bytes(const model::Checkpoint& weights, const model::ParamStore& store);

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
// allocated there for its trainable parameters, so freeze before): the part inside the store's moment_range(), read
// from whichever optimizer files hold it (whole per tensor, or one file a rank); a store holding a tensor's expert
// rows apart (ParamInfo::rows_begin) reads its rows of the whole tensor (load_moments_into).
// `before_allocating`, `train_vision`, `store`, `place`: as model::load_checkpoint's (a sharded store keeps each rank's
// pieces as the tensors are read: a resume under parallelism.shard full holds no whole copy on any rank; a store
// placed with expert rows reads those rows alone).
LoadedCheckpoint load_train_checkpoint(const std::string& dir, const model::BeforeAllocating& before_allocating = {},
                                       bool train_vision = false, std::unique_ptr<model::ParamStore> store = nullptr,
                                       const model::PlaceParams& place = {});
// A store holding expert rows (ParamInfo::holds_part) reads its rows' moments alone, from either kind of files
// (load_moments_into).
void load_optimizer_state(const std::string& dir, model::ParamStore& store);

// Where some of a run's moments go: elements [first, first + n) of parameter `slot` of the files' layout (its whole
// tensor's row-major elements), into exp_avg[0, n) and exp_avg_sq[0, n).
struct MomentTarget {
  size_t slot = 0;
  int64_t first = 0, n = 0;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
};
// Reads the targets' moments from the checkpoint `dir`, whichever files hold them (optimizer.safetensors, or the
// sharded files of optimizer.json, checked against `layout`), copying only their bytes out of the mapped files (a
// sharded file is opened only when a target lies in it), checked finite and the second moments non-negative.
// `layout`: the files' registry, every parameter whole with the trainable flags of this run (model.freeze).
void load_moments_into(const std::string& dir, const model::ParamStore& layout, std::span<const MomentTarget> targets);

// As write_moments_whole, each moment tensor of `layout`'s trainable parameters produced by `read` (role, slot, the
// whole tensor [numel]) while the file is written, one at a time: the same file, without the moments in one store.
// `write` false: the reads run in the same order and nothing is written (the ranks whose reads are collectives with
// the writing rank's).
using MomentReader = std::function<void(model::Role role, size_t slot, std::span<float> out)>;
void write_moments_streamed(const std::string& dir, const model::ParamStore& layout, const MomentReader& read,
                            bool write);
// trainer_state.json alone (a LoRA checkpoint's weights are its adapters: model/peft_files.h load_peft_adapter).
TrainState load_train_state(const std::string& dir);

// Throws rf::Error "<where>: tensor `name` has nan at [i, j]" for the first NaN or infinity of `values` (row-major
// of `shape`), and with `non_negative` for the first negative value too. Training checks what it loads (weights,
// AdamW's moments) before step 1: a non-finite value there would otherwise surface as a non-finite loss, or turn every
// weight NaN in the first update and be saved in the next checkpoint.
void check_loaded_tensor(const std::string& where, const std::string& name, std::span<const float> values,
                         const std::vector<int64_t>& shape, bool non_negative = false);

}  // namespace rf::trainer
