// ringflex model: the built-in models' config.json, Gemma 4 shapes shrunk to train a few hundred steps in minutes on
// 2 cores (`ringflex train` with model.builtin, and the tests that rebuild what it trained).
//
// Five sliding layers of window 64 and one full layer (Gemma 4's 5:1 mix), GQA 4:2 on sliding and 4:1 with K = V on
// the full layer (as the 26B/31B), head dims 16 and 32 (sliding and global differ as in Gemma 4),
// vision-bidirectional image groups. tiny_moe_vlm adds Gemma 4's parallel MoE block (4 experts, top 2) to
// tiny_dense's text model; nothing else differs.
//
// Both are multimodal Gemma4ForConditionalGeneration models: their image features (kBuiltinFeatureDim wide) go
// through the trainable projection model.embed_vision.embedding_projection, which transformers only builds beside a
// vision tower. So the config holds a vision_config (a one-layer tower of width kBuiltinFeatureDim) and every
// checkpoint holds that tower, freshly initialised from train.seed and frozen (it encodes the mock data's drawings):
// transformers loads the checkpoint with no missing and no unexpected weights.
#pragma once

#include <string>

namespace rf::model {

// The width of the built-in models' image features: their vision tower's hidden_size.
constexpr int kBuiltinFeatureDim = 32;

// config.json text of built-in model `name` ("tiny_dense", "tiny_moe_vlm"); throws rf::Error naming the choices.
// The text is what a checkpoint of the model keeps as its config.json (Gemma4Config::source_json).
std::string builtin_config_json(const std::string& name);

}  // namespace rf::model
