// ringflex trainer: train.samples, greedy generations during training from a prompts file, so a user watches the
// model learn (docs/train-samples.md).
//
// The prompts file is JSONL, one prompt a line, in one of two forms:
//   {"messages": [...], "tools": [...]?}  a conversation as `ringflex generate --messages` reads it, rendered through
//                                         the chat template with the generation prompt, images as message parts
//                                         (trainer/conversation_prompt.h, the reader generate uses);
//   {"ids": [1, 40, 41]}                  token ids as they are, for a model without a tokenizer (the mock data).
// Every rank reads and checks the file at setup, so a bad one stops the run before step 1 with one line on each rank.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "model/generate.h"
#include "model/image_processor.h"
#include "model/multimodal.h"
#include "model/vision_encoder.h"
#include "text/tokenizer.h"
#include "trainer/config.h"
#include "trainer/data.h"

namespace rf::trainer {

struct SamplePrompts {
  std::vector<model::Prompt> prompts;    // in file order
  std::vector<std::string> where;        // [prompts] "FILE:LINE"
  std::unique_ptr<text::Tokenizer> tok;  // set when a line is a conversation: the samples' text is decoded with it
  // A sample ends after one of these (its stop_reason "eos"), as `ringflex generate` on the run's checkpoints stops:
  // the eos_token_id of the generation_config.json the checkpoints carry (sample_stop_ids).
  std::vector<int32_t> stop_ids;
  // The prompts' images as the tower takes them ([prompts][images], empty for a text prompt) and their paths: their
  // slots are in the prompts' ids; encode_sample_images fills the features. Kept for a tower that trains
  // (model.train_vision), whose soft tokens change every step; freed once a frozen tower has encoded them.
  std::vector<std::vector<model::ProcessedImage>> images;
  std::vector<std::vector<std::string>> image_paths;
};

// The end tokens of the generation_config.json among a checkpoint's side files (model::Checkpoint::side_files, the
// bytes every save of the run writes), read by model::parse_generation_config as `ringflex generate` reads the file;
// none without one. `where` names the file in errors.
std::vector<int32_t> sample_stop_ids(const std::map<std::string, std::string>& side_files, const std::string& where);

// Reads c.train.samples_prompts (c.train.samples_prompts non-empty) and checks every prompt against the model
// (model::check_prompt with samples_max_new_tokens over `cp_ranks`). Throws rf::Error "FILE:LINE: ..." for a line
// that does not parse, is neither form, has ids outside the vocabulary, or images the model cannot take (no vision
// tower, a missing or unreadable image file); "FILE: no prompts" for none. The tokenizer and chat template are the
// run's (data.tokenizer and data.chat_template, else model.path's files); images are laid out for the model's
// processor at data.image_soft_tokens, as the training data's are. `m` may be shapes only: no weight is read.
SamplePrompts read_sample_prompts(const TrainConfig& c, const model::Gemma4Multimodal& m, int cp_ranks);

// Whether any prompt has images.
bool has_sample_images(const SamplePrompts& s);

// Every prompt's image features through `tower` (as `ringflex generate` encodes them: encode_prompt_images), the
// same on every rank. With `keep_images` false the preprocessed images are freed after (a frozen tower). Collective
// where the tower's store hooks are (a sharded store's gathers under model.train_vision): every rank calls it.
void encode_sample_images(SamplePrompts& s, const model::VisionEncoder& tower, bool keep_images);

// Each prompt's token count [prompts], what the memory check sizes the samples' KV cache from.
std::vector<int64_t> prompt_lengths(const SamplePrompts& s);

// Token ids as text, space-separated (a model without a tokenizer).
std::string ids_text(std::span<const int32_t> ids);

// Whether `step` generates samples: every samples_every steps and the last.
bool is_sample_step(const TrainConfig& c, int64_t step);

// Where the samples of a run with `--metrics metrics_path` go: <metrics without its extension>.samples.jsonl; empty
// without a metrics file (the samples are then printed only).
std::string samples_path(const std::string& metrics_path);

// One line of the samples file: {"step", "prompt" (its index), "where", "prompt_ids", "token_ids", "stop_reason",
// "text" (with a tokenizer)}, with its newline.
std::string sample_json_line(int64_t step, size_t index, const std::string& where, const model::Prompt& p,
                             const model::Generated& g, const text::Tokenizer* tok);

}  // namespace rf::trainer
