// ringflex model: a LoRA store's adapters in PEFT's files, written and read (see peft_files.h).
#include "model/peft_files.h"

#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/atomic_file.h"
#include "io/json_text.h"
#include "io/safetensors.h"
#include "io/tensor_access.h"
#include "model/checkpoint.h"
#include "model/expert_store.h"

namespace rf::model {

namespace {

constexpr const char* kPeftPrefix = "base_model.model.";
constexpr const char* kLoraASuffix = ".lora_A.weight";
// Where the decoder's modules live in a multimodal checkpoint and in a text-only one (model/checkpoint.h).
constexpr const char* kMultimodalText = "model.language_model.";
constexpr const char* kText = "model.";

// A PEFT tensor name of an adapter slot ("model.layers.0.self_attn.q_proj.lora_A.weight").
std::string peft_name(const std::string& slot_name, const std::string& text_prefix) {
  return kPeftPrefix + file_name_of(slot_name, text_prefix);
}

// The ringflex name of a PEFT tensor name, whichever layout it was written in; empty when it is no adapter of the
// text model.
std::string slot_name_of(const std::string& peft) {
  const std::string prefix = kPeftPrefix;
  if (!peft.starts_with(prefix)) return {};
  const std::string rest = peft.substr(prefix.size());
  for (const std::string text : {kMultimodalText, kText})
    if (rest.starts_with(text)) return kText + rest.substr(text.size());
  return {};
}

}  // namespace

void save_peft_adapter(const LoraStore& store, const std::string& text_prefix, const std::string& base_model,
                       const std::string& dir) {
  namespace fs = std::filesystem;
  const LoraConfig& c = store.config();
  std::vector<std::string> modules, parameters;
  io::SafetensorsWriter w;
  w.set_metadata("format", "pt");
  for (const LoraStore::Adapter& a : store.adapters()) {
    if (a.experts_weight)
      parameters.push_back(file_name_of(store.info(a.base).name, text_prefix));
    else
      modules.push_back(file_name_of(module_of(store.info(a.base).name), text_prefix));
    for (size_t slot : {a.a, a.b}) {
      const ParamInfo& p = store.info(slot);
      RF_CHECK(!p.holds_part(), "save: ", p.name, " holds experts' rows only; save whole_adapters()");
      // In PEFT's layout, reordered while the file is written.
      w.add_fill(peft_name(p.name, text_prefix), io::StDType::F32, store.file_shape(slot),
                 [&store, slot, n = p.numel](std::span<std::byte> out) {
                   store.to_file_layout(slot, std::span<const float>(store.weight(slot), static_cast<size_t>(n)),
                                        std::span<float>(reinterpret_cast<float*>(out.data()), static_cast<size_t>(n)));
                 });
    }
  }
  // PEFT's LoraConfig fields; those left out take PEFT's defaults, which are what ringflex computes (no bias, no
  // DoRA, fan_in_fan_out false).
  const nlohmann::json j = {{"peft_type", "LORA"},
                            {"task_type", "CAUSAL_LM"},
                            {"base_model_name_or_path", base_model},
                            {"r", c.rank},
                            {"lora_alpha", c.alpha},
                            {"lora_dropout", c.dropout},
                            {"use_rslora", c.use_rslora},
                            {"target_modules", modules},
                            {"target_parameters", parameters},
                            {"bias", "none"},
                            {"fan_in_fan_out", false},
                            {"init_lora_weights", true},
                            {"use_dora", false},
                            {"inference_mode", true},
                            {"modules_to_save", nullptr}};
  io::write_file_atomically((fs::path(dir) / kPeftConfigFile).string(), j.dump(2) + "\n");
  w.write((fs::path(dir) / kPeftWeightsFile).string());
}

LoraConfig read_peft_config(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path config_path = fs::path(dir) / kPeftConfigFile;
  RF_CHECK(fs::exists(config_path), dir, ": no ", kPeftConfigFile);
  const nlohmann::json j = io::parse_json(io::read_config_file(config_path.string()), config_path.string());
  LoraConfig c;
  try {
    RF_CHECK(j.value("peft_type", std::string()) == "LORA", config_path.string(), ": peft_type is not LORA");
    // get<int> would truncate 2.5 to 2 and wrap 2^32 + 1 to 1.
    const nlohmann::json& r = j.at("r");
    RF_CHECK(r.is_number_integer() &&
                 (r.is_number_unsigned() ? r.get<uint64_t>() <= uint64_t{INT32_MAX} : r.get<int64_t>() >= INT32_MIN),
             config_path.string(), ": r = ", r.dump(), " is not an integer rank");
    c.rank = r.get<int>();
    const nlohmann::json& alpha = j.at("lora_alpha");
    RF_CHECK(alpha.is_number(), config_path.string(), ": lora_alpha = ", alpha.dump(), " is not a number");
    c.alpha = alpha.get<double>();
    c.dropout = j.value("lora_dropout", 0.0);
    c.use_rslora = j.value("use_rslora", false);
    RF_CHECK(!j.value("use_dora", false), config_path.string(), ": use_dora is not implemented");
  } catch (const nlohmann::json::exception& e) {
    rf::fail(config_path.string(), ": ", io::json_error_text(e.what()));
  }
  // Inference on an adapter: dropout is off whatever it trained with.
  c.dropout = 0.0;
  const io::SafetensorsFile file = io::SafetensorsFile::open((fs::path(dir) / kPeftWeightsFile).string());
  c.target.clear();
  for (const io::TensorView& v : file.tensors()) {
    const std::string slot = slot_name_of(v.name);
    // The experts' adapters come from target_parameters (their module is the experts module, or a ParamWrapper's
    // base_layer inside it).
    if (!slot.ends_with(kLoraASuffix) || slot.find(".experts.") != std::string::npos) continue;
    // A linear layer's A is [r, in]: an r the tensors do not have would size every adapter by it before the shapes
    // are checked (r = 2e9 ended in std::bad_alloc).
    RF_CHECK(v.rank() == 2 && v.shape[0] == c.rank, dir, "/", kPeftWeightsFile, ": tensor `", v.name, "` has shape ",
             io::shape_string(v.shape), ", but ", kPeftConfigFile, " gives r = ", c.rank);
    c.target.push_back(slot.substr(0, slot.size() - std::string(kLoraASuffix).size()));
  }
  try {
    if (j.contains("target_parameters") && j.at("target_parameters").is_array())
      for (const auto& name : j.at("target_parameters")) {
        const std::string n = name.get<std::string>();
        c.target_parameters.push_back(
            n.starts_with(kMultimodalText) ? kText + n.substr(std::string(kMultimodalText).size()) : n);
      }
  } catch (const nlohmann::json::exception& e) {
    rf::fail(config_path.string(), ": target_parameters: ", io::json_error_text(e.what()));
  }
  RF_CHECK(!c.target.empty() || !c.target_parameters.empty(), dir, "/", kPeftWeightsFile,
           ": no lora_A tensor of the text model");
  c.validate();
  return c;
}

void load_peft_adapter(LoraStore& store, const std::string& dir) {
  namespace fs = std::filesystem;
  const std::string path = (fs::path(dir) / kPeftWeightsFile).string();
  const io::SafetensorsFile file = io::SafetensorsFile::open(path);
  size_t read = 0;
  // PEFT's two spellings of a text model's module (with and without `language_model.`) name one adapter: a file
  // holding both would be counted twice, and the count below would miss the adapter it lacks.
  std::map<size_t, std::string> read_from;  // slot -> the file's name for it
  for (const io::TensorView& v : file.tensors()) {
    const std::string name = slot_name_of(v.name);
    RF_CHECK(!name.empty() && store.contains(name) && store.info(store.slot(name)).trainable, path, ": tensor `",
             v.name, "` is no adapter of this model");
    const size_t slot = store.slot(name);
    const auto [first, inserted] = read_from.emplace(slot, v.name);
    RF_CHECK(inserted, path, ": tensors `", first->second, "` and `", v.name, "` are the same adapter, ", name);
    const ParamInfo& p = store.info(slot);
    RF_CHECK(v.shape == store.file_shape(slot), path, ": tensor `", v.name, "` has shape ", io::shape_string(v.shape),
             ", expected ", io::shape_string(store.file_shape(slot)));
    const std::vector<float> values = io::to_float32(v);
    std::vector<float> held(values.size());
    store.from_file_layout(slot, values, held);
    // The rows the store holds (every one, or an EP rank's experts').
    std::copy_n(held.data() + p.rows_begin * row_elements(p), p.numel, store.mutable_weight(slot));
    ++read;
  }
  RF_CHECK(read == 2 * store.adapters().size(), path, ": ", read, " adapter tensors, expected ",
           2 * store.adapters().size());
}

AdaptedCheckpoint load_adapted_checkpoint(const std::string& dir, const std::string& adapter_dir,
                                          const BeforeAllocating& before_allocating) {
  AdaptedCheckpoint out;
  if (adapter_dir.empty()) {
    out.checkpoint = load_checkpoint(dir, before_allocating);
    return out;
  }
  auto store = std::make_unique<LoraStore>(read_peft_config(adapter_dir));
  out.adapters = store.get();  // the model owns it from here on, and keeps it: nothing places another
  out.checkpoint = load_checkpoint(dir, before_allocating, std::move(store));
  load_peft_adapter(*out.adapters, adapter_dir);
  return out;
}

}  // namespace rf::model
