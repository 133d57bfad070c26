// ringflex model: the Gemma 4 text-decoder configuration and what it implies per layer.
//
// Read from a Hugging Face config.json (a Gemma4TextConfig, or a Gemma4Config whose `text_config` holds one). Only
// the fields that change the text decoder's math are kept; a field whose value this implementation does not
// support (attention bias, another activation, fully bidirectional attention, a RoPE type other than default and
// proportional) is rejected by name rather than silently ignored.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/mask.h"

namespace rf::model {

struct RopeParams {
  bool proportional = false;          // "proportional": only the first partial_rotary_factor of the pairs rotate
  double theta = 10000.0;             // rope_theta
  double partial_rotary_factor = 1.0; // proportional only
  double factor = 1.0;                // frequencies are divided by it
};

// What one decoder layer looks like, resolved from the layer type, per_layer_config and KV sharing.
struct LayerSpec {
  bool sliding = true;
  int head_dim = 0;      // D of this layer (head_dim on sliding layers, the global head dim on full ones)
  int kv_heads = 0;      // Hkv of this layer
  bool has_v_proj = true;  // false on full layers with attention_k_eq_v: V is the raw K projection
  int kv_source = -1;    // >= 0: a KV-shared layer reading the K/V stored by layer kv_source; -1: its own K/V
  bool stores_kv = false;  // another layer reads this layer's K/V
  int intermediate = 0;  // dense MLP width (doubled on KV-shared layers when use_double_wide_mlp)
  LayerMask mask;        // SPEC §3 mask of this layer
  const RopeParams* rope = nullptr;
};

struct Gemma4Config {
  int vocab_size = 0;
  int hidden_size = 0;        // H
  int intermediate_size = 0;
  int num_layers = 0;
  int num_heads = 0;          // Hq
  int num_kv_heads = 0;       // Hkv on sliding layers (and full ones unless overridden)
  int head_dim = 0;
  std::vector<bool> sliding;  // [num_layers] layer_types == "sliding_attention"
  std::vector<int> full_head_dim;    // [num_layers] per_layer_config head_dim override (0 = none)
  std::vector<int> full_kv_heads;    // [num_layers] per_layer_config num_key_value_heads override (0 = none)
  int sliding_window = 0;
  RopeParams rope_sliding, rope_full;
  double rms_norm_eps = 1e-6;
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
  int ple_dim = 0;            // hidden_size_per_layer_input (0 = no per-layer embeddings)
  int ple_vocab_size = 0;     // vocab_size_per_layer_input
  int pad_token_id = 0;
  bool tie_word_embeddings = true;

  // Parses config.json text. Throws rf::Error naming a missing or unsupported field.
  static Gemma4Config from_json(const std::string& json_text);
  std::string source_json;  // the text it was parsed from, written back unchanged when a checkpoint is saved

  // Throws rf::Error when the sizes are inconsistent (Hq % Hkv, KV sharing without a producer, ...).
  void validate() const;
  LayerSpec layer(int i) const;
};

}  // namespace rf::model
