// The training config: defaults, YAML, --set overrides, --print-config round trip, and one clear error per bad
// field (the oracle is the message text the user reads).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/error_of.h"
#include "trainer/config.h"

namespace rf::trainer {
namespace {

using testing::error_of;

TEST(TrainConfig, EmptyFileIsTheDefaults) {
  const TrainConfig c = parse_config("", "empty.yaml");
  EXPECT_EQ(c.model.builtin, "tiny_moe_vlm");
  EXPECT_EQ(c.data.source, SourceKind::Mock);
  EXPECT_EQ(c.model.compute_dtype, model::ComputeDtype::Float32);
  EXPECT_EQ(c.model.param_dtype, model::ParamDtype::Float32);
  EXPECT_EQ(c.parallelism.sharding, cp::Scheme::Balanced);
  EXPECT_EQ(c.parallelism.shard, ShardMode::None);
  EXPECT_EQ(c.parallelism.cp, 1);
  EXPECT_EQ(c.train.steps, 300);
  EXPECT_NO_THROW(validate(c, 1));
}

TEST(TrainConfig, YamlThenSetsInOrder) {
  const TrainConfig c = parse_config(
      "model: {builtin: tiny_dense, freeze: [embed_tokens, norm]}\n"
      "optimizer: {lr: 1e-4}\ntrain: {steps: 9, seed: 4}\nparallelism: {cp: 2, dp: 3}\n",
      "a.yaml",
      {"parallelism.cp=2", "parallelism.dp=1", "train.steps=5", "train.seed=3", "checkpoint.dir=runs/ck",
       "checkpoint.every=2", "train.steps=6"});
  EXPECT_EQ(c.model.builtin, "tiny_dense");
  EXPECT_EQ(c.model.freeze, (std::vector<std::string>{"embed_tokens", "norm"}));
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 1e-4);
  EXPECT_EQ(c.parallelism.cp, 2);
  EXPECT_EQ(c.parallelism.dp, 1);
  EXPECT_EQ(c.train.steps, 6);  // the last --set wins
  EXPECT_EQ(c.train.seed, 3u);
  EXPECT_EQ(c.checkpoint.dir, "runs/ck");
  EXPECT_EQ(c.checkpoint.every, 2);
}

TEST(TrainConfig, PrintedConfigParsesBackToTheSameConfig) {
  const TrainConfig c =
      parse_config("", "x",
                   {"optimizer.lr=0.003", "model.freeze=embed", "schedule.min_lr_ratio=0.125",
                    "data.path=some file.jsonl", "model.compute_dtype=bfloat16", "data.source=jsonl_text",
                    "parallelism.sharding=zigzag", "parallelism.shard=gradients"});
  EXPECT_EQ(c.model.compute_dtype, model::ComputeDtype::Bfloat16);
  EXPECT_EQ(c.data.source, SourceKind::JsonlText);
  EXPECT_EQ(c.parallelism.sharding, cp::Scheme::Zigzag);
  EXPECT_EQ(c.parallelism.shard, ShardMode::Gradients);
  const std::string yaml = to_yaml(c);
  EXPECT_NE(yaml.find("lr: 0.003\n"), std::string::npos) << yaml;  // shortest round-trip form
  // The choices print with the spelling they are read in.
  for (const char* line :
       {"compute_dtype: bfloat16\n", "source: jsonl_text\n", "sharding: zigzag\n", "shard: gradients\n"})
    EXPECT_NE(yaml.find(line), std::string::npos) << line << " in\n" << yaml;
  EXPECT_EQ(to_yaml(parse_config(yaml, "printed")), yaml);
}

// train.recompute and the keep_* fields are true, false or auto (the default): auto prints back as auto and reads as
// the values a run without a choice takes (recompute, keeping the o_proj and down_proj outputs) until the trainer
// chooses (choose_recompute); a later setting replaces an earlier one either way.
TEST(TrainConfig, RecomputeFieldsAreTrueFalseOrAuto) {
  const TrainConfig d = parse_config("", "x");
  EXPECT_TRUE(d.train.automatic.recompute && d.train.automatic.keep_mlp && d.train.automatic.keep_o_proj &&
              d.train.automatic.keep_down_proj);
  EXPECT_TRUE(d.train.recompute && !d.train.keep_mlp && d.train.keep_o_proj && d.train.keep_down_proj);
  const std::string yaml = to_yaml(d);
  for (const char* line : {"recompute: auto\n", "keep_mlp: auto\n", "keep_o_proj: auto\n", "keep_down_proj: auto\n"})
    EXPECT_NE(yaml.find(line), std::string::npos) << line << " in\n" << yaml;

  const TrainConfig set = parse_config("train: {recompute: false, keep_o_proj: false}", "x");
  EXPECT_FALSE(set.train.automatic.recompute);
  EXPECT_FALSE(set.train.recompute);
  EXPECT_FALSE(set.train.automatic.keep_o_proj);
  EXPECT_FALSE(set.train.keep_o_proj);
  EXPECT_TRUE(set.train.automatic.keep_mlp && set.train.automatic.keep_down_proj);
  EXPECT_NE(to_yaml(set).find("recompute: false\n"), std::string::npos);
  EXPECT_EQ(to_yaml(parse_config(to_yaml(set), "printed")), to_yaml(set));

  const TrainConfig back = parse_config("train: {recompute: false}", "x", {"train.recompute=auto"});
  EXPECT_TRUE(back.train.automatic.recompute);
  EXPECT_TRUE(back.train.recompute);  // the unchosen value again, not the false set before
  EXPECT_EQ(error_of([] { parse_config("", "a.yaml", {"train.keep_mlp=sometimes"}); }),
            "config: field `train.keep_mlp` must be true, false or auto, got 'sometimes'");
}

TEST(TrainConfig, UnknownFieldsAndWrongTypesNameTheField) {
  EXPECT_EQ(error_of([] { parse_config("train: {stepz: 3}", "a.yaml"); }), "a.yaml: unknown field `train.stepz`");
  EXPECT_EQ(error_of([] { parse_config("", "a.yaml", {"optimizer.learning_rate=1"}); }),
            "--set: unknown field `optimizer.learning_rate`");
  EXPECT_EQ(error_of([] { parse_config("train: {steps: many}", "a.yaml"); }),
            "config: field `train.steps` must be an integer, got 'many'");
  EXPECT_EQ(error_of([] { parse_config("optimizer: {lr: [1, 2]}", "a.yaml"); }),
            "config: field `optimizer.lr` must be a number");
  EXPECT_EQ(error_of([] { parse_config("", "a.yaml", {"train.steps"}); }),
            "--set train.steps: expected section.key=value");
  EXPECT_EQ(error_of([] { parse_config("- 1\n- 2\n", "a.yaml"); }),
            "a.yaml: the config must be a map of sections (model, data, optimizer, ...)");
  EXPECT_NE(error_of([] { parse_config("train: {steps: [1", "a.yaml"); }).find("a.yaml: not valid YAML"),
            std::string::npos);
  EXPECT_EQ(error_of([] { load_config("/absent/x.yaml"); }), "/absent/x.yaml: no such file");
  // A device or a FIFO would be read forever (or block the read): a config is a small regular file.
  EXPECT_EQ(error_of([] { load_config("/dev/zero"); }), "/dev/zero: not a regular file");
  EXPECT_EQ(error_of([] { validate(parse_config("model: {compute_dtype: float16}", "a.yaml"), 1); }),
            "config: model.compute_dtype = 'float16' is not one of float32, bfloat16");
}

// The choices are read once, when the YAML is: a bad spelling fails parse_config itself, naming the field and the
// choices (parallelism.shard = full is read; validate refuses it until it exists).
TEST(TrainConfig, ChoicesFailWhenReadNamingTheFieldAndTheChoices) {
  EXPECT_EQ(error_of([] { parse_config("data: {source: csv}", "a.yaml"); }),
            "config: data.source = 'csv' is not one of mock, jsonl_tokens, jsonl_text, jsonl_chat");
  // data.chat is a nested group, as model.lora: its fields read nested or dotted, its choices checked alike.
  const TrainConfig chat = parse_config("data: {chat: {train_on: last_assistant, overlength: truncate}}", "a.yaml");
  EXPECT_EQ(chat.data.chat_train_on, text::TrainOn::LastAssistant);
  EXPECT_EQ(chat.data.chat_overlength, Overlength::Truncate);
  EXPECT_TRUE(chat.data.chat_thought_prefix);
  EXPECT_EQ(error_of([] { parse_config("", "a.yaml", {"data.chat.train_on=user"}); }),
            "config: data.chat.train_on = 'user' is not one of assistant, last_assistant, all");
  EXPECT_EQ(error_of([] { parse_config("data: {chat: {trainon: all}}", "a.yaml"); }),
            "a.yaml: unknown field `data.chat.trainon`");
  EXPECT_EQ(error_of([] { parse_config("", "a.yaml", {"parallelism.sharding=Zigzag"}); }),
            "config: parallelism.sharding = 'Zigzag' is not one of contiguous, zigzag, balanced");
  EXPECT_EQ(error_of([] { parse_config("", "a.yaml", {"model.compute_dtype=bf16"}); }),
            "config: model.compute_dtype = 'bf16' is not one of float32, bfloat16");
  EXPECT_EQ(error_of([] { parse_config("parallelism: {shard: [none]}", "a.yaml"); }),
            "config: field `parallelism.shard` must be one of none, optimizer, gradients, full");
  EXPECT_EQ(parse_config("", "a.yaml", {"parallelism.shard=full"}).parallelism.shard, ShardMode::Full);
}

// model.param_dtype: float32 (default) or bfloat16, printed back as read; bfloat16 beside the features whose weights
// keep float32 working copies of their own is refused in one line naming that feature. The trained vision tower's
// parameters are store slots: bfloat16 with model.train_vision runs, in every shard mode.
TEST(TrainConfig, ParamDtypeIsReadPrintedAndRefusedBesideLoraAndEp) {
  const TrainConfig c = parse_config("model: {param_dtype: bfloat16}", "a.yaml");
  EXPECT_EQ(c.model.param_dtype, model::ParamDtype::Bfloat16);
  EXPECT_NE(to_yaml(c).find("param_dtype: bfloat16\n"), std::string::npos) << to_yaml(c);
  validate(c, 1);
  EXPECT_EQ(error_of([] { parse_config("", "a.yaml", {"model.param_dtype=bf16"}); }),
            "config: model.param_dtype = 'bf16' is not one of float32, bfloat16");
  const std::string tail = " is not implemented (its weights keep float32 working copies of their own)";
  EXPECT_EQ(error_of([] {
              validate(parse_config("", "a.yaml", {"model.param_dtype=bfloat16", "model.lora.rank=4"}), 1);
            }),
            "config: model.param_dtype = bfloat16 with model.lora" + tail);
  EXPECT_EQ(
      error_of([] {
        validate(parse_config("", "a.yaml", {"model.param_dtype=bfloat16", "parallelism.ep=2", "parallelism.dp=2"}), 2);
      }),
      "config: model.param_dtype = bfloat16 with parallelism.ep > 1" + tail);
  for (const char* shard : {"none", "optimizer", "gradients", "full"})
    validate(parse_config("", "a.yaml",
                          {"model.param_dtype=bfloat16", "model.train_vision=true",
                           std::string("parallelism.shard=") + shard, "parallelism.dp=2"}),
             2);
}

// A number that is not whole is "not an integer", not "out of range"; a whole one beyond the field still is.
TEST(TrainConfig, LoraIsANestedMapOrDottedFieldsAndPrintsBack) {
  const TrainConfig c =
      parse_config("model: {lora: {rank: 8, alpha: 16, target: [q_proj, v_proj], use_rslora: true}}", "a.yaml");
  EXPECT_EQ(c.model.lora_rank, 8);
  EXPECT_EQ(c.model.lora_alpha, 16.0);
  EXPECT_EQ(c.model.lora_target, (std::vector<std::string>{"q_proj", "v_proj"}));
  EXPECT_FALSE(c.model.lora_target_regex);
  EXPECT_TRUE(c.model.lora_use_rslora);
  EXPECT_EQ(to_yaml(parse_config(to_yaml(c), "printed")), to_yaml(c));
  // One string is PEFT's regular expression; --set reaches the nested fields by their dotted names.
  const TrainConfig r = parse_config("", "a.yaml", {"model.lora.rank=4", "model.lora.target=.*\\.(q|v)_proj"});
  EXPECT_EQ(r.model.lora_rank, 4);
  EXPECT_EQ(r.model.lora_target, (std::vector<std::string>{".*\\.(q|v)_proj"}));
  EXPECT_TRUE(r.model.lora_target_regex);
  EXPECT_EQ(to_yaml(parse_config(to_yaml(r), "printed")), to_yaml(r));
  EXPECT_EQ(error_of([] { parse_config("model: {lora: {ranks: 8}}", "a.yaml"); }),
            "a.yaml: unknown field `model.lora.ranks`");
  EXPECT_EQ(error_of([] { validate(parse_config("model: {lora: {rank: 8, dropout: 0.1}}", "a.yaml"), 1); }), "");
  EXPECT_EQ(error_of([] { validate(parse_config("model: {lora: {rank: 8, dropout: 1}}", "a.yaml"), 1); }),
            "config: model.lora.dropout = 1 must be in [0, 1)");
}

TEST(TrainConfig, IntegerFieldsSayIntegerForFractions) {
  EXPECT_EQ(error_of([] { parse_config("train: {steps: 1.5}", "a.yaml"); }),
            "config: field `train.steps` must be an integer, got '1.5'");
  EXPECT_EQ(error_of([] { parse_config("train: {seed: 1.0}", "a.yaml"); }),
            "config: field `train.seed` must be a non-negative integer, got '1.0'");
  EXPECT_EQ(error_of([] { parse_config("", "a.yaml", {"train.steps=2.5"}); }),
            "config: field `train.steps` must be an integer, got '2.5'");
  EXPECT_EQ(error_of([] { parse_config("", "a.yaml", {"train.steps=1e12"}); }),
            "config: field `train.steps` = 1e12 is out of range (-2147483648 to 2147483647)");
  EXPECT_EQ(error_of([] { parse_config("train: {seed: -1}", "a.yaml"); }),
            "config: field `train.seed` = -1 is out of range (0 to 18446744073709551615)");
}

// Every yaml-cpp failure becomes one rf::Error naming the file and the line (the ranks of a job agree only on those):
// a key that is a list or a map names no field.
TEST(TrainConfig, NonScalarKeysNameTheFileAndLine) {
  EXPECT_EQ(error_of([] { parse_config("train: {steps: 1}\n? [a, b]\n: 1\n", "a.yaml"); }),
            "a.yaml:2: a key must be a plain name, not a list");
  EXPECT_EQ(error_of([] { parse_config("train:\n  steps: 1\n  ? {a: 1}\n  : 2\n", "a.yaml"); }),
            "a.yaml:3: a key must be a plain name, not a map");
  EXPECT_EQ(error_of([] { parse_config("", "a.yaml", {"model.freeze=[a, {b: 1}]"}); }),
            "config: field `model.freeze` must be a list of strings");
}

// checkpoint.max_shard_size reads as transformers reads max_shard_size: plain bytes, or a number with a decimal unit
// (huggingface_hub: KB = 1000 bytes) or a binary one (KiB = 1024), in any case; nothing else, and never below a byte.
TEST(TrainConfig, MaxShardSizeIsTransformersSize) {
  const auto bytes = [](const std::string& v) {
    return max_shard_bytes(parse_config("", "t", {"checkpoint.max_shard_size=" + v}).checkpoint);
  };
  EXPECT_EQ(max_shard_bytes(TrainConfig{}.checkpoint), int64_t{50'000'000'000});  // transformers' "50GB"
  EXPECT_EQ(bytes("4096"), 4096);
  EXPECT_EQ(bytes("200KB"), 200'000);
  EXPECT_EQ(bytes("5gb"), 5'000'000'000);
  EXPECT_EQ(bytes("1.5MB"), 1'500'000);
  EXPECT_EQ(bytes("2MiB"), 2 * 1024 * 1024);
  EXPECT_EQ(bytes("1 TiB"), int64_t{1} << 40);
  for (const char* bad : {"", "GB", "0", "0.5", "5XB", "-5MB", "5MB5", "1e30TB"})
    EXPECT_NE(error_of([&] { bytes(bad); }).find("checkpoint.max_shard_size"), std::string::npos) << bad;
  EXPECT_NE(error_of([] {
              validate(parse_config("", "t", {"checkpoint.max_shard_size=big"}), 1);
            }).find("is not a positive size"),
            std::string::npos);
}

// data.image_soft_tokens, unset, is the max_soft_tokens of the image processor beside model.path (transformers 5's
// processor_config.json nests it under image_processor; an image processor saved alone writes it at the top of
// preprocessor_config.json), else Gemma4ImageProcessor's default 280; given, it wins.
TEST(TrainConfig, ImageSoftTokensDefaultToTheCheckpointsProcessor) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / "rf_soft_tokens";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const auto write = [&](const char* name, const std::string& text) { std::ofstream(dir / name) << text; };
  const auto soft = [&](std::vector<std::string> sets) {
    sets.push_back("model.path=" + dir.string());
    return parse_config("", "x", sets).data.image_soft_tokens;
  };
  EXPECT_EQ(parse_config("", "x").data.image_soft_tokens, 280);
  EXPECT_EQ(soft({}), 280);
  write("preprocessor_config.json", R"({"image_processor_type": "Gemma4ImageProcessor", "max_soft_tokens": 140})");
  EXPECT_EQ(soft({}), 140);
  write("processor_config.json", R"({"image_processor": {"max_soft_tokens": 70}, "image_seq_length": 70})");
  EXPECT_EQ(soft({}), 70);  // processor_config.json first, as AutoProcessor reads it
  EXPECT_EQ(soft({"data.image_soft_tokens=560"}), 560);
  write("processor_config.json", R"({"image_processor": {"max_soft_tokens": 100}})");
  EXPECT_EQ(error_of([&] { soft({}); }),
            (dir / "processor_config.json").string() +
                ": image_processor.max_soft_tokens = 100 is not 70, 140, 280, 560 or 1120 (data.image_soft_tokens "
                "takes its default from it; set it to override)");
  EXPECT_EQ(soft({"data.image_soft_tokens=1120"}), 1120);
  std::filesystem::remove_all(dir);
}

TEST(TrainConfig, CrossFieldRules) {
  const auto check = [](const std::vector<std::string>& sets, int ranks) {
    return error_of([&] { validate(parse_config("", "x", sets), ranks); });
  };
  EXPECT_EQ(check({"parallelism.cp=2", "parallelism.dp=2"}, 2),
            "config: parallelism.cp * parallelism.dp = 2 * 2 = 4 does not match the 2 rank(s) of this job");
  EXPECT_EQ(check({"parallelism.cp=4", "train.seq_len=3"}, 4),
            "config: train.seq_len = 3 is shorter than parallelism.cp = 4 (every CP rank needs a token)");
  EXPECT_EQ(check({"parallelism.dp=3", "train.global_batch=4"}, 3),
            "config: train.global_batch = 4 is not a multiple of parallelism.dp = 3");
  EXPECT_EQ(check({"train.global_batch=6", "train.micro_batch=4"}, 1),
            "config: train.global_batch / parallelism.dp = 6 is not a multiple of train.micro_batch = 4");
  EXPECT_EQ(check({"model.path=/absent/ckpt"}, 1), "config: model.path = '/absent/ckpt' has no config.json");
  EXPECT_EQ(
      check({"model.builtin=huge"}, 1),
      "config: model.builtin = 'huge' is not one of tiny_dense, tiny_moe_vlm (or set model.path to a checkpoint)");
  EXPECT_EQ(check({"data.source=jsonl_tokens"}, 1), "config: data.path is required with data.source = jsonl_tokens");
  EXPECT_EQ(check({"data.source=jsonl_tokens", "data.path=/absent.jsonl"}, 1),
            "config: data.path = '/absent.jsonl' is not a file");
  EXPECT_EQ(check({"optimizer.beta2=1"}, 1), "config: optimizer.beta2 = 1 must be in [0, 1)");
  EXPECT_EQ(check({"optimizer.weight_decay=1e308"}, 1),
            "config: optimizer.lr * optimizer.weight_decay = 0.003 * 1e+308 = 3e+305 must be below 1 (AdamW scales "
            "each weight by 1 - lr * weight_decay a step)");
  EXPECT_EQ(check({"optimizer.lr=2", "optimizer.weight_decay=0.5"}, 1),
            "config: optimizer.lr * optimizer.weight_decay = 2 * 0.5 = 1 must be below 1 (AdamW scales each weight by "
            "1 - lr * weight_decay a step)");
  EXPECT_EQ(check({"optimizer.lr=1e30", "optimizer.weight_decay=0"}, 1), "");
  EXPECT_EQ(check({"train.steps=0"}, 1), "config: train.steps = 0 must be >= 1");
  EXPECT_EQ(check({"parallelism.sharding=diagonal"}, 1),
            "config: parallelism.sharding = 'diagonal' is not one of contiguous, zigzag, balanced");
  EXPECT_EQ(check({"parallelism.shard=zero1"}, 1),
            "config: parallelism.shard = 'zero1' is not one of none, optimizer, gradients, full");
  EXPECT_EQ(check({"checkpoint.keep=0"}, 1), "config: checkpoint.keep = 0 must be >= 1");
}

}  // namespace
}  // namespace rf::trainer
