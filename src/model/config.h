// ringflex model: the Gemma 4 text-decoder configuration and what it implies per layer.
//
// Read from a Hugging Face config.json (a Gemma4TextConfig, or a Gemma4Config whose `text_config` holds one). Only
// the fields that change the text decoder's math are kept; a field whose value this implementation does not
// support (attention bias, another activation, fully bidirectional attention, a RoPE type other than default and
// proportional) is rejected by name rather than silently ignored. A field config.json leaves out takes the default
// of the pinned transformers 5.24 config classes (Gemma4TextConfig, Gemma4Config, Gemma4VisionConfig), so a
// minimal config.json means here what it means there; tests/model/config_defaults.py checks every resolved field
// against transformers. A field of the wrong JSON type is an error naming the file, the field, the expected and
// the found type.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/mask.h"

namespace rf::model {

struct RopeParams {
  bool proportional = false;           // "proportional": only the first partial_rotary_factor of the pairs rotate
  double theta = 10000.0;              // rope_theta
  double partial_rotary_factor = 1.0;  // proportional only
  // Frequencies are divided by it. Only "proportional" reads it: transformers 5.24's "default" RoPE ignores a
  // `factor` key (with a warning, which Gemma4Config::warnings repeats), so it stays 1 there.
  double factor = 1.0;
};

// What one decoder layer looks like, resolved from the layer type, per_layer_config and KV sharing.
struct LayerSpec {
  bool sliding = true;
  int head_dim = 0;        // D of this layer (head_dim on sliding layers, the global head dim on full ones)
  int kv_heads = 0;        // Hkv of this layer
  bool has_v_proj = true;  // false on full layers with attention_k_eq_v: V is the raw K projection
  int kv_source = -1;      // >= 0: a KV-shared layer reading the K/V stored by layer kv_source; -1: its own K/V
  bool stores_kv = false;  // another layer reads this layer's K/V
  int intermediate = 0;    // dense MLP width (doubled on KV-shared layers when use_double_wide_mlp)
  LayerMask mask;          // docs/spec.md §3 mask of this layer
  const RopeParams* rope = nullptr;
};

struct Gemma4Config {
  int vocab_size = 0;
  int hidden_size = 0;  // H
  int intermediate_size = 0;
  int num_layers = 0;
  int num_heads = 0;     // Hq
  int num_kv_heads = 0;  // Hkv on sliding layers (and full ones unless overridden)
  int head_dim = 0;
  std::vector<bool> sliding;           // [num_layers] layer_types == "sliding_attention"
  std::vector<int> head_dim_override;  // [num_layers] per_layer_config head_dim (0 = none: head_dim)
  std::vector<int> kv_heads_override;  // [num_layers] per_layer_config num_key_value_heads (0 = none)
  int sliding_window = 0;
  int64_t max_position_embeddings = 0;  // the positions generation may reach (prompt and new tokens); 0 = no limit
  RopeParams rope_sliding, rope_full;
  double rms_norm_eps = 1e-6;
  // vision_config.rms_norm_eps: the epsilon of the vision projection's scale-free pre-norm
  // (Gemma4MultimodalEmbedder reads it from the vision config, not the text one).
  double vision_rms_norm_eps = 1e-6;
  double final_logit_softcapping = 0.0;  // 0 = no cap
  bool vision_bidirectional = false;     // use_bidirectional_attention == "vision"
  // Whether image groups are bidirectional on full layers too. transformers 5.24 (pinned by the parity test)
  // builds the full-attention mask causal-only (create_masks_for_vision_model), so the default is false.
  bool groups_on_full_layers = false;
  bool attention_k_eq_v = false;
  int num_kv_shared_layers = 0;
  bool use_double_wide_mlp = false;
  bool enable_moe = false;
  int num_experts = 0;
  int top_k_experts = 0;
  int moe_intermediate_size = 0;
  int ple_dim = 0;         // hidden_size_per_layer_input (0 = no per-layer embeddings)
  int ple_vocab_size = 0;  // vocab_size_per_layer_input
  // The embedding row nn.Embedding(padding_idx) keeps out of training, main and per-layer tables alike; image and
  // video slots read it for their per-layer input. null (std::nullopt): no padding row, every row is trained.
  std::optional<int> pad_token_id = 0;
  bool tie_word_embeddings = true;
  // What config.json asks that transformers 5.24 accepts with a warning and ringflex treats the same way (a
  // `factor` on a "default" RoPE, a last layer forced to full attention), in transformers' own words; the
  // command line prints them.
  std::vector<std::string> warnings;

  // Parses config.json text; `source` names it in messages (the file's path). Throws rf::Error naming a field of
  // the wrong type, an unsupported value, or a model_type that is not Gemma 4's.
  static Gemma4Config from_json(const std::string& json_text, const std::string& source = "config.json");
  std::string source_json;  // the text it was parsed from, written back unchanged when a checkpoint is saved

  // Throws rf::Error when the sizes are inconsistent (Hq % Hkv, KV sharing without a producer, ...).
  void validate() const;
  LayerSpec layer(int i) const;

  // Every resolved field as JSON, defaults applied, with the per-layer shapes and RoPE parameters (what
  // `config_defaults.py` compares against transformers).
  std::string resolved_json() const;
};

}  // namespace rf::model
