// Tests of Hugging Face checkpoint saving and loading: a saved random model loads back with the same parameters,
// buffers, config and outputs, and a checkpoint whose tensor disagrees with its config fails naming the tensor.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "core/error.h"
#include "io/safetensors.h"
#include "model/checkpoint.h"

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

}  // namespace
}  // namespace rf::model
