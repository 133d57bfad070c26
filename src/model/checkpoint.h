// ringflex model: Hugging Face checkpoints in and out (config.json + *.safetensors with HF tensor names).
//
// The files are opened through rf::io::Checkpoint (one model.safetensors, or an index and its shards).
// Loading accepts a Gemma4ForCausalLM checkpoint ("model.layers.0...") or a multimodal Gemma4 one whose text
// decoder sits under "model.language_model." (the vision embedder's projection
// "model.embed_vision.embedding_projection.weight", when present, becomes the trainable projection of image
// features). The model's weights of any floating dtype are widened to float32. lm_head.weight is only read when the
// config unties the embeddings.
//
// Nothing of a checkpoint is lost: every tensor the model does not hold (the vision and audio towers, the audio
// embedder, any name ringflex does not know) is kept in the model's kept() as it is in the files (io/passthrough.h) and
// written again with the same name, dtype and bits. Saving writes config.json unchanged and one model.safetensors:
// the model's tensors in float32 under the prefix the checkpoint was read with, and the passthrough tensors, so the
// written files hold exactly what the config describes when the files read did. The tokenizer, processor, chat
// template and generation files beside them are carried over too (Checkpoint::side_files).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>

#include "io/passthrough.h"
#include "model/multimodal.h"

namespace rf::model {

// Where a multimodal checkpoint (Gemma4ForConditionalGeneration) keeps its text decoder's tensors.
inline constexpr const char* kMultimodalTextPrefix = "model.language_model.";

struct Checkpoint {
  // The whole model: the decoder, the vision embedder when the files hold its projection, the tower (its config;
  // with model.train_vision its parameters in the store), and every tensor of the files it does not hold (kept()).
  std::unique_ptr<Gemma4Multimodal> model;
  std::string text_prefix = "model.";  // where the decoder's tensors live in the files ("model.language_model.")
  std::string source;                  // the directory it was loaded from (empty: built in memory)
  // The config.json a save writes; empty: the model's own (Gemma4Config::source_json). Set by the loader for a stale
  // checkpoint (see load_checkpoint) to the config that describes the files a save writes.
  std::string config_json;
  // The files beside the config and the weights that say how to feed and run the model (is_side_file: tokenizer,
  // processor, chat template, generation settings), name -> bytes. Read when the checkpoint is loaded (the folder may
  // be gone by a later save: keep-last-K removes the checkpoint a run resumed from) and written unchanged by every
  // save, so that a checkpoint ringflex writes is used as the one it read was (AutoProcessor, AutoTokenizer, generate).
  std::map<std::string, std::string> side_files;
};

// Whether a file of a checkpoint folder is one of the side files a save carries over (Checkpoint::side_files):
// generation_config.json, processor_config.json, preprocessor_config.json, video_preprocessor_config.json,
// special_tokens_map.json, added_tokens.json, chat_template.jinja / .json, and tokenizer.* / tokenizer_config.json.
bool is_side_file(const std::string& name);
// A side file's bytes, refused (naming `path`) beyond 256 MiB: no tokenizer or processor file is that large.
std::string read_side_file(const std::string& path);

// Runs with the model's parameters registered as shapes only (TensorSet::Storage::Deferred), after they were
// checked against the files and before any is allocated: where a caller checks what its whole job needs.
using BeforeAllocating = std::function<void(const Gemma4Multimodal& shapes)>;

// Runs after BeforeAllocating, still before any parameter is allocated: returns the store the parameters are loaded
// into instead of the registered one (the same names and whole shapes, ParamInfo::whole_shape), or null to keep it.
// A slot it holds in part (ParamInfo::holds_part: expert parallelism's rows) is read from the files by those rows
// alone, one leading row at a time widened straight into its mutable_weight: the rows it does not hold are never
// read, and no float32 copy of the whole tensor is made.
using PlaceParams = std::function<std::unique_ptr<ParamStore>(const Gemma4Multimodal& shapes)>;

// Throws rf::Error naming the file or tensor: a missing config.json or tensor, a shape against the config, an
// unsupported config field, parameters beyond the machine's memory (or whatever `before_allocating` throws).
// `store`: where the parameters live (null: a ReplicatedStore); the parameters the store itself adds when it allocates
// (a LoraStore's adapters) are not read from the files.
// A stale checkpoint, one whose config.json declares a text-only model (Gemma4ForCausalLM, no vision_config) while its
// files hold the vision projection model.embed_vision.embedding_projection.weight (which transformers only builds
// beside a vision tower, so it reports the tensor as unexpected and drops it) and no model.vision_tower.* tensor
// (whose config ringflex could not know), is described whole for its next save:
// config_json becomes a Gemma4ForConditionalGeneration config (the old config as its text_config, a vision_config of
// the projection's width F with no encoder layers: the patch embedder alone), the decoder is written under
// "model.language_model.", and that tower, freshly initialised (vision.h init_vision_tower, seed 0), joins the
// passthrough tensors, so transformers loads what ringflex writes with no missing and no unexpected keys. What the
// model computes does not change: it takes image features as before.
// `train_vision` (model.train_vision): the vision tower's parameters are registered in the store too
// (register_vision_tower, vision.h) and read from the files like the decoder's, so they train and are written back
// in float32 under their own names; its buffers stay passthrough. Throws rf::Error when the config has no
// vision_config. `place`: see PlaceParams.
Checkpoint load_checkpoint(const std::string& dir, const BeforeAllocating& before_allocating = {},
                           std::unique_ptr<ParamStore> store = nullptr, bool train_vision = false,
                           const PlaceParams& place = {});

// Whether `dir` holds weights (model.safetensors or its index), as load_checkpoint reads them.
bool has_weight_files(const std::string& dir);

// The model `dir`'s config.json describes, its parameters registered as shapes only in `store` (null: a replicated
// store): what load_checkpoint checks the files against, with nothing allocated and no tensor read. The vision
// projection's width F is the files' (their headers alone) where `dir` has weights, else the config's
// vision_config.hidden_size (transformers sizes the projection by it), else none. `train_vision`: as load_checkpoint.
std::unique_ptr<Gemma4Multimodal> checkpoint_shapes(const std::string& dir, bool train_vision,
                                                    std::unique_ptr<ParamStore> store = nullptr);

// How save_checkpoint writes the weights.
struct SaveOptions {
  // checkpoint.max_shard_size, transformers' max_shard_size: tensors are taken in order (the model's parameters in
  // registration order, its buffers, the passthrough tensors) and a file is closed before a tensor that would take it
  // past this many bytes of tensor data; a tensor larger than the limit has a file of its own. One file:
  // model.safetensors, as transformers writes it; more: model-0000k-of-0000n.safetensors and
  // model.safetensors.index.json ({"metadata": {"total_size"}, "weight_map"}).
  int64_t max_shard_bytes = kDefaultMaxShardBytes;
  // false: this rank writes nothing and only takes part in the weights' reads (ParamStore::read_weight is a
  // collective when the weights are sharded), in the order the writing rank reads them.
  bool write = true;
  static constexpr int64_t kDefaultMaxShardBytes = 50'000'000'000;  // transformers' default, "50GB"
};

// Writes config.json unchanged, the side files (Checkpoint::side_files) and the weights, each tensor read from the
// store (ParamStore::read_weight) only while it is written: the writer holds one tensor at a time beside the store,
// never a copy of the model. Every file is replaced all or nothing; a failed write still takes part in the remaining
// reads (so ranks sharing them stay matched), then throws rf::Error naming the file.
// `store`: the parameters as the files hold them (every one whole: the model's own store, or one that reads each
// tensor from the ranks holding its parts, as a save of held experts does); `ck` gives the rest (the config, the side
// files, the buffers, the tensors kept from the files).
void save_checkpoint(const Checkpoint& ck, ParamStore& store, const std::string& dir, const SaveOptions& options = {});
// The model's own store.
void save_checkpoint(const Checkpoint& ck, const std::string& dir, const SaveOptions& options = {});

// The file name of a parameter: "model.X" becomes text_prefix + "X"; other names are kept, and so are those of the
// multimodal parts that sit beside the decoder (the vision projection, the vision tower).
std::string file_name_of(const std::string& param_name, const std::string& text_prefix);

}  // namespace rf::model
