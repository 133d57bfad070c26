// Tests of Hugging Face checkpoint saving and loading: a saved random model loads back with the same parameters,
// buffers, config and outputs, and a checkpoint whose tensor disagrees with its config fails naming the tensor.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/error_of.h"
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
  ck.model = std::make_unique<Gemma4Multimodal>(Gemma4Config::from_json(kConfig), MultimodalParts{3});
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
  ck.model = std::make_unique<Gemma4Multimodal>(Gemma4Config::from_json(kConfig));
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
  ck.model = std::make_unique<Gemma4Multimodal>(Gemma4Config::from_json(kConfig));
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

// A parameter stored as integers (its bytes the right count for its shape) is refused before allocating, naming the
// file; io::to_float32 would otherwise fail later without it.
TEST(ModelCheckpoint, AnIntegerParameterIsRefusedNamingTheFile) {
  Checkpoint ck;
  ck.model = std::make_unique<Gemma4Multimodal>(Gemma4Config::from_json(kConfig));
  const fs::path dir = scratch("int_param");
  save_checkpoint(ck, dir.string());
  const std::string file = (dir / "model.safetensors").string();
  io::SafetensorsWriter w;
  std::vector<std::vector<std::byte>> keep;
  {
    const io::SafetensorsFile f = io::SafetensorsFile::open(file);
    for (const io::TensorView& v : f.tensors()) {
      keep.emplace_back(v.bytes.begin(), v.bytes.end());
      const bool as_int = v.name == "model.layers.0.input_layernorm.weight";
      w.add(v.name, as_int ? io::StDType::I32 : v.dtype, v.shape, keep.back());
    }
  }
  w.write(file);
  const std::string message = testing::error_of([&] { load_checkpoint(dir.string()); });
  EXPECT_EQ(message, file +
                         ": tensor `model.layers.0.input_layernorm.weight` has dtype I32, not a floating-point "
                         "dtype (F32, BF16, F16 or F64)");
  fs::remove_all(dir);
}

// Tensors the model does not hold (a tower, an unknown name) come back from load + save with the same name, dtype,
// shape and bytes: a bf16 NaN payload, -0, an int8 tensor, a scalar and an empty tensor, none of which survive a
// round trip through float32 unnoticed. The source directory is deleted before the save: the kept tensors are
// mapped, and a mapping outlives its file (keep-last-K may delete the checkpoint a run resumed from).
TEST(ModelCheckpoint, ForeignTensorsComeBackBitForBit) {
  Checkpoint ck;
  ck.model = std::make_unique<Gemma4Multimodal>(Gemma4Config::from_json(kConfig), MultimodalParts{3});
  ck.model->init_random(7, 0.2f);
  const std::vector<uint16_t> bf16 = {0x7fc1, 0x8000, 0x3f80, 0xff81, 0x0001, 0x7f80};  // NaN payloads, -0, 1, ...
  const std::vector<int8_t> i8 = {-128, 0, 127, 5};
  const float scalar = -std::numeric_limits<float>::infinity();
  std::vector<std::byte> bf16_bytes(bf16.size() * 2), i8_bytes(i8.size()), scalar_bytes(sizeof scalar);
  std::memcpy(bf16_bytes.data(), bf16.data(), bf16_bytes.size());
  std::memcpy(i8_bytes.data(), i8.data(), i8_bytes.size());
  std::memcpy(scalar_bytes.data(), &scalar, sizeof scalar);
  ck.model->kept().own("model.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight", io::StDType::BF16, {2, 3},
                       bf16_bytes);
  ck.model->kept().own("model.audio_tower.some_new_name", io::StDType::I8, {4}, i8_bytes);
  ck.model->kept().own("model.vision_tower.encoder.layers.0.mlp.up_proj.input_min", io::StDType::F32, {}, scalar_bytes);
  ck.model->kept().own("model.embed_audio.empty", io::StDType::F16, {0, 5}, {});
  const fs::path first = scratch("foreign_a"), second = scratch("foreign_b");
  save_checkpoint(ck, first.string());

  std::unique_ptr<Checkpoint> back = std::make_unique<Checkpoint>(load_checkpoint(first.string()));
  ASSERT_EQ(back->model->kept().size(), 4u);
  fs::remove_all(first);
  save_checkpoint(*back, second.string());
  back.reset();
  const io::SafetensorsFile f = io::SafetensorsFile::open((second / "model.safetensors").string());
  for (const io::Passthrough::Entry& e : ck.model->kept().entries()) {
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

// Above checkpoint.max_shard_size the weights go into model-0000k-of-0000n.safetensors and an index, split as
// huggingface_hub splits (tensors in order, a file closed before a tensor that would take it past the limit, a tensor
// larger than the limit alone): every tensor in the file the index names and nowhere else, total_size the sum of the
// tensors' bytes, each file within the limit unless it holds one larger tensor, and no file that the next file's first
// tensor would still have fitted. The folder loads back bit for bit; saving it again in one file drops the index (it
// would shadow the new file), and the sharded save drops a stale single file.
TEST(ModelCheckpoint, SplitsIntoIndexedFilesAboveTheLimit) {
  Checkpoint ck;
  ck.model = std::make_unique<Gemma4Multimodal>(Gemma4Config::from_json(kConfig), MultimodalParts{3});
  ck.model->init_random(8, 0.2f);
  ck.model->kept().own("model.vision_tower.big", io::StDType::BF16, {300}, std::vector<std::byte>(600, std::byte{7}));
  const fs::path dir = scratch("split");
  save_checkpoint(ck, dir.string());  // one file first: the sharded save must drop it
  ASSERT_TRUE(fs::exists(dir / "model.safetensors"));
  constexpr int64_t kLimit = 500;  // bytes: several tensors a file, the 600-byte tower tensor and the embeddings alone
  SaveOptions options;
  options.max_shard_bytes = kLimit;
  save_checkpoint(ck, dir.string(), options);
  EXPECT_FALSE(fs::exists(dir / "model.safetensors"));
  std::ifstream in(dir / "model.safetensors.index.json");
  const nlohmann::json index = nlohmann::json::parse(in);
  const auto& map = index.at("weight_map");
  std::map<std::string, std::vector<std::string>> by_file;
  for (const auto& [name, file] : map.items()) by_file[file.get<std::string>()].push_back(name);
  const size_t n = by_file.size();
  ASSERT_GT(n, 3u);
  uint64_t total = 0;
  std::vector<uint64_t> file_bytes, first_bytes;
  size_t k = 1;
  for (const auto& [file, names] : by_file) {  // sorted by name: file k of n in order
    char expected[64];
    std::snprintf(expected, sizeof expected, "model-%05zu-of-%05zu.safetensors", k++, n);
    EXPECT_EQ(file, expected);
    const io::SafetensorsFile f = io::SafetensorsFile::open((dir / file).string());
    EXPECT_EQ(f.tensors().size(), names.size()) << file << " holds tensors the index does not name";
    EXPECT_EQ(f.metadata().at("format"), "pt");
    uint64_t bytes = 0;
    for (const std::string& name : names) {
      ASSERT_NE(f.find(name), nullptr) << name << " is not in " << file;
      bytes += f.find(name)->bytes.size();
    }
    EXPECT_TRUE(bytes <= kLimit || names.size() == 1) << file << " holds " << bytes << " bytes";
    total += bytes;
  }
  EXPECT_EQ(index.at("metadata").at("total_size").get<uint64_t>(), total);
  const Checkpoint back = load_checkpoint(dir.string());
  const TensorSet written = ck.model->params().snapshot(Role::Weights),
                  read = back.model->params().snapshot(Role::Weights);
  ASSERT_EQ(read.size(), written.size());
  for (size_t i = 0; i < written.size(); ++i) EXPECT_EQ(read[i].data, written[i].data) << written[i].name;
  ASSERT_NE(back.model->kept().find("model.vision_tower.big"), nullptr);
  EXPECT_EQ(back.model->buffers()[0].data, ck.model->buffers()[0].data);

  save_checkpoint(ck, dir.string());  // one file again: the index must go, or it would shadow it
  EXPECT_FALSE(fs::exists(dir / "model.safetensors.index.json"));
  EXPECT_EQ(load_checkpoint(dir.string()).model->params().snapshot(Role::Weights)[0].data, written[0].data);
  fs::remove_all(dir);
}

// The greedy order of the split: each file closes only when the next tensor would not fit it, so no two consecutive
// files of small tensors could have been one (checked on a model whose tensors are all far below the limit).
TEST(ModelCheckpoint, SplitClosesAFileOnlyWhenTheNextTensorDoesNotFit) {
  Checkpoint ck;
  ck.model = std::make_unique<Gemma4Multimodal>(Gemma4Config::from_json(kConfig));
  const fs::path dir = scratch("split_greedy");
  SaveOptions options;
  // Above every tensor of kConfig: the largest, the full-attention layer's q_proj and o_proj ([2 heads x Gemma 4's
  // default global_head_dim 512, 8] float32), are 32768 bytes; the model's ~110 KB make a few files.
  constexpr uint64_t kLimit = 40000;
  options.max_shard_bytes = kLimit;
  save_checkpoint(ck, dir.string(), options);
  std::ifstream in(dir / "model.safetensors.index.json");
  const nlohmann::json index = nlohmann::json::parse(in);
  // Each file's bytes, and each tensor's file and bytes in the model's order (parameters as registered, then buffers).
  std::vector<std::string> order;
  for (const ParamInfo& p : ck.model->params().infos()) order.push_back(p.name);
  for (const Tensor& t : ck.model->buffers()) order.push_back(t.name);
  std::map<std::string, uint64_t> bytes_of_file;
  std::vector<std::pair<std::string, uint64_t>> sequence;  // (file, bytes) in the model's order
  for (const std::string& name : order) {
    const std::string file = index.at("weight_map").at(name).get<std::string>();
    const io::SafetensorsFile f = io::SafetensorsFile::open((dir / file).string());
    const uint64_t b = f.find(name)->bytes.size();
    bytes_of_file[file] += b;
    sequence.emplace_back(file, b);
  }
  for (size_t i = 1; i < sequence.size(); ++i) {
    if (sequence[i].first == sequence[i - 1].first) continue;
    EXPECT_GT(bytes_of_file[sequence[i - 1].first] + sequence[i].second, kLimit)
        << order[i] << " would have fitted in " << sequence[i - 1].first;
    EXPECT_GT(sequence[i].first, sequence[i - 1].first) << "the files follow the model's order at " << order[i];
  }
  fs::remove_all(dir);
}

// A foreign tensor named like one of the model's would be written twice: the save refuses rather than pick one.
TEST(ModelCheckpoint, AForeignNameTheModelHoldsIsRefused) {
  Checkpoint ck;
  ck.model = std::make_unique<Gemma4Multimodal>(Gemma4Config::from_json(kConfig));
  ck.model->kept().own("model.norm.weight", io::StDType::F32, {8}, std::vector<std::byte>(8 * sizeof(float)));
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

// The multimodal model is transformers' parts in one store, in its save order: the decoder's parameters (the vision
// projection no longer among them), the embedder's projection, then with train_vision the tower's parameters. The
// tower's buffers stay kept (outside the store), and the tower the model builds reads its parameters from the store.
TEST(ModelMultimodal, PartsInOneStoreInTransformersOrder) {
  const std::string json = R"({"model_type": "gemma4", "vision_config": {"hidden_size": 16, "intermediate_size": 32,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8, "patch_size": 4,
    "position_embedding_size": 32, "use_clipped_linears": true}})";
  const VisionConfig vc = VisionConfig::from_config_json(json, "test").value();
  const Gemma4Config text = Gemma4Config::from_json(kConfig);
  const Gemma4Model decoder(text);
  Gemma4Multimodal m(text, MultimodalParts(vc.hidden_size, vc, true));
  const ParamStore& all = m.params();
  const size_t D = decoder.params().size();
  EXPECT_FALSE(decoder.params().contains(VisionEmbedder::kProjection));
  for (size_t i = 0; i < D; ++i) EXPECT_EQ(all.info(i).name, decoder.params().info(i).name);
  ASSERT_NE(m.embed_vision(), nullptr);
  EXPECT_EQ(m.embed_vision()->slot(), D);
  EXPECT_EQ(all.info(D).name, VisionEmbedder::kProjection);
  EXPECT_EQ(all.info(D).shape, (std::vector<int64_t>{text.hidden_size, vc.hidden_size}));
  std::vector<std::string> tower;
  for (const TowerTensor& t : vision_tower_tensors(vc))
    if (t.parameter) tower.push_back(kVisionTowerPrefix + t.name);
  ASSERT_EQ(all.size(), D + 1 + tower.size());
  for (size_t i = 0; i < tower.size(); ++i) EXPECT_EQ(all.info(D + 1 + i).name, tower[i]);
  // A fresh tower in kept(), its parameters adopted into the store: kept() keeps its buffers (the clip bounds).
  m.kept() = init_vision_tower(vc, 3);
  const size_t kept_before = m.kept().size();
  m.adopt_tower_parameters();
  EXPECT_EQ(m.kept().size(), kept_before - tower.size());
  EXPECT_GT(m.kept().size(), 0u);
  for (const std::string& name : tower) EXPECT_EQ(m.kept().find(name), nullptr);
  const VisionEncoder* built = m.vision_tower();
  ASSERT_NE(built, nullptr);
  EXPECT_EQ(built->config().hidden_size, vc.hidden_size);
  // Without a vision config there is no tower, and without a feature width no embedder.
  Gemma4Multimodal text_only(text);
  EXPECT_EQ(text_only.vision_tower(), nullptr);
  EXPECT_EQ(text_only.embed_vision(), nullptr);
  EXPECT_EQ(text_only.params().size(), D);
  EXPECT_EQ(text_only.image_feature_width(), text.hidden_size);
}

}  // namespace
}  // namespace rf::model
