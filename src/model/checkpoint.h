// ringflex model: Hugging Face checkpoints in and out (config.json + *.safetensors with HF tensor names).
//
// The files are opened through rf::io::Checkpoint (one model.safetensors, or an index and its shards).
// Loading accepts a Gemma4ForCausalLM checkpoint ("model.layers.0...") or a multimodal Gemma4 one whose text
// decoder sits under "model.language_model." (its vision and audio towers are ignored; the vision embedder's
// projection "model.embed_vision.embedding_projection.weight", when present, becomes the trainable projection of
// image features). Weights of any floating dtype are widened to float32. lm_head.weight is only read when the
// config unties the embeddings. Saving writes config.json unchanged and one model.safetensors in float32 under
// the prefix the checkpoint was read with.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "model/gemma4.h"

namespace rf::model {

struct Checkpoint {
  std::unique_ptr<Gemma4Model> model;
  std::string text_prefix = "model.";  // where the decoder's tensors live in the files ("model.language_model.")
  std::string source;                  // the directory it was loaded from (empty: built in memory)
};

// Runs with the model's parameters registered as shapes only (TensorSet::Storage::Deferred), after they were
// checked against the files and before any is allocated: where a caller checks what its whole job needs.
using BeforeAllocating = std::function<void(const Gemma4Model& shapes)>;

// Throws rf::Error naming the file or tensor: a missing config.json or tensor, a shape against the config, an
// unsupported config field, parameters beyond the machine's memory (or whatever `before_allocating` throws).
// `store`: where the parameters live (null: a ReplicatedStore); the parameters the store itself adds when it allocates
// (a LoraStore's adapters) are not read from the files.
Checkpoint load_checkpoint(const std::string& dir, const BeforeAllocating& before_allocating = {},
                           std::unique_ptr<ParamStore> store = nullptr);

void save_checkpoint(const Checkpoint& ck, const std::string& dir);

// The file name of a parameter: "model.X" becomes text_prefix + "X"; other names are kept.
std::string file_name_of(const std::string& param_name, const std::string& text_prefix);

}  // namespace rf::model
