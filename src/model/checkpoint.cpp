// ringflex model: loading and saving Hugging Face Gemma 4 checkpoints through rf_io's safetensors files.
#include "model/checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include "core/error.h"
#include "io/atomic_file.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "io/tensor_access.h"

namespace rf::model {

namespace fs = std::filesystem;

namespace {

constexpr const char* kCausalLmPrefix = "model.";
constexpr const char* kMultimodalPrefix = "model.language_model.";
constexpr const char* kVisionProjection = "model.embed_vision.embedding_projection.weight";

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  RF_CHECK(in.good(), p.string(), ": cannot be read");
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void copy_into(Tensor& dst, const io::TensorView& v, const std::string& file) {
  RF_CHECK(v.shape == dst.shape, file, ": tensor `", v.name, "` has shape ", io::shape_string(v.shape),
           ", the config implies ", io::shape_string(dst.shape));
  const std::vector<float> values = io::to_float32(v);
  std::copy(values.begin(), values.end(), dst.data.begin());
}

}  // namespace

std::string file_name_of(const std::string& param_name, const std::string& text_prefix) {
  const std::string p = kCausalLmPrefix;
  if (param_name.rfind(p, 0) == 0 && param_name != kVisionProjection) return text_prefix + param_name.substr(p.size());
  return param_name;
}

Checkpoint load_checkpoint(const std::string& dir) {
  const fs::path root(dir);
  RF_CHECK(fs::is_directory(root), dir, ": not a directory");
  const fs::path config_path = root / "config.json";
  RF_CHECK(fs::exists(config_path), dir, ": no config.json");
  Gemma4Config cfg = Gemma4Config::from_json(read_text(config_path));

  const io::Checkpoint files = io::Checkpoint::open(dir);

  Checkpoint ck;
  const std::string embed = "embed_tokens.weight";
  if (files.find(kMultimodalPrefix + embed)) ck.text_prefix = kMultimodalPrefix;
  int vision_dim = 0;
  if (const io::TensorView* v = files.find(kVisionProjection)) {
    RF_CHECK(v->rank() == 2 && v->shape[0] == cfg.hidden_size, files.shard_of(kVisionProjection).path(),
             ": tensor `", kVisionProjection, "` has shape ", io::shape_string(v->shape),
             ", expected [hidden_size = ", cfg.hidden_size, ", F]");
    vision_dim = static_cast<int>(v->shape[1]);
  }
  ck.model = std::make_unique<Gemma4Model>(std::move(cfg), vision_dim);
  for (Tensor& t : ck.model->params()) {
    const std::string name = file_name_of(t.name, ck.text_prefix);
    const io::TensorView* v = files.find(name);
    RF_CHECK(v != nullptr, dir, ": no tensor `", name, "` in the checkpoint");
    copy_into(t, *v, files.shard_of(name).path());
  }
  for (Tensor& t : ck.model->buffers()) {
    // layer_scalar is a buffer transformers saves; older exports may omit it (then it stays 1).
    const std::string name = file_name_of(t.name, ck.text_prefix);
    if (const io::TensorView* v = files.find(name)) copy_into(t, *v, files.shard_of(name).path());
  }
  return ck;
}

void save_checkpoint(const Checkpoint& ck, const std::string& dir) {
  const fs::path root(dir);
  std::error_code ec;
  fs::create_directories(root, ec);
  RF_CHECK(!ec, dir, ": cannot create the directory (", ec.message(), ")");
  // Each file is replaced all or nothing (io/atomic_file.h); a whole checkpoint directory is made atomic by
  // its caller (written under a temporary name and renamed).
  io::write_file_atomically((root / "config.json").string(), ck.model->config().source_json);
  io::SafetensorsWriter w;
  w.set_metadata("format", "pt");  // what transformers writes and expects
  for (const TensorSet* set : {&ck.model->params(), &ck.model->buffers()}) {
    for (const Tensor& t : *set) {
      w.add(file_name_of(t.name, ck.text_prefix), io::StDType::F32, t.shape, std::span<const float>(t.data));
    }
  }
  w.write((root / std::string(io::Checkpoint::kSingleFile)).string());
}

}  // namespace rf::model
