// ringflex model: loading and saving Hugging Face Gemma 4 checkpoints through rf_io's safetensors files.
#include "model/checkpoint.h"

#include <algorithm>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/memory.h"
#include "io/atomic_file.h"
#include "io/checkpoint.h"
#include "io/json_text.h"
#include "io/safetensors.h"
#include "io/tensor_access.h"
#include "model/vision.h"

namespace rf::model {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr const char* kCausalLmPrefix = "model.";
constexpr const char* kVisionProjection = VisionEmbedder::kProjection;

// A tensor of the files against what the config implies: its shape, and a floating-point dtype io::to_float32 reads
// (checked here, before allocating, so the line names the file).
void check_shape(const std::vector<int64_t>& shape, const io::TensorView& v, const std::string& file) {
  RF_CHECK(v.shape == shape, file, ": tensor `", v.name, "` has shape ", io::shape_string(v.shape),
           ", the config implies ", io::shape_string(shape));
  const io::StDType t = v.dtype;
  RF_CHECK(t == io::StDType::F32 || t == io::StDType::BF16 || t == io::StDType::F16 || t == io::StDType::F64, file,
           ": tensor `", v.name, "` has dtype ", io::dtype_name(t),
           ", not a floating-point dtype (F32, BF16, F16 or F64)");
}

// Moves the widened values in: one float32 copy of the tensor is alive, not two.
void copy_into(Tensor& dst, const io::TensorView& v, const std::string& file) {
  check_shape(dst.shape, v, file);
  dst.data = io::to_float32(v);
}

// The placeholder tower of a stale checkpoint (checkpoint.h): the projection's width, no encoder layers (only the
// patch embedder's two tensors), the smallest patch and pooling Gemma 4's processor takes.
constexpr int kStalePatch = 4, kStalePooling = 2, kStalePositions = 16, kStaleHeadDim = 4;

void describe_stale_multimodal(Checkpoint& ck, int vision_dim) {
  const json vision = {{"model_type", "gemma4_vision"},
                       {"hidden_size", vision_dim},
                       {"intermediate_size", vision_dim},
                       {"num_hidden_layers", 0},
                       {"num_attention_heads", 1},
                       {"num_key_value_heads", 1},
                       {"head_dim", kStaleHeadDim},
                       {"patch_size", kStalePatch},
                       {"pooling_kernel_size", kStalePooling},
                       {"position_embedding_size", kStalePositions}};
  json root = json::parse(ck.model->config().source_json);  // parsed once already: Gemma4Config::from_json
  if (!root.contains("text_config")) {  // a text model's config becomes the text_config of a multimodal one
    json text = root;
    for (const char* key : {"architectures", "transformers_version", "vision_config", "audio_config"}) text.erase(key);
    text["model_type"] = "gemma4_text";
    root = {{"text_config", text}};
    if (text.contains("tie_word_embeddings")) root["tie_word_embeddings"] = text["tie_word_embeddings"];
  }
  root["architectures"] = {"Gemma4ForConditionalGeneration"};
  root["model_type"] = "gemma4";
  root["vision_config"] = vision;
  ck.config_json = root.dump(2);
  const std::optional<VisionConfig> tower = VisionConfig::from_config_json(ck.config_json, "the re-described config");
  const io::Passthrough fresh = init_vision_tower(*tower, 0);
  for (const io::Passthrough::Entry& e : fresh.entries()) {  // no tower tensor in the files (load_checkpoint)
    const auto* begin = e.bytes.data();
    ck.model->kept().own(e.name, e.dtype, e.shape, std::vector<std::byte>(begin, begin + e.bytes.size()));
  }
  ck.text_prefix = kMultimodalTextPrefix;
}

// The dtypes a store may hold a parameter in as the files have it.
std::optional<HeldDType> held_dtype_of(io::StDType t) {
  switch (t) {
    case io::StDType::F32:
      return HeldDType::F32;
    case io::StDType::BF16:
      return HeldDType::BF16;
    case io::StDType::F16:
      return HeldDType::F16;
    default:
      return std::nullopt;
  }
}

// The rows a parameter holds of its tensor in the files (PlaceParams), one leading row at a time (an expert's
// weights) widened into dst [p.numel]: only those rows' bytes of the mapped file are read.
void read_held_rows(const io::TensorView& v, const ParamInfo& p, float* dst) {
  const int64_t rows = p.shape.at(0);
  if (rows == 0) return;
  const int64_t row = p.numel / rows;
  const auto row_bytes = static_cast<size_t>(row) * io::element_size(v.dtype);
  std::vector<int64_t> row_shape(p.shape.begin() + 1, p.shape.end());
  for (int64_t r = 0; r < rows; ++r) {
    const io::TensorView one{v.name, v.dtype, row_shape,
                             v.bytes.subspan(static_cast<size_t>(p.rows_begin + r) * row_bytes, row_bytes)};
    const std::vector<float> values = io::to_float32(one);
    std::copy(values.begin(), values.end(), dst + r * row);
  }
}

}  // namespace

std::string file_name_of(const std::string& param_name, const std::string& text_prefix) {
  const std::string p = kCausalLmPrefix;
  const bool beside_decoder = param_name == kVisionProjection || param_name.rfind(kVisionTowerPrefix, 0) == 0;
  if (param_name.rfind(p, 0) == 0 && !beside_decoder) return text_prefix + param_name.substr(p.size());
  return param_name;
}

namespace {

// The largest side file carried: Gemma 4's tokenizer.json is ~32 MiB; a file far larger is not a tokenizer or processor
// file (and would be held in memory by every rank from load to the last save).
constexpr std::uintmax_t kMaxSideFileBytes = 256u << 20;

}  // namespace

std::string read_side_file(const std::string& path) {
  std::error_code ec;
  const std::uintmax_t size = fs::file_size(path, ec);
  RF_CHECK(!ec && size <= kMaxSideFileBytes, path, ": ", ec ? ec.message() : std::to_string(size) + " bytes",
           ", more than the ", kMaxSideFileBytes, " a checkpoint's tokenizer or processor file is read with");
  std::ifstream in(path, std::ios::binary);
  RF_CHECK(in.is_open(), path, ": cannot be read");
  std::string bytes(static_cast<size_t>(size), '\0');
  in.read(bytes.data(), static_cast<std::streamsize>(size));
  RF_CHECK(in.gcount() == static_cast<std::streamsize>(size), path, ": cannot be read (", in.gcount(), " of ", size,
           " bytes)");
  return bytes;
}

bool is_side_file(const std::string& name) {
  static const std::set<std::string, std::less<>> kSideFiles = {
      "generation_config.json",  "processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json",
      "special_tokens_map.json", "added_tokens.json",     "chat_template.jinja",      "chat_template.json",
      "tokenizer.json",          "tokenizer_config.json", "tokenizer.model"};
  return kSideFiles.count(name) > 0;
}

namespace {

// The vision projection's width F in `files` (0 without one), its shape checked against the config.
int projection_width(const io::Checkpoint& files, const Gemma4Config& cfg) {
  const io::TensorView* v = files.find(kVisionProjection);
  if (v == nullptr) return 0;
  RF_CHECK(v->rank() == 2 && v->shape[0] == cfg.hidden_size, files.shard_of(kVisionProjection).path(), ": tensor `",
           kVisionProjection, "` has shape ", io::shape_string(v->shape), ", expected [hidden_size = ", cfg.hidden_size,
           ", F]");
  return static_cast<int>(v->shape[1]);
}

// The model of `cfg` (read from `config_path` in `dir`) with a projection of width `vision_dim`, as shapes only.
std::unique_ptr<Gemma4Multimodal> shapes_of(Gemma4Config cfg, const std::string& config_path, int vision_dim,
                                            bool train_vision, const std::string& dir,
                                            std::unique_ptr<ParamStore> store) {
  MultimodalParts parts;
  parts.vision_feature_dim = vision_dim;
  parts.vision = VisionConfig::from_config_json(cfg.source_json, config_path);
  parts.train_vision = train_vision;
  RF_CHECK(!train_vision || parts.vision.has_value(), dir,
           ": model.train_vision, but the config has no vision_config (no vision tower)");
  return std::make_unique<Gemma4Multimodal>(std::move(cfg), std::move(parts), TensorSet::Storage::Deferred,
                                            std::move(store));
}

}  // namespace

bool has_weight_files(const std::string& dir) {
  std::error_code ec;
  return fs::exists(fs::path(dir) / io::Checkpoint::kIndexFile, ec) ||
         fs::exists(fs::path(dir) / io::Checkpoint::kSingleFile, ec);
}

std::unique_ptr<Gemma4Multimodal> checkpoint_shapes(const std::string& dir, bool train_vision,
                                                    std::unique_ptr<ParamStore> store) {
  const fs::path config_path = fs::path(dir) / "config.json";
  RF_CHECK(fs::is_directory(dir), dir, ": not a directory");
  RF_CHECK(fs::exists(config_path), dir, ": no config.json");
  Gemma4Config cfg = Gemma4Config::from_json(io::read_config_file(config_path.string()), config_path.string());
  int vision_dim = 0;
  if (has_weight_files(dir)) {
    vision_dim = projection_width(io::Checkpoint::open(dir), cfg);
  } else if (const std::optional<VisionConfig> vision =
                 VisionConfig::from_config_json(cfg.source_json, config_path.string())) {
    vision_dim = vision->hidden_size;
  }
  return shapes_of(std::move(cfg), config_path.string(), vision_dim, train_vision, dir, std::move(store));
}

Checkpoint load_checkpoint(const std::string& dir, const BeforeAllocating& before_allocating,
                           std::unique_ptr<ParamStore> store, bool train_vision, const PlaceParams& place) {
  const fs::path root(dir);
  RF_CHECK(fs::is_directory(root), dir, ": not a directory");
  const fs::path config_path = root / "config.json";
  RF_CHECK(fs::exists(config_path), dir, ": no config.json");
  Gemma4Config cfg = Gemma4Config::from_json(io::read_config_file(config_path.string()), config_path.string());

  // Shared, because the passthrough tensors borrow their bytes from the mapped files for as long as they live.
  const auto opened = std::make_shared<const io::Checkpoint>(io::Checkpoint::open(dir));
  const io::Checkpoint& files = *opened;

  Checkpoint ck;
  ck.source = dir;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    std::error_code type_ec;  // a dangling link is no side file, not a failure to list the folder
    if (is_side_file(name) && e.is_regular_file(type_ec)) ck.side_files[name] = read_side_file(e.path().string());
  }
  RF_CHECK(!ec, dir, ": cannot list the directory (", ec.message(), ")");
  const std::string embed = "embed_tokens.weight";
  if (files.find(kMultimodalTextPrefix + embed)) ck.text_prefix = kMultimodalTextPrefix;
  // What the config claims is checked against the files before any of it is allocated: the parameters are
  // registered as shapes only, each must be in the files with that shape, and their float32 total must fit the
  // machine. (A 4 KiB checkpoint whose config claims a 262144-token vocabulary fails here, not after 1 GiB.)
  const int vision_dim = projection_width(files, cfg);
  ck.model = shapes_of(std::move(cfg), config_path.string(), vision_dim, train_vision, dir, std::move(store));
  const size_t from_files = ck.model->params().size();
  for (const ParamInfo& p : ck.model->params().infos()) {
    const std::string name = file_name_of(p.name, ck.text_prefix);
    const io::TensorView* v = files.find(name);
    RF_CHECK(v != nullptr, dir, ": no tensor `", name, "` in the checkpoint");
    check_shape(p.shape, *v, files.shard_of(name).path());
  }
  if (before_allocating) before_allocating(*ck.model);
  if (std::unique_ptr<ParamStore> placed = place ? place(*ck.model) : nullptr)
    ck.model->replace_params(std::move(placed));
  ParamStore& params = ck.model->params();
  // A store that holds frozen parameters where the files are mapped (a LoRA base) makes no float32 copy of them.
  if (!params.maps_frozen_weights())
    check_memory(params.resident_weight_bytes(), dir + ": the model's float32 parameters held by this rank");
  params.allocate_weights();
  for (size_t slot = 0; slot < from_files; ++slot) {
    const ParamInfo& p = params.info(slot);
    const io::TensorView& v = *files.find(file_name_of(p.name, ck.text_prefix));
    if (p.holds_part()) {
      read_held_rows(v, p, params.mutable_weight(slot));
      continue;
    }
    if (const std::optional<HeldDType> dtype = held_dtype_of(v.dtype);
        dtype && params.hold_mapped(slot, HeldWeight{*dtype, v.bytes.data()}, opened))
      continue;
    params.load_weight(slot, v);  // into the store's arena; a sharded store keeps its piece alone
  }
  std::set<std::string, std::less<>> held;
  for (const ParamInfo& p : params.infos()) held.insert(file_name_of(p.name, ck.text_prefix));
  for (Tensor& t : ck.model->buffers()) {
    // layer_scalar is a buffer transformers saves; older exports may omit it (then it stays 1).
    const std::string name = file_name_of(t.name, ck.text_prefix);
    if (const io::TensorView* v = files.find(name)) copy_into(t, *v, files.shard_of(name).path());
    held.insert(name);
  }
  for (const std::string& name : files.names())
    if (!held.contains(name)) ck.model->kept().borrow(opened, name);
  ck.model->kept().release_pages();  // the model's tensors were read and widened: their pages are not needed again
  // Stale: the projection without a vision_config, and no tower tensors whose config a placeholder would misstate.
  const bool tower_in_files =
      std::any_of(ck.model->kept().entries().begin(), ck.model->kept().entries().end(),
                  [](const io::Passthrough::Entry& e) { return e.name.rfind(kVisionTowerPrefix, 0) == 0; });
  if (vision_dim > 0 && !tower_in_files && !ck.model->parts().vision) describe_stale_multimodal(ck, vision_dim);
  return ck;
}

namespace {

// One tensor to write: a parameter read from the store, a buffer, or a passthrough tensor.
struct Outgoing {
  std::string name;  // as in the files
  io::StDType dtype = io::StDType::F32;
  std::vector<int64_t> shape;
  uint64_t bytes = 0;
  std::optional<size_t> slot;       // a parameter: read_weight(slot)
  std::span<const std::byte> data;  // otherwise: the bytes as they are
};

// The checkpoint's tensors in transformers' order (parameters, buffers, the rest), split into files of at most
// `max_bytes` of tensor data each (huggingface_hub's split_state_dict_into_shards: a tensor that would take the
// current file past the limit starts the next; one larger than the limit has a file of its own).
std::vector<std::vector<Outgoing>> split_into_files(const Checkpoint& ck, const ParamStore& params, int64_t max_bytes) {
  std::vector<Outgoing> all;
  constexpr uint64_t kF32 = sizeof(float);
  for (size_t slot = 0; slot < params.size(); ++slot) {
    const ParamInfo& p = params.info(slot);
    all.push_back({file_name_of(p.name, ck.text_prefix),
                   io::StDType::F32,
                   p.shape,
                   static_cast<uint64_t>(p.numel) * kF32,
                   slot,
                   {}});
  }
  for (const Tensor& t : ck.model->buffers())
    all.push_back({file_name_of(t.name, ck.text_prefix), io::StDType::F32, t.shape, t.data.size() * kF32, std::nullopt,
                   std::as_bytes(std::span<const float>(t.data))});
  for (const io::Passthrough::Entry& e : ck.model->kept().entries())
    all.push_back({e.name, e.dtype, e.shape, e.bytes.size(), std::nullopt, e.bytes});
  std::set<std::string, std::less<>> names;  // one name in two files would load as whichever the index names
  for (const Outgoing& t : all)
    RF_CHECK(names.insert(t.name).second, "safetensors: tensor `", t.name, "` added twice (the model holds it and ",
             "it is kept from the files as well)");
  std::vector<std::vector<Outgoing>> files;
  std::vector<Outgoing> current;
  uint64_t current_bytes = 0;
  const auto limit = static_cast<uint64_t>(max_bytes);
  for (Outgoing& t : all) {
    if (t.bytes > limit) {  // a file of its own, listed where it was met (huggingface_hub does the same)
      files.push_back({std::move(t)});
      continue;
    }
    if (current_bytes + t.bytes > limit) {
      files.push_back(std::move(current));
      current.clear();
      current_bytes = 0;
    }
    current_bytes += t.bytes;
    current.push_back(std::move(t));
  }
  if (!current.empty()) files.push_back(std::move(current));
  return files;
}

std::string shard_file_name(size_t k, size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", k + 1, n);
  return buf;
}

}  // namespace

void save_checkpoint(const Checkpoint& ck, const std::string& dir, const SaveOptions& options) {
  save_checkpoint(ck, ck.model->params(), dir, options);
}

// `params` is not const: read_weight is a collective under shard full.
void save_checkpoint(const Checkpoint& ck, ParamStore& params, const std::string& dir, const SaveOptions& options) {
  RF_CHECK(options.max_shard_bytes > 0, "checkpoint.max_shard_size must be positive, not ", options.max_shard_bytes);
  const fs::path root(dir);
  const std::vector<std::vector<Outgoing>> files = split_into_files(ck, params, options.max_shard_bytes);
  // One writer a file. A parameter's float32 values are read into the writer's buffer while its turn comes.
  std::vector<io::SafetensorsWriter> writers(files.size());
  for (size_t k = 0; k < files.size(); ++k) {
    io::SafetensorsWriter& w = writers[k];
    w.set_metadata("format", "pt");  // what transformers writes and expects
    for (const Outgoing& t : files[k]) {
      if (!t.slot) {
        w.add(t.name, t.dtype, t.shape, t.data);
        continue;
      }
      const size_t slot = *t.slot;
      w.add_fill(t.name, t.dtype, t.shape, [&params, slot](std::span<std::byte> out) {
        params.read_weight(slot, std::span<float>(reinterpret_cast<float*>(out.data()), out.size() / sizeof(float)));
      });
    }
  }
  if (!options.write) {
    for (const io::SafetensorsWriter& w : writers) w.run_fills();
    return;
  }
  std::error_code ec;
  fs::create_directories(root, ec);
  // The directory check must not leave the other ranks waiting in the reads: they run before the error is thrown.
  const auto run_all_fills_then = [&](size_t from, const std::exception_ptr& failed) {
    for (size_t k = from; k < writers.size(); ++k) writers[k].run_fills();
    std::rethrow_exception(failed);
  };
  try {
    RF_CHECK(!ec, dir, ": cannot create the directory (", ec.message(), ")");
    // Each file is replaced all or nothing (io/atomic_file.h); a whole checkpoint directory is made atomic by
    // its caller (written under a temporary name and renamed).
    io::write_file_atomically((root / "config.json").string(),
                              ck.config_json.empty() ? ck.model->config().source_json : ck.config_json);
    for (const auto& [name, bytes] : ck.side_files) io::write_file_atomically((root / name).string(), bytes);
  } catch (...) {
    run_all_fills_then(0, std::current_exception());
  }
  const fs::path single = root / std::string(io::Checkpoint::kSingleFile);
  const fs::path index = root / std::string(io::Checkpoint::kIndexFile);
  if (writers.size() == 1) {
    writers[0].write(single.string());
    fs::remove(index, ec);  // an index left from an earlier save into this folder would shadow the file
  } else {
    nlohmann::json weight_map = nlohmann::json::object();
    uint64_t total = 0;
    for (size_t k = 0; k < writers.size(); ++k) {
      const std::string name = shard_file_name(k, writers.size());
      try {
        writers[k].write((root / name).string());
      } catch (...) {
        run_all_fills_then(k + 1, std::current_exception());
      }
      for (const Outgoing& t : files[k]) {
        weight_map[t.name] = name;
        total += t.bytes;
      }
    }
    // Last, so a folder with an index always has every shard the index names.
    const nlohmann::json j = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    io::write_file_atomically(index.string(), j.dump(2) + "\n");
    fs::remove(single, ec);  // the loader takes the index; a single file left from an earlier save is stale
  }
  ck.model->kept().release_pages();
}

}  // namespace rf::model
