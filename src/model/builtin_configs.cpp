// ringflex model: the built-in models' config.json (see builtin_configs.h): one text with the text model's size
// of MLP (dense, or MoE) as its only difference.
#include "model/builtin_configs.h"

#include "core/error.h"

namespace rf::model {
namespace {

// Everything before the text model's MLP fields: the architecture and the attention layout both models share. The
// image tokens sit inside the 512-token vocabulary, where the tiny chat example's tokenizer has Gemma 4's <|image>,
// <|image|> and <image|> (examples/tiny_chat/make.py).
constexpr const char* kBeforeMlp = R"({
  "architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "tie_word_embeddings": true,
  "boi_token_id": 494, "image_token_id": 495, "eoi_token_id": 496,
  "text_config": {
    "model_type": "gemma4_text", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 6,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32,
    "num_global_key_value_heads": 1, "attention_k_eq_v": true, "sliding_window": 64,
    "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "sliding_attention",
                    "sliding_attention", "full_attention"],
    "final_logit_softcapping": 30.0, "hidden_size_per_layer_input": 0, "use_bidirectional_attention": "vision",
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1, "tie_word_embeddings": true,
)";

// The MLP of each: tiny_moe_vlm's dense MLP is narrower, beside the MoE block.
constexpr const char* kDenseMlp = R"(    "intermediate_size": 128
)";
constexpr const char* kMoeMlp =
    R"(    "intermediate_size": 96, "enable_moe_block": true, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 48
)";

// After the text model: the one-layer vision tower of width kBuiltinFeatureDim.
constexpr const char* kAfterMlp = R"(  },
  "vision_config": {
    "model_type": "gemma4_vision", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "patch_size": 4, "pooling_kernel_size": 2,
    "position_embedding_size": 16
  }
})";

}  // namespace

std::string builtin_config_json(const std::string& name) {
  if (name == "tiny_dense") return std::string(kBeforeMlp) + kDenseMlp + kAfterMlp;
  if (name == "tiny_moe_vlm") return std::string(kBeforeMlp) + kMoeMlp + kAfterMlp;
  rf::fail("model.builtin = '", name, "' is not one of tiny_dense, tiny_moe_vlm");
}

}  // namespace rf::model
