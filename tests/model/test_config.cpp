// Tests of config.json reading: transformers 5.24's defaults for what a file leaves out, a null pad id, the vision
// config's epsilon, RoPE `factor` handled as transformers does (with its warning), messages naming the file, the
// field and both types, and parameters registered as shapes only until allocated. (config_defaults.py checks the
// same against transformers itself; these run without Python.)
#include <gtest/gtest.h>

#include <string>

#include "core/error.h"
#include "model/gemma4.h"

namespace rf::model {
namespace {

std::string error_of(const std::string& json) {
  try {
    Gemma4Config::from_json(json, "dir/config.json");
  } catch (const rf::Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(ModelConfig, EmptyFileTakesTransformersDefaults) {
  const Gemma4Config c = Gemma4Config::from_json("{}");
  // Gemma4TextConfig's field defaults in transformers 5.24.
  EXPECT_EQ(c.vocab_size, 262144);
  EXPECT_EQ(c.hidden_size, 2304);
  EXPECT_EQ(c.intermediate_size, 9216);
  EXPECT_EQ(c.num_layers, 30);
  EXPECT_EQ(c.num_heads, 8);
  EXPECT_EQ(c.num_kv_heads, 4);
  EXPECT_EQ(c.head_dim, 256);
  EXPECT_EQ(c.sliding_window, 512);
  EXPECT_EQ(c.ple_dim, 256);  // per-layer embeddings are on unless the file says 0
  EXPECT_EQ(c.ple_vocab_size, 262144);
  EXPECT_EQ(c.pad_token_id, 0);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.final_logit_softcapping, 0.0);
  // 5 sliding : 1 full, and the last layer (29) full; full layers at the global head dim 512.
  for (int i = 0; i < c.num_layers; ++i) EXPECT_EQ(c.sliding[i], (i + 1) % 6 != 0 && i != 29) << i;
  EXPECT_EQ(c.layer(5).head_dim, 512);
  EXPECT_EQ(c.layer(0).head_dim, 256);
  EXPECT_TRUE(c.rope_full.proportional);
  EXPECT_EQ(c.rope_full.partial_rotary_factor, 0.25);
  EXPECT_EQ(c.rope_full.theta, 1e6);
  EXPECT_EQ(c.rope_sliding.theta, 1e4);
  EXPECT_TRUE(c.warnings.empty());
}

TEST(ModelConfig, NullPadTokenAndVisionEpsOfAMultimodalFile) {
  const Gemma4Config c = Gemma4Config::from_json(
      R"({"model_type": "gemma4", "tie_word_embeddings": false,
          "text_config": {"num_hidden_layers": 2, "pad_token_id": null, "tie_word_embeddings": true},
          "vision_config": {"rms_norm_eps": 0.001}})");
  EXPECT_FALSE(c.pad_token_id.has_value());
  EXPECT_EQ(c.vision_rms_norm_eps, 0.001);
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_FALSE(c.tie_word_embeddings);  // the model class reads the top-level field
  // The forced last layer is reported in transformers' words.
  ASSERT_EQ(c.warnings.size(), 1u);
  EXPECT_EQ(c.warnings[0].rfind("Last layer must use `full_attention`", 0), 0u);
}

TEST(ModelConfig, RopeFactorIgnoredOnDefaultAppliedOnProportionalWithWarnings) {
  const Gemma4Config c = Gemma4Config::from_json(
      R"({"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"], "rope_parameters": {
          "sliding_attention": {"rope_type": "default", "rope_theta": 100.0, "factor": 8.0},
          "full_attention": {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.5,
                             "factor": 2.0}}})");
  EXPECT_EQ(c.rope_sliding.factor, 1.0);
  EXPECT_EQ(c.rope_full.factor, 2.0);
  ASSERT_EQ(c.warnings.size(), 2u);
  EXPECT_EQ(c.warnings[0].rfind("Unrecognized keys in `rope_parameters` for 'rope_type'='default': {'factor'}", 0), 0u);
  EXPECT_EQ(c.warnings[1].rfind("Unrecognized keys in `rope_parameters` for 'rope_type'='proportional': {'factor'}", 0),
            0u);
}

TEST(ModelConfig, MessagesNameFileFieldAndBothTypes) {
  EXPECT_EQ(error_of(R"({"num_hidden_layers": "2"})"),
            R"(dir/config.json: field 'num_hidden_layers' must be an integer, found string "2")");
  EXPECT_EQ(error_of(R"({"text_config": {"rms_norm_eps": [1]}})"),
            "dir/config.json: field 'text_config.rms_norm_eps' must be a number, found array [1]");
  EXPECT_EQ(error_of(R"({"attention_k_eq_v": 1})"),
            "dir/config.json: field 'attention_k_eq_v' must be true or false, found integer 1");
  EXPECT_EQ(error_of(R"({"vocab_size": 3000000000})"),
            "dir/config.json: field 'vocab_size' must be an integer that fits in 32 bits, found integer 3000000000");
  EXPECT_EQ(error_of(R"({"model_type": "llama"})"),
            "dir/config.json: model_type 'llama' is not Gemma 4 (gemma4 or gemma4_text)");
  EXPECT_EQ(error_of("[1, 2]"), "dir/config.json: must hold a JSON object, found array [1,2]");
  EXPECT_EQ(error_of(R"({"per_layer_config": {"1x": {}}})"),
            "dir/config.json: field 'per_layer_config.1x' does not name a layer (per_layer_config keys are layer "
            "indices 0..29)");
  EXPECT_NE(error_of("{").find("dir/config.json: not valid JSON: "), std::string::npos);
  EXPECT_NE(error_of(R"({"pad_token_id": -1})").find("pad_token_id = -1 must be in [0, vocab_size"), std::string::npos);
  // A corrupt layer count fails before the per-layer tables are built from it.
  EXPECT_EQ(error_of(R"({"num_hidden_layers": 1000000000})"),
            "dir/config.json: field 'num_hidden_layers' = 1000000000 must be in [1, 65536]");
  // A per-layer override of 0 or less would read as "no override": it is an error, as in transformers.
  EXPECT_EQ(error_of(R"({"per_layer_config": {"1": {"num_key_value_heads": -2}}})"),
            "dir/config.json: field 'per_layer_config.1.num_key_value_heads' = -2 must be positive");
  EXPECT_EQ(error_of(R"({"per_layer_config": {"1": {"head_dim": 0}}})"),
            "dir/config.json: field 'per_layer_config.1.head_dim' = 0 must be positive");
  EXPECT_EQ(error_of(R"({"global_head_dim": -512})"),
            "dir/config.json: field 'global_head_dim' = -512 must be positive");
  EXPECT_EQ(error_of(std::string("{}\0garbage", 10)), "dir/config.json: byte 2 is a NUL, which JSON text cannot hold");
}

TEST(ModelConfig, NullPadTokenWithImageSlotsNeedingItIsAnError) {
  const std::string config = R"({"vocab_size": 16, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 2,
      "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "global_head_dim": 4,
      "hidden_size_per_layer_input": 2, "vocab_size_per_layer_input": 16, "pad_token_id": null})";
  const Gemma4Model m(Gemma4Config::from_json(config));
  const std::vector<int32_t> ids = {1, 2, 3, 4}, mm = {0, 1, 1, 0};
  const std::vector<float> features(2 * 8, 0.5f);
  Batch b;
  b.B = 1;
  b.S = 4;
  b.input_ids = ids.data();
  b.mm_token_type = mm.data();
  b.image_features = features.data();
  b.n_image_features = 2;
  try {
    m.run(b, RunOptions{});
    FAIL() << "no error";
  } catch (const rf::Error& e) {
    EXPECT_NE(std::string(e.what()).find("pad_token_id is null, but image/video slots read"), std::string::npos);
  }
}

TEST(TensorSet, DeferredRegistersShapesWithoutMemoryUntilAllocated) {
  TensorSet s(TensorSet::Storage::Deferred);
  const size_t big = s.add("big", {int64_t{1} << 20, int64_t{1} << 20});  // 4 TiB if it were allocated
  EXPECT_TRUE(s[big].data.empty());
  EXPECT_EQ(s.total_bytes(), int64_t{4} << 40);
  const size_t small = s.add("small", {3, 2});
  s.allocate(small);
  EXPECT_EQ(s[small].data, std::vector<float>(6, 0.f));
  EXPECT_THROW(s.add("overflow", {int64_t{1} << 40, int64_t{1} << 40}), rf::Error);
}

}  // namespace
}  // namespace rf::model
