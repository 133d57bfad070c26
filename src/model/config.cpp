// ringflex model: parsing config.json into Gemma4Config and resolving each layer's shape, mask and KV sharing.
#include "model/config.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "core/attention_args.h"
#include "core/error.h"
#include "io/json_text.h"

namespace rf::model {

namespace {

using json = nlohmann::json;

constexpr const char* kSlidingType = "sliding_attention";
constexpr const char* kFullType = "full_attention";
constexpr const char* kGeluTanh = "gelu_pytorch_tanh";
constexpr const char* kMultimodalModelType = "gemma4";  // Gemma4Config
constexpr const char* kTextModelType = "gemma4_text";   // Gemma4TextConfig

// transformers 5.24's defaults (Gemma4TextConfig, Gemma4VisionConfig, and the keyword arguments
// Gemma4TextConfig.__post_init__ pops), applied when config.json leaves the field out.
constexpr int kDefaultVocabSize = 262144;
constexpr int kDefaultHiddenSize = 2304;
constexpr int kDefaultIntermediateSize = 9216;
constexpr int kDefaultNumLayers = 30;
constexpr int kDefaultNumHeads = 8;
constexpr int kDefaultNumKvHeads = 4;
constexpr int kDefaultHeadDim = 256;
constexpr int kDefaultSlidingWindow = 512;
constexpr int kDefaultMaxPositionEmbeddings = 131072;  // Gemma4TextConfig's default
constexpr int kDefaultGlobalHeadDim = 512;
constexpr double kDefaultRmsNormEps = 1e-6;
constexpr int kDefaultPadTokenId = 0;
constexpr int kDefaultPleDim = 256;
constexpr int kDefaultPleVocabSize = 262144;
constexpr double kDefaultVisionRmsNormEps = 1e-6;
constexpr int kDefaultLayerPattern = 6;  // 5 sliding : 1 full when layer_types is absent
// More layers than any model has (Gemma 4's largest has 60) and few enough that the per-layer tables built from
// the config before the checkpoint is read stay small: a corrupt count fails here, not in a 1e9-entry allocation.
constexpr int kMaxLayers = 1 << 16;
constexpr double kSlidingTheta = 10000.0, kFullTheta = 1000000.0, kFullPartialRotary = 0.25;

// What a JSON value is, for messages: its type and (shortened) value.
std::string describe(const json& v) {
  constexpr size_t kMaxShown = 40;
  std::string shown = v.dump();
  if (shown.size() > kMaxShown) shown = shown.substr(0, kMaxShown) + "...";
  if (v.is_null()) return "null";
  if (v.is_boolean()) return "boolean " + shown;
  if (v.is_number_integer()) return "integer " + shown;
  if (v.is_number()) return "number " + shown;
  if (v.is_string()) return "string " + shown;
  if (v.is_array()) return "array " + shown;
  return "object " + shown;
}

// One JSON object of config.json, read field by field: each read checks the JSON type and says which file and
// field is wrong, what it expected and what it found (no library exception text reaches the user).
class Fields {
 public:
  Fields(const json& object, std::string source, std::string path)
      : obj_(object), source_(std::move(source)), path_(std::move(path)) {}

  // Present with a non-null value.
  bool has(const char* key) const { return obj_.contains(key) && !obj_[key].is_null(); }
  bool contains(const char* key) const { return obj_.contains(key); }
  const json& raw(const char* key) const { return obj_[key]; }
  std::string name(const std::string& key) const { return path_ + key; }

  [[noreturn]] void wrong_type(const std::string& key, const char* expected) const {
    fail(source_, ": field '", name(key), "' must be ", expected, ", found ", describe(obj_[key]));
  }

  // An int field; transformers' non-optional fields take no null.
  int integer(const char* key, int fallback) const {
    if (!obj_.contains(key)) return fallback;
    return as_int(key);
  }
  // An `int | None` field: absent gives the fallback, null gives nullopt.
  std::optional<int> nullable_integer(const char* key, std::optional<int> fallback) const {
    if (!obj_.contains(key)) return fallback;
    if (obj_[key].is_null()) return std::nullopt;
    return as_int(key);
  }
  double number(const char* key, double fallback) const {
    if (!obj_.contains(key)) return fallback;
    const json& v = obj_[key];
    if (!v.is_number()) wrong_type(key, "a number");
    const double x = v.get<double>();
    if (!std::isfinite(x)) wrong_type(key, "a finite number");
    return x;
  }
  std::optional<double> nullable_number(const char* key, std::optional<double> fallback) const {
    if (!obj_.contains(key)) return fallback;
    if (obj_[key].is_null()) return std::nullopt;
    return number(key, 0.0);
  }
  bool boolean(const char* key, bool fallback) const {
    if (!obj_.contains(key)) return fallback;
    if (!obj_[key].is_boolean()) wrong_type(key, "true or false");
    return obj_[key].get<bool>();
  }
  std::string string(const char* key, const std::string& fallback) const {
    if (!obj_.contains(key)) return fallback;
    if (!obj_[key].is_string()) wrong_type(key, "a string");
    return obj_[key].get<std::string>();
  }
  std::optional<std::string> nullable_string(const char* key, std::optional<std::string> fallback) const {
    if (!obj_.contains(key)) return fallback;
    if (obj_[key].is_null()) return std::nullopt;
    return string(key, "");
  }
  // A nested object (null or absent: nullopt).
  std::optional<Fields> object(const char* key) const {
    if (!has(key)) return std::nullopt;
    if (!obj_[key].is_object()) wrong_type(key, "an object");
    return Fields(obj_[key], source_, name(key) + ".");
  }
  const json& object_json() const { return obj_; }
  const std::string& source() const { return source_; }

 private:
  int as_int(const char* key) const {
    const json& v = obj_[key];
    if (!v.is_number_integer()) wrong_type(key, "an integer");
    // Unsigned and signed 64-bit JSON integers both compare against int's range before narrowing.
    const bool fits = v.is_number_unsigned()
                          ? v.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<int>::max())
                          : v.get<int64_t>() >= std::numeric_limits<int>::min() &&
                                v.get<int64_t>() <= std::numeric_limits<int>::max();
    if (!fits) wrong_type(key, "an integer that fits in 32 bits");
    return v.get<int>();
  }

  const json& obj_;
  std::string source_;
  std::string path_;
};

// transformers' own set repr, keys sorted: {'factor', 'foo'}.
std::string python_set(const std::vector<std::string>& keys) {
  std::string s = "{";
  for (size_t i = 0; i < keys.size(); ++i) s += (i ? ", '" : "'") + keys[i] + "'";
  return s + "}";
}

// One layer type's entry of rope_parameters, as transformers 5.24 resolves it (rope_type defaults to "default";
// rope_theta is required, as transformers fails without it).
RopeParams parse_rope(const Fields& rope, const char* layer_type, std::vector<std::string>& warnings) {
  RF_CHECK(rope.contains(layer_type), rope.source(), ": field '", rope.name(layer_type),
           "' is missing; config.json's layer_types use it (transformers 5.24 fails without it too)");
  const std::optional<Fields> p = rope.object(layer_type);
  RF_CHECK(p.has_value(), rope.source(), ": field '", rope.name(layer_type),
           "' is null (a layer type without RoPE is not supported)");
  // "type" is the older spelling of "rope_type", which transformers still accepts.
  const std::string type = p->string("rope_type", p->string("type", "default"));
  RF_CHECK(type == "default" || type == "proportional", p->source(), ": field '", p->name("rope_type"), "' is '", type,
           "', not supported (default or proportional)");
  RF_CHECK(p->has("rope_theta"), p->source(), ": field '", p->name("rope_theta"),
           "' is missing (transformers 5.24 requires it)");
  RopeParams r;
  r.proportional = type == "proportional";
  r.theta = p->number("rope_theta", 0.0);
  RF_CHECK(r.theta > 0.0, p->source(), ": field '", p->name("rope_theta"), "' = ", r.theta, " must be positive");
  r.partial_rotary_factor = p->number("partial_rotary_factor", 1.0);
  RF_CHECK(r.partial_rotary_factor >= 0.0 && r.partial_rotary_factor <= 1.0, p->source(), ": field '",
           p->name("partial_rotary_factor"), "' = ", r.partial_rotary_factor, " must be in [0, 1]");

  // transformers' validation: keys outside its list for the type are reported and, for "default", unused.
  const std::set<std::string> known = {"rope_type", "type", "rope_theta", "partial_rotary_factor"};
  std::vector<std::string> unknown;
  for (const auto& [key, value] : p->object_json().items())
    if (!known.count(key)) unknown.push_back(key);
  if (!unknown.empty()) {
    warnings.push_back("Unrecognized keys in `rope_parameters` for 'rope_type'='" + type + "': " + python_set(unknown) +
                       (r.proportional && p->contains("factor")
                            ? " (rope_parameters." + std::string(layer_type) +
                                  ".factor is still applied, as transformers 5.24's proportional RoPE does)"
                            : " (ignored, as transformers 5.24 ignores them)"));
  }
  if (r.proportional) {
    r.factor = p->number("factor", 1.0);
    RF_CHECK(r.factor > 0.0, p->source(), ": field '", p->name("factor"), "' = ", r.factor, " must be positive");
    if (!p->contains("partial_rotary_factor")) {
      warnings.push_back(
          "`rope_parameters`'s partial_rotary_factor is None. This will default to 1.0 in the computation, making "
          "this equivalent to the linear_scaling RoPE type. Provide a value in the range [0.0, 1.0) to make use of "
          "the proportional RoPE functionality.");
    }
  }
  return r;
}

// A per_layer_config key: the layer index written as a decimal string.
int layer_index(const std::string& key, int num_layers, const Fields& where) {
  const bool digits = !key.empty() && key.size() <= 9 &&
                      std::all_of(key.begin(), key.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
  RF_CHECK(digits && std::stoi(key) < num_layers, where.source(), ": field '", where.name(key),
           "' does not name a layer (per_layer_config keys are layer indices 0..", num_layers - 1, ")");
  return std::stoi(key);
}

}  // namespace

Gemma4Config Gemma4Config::from_json(const std::string& json_text, const std::string& source) {
  const json root_json = io::parse_json(json_text, source);
  RF_CHECK(root_json.is_object(), source, ": must hold a JSON object, found ", describe(root_json));
  const Fields root(root_json, source, "");

  // Gemma 4 only, by name: a config of another model would otherwise be read as Gemma 4 with defaults.
  const std::string model_type = root.string("model_type", "");
  RF_CHECK(model_type.empty() || model_type == kMultimodalModelType || model_type == kTextModelType, source,
           ": model_type '", model_type, "' is not Gemma 4 (", kMultimodalModelType, " or ", kTextModelType, ")");
  // A multimodal Gemma4Config keeps the decoder's fields under text_config (all defaults when it is null).
  const bool multimodal = model_type == kMultimodalModelType || root.contains("text_config");
  static const json kEmptyObject = json::object();
  const std::optional<Fields> text_object = multimodal ? root.object("text_config") : std::nullopt;
  const Fields j = text_object ? *text_object : multimodal ? Fields(kEmptyObject, source, "text_config.") : root;
  if (multimodal) {
    const std::string text_type = j.string("model_type", kTextModelType);
    RF_CHECK(text_type == kTextModelType, source, ": field '", j.name("model_type"), "' is '", text_type,
             "', not Gemma 4's text decoder (", kTextModelType, ")");
  }

  Gemma4Config c;
  c.source_json = json_text;
  c.vocab_size = j.integer("vocab_size", kDefaultVocabSize);
  c.hidden_size = j.integer("hidden_size", kDefaultHiddenSize);
  c.intermediate_size = j.integer("intermediate_size", kDefaultIntermediateSize);
  c.num_layers = j.integer("num_hidden_layers", kDefaultNumLayers);
  c.num_heads = j.integer("num_attention_heads", kDefaultNumHeads);
  c.num_kv_heads = j.integer("num_key_value_heads", kDefaultNumKvHeads);
  c.head_dim = j.integer("head_dim", kDefaultHeadDim);
  c.sliding_window = j.integer("sliding_window", kDefaultSlidingWindow);
  c.max_position_embeddings = j.integer("max_position_embeddings", kDefaultMaxPositionEmbeddings);
  c.rms_norm_eps = j.number("rms_norm_eps", kDefaultRmsNormEps);
  c.final_logit_softcapping = j.nullable_number("final_logit_softcapping", std::nullopt).value_or(0.0);
  RF_CHECK(!j.has("final_logit_softcapping") || c.final_logit_softcapping > 0.0, source, ": field '",
           j.name("final_logit_softcapping"), "' = ", c.final_logit_softcapping, " must be positive or null");
  c.attention_k_eq_v = j.boolean("attention_k_eq_v", false);
  c.num_kv_shared_layers = j.integer("num_kv_shared_layers", 0);
  c.use_double_wide_mlp = j.boolean("use_double_wide_mlp", false);
  c.enable_moe = j.boolean("enable_moe_block", false);
  c.ple_dim = j.integer("hidden_size_per_layer_input", kDefaultPleDim);
  c.ple_vocab_size = j.integer("vocab_size_per_layer_input", kDefaultPleVocabSize);
  c.pad_token_id = j.nullable_integer("pad_token_id", kDefaultPadTokenId);
  // The model class reads the tie from the top-level config (Gemma4Config's own field for a multimodal one).
  c.tie_word_embeddings = root.boolean("tie_word_embeddings", true);
  const std::optional<int> experts = j.nullable_integer("num_experts", std::nullopt);
  const std::optional<int> top_k = j.nullable_integer("top_k_experts", std::nullopt);
  const std::optional<int> moe_width = j.nullable_integer("moe_intermediate_size", std::nullopt);
  if (c.enable_moe) {
    for (const auto& [field, value] :
         {std::pair{"num_experts", experts}, {"top_k_experts", top_k}, {"moe_intermediate_size", moe_width}}) {
      RF_CHECK(value.has_value(), source, ": field '", j.name(field), "' is required with enable_moe_block = true");
    }
    c.num_experts = *experts;
    c.top_k_experts = *top_k;
    c.moe_intermediate_size = *moe_width;
  }
  if (multimodal) {
    if (const std::optional<Fields> vision = root.object("vision_config"))
      c.vision_rms_norm_eps = vision->number("rms_norm_eps", kDefaultVisionRmsNormEps);
  }

  RF_CHECK(!j.boolean("attention_bias", false), source, ": field '", j.name("attention_bias"),
           "' = true is not supported");
  const std::string act = j.string("hidden_activation", kGeluTanh);
  RF_CHECK(act == kGeluTanh, source, ": field '", j.name("hidden_activation"), "' is '", act, "', not supported (",
           kGeluTanh, ")");
  const std::optional<std::string> bidir = j.nullable_string("use_bidirectional_attention", std::nullopt);
  RF_CHECK(!bidir || *bidir == "vision", source, ": field '", j.name("use_bidirectional_attention"), "' is '",
           bidir.value_or(""), "', not supported (null or \"vision\")");
  c.vision_bidirectional = bidir.has_value();

  // Sizes that every later step indexes with, checked before they are used.
  RF_CHECK(c.num_layers > 0 && c.num_layers <= kMaxLayers, source, ": field '", j.name("num_hidden_layers"),
           "' = ", c.num_layers, " must be in [1, ", kMaxLayers, "]");

  // Layer types: given, or the 5 sliding : 1 full default; the last layer is always full (as transformers forces,
  // with the warning it prints).
  if (j.has("layer_types")) {
    const json& types = j.raw("layer_types");
    if (!types.is_array()) j.wrong_type("layer_types", "an array of layer type names");
    RF_CHECK(static_cast<int>(types.size()) == c.num_layers, source, ": field '", j.name("layer_types"), "' has ",
             types.size(), " entries for num_hidden_layers = ", c.num_layers);
    for (size_t i = 0; i < types.size(); ++i) {
      RF_CHECK(types[i].is_string(), source, ": field '", j.name("layer_types"), "[", i, "]' must be a string, found ",
               describe(types[i]));
      const std::string s = types[i].get<std::string>();
      RF_CHECK(s == kSlidingType || s == kFullType, source, ": field '", j.name("layer_types"), "[", i, "]' is '", s,
               "', not supported (", kSlidingType, " or ", kFullType, ")");
      c.sliding.push_back(s == kSlidingType);
    }
  } else {
    for (int i = 0; i < c.num_layers; ++i) c.sliding.push_back((i + 1) % kDefaultLayerPattern != 0);
  }
  if (c.sliding.back()) {
    c.warnings.push_back(
        "Last layer must use `full_attention`, but got `sliding_attention`. Forcing last layer to "
        "`full_attention`.");
    c.sliding.back() = false;
  }

  // RoPE: absent or null means transformers' two defaults; given, it must name every layer type in use.
  const bool any_sliding = std::find(c.sliding.begin(), c.sliding.end(), true) != c.sliding.end();
  if (const std::optional<Fields> rope = j.object("rope_parameters")) {
    for (const auto& [key, value] : rope->object_json().items()) {
      RF_CHECK(key == kSlidingType || key == kFullType, source, ": field '", rope->name(key),
               "' is not a layer type; Gemma 4's rope_parameters are nested by layer type (", kSlidingType, ", ",
               kFullType, ")");
    }
    if (any_sliding) c.rope_sliding = parse_rope(*rope, kSlidingType, c.warnings);
    c.rope_full = parse_rope(*rope, kFullType, c.warnings);
  } else {
    c.rope_sliding = RopeParams{false, kSlidingTheta, 1.0, 1.0};
    c.rope_full = RopeParams{true, kFullTheta, kFullPartialRotary, 1.0};
  }

  // Head dims and kv heads per layer: per_layer_config (what transformers 5.24 writes), or the older
  // global_head_dim / num_global_key_value_heads fields, which apply to full layers (the kv-head override only
  // with attention_k_eq_v), as Gemma4TextConfig.__post_init__ turns them into a per_layer_config.
  c.head_dim_override.assign(c.num_layers, 0);
  c.kv_heads_override.assign(c.num_layers, 0);
  if (const std::optional<Fields> per_layer = j.object("per_layer_config")) {
    for (const auto& [key, value] : per_layer->object_json().items()) {
      const int i = layer_index(key, c.num_layers, *per_layer);
      const std::optional<Fields> over = per_layer->object(key.c_str());
      if (!over) continue;
      for (const auto& [field, v] : over->object_json().items()) {
        RF_CHECK(field == "head_dim" || field == "num_key_value_heads", source, ": field '", over->name(field),
                 "' is not supported (head_dim, num_key_value_heads)");
      }
      // 0 in the tables below means "the layer type's default", so an override must itself be positive.
      for (auto [field, dst] : {std::pair{"head_dim", &c.head_dim_override[i]},
                                std::pair{"num_key_value_heads", &c.kv_heads_override[i]}}) {
        if (!over->has(field)) continue;
        *dst = over->integer(field, 0);
        RF_CHECK(*dst > 0, source, ": field '", over->name(field), "' = ", *dst, " must be positive");
      }
    }
  } else {
    const int global_dim = j.integer("global_head_dim", kDefaultGlobalHeadDim);
    const std::optional<int> global_kv = j.nullable_integer("num_global_key_value_heads", std::nullopt);
    RF_CHECK(global_dim > 0, source, ": field '", j.name("global_head_dim"), "' = ", global_dim, " must be positive");
    RF_CHECK(!global_kv || *global_kv > 0, source, ": field '", j.name("num_global_key_value_heads"),
             "' = ", global_kv.value_or(0), " must be positive");
    for (int i = 0; i < c.num_layers; ++i) {
      if (c.sliding[i]) continue;
      c.head_dim_override[i] = global_dim;
      c.kv_heads_override[i] = c.attention_k_eq_v ? global_kv.value_or(0) : 0;
    }
  }
  c.validate();
  return c;
}

void Gemma4Config::validate() const {
  for (const auto& [field, value] : {std::pair{"vocab_size", vocab_size},
                                     {"hidden_size", hidden_size},
                                     {"intermediate_size", intermediate_size},
                                     {"num_hidden_layers", num_layers},
                                     {"num_attention_heads", num_heads},
                                     {"num_key_value_heads", num_kv_heads},
                                     {"sliding_window", sliding_window}}) {
    RF_CHECK(value > 0, "config.json: ", field, " = ", value, " must be positive");
  }
  RF_CHECK(static_cast<int>(sliding.size()) == num_layers && static_cast<int>(head_dim_override.size()) == num_layers &&
               static_cast<int>(kv_heads_override.size()) == num_layers,
           "config.json: layer_types and per-layer overrides must cover num_hidden_layers = ", num_layers, " layers");
  RF_CHECK(std::isfinite(rms_norm_eps) && rms_norm_eps >= 0.0, "config.json: rms_norm_eps = ", rms_norm_eps,
           " must be a finite non-negative number");
  RF_CHECK(std::isfinite(vision_rms_norm_eps) && vision_rms_norm_eps >= 0.0,
           "config.json: vision_config.rms_norm_eps = ", vision_rms_norm_eps, " must be a finite non-negative number");
  RF_CHECK(num_kv_shared_layers >= 0 && num_kv_shared_layers < num_layers,
           "config.json: num_kv_shared_layers = ", num_kv_shared_layers, " must be in [0, num_hidden_layers)");
  if (enable_moe) {
    RF_CHECK(num_experts > 0 && top_k_experts > 0 && top_k_experts <= num_experts && moe_intermediate_size > 0,
             "config.json: MoE needs 0 < top_k_experts <= num_experts and moe_intermediate_size > 0");
  }
  RF_CHECK(ple_dim >= 0, "config.json: hidden_size_per_layer_input = ", ple_dim, " must be non-negative");
  RF_CHECK(ple_dim == 0 || ple_vocab_size > 0, "config.json: vocab_size_per_layer_input = ", ple_vocab_size,
           " must be positive");
  if (pad_token_id) {
    // nn.Embedding(padding_idx) needs the row to exist, in both tables.
    RF_CHECK(*pad_token_id >= 0 && *pad_token_id < vocab_size, "config.json: pad_token_id = ", *pad_token_id,
             " must be in [0, vocab_size = ", vocab_size, ") or null");
    RF_CHECK(ple_dim == 0 || *pad_token_id < ple_vocab_size, "config.json: pad_token_id = ", *pad_token_id,
             " must be below vocab_size_per_layer_input = ", ple_vocab_size, " or null");
  }
  int type_head_dim[2] = {0, 0};  // [sliding?]: RoPE tables are built once per layer type, so one D per type
  for (int i = 0; i < num_layers; ++i) {
    const LayerSpec s = layer(i);
    RF_CHECK(s.head_dim > 0 && s.head_dim <= kMaxHeadDim && s.head_dim % 2 == 0, "config.json: layer ", i, " head dim ",
             s.head_dim, " must be even and in 2..", kMaxHeadDim);
    RF_CHECK(s.kv_heads > 0 && num_heads % s.kv_heads == 0, "config.json: layer ", i, " has ", num_heads,
             " query heads, not a multiple of its ", s.kv_heads, " key/value heads");
    int& d = type_head_dim[s.sliding ? 1 : 0];
    RF_CHECK(d == 0 || d == s.head_dim, "config.json: layer ", i, " has head dim ", s.head_dim, ", another ",
             s.sliding ? kSlidingType : kFullType, " layer has ", d, " (one head dim per layer type is supported)");
    d = s.head_dim;
  }
}

LayerSpec Gemma4Config::layer(int i) const {
  LayerSpec s;
  s.sliding = sliding.at(i);
  s.head_dim = head_dim_override[i] > 0 ? head_dim_override[i] : head_dim;
  s.kv_heads = kv_heads_override[i] > 0 ? kv_heads_override[i] : num_kv_heads;
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

std::string Gemma4Config::resolved_json() const {
  auto rope_json = [](const RopeParams& r) {
    return json{{"rope_type", r.proportional ? "proportional" : "default"},
                {"rope_theta", r.theta},
                {"partial_rotary_factor", r.partial_rotary_factor},
                {"factor", r.factor}};
  };
  json layers = json::array();
  json layer_types = json::array();
  for (int i = 0; i < num_layers; ++i) {
    const LayerSpec s = layer(i);
    layer_types.push_back(s.sliding ? kSlidingType : kFullType);
    layers.push_back({{"head_dim", s.head_dim},
                      {"num_key_value_heads", s.kv_heads},
                      {"has_v_proj", s.has_v_proj},
                      {"kv_source", s.kv_source},
                      {"stores_kv", s.stores_kv},
                      {"intermediate_size", s.intermediate},
                      {"window", s.mask.window},
                      {"bidirectional_groups", s.mask.bidirectional_groups}});
  }
  const json out = {
      {"vocab_size", vocab_size},
      {"hidden_size", hidden_size},
      {"intermediate_size", intermediate_size},
      {"num_hidden_layers", num_layers},
      {"num_attention_heads", num_heads},
      {"num_key_value_heads", num_kv_heads},
      {"head_dim", head_dim},
      {"sliding_window", sliding_window},
      {"rms_norm_eps", rms_norm_eps},
      {"vision_rms_norm_eps", vision_rms_norm_eps},
      {"final_logit_softcapping", final_logit_softcapping > 0.0 ? json(final_logit_softcapping) : json(nullptr)},
      {"use_bidirectional_attention", vision_bidirectional ? json("vision") : json(nullptr)},
      {"attention_k_eq_v", attention_k_eq_v},
      {"num_kv_shared_layers", num_kv_shared_layers},
      {"use_double_wide_mlp", use_double_wide_mlp},
      {"enable_moe_block", enable_moe},
      {"num_experts", enable_moe ? json(num_experts) : json(nullptr)},
      {"top_k_experts", enable_moe ? json(top_k_experts) : json(nullptr)},
      {"moe_intermediate_size", enable_moe ? json(moe_intermediate_size) : json(nullptr)},
      {"hidden_size_per_layer_input", ple_dim},
      {"vocab_size_per_layer_input", ple_vocab_size},
      {"pad_token_id", pad_token_id ? json(*pad_token_id) : json(nullptr)},
      {"tie_word_embeddings", tie_word_embeddings},
      {"layer_types", layer_types},
      {"layers", layers},
      {"rope_parameters", {{kSlidingType, rope_json(rope_sliding)}, {kFullType, rope_json(rope_full)}}},
      {"warnings", warnings},
  };
  return out.dump(2);
}

}  // namespace rf::model
