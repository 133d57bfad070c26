// What training needs, checked before it allocates (trainer::train_memory_at_least): its terms follow the config
// (freeze, cp, recompute, micro-batch), and a run beyond the memory available stops with the figure before the
// weights exist, from a built-in model and from a checkpoint it resumes.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "comm/loopback_comm.h"
#include "common/error_of.h"
#include "common/memory_limit.h"
#include "model/builtin_configs.h"
#include "model/checkpoint.h"
#include "model/generate.h"
#include "model/lora_store.h"
#include "model/memory.h"
#include "model/vision.h"
#include "model/vision_encoder.h"
#include "trainer/runtime_memory.h"
#include "trainer/state/sharded_store.h"
#include "trainer/trainer.h"

namespace rf::trainer {
namespace {

using testing::error_of;

TrainConfig config(std::vector<std::string> sets) {
  std::vector<std::string> base = {"model.builtin=tiny_dense", "train.seq_len=512",
                                   "train.global_batch=4",     "train.steps=2",
                                   "train.threads=1",          "data.val_rows=2",
                                   "train.val_every=0"};
  base.insert(base.end(), sets.begin(), sets.end());
  return parse_config("", "test", base);
}

model::Gemma4Multimodal shapes() {
  return model::Gemma4Multimodal(model::Gemma4Config::from_json(model::builtin_config_json("tiny_dense")),
                                 model::MultimodalParts{model::kBuiltinFeatureDim},
                                 model::TensorSet::Storage::Deferred);
}

// Expert parallelism: a rank holds its EP rank's experts only, so the experts' weights, gradients and moments count
// E / ep experts; under sharding (trainer/state/held_expert_store.h) the other parameters are placed by the mode, the
// experts' moments (and under gradients / full their gradients) are a padded slice over the Q = N / ep EDP ranks.
TEST(TrainMemory, HeldExpertsCountTheRanksOwn) {
  const model::Gemma4Multimodal m(model::Gemma4Config::from_json(model::builtin_config_json("tiny_moe_vlm")),
                                  model::MultimodalParts{model::kBuiltinFeatureDim},
                                  model::TensorSet::Storage::Deferred);
  const std::vector<std::string> moe = {"model.builtin=tiny_moe_vlm", "train.seq_len=8", "parallelism.dp=2"};
  const auto with = [&](std::vector<std::string> more) {
    std::vector<std::string> sets = moe;
    sets.insert(sets.end(), more.begin(), more.end());
    return train_memory_at_least(config(sets), m, 2);
  };
  int64_t experts = 0;  // float32 bytes of every expert tensor
  for (const model::ParamInfo& t : m.params().infos())
    if (t.name.ends_with(".experts.gate_up_proj") || t.name.ends_with(".experts.down_proj"))
      experts += t.numel * int64_t{sizeof(float)};
  ASSERT_GT(experts, 0);
  const MemoryBreakdown one = with({}), two = with({"parallelism.ep=2"});
  EXPECT_EQ(one.of("weights") - two.of("weights"), experts / 2);
  EXPECT_EQ(one.of("gradients") - two.of("gradients"), experts / 2);
  EXPECT_EQ(one.of("AdamW moments") - two.of("AdamW moments"), 2 * (experts / 2));
  const MemoryBreakdown sharded = with({"parallelism.ep=2", "parallelism.shard=optimizer"});  // Q = 1
  EXPECT_EQ(sharded.of("experts held (E / ep)"), experts / 2);
  EXPECT_EQ(sharded.of("weights") + sharded.of("experts held (E / ep)"), two.of("weights"));
  EXPECT_EQ(sharded.of("gradients") + sharded.of("experts' gradients"), two.of("gradients"));
  EXPECT_EQ(sharded.of("experts' AdamW moments (EDP slice)"), 2 * (experts / 2));
  // 4 ranks, ep 2: two EDP ranks share each expert's state. One layer's held experts (every layer has the same).
  const int64_t held = experts / 2 / int64_t{sizeof(float)}, slice = (held + 1) / 2;
  const int64_t layer = held / m.config().num_layers, f32 = sizeof(float);
  const auto over4 = [&](const std::string& mode) {
    std::vector<std::string> sets = {"model.builtin=tiny_moe_vlm", "train.seq_len=8", "parallelism.dp=4",
                                     "parallelism.ep=2", "parallelism.shard=" + mode};
    return train_memory_at_least(config(sets), m, 4);
  };
  for (const std::string mode : {"optimizer", "gradients", "full"}) {
    const MemoryBreakdown b = over4(mode);
    EXPECT_EQ(b.of("experts held (E / ep)"), experts / 2) << mode;
    EXPECT_EQ(b.of("experts' AdamW moments (EDP slice)"), 2 * slice * f32) << mode;
    // optimizer: every held expert's gradient; gradients, full: the slice, one layer's buffer and its Q runs.
    EXPECT_EQ(b.of("experts' gradients"), mode == "optimizer" ? experts / 2 : (slice + 2 * layer) * f32) << mode;
  }
}

TEST(TrainMemory, TermsFollowTheConfig) {
  const model::Gemma4Multimodal m = shapes();
  const int64_t params = m.params().weight_bytes();
  const MemoryBreakdown one = train_memory_at_least(config({}), m, 1);
  EXPECT_EQ(one.of("gradients"), params);
  EXPECT_EQ(one.of("AdamW moments"), 2 * params);
  EXPECT_EQ(one.of("weights"), params + m.buffers().total_bytes());
  // The step's rows: global_batch / dp rows of seq_len tokens, five int32 arrays each.
  const TrainConfig defaults = config({});
  EXPECT_EQ(one.of("the step's rows"), int64_t{defaults.global_batch_per_replica()} * 512 * 5 * 4);
  EXPECT_EQ(train_memory_at_least(config({"parallelism.dp=2"}), m, 2).of("the step's rows"),
            one.of("the step's rows") / 2);
  // Validation builds this replica's share of data.val_rows at once, the same five int32 arrays a token.
  EXPECT_EQ(one.of("validation rows (data.val_rows)"), int64_t{2} * 512 * 5 * 4);
  EXPECT_EQ(train_memory_at_least(config({"parallelism.dp=2", "data.val_rows=3"}), m, 2)
                .of("validation rows (data.val_rows)"),
            int64_t{2} * 512 * 5 * 4);  // rows 0 and 2 on replica 0
  // The activations are model::run_memory_at_least's for one micro-batch of seq_len tokens.
  model::RunMemoryArgs run;
  run.tokens = 512;
  run.training = true;
  EXPECT_EQ(one.of("activations"), model::run_memory_at_least(m.decoder(), run).of("activations"));

  // Over 2 ranks the gradients are reduced in place in the store's flat arena: no copy to count.
  const MemoryBreakdown dp = train_memory_at_least(config({"train.seq_len=8", "parallelism.dp=2"}), m, 2);
  EXPECT_EQ(dp.of("gradient reduction"), 0);
  EXPECT_GT(dp.of("activations"), 0);
  const MemoryBreakdown frozen =
      train_memory_at_least(config({"train.seq_len=8", "parallelism.dp=2", "model.freeze=embed"}), m, 2);
  int64_t embed = 0;  // the bytes of the tensors "embed" freezes
  for (const model::ParamInfo& t : m.params().infos())
    if (t.name.find("embed") != std::string::npos) embed += t.numel * int64_t{sizeof(float)};
  ASSERT_GT(embed, 0);
  // parallelism.shard = optimizer: a rank holds the moments of its padded shard, ceil(trainable / N) elements.
  const int64_t elements = params / int64_t{sizeof(float)};
  EXPECT_EQ(train_memory_at_least(config({"parallelism.dp=3", "train.global_batch=3", "parallelism.shard=optimizer"}),
                                  m, 3)
                .of("AdamW moments"),
            2 * ((elements + 2) / 3) * int64_t{sizeof(float)});
  // parallelism.shard = gradients: the same moments; the gradients are this rank's padded slice, the global group's
  // buffer (embeddings, final norm, head: written through the whole backward) and one decoder layer's buffer.
  // shard = full: besides, a weight shard of the same padded slice and the global group gathered: its small
  // parameters, the rows of its tied table (every rank's tokens: 3 x 512, all 512 rows) and, around the loss, the
  // head (that table) beside the last layer, the largest moment of the gathered kind (more than any one layer).
  int64_t global = 0, layer0 = 0, last = 0;  // elements
  for (const model::ParamInfo& t : m.params().infos()) {
    if (t.layer == model::kGlobalGroup) global += t.numel;
    if (t.layer == 0) layer0 += t.numel;  // tiny_moe_vlm's layers are alike but for the full one
    if (t.layer == m.config().num_layers - 1) last += t.numel;
  }
  const int64_t table = m.params().info(m.params().slot("model.embed_tokens.weight")).numel;
  int64_t largest = 0;
  for (int l = 0; l < m.config().num_layers; ++l) {
    int64_t n = 0;
    for (size_t slot : m.params().group(l)) n += m.params().info(slot).numel;
    largest = std::max(largest, n);
  }
  ASSERT_GE(largest, layer0);
  const int64_t slice = (elements + 2) / 3, f32 = sizeof(float);
  const MemoryBreakdown zero2 =
      train_memory_at_least(config({"parallelism.dp=3", "train.global_batch=9", "parallelism.shard=gradients"}), m, 3);
  EXPECT_EQ(zero2.of("AdamW moments"), 2 * slice * f32);
  EXPECT_EQ(zero2.of("gradients"), (slice + global + largest) * f32);
  EXPECT_EQ(zero2.of("weights"), params + m.buffers().total_bytes());
  const MemoryBreakdown zero3 =
      train_memory_at_least(config({"parallelism.dp=3", "train.global_batch=9", "parallelism.shard=full"}), m, 3);
  EXPECT_EQ(zero3.of("weight shard"), slice * f32 + m.buffers().total_bytes());
  ASSERT_GT(table + last, largest);
  EXPECT_EQ(zero3.of("gathered weights"), (global + table + last) * f32);
  EXPECT_EQ(zero3.of("gradients"), (slice + global + largest) * f32);
  EXPECT_EQ(zero3.of("AdamW moments"), 2 * slice * f32);
  EXPECT_EQ(zero3.of("weights"), 0);
  // The sharded state (weight shard, moments, gradient slice) falls as 1/N; what stays is the gathered part.
  const auto state = [&](int n) {
    const MemoryBreakdown b =
        train_memory_at_least(config({"parallelism.dp=" + std::to_string(n), "train.global_batch=" + std::to_string(n),
                                      "parallelism.shard=full"}),
                              m, n);
    return b.of("weight shard") + b.of("AdamW moments") + b.of("gradients") - (global + largest) * f32;
  };
  EXPECT_NEAR(static_cast<double>(state(4)), static_cast<double>(state(1)) / 4, 4.0 * 4 * f32);  // padding only
  // A frozen tensor has neither a gradient nor moments.
  EXPECT_EQ(frozen.of("gradients"), params - embed);
  EXPECT_EQ(frozen.of("AdamW moments"), 2 * (params - embed));
  // A row split over cp ranks holds a cp-th of the tokens; keeping every layer costs more than recomputing.
  EXPECT_LT(train_memory_at_least(config({"parallelism.cp=2"}), m, 2).of("activations"), one.of("activations"));
  EXPECT_GT(train_memory_at_least(config({"train.recompute=false"}), m, 1).total(), one.total());
  EXPECT_GT(train_memory_at_least(config({"train.micro_batch=2"}), m, 1).total(), one.total());
}

// train.recompute and keep_* left at auto (choose_recompute): the most kept of the ladder whose need fits 95% of the
// budget, else the least; the fields a config sets stay set and narrow the ladder; spill and tile keep no MLP
// projections by choice, spill recomputes.
TEST(TrainMemory, AutoRecomputeKeepsTheMostThatFits) {
  const model::Gemma4Multimodal m = shapes();
  const auto need = [&](const TrainConfig& k) { return train_memory_at_least(k, m, 1).total(); };
  const auto choose = [&](const TrainConfig& k, int64_t budget) {
    return choose_recompute(k, m, 1, local_ranks(), {}, budget);
  };
  const auto need_of = [&](std::vector<std::string> sets) { return need(config(std::move(sets))); };
  // The ladder, each step freeing memory.
  const std::vector<int64_t> ladder = {
      need_of({"train.recompute=false"}),
      need_of({"train.recompute=true", "train.keep_mlp=true", "train.keep_o_proj=true", "train.keep_down_proj=true"}),
      need_of({"train.recompute=true", "train.keep_mlp=false", "train.keep_o_proj=true", "train.keep_down_proj=true"}),
      need_of({"train.recompute=true", "train.keep_mlp=false", "train.keep_o_proj=false", "train.keep_down_proj=true"}),
      need_of(
          {"train.recompute=true", "train.keep_mlp=false", "train.keep_o_proj=false", "train.keep_down_proj=false"})};
  for (size_t i = 1; i < ladder.size(); ++i) EXPECT_GT(ladder[i - 1], ladder[i] + 1) << i;
  const auto keeps = [](const TrainConfig& k) {
    return std::vector<bool>{k.train.recompute, k.train.keep_mlp, k.train.keep_o_proj, k.train.keep_down_proj};
  };
  const std::vector<std::vector<bool>> expected = {{false, false, true, true},
                                                   {true, true, true, true},
                                                   {true, false, true, true},
                                                   {true, false, false, true},
                                                   {true, false, false, false}};
  const TrainConfig automatic = config({});
  for (size_t i = 0; i < ladder.size(); ++i) {
    // The smallest budget whose 95% holds step i: step i - 1 no longer fits in it.
    const auto budget = static_cast<int64_t>(std::ceil(static_cast<double>(ladder[i]) / 0.95));
    const TrainConfig chosen = choose(automatic, budget);
    EXPECT_EQ(keeps(chosen), expected[i]) << "budget for step " << i;
    EXPECT_EQ(need(chosen), ladder[i]);
    EXPECT_TRUE(chosen.train.automatic.any());  // still printed as auto
  }
  // Nothing fits: the least, for the check to refuse with its figure.
  EXPECT_EQ(keeps(choose(automatic, 1)), expected[4]);
  const int64_t plenty = int64_t{1} << 50;
  // Set fields stay set.
  EXPECT_EQ(keeps(choose(config({"train.recompute=true"}), plenty)), expected[1]);
  EXPECT_EQ(keeps(choose(config({"train.keep_o_proj=false"}), plenty)),
            (std::vector<bool>{true, true, false, true}));  // a product asked recomputed: no recompute-free run
  EXPECT_EQ(keeps(choose(config({"train.keep_down_proj=false"}), 1)), expected[4]);
  const TrainConfig given =
      config({"train.recompute=true", "train.keep_mlp=false", "train.keep_o_proj=false", "train.keep_down_proj=true"});
  EXPECT_EQ(keeps(choose(given, plenty)), expected[3]);
  EXPECT_EQ(keeps(choose(config({"train.recompute=false"}), 1))[0], false);
  // The spill file recomputes and keeps no MLP projections by choice; the tiled MLP keeps none.
  EXPECT_EQ(keeps(choose(config({"train.spill_dir=/tmp"}), plenty)), expected[2]);
  const std::vector<bool> tiled = keeps(choose(config({"train.tile_mlp=true", "train.recompute=true"}), plenty));
  EXPECT_EQ(tiled, expected[2]);
  // What the announcement says.
  EXPECT_EQ(describe_recompute(choose(automatic, plenty)), "recompute: none, every layer's activations kept (auto)");
  EXPECT_EQ(describe_recompute(given), "recompute: each layer in the backward, keeping its down_proj output");
  EXPECT_EQ(describe_recompute(config({})),
            "recompute: each layer in the backward, keeping its o_proj and down_proj outputs (auto)");
  EXPECT_EQ(describe_recompute(config({"train.keep_o_proj=false", "train.keep_down_proj=false"})),
            "recompute: each layer in the backward, keeping none of its products (auto)");
}

// model.param_dtype = bfloat16: the bf16 working weights are counted, and replace compute_dtype's bf16 copies (not
// made then). Replicated (none; optimizer and gradients alike): 2 bytes for every weight, and in float32 the largest
// decoder layer, the global group's parameters that are not streamed and the largest streamed one (the head) widened
// at once. Shard full: a bf16 copy of what is gathered (half the gathered float32 bytes). Under shard optimizer and
// gradients the working weights are whole as under none, and the float32 masters are this rank's slice:
// ceil(total / N) elements (nothing frozen here), where float32 working weights keep every weight.
TEST(TrainMemory, Bf16WorkingWeightsAreCounted) {
  const model::Gemma4Multimodal m = shapes();
  int64_t global = 0, streamed = 0, largest = 0;  // elements
  for (const model::ParamInfo& t : m.params().infos()) {
    if (t.streamed)
      streamed = std::max(streamed, t.numel);
    else if (t.layer == model::kGlobalGroup)
      global += t.numel;
  }
  for (int l = 0; l < m.config().num_layers; ++l) {
    int64_t n = 0;
    for (size_t slot : m.params().group(l)) n += m.params().info(slot).numel;
    largest = std::max(largest, n);
  }
  const MemoryBreakdown none =
      train_memory_at_least(config({"model.param_dtype=bfloat16", "model.compute_dtype=bfloat16"}), m, 1);
  EXPECT_EQ(none.of("bf16 working weights"), 2 * m.params().total_elements() + 4 * (largest + global + streamed));
  EXPECT_EQ(none.of("bf16 weight copies"), 0);
  EXPECT_EQ(train_memory_at_least(config({}), m, 1).of("bf16 working weights"), 0);
  const MemoryBreakdown full = train_memory_at_least(config({"parallelism.dp=3", "train.global_batch=3",
                                                             "parallelism.shard=full", "model.param_dtype=bfloat16"}),
                                                     m, 3);
  EXPECT_GT(full.of("gathered weights"), 0);
  EXPECT_EQ(full.of("bf16 working weights"), full.of("gathered weights") / 2);
  constexpr int kRanks = 3;
  const int64_t buffers = m.buffers().total_bytes(), total = m.params().total_elements();
  for (const std::string mode : {"optimizer", "gradients"}) {
    const std::vector<std::string> sets = {"parallelism.dp=3", "train.global_batch=3", "parallelism.shard=" + mode};
    std::vector<std::string> bf16 = sets;
    bf16.push_back("model.param_dtype=bfloat16");
    const MemoryBreakdown b = train_memory_at_least(config(bf16), m, kRanks);
    EXPECT_EQ(b.of("float32 masters (this rank's slice)"), (total + kRanks - 1) / kRanks * 4 + buffers) << mode;
    EXPECT_EQ(b.of("weights"), 0) << mode;
    EXPECT_EQ(b.of("bf16 working weights"), none.of("bf16 working weights")) << mode;
    EXPECT_EQ(train_memory_at_least(config(sets), m, kRanks).of("weights"), total * 4 + buffers) << mode;
  }
}

// model.train_vision: the tower's tape for one image of the data's size, whole or (train.recompute) each layer's input
// only, as VisionEncoder::tape_bytes counts it (tests/model/test_vision_encoder.cpp holds that against a real tape).
TEST(TrainMemory, TrainedVisionTowerCountsItsTapeSmallerWhenRecomputing) {
  const std::string text = model::builtin_config_json("tiny_dense");
  const model::VisionConfig tower = model::VisionConfig::from_config_json(text, "tiny_dense").value();
  const model::Gemma4Multimodal m(model::Gemma4Config::from_json(text),
                                  model::MultimodalParts(model::kBuiltinFeatureDim, tower, true),
                                  model::TensorSet::Storage::Deferred);
  const MemoryBreakdown recompute = train_memory_at_least(config({"model.train_vision=true"}), m, 1);
  const MemoryBreakdown keep =
      train_memory_at_least(config({"model.train_vision=true", "train.recompute=false"}), m, 1);
  // The mock's drawings: data.mock_image_tokens (16 by default) pooling cells of k x k = 2 x 2 patches.
  const int64_t P = 16 * 2 * 2;
  EXPECT_EQ(recompute.of(kVisionActivations), model::VisionEncoder::tape_bytes(tower, 1, P, true));
  EXPECT_EQ(keep.of(kVisionActivations), model::VisionEncoder::tape_bytes(tower, 1, P, false));
  // By hand, the tiny tower (hidden H = 32, intermediate I = 64, 2 heads and 2 KV heads of 16: Q = KV = 32, one
  // layer): a layer keeps 6 [P, H] buffers (input, input norm, o_proj output, MLP input, its norm, down_proj output),
  // 4 [P, Q] (q before and after its norm, attention output, o_proj input), 4 [P, KV] (k, v before and after), 3
  // [P, I] (gate, up, their product) and P x 12 scalars (4 norms' 1/rms, q's, k's and v's per head, the LSE per head):
  // 652 floats a patch, of which recompute keeps the layer's input, H = 32.
  EXPECT_EQ(keep.of(kVisionActivations) - recompute.of(kVisionActivations), P * (652 - 32) * 4);
  EXPECT_GT(keep.total(), recompute.total());
  // Files' images are padded to data.image_soft_tokens' patches.
  const MemoryBreakdown files = train_memory_at_least(config({"model.train_vision=true", "data.source=jsonl_tokens",
                                                              "data.image_soft_tokens=70"}),
                                                      m, 1);
  EXPECT_EQ(files.of(kVisionActivations), model::VisionEncoder::tape_bytes(tower, 1, 70 * 2 * 2, true));
  // A frozen tower encodes the data's images once, before training: no tape.
  EXPECT_EQ(train_memory_at_least(config({}), shapes(), 1).of(kVisionActivations), 0);
}

TEST(TrainMemory, LoraCountsTheAdaptersNotTheBase) {
  const model::Gemma4Multimodal m = shapes();
  const int64_t params = m.params().weight_bytes();
  const TrainConfig c = config({"model.lora.rank=4", "model.lora.target=[q_proj, down_proj]"});
  const MemoryBreakdown lora = train_memory_at_least(c, m, 1);
  // What the LoRA store allocates for the same model and config: its trainable (adapter) parameters.
  model::LoraConfig lc;
  lc.rank = 4;
  lc.target = {"q_proj", "down_proj"};
  const model::Gemma4Multimodal allocated(model::Gemma4Config::from_json(model::builtin_config_json("tiny_dense")),
                                          model::MultimodalParts{model::kBuiltinFeatureDim},
                                          model::TensorSet::Storage::Allocated, std::make_unique<model::LoraStore>(lc));
  const int64_t adapters = allocated.params().trainable_bytes();
  ASSERT_GT(adapters, 0);
  EXPECT_EQ(lora.of("gradients"), adapters);
  EXPECT_EQ(lora.of("AdamW moments"), 2 * adapters);
  EXPECT_EQ(lora.of("weights"), params + adapters + m.buffers().total_bytes());
  EXPECT_EQ(allocated.params().weight_bytes(), params + adapters);
  EXPECT_LT(lora.total(), train_memory_at_least(config({}), m, 1).total());
  // shard optimizer over 3 ranks: each holds the moments of a third of the adapters (padded), the rest unchanged.
  const TrainConfig sharded =
      config({"model.lora.rank=4", "model.lora.target=[q_proj, down_proj]", "parallelism.shard=optimizer"});
  const MemoryBreakdown third = train_memory_at_least(sharded, m, 3);
  const int64_t f32 = sizeof(float);
  EXPECT_EQ(third.of("AdamW moments"), 2 * f32 * model::shard_of(adapters / f32, 0, 3).padded);
  EXPECT_EQ(third.of("gradients"), adapters);
  EXPECT_EQ(third.of("weights"), lora.of("weights"));
}

using ScopedLimit = rf::testing::ScopedMemoryLimit;

std::string train_error(const TrainConfig& c, const TrainOptions& options) {
  std::string error;
  comm::run_ranks(1, [&](comm::Communicator& world) {
    TrainOptions o = options;
    o.progress = nullptr;
    error = error_of([&] { train(c, world, o); });
  });
  return error;
}

// train.samples: the generation after a step holds every prompt's KV cache and its runs' buffers, the figure
// `ringflex generate` checks (model::generate_memory_at_least) at the last CP rank's share, named for the samples. It
// runs once the step's activations are freed, so the larger of the two runs counts, never both.
TEST(TrainMemory, SamplesCountGeneratesFigureInsteadOfASmallerStep) {
  const model::Gemma4Multimodal m = shapes();
  const std::vector<int64_t> prompts = {2, 2, 70};  // the last crosses the sliding window (64)
  for (const int cp : {1, 2, 3}) {
    const TrainConfig c = config({"parallelism.cp=" + std::to_string(cp), "train.samples.prompts=p.jsonl",
                                  "train.samples.max_new_tokens=20000"});
    const MemoryBreakdown gen = model::generate_memory_at_least(m.decoder(), prompts, 20000, cp, cp - 1, DType::F32);
    const MemoryBreakdown samples = samples_memory_at_least(c, m, prompts);
    ASSERT_EQ(samples.terms().size(), gen.terms().size());
    for (size_t t = 0; t < gen.terms().size(); ++t) {
      EXPECT_EQ(samples.terms()[t].name, kSamplesTerm + gen.terms()[t].name);
      EXPECT_EQ(samples.terms()[t].bytes, gen.terms()[t].bytes);
    }
    // By hand: the full layer's one 32-wide KV head, K and V in float32 and a 12-byte TokenMeta a position, holds
    // the rank's share of each prompt's S - 1 prefilled positions and of the 20000 decoded ones (the last rank's,
    // the smallest); the five sliding layers' two 16-wide heads at most their window of 64.
    int64_t cache = 0;
    for (const int64_t S : prompts) {
      const int64_t held = (S - 1 + cp - 1) / cp, decoded = 20000 / cp,
                    in_window = (std::min<int64_t>(S - 1, 63) + cp - 1) / cp;
      cache +=
          (held + decoded) * (2 * 32 * 4 + 12) + 5 * std::min<int64_t>(64, in_window + decoded) * (2 * 2 * 16 * 4 + 12);
    }
    EXPECT_EQ(samples.of("train.samples' KV cache"), cache) << "cp " << cp;
    // The step's run gives way to the samples' terms; every other term is the run's without samples.
    const MemoryBreakdown without = train_memory_at_least(c, m, cp, 1),
                          with = train_memory_at_least(c, m, cp, 1, prompts);
    EXPECT_GT(without.of("activations"), 0);
    EXPECT_EQ(with.of("activations"), 0) << "cp " << cp;
    int64_t rest = 0;
    for (const MemoryBreakdown::Term& t : with.terms()) {
      if (t.name.starts_with(kSamplesTerm)) {
        EXPECT_EQ(t.bytes, samples.of(t.name)) << t.name;
      } else {
        EXPECT_EQ(t.bytes, without.of(t.name)) << t.name;
        rest += t.bytes;
      }
    }
    EXPECT_EQ(with.total(), rest + samples.total());
  }
  // A small generation leaves the step's run as it was.
  const TrainConfig small = config({"train.samples.prompts=p.jsonl", "train.samples.max_new_tokens=4"});
  const MemoryBreakdown kept = train_memory_at_least(small, m, 1, 1, std::vector<int64_t>{2});
  EXPECT_EQ(kept.of("train.samples' KV cache"), 0);
  EXPECT_EQ(kept.total(), train_memory_at_least(small, m, 1, 1).total());
}

TEST(TrainMemory, BeyondTheLimitStopsBeforeAllocatingWithTheFigure) {
  const TrainConfig c = config({});
  const std::string error = [&] {
    const ScopedLimit limit("1M");
    return train_error(c, {});
  }();
  EXPECT_EQ(error.rfind("train needs at least ", 0), 0u) << error;
  EXPECT_NE(error.find(" at seq_len 512 over cp 1), but only 1.0 MiB is available to this rank"), std::string::npos)
      << error;
  EXPECT_NE(error.find("AdamW moments "), std::string::npos) << error;
}

// A million validation rows of the mock source (~10 GB here) stop the run before step 1 with the figure, not with
// std::bad_alloc when the first validation builds them.
TEST(TrainMemory, ValidationRowsBeyondTheLimitStopBeforeStepOne) {
  const TrainConfig c = config({"data.val_rows=1000000"});
  const std::string error = [&] {
    const ScopedLimit limit("4G");
    return train_error(c, {});
  }();
  EXPECT_EQ(error.rfind("train needs at least ", 0), 0u) << error;
  EXPECT_NE(error.find("validation rows (data.val_rows) "), std::string::npos) << error;
}

TEST(TrainMemory, ResumingBeyondTheLimitStopsBeforeLoadingTheWeights) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("rf_train_memory_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  const TrainConfig first = config({"train.steps=1", "checkpoint.dir=" + dir.string()});
  ASSERT_EQ(train_error(first, {}), "");
  TrainOptions resume;
  resume.resume = dir.string();
  const TrainConfig longer = config({"train.steps=2", "checkpoint.dir=" + dir.string()});
  const std::string error = [&] {
    const ScopedLimit limit("1M");
    return train_error(longer, resume);
  }();
  // The whole run's figure, not the loader's own check of the weights alone.
  EXPECT_EQ(error.rfind("train needs at least ", 0), 0u) << error;
  std::filesystem::remove_all(dir);
}

// Under shard full a rank holds its pieces of the weights only, so the loader checks those against the machine, not
// the whole float32 model no rank holds (which would refuse every real Gemma 4 at any N): weights beyond one rank
// load over 4 ranks, each holding about a quarter, while a replicated store refuses them with the figure before
// allocating.
TEST(TrainMemory, ShardFullLoadsWeightsNoRankCouldHoldWhole) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("rf_train_memory_shard_full_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  const char* text_only = R"({"vocab_size": 512, "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "sliding_window": 16,
    "layer_types": ["sliding_attention", "full_attention"], "final_logit_softcapping": 30.0,
    "hidden_size_per_layer_input": 0})";
  model::Checkpoint ck;
  ck.model = std::make_unique<model::Gemma4Multimodal>(model::Gemma4Config::from_json(text_only));
  ck.model->init_random(3, 0.1f);
  model::save_checkpoint(ck, dir.string());
  constexpr int kRanks = 4;
  // Half the whole weights a rank: a quarter of them (and a rank's padding) fits, all of them do not.
  const ScopedLimit limit(std::to_string(ck.model->params().weight_bytes() / 2).c_str());
  const std::string whole = error_of([&] { model::load_checkpoint(dir.string()); });
  EXPECT_NE(whole.find("the model's float32 parameters held by this rank"), std::string::npos) << whole;
  comm::run_ranks(kRanks, [&](comm::Communicator& world) {
    auto store =
        std::make_unique<ShardedStore>(world.split(0, world.rank()), ShardedStore::Mode::Full, comm::default_timeout());
    const model::Checkpoint sharded = model::load_checkpoint(dir.string(), {}, std::move(store));
    EXPECT_TRUE(sharded.model->params().weights_allocated());
  });
  std::filesystem::remove_all(dir);
}

// Under shard full the head is the one streamed parameter held whole (around the loss, with its gradient and its
// reduction's buffers); a per-layer token table is read by row only, however large: E2B's is 6x its head. Here the
// per-layer table (4096 x 2 layers x 128) is four times the head (4096 x 64) and larger than every other term, and no
// term holds it whole.
TEST(TrainMemory, ShardFullHoldsTheHeadWholeNotThePerLayerTable) {
  const char* with_ple = R"({"vocab_size": 4096, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "global_head_dim": 16, "sliding_window": 16,
    "layer_types": ["sliding_attention", "full_attention"], "final_logit_softcapping": 30.0,
    "hidden_size_per_layer_input": 128, "vocab_size_per_layer_input": 4096})";
  const model::Gemma4Model m(model::Gemma4Config::from_json(with_ple), model::TensorSet::Storage::Deferred);
  const model::ParamStore& ps = m.params();
  const int64_t ple_table = ps.info(ps.slot("model.embed_tokens_per_layer.weight")).numel * int64_t{sizeof(float)};
  const int64_t head = ps.info(ps.slot("model.embed_tokens.weight")).numel * int64_t{sizeof(float)};
  ASSERT_GT(ple_table, head);
  constexpr int kRanks = 4;
  constexpr int64_t kStepTokens = 16;
  const ShardedStore::Bytes b =
      ShardedStore::bytes_for(ps, std::vector<bool>(ps.size(), true), ShardedStore::Mode::Full, kRanks, kStepTokens);
  EXPECT_GE(b.gathered, head);
  EXPECT_LT(b.gathered, ple_table);
  EXPECT_LT(b.gradients, ple_table);
  // The head's staging and its reduction (4 ranks' contributions to rank 0's part of it, the whole head here).
  EXPECT_LE(b.comm_buffers, (kRanks + 1) * head);
}

// A reduction's receive buffers are bounded whatever the group (Communicator::post_reduce_parts' rounds): a tied head
// of 65536 x 640 (the 100m config's table, 168 MB) lies in rank 0's slice at N = 2 and in ranks 0-1's at N = 4 and
// 8, whose owners would receive N x their part of it at once (N x 84 MB and more); they receive it in rounds of
// kReduceSliceBytes' worth. Under gradients the communication buffers are the reductions alone: the head's budget, or
// a layer's send copy beside its own budget's worth.
TEST(TrainMemory, ShardedReductionsAreBoundedWhateverTheGroup) {
  auto ps = std::make_unique<model::ReplicatedStore>();
  const size_t table = ps->add("model.embed_tokens.weight", {65536, 640});
  ps->add("model.norm.weight", {640});
  ps->add("model.layers.0.w", {640, 640}, 0, true);
  ps->mark_streamed(table);
  constexpr int64_t kLayerBytes = int64_t{640} * 640 * sizeof(float);
  constexpr auto kBudget = static_cast<int64_t>(comm::Communicator::kReduceSliceBytes);
  for (int N : {2, 4, 8}) {
    const ShardedStore::Bytes b =
        ShardedStore::bytes_for(*ps, std::vector<bool>(ps->size(), true), ShardedStore::Mode::Gradients, N, 16, 16 / N);
    EXPECT_GE(b.comm_buffers, kBudget) << "N = " << N;  // the head's part spans many chunks: two rounds in flight
    EXPECT_LE(b.comm_buffers, kLayerBytes + kBudget) << "N = " << N;
  }
}

// The rows of the token table tied to a trained head are every rank's tokens' on every rank, all-gathered in place
// (fetch_rows), and a per-layer table's owner sends one rank's rows at a time (two in flight): however many tokens a
// step reads, shard full's communication buffers gain at most the rows' reductions' bounded receive buffers (the
// per-layer rows' sends, 2 x 1024 rows of 10 KiB, stay under the head's staging). Before, each owner packed its part
// of the rows for every rank at once: N x min(the rows, its piece), at N = 64 about the whole model.
TEST(TrainMemory, ShardFullRowFetchesDoNotGrowWithTheRanks) {
  auto ps = std::make_unique<model::ReplicatedStore>();
  const size_t table = ps->add("model.embed_tokens.weight", {65536, 640});
  const size_t per_layer = ps->add("model.embed_tokens_per_layer.weight", {65536, 2560});
  ps->add("model.norm.weight", {640});
  ps->add("model.layers.0.w", {640, 640}, 0, true);
  ps->mark_streamed(table);
  ps->mark_streamed(per_layer);
  constexpr int64_t kRankTokens = 1024;
  constexpr auto kBudget = static_cast<int64_t>(comm::Communicator::kReduceSliceBytes);
  const auto comm_buffers = [&](int N, int64_t step_tokens, int64_t rank_tokens) {
    return ShardedStore::bytes_for(*ps, std::vector<bool>(ps->size(), true), ShardedStore::Mode::Full, N, step_tokens,
                                   rank_tokens)
        .comm_buffers;
  };
  for (int N : {2, 8, 32, 64})
    EXPECT_LE(comm_buffers(N, kRankTokens * N, kRankTokens), comm_buffers(N, 1, 1) + kBudget) << "N = " << N;
}

// The runtime baseline is this process's resident set as the first check measured it (libraries, MPI, the start-up
// heap), the same figure in every later check and --stats, however much the process allocates in between.
TEST(TrainMemory, RuntimeBaselineIsTheResidentSetOfTheFirstCheck) {
  const model::Gemma4Multimodal m = shapes();
  const int64_t first = train_memory_at_least(config({}), m, 1).of(kRuntimeBaseline);
  // At least this test binary's own code is resident; far less than the machine.
  EXPECT_GT(first, 0);
  EXPECT_EQ(first, runtime_baseline_bytes());
  constexpr size_t kTouched = size_t{64} << 20;  // more than the baseline could drift by itself
  std::vector<char> touched(kTouched, 1);
  EXPECT_EQ(train_memory_at_least(config({"parallelism.shard=full", "parallelism.dp=2"}), m, 2).of(kRuntimeBaseline),
            first);
  EXPECT_EQ(touched.back(), 1);
}

// ShardedStore::bytes_for counts what the store's code holds, by hand on two small registries at N = 1 and 2 (elements;
// float32 bytes are 4 x): a tied table of 16 x 4 (the head, streamed) first, a final norm of 4, layer 0 of 32 and layer
// 1 of 32 + 4, so that the trainable layout is table [0, 64), norm [64, 68), layer 0 [68, 100), layer 1 [100, 136) and
// at N = 2 rank 0's slice [0, 68) holds the whole head and rank 1's [68, 136) both layers. 6 tokens a step, 3 a rank.
// One gather's staging is in flight at a time, one reduction at a time; a reduction's receiver gets N x its part of
// the group (up to the whole head here: every part is below one round's chunk), a table's rows are the rank's own
// tokens' but for the table tied to a trained head (every rank's). A reduction sends from the gradients packed in
// place: only a layer's, kept while the next layer's backward fills its own, is counted beside them. The tied table's
// rows are all-gathered in place (no send buffer); another table's owner sends one rank's rows at a time, two in
// flight.
TEST(TrainMemory, ShardedBytesCountWhatTheStoreHolds) {
  const auto registry = [](bool tied) {
    auto ps = std::make_unique<model::ReplicatedStore>();
    const size_t table = ps->add("model.embed_tokens.weight", {16, 4});
    ps->add("model.norm.weight", {4});
    ps->add("model.layers.0.w", {8, 4}, 0, true);
    ps->add("model.layers.1.w", {8, 4}, 1, true);
    ps->add("model.layers.1.n", {4}, 1);
    ps->mark_streamed(table);
    if (!tied) ps->mark_streamed(ps->add("lm_head.weight", {16, 4}));
    return ps;
  };
  constexpr int64_t kStepTokens = 6, kRankTokens = 3, f32 = sizeof(float);
  using Mode = ShardedStore::Mode;
  const auto bytes = [&](const model::ParamStore& ps, Mode mode, int ranks) {
    return ShardedStore::bytes_for(ps, std::vector<bool>(ps.size(), true), mode, ranks, kStepTokens, kRankTokens);
  };
  const auto tied = registry(true), untied = registry(false);

  // Tied, N = 2, full. Rows: the head's table with gradients holds every rank's 6 tokens' rows, 24 elements.
  ShardedStore::Bytes b = bytes(*tied, Mode::Full, 2);
  EXPECT_EQ(b.weight_shard, 68 * f32);                // the slice (nothing frozen)
  EXPECT_EQ(b.gathered, (4 + (64 + 36) + 24) * f32);  // norm; the head beside the last layer; the rows
  EXPECT_EQ(b.gradients, (68 + 4 + 64 + 24) * f32);   // slice, norm's buffer, the head's, the rows'
  EXPECT_EQ(b.moments, 2 * 68 * f32);                 // exp_avg, exp_avg_sq of the slice
  // Staging: the head's 64, over a layer's (the largest, 36; the tied rows need no send buffer). Reductions: the
  // head's on rank 0, 2 x 64 (over layer 1's 36 + 2 x 36, the norm's 2 x 4, the rows' 2 x 24).
  EXPECT_EQ(b.comm_buffers, (64 + 2 * 64) * f32);
  b = bytes(*tied, Mode::Gradients, 2);
  EXPECT_EQ(b.weight_shard, 136 * f32);
  EXPECT_EQ(b.gathered, 24 * f32);
  EXPECT_EQ(b.gradients, (68 + 4 + 64 + 24) * f32);
  EXPECT_EQ(b.comm_buffers, 2 * 64 * f32);
  // N = 1: no receive buffers; a layer's reduction is its gradient buffer in flight (36), the head's none.
  b = bytes(*tied, Mode::Full, 1);
  EXPECT_EQ(b.weight_shard, 136 * f32);
  EXPECT_EQ(b.gathered, (4 + (64 + 36) + 24) * f32);
  EXPECT_EQ(b.gradients, (136 + 4 + 64 + 24) * f32);
  EXPECT_EQ(b.comm_buffers, (64 + 36) * f32);

  // Untied, N = 2: the layout gains lm_head [136, 200), slices [0, 100) and [100, 200). The table's rows are the
  // rank's own 3 tokens' (12 elements); lm_head is never read by row. Staging: the head's 64 over layer 1's 36 + 12
  // (the rows sent to the one other rank); reductions: the head's on rank 1, 2 x 64.
  b = bytes(*untied, Mode::Full, 2);
  EXPECT_EQ(b.weight_shard, 100 * f32);
  EXPECT_EQ(b.gathered, (4 + (64 + 36) + 12) * f32);
  EXPECT_EQ(b.gradients, (100 + 4 + 64 + 12) * f32);
  EXPECT_EQ(b.moments, 2 * 100 * f32);
  EXPECT_EQ(b.comm_buffers, (64 + 2 * 64) * f32);
  // Frozen, the table's rows are the rank's own (no head gradient to seed them) and have no gradient.
  std::vector<bool> trainable(tied->size(), true);
  trainable[0] = false;
  b = ShardedStore::bytes_for(*tied, trainable, Mode::Full, 2, kStepTokens, kRankTokens);
  // Trainable layout: norm [0, 4), layer 0 [4, 36), layer 1 [36, 72): slices [0, 36) and [36, 72); frozen: the table,
  // [0, 32) and [32, 64).
  EXPECT_EQ(b.weight_shard, (36 + 32) * f32);
  EXPECT_EQ(b.gathered, (4 + (64 + 36) + 12) * f32);
  EXPECT_EQ(b.gradients, (36 + 4 + 36) * f32);
  // Staging: the head's 64 (over 36 + 12); reductions: layer 1's on rank 1, 36 + 2 x 36 (layer 0's on rank 0,
  // 32 + 2 x 32; the norm's 2 x 4).
  EXPECT_EQ(b.comm_buffers, (64 + 36 + 2 * 36) * f32);
}

}  // namespace
}  // namespace rf::trainer
