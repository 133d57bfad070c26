// ringflex trainer: the config table, YAML parsing, overrides, validation and printing (see config.h).
#include "trainer/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <type_traits>
#include <utility>

#include "core/error.h"
#include "io/json_text.h"
#include "model/image_processor.h"
#include "trainer/state/state.h"

namespace rf::trainer {
namespace {

// std::filesystem's queries without exceptions: a path that cannot be examined (permissions, a name too long) is
// neither a directory nor a file, and the check naming the field reports it.
bool is_directory(const std::filesystem::path& p) {
  std::error_code ec;
  return std::filesystem::is_directory(p, ec);
}
bool is_file(const std::filesystem::path& p) {
  std::error_code ec;
  return std::filesystem::is_regular_file(p, ec);
}

namespace fs = std::filesystem;

// Threads per rank at most, as the command line's --threads allows (src/cli): far above any core count, and low
// enough that OpenMP's per-thread stacks and the per-thread buffers cannot exhaust memory first.
constexpr int kMaxThreads = 1024;

// One config field: its `section.key` name, how to read a YAML value into it, and how to print it.
struct Field {
  std::string name;
  std::string type;  // named in errors: "an integer", "a number", ...
  std::function<void(TrainConfig&, const YAML::Node&)> read;
  std::function<void(const TrainConfig&, YAML::Emitter&)> write;
};

template <typename T>
T scalar_as(const YAML::Node& n, const std::string& name, const std::string& type) {
  RF_CHECK(n.IsScalar(), "config: field `", name, "` must be ", type);
  T v;
  try {
    v = n.as<T>();
  } catch (const YAML::Exception&) {
    if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
      // A whole number this integer field cannot hold (e.g. train.steps = 1e12) is out of range; any other number
      // (1.5, or 1.0 spelled as a float) is not an integer at all, and the message below says so.
      double d = 0;
      if (YAML::convert<double>::decode(n, d) && std::isfinite(d) && d == std::trunc(d) &&
          (d < static_cast<double>(std::numeric_limits<T>::min()) ||
           d > static_cast<double>(std::numeric_limits<T>::max())))
        rf::fail("config: field `", name, "` = ", n.Scalar(), " is out of range (", std::numeric_limits<T>::min(),
                 " to ", std::numeric_limits<T>::max(), ")");
    }
    rf::fail("config: field `", name, "` must be ", type, ", got '", n.Scalar(), "'");
  }
  // YAML spells infinities and NaN (.inf, .nan); no field of the config means one (an lr of .inf trains to NaN).
  if constexpr (std::is_floating_point_v<T>)
    RF_CHECK(std::isfinite(v), "config: field `", name, "` must be a finite number, got '", n.Scalar(), "'");
  return v;
}

// Doubles print in their shortest round-trip form (0.003, not yaml-cpp's 0.0030000000000000001).
template <typename V>
void emit(YAML::Emitter& out, const V& v) {
  out << v;
}
template <>
void emit<double>(YAML::Emitter& out, const double& v) {
  char buf[32];
  const auto res = std::to_chars(buf, buf + sizeof buf, v);
  out << std::string(buf, res.ptr);
}

template <typename T>
Field field(const std::string& name, const std::string& type, T TrainConfig::*section, auto member) {
  return Field{name, type,
               [=](TrainConfig& c, const YAML::Node& n) {
                 using V = std::remove_reference_t<decltype(c.*section.*member)>;
                 c.*section.*member = scalar_as<V>(n, name, type);
               },
               [=](const TrainConfig& c, YAML::Emitter& out) { emit(out, c.*section.*member); }};
}

// A field that names one of `values` (an enum): read from its spelling, spelling(v), once; anything else is an error
// naming the field and the choices. Printed with the same spelling.
template <typename T, typename E, typename NameFn>
Field choice(const std::string& field_name, T TrainConfig::*section, E T::*member, std::vector<E> values,
             NameFn spelling) {
  std::string choices;
  for (const E v : values) choices += (choices.empty() ? "" : ", ") + std::string(spelling(v));
  return Field{field_name, "one of " + choices,
               [=](TrainConfig& c, const YAML::Node& n) {
                 const std::string spelled = scalar_as<std::string>(n, field_name, "one of " + choices);
                 for (const E v : values)
                   if (spelled == spelling(v)) {
                     c.*section.*member = v;
                     return;
                   }
                 rf::fail("config: ", field_name, " = '", spelled, "' is not one of ", choices);
               },
               [=](const TrainConfig& c, YAML::Emitter& out) { out << std::string(spelling(c.*section.*member)); }};
}

Field string_list(const std::string& name, std::vector<std::string> ModelSection::*member) {
  return Field{name, "a list of strings",
               [=](TrainConfig& c, const YAML::Node& n) {
                 std::vector<std::string> items;
                 if (n.IsScalar() && !n.Scalar().empty())
                   items.push_back(n.Scalar());  // `--set model.freeze=embed`
                 else if (n.IsSequence()) {
                   for (const YAML::Node& item : n)
                     items.push_back(scalar_as<std::string>(item, name, "a list of strings"));
                 } else {
                   RF_CHECK(n.IsNull() || n.IsScalar(), "config: field `", name, "` must be a list of strings");
                 }
                 c.model.*member = items;
               },
               [=](const TrainConfig& c, YAML::Emitter& out) {
                 out << YAML::Flow << YAML::BeginSeq;
                 for (const std::string& s : c.model.*member) out << s;
                 out << YAML::EndSeq;
               }};
}

// A train field that is true, false or auto (TrainSection::automatic): `auto` leaves the value to the trainer
// (choose_recompute), true or false sets it. Printed as given, so a saved config chooses again where it runs.
Field true_false_auto(const std::string& name, bool TrainSection::*value, bool TrainSection::Automatic::*automatic) {
  const std::string type = "true, false or auto";
  return Field{name, type,
               [=](TrainConfig& c, const YAML::Node& n) {
                 if (n.IsScalar() && n.Scalar() == "auto") {
                   c.train.*value = TrainSection{}.*value;  // what it reads as until chosen
                   c.train.automatic.*automatic = true;
                   return;
                 }
                 c.train.*value = scalar_as<bool>(n, name, type);
                 c.train.automatic.*automatic = false;
               },
               [=](const TrainConfig& c, YAML::Emitter& out) {
                 if (c.train.automatic.*automatic)
                   out << "auto";
                 else
                   out << c.train.*value;
               }};
}

// model.lora.target: a list of module names, or one string, a regular expression (PEFT's target_modules).
Field lora_target() {
  const std::string name = "model.lora.target", type = "a list of module names or one regular expression";
  return Field{name, type,
               [=](TrainConfig& c, const YAML::Node& n) {
                 std::vector<std::string> items;
                 if (n.IsScalar()) {
                   items.push_back(n.Scalar());
                 } else {
                   RF_CHECK(n.IsSequence(), "config: field `", name, "` must be ", type);
                   for (const YAML::Node& item : n) items.push_back(scalar_as<std::string>(item, name, type));
                 }
                 c.model.lora_target = items;
                 c.model.lora_target_regex = n.IsScalar();
               },
               [=](const TrainConfig& c, YAML::Emitter& out) {
                 if (c.model.lora_target_regex && c.model.lora_target.size() == 1) {
                   out << c.model.lora_target[0];
                   return;
                 }
                 out << YAML::Flow << YAML::BeginSeq;
                 for (const std::string& s : c.model.lora_target) out << s;
                 out << YAML::EndSeq;
               }};
}

const std::vector<Field>& fields() {
  static const std::string kInt = "an integer", kNum = "a number", kStr = "a string";
  using C = TrainConfig;
  // name_of is overloaded; these pick one overload each.
  constexpr auto kSourceName = [](SourceKind s) { return name_of(s); };
  constexpr auto kShardName = [](ShardMode s) { return name_of(s); };
  constexpr auto kOverlengthName = [](Overlength o) { return name_of(o); };
  static const std::vector<Field> table = {
      field("model.builtin", kStr, &C::model, &ModelSection::builtin),
      field("model.path", kStr, &C::model, &ModelSection::path),
      field("model.init_std", kNum, &C::model, &ModelSection::init_std),
      string_list("model.freeze", &ModelSection::freeze),
      choice("model.compute_dtype", &C::model, &ModelSection::compute_dtype,
             {model::ComputeDtype::Float32, model::ComputeDtype::Bfloat16}, model::compute_dtype_name),
      choice("model.param_dtype", &C::model, &ModelSection::param_dtype,
             {model::ParamDtype::Float32, model::ParamDtype::Bfloat16}, model::param_dtype_name),
      field("model.lora.rank", kInt, &C::model, &ModelSection::lora_rank),
      field("model.lora.alpha", kNum, &C::model, &ModelSection::lora_alpha),
      field("model.lora.dropout", kNum, &C::model, &ModelSection::lora_dropout),
      lora_target(),
      string_list("model.lora.target_parameters", &ModelSection::lora_target_parameters),
      field("model.lora.use_rslora", "true or false", &C::model, &ModelSection::lora_use_rslora),
      field("model.train_vision", "true or false", &C::model, &ModelSection::train_vision),
      choice("data.source", &C::data, &DataSection::source,
             {SourceKind::Mock, SourceKind::JsonlTokens, SourceKind::JsonlText, SourceKind::JsonlChat}, kSourceName),
      field("data.path", kStr, &C::data, &DataSection::path),
      field("data.features", kStr, &C::data, &DataSection::features),
      field("data.tokenizer", kStr, &C::data, &DataSection::tokenizer),
      field("data.chat_template", kStr, &C::data, &DataSection::chat_template),
      choice("data.chat.train_on", &C::data, &DataSection::chat_train_on,
             {text::TrainOn::Assistant, text::TrainOn::LastAssistant, text::TrainOn::All}, text::name_of),
      field("data.chat.thought_prefix", "true or false", &C::data, &DataSection::chat_thought_prefix),
      choice("data.chat.overlength", &C::data, &DataSection::chat_overlength,
             {Overlength::Drop, Overlength::Truncate, Overlength::Error}, kOverlengthName),
      field("data.chat.enable_thinking", "true or false", &C::data, &DataSection::chat_enable_thinking),
      field("data.val_rows", kInt, &C::data, &DataSection::val_rows),
      field("data.mock_image_tokens", kInt, &C::data, &DataSection::mock_image_tokens),
      field("data.image_soft_tokens", kInt, &C::data, &DataSection::image_soft_tokens),
      field("optimizer.lr", kNum, &C::optimizer, &OptimizerSection::lr),
      field("optimizer.beta1", kNum, &C::optimizer, &OptimizerSection::beta1),
      field("optimizer.beta2", kNum, &C::optimizer, &OptimizerSection::beta2),
      field("optimizer.eps", kNum, &C::optimizer, &OptimizerSection::eps),
      field("optimizer.weight_decay", kNum, &C::optimizer, &OptimizerSection::weight_decay),
      field("optimizer.grad_clip", kNum, &C::optimizer, &OptimizerSection::grad_clip),
      field("schedule.warmup_steps", kInt, &C::schedule, &ScheduleSection::warmup_steps),
      field("schedule.min_lr_ratio", kNum, &C::schedule, &ScheduleSection::min_lr_ratio),
      field("parallelism.cp", kInt, &C::parallelism, &ParallelismSection::cp),
      field("parallelism.dp", kInt, &C::parallelism, &ParallelismSection::dp),
      choice("parallelism.sharding", &C::parallelism, &ParallelismSection::sharding,
             {cp::Scheme::Contiguous, cp::Scheme::Zigzag, cp::Scheme::Balanced}, cp::scheme_name),
      choice("parallelism.shard", &C::parallelism, &ParallelismSection::shard,
             {ShardMode::None, ShardMode::Optimizer, ShardMode::Gradients, ShardMode::Full}, kShardName),
      field("parallelism.ep", kInt, &C::parallelism, &ParallelismSection::ep),
      field("parallelism.split_vision", "true or false", &C::parallelism, &ParallelismSection::split_vision),
      field("train.steps", kInt, &C::train, &TrainSection::steps),
      field("train.seq_len", kInt, &C::train, &TrainSection::seq_len),
      field("train.global_batch", kInt, &C::train, &TrainSection::global_batch),
      field("train.micro_batch", kInt, &C::train, &TrainSection::micro_batch),
      field("train.seed", "a non-negative integer", &C::train, &TrainSection::seed),
      field("train.threads", kInt, &C::train, &TrainSection::threads),
      field("train.val_every", kInt, &C::train, &TrainSection::val_every),
      field("train.log_every", kInt, &C::train, &TrainSection::log_every),
      true_false_auto("train.recompute", &TrainSection::recompute, &TrainSection::Automatic::recompute),
      true_false_auto("train.keep_mlp", &TrainSection::keep_mlp, &TrainSection::Automatic::keep_mlp),
      true_false_auto("train.keep_o_proj", &TrainSection::keep_o_proj, &TrainSection::Automatic::keep_o_proj),
      true_false_auto("train.keep_down_proj", &TrainSection::keep_down_proj, &TrainSection::Automatic::keep_down_proj),
      field("train.samples.prompts", kStr, &C::train, &TrainSection::samples_prompts),
      field("train.samples.every", kInt, &C::train, &TrainSection::samples_every),
      field("train.samples.max_new_tokens", kInt, &C::train, &TrainSection::samples_max_new_tokens),
      field("train.spill_dir", kStr, &C::train, &TrainSection::spill_dir),
      field("train.mlp_tile_tokens", kInt, &C::train, &TrainSection::mlp_tile_tokens),
      field("train.tile_mlp", "true or false", &C::train, &TrainSection::tile_mlp),
      field("checkpoint.dir", kStr, &C::checkpoint, &CheckpointSection::dir),
      field("checkpoint.every", kInt, &C::checkpoint, &CheckpointSection::every),
      field("checkpoint.keep", kInt, &C::checkpoint, &CheckpointSection::keep),
      field("checkpoint.max_shard_size", "a size (bytes, or e.g. 5GB, 500MB, 2MiB)", &C::checkpoint,
            &CheckpointSection::max_shard_size),
  };
  return table;
}

const Field& find_field(const std::string& name, const std::string& source) {
  for (const Field& f : fields())
    if (f.name == name) return f;
  rf::fail(source, ": unknown field `", name, "`");
}

// A map key as a name: a key that is not a plain scalar (`? [a, b]`) names no section or field.
std::string key_name(const YAML::Node& key, const std::string& source) {
  RF_CHECK(key.IsScalar(), source, ":", key.Mark().line + 1, ": a key must be a plain name, not a ",
           key.IsSequence() ? "list"
           : key.IsMap()    ? "map"
                            : "null");
  return key.Scalar();
}

// Runs `fn`, turning any yaml-cpp exception it lets out into one rf::Error naming `source` and the line, so the
// message is the same on every rank (the command line agrees only on rf::Error).
template <typename Fn>
void yaml_guard(const std::string& source, Fn fn) {
  try {
    fn();
  } catch (const YAML::Exception& e) {
    if (e.mark.is_null())
      rf::fail(source, ": ", e.msg);
    else
      rf::fail(source, ":", e.mark.line + 1, ": ", e.msg);
  }
}

// The nested groups of fields: `model: {lora: {rank: 8, ...}}` and `data: {chat: {train_on: assistant, ...}}` (also
// spelled model.lora.rank, data.chat.train_on, as printed).
bool is_group(const std::string& name) {
  return name == "model.lora" || name == "data.chat" || name == "train.samples";
}

// A group's fields, for the error on a group that is not a map.
const char* group_fields(const std::string& name) {
  if (name == "model.lora") return "rank, alpha, dropout, target, target_parameters, use_rslora";
  if (name == "data.chat") return "train_on, thought_prefix, overlength, enable_thinking";
  return "prompts, every, max_new_tokens";
}

// The sections of a parsed config into `c` (names and types; validate() does the cross-field rules).
void read_sections(TrainConfig& c, const YAML::Node& root, const std::string& source) {
  if (root.IsNull()) return;
  RF_CHECK(root.IsMap(), source, ": the config must be a map of sections (model, data, optimizer, ...)");
  // yaml-cpp keeps a repeated key as a second entry; the last would win silently, so a repeat is an error.
  std::set<std::string> seen;
  for (const auto& section : root) {
    const std::string sname = key_name(section.first, source);
    RF_CHECK(seen.insert(sname).second, source, ": section `", sname, "` appears twice");
    if (section.second.IsNull()) continue;
    RF_CHECK(section.second.IsMap(), source, ": section `", sname, "` must be a map of fields");
    for (const auto& entry : section.second) {
      const std::string name = sname + "." + key_name(entry.first, source);
      RF_CHECK(seen.insert(name).second, source, ": field `", name, "` appears twice");
      if (is_group(name)) {
        // A group is a map of its own fields (model.lora: rank, alpha, ...), read as <group>.<key>.
        RF_CHECK(entry.second.IsMap(), source, ": `", name, "` must be a map (", group_fields(name), ")");
        for (const auto& sub : entry.second) {
          const std::string sub_name = name + "." + key_name(sub.first, source);
          RF_CHECK(seen.insert(sub_name).second, source, ": field `", sub_name, "` appears twice");
          find_field(sub_name, source).read(c, sub.second);
        }
        continue;
      }
      find_field(name, source).read(c, entry.second);
    }
  }
}

}  // namespace

std::string_view name_of(SourceKind s) {
  switch (s) {
    case SourceKind::Mock:
      return "mock";
    case SourceKind::JsonlTokens:
      return "jsonl_tokens";
    case SourceKind::JsonlText:
      return "jsonl_text";
    case SourceKind::JsonlChat:
      return "jsonl_chat";
  }
  return "?";
}

std::string_view name_of(Overlength o) {
  switch (o) {
    case Overlength::Drop:
      return "drop";
    case Overlength::Truncate:
      return "truncate";
    case Overlength::Error:
      return "error";
  }
  return "?";
}

std::string_view name_of(ShardMode s) {
  switch (s) {
    case ShardMode::None:
      return "none";
    case ShardMode::Optimizer:
      return "optimizer";
    case ShardMode::Gradients:
      return "gradients";
    case ShardMode::Full:
      return "full";
  }
  return "?";
}

int processor_soft_tokens(const std::string& model_path) {
  const std::filesystem::path dir(model_path);
  std::error_code ec;
  // transformers 5 saves a processor's image processor inside processor_config.json; an image processor saved alone,
  // and older processors, write preprocessor_config.json with the field at the top.
  for (const auto& [file, nested] : {std::pair{"processor_config.json", true}, {"preprocessor_config.json", false}}) {
    const std::string path = (dir / file).string();
    if (model_path.empty() || !std::filesystem::is_regular_file(path, ec)) continue;
    const nlohmann::json root = io::parse_json(io::read_config_file(path), path);
    const nlohmann::json* at = &root;
    if (nested) {
      if (!root.is_object() || !root.contains("image_processor") || !root["image_processor"].is_object()) continue;
      at = &root["image_processor"];
    }
    if (!at->is_object() || !at->contains("max_soft_tokens")) continue;
    const nlohmann::json& v = (*at)["max_soft_tokens"];
    const std::string field = nested ? "image_processor.max_soft_tokens" : "max_soft_tokens";
    RF_CHECK(v.is_number_integer() && model::supported_soft_tokens(v.get<int64_t>()), path, ": ", field, " = ",
             v.dump(), " is not 70, 140, 280, 560 or 1120 (data.image_soft_tokens takes its ",
             "default from it; set it to override)");
    return v.get<int>();
  }
  return DataSection::kDefaultImageSoftTokens;
}

TrainConfig parse_config(const std::string& yaml_text, const std::string& source,
                         const std::vector<std::string>& sets) {
  TrainConfig c;
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    rf::fail(source, ": not valid YAML: ", e.what());
  }
  yaml_guard(source, [&] { read_sections(c, root, source); });
  for (const std::string& set : sets) {
    const size_t eq = set.find('=');
    RF_CHECK(eq != std::string::npos && eq > 0, "--set ", set, ": expected section.key=value");
    const std::string name = set.substr(0, eq), value = set.substr(eq + 1);
    YAML::Node node;
    try {
      node = YAML::Load(value);
    } catch (const YAML::Exception& e) {
      rf::fail("--set ", set, ": value is not valid YAML: ", e.what());
    }
    if (node.IsNull()) node = YAML::Node(value);  // `--set checkpoint.dir=` means the empty string
    yaml_guard("--set " + set, [&] { find_field(name, "--set").read(c, node); });
  }
  if (c.data.image_soft_tokens == 0) c.data.image_soft_tokens = processor_soft_tokens(c.model.path);
  return c;
}

TrainConfig load_config(const std::string& path, const std::vector<std::string>& sets) {
  // A directory opens as a stream that reads nothing, which would run on every default.
  RF_CHECK(!is_directory(path), path, ": is a directory, not a config file");
  // A FIFO would block the read forever on every rank, /dev/zero would read until memory ran out.
  return parse_config(io::read_config_file(path, "a YAML config"), path, sets);
}

namespace {

void positive(int v, const char* name) { RF_CHECK(v >= 1, "config: ", name, " = ", v, " must be >= 1"); }

}  // namespace

void validate(const TrainConfig& c, int world_size) {
  const auto non_negative = [](double v, const char* name) {
    RF_CHECK(v >= 0, "config: ", name, " = ", v, " must be >= 0");
  };
  if (c.model.path.empty()) {
    RF_CHECK(c.model.builtin == "tiny_dense" || c.model.builtin == "tiny_moe_vlm", "config: model.builtin = '",
             c.model.builtin, "' is not one of tiny_dense, tiny_moe_vlm (or set model.path to a checkpoint)");
    RF_CHECK(c.model.init_std > 0, "config: model.init_std = ", c.model.init_std, " must be > 0");
  } else {
    RF_CHECK(is_file(fs::path(c.model.path) / "config.json"), "config: model.path = '", c.model.path,
             "' has no config.json");
  }
  if (c.model.lora_rank != 0) {
    RF_CHECK(c.model.lora_rank >= 1, "config: model.lora.rank = ", c.model.lora_rank, " must be >= 1 (0: no LoRA)");
    RF_CHECK(c.model.lora_alpha > 0, "config: model.lora.alpha = ", c.model.lora_alpha, " must be > 0");
    RF_CHECK(c.model.lora_dropout >= 0 && c.model.lora_dropout < 1,
             "config: model.lora.dropout = ", c.model.lora_dropout, " must be in [0, 1)");
    RF_CHECK(!c.model.lora_target.empty() || !c.model.lora_target_parameters.empty(),
             "config: model.lora.target and model.lora.target_parameters are both empty");
  }
  // What the run's training state (shard mode, LoRA, held experts) supports: trainer/state/, docs/parallel-state.md.
  const detail::Support support = detail::plan_state(c)->supports(c);
  RF_CHECK(support, "config: ", support.refusal);
  if (c.data.source != SourceKind::Mock) {
    RF_CHECK(!c.data.path.empty(), "config: data.path is required with data.source = ", name_of(c.data.source));
    RF_CHECK(is_file(c.data.path), "config: data.path = '", c.data.path, "' is not a file");
  }
  if (!c.data.features.empty())
    RF_CHECK(is_file(c.data.features), "config: data.features = '", c.data.features, "' is not a file");
  if (c.data.source == SourceKind::JsonlText || c.data.source == SourceKind::JsonlChat) {
    RF_CHECK(!c.data.tokenizer.empty() || !c.model.path.empty(), "config: data.tokenizer is required with ",
             "data.source = ", name_of(c.data.source), " and a built-in model");
    if (!c.data.tokenizer.empty())
      RF_CHECK(is_file(c.data.tokenizer), "config: data.tokenizer = '", c.data.tokenizer, "' is not a file");
  }
  if (c.data.source == SourceKind::JsonlChat) {
    RF_CHECK(!c.data.chat_template.empty() || !c.model.path.empty(),
             "config: data.chat_template is required with data.source = jsonl_chat and a built-in model");
    if (!c.data.chat_template.empty())
      RF_CHECK(is_file(c.data.chat_template), "config: data.chat_template = '", c.data.chat_template,
               "' is not a file");
  }
  RF_CHECK(c.data.val_rows >= 0, "config: data.val_rows = ", c.data.val_rows, " must be >= 0 (0: no validation)");
  RF_CHECK(model::supported_soft_tokens(c.data.image_soft_tokens),
           "config: data.image_soft_tokens = ", c.data.image_soft_tokens, " must be 70, 140, 280, 560 or 1120");
  positive(c.data.mock_image_tokens, "data.mock_image_tokens");
  RF_CHECK(c.optimizer.lr > 0, "config: optimizer.lr = ", c.optimizer.lr, " must be > 0");
  RF_CHECK(c.optimizer.beta1 >= 0 && c.optimizer.beta1 < 1, "config: optimizer.beta1 = ", c.optimizer.beta1,
           " must be in [0, 1)");
  RF_CHECK(c.optimizer.beta2 >= 0 && c.optimizer.beta2 < 1, "config: optimizer.beta2 = ", c.optimizer.beta2,
           " must be in [0, 1)");
  RF_CHECK(c.optimizer.eps > 0, "config: optimizer.eps = ", c.optimizer.eps, " must be > 0");
  non_negative(c.optimizer.weight_decay, "optimizer.weight_decay");
  // AdamW's decoupled decay scales every weight by 1 - lr * weight_decay each step (lr at most optimizer.lr): at 1 or
  // more it zeroes or flips them all, and far above it the float32 weights become inf in the first update, after the
  // step's finiteness check, so the run would write a checkpoint of infinities and exit 0.
  RF_CHECK(c.optimizer.lr * c.optimizer.weight_decay < 1,
           "config: optimizer.lr * optimizer.weight_decay = ", c.optimizer.lr, " * ", c.optimizer.weight_decay, " = ",
           c.optimizer.lr * c.optimizer.weight_decay,
           " must be below 1 (AdamW scales each weight by 1 - lr * weight_decay a step)");
  non_negative(c.optimizer.grad_clip, "optimizer.grad_clip");
  non_negative(c.schedule.warmup_steps, "schedule.warmup_steps");
  RF_CHECK(c.schedule.min_lr_ratio >= 0 && c.schedule.min_lr_ratio <= 1,
           "config: schedule.min_lr_ratio = ", c.schedule.min_lr_ratio, " must be in [0, 1]");
  validate_parallelism(c, world_size);
  non_negative(c.train.threads, "train.threads");
  RF_CHECK(c.train.spill_dir.empty() || c.train.recompute, "config: train.spill_dir = ", c.train.spill_dir,
           " needs train.recompute: true (the spill file holds what a recomputed layer keeps)");
  positive(c.train.mlp_tile_tokens, "train.mlp_tile_tokens");
  RF_CHECK(!c.train.tile_mlp || !c.train.keep_mlp,
           "config: train.tile_mlp keeps no gate/up projections: it cannot go with train.keep_mlp: true");
  RF_CHECK(c.train.threads <= kMaxThreads, "config: train.threads = ", c.train.threads, " is more than ", kMaxThreads);
  non_negative(c.train.val_every, "train.val_every");
  positive(c.train.log_every, "train.log_every");
  non_negative(c.train.samples_every, "train.samples.every");
  positive(c.train.samples_max_new_tokens, "train.samples.max_new_tokens");
  non_negative(c.checkpoint.every, "checkpoint.every");
  positive(c.checkpoint.keep, "checkpoint.keep");
  max_shard_bytes(c.checkpoint);
}

void validate_parallelism(const TrainConfig& c, int world_size) {
  positive(c.parallelism.cp, "parallelism.cp");
  positive(c.parallelism.dp, "parallelism.dp");
  RF_CHECK(int64_t{c.parallelism.cp} * c.parallelism.dp == world_size,
           "config: parallelism.cp * parallelism.dp = ", c.parallelism.cp, " * ", c.parallelism.dp, " = ",
           int64_t{c.parallelism.cp} * c.parallelism.dp, " does not match the ", world_size, " rank(s) of this job");
  positive(c.parallelism.ep, "parallelism.ep");
  RF_CHECK(world_size % c.parallelism.ep == 0, "config: parallelism.ep = ", c.parallelism.ep, " does not divide the ",
           world_size, " rank(s) of this job (cp * dp)");
  positive(c.train.steps, "train.steps");
  positive(c.train.seq_len, "train.seq_len");
  RF_CHECK(c.train.seq_len >= c.parallelism.cp, "config: train.seq_len = ", c.train.seq_len,
           " is shorter than parallelism.cp = ", c.parallelism.cp, " (every CP rank needs a token)");
  positive(c.train.global_batch, "train.global_batch");
  positive(c.train.micro_batch, "train.micro_batch");
  RF_CHECK(c.train.global_batch % c.parallelism.dp == 0, "config: train.global_batch = ", c.train.global_batch,
           " is not a multiple of parallelism.dp = ", c.parallelism.dp);
  RF_CHECK(c.global_batch_per_replica() % c.train.micro_batch == 0,
           "config: train.global_batch / parallelism.dp = ", c.global_batch_per_replica(),
           " is not a multiple of train.micro_batch = ", c.train.micro_batch);
}

int64_t max_shard_bytes(const CheckpointSection& c) {
  return parse_size(c.max_shard_size, "config: checkpoint.max_shard_size");
}

int64_t parse_size(const std::string& text, const std::string& what) {
  const std::string problem = rf::concat(what, " = '", text,
                                         "' is not a positive size (bytes, or a number with KB, MB, GB, TB, KiB, "
                                         "MiB, GiB or TiB)");
  const auto bad = [&] { throw rf::Error(problem); };
  size_t digits = 0;
  while (digits < text.size() && (std::isdigit(static_cast<unsigned char>(text[digits])) || text[digits] == '.'))
    ++digits;
  if (digits == 0) bad();
  double value = 0;
  try {
    size_t used = 0;
    value = std::stod(text.substr(0, digits), &used);
    if (used != digits) bad();
  } catch (const std::logic_error&) {
    bad();
  }
  std::string unit = text.substr(digits);
  while (!unit.empty() && unit.front() == ' ') unit.erase(0, 1);
  std::transform(unit.begin(), unit.end(), unit.begin(), [](unsigned char ch) { return std::toupper(ch); });
  constexpr double kKilo = 1e3, kKibi = 1024.0;
  const std::pair<const char*, double> units[] = {{"", 1.0},
                                                  {"KB", kKilo},
                                                  {"MB", kKilo * kKilo},
                                                  {"GB", kKilo * kKilo * kKilo},
                                                  {"TB", kKilo * kKilo * kKilo * kKilo},
                                                  {"KIB", kKibi},
                                                  {"MIB", kKibi * kKibi},
                                                  {"GIB", kKibi * kKibi * kKibi},
                                                  {"TIB", kKibi * kKibi * kKibi * kKibi}};
  for (const auto& [name, factor] : units) {
    if (unit != name) continue;
    const double bytes = value * factor;
    // Below one byte no tensor fits anywhere; above int64 no count is exact.
    if (!(bytes >= 1.0 && bytes < static_cast<double>(std::numeric_limits<int64_t>::max()))) bad();
    return static_cast<int64_t>(bytes);
  }
  throw rf::Error(problem);
}

std::string to_yaml(const TrainConfig& c) {
  YAML::Emitter out;
  out << YAML::BeginMap;
  std::string open_section;
  for (const Field& f : fields()) {
    const size_t dot = f.name.find('.');
    const std::string section = f.name.substr(0, dot), key = f.name.substr(dot + 1);
    if (section != open_section) {
      if (!open_section.empty()) out << YAML::EndMap;
      out << YAML::Key << section << YAML::Value << YAML::BeginMap;
      open_section = section;
    }
    out << YAML::Key << key << YAML::Value;
    f.write(c, out);
  }
  out << YAML::EndMap << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

}  // namespace rf::trainer
