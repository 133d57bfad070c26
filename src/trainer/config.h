// ringflex trainer: the training configuration (YAML), its defaults, `--set` overrides and up-front validation.
//
// Every field has a default, so an empty file is a valid config (the built-in tiny MoE VLM on mock data). A field
// is addressed as `section.key` both in the file and on the command line (`--set train.steps=5`); the table in
// config.cpp is the one place that lists them. Anything wrong (an unknown field, a value of the wrong type or out
// of range, cp * dp != the number of ranks, ...) throws rf::Error naming the field before any work starts.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "cp/shard.h"
#include "model/ops.h"
#include "text/conversation.h"

namespace rf::trainer {

// The options that name one of a fixed set of choices, parsed once when the YAML is read (a bad spelling is an error
// there, naming the field and the choices); name_of gives back the spelling the YAML uses.
enum class SourceKind { Mock, JsonlTokens, JsonlText, JsonlChat };  // data.source: mock | jsonl_tokens | ...
enum class Overlength { Drop, Truncate, Error };                    // data.chat.overlength: drop | truncate | error
enum class ShardMode { None, Optimizer, Gradients, Full };  // parallelism.shard: none | optimizer | gradients | full
std::string_view name_of(SourceKind s);
std::string_view name_of(Overlength o);
std::string_view name_of(ShardMode s);

struct ModelSection {
  std::string builtin = "tiny_moe_vlm";  // tiny_dense | tiny_moe_vlm; ignored when `path` is set
  std::string path;                      // a Hugging Face Gemma 4 checkpoint directory
  double init_std = 0.02;                // built-in models: weights ~ N(0, init_std)
  std::vector<std::string> freeze;       // parameters whose name contains one of these do not train
  // float32 | bfloat16: what the linear layers multiply in (model::RunOptions::compute_dtype)
  model::ComputeDtype compute_dtype = model::ComputeDtype::Float32;
  // float32 | bfloat16: the working copy of the weights the run reads (model::ParamDtype, model/param_store.h); the
  // masters the optimizer updates and the checkpoint writes stay float32
  model::ParamDtype param_dtype = model::ParamDtype::Float32;
  // LoRA over the frozen base (model/lora_store.h), PEFT's LoraConfig names: off while lora_rank is 0.
  int lora_rank = 0;
  double lora_alpha = 8.0;
  double lora_dropout = 0.0;
  // PEFT's target_modules: a YAML list of module names, or one string, a regular expression that must match the
  // whole module name ("model.layers.N.self_attn.q_proj").
  std::vector<std::string> lora_target = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  bool lora_target_regex = false;
  // PEFT's target_parameters: the MoE experts' 3-D weights, e.g. [experts.gate_up_proj, experts.down_proj].
  std::vector<std::string> lora_target_parameters;
  bool lora_use_rslora = false;
  // The vision tower trains (its parameters get gradients and moments and are written back updated); false: it is
  // frozen, as in every Gemma 4 recipe, and encodes each image of the data once.
  bool train_vision = false;
};

struct DataSection {
  SourceKind source = SourceKind::Mock;  // mock | jsonl_tokens | jsonl_text | jsonl_chat
  std::string path;                      // the JSONL file (jsonl_tokens, jsonl_text, jsonl_chat)
  std::string features;                  // jsonl_tokens with image spans: safetensors with `image_features` [N, F]
  // jsonl_text, jsonl_chat: the tokenizer file (default: model.path's tokenizer.json, else its tokenizer.model)
  std::string tokenizer;
  // jsonl_chat (docs/text.md): the chat template file (default: model.path's chat_template.jinja, else its
  // tokenizer_config.json's `chat_template`), which tokens train, the empty thought block after each trained model
  // header, what happens to a conversation longer than train.seq_len, and the template's enable_thinking.
  std::string chat_template;
  text::TrainOn chat_train_on = text::TrainOn::Assistant;
  bool chat_thought_prefix = true;
  Overlength chat_overlength = Overlength::Drop;
  bool chat_enable_thinking = false;
  int val_rows = 8;            // rows held out for validation
  int mock_image_tokens = 16;  // mock: placeholder tokens per image block
  // jsonl_tokens samples with `images`: the soft tokens an image is resized for (Gemma4ImageProcessor's
  // max_soft_tokens: 70, 140, 280, 560 or 1120). 0 (the default): the checkpoint's own image processor's, read by
  // parse_config from model.path (processor_config.json's image_processor.max_soft_tokens, else
  // preprocessor_config.json's max_soft_tokens), else kDefaultImageSoftTokens.
  int image_soft_tokens = 0;
  static constexpr int kDefaultImageSoftTokens = 280;  // Gemma4ImageProcessor's own default
};

struct OptimizerSection {
  double lr = 3e-3;  // peak learning rate
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double weight_decay = 0.1;  // decoupled (AdamW); only tensors of 2 or more dims decay
  double grad_clip = 1.0;     // global L2 norm; 0 = off
};

struct ScheduleSection {
  int warmup_steps = 20;      // linear from lr / warmup_steps to lr
  double min_lr_ratio = 0.1;  // cosine decays to lr * min_lr_ratio at train.steps
};

struct ParallelismSection {
  int cp = 1;                                  // context-parallel ranks per row
  int dp = 1;                                  // data-parallel replicas
  cp::Scheme sharding = cp::Scheme::Balanced;  // how CP splits a row: contiguous | zigzag | balanced
  // How the training state is spread over all cp x dp ranks (ZeRO stages): none (every rank holds all of it) |
  // optimizer (AdamW's moments sharded, ZeRO-1: the gradients are reduce-scattered, each rank updates its shard of
  // the trainable parameters, then the updated weights are all-gathered) | gradients (ZeRO-2: as optimizer, and each
  // layer's gradients are reduce-scattered as its backward ends, a rank accumulating its slice alone) | full (ZeRO-3:
  // as gradients, and each rank holds its pieces of the weights, every layer gathered around its forward and
  // backward). trainer/state/sharded_store.h has the details.
  ShardMode shard = ShardMode::None;
  // Expert parallelism: the experts of every MoE layer divided over groups of ep consecutive ranks of the cp x dp
  // ranks (folded: each rank sends its own tokens' rows to the experts' ranks). ep divides cp x dp and the model's
  // experts; 1: every expert on every rank. Without LoRA each rank holds and trains only its EP rank's experts
  // (weights, gradients and moments; trainer/state/expert_state.h, under sharding trainer/state/held_expert_store.h).
  // With LoRA every rank keeps the whole frozen base and only its experts' adapters (model::LoraStore::place_experts),
  // under shard optimizer their moments sharded over the ranks holding the same experts (trainer/state/expert_state.h).
  int ep = 1;
  // The vision tower's work over the ranks (issue 24 item 4): true divides it, each image encoded once (a frozen
  // tower's data images over all ranks when the data is read, then one sum; with model.train_vision each
  // micro-batch's images over its CP group, balanced by patch count, the soft tokens and their gradients summed over
  // the group); false: every rank encodes every image its rows hold, as a reference system runs the tower on the
  // full row before sharding, and with model.train_vision back-propagates its own positions' share of the soft
  // tokens' gradient (the gradient reduction sums the shares). The same losses either way (docs/training.md, Config).
  bool split_vision = true;
};

struct TrainSection {
  int steps = 300;        // optimizer steps
  int seq_len = 256;      // tokens per packed row (S)
  int global_batch = 4;   // rows per optimizer step, over all DP replicas and accumulation
  int micro_batch = 1;    // rows per forward/backward on one DP replica
  uint64_t seed = 0;      // model init and mock data
  int threads = 0;        // OpenMP threads per rank; 0 = the runtime's default
  int val_every = 50;     // validation every N steps (and at the end); 0 = only at the end
  int log_every = 10;     // progress lines in a log file (a terminal updates every step)
  bool recompute = true;  // per-layer activation recompute in the backward (model::RunOptions::recompute_layers)
  // (recompute: with model.train_vision the vision tower's layers too, model::VisionEncoder::forward; the same bits)
  bool keep_mlp = false;  // with recompute: keep the MLP projections (model::RunOptions::keep_mlp_projections)
  // with recompute: keep the o_proj / down_proj outputs (model::RunOptions::keep_o_proj_output, keep_down_proj_output)
  bool keep_o_proj = true;
  bool keep_down_proj = true;
  // Which of those four the config spells `auto` (the default): the trainer chooses them before it allocates, the
  // least recompute the memory check fits (choose_recompute, trainer.h); until then they hold the values above.
  // Every choice gives the same bits; only time and memory differ.
  struct Automatic {
    bool recompute = true, keep_mlp = true, keep_o_proj = true, keep_down_proj = true;
    bool any() const { return recompute || keep_mlp || keep_o_proj || keep_down_proj; }
  } automatic;
  // train.samples (docs/train-samples.md): greedy generations from the prompts of `samples_prompts` (JSONL) every
  // samples_every steps and at the last, samples_max_new_tokens each. Empty: none.
  std::string samples_prompts;
  int samples_every = 0;  // 0: only at the last step
  int samples_max_new_tokens = 32;
  // with recompute: a directory for the spill file holding each layer's kept activations between the forward and
  // the backward instead of memory (model::RunOptions::spill_dir; docs/training.md, Long rows); empty: in memory
  std::string spill_dir;
  // the dense MLP's token tile (model::RunOptions::mlp_tile_tokens) and whether its [T, I] products exist one tile at
  // a time (model::RunOptions::tile_mlp; docs/training.md, Long rows)
  int mlp_tile_tokens = 2048;
  bool tile_mlp = false;
};

struct CheckpointSection {
  std::string dir;  // empty: no checkpoints
  int every = 0;    // steps between checkpoints (and one at the end); 0 = only at the end
  int keep = 3;     // keep the last K checkpoints
  // transformers' max_shard_size: the weights go into files of at most this much tensor data (model-0000k-of-
  // 0000n.safetensors and an index) once they are larger; bytes, or a number with KB, MB, GB, TB (powers of 1000,
  // as huggingface_hub) or KiB, MiB, GiB, TiB (powers of 1024)
  std::string max_shard_size = "50GB";
};

struct TrainConfig {
  ModelSection model;
  DataSection data;
  OptimizerSection optimizer;
  ScheduleSection schedule;
  ParallelismSection parallelism;
  TrainSection train;
  CheckpointSection checkpoint;

  int accumulation_steps() const { return global_batch_per_replica() / train.micro_batch; }
  int global_batch_per_replica() const { return train.global_batch / parallelism.dp; }
};

// Parses YAML text (`source` names it in errors), then applies `sets` ("section.key=value", in order). Checks
// names and types, not the cross-field rules (see validate).
TrainConfig parse_config(const std::string& yaml_text, const std::string& source,
                         const std::vector<std::string>& sets = {});
// The max_soft_tokens of the image processor saved beside the checkpoint at `model_path` (processor_config.json's
// image_processor, else preprocessor_config.json), DataSection::kDefaultImageSoftTokens without one: the image budget
// the model's own processor uses (data.image_soft_tokens' default, generate --messages' images). Throws rf::Error
// naming the file for an unsupported count.
int processor_soft_tokens(const std::string& model_path);

TrainConfig load_config(const std::string& path, const std::vector<std::string>& sets = {});

// Cross-field rules and the files the config names; `world_size` is the number of ranks of the job.
void validate(const TrainConfig& c, int world_size);
// Its rules on the layout of the ranks, which validate checks in turn: cp x dp = `world_size`, ep divides it, a CP
// rank's token, the batch over the replicas and micro-batches (`ringflex train --plan` asks them of each layout).
void validate_parallelism(const TrainConfig& c, int world_size);

// checkpoint.max_shard_size in bytes; throws rf::Error naming the field when it is not a positive size.
int64_t max_shard_bytes(const CheckpointSection& c);
// `text` in bytes: a number, optionally with KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (of 1024); throws
// rf::Error "<what> = '<text>' is not a positive size (...)" otherwise.
int64_t parse_size(const std::string& text, const std::string& what);

// The resolved config as YAML, every field with its value (what --print-config shows and a checkpoint keeps).
std::string to_yaml(const TrainConfig& c);

}  // namespace rf::trainer
