// ringflex model: Gemma 4's vision tower config and tensors (see vision.h).
#include "model/vision.h"

#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>

#include "core/error.h"
#include "io/json_text.h"

namespace rf::model {

namespace {

using json = nlohmann::json;

// The pixel channels a patch flattens (RGB): Gemma4VisionPatchEmbedder's input_proj takes 3 * patch_size^2.
constexpr int64_t kChannels = 3;
// position_embedding_table holds one table per image axis (x, y).
constexpr int64_t kAxes = 2;

}  // namespace

std::optional<VisionConfig> VisionConfig::from_config_json(const std::string& json_text, const std::string& source) {
  const json root = io::parse_json(json_text, source);
  if (!root.is_object() || !root.contains("vision_config") || root["vision_config"].is_null()) return std::nullopt;
  const json& v = root["vision_config"];
  RF_CHECK(v.is_object(), source, ": field 'vision_config' must be an object");
  VisionConfig c;
  const auto positive = [&](const char* key, int& out) {
    if (!v.contains(key)) return;
    RF_CHECK(v[key].is_number_integer() && v[key].get<int64_t>() > 0 &&
                 v[key].get<int64_t>() <= std::numeric_limits<int>::max(),
             source, ": field 'vision_config.", key, "' must be a positive integer, found ", v[key].dump());
    out = v[key].get<int>();
  };
  const auto flag = [&](const char* key, bool& out) {
    if (!v.contains(key)) return;
    RF_CHECK(v[key].is_boolean(), source, ": field 'vision_config.", key, "' must be a boolean, found ", v[key].dump());
    out = v[key].get<bool>();
  };
  const auto number = [&](const char* key, double& out) {
    if (!v.contains(key)) return;
    RF_CHECK(v[key].is_number() && v[key].get<double>() >= 0.0, source, ": field 'vision_config.", key,
             "' must be a non-negative number, found ", v[key].dump());
    out = v[key].get<double>();
  };
  positive("hidden_size", c.hidden_size);
  positive("intermediate_size", c.intermediate_size);
  // transformers builds a tower of no layers without complaint; 0 is a valid count.
  if (v.contains("num_hidden_layers")) {
    RF_CHECK(v["num_hidden_layers"].is_number_integer() && v["num_hidden_layers"].get<int64_t>() >= 0 &&
                 v["num_hidden_layers"].get<int64_t>() <= std::numeric_limits<int>::max(),
             source, ": field 'vision_config.num_hidden_layers' must be a non-negative integer, found ",
             v["num_hidden_layers"].dump());
    c.num_layers = v["num_hidden_layers"].get<int>();
  }
  positive("num_attention_heads", c.num_heads);
  positive("num_key_value_heads", c.num_kv_heads);
  positive("head_dim", c.head_dim);
  positive("pooling_kernel_size", c.pooling_kernel_size);
  positive("patch_size", c.patch_size);
  positive("position_embedding_size", c.position_embedding_size);
  number("rms_norm_eps", c.rms_norm_eps);
  number("initializer_range", c.initializer_range);
  flag("use_clipped_linears", c.use_clipped_linears);
  flag("standardize", c.standardize);
  if (v.contains("rope_parameters") && v["rope_parameters"].is_object()) {
    const json& rope = v["rope_parameters"];
    RF_CHECK(!rope.contains("rope_type") || rope["rope_type"] == "axial", source,
             ": field 'vision_config.rope_parameters.rope_type' is ", rope["rope_type"].dump(),
             ", not the vision tower's \"axial\"");
    if (rope.contains("rope_theta")) {
      RF_CHECK(rope["rope_theta"].is_number() && rope["rope_theta"].get<double>() > 0.0, source,
               ": field 'vision_config.rope_parameters.rope_theta' must be a positive number, found ",
               rope["rope_theta"].dump());
      c.rope_theta = rope["rope_theta"].get<double>();
    }
  }
  if (v.contains("hidden_activation"))
    RF_CHECK(v["hidden_activation"] == "gelu_pytorch_tanh", source, ": field 'vision_config.hidden_activation' is ",
             v["hidden_activation"].dump(), ", not supported (\"gelu_pytorch_tanh\")");
  return c;
}

MultimodalTokens MultimodalTokens::from_config_json(const std::string& json_text, const std::string& source) {
  const json root = io::parse_json(json_text, source);
  MultimodalTokens t;
  if (!root.is_object()) return t;
  for (auto [key, dst] : {std::pair{"image_token_id", &t.image}, {"boi_token_id", &t.boi}, {"eoi_token_id", &t.eoi}}) {
    if (!root.contains(key) || root[key].is_null()) continue;
    RF_CHECK(root[key].is_number_integer() && root[key].get<int64_t>() >= 0 &&
                 root[key].get<int64_t>() <= std::numeric_limits<int>::max(),
             source, ": field '", key, "' must be a non-negative integer, found ", root[key].dump());
    *dst = root[key].get<int>();
  }
  return t;
}

std::vector<TowerTensor> vision_tower_tensors(const VisionConfig& c) {
  const int64_t H = c.hidden_size, D = c.head_dim, I = c.intermediate_size;
  std::vector<TowerTensor> out;
  int group = 0;  // the encoder layer's (1 + l) inside the loop, the patch embedder's (0) after it
  const auto linear = [&](const std::string& name, int64_t in, int64_t outs) {
    out.push_back({name + ".linear.weight", {outs, in}, TowerInit::Normal, true, group, true});
    if (!c.use_clipped_linears) return;
    out.push_back({name + ".input_max", {}, TowerInit::PlusInf, false, group});
    out.push_back({name + ".input_min", {}, TowerInit::MinusInf, false, group});
    out.push_back({name + ".output_max", {}, TowerInit::PlusInf, false, group});
    out.push_back({name + ".output_min", {}, TowerInit::MinusInf, false, group});
  };
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = "encoder.layers." + std::to_string(l) + ".";
    group = 1 + l;
    for (const char* norm :
         {"input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"})
      out.push_back({p + norm + ".weight", {H}, TowerInit::Ones, true, group});
    linear(p + "self_attn.q_proj", H, c.num_heads * D);
    linear(p + "self_attn.k_proj", H, c.num_kv_heads * D);
    linear(p + "self_attn.v_proj", H, c.num_kv_heads * D);
    linear(p + "self_attn.o_proj", c.num_heads * D, H);
    out.push_back({p + "self_attn.q_norm.weight", {D}, TowerInit::Ones, true, group});
    out.push_back({p + "self_attn.k_norm.weight", {D}, TowerInit::Ones, true, group});
    linear(p + "mlp.gate_proj", H, I);
    linear(p + "mlp.up_proj", H, I);
    linear(p + "mlp.down_proj", I, H);
  }
  const int64_t patch = c.patch_size;
  out.push_back({"patch_embedder.input_proj.weight", {H, kChannels * patch * patch}, TowerInit::Normal, true, 0, true});
  out.push_back({"patch_embedder.position_embedding_table", {kAxes, c.position_embedding_size, H}, TowerInit::Ones});
  if (c.standardize) {
    out.push_back({"std_bias", {H}, TowerInit::Zeros, false});
    out.push_back({"std_scale", {H}, TowerInit::Ones, false});
  }
  return out;
}

io::Passthrough init_vision_tower(const VisionConfig& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, static_cast<float>(c.initializer_range));
  io::Passthrough tower;
  for (const TowerTensor& t : vision_tower_tensors(c)) {
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    std::vector<float> values(static_cast<size_t>(n));
    for (float& x : values) {
      switch (t.init) {
        case TowerInit::Normal:
          x = normal(rng);
          break;
        case TowerInit::Ones:
          x = 1.f;
          break;
        case TowerInit::Zeros:
          x = 0.f;
          break;
        case TowerInit::MinusInf:
          x = -std::numeric_limits<float>::infinity();
          break;
        case TowerInit::PlusInf:
          x = std::numeric_limits<float>::infinity();
          break;
      }
    }
    std::vector<std::byte> bytes(values.size() * sizeof(float));
    if (!bytes.empty()) std::memcpy(bytes.data(), values.data(), bytes.size());
    tower.own(kVisionTowerPrefix + t.name, io::StDType::F32, t.shape, std::move(bytes));
  }
  return tower;
}

void register_vision_tower(ParamStore& store, const VisionConfig& c) {
  for (const TowerTensor& t : vision_tower_tensors(c))
    if (t.parameter) store.add(kVisionTowerPrefix + t.name, t.shape, tower_group(t.group), t.matmul);
}

}  // namespace rf::model
