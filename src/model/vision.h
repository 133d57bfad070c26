// ringflex model: Gemma 4's vision tower (transformers 5.24's Gemma4VisionModel): its config and its tensors.
//
// The tower's forward and backward are vision_encoder.h; the decoder takes its soft tokens as image features
// (gemma4.h). Here: the config, and the tower's tensors, which a built-in multimodal model also needs to write one (it
// is a Gemma4ForConditionalGeneration whose checkpoint must hold every tensor its vision_config implies, or
// transformers re-initialises the missing ones at load). The names and shapes are transformers' (Gemma4VisionModel
// under "model.vision_tower."), per encoder layer:
//   self_attn.{q,k,v,o}_proj   Gemma4ClippableLinear: `.linear.weight` [out, in], and with use_clipped_linears the
//                              scalar buffers `.input_min`, `.input_max`, `.output_min`, `.output_max`;
//   self_attn.{q,k}_norm       RMSNorm scales [head_dim] (v_norm has none);
//   mlp.{gate,up,down}_proj    clippable linears, as above;
//   {input,post_attention,pre_feedforward,post_feedforward}_layernorm   RMSNorm scales [hidden_size];
// and once: patch_embedder.input_proj.weight [hidden, 3 * patch^2], patch_embedder.position_embedding_table
// [2, position_embedding_size, hidden], and with standardize the buffers std_bias, std_scale [hidden].
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "io/passthrough.h"
#include "model/param_store.h"

namespace rf::model {

// Gemma4VisionConfig's fields, with transformers 5.24's defaults.
struct VisionConfig {
  int hidden_size = 768;
  int intermediate_size = 3072;
  int num_layers = 16;  // num_hidden_layers
  int num_heads = 12;   // num_attention_heads
  int num_kv_heads = 12;
  int head_dim = 64;
  double rms_norm_eps = 1e-6;
  int pooling_kernel_size = 3;
  int patch_size = 16;
  int position_embedding_size = 10 * 1024;
  bool use_clipped_linears = false;
  bool standardize = false;
  double initializer_range = 0.02;
  double rope_theta = 100.0;  // rope_parameters.rope_theta of the "axial" 2-D rotary embedding

  // The `vision_config` object of a multimodal config.json; nullopt when there is none (or it is null). Throws
  // rf::Error naming the field of a wrong type or a non-positive size; `source` names the file.
  static std::optional<VisionConfig> from_config_json(const std::string& json_text, const std::string& source);
};

// The token ids a multimodal Gemma4Config gives images (its top-level fields, transformers 5.24's defaults): the
// placeholder that marks an image in a prompt and fills its soft-token slots, and the begin / end-of-image tokens
// around the slots (Gemma4Processor lays an image out as boi, image x soft tokens, eoi).
struct MultimodalTokens {
  int image = 258880;  // image_token_id
  int boi = 255999;    // boi_token_id
  int eoi = 258882;    // eoi_token_id

  // Throws rf::Error naming a field that is not an integer; `source` names the file.
  static MultimodalTokens from_config_json(const std::string& json_text, const std::string& source);
};

// Where a multimodal checkpoint keeps the tower's tensors.
inline constexpr const char* kVisionTowerPrefix = "model.vision_tower.";

// How transformers' Gemma4PreTrainedModel._init_weights starts each tensor.
enum class TowerInit { Normal, Ones, Zeros, MinusInf, PlusInf };

struct TowerTensor {
  std::string name;  // under kVisionTowerPrefix
  std::vector<int64_t> shape;
  TowerInit init;
  // An nn.Parameter in transformers (linear weights, norm scales, the patch projection, the position table): what
  // model.train_vision trains. false: a buffer (the clip bounds, std_bias, std_scale), never trained.
  bool parameter = true;
  // Its group (model::tower_group's index): 0 the patch embedder (and the buffers outside the layers), 1 + l encoder
  // layer l.
  int group = 0;
  // Read by a matmul (the linear weights and the patch projection): a store keeps a bf16 compute copy of it.
  bool matmul = false;
};

// Every tensor Gemma4VisionModel saves for `c`, in transformers' names and shapes (see the top of this file).
std::vector<TowerTensor> vision_tower_tensors(const VisionConfig& c);

// A freshly initialised tower in float32, as transformers would start one (linear weights normal with standard
// deviation initializer_range, norm scales and the position table ones, clip bounds at -inf / +inf, std_bias 0,
// std_scale 1), deterministic in `seed`, as passthrough tensors under kVisionTowerPrefix.
io::Passthrough init_vision_tower(const VisionConfig& c, uint64_t seed);

// model.train_vision: registers the tower's parameters (TowerTensor::parameter, under kVisionTowerPrefix, in
// vision_tower_tensors' order) in `store`, after the decoder's and before the store allocates, so that they get
// gradients and AdamW moments like the decoder's, in groups of their own (tower_group(TowerTensor::group)): the
// tower reads its weights and writes its gradients in the store's arenas, between the store's hooks of each group,
// as a decoder layer does (vision_encoder.h TowerParams; the trainer's source is model/multimodal.h). The buffers stay
// passthrough tensors.
void register_vision_tower(ParamStore& store, const VisionConfig& c);

}  // namespace rf::model
