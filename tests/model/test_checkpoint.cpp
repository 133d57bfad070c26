// Tests of Hugging Face checkpoint saving and loading: a saved random model loads back with the same parameters,
// buffers, config and outputs, and a checkpoint whose tensor disagrees with its config fails naming the tensor.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/safetensors.h"
#include "model/checkpoint.h"
#include "model/vision.h"

namespace rf::model {
namespace {

namespace fs = std::filesystem;

const char* kConfig = R"({"vocab_size": 24, "hidden_size": 8, "intermediate_size": 12, "num_hidden_layers": 2,
  "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "sliding_window": 3,
  "layer_types": ["sliding_attention", "full_attention"], "hidden_size_per_layer_input": 2,
  "vocab_size_per_layer_input": 24, "final_logit_softcapping": 5.0})";

fs::path scratch(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("rf_model_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p;
}

TEST(ModelCheckpoint, SaveThenLoadRoundTrips) {
  Checkpoint ck;
  ck.model = std::make_unique<Gemma4Model>(Gemma4Config::from_json(kConfig), 3);
  ck.model->init_random(5, 0.2f);
  ck.model->buffers()[0].data[0] = 0.75f;  // layer 0's layer_scalar
  const fs::path dir = scratch("roundtrip");
  save_checkpoint(ck, dir.string());
  const Checkpoint back = load_checkpoint(dir.string());
  EXPECT_EQ(back.model->config().source_json, kConfig);
  EXPECT_EQ(back.model->vision_feature_dim(), 3);
  ASSERT_EQ(back.model->params().size(), ck.model->params().size());
  const TensorSet written = ck.model->params().snapshot(Role::Weights),
                  read = back.model->params().snapshot(Role::Weights);
  for (size_t i = 0; i < written.size(); ++i) {
    EXPECT_EQ(read[i].name, written[i].name);
    EXPECT_EQ(read[i].data, written[i].data);  // float32 written and read: exact
  }
  EXPECT_EQ(back.model->buffers()[0].data[0], 0.75f);
  fs::remove_all(dir);
}

TEST(ModelCheckpoint, ReadsTheMultimodalPrefix) {
  Checkpoint ck;
  ck.model = std::make_unique<Gemma4Model>(Gemma4Config::from_json(kConfig));
  ck.model->init_random(6, 0.2f);
  ck.text_prefix = "model.language_model.";
  const fs::path dir = scratch("prefix");
  save_checkpoint(ck, dir.string());
  const io::SafetensorsFile f = io::SafetensorsFile::open((dir / "model.safetensors").string());
  EXPECT_NE(f.find("model.language_model.layers.0.self_attn.q_proj.weight"), nullptr);
  const Checkpoint back = load_checkpoint(dir.string());
  EXPECT_EQ(back.text_prefix, "model.language_model.");
  EXPECT_EQ(back.model->params().snapshot(Role::Weights)[0].data, ck.model->params().snapshot(Role::Weights)[0].data);
  fs::remove_all(dir);
}

TEST(ModelCheckpoint, ShapeAgainstConfigNamesTheTensor) {
  Checkpoint ck;
  ck.model = std::make_unique<Gemma4Model>(Gemma4Config::from_json(kConfig));
  const fs::path dir = scratch("shape");
  save_checkpoint(ck, dir.string());
  // The same tensors under a config with a wider MLP: the MLP weights no longer fit.
  std::string wider = kConfig;
  wider.replace(wider.find("\"intermediate_size\": 12"), 23, "\"intermediate_size\": 16");
  {
    std::ofstream out(dir / "config.json");
    out << wider;
  }
  try {
    load_checkpoint(dir.string());
    FAIL() << "no error";
  } catch (const rf::Error& e) {
    EXPECT_NE(std::string(e.what()).find("mlp.gate_proj.weight"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

// Tensors the model does not hold (a tower, an unknown name) come back from load + save with the same name, dtype,
// shape and bytes: a bf16 NaN payload, -0, an int8 tensor, a scalar and an empty tensor, none of which survive a
// round trip through float32 unnoticed. The source directory is deleted before the save: the kept tensors are
// mapped, and a mapping outlives its file (keep-last-K may delete the checkpoint a run resumed from).
TEST(ModelCheckpoint, ForeignTensorsComeBackBitForBit) {
  Checkpoint ck;
  ck.model = std::make_unique<Gemma4Model>(Gemma4Config::from_json(kConfig), 3);
  ck.model->init_random(7, 0.2f);
  const std::vector<uint16_t> bf16 = {0x7fc1, 0x8000, 0x3f80, 0xff81, 0x0001, 0x7f80};  // NaN payloads, -0, 1, ...
  const std::vector<int8_t> i8 = {-128, 0, 127, 5};
  const float scalar = -std::numeric_limits<float>::infinity();
  std::vector<std::byte> bf16_bytes(bf16.size() * 2), i8_bytes(i8.size()), scalar_bytes(sizeof scalar);
  std::memcpy(bf16_bytes.data(), bf16.data(), bf16_bytes.size());
  std::memcpy(i8_bytes.data(), i8.data(), i8_bytes.size());
  std::memcpy(scalar_bytes.data(), &scalar, sizeof scalar);
  ck.passthrough.own("model.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight", io::StDType::BF16, {2, 3},
                     bf16_bytes);
  ck.passthrough.own("model.audio_tower.some_new_name", io::StDType::I8, {4}, i8_bytes);
  ck.passthrough.own("model.vision_tower.encoder.layers.0.mlp.up_proj.input_min", io::StDType::F32, {}, scalar_bytes);
  ck.passthrough.own("model.embed_audio.empty", io::StDType::F16, {0, 5}, {});
  const fs::path first = scratch("foreign_a"), second = scratch("foreign_b");
  save_checkpoint(ck, first.string());

  std::unique_ptr<Checkpoint> back = std::make_unique<Checkpoint>(load_checkpoint(first.string()));
  ASSERT_EQ(back->passthrough.size(), 4u);
  fs::remove_all(first);
  save_checkpoint(*back, second.string());
  back.reset();
  const io::SafetensorsFile f = io::SafetensorsFile::open((second / "model.safetensors").string());
  for (const io::Passthrough::Entry& e : ck.passthrough.entries()) {
    const io::TensorView* v = f.find(e.name);
    ASSERT_NE(v, nullptr) << e.name;
    EXPECT_EQ(v->dtype, e.dtype) << e.name;
    EXPECT_EQ(v->shape, e.shape) << e.name;
    ASSERT_EQ(v->bytes.size(), e.bytes.size()) << e.name;
    EXPECT_EQ(std::memcmp(v->bytes.data(), e.bytes.data(), e.bytes.size()), 0) << e.name;
  }
  // And nothing else: the model's own tensors plus the four.
  EXPECT_EQ(f.tensors().size(), ck.model->params().size() + ck.model->buffers().size() + 4);
  fs::remove_all(second);
}

// A foreign tensor named like one of the model's would be written twice: the save refuses rather than pick one.
TEST(ModelCheckpoint, AForeignNameTheModelHoldsIsRefused) {
  Checkpoint ck;
  ck.model = std::make_unique<Gemma4Model>(Gemma4Config::from_json(kConfig));
  ck.passthrough.own("model.norm.weight", io::StDType::F32, {8}, std::vector<std::byte>(8 * sizeof(float)));
  const fs::path dir = scratch("foreign_clash");
  try {
    save_checkpoint(ck, dir.string());
    FAIL() << "no error";
  } catch (const rf::Error& e) {
    EXPECT_NE(std::string(e.what()).find("`model.norm.weight` added twice"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

// The tower ringflex writes for a vision_config has transformers' names and count: 45 tensors for one layer with
// clipped linears and standardize (4 norms, 7 linears of 1 weight + 4 clip bounds, q/k norms, the patch
// projection, the position table, std_bias, std_scale), as transformers 5.24 saves Gemma4VisionModel; without
// either knob, the 7 linears' 28 bounds and the 2 std buffers go.
TEST(ModelCheckpoint, VisionTowerTensorsAreTransformers) {
  const std::string json = R"({"model_type": "gemma4", "vision_config": {"hidden_size": 16, "intermediate_size": 32,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8, "patch_size": 4,
    "position_embedding_size": 32, "standardize": true, "use_clipped_linears": true}})";
  const VisionConfig c = VisionConfig::from_config_json(json, "test").value();
  const std::vector<TowerTensor> all = vision_tower_tensors(c);
  EXPECT_EQ(all.size(), 45u);
  VisionConfig plain = c;
  plain.standardize = plain.use_clipped_linears = false;
  EXPECT_EQ(vision_tower_tensors(plain).size(), 45u - 28u - 2u);
  const io::Passthrough tower = init_vision_tower(c, 1);
  const io::Passthrough::Entry* table = tower.find("model.vision_tower.patch_embedder.position_embedding_table");
  ASSERT_NE(table, nullptr);
  EXPECT_EQ(table->shape, (std::vector<int64_t>{2, 32, 16}));
  const io::Passthrough::Entry* proj = tower.find("model.vision_tower.patch_embedder.input_proj.weight");
  ASSERT_NE(proj, nullptr);
  EXPECT_EQ(proj->shape, (std::vector<int64_t>{16, 3 * 4 * 4}));
  const io::Passthrough::Entry* k = tower.find("model.vision_tower.encoder.layers.0.self_attn.k_proj.linear.weight");
  ASSERT_NE(k, nullptr);
  EXPECT_EQ(k->shape, (std::vector<int64_t>{2 * 8, 16}));
  EXPECT_FALSE(VisionConfig::from_config_json(R"({"model_type": "gemma4_text"})", "test").has_value());
  try {
    VisionConfig::from_config_json(R"({"vision_config": {"patch_size": 0}})", "cfg.json");
    FAIL() << "no error";
  } catch (const rf::Error& e) {
    EXPECT_EQ(std::string(e.what()), "cfg.json: field 'vision_config.patch_size' must be a positive integer, found 0");
  }
}

}  // namespace
}  // namespace rf::model
