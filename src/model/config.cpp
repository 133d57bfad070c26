// ringflex model: parsing config.json into Gemma4Config and resolving each layer's shape, mask and KV sharing.
#include "model/config.h"

#include <nlohmann/json.hpp>

#include "core/attention_args.h"
#include "core/error.h"

namespace rf::model {

namespace {

using json = nlohmann::json;

constexpr const char* kSlidingType = "sliding_attention";
constexpr const char* kFullType = "full_attention";
constexpr const char* kGeluTanh = "gelu_pytorch_tanh";

// transformers' Gemma4TextConfig defaults, applied when config.json leaves the field out.
constexpr int kDefaultHeadDim = 256;
constexpr int kDefaultSlidingWindow = 512;
constexpr int kDefaultGlobalHeadDim = 512;
constexpr double kDefaultRmsNormEps = 1e-6;

template <typename T>
T required(const json& j, const char* key) {
  RF_CHECK(j.contains(key) && !j[key].is_null(), "config.json: missing required field '", key, "'");
  return j[key].get<T>();
}

template <typename T>
T optional(const json& j, const char* key, T fallback) {
  return j.contains(key) && !j[key].is_null() ? j[key].get<T>() : fallback;
}

RopeParams parse_rope(const json& rope, const char* layer_type, double default_theta) {
  RopeParams r;
  r.theta = default_theta;
  if (!rope.contains(layer_type)) return r;
  const json& p = rope[layer_type];
  const std::string type = optional<std::string>(p, "rope_type", "default");
  RF_CHECK(type == "default" || type == "proportional", "config.json: rope_parameters.", layer_type,
           ".rope_type '", type, "' is not supported (default or proportional)");
  r.proportional = type == "proportional";
  r.theta = optional<double>(p, "rope_theta", default_theta);
  r.partial_rotary_factor = optional<double>(p, "partial_rotary_factor", 1.0);
  r.factor = optional<double>(p, "factor", 1.0);
  return r;
}

}  // namespace

Gemma4Config Gemma4Config::from_json(const std::string& json_text) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& e) {
    fail("config.json is not valid JSON: ", e.what());
  }
  // A multimodal Gemma4Config keeps the decoder's fields under text_config.
  const json& j = root.contains("text_config") ? root["text_config"] : root;
  Gemma4Config c;
  c.source_json = json_text;
  c.vocab_size = required<int>(j, "vocab_size");
  c.hidden_size = required<int>(j, "hidden_size");
  c.intermediate_size = required<int>(j, "intermediate_size");
  c.num_layers = required<int>(j, "num_hidden_layers");
  c.num_heads = required<int>(j, "num_attention_heads");
  c.num_kv_heads = required<int>(j, "num_key_value_heads");
  c.head_dim = optional<int>(j, "head_dim", kDefaultHeadDim);
  c.sliding_window = optional<int>(j, "sliding_window", kDefaultSlidingWindow);
  c.rms_norm_eps = optional<double>(j, "rms_norm_eps", kDefaultRmsNormEps);
  c.final_logit_softcapping = optional<double>(j, "final_logit_softcapping", 0.0);
  c.attention_k_eq_v = optional<bool>(j, "attention_k_eq_v", false);
  c.num_kv_shared_layers = optional<int>(j, "num_kv_shared_layers", 0);
  c.use_double_wide_mlp = optional<bool>(j, "use_double_wide_mlp", false);
  c.enable_moe = optional<bool>(j, "enable_moe_block", false);
  c.ple_dim = optional<int>(j, "hidden_size_per_layer_input", 0);
  c.ple_vocab_size = optional<int>(j, "vocab_size_per_layer_input", c.vocab_size);
  c.pad_token_id = optional<int>(j, "pad_token_id", 0);
  c.tie_word_embeddings = optional<bool>(root, "tie_word_embeddings", optional<bool>(j, "tie_word_embeddings", true));
  if (c.enable_moe) {
    c.num_experts = required<int>(j, "num_experts");
    c.top_k_experts = required<int>(j, "top_k_experts");
    c.moe_intermediate_size = required<int>(j, "moe_intermediate_size");
  }

  RF_CHECK(!optional<bool>(j, "attention_bias", false), "config.json: attention_bias = true is not supported");
  const std::string act = optional<std::string>(j, "hidden_activation", kGeluTanh);
  RF_CHECK(act == kGeluTanh, "config.json: hidden_activation '", act, "' is not supported (", kGeluTanh, ")");
  const std::string bidir = optional<std::string>(j, "use_bidirectional_attention", "");
  RF_CHECK(bidir.empty() || bidir == "vision", "config.json: use_bidirectional_attention '", bidir,
           "' is not supported (null or \"vision\")");
  c.vision_bidirectional = bidir == "vision";

  // Layer types: given, or the 5 sliding : 1 full default; the last layer is always full (as transformers forces).
  constexpr int kDefaultPattern = 6;
  if (j.contains("layer_types") && !j["layer_types"].is_null()) {
    const json& types = j["layer_types"];
    RF_CHECK(static_cast<int>(types.size()) == c.num_layers, "config.json: layer_types has ", types.size(),
             " entries for ", c.num_layers, " layers");
    for (const auto& t : types) {
      const std::string s = t.get<std::string>();
      RF_CHECK(s == kSlidingType || s == kFullType, "config.json: layer type '", s, "' is not supported");
      c.sliding.push_back(s == kSlidingType);
    }
  } else {
    for (int i = 0; i < c.num_layers; ++i) c.sliding.push_back((i + 1) % kDefaultPattern != 0);
  }
  if (!c.sliding.empty()) c.sliding.back() = false;

  const json rope = j.contains("rope_parameters") && !j["rope_parameters"].is_null() ? j["rope_parameters"] : json{};
  constexpr double kSlidingTheta = 10000.0, kFullTheta = 1000000.0, kFullPartial = 0.25;
  c.rope_sliding = parse_rope(rope, kSlidingType, kSlidingTheta);
  if (rope.contains(kFullType)) {
    c.rope_full = parse_rope(rope, kFullType, kFullTheta);
  } else {
    c.rope_full = RopeParams{true, kFullTheta, kFullPartial, 1.0};
  }

  // Full layers' head dim and kv heads: per_layer_config (what transformers 5.24 writes), or the older
  // global_head_dim / num_global_key_value_heads fields (the kv-head override only applies with k_eq_v).
  c.full_head_dim.assign(c.num_layers, 0);
  c.full_kv_heads.assign(c.num_layers, 0);
  if (j.contains("per_layer_config") && !j["per_layer_config"].is_null()) {
    for (const auto& [key, over] : j["per_layer_config"].items()) {
      const int i = std::stoi(key);
      RF_CHECK(i >= 0 && i < c.num_layers, "config.json: per_layer_config names layer ", key, " out of range");
      for (const auto& [field, value] : over.items()) {
        RF_CHECK(field == "head_dim" || field == "num_key_value_heads", "config.json: per_layer_config.", key, ".",
                 field, " is not supported");
      }
      c.full_head_dim[i] = optional<int>(over, "head_dim", 0);
      c.full_kv_heads[i] = optional<int>(over, "num_key_value_heads", 0);
    }
  } else {
    const int global_dim = optional<int>(j, "global_head_dim", kDefaultGlobalHeadDim);
    const int global_kv = optional<int>(j, "num_global_key_value_heads", 0);
    for (int i = 0; i < c.num_layers; ++i) {
      if (c.sliding[i]) continue;
      c.full_head_dim[i] = global_dim;
      c.full_kv_heads[i] = c.attention_k_eq_v ? global_kv : 0;
    }
  }
  c.validate();
  return c;
}

void Gemma4Config::validate() const {
  RF_CHECK(vocab_size > 0 && hidden_size > 0 && num_layers > 0 && num_heads > 0 && num_kv_heads > 0,
           "config.json: vocab_size, hidden_size, num_hidden_layers and head counts must be positive");
  RF_CHECK(num_kv_shared_layers >= 0 && num_kv_shared_layers < num_layers,
           "config.json: num_kv_shared_layers = ", num_kv_shared_layers, " must be in [0, num_hidden_layers)");
  if (enable_moe) {
    RF_CHECK(num_experts > 0 && top_k_experts > 0 && top_k_experts <= num_experts && moe_intermediate_size > 0,
             "config.json: MoE needs 0 < top_k_experts <= num_experts and moe_intermediate_size > 0");
  }
  RF_CHECK(ple_dim == 0 || ple_vocab_size > 0, "config.json: vocab_size_per_layer_input must be positive");
  for (int i = 0; i < num_layers; ++i) {
    const LayerSpec s = layer(i);
    RF_CHECK(s.head_dim > 0 && s.head_dim <= kMaxHeadDim && s.head_dim % 2 == 0, "config.json: layer ", i,
             " head dim ", s.head_dim, " must be even and in 2..", kMaxHeadDim);
    RF_CHECK(s.kv_heads > 0 && num_heads % s.kv_heads == 0, "config.json: layer ", i, " has ", num_heads,
             " query heads, not a multiple of its ", s.kv_heads, " key/value heads");
  }
}

LayerSpec Gemma4Config::layer(int i) const {
  LayerSpec s;
  s.sliding = sliding.at(i);
  s.head_dim = !s.sliding && full_head_dim[i] > 0 ? full_head_dim[i] : head_dim;
  s.kv_heads = !s.sliding && full_kv_heads[i] > 0 ? full_kv_heads[i] : num_kv_heads;
  s.has_v_proj = !(attention_k_eq_v && !s.sliding);
  s.rope = s.sliding ? &rope_sliding : &rope_full;
  s.mask.causal = true;
  s.mask.window = s.sliding ? sliding_window : 0;
  s.mask.bidirectional_groups = vision_bidirectional && (s.sliding || groups_on_full_layers);

  // KV sharing as transformers' kv_sharing_modes: layers from first_shared on reuse the K/V of the last earlier
  // layer of the same type.
  const int first_shared = num_layers - num_kv_shared_layers;
  if (num_kv_shared_layers > 0) {
    if (i >= first_shared) {
      for (int p = first_shared - 1; p >= 0; --p) {
        if (sliding[p] == s.sliding) {
          s.kv_source = p;
          break;
        }
      }
      RF_CHECK(s.kv_source >= 0, "config.json: KV-shared layer ", i, " has no earlier layer of its type to read");
    } else {
      for (int p = first_shared - 1; p >= 0; --p) {
        if (sliding[p] == s.sliding) {
          s.stores_kv = p == i;
          break;
        }
      }
    }
  }
  s.intermediate = intermediate_size * (use_double_wide_mlp && s.kv_source >= 0 ? 2 : 1);
  return s;
}

}  // namespace rf::model
