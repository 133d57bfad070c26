// ringflex model: a checkpoint's generation_config.json, the decoding defaults (sampling and end tokens) that
// `ringflex generate` starts from and train.samples stops on, read as transformers' GenerationConfig reads them.
//
// One reader for both, so that a sample written during training and `ringflex generate` on the checkpoint of that
// step stop on the same tokens: the trainer parses the file's bytes the checkpoint carries (Checkpoint::side_files),
// generate the file in the checkpoint folder, which is the same file.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "model/sampling.h"

namespace rf::model {

// GenerationConfig's default top_k, used when sampling without one.
inline constexpr int kTransformersTopK = 50;

struct GenerationDefaults {
  GenerationDefaults() { sampling.top_k = kTransformersTopK; }
  // do_sample (false: greedy), temperature, top_k (kTransformersTopK when absent or null), top_p, min_p.
  SamplingOptions sampling;
  // eos_token_id: an id or a list (Gemma 4 ships 1, 106, 50: <eos>, <turn|>, <|tool_response>); empty: none.
  std::vector<int32_t> stop_ids;
  std::optional<int> max_new_tokens;  // absent or null: the caller's default
};

// The defaults of the generation_config.json whose text is `text`, transformers' where it has none; `where` names it
// in errors (one line: a value of the wrong type, eos_token_id not an integer or a list of integers, JSON that does
// not parse).
GenerationDefaults parse_generation_config(const std::string& text, const std::string& where);

// parse_generation_config of <dir>/generation_config.json; transformers' defaults (greedy, top_k 50, no end tokens)
// when the folder has none.
GenerationDefaults read_generation_config(const std::filesystem::path& dir);

}  // namespace rf::model
