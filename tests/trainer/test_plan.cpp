// `ringflex train --plan` (trainer/plan.h): which layouts fit, priced by the check `ringflex train` runs. The rows
// are the trainer's own figures for their configs, ordered as plan.h says; the real Gemma 4 E2B and 26B-A4B layouts
// (bench/trainer/configs, the shapes of transformers' configurations) are read from a config.json alone.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <string>
#include <vector>

#include "common/error_of.h"
#include "core/memory.h"
#include "model/builtin_configs.h"
#include "model/checkpoint.h"
#include "trainer/plan.h"
#include "trainer/samples.h"
#include "trainer/trainer.h"

namespace rf::trainer {
namespace {

namespace fs = std::filesystem;
using testing::error_of;

constexpr int64_t kGiB = int64_t{1} << 30;

TrainConfig config(std::vector<std::string> sets) {
  std::vector<std::string> base = {"model.builtin=tiny_moe_vlm", "train.seq_len=256", "train.global_batch=8",
                                   "train.threads=1", "data.val_rows=0"};
  base.insert(base.end(), sets.begin(), sets.end());
  return parse_config("", "test", base);
}

// A directory holding `name`'s config.json and nothing else (no weights): what a user has before downloading.
std::string config_only(const std::string& name) {
  const fs::path dir = fs::path(::testing::TempDir()) / ("plan_" + name);
  fs::create_directories(dir);
  fs::copy_file(fs::path(RINGFLEX_SOURCE_DIR) / "bench/trainer/configs" / (name + ".json"), dir / "config.json",
                fs::copy_options::overwrite_existing);
  return dir.string();
}

std::string layout(const PlanRow& r) {
  return rf::concat("cp ", r.cp, " dp ", r.dp, " ep ", r.ep, " ", name_of(r.shard), " ",
                    model::param_dtype_name(r.param_dtype), r.lora ? " LoRA" : " full");
}

// Each row is train_memory_at_least of its own config over the plan's model, its recompute fields left at auto chosen
// for the plan's machine: the number `ringflex train` checks.
void expect_rows_are_the_check(const Plan& plan, const TrainConfig& c, const PlanMachine& machine) {
  const std::unique_ptr<model::Gemma4Multimodal> shapes =
      c.model.path.empty() ? nullptr : model::checkpoint_shapes(c.model.path, c.model.train_vision);
  for (const PlanRow& r : plan.rows) {
    TrainConfig rc = row_config(c, r);
    EXPECT_NO_THROW(validate_parallelism(rc, machine.ranks)) << layout(r);
    if (shapes == nullptr) continue;
    rc = choose_recompute(rc, *shapes, machine.ranks, machine.ranks_per_node, {}, machine.rank_bytes);
    const MemoryBreakdown need = train_memory_at_least(rc, *shapes, machine.ranks, machine.ranks_per_node);
    ASSERT_EQ(need.terms().size(), r.need.terms().size()) << layout(r);
    for (size_t t = 0; t < need.terms().size(); ++t) {
      EXPECT_EQ(need.terms()[t].name, r.need.terms()[t].name) << layout(r);
      EXPECT_EQ(need.terms()[t].bytes, r.need.terms()[t].bytes) << layout(r) << ": " << need.terms()[t].name;
    }
    EXPECT_EQ(r.fits, need.total() <= machine.rank_bytes) << layout(r);
  }
}

// Fitting rows first; among them shard none, optimizer, gradients, full; ep 1 before more; float32 before bfloat16;
// fewer CP ranks first. Non-fitting rows after, fewest bytes first.
void expect_best_first(const Plan& plan) {
  for (size_t i = 1; i < plan.rows.size(); ++i) {
    const PlanRow &a = plan.rows[i - 1], &b = plan.rows[i];
    SCOPED_TRACE(layout(a) + " before " + layout(b));
    EXPECT_TRUE(a.fits || !b.fits);
    if (!a.fits && !b.fits) {
      EXPECT_LE(a.need.total(), b.need.total());
    } else if (a.fits && b.fits && a.lora == b.lora) {
      // The first field that differs decides, in plan.h's order.
      const int fields_a[] = {static_cast<int>(a.shard), a.ep, static_cast<int>(a.param_dtype), a.cp};
      const int fields_b[] = {static_cast<int>(b.shard), b.ep, static_cast<int>(b.param_dtype), b.cp};
      const auto [at_a, at_b] = std::mismatch(std::begin(fields_a), std::end(fields_a), std::begin(fields_b));
      if (at_a != std::end(fields_a)) {
        EXPECT_LT(*at_a, *at_b);
      } else {
        EXPECT_LE(a.need.total(), b.need.total());
      }
    }
  }
}

// The real E2B: dense (no ep row), 8 ranks of 24 GiB machines, one a machine, at 32K tokens. Every cp x dp layout
// of 8 appears with 4 shard modes x 2 dtypes (the global batch of 8 divides every dp); shard none's float32 state
// (4.6 B parameters: 17 GiB of weights, as much of gradients, twice that of moments) does not fit, shard full's
// eighth of it does.
TEST(TrainPlan, E2BFromItsConfigJson) {
  TrainConfig c = config({"train.seq_len=32768"});
  c.model.path = config_only("gemma4_e2b");
  const PlanMachine machine{8, 1, rank_share_bytes(24 * kGiB, 1)};
  const Plan plan = plan_training(c, machine);
  EXPECT_EQ(plan.rows.size(), 4u * 4u * 2u);
  for (const PlanRow& r : plan.rows) EXPECT_EQ(r.ep, 1);
  EXPECT_TRUE(plan.refused.empty());
  expect_rows_are_the_check(plan, c, machine);
  expect_best_first(plan);
  for (const PlanRow& r : plan.rows) {
    if (r.shard == ShardMode::None && r.param_dtype == model::ParamDtype::Float32) {
      EXPECT_FALSE(r.fits) << layout(r);
    }
  }
  ASSERT_TRUE(plan.rows.front().fits);
  EXPECT_NE(plan.rows.front().shard, ShardMode::None);
}

// The real 26B-A4B (MoE, 128 experts): ep takes the divisors of 8 (all divide 128), bfloat16 weights with ep > 1 are
// refused by the held experts' state, and its reason is listed once with its count.
TEST(TrainPlan, MoeOffersExpertParallelism) {
  TrainConfig c = config({"train.seq_len=8192"});
  c.model.path = config_only("gemma4_26b_a4b");
  const PlanMachine machine{8, 8, rank_share_bytes(1024 * kGiB, 8)};
  const Plan plan = plan_training(c, machine);
  std::set<int> eps;
  for (const PlanRow& r : plan.rows) {
    eps.insert(r.ep);
    EXPECT_FALSE(r.ep > 1 && r.param_dtype == model::ParamDtype::Bfloat16) << layout(r);
  }
  EXPECT_EQ(eps, (std::set<int>{1, 2, 4, 8}));
  ASSERT_EQ(plan.refused.size(), 1u);
  EXPECT_NE(plan.refused[0].first.find("model.param_dtype = bfloat16 with parallelism.ep > 1 is not implemented"),
            std::string::npos);
  EXPECT_EQ(plan.refused[0].second, 4 * 3 * 4);  // 4 cp x dp layouts, ep 2, 4, 8, 4 shard modes
  expect_rows_are_the_check(plan, c, machine);
  expect_best_first(plan);
  // Held experts at ep 8 hold an eighth of the experts: fewer bytes than ep 1 in the same layout.
  const auto find = [&](int cp, int ep) {
    return *std::find_if(plan.rows.begin(), plan.rows.end(), [&](const PlanRow& r) {
      return r.cp == cp && r.ep == ep && r.shard == ShardMode::None && !r.lora &&
             r.param_dtype == model::ParamDtype::Float32;
    });
  };
  EXPECT_LT(find(2, 8).need.total(), find(2, 1).need.total());
}

// LoRA rows come with a model.lora block (its rank and targets), beside full training, and the config's own choice
// ranks first among those that fit; shard gradients / full and bfloat16 under LoRA are refused with their reasons.
TEST(TrainPlan, LoraBlockAddsLoraRows) {
  const PlanMachine machine{4, 4, 64 * kGiB};
  const Plan full = plan_training(config({}), machine);
  for (const PlanRow& r : full.rows) EXPECT_FALSE(r.lora);
  const Plan lora = plan_training(config({"model.lora.rank=4"}), machine);
  int lora_rows = 0;
  for (const PlanRow& r : lora.rows) {
    lora_rows += r.lora ? 1 : 0;
    if (r.lora) {
      EXPECT_TRUE(r.shard == ShardMode::None || r.shard == ShardMode::Optimizer) << layout(r);
      EXPECT_EQ(r.param_dtype, model::ParamDtype::Float32) << layout(r);
    }
  }
  EXPECT_EQ(lora.rows.size() - static_cast<size_t>(lora_rows), full.rows.size());
  EXPECT_GT(lora_rows, 0);
  ASSERT_TRUE(lora.rows.front().fits);
  EXPECT_TRUE(lora.rows.front().lora);
  bool shard_refusal = false;
  for (const auto& [why, count] : lora.refused)
    shard_refusal |= why.find("model.lora with parallelism.shard = gradients is not implemented") != std::string::npos;
  EXPECT_TRUE(shard_refusal);
  expect_best_first(lora);
}

// A budget between two rows' figures: the rows up to it fit, the others do not, and the smallest that does not
// leads the rest.
TEST(TrainPlan, FitsIsTheFigureAgainstTheBudget) {
  // What the backward recomputes is set: left at auto, a row would recompute more under the tight budget and fit.
  const TrainConfig c = config({"train.seq_len=4096", "train.recompute=true", "train.keep_mlp=false",
                                "train.keep_o_proj=true", "train.keep_down_proj=true"});
  const Plan roomy = plan_training(c, PlanMachine{4, 4, int64_t{1} << 50});
  std::vector<int64_t> totals;
  for (const PlanRow& r : roomy.rows) totals.push_back(r.need.total());
  std::sort(totals.begin(), totals.end());
  ASSERT_LT(totals.front(), totals.back());
  const int64_t budget = totals[totals.size() / 2];
  const Plan tight = plan_training(c, PlanMachine{4, 4, budget});
  for (const PlanRow& r : tight.rows) EXPECT_EQ(r.fits, r.need.total() <= budget) << layout(r);
  expect_best_first(tight);
  EXPECT_FALSE(tight.rows.back().fits);
}

// train.samples: the plan reads the prompts file as `ringflex train` does, and every row counts the samples'
// generation (its KV cache at the row's CP) with the same function as the check.
TEST(TrainPlan, SamplesCacheIsInEveryRow) {
  const fs::path prompts = fs::path(::testing::TempDir()) / "plan_prompts.jsonl";
  std::ofstream(prompts) << "{\"ids\": [1, 40]}\n{\"ids\": [1, 40, 41]}\n";
  const TrainConfig c = config({"train.samples.prompts=" + prompts.string(), "train.samples.max_new_tokens=100000"});
  const Plan plan = plan_training(c, PlanMachine{2, 2, int64_t{1} << 50});
  const model::Gemma4Multimodal m(model::Gemma4Config::from_json(model::builtin_config_json("tiny_moe_vlm")),
                                  model::MultimodalParts{model::kBuiltinFeatureDim},
                                  model::TensorSet::Storage::Deferred);
  const std::string cache = std::string(kSamplesTerm) + "KV cache";
  ASSERT_FALSE(plan.rows.empty());
  for (const PlanRow& r : plan.rows) {
    EXPECT_GT(r.need.of(cache), 0) << layout(r);
    EXPECT_EQ(r.need.of(cache), samples_memory_at_least(row_config(c, r), m, std::vector<int64_t>{2, 3}).of(cache))
        << layout(r);
  }
  EXPECT_EQ(error_of([&] {
              plan_training(config({"train.samples.prompts=/absent/prompts.jsonl"}), PlanMachine{1, 1, kGiB});
            }),
            "/absent/prompts.jsonl: cannot open");
}

// train.samples' image prompts: read as generate reads them (trainer/conversation_prompt.h), each image <boi>, its
// soft-token slots (token type 1; the processor's count, whole pooling cells of its resized picture) and <eoi>, no
// features until a tower encodes them; the plan counts the slots in the samples' cache.
TEST(TrainPlan, SamplesImagePromptCountsItsSlots) {
  const fs::path chat = fs::path(RINGFLEX_SOURCE_DIR) / "examples/tiny_chat";
  const fs::path prompts = fs::path(::testing::TempDir()) / "plan_image_prompts.jsonl";
  std::ofstream(prompts) << R"({"messages": [{"role": "user", "content": [{"type": "image", "path": ")"
                         << (chat / "images/0_yellow_circle.png").string()
                         << R"("}, {"type": "text", "text": "What is this?"}]}]})"
                         << "\n";
  const TrainConfig c =
      config({"train.samples.prompts=" + prompts.string(), "train.samples.max_new_tokens=100000",
              "data.tokenizer=" + (chat / "tokenizer.json").string(),
              "data.chat_template=" + (chat / "chat_template.jinja").string(), "data.image_soft_tokens=70"});
  const std::string text = model::builtin_config_json("tiny_moe_vlm");
  const auto m = std::make_unique<model::Gemma4Multimodal>(
      model::Gemma4Config::from_json(text),
      model::MultimodalParts{model::kBuiltinFeatureDim, model::VisionConfig::from_config_json(text, "tiny_moe_vlm")},
      model::TensorSet::Storage::Deferred);
  const SamplePrompts s = read_sample_prompts(c, *m, 1);
  ASSERT_EQ(s.prompts.size(), 1u);
  ASSERT_EQ(s.images.size(), 1u);
  ASSERT_EQ(s.images[0].size(), 1u);
  const model::Prompt& p = s.prompts[0];
  const model::ProcessedImage& image = s.images[0][0];
  const int cell = m->parts().vision->patch_size * m->parts().vision->pooling_kernel_size;
  EXPECT_EQ(image.soft_tokens, int64_t{image.height / cell} * (image.width / cell));
  EXPECT_GT(image.soft_tokens, 0);
  EXPECT_LE(image.soft_tokens, 70);
  const model::MultimodalTokens tokens = model::MultimodalTokens::from_config_json(m->config().source_json, "test");
  const auto first = std::find(p.ids.begin(), p.ids.end(), tokens.image);
  ASSERT_NE(first, p.ids.begin());
  const size_t at = static_cast<size_t>(first - p.ids.begin());
  ASSERT_LT(at + static_cast<size_t>(image.soft_tokens), p.ids.size());
  EXPECT_EQ(p.ids[at - 1], tokens.boi);
  EXPECT_EQ(p.ids[at + static_cast<size_t>(image.soft_tokens)], tokens.eoi);
  EXPECT_EQ(std::count(p.ids.begin(), p.ids.end(), tokens.image), image.soft_tokens);
  ASSERT_EQ(p.mm_token_type.size(), p.ids.size());
  for (size_t t = 0; t < p.ids.size(); ++t) EXPECT_EQ(p.mm_token_type[t], p.ids[t] == tokens.image ? 1 : 0) << t;
  EXPECT_TRUE(p.image_features.empty());
  const Plan plan = plan_training(c, PlanMachine{2, 2, int64_t{1} << 50});
  const std::string cache = std::string(kSamplesTerm) + "KV cache";
  const std::vector<int64_t> lengths = {static_cast<int64_t>(p.ids.size())};
  ASSERT_FALSE(plan.rows.empty());
  for (const PlanRow& r : plan.rows) {
    EXPECT_GT(r.need.of(cache), 0) << layout(r);
    EXPECT_EQ(r.need.of(cache), samples_memory_at_least(row_config(c, r), *m, lengths).of(cache)) << layout(r);
  }
}

TEST(TrainPlan, BadInputsAreOneLine) {
  EXPECT_EQ(error_of([] {
              plan_training(config({}), PlanMachine{0, 1, kGiB});
            }),
            "train --plan: --ranks = 0 must be >= 1");
  EXPECT_EQ(error_of([] {
              plan_training(config({}), PlanMachine{2, 3, kGiB});
            }),
            "train --plan: --ranks-per-node = 3 must be in [1, --ranks = 2]");
  EXPECT_EQ(error_of([] {
              plan_training(config({"train.seq_len=2", "train.global_batch=3"}), PlanMachine{4, 4, kGiB});
            }),
            "train --plan: no layout of 4 rank(s) is supported: config: train.global_batch = 3 is not a multiple of "
            "parallelism.dp = 4");
  TrainConfig missing = config({});
  missing.model.path = (fs::path(::testing::TempDir()) / "plan_nowhere").string();
  EXPECT_EQ(error_of([&] {
              plan_training(missing, PlanMachine{1, 1, kGiB});
            }),
            missing.model.path + ": not a directory");
}

}  // namespace
}  // namespace rf::trainer
