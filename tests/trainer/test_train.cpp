// The training loop: the same losses at every cp x dp and accumulation split of one global batch, the label-token
// count taken once, bit-exact resume, crash-safe checkpoints, keep-last-K and the metrics file. Ranks are loopback
// threads in this process (the MPI path runs through the CLI tests).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <set>
#include <thread>

#include "comm/loopback_comm.h"
#include "common/error_of.h"
#include "io/atomic_file.h"
#include "io/safetensors.h"
#include "model/builtin_configs.h"
#include "model/checkpoint.h"
#include "model/expert_store.h"
#include "model/lora_store.h"
#include "model/peft_files.h"
#include "trainer/checkpoint.h"
#include "trainer/data.h"
#include "trainer/optimizer.h"
#include "trainer/runtime_memory.h"
#include "trainer/state/held_checkpoint.h"
#include "trainer/state/held_expert_store.h"
#include "trainer/state/sharded_store.h"
#include "trainer/trainer.h"

namespace rf::trainer {
namespace {

namespace fs = std::filesystem;
using testing::error_of;

fs::path scratch(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("rf_trainer_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p;
}

// A small, fast run of a built-in model: 64-token rows (so images of 16 slots, documents and padding all occur),
// a global batch of 4 rows, one OpenMP thread per rank (ranks are threads here).
TrainConfig small(const std::string& builtin, std::vector<std::string> sets) {
  std::vector<std::string> base = {"model.builtin=" + builtin, "train.seq_len=64",
                                   "train.global_batch=4",     "train.steps=5",
                                   "train.threads=1",          "data.val_rows=2",
                                   "train.val_every=0",        "schedule.warmup_steps=2",
                                   "optimizer.lr=0.003",       "model.init_std=0.1"};
  base.insert(base.end(), sets.begin(), sets.end());
  return parse_config("", "test", base);
}

struct Trained {
  std::vector<StepMetrics> steps;
  std::unique_ptr<model::Gemma4Multimodal> model;
  std::string last_checkpoint;
};

Trained run(const TrainConfig& c, TrainOptions opt = {}) {
  opt.progress = nullptr;
  Trained out;
  std::mutex mu;
  const int P = c.parallelism.cp * c.parallelism.dp;
  validate(c, P);
  comm::run_ranks(P, [&](comm::Communicator& world) {
    TrainResult r = train(c, world, opt);
    if (world.rank() != 0) return;
    std::lock_guard lock(mu);
    out.steps = r.steps;
    out.model = std::move(r.model);
    out.last_checkpoint = r.last_checkpoint;
  });
  return out;
}

// The same global batch split differently gives the same training. What differs is only the order of float32
// sums (gradient accumulation vs the rank-ordered reduction), ~1e-7 relative per gradient; through 5 AdamW steps
// (which normalise the update, so a gradient's rounding moves a weight by at most lr * 1e-7-ish) the loss moves
// by well under 1e-5 relative, while any real error (a row missed or counted twice, a wrong denominator) moves it
// by 1e-2 or more.
constexpr double kSameTrainingRel = 1e-5;
// Context parallelism also reorders sums inside a row (each rank's GEMMs over its shard, attention merged over the
// ring), so a gradient rounds at ~1e-6 relative, not ~1e-7; and AdamW's first steps move each weight by about
// lr * sign(gradient), so a weight whose gradient is within that rounding of zero moves by +-lr either way. Measured
// on the mock data's rows: up to 2e-5 relative by step 4 (tiny_dense, cp 4), 3e-6 on other rows; a real error still
// moves the loss by 1e-2 or more.
constexpr double kSameTrainingRelCp = 1e-4;

void expect_same_losses(const Trained& a, const Trained& b, const std::string& what, double rel = kSameTrainingRel) {
  ASSERT_EQ(a.steps.size(), b.steps.size()) << what;
  for (size_t i = 0; i < a.steps.size(); ++i) {
    EXPECT_NEAR(b.steps[i].loss, a.steps[i].loss, rel * a.steps[i].loss) << what << " step " << i + 1;
    EXPECT_EQ(b.steps[i].tokens, a.steps[i].tokens) << what << " step " << i + 1;
  }
}

class GridInvariance : public ::testing::TestWithParam<std::string> {};

// MoE top-k routing is discontinuous: a token whose best experts are within float32 rounding of each other picks
// either, depending on summation order, and CP changes the order (GEMMs over L instead of S tokens, attention
// merged over ring steps). At init std 0.1 the tiny MoE's router is near-uniform, such ties are common and one
// flipped token moves the loss by ~1e-3 within 3 steps; at 0.4 its margins are wide, so the test measures the CP
// and DP paths rather than tie-breaking (dense models have no such switch and use 0.1).
TrainConfig grid_case(const std::string& builtin, std::vector<std::string> sets) {
  if (builtin == "tiny_moe_vlm") sets.insert(sets.begin(), "model.init_std=0.4");
  return small(builtin, sets);
}

TEST_P(GridInvariance, SameLossAtEveryDpAndAccumulationSplit) {
  const Trained ref = run(grid_case(GetParam(), {}));  // dp 1, 4 micro-batches of 1 row
  ASSERT_EQ(ref.steps.size(), 5u);
  EXPECT_LT(ref.steps.back().loss, ref.steps.front().loss);  // it trains
  expect_same_losses(ref, run(grid_case(GetParam(), {"parallelism.dp=2"})), "dp 2");
  expect_same_losses(ref, run(grid_case(GetParam(), {"parallelism.dp=4"})), "dp 4");
  expect_same_losses(ref, run(grid_case(GetParam(), {"train.micro_batch=2"})), "dp 1, micro-batches of 2");
  expect_same_losses(ref, run(grid_case(GetParam(), {"parallelism.dp=2", "train.micro_batch=2"})),
                     "dp 2, no accumulation");
  // Context parallelism: each row split over 2 or 4 ranks (16-token images and documents straddle the shards),
  // balanced and zigzag maps, and the 2 x 2 grid.
  expect_same_losses(ref, run(grid_case(GetParam(), {"parallelism.cp=2"})), "cp 2", kSameTrainingRelCp);
  expect_same_losses(ref, run(grid_case(GetParam(), {"parallelism.cp=4", "parallelism.sharding=zigzag"})),
                     "cp 4 zigzag", kSameTrainingRelCp);
  expect_same_losses(ref, run(grid_case(GetParam(), {"parallelism.cp=2", "parallelism.dp=2"})), "cp 2 x dp 2",
                     kSameTrainingRelCp);
}

INSTANTIATE_TEST_SUITE_P(Builtins, GridInvariance, ::testing::Values("tiny_dense", "tiny_moe_vlm"));

// The label tokens of the global batch are counted once. Oracle: the model's own mean over the 4 rows run as one
// batch (its default denominator is that batch's label count). A trainer that divided by a per-replica count
// (or summed the count over ranks that hold the same rows) would report a different first loss by a factor ~dp.
TEST(LabelTokens, CountedOnceOverTheGlobalBatch) {
  const TrainConfig c = small("tiny_moe_vlm", {"parallelism.cp=2", "parallelism.dp=2", "train.steps=1"});
  const Trained trained = run(c);
  model::Gemma4Multimodal m(model::Gemma4Config::from_json(model::builtin_config_json("tiny_moe_vlm")),
                            model::MultimodalParts{model::kBuiltinFeatureDim});
  m.init_random(c.train.seed, static_cast<float>(c.model.init_std));
  // The trainer's mock images: drawings encoded by the built-in tower, initialised from train.seed as set_up does.
  const std::string json = model::builtin_config_json("tiny_moe_vlm");
  const model::VisionConfig vc = model::VisionConfig::from_config_json(json, "tiny_moe_vlm").value();
  const io::Passthrough tower_weights = model::init_vision_tower(vc, c.train.seed);
  const model::VisionEncoder tower(vc, tower_weights);
  ImageContract images;
  images.vision = [&]() -> const model::VisionEncoder* { return &tower; };
  const auto data = make_data_source(c, {m.config().vocab_size, 0, model::kBuiltinFeatureDim, ""}, images);
  const PackedBatch p = stack_rows({data->train_row(0), data->train_row(1), data->train_row(2), data->train_row(3)},
                                   model::kBuiltinFeatureDim);
  const model::Batch b = p.batch();
  const model::Result r = m.run(b, {});
  EXPECT_EQ(trained.steps[0].tokens, r.label_tokens);
  // Same model, same rows; only the summation order differs (sharded rows over 4 ranks vs one batch): float32
  // rounding of a sum of ~900 token losses of O(6), far below the factor-2 error this test exists to catch.
  EXPECT_NEAR(trained.steps[0].loss, r.loss, 1e-6 * r.loss);
}

// Fewer tokens in a row than CP ranks is refused up front (validate), naming both numbers.
TEST(ContextParallel, RowShorterThanTheGroupIsRefused) {
  EXPECT_EQ(error_of([] {
              run(small("tiny_dense", {"parallelism.cp=4", "train.seq_len=3"}));
            }),
            "config: train.seq_len = 3 is shorter than parallelism.cp = 4 (every CP rank needs a token)");
}

std::vector<float> flat_params(const model::Gemma4Multimodal& m) {
  const std::span<const float> all = m.params().flat(model::Role::Weights);
  return {all.begin(), all.end()};
}

TEST(Resume, ContinuesBitForBit) {
  const fs::path dir = scratch("resume");
  const TrainConfig c = small("tiny_moe_vlm", {"parallelism.cp=2", "train.steps=6", "checkpoint.every=3",
                                               "checkpoint.dir=" + dir.string(), "train.val_every=3"});
  const Trained whole = run(c);
  ASSERT_EQ(whole.steps.size(), 6u);
  TrainOptions resume;
  resume.resume = (dir / "step-00000003").string();
  const Trained second = run(c, resume);
  ASSERT_EQ(second.steps.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(second.steps[i].step, whole.steps[i + 3].step);
    EXPECT_EQ(second.steps[i].loss, whole.steps[i + 3].loss) << "step " << i + 4;  // the same bits
    EXPECT_EQ(second.steps[i].grad_norm, whole.steps[i + 3].grad_norm);
  }
  EXPECT_EQ(second.steps[2].val_loss, whole.steps[5].val_loss);
  EXPECT_EQ(flat_params(*second.model), flat_params(*whole.model));
  // The root means its newest checkpoint, which now has nothing left to do.
  EXPECT_EQ(resolve_checkpoint(dir.string()), (dir / "step-00000006").string());
  TrainOptions again;
  again.resume = dir.string();
  EXPECT_NE(error_of([&] {
              run(c, again);
            }).find("the checkpoint is at step 6 and train.steps = 6 leaves nothing to do"),
            std::string::npos);
  // A different batch layout cannot continue this run.
  TrainOptions other = resume;
  EXPECT_NE(error_of([&] {
              run(small("tiny_moe_vlm", {"parallelism.cp=2", "train.steps=6", "train.seq_len=32"}), other);
            }).find("train.seq_len differs from the run that wrote the checkpoint"),
            std::string::npos);
  // Nor can another model: the weights would be the checkpoint's and the new checkpoints would name the config's.
  EXPECT_NE(error_of([&] {
              run(small("tiny_dense", {"parallelism.cp=2", "train.steps=6"}), other);
            }).find("model.builtin differs from the run that wrote the checkpoint"),
            std::string::npos);
}

std::string file_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// AdamW's moments of checkpoint `ck` as two arrays in the trainable layout, read straight from its files in either
// layout (trainer/checkpoint.h): optimizer.safetensors's per-parameter tensors in the trainable order of `store`, or
// the sharded files' ranges in the order optimizer.json lists them.
std::pair<std::vector<float>, std::vector<float>> moments_of(const fs::path& ck, const model::ParamStore& store) {
  std::vector<float> m, v;
  const auto append = [](std::vector<float>& out, const io::TensorView& t) {
    EXPECT_EQ(t.dtype, io::StDType::F32) << t.name;
    const size_t at = out.size();
    out.resize(at + t.bytes.size() / sizeof(float));
    std::memcpy(out.data() + at, t.bytes.data(), t.bytes.size());
  };
  if (fs::exists(ck / "optimizer.json")) {
    std::ifstream in(ck / "optimizer.json");
    const nlohmann::json layout = nlohmann::json::parse(in);
    for (const auto& f : layout.at("files")) {
      const io::SafetensorsFile file = io::SafetensorsFile::open((ck / f.at("file").get<std::string>()).string());
      append(m, file.at("exp_avg"));
      append(v, file.at("exp_avg_sq"));
    }
  } else {
    const io::SafetensorsFile file = io::SafetensorsFile::open((ck / "optimizer.safetensors").string());
    for (const model::ParamInfo& p : store.infos()) {
      if (!p.trainable) continue;
      append(m, file.at("exp_avg." + p.name));
      append(v, file.at("exp_avg_sq." + p.name));
    }
  }
  EXPECT_EQ(static_cast<int64_t>(m.size()), store.trainable_elements()) << ck;
  return {m, v};
}

// Every step's loss, gradient norm and validation loss, the final weights, the written model file and the moments of
// `sharded` are the bits of `none` (the runs' step counts already compared by the caller).
void expect_same_bits(const Trained& none, const Trained& sharded, const std::string& what) {
  for (size_t s = 0; s < none.steps.size(); ++s) {
    EXPECT_EQ(sharded.steps[s].loss, none.steps[s].loss) << what << ", step " << s + 1;
    EXPECT_EQ(sharded.steps[s].grad_norm, none.steps[s].grad_norm) << what << ", step " << s + 1;
    EXPECT_EQ(sharded.steps[s].val_loss, none.steps[s].val_loss) << what << ", step " << s + 1;
  }
  EXPECT_EQ(flat_params(*sharded.model), flat_params(*none.model)) << what;
  EXPECT_EQ(file_bytes(fs::path(sharded.last_checkpoint) / "model.safetensors"),
            file_bytes(fs::path(none.last_checkpoint) / "model.safetensors"))
      << what;
  EXPECT_EQ(moments_of(sharded.last_checkpoint, sharded.model->params()),
            moments_of(none.last_checkpoint, none.model->params()))
      << what;
}

// Each rank resolves --resume and reads data.path on its own file system. Ranks that find different files (a relative
// path from other working directories, machines with other copies) are named on every rank before any step: they
// would otherwise run different steps (a failed collective) or train on different rows without a word.
TEST(Resume, RanksThatFindDifferentFilesAreNamed) {
  const fs::path dir = scratch("different_files");
  const TrainConfig c = small("tiny_dense", {"parallelism.dp=2", "train.steps=4", "checkpoint.every=2",
                                             "checkpoint.dir=" + (dir / "ck").string()});
  run(c);
  const auto per_rank = [&](const std::function<TrainConfig(int)>& config_of,
                            const std::function<TrainOptions(int)>& options_of) {
    return error_of([&] {
      comm::run_ranks(2, [&](comm::Communicator& world) {
        TrainOptions o = options_of(world.rank());
        o.progress = nullptr;
        train(config_of(world.rank()), world, o);
      });
    });
  };
  const TrainConfig resumed = small("tiny_dense", {"parallelism.dp=2", "train.steps=6", "checkpoint.dir="});
  const std::string steps = per_rank([&](int) { return resumed; },
                                     [&](int rank) {
                                       TrainOptions o;
                                       o.resume =
                                           (dir / "ck" / (rank == 0 ? "step-00000004" : "step-00000002")).string();
                                       return o;
                                     });
  EXPECT_NE(steps.find("ranks resumed from different checkpoints: rank 1 at step 2 (data position 8), rank 0 at "
                       "step 4 (data position 16)"),
            std::string::npos)
      << steps;
  for (int r = 0; r < 2; ++r) {
    std::ofstream out(dir / ("d" + std::to_string(r) + ".jsonl"));
    // 40 samples of 20 tokens: a dozen 64-token rows, more than data.val_rows; rank 1's differ in every sample.
    for (int line = 0; line < 40; ++line) {
      out << "{\"input_ids\": [" << line + 1;
      for (int t = 1; t < 20; ++t) out << ", " << (t * 5 + 7 * r) % 500 + 1;
      out << "]}\n";
    }
  }
  const std::string data = per_rank(
      [&](int rank) {
        return small("tiny_dense", {"parallelism.dp=2", "train.steps=2", "checkpoint.dir=", "data.source=jsonl_tokens",
                                    "data.path=" + (dir / ("d" + std::to_string(rank) + ".jsonl")).string()});
      },
      [](int) { return TrainOptions{}; });
  EXPECT_NE(data.find("rank 1 read other data than rank 0"), std::string::npos) << data;
  fs::remove_all(dir);
}

// parallelism.shard = optimizer (ZeRO-1): each rank keeps AdamW's moments for its shard of the trainable
// parameters (any count: shards are padded), updates those elements alone, and takes the others' from their owners.
// An element's update depends on that element alone, so every loss, gradient norm and weight, and the checkpoint
// files (the model's bytes; the moments, which each rank writes for its shard, as values), are the bits of shard none
// at the same grid: N = 1 to 4, dense and MoE, CP and DP, frozen parameters and gradient accumulation.
TEST(ShardOptimizer, SameBitsAsShardNoneAtEveryGrid) {
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"tiny_dense", {}},
      {"tiny_moe_vlm", {"parallelism.cp=2"}},
      {"tiny_dense", {"parallelism.dp=3", "train.global_batch=6"}},
      {"tiny_moe_vlm", {"parallelism.cp=3", "model.freeze=[embed_tokens, experts]"}},
      {"tiny_dense", {"parallelism.cp=2", "parallelism.dp=2", "train.global_batch=8"}},  // 2 micro-batches a replica
  };
  const fs::path dir = scratch("shard_optimizer");
  int i = 0;
  for (const auto& [builtin, sets] : cases) {
    const std::string what = builtin + " case " + std::to_string(i);
    const auto config = [&](const std::string& mode) {
      std::vector<std::string> all = sets;
      all.insert(all.end(), {"parallelism.shard=" + mode, "train.steps=3", "train.val_every=2",
                             "checkpoint.dir=" + (dir / (std::to_string(i) + mode)).string()});
      return grid_case(builtin, all);
    };
    const Trained none = run(config("none")), sharded = run(config("optimizer"));
    ASSERT_EQ(sharded.steps.size(), none.steps.size()) << what;
    expect_same_bits(none, sharded, what);
    ++i;
  }
  fs::remove_all(dir);
}

// parallelism.shard = optimizer under LoRA: the adapters' moments are sharded over the ranks (each rank updates its
// slice of the adapters and gathers the others'), the frozen base stays whole and unsharded (mapped from the files
// and shared by a machine's ranks; config.cpp says why gradients and full are refused). Every loss, gradient norm
// and validation loss, the final adapters, the written adapter file and the moments are shard none's bits at
// N = 2 and 3, over CP, DP and a mix, dense and MoE with the experts' 3-D weights adapted (target_parameters).
TEST(ShardOptimizer, LoraSameBitsAsShardNone) {
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"tiny_dense", {"parallelism.cp=2"}},
      {"tiny_dense", {"parallelism.dp=3", "train.global_batch=6"}},
      {"tiny_moe_vlm", {"parallelism.cp=3", "model.lora.target_parameters=[experts.gate_up_proj, experts.down_proj]"}},
      {"tiny_moe_vlm", {"parallelism.cp=1", "parallelism.dp=2", "model.lora.target=[q_proj, o_proj]"}},
  };
  const fs::path dir = scratch("shard_optimizer_lora");
  int i = 0;
  for (const auto& [builtin, sets] : cases) {
    const std::string what = builtin + " LoRA case " + std::to_string(i);
    const auto config = [&](const std::string& mode) {
      std::vector<std::string> all = {"model.lora.rank=2", "model.lora.alpha=4"};
      all.insert(all.end(), sets.begin(), sets.end());
      all.insert(all.end(), {"parallelism.shard=" + mode, "train.steps=3", "train.val_every=2",
                             "checkpoint.dir=" + (dir / (std::to_string(i) + mode)).string()});
      return grid_case(builtin, all);
    };
    const Trained none = run(config("none")), sharded = run(config("optimizer"));
    ASSERT_EQ(sharded.steps.size(), none.steps.size()) << what;
    for (size_t s = 0; s < none.steps.size(); ++s) {
      EXPECT_EQ(sharded.steps[s].loss, none.steps[s].loss) << what << ", step " << s + 1;
      EXPECT_EQ(sharded.steps[s].grad_norm, none.steps[s].grad_norm) << what << ", step " << s + 1;
      EXPECT_EQ(sharded.steps[s].val_loss, none.steps[s].val_loss) << what << ", step " << s + 1;
    }
    // The adapters' weights (a LoRA store's Weights arena holds the adapters only) moved, and to the same bits.
    const std::vector<float> adapters = flat_params(*none.model);
    EXPECT_EQ(flat_params(*sharded.model), adapters) << what;
    EXPECT_TRUE(std::any_of(adapters.begin(), adapters.end(), [](float x) { return x != 0.0f; })) << what;
    EXPECT_EQ(file_bytes(fs::path(sharded.last_checkpoint) / model::kPeftWeightsFile),
              file_bytes(fs::path(none.last_checkpoint) / model::kPeftWeightsFile))
        << what;
    EXPECT_FALSE(fs::exists(fs::path(sharded.last_checkpoint) / "model.safetensors")) << what;
    EXPECT_TRUE(fs::exists(fs::path(sharded.last_checkpoint) / "optimizer.json")) << what;  // one file a rank
    EXPECT_EQ(moments_of(sharded.last_checkpoint, sharded.model->params()),
              moments_of(none.last_checkpoint, none.model->params()))
        << what;
    ++i;
  }
  fs::remove_all(dir);
}

// LoRA's experts' adapters under shard optimizer follow the EP placement (trainer/state/expert_state.h): each rank
// holds its EP rank's experts' adapters only, and AdamW's moments of its EDP slice of its held adapters (ep 2 over dp
// 4: two ranks a group of the same experts). The gradients are summed as under shard none and AdamW updates each
// element alone, so every loss, gradient norm and validation loss, the written adapter file and the moments (written
// whole) are shard none's bits at the same EP, and the moment range is the slice again after a save. Resumes: the ep 2
// run's step-2 checkpoint continues it bit for bit; ep 1's under shard optimizer (one moment file a rank, whole
// tensors' layout) is read by rows at ep 2 and gives ep 1's step 3 loss bit for bit (the forward is the same at any
// EP).
TEST(ShardOptimizer, LoraExpertAdaptersFollowTheEpPlacement) {
  const fs::path dir = scratch("shard_optimizer_lora_ep");
  const auto config = [&](const std::string& mode, int ep, const std::string& root) {
    return grid_case("tiny_moe_vlm",
                     {"model.lora.rank=2", "model.lora.alpha=4",
                      "model.lora.target_parameters=[experts.gate_up_proj, experts.down_proj]", "parallelism.dp=4",
                      "parallelism.ep=" + std::to_string(ep), "parallelism.shard=" + mode, "train.steps=3",
                      "train.val_every=2", "checkpoint.every=2", "checkpoint.dir=" + (dir / root).string()});
  };
  const Trained none = run(config("none", 2, "none")), sharded = run(config("optimizer", 2, "optimizer"));
  ASSERT_EQ(sharded.steps.size(), 3u);
  ASSERT_EQ(none.steps.size(), 3u);
  for (size_t s = 0; s < none.steps.size(); ++s) {
    EXPECT_EQ(sharded.steps[s].loss, none.steps[s].loss) << "step " << s + 1;
    EXPECT_EQ(sharded.steps[s].grad_norm, none.steps[s].grad_norm) << "step " << s + 1;
    EXPECT_EQ(sharded.steps[s].val_loss, none.steps[s].val_loss) << "step " << s + 1;
  }
  for (const char* file : {model::kPeftWeightsFile, "optimizer.safetensors"})
    EXPECT_EQ(file_bytes(fs::path(sharded.last_checkpoint) / file), file_bytes(fs::path(none.last_checkpoint) / file))
        << file;
  EXPECT_FALSE(fs::exists(fs::path(sharded.last_checkpoint) / "optimizer.json"));  // written whole, as under none
  // World rank 0 (EP rank 0, EDP rank 0 of 2): its experts' rows of every expert adapter, the moments of its slice.
  const model::ParamStore& held = sharded.model->params();
  int placed = 0;
  for (const model::ParamInfo& p : held.infos()) {
    if (p.name.find(".experts.") == std::string::npos || p.name.find("lora_") == std::string::npos) continue;
    EXPECT_TRUE(p.holds_part() && p.rows_begin == 0 && p.rows_total == 2 * p.shape.at(0)) << p.name;
    ++placed;
  }
  EXPECT_GT(placed, 0);
  const model::Shard slice = model::shard_of(held.trainable_elements(), 0, 2);
  EXPECT_EQ(held.moment_range().begin, slice.begin);
  EXPECT_EQ(held.moment_range().end, slice.end);

  TrainOptions resume;
  resume.resume = (dir / "optimizer" / "step-00000002").string();
  const Trained again = run(config("optimizer", 2, "again"), resume);
  ASSERT_EQ(again.steps.size(), 1u);
  EXPECT_EQ(again.steps[0].loss, sharded.steps[2].loss);
  EXPECT_EQ(again.steps[0].grad_norm, sharded.steps[2].grad_norm);
  EXPECT_EQ(file_bytes(fs::path(again.last_checkpoint) / model::kPeftWeightsFile),
            file_bytes(fs::path(sharded.last_checkpoint) / model::kPeftWeightsFile));
  const Trained one = run(config("optimizer", 1, "ep1"));
  ASSERT_EQ(one.steps.size(), 3u);
  ASSERT_TRUE(fs::exists(dir / "ep1" / "step-00000002" / "optimizer.json"));  // one moment file a rank
  resume.resume = (dir / "ep1" / "step-00000002").string();
  const Trained from_one = run(config("optimizer", 2, "from_ep1"), resume);
  ASSERT_EQ(from_one.steps.size(), 1u);
  EXPECT_EQ(from_one.steps[0].loss, one.steps[2].loss);
  fs::remove_all(dir);
}

// A checkpoint's moments are read by range from whichever files hold them, whatever the shard mode and rank count
// that wrote it, so a run resumes at any other: at the same grid in the other mode, bit for bit; at other rank counts,
// the same training (the reduction order changes with the grid, as GridInvariance allows for).
TEST(ShardOptimizer, ResumesAcrossModesAndRankCounts) {
  const fs::path dir = scratch("shard_resume");
  const auto config = [&](std::vector<std::string> sets) {
    sets.insert(sets.end(), {"train.steps=4", "checkpoint.every=2", "checkpoint.dir=" + dir.string()});
    return small("tiny_dense", sets);
  };
  const Trained whole = run(config({"parallelism.cp=2", "parallelism.dp=2", "parallelism.shard=optimizer"}));
  ASSERT_EQ(whole.steps.size(), 4u);
  TrainOptions resume;
  resume.resume = (dir / "step-00000002").string();
  const Trained same_grid = run(config({"parallelism.cp=2", "parallelism.dp=2", "parallelism.shard=none"}), resume);
  ASSERT_EQ(same_grid.steps.size(), 2u);
  for (size_t s = 0; s < 2; ++s) EXPECT_EQ(same_grid.steps[s].loss, whole.steps[s + 2].loss) << "step " << s + 3;
  EXPECT_EQ(flat_params(*same_grid.model), flat_params(*whole.model));
  Trained tail;
  tail.steps.assign(whole.steps.begin() + 2, whole.steps.end());
  expect_same_losses(tail, run(config({"parallelism.dp=2", "parallelism.shard=optimizer"}), resume), "N = 2");
  expect_same_losses(tail, run(config({"parallelism.dp=4", "parallelism.shard=optimizer"}), resume), "N = 4, dp");
  expect_same_losses(tail, run(config({"parallelism.shard=none"}), resume), "N = 1");
  fs::remove_all(dir);
}

// Checkpoint `from` copied to `to` with its moments rewritten by the test in the other layout: a sharded checkpoint's
// as one optimizer.safetensors of per-parameter tensors; a whole one's as optimizer.json and files of the uneven
// ranges `cuts` (boundaries inside the trainable layout, not any rank count's shards).
void rewrite_moments(const fs::path& from, const fs::path& to, const model::ParamStore& store,
                     const std::vector<int64_t>& cuts) {
  fs::remove_all(to);
  fs::create_directories(to);
  for (const auto& e : fs::directory_iterator(from)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("optimizer", 0) != 0) fs::copy_file(e.path(), to / name);
  }
  const auto [m, v] = moments_of(from, store);
  io::SafetensorsWriter w;
  const auto range = [](const std::vector<float>& a, int64_t begin, int64_t n) {
    return std::span<const float>(a.data() + begin, static_cast<size_t>(n));
  };
  if (fs::exists(from / "optimizer.json")) {
    for (const model::ParamInfo& p : store.infos()) {
      if (!p.trainable) continue;
      w.add("exp_avg." + p.name, io::StDType::F32, p.shape, range(m, p.train_offset, p.numel));
      w.add("exp_avg_sq." + p.name, io::StDType::F32, p.shape, range(v, p.train_offset, p.numel));
    }
    w.write((to / "optimizer.safetensors").string());
    return;
  }
  nlohmann::json params = nlohmann::json::array(), files = nlohmann::json::array();
  for (const model::ParamInfo& p : store.infos())
    if (p.trainable) params.push_back({{"name", p.name}, {"shape", p.shape}, {"offset", p.train_offset}});
  std::vector<int64_t> bounds = {0};
  bounds.insert(bounds.end(), cuts.begin(), cuts.end());
  bounds.push_back(store.trainable_elements());
  for (size_t k = 0; k + 1 < bounds.size(); ++k) {
    const std::string file = "part" + std::to_string(k) + ".safetensors";
    io::SafetensorsWriter part;
    const int64_t n = bounds[k + 1] - bounds[k];
    part.add("exp_avg", io::StDType::F32, {n}, range(m, bounds[k], n));
    part.add("exp_avg_sq", io::StDType::F32, {n}, range(v, bounds[k], n));
    part.set_metadata("begin", std::to_string(bounds[k]));  // as write_moments_shard records each file's range
    part.set_metadata("end", std::to_string(bounds[k + 1]));
    part.write((to / file).string());
    files.push_back({{"file", file}, {"begin", bounds[k]}, {"end", bounds[k + 1]}});
  }
  const nlohmann::json layout = {{"format", "ringflex-moments-1"}, {"shard", "optimizer"},
                                 {"ranks", files.size()},          {"trainable_elements", store.trainable_elements()},
                                 {"parameters", params},           {"files", files}};
  std::ofstream((to / "optimizer.json").string()) << layout.dump();
}

// The moments re-shard exactly: a run resumed from a checkpoint whose moments are sharded over 4 ranks (each rank's
// file) gives the bits of the same run resumed from those moments rewritten by the test as one whole file, at N = 2
// (shard optimizer: each rank reads the parts of two files), N = 3 (ranges that straddle files) and N = 1 (shard
// none); and the other way, a whole checkpoint (N = 1, shard none) and the test's three uneven files give the same
// bits at N = 4 shard optimizer, N = 2 shard gradients and N = 3 shard full; and a checkpoint saved under shard full
// at N = 4 against its moments rewritten whole, at N = 2 shard optimizer. Either way both runs compute the same
// arithmetic from the same values, so any element read from the wrong place shows as a difference.
TEST(ShardOptimizer, ReshardsTheMomentsExactlyAtAnyRankCount) {
  const fs::path dir = scratch("reshard");
  const auto config = [&](const fs::path& out, std::vector<std::string> sets) {
    sets.insert(sets.end(),
                {"train.steps=3", "checkpoint.every=2", "train.global_batch=12", "checkpoint.dir=" + out.string()});
    return small("tiny_dense", sets);
  };
  const Trained four =
      run(config(dir / "four", {"parallelism.cp=2", "parallelism.dp=2", "parallelism.shard=optimizer"}));
  const fs::path sharded = dir / "four" / "step-00000002", whole = dir / "rewritten" / "step-00000002";
  ASSERT_TRUE(fs::exists(sharded / "optimizer-00004-of-00004.safetensors"));
  rewrite_moments(sharded, whole, four.model->params(), {});
  const auto same_bits = [&](const fs::path& a, const fs::path& b, const std::vector<std::string>& grid,
                             const std::string& what) {
    TrainOptions from_a, from_b;
    from_a.resume = a.string();
    from_b.resume = b.string();
    const Trained x = run(config(dir / "x", grid), from_a), y = run(config(dir / "y", grid), from_b);
    ASSERT_EQ(x.steps.size(), 1u) << what;
    ASSERT_EQ(y.steps.size(), 1u) << what;
    EXPECT_EQ(x.steps[0].loss, y.steps[0].loss) << what;
    EXPECT_EQ(x.steps[0].grad_norm, y.steps[0].grad_norm) << what;
    EXPECT_EQ(flat_params(*x.model), flat_params(*y.model)) << what;
    EXPECT_EQ(moments_of(x.last_checkpoint, x.model->params()), moments_of(y.last_checkpoint, y.model->params()))
        << what;
  };
  same_bits(sharded, whole, {"parallelism.dp=2", "parallelism.shard=optimizer"}, "4 files at N = 2");
  same_bits(sharded, whole, {"parallelism.dp=3", "parallelism.shard=optimizer"}, "4 files at N = 3");
  same_bits(sharded, whole, {"parallelism.shard=none"}, "4 files at N = 1");
  // Two rank files swapped (or one copied over another): each file's own range must be the layout's, else equal-length
  // files would load each other's moments.
  const fs::path swapped = dir / "swapped";
  fs::copy(sharded, swapped);
  fs::rename(swapped / "optimizer-00001-of-00004.safetensors", swapped / "tmp.safetensors");
  fs::rename(swapped / "optimizer-00002-of-00004.safetensors", swapped / "optimizer-00001-of-00004.safetensors");
  fs::rename(swapped / "tmp.safetensors", swapped / "optimizer-00002-of-00004.safetensors");
  TrainOptions from_swapped;
  from_swapped.resume = swapped.string();
  const std::string refused = error_of([&] { run(config(dir / "x", {"parallelism.shard=none"}), from_swapped); });
  EXPECT_NE(refused.find("optimizer-00001-of-00004.safetensors: holds elements "), std::string::npos) << refused;
  EXPECT_NE(refused.find(" of the trainable layout, optimizer.json gives it 0 to "), std::string::npos) << refused;

  const Trained one = run(config(dir / "one", {"parallelism.shard=none"}));
  const fs::path one_whole = dir / "one" / "step-00000002", uneven = dir / "uneven" / "step-00000002";
  ASSERT_TRUE(fs::exists(one_whole / "optimizer.safetensors"));
  const int64_t n = one.model->params().trainable_elements();
  rewrite_moments(one_whole, uneven, one.model->params(), {n / 7, n / 7 + 1, n / 2 + 3});
  same_bits(one_whole, uneven, {"parallelism.cp=2", "parallelism.dp=2", "parallelism.shard=optimizer"},
            "a whole file at N = 4");
  same_bits(one_whole, uneven, {"parallelism.dp=2", "parallelism.shard=gradients"}, "a whole file at N = 2");
  same_bits(one_whole, uneven, {"parallelism.dp=3", "parallelism.shard=full"}, "a whole file at N = 3 full");

  // Saved under shard full (each rank's moments its own file, the weights gathered tensor by tensor), resumed at
  // N = 2 shard optimizer.
  const Trained full = run(config(dir / "full", {"parallelism.cp=2", "parallelism.dp=2", "parallelism.shard=full"}));
  const fs::path full_sharded = dir / "full" / "step-00000002", full_whole = dir / "full_whole" / "step-00000002";
  ASSERT_TRUE(fs::exists(full_sharded / "optimizer-00004-of-00004.safetensors"));
  rewrite_moments(full_sharded, full_whole, full.model->params(), {});
  same_bits(full_sharded, full_whole, {"parallelism.dp=2", "parallelism.shard=optimizer"}, "4 full files at N = 2");
  fs::remove_all(dir);
}

// parallelism.shard = gradients (ZeRO-2): as optimizer, and each layer's gradients are reduce-scattered as its
// backward ends, a rank accumulating only its slice. shard = full (ZeRO-3): the same, and each rank holds only its
// pieces of the weights, every layer gathered around its forward and backward. With one micro-batch a replica that
// is shard none's one rank-order reduction, so losses, norms, weights and checkpoint files are shard none's bits
// (N = 1 to 4, dense and MoE, CP and DP, frozen parameters, bf16 compute). With gradient accumulation shard none adds a
// rank's micro-batches before the reduction and shard gradients after it: the same terms associated differently, the
// difference GridInvariance's accumulation splits already make, so the losses agree within kSameTrainingRel. The
// weights: AdamW normalises each element's update to at most about lr, and an element whose micro-batches' gradients
// nearly cancel has a sum whose rounding is large relative to it, so such an element may move by a fraction of lr;
// allow 1% of the 3 steps' lr = 0.003 for the worst element (9e-5; measured up to ~7e-6), and 0.1% of one lr for the
// mean (3e-6), while a row missed or counted twice moves most weights' updates by a large fraction of lr. gradients and
// full reduce the same micro-batch sums and add them in the same order, so they give each other's bits with
// accumulation too.
TEST(ShardGradients, ShardNoneBitsWithoutAccumulationAndItsTrainingWith) {
  constexpr double kLr = 0.003, kSteps = 3;  // small()'s optimizer.lr, and train.steps below
  constexpr double kWorstWeightAbs = 1e-2 * kLr * kSteps, kMeanWeightAbs = 1e-3 * kLr;
  struct Case {
    std::string builtin;
    std::vector<std::string> sets;
    bool same_bits;  // one micro-batch a replica
  };
  const std::vector<Case> cases = {
      {"tiny_dense", {"train.global_batch=1"}, true},
      {"tiny_moe_vlm", {"parallelism.cp=2", "train.global_batch=1"}, true},
      {"tiny_dense", {"parallelism.dp=3", "train.global_batch=3"}, true},
      {"tiny_moe_vlm", {"parallelism.cp=3", "train.global_batch=1", "model.freeze=[embed_tokens, experts]"}, true},
      {"tiny_dense", {"parallelism.cp=2", "parallelism.dp=2", "train.global_batch=2"}, true},
      {"tiny_dense", {"parallelism.dp=2", "train.global_batch=2", "model.compute_dtype=bfloat16"}, true},
      {"tiny_dense", {}, false},                                                     // N = 1, 4 micro-batches
      {"tiny_moe_vlm", {"parallelism.cp=2", "model.freeze=[embed_tokens]"}, false},  // N = 2, 4 micro-batches
      {"tiny_dense", {"parallelism.dp=3", "train.global_batch=6"}, false},           // N = 3, 2 micro-batches
      {"tiny_dense", {"parallelism.cp=2", "parallelism.dp=2", "train.global_batch=8"}, false},  // N = 4, 2 each
  };
  const fs::path dir = scratch("shard_gradients");
  int i = 0;
  for (const Case& c : cases) {
    const auto config = [&](const std::string& mode) {
      std::vector<std::string> all = c.sets;
      all.insert(all.end(), {"parallelism.shard=" + mode, "train.steps=" + std::to_string(static_cast<int>(kSteps)),
                             "train.val_every=2", "checkpoint.dir=" + (dir / (std::to_string(i) + mode)).string()});
      return grid_case(c.builtin, all);
    };
    const Trained none = run(config("none"));
    const std::vector<float> a = flat_params(*none.model);
    std::optional<Trained> gradients;
    for (const std::string mode : {"gradients", "full"}) {
      const std::string what = c.builtin + " case " + std::to_string(i) + ", shard " + mode;
      Trained sharded = run(config(mode));
      ASSERT_EQ(sharded.steps.size(), none.steps.size()) << what;
      const std::vector<float> b = flat_params(*sharded.model);
      ASSERT_EQ(a.size(), b.size()) << what;
      const int ranks = config(mode).parallelism.cp * config(mode).parallelism.dp;
      for (size_t s = 0; s < none.steps.size(); ++s) {  // the exposed communication: the sharded modes' alone
        EXPECT_FALSE(none.steps[s].shard_comm_wait_s.has_value()) << what;
        ASSERT_TRUE(sharded.steps[s].shard_comm_wait_s.has_value()) << what;
        EXPECT_GE(*sharded.steps[s].shard_comm_wait_s, 0.0) << what;
        // All of the step's waits (comm_wait_s): every mode's, wherever there is more than one rank.
        for (const std::optional<double>& wait : {none.steps[s].comm_wait_s, sharded.steps[s].comm_wait_s}) {
          ASSERT_EQ(wait.has_value(), ranks > 1) << what;
          if (wait) {
            EXPECT_GE(*wait, 0.0) << what;
          }
        }
      }
      if (c.same_bits) {
        expect_same_bits(none, sharded, what);
      } else {
        expect_same_losses(none, sharded, what);
        double worst = 0.0, total = 0.0;
        for (size_t k = 0; k < a.size(); ++k) {
          const double d = std::abs(static_cast<double>(a[k]) - b[k]);
          worst = std::max(worst, d);
          total += d;
        }
        EXPECT_LE(worst, kWorstWeightAbs) << what;
        EXPECT_LE(total / static_cast<double>(a.size()), kMeanWeightAbs) << what;
        EXPECT_GT(worst, 0.0) << what << ": accumulation changes the rounding, so some weight should differ";
        if (gradients) {
          for (size_t s = 0; s < none.steps.size(); ++s) {
            EXPECT_EQ(sharded.steps[s].loss, gradients->steps[s].loss) << what << ", step " << s + 1;
            EXPECT_EQ(sharded.steps[s].grad_norm, gradients->steps[s].grad_norm) << what << ", step " << s + 1;
          }
          EXPECT_EQ(b, flat_params(*gradients->model)) << what << ": full against gradients";
        }
      }
      if (!gradients) gradients = std::move(sharded);
    }
    ++i;
  }
  fs::remove_all(dir);
}

// The config of a text-only model with per-layer embeddings (a global lookup table and projection, per-layer gates)
// and KV sharing (the last two layers read the K/V of earlier ones), its head tied to embed_tokens or not.
std::string ple_kv_config(bool tied) {
  return std::string(R"({"model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"], "vocab_size": 512,
                "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 16,
                "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                "final_logit_softcapping": 30.0, "hidden_size_per_layer_input": 4,
                "vocab_size_per_layer_input": 512, "num_kv_shared_layers": 2, "pad_token_id": 0,
                "bos_token_id": 1, "eos_token_id": 1, "tie_word_embeddings": )") +
         (tied ? "true}" : "false}");
}

// The model of ple_kv_config, written as a checkpoint.
void write_ple_kv_model(bool tied, const std::string& dir) {
  model::Checkpoint ck;
  ck.model = std::make_unique<model::Gemma4Multimodal>(model::Gemma4Config::from_json(ple_kv_config(tied), "test"));
  ck.model->init_random(11, 0.1f);
  model::save_checkpoint(ck, dir);
}

// shard gradients and full against none on `model_dir` under `sets` (one micro-batch a replica): the same losses,
// gradient norms, validation losses and final weights, bit for bit; `sharded_options` for the sharded runs.
void expect_shard_modes_give_none_bits(const std::string& model_dir, const std::vector<std::string>& sets,
                                       const std::string& what_case, const TrainOptions& sharded_options = {}) {
  const auto config = [&](const std::string& mode) {
    std::vector<std::string> all = sets;
    all.insert(all.end(),
               {"model.path=" + model_dir, "parallelism.shard=" + mode, "train.steps=3", "train.val_every=2"});
    return small("tiny_dense", all);
  };
  const Trained none = run(config("none"));
  for (const std::string mode : {"gradients", "full"}) {
    const std::string what = what_case + ", shard " + mode;
    const Trained sharded = run(config(mode), sharded_options);
    ASSERT_EQ(sharded.steps.size(), none.steps.size()) << what;
    for (size_t s = 0; s < none.steps.size(); ++s) {
      EXPECT_EQ(sharded.steps[s].loss, none.steps[s].loss) << what << ", step " << s + 1;
      EXPECT_EQ(sharded.steps[s].grad_norm, none.steps[s].grad_norm) << what << ", step " << s + 1;
      EXPECT_EQ(sharded.steps[s].val_loss, none.steps[s].val_loss) << what << ", step " << s + 1;
    }
    EXPECT_EQ(flat_params(*sharded.model), flat_params(*none.model)) << what;
  }
}

// Per-layer embeddings and KV sharing (the last two layers' backward sends dK/dV to another layer's): under shard
// gradients and full every layer is still gathered and reduced on its own, the token tables' rows fetched and their
// gradient rows reduced at their owners, the head gathered around the loss; one micro-batch a replica gives shard
// none's bits at N = 2, 3 and 4, with the head tied to embed_tokens (its gradient and the embedding's share rows) or
// its own, the per-layer table or the token table frozen or not.
TEST(ShardFull, PerLayerEmbeddingsAndKvSharingGiveShardNoneBits) {
  const fs::path dir = scratch("shard_ple_kv");
  struct Case {
    bool tied;
    std::vector<std::string> sets;
  };
  const std::vector<Case> cases = {
      {true, {"parallelism.cp=2", "train.global_batch=1"}},
      {true, {"parallelism.dp=3", "train.global_batch=3"}},
      {true, {"parallelism.cp=2", "parallelism.dp=2", "train.global_batch=2", "model.freeze=[embed_tokens_per_layer]"}},
      {false, {"parallelism.cp=2", "parallelism.dp=2", "train.global_batch=2"}},
      {false, {"parallelism.cp=3", "train.global_batch=1", "model.freeze=[model.embed_tokens.]"}},
  };
  for (bool tied : {true, false}) write_ple_kv_model(tied, (dir / (tied ? "tied" : "untied")).string());
  int i = 0;
  for (const Case& c : cases)
    expect_shard_modes_give_none_bits((dir / (c.tied ? "tied" : "untied")).string(), c.sets,
                                      "case " + std::to_string(i++));
  fs::remove_all(dir);
}

// Every reduction of shard gradients and full received in rounds of a few hundred elements (a 4 KiB budget, where
// the tied head alone is 64 KiB: its owner's part takes dozens of rounds, a layer's several, the tables' gradient
// rows some): shard none's bits at N = 2 and 4, over cp and dp, with the per-layer table, KV sharing and the head tied
// to the token table (its gradient and the embedding's share rows), as the default budget gives them.
TEST(ShardFull, ReductionsInBoundedRoundsGiveShardNoneBits) {
  const fs::path dir = scratch("shard_rounds");
  write_ple_kv_model(true, dir.string());
  TrainOptions rounds;
  rounds.shard_reduce_budget = 4096;
  int i = 0;
  for (const std::vector<std::string>& sets :
       std::vector<std::vector<std::string>>{{"parallelism.cp=2", "train.global_batch=1"},
                                             {"parallelism.cp=2", "parallelism.dp=2", "train.global_batch=2"}})
    expect_shard_modes_give_none_bits(dir.string(), sets, "case " + std::to_string(i++), rounds);
  fs::remove_all(dir);
}

// What a reduction receives into is bounded by the store's budget, not by the group: with the head tied to the token
// table (16K floats, most of it inside rank 0's slice at N = 2 and 4, so rank 0 would receive N x 64 KiB at once), one
// backward through the store's hooks (the head's gradient, every layer's, the global group's and the tables' gradient
// rows) reduces through buffers of at most the 4 KiB budget, measured while a layer's reduction is in flight and as
// the largest any reduction held; the gradient slices are those of the default budget (one round each), bit for bit.
TEST(ShardFull, ReductionsReceiveWithinTheBudget) {
  const model::Gemma4Config cfg = model::Gemma4Config::from_json(ple_kv_config(true), "test");
  model::Gemma4Model whole(cfg, model::TensorSet::Storage::Allocated);
  whole.init_random(5, 0.1f);
  const model::ParamStore& w = whole.params();
  const size_t embed = w.slot("model.embed_tokens.weight"), ple = w.slot("model.embed_tokens_per_layer.weight");
  constexpr size_t kBudget = 4096;
  constexpr int64_t kF = sizeof(float);
  // Rank r's gradient value of element e of slot i: distinct per rank, slot and element.
  const auto value = [](int r, size_t slot, int64_t e) {
    return 0.001f * static_cast<float>((r + 1) * (e % 97 + 1)) + 0.01f * static_cast<float>(slot % 7);
  };
  for (int P : {2, 4}) {
    comm::run_ranks(P, [&](comm::Communicator& world) {
      const int r = world.rank();
      const std::string at = "N = " + std::to_string(P) + ", rank " + std::to_string(r);
      struct Seen {
        std::vector<float> grads;
        int64_t in_flight = 0, largest = 0;
      };
      const auto backward = [&](size_t budget) {
        auto store =
            std::make_unique<ShardedStore>(world.split(0, r), ShardedStore::Mode::Full, comm::default_timeout());
        ShardedStore& sharded = *store;
        sharded.set_reduce_budget(budget);
        const model::Gemma4Model m(cfg, model::TensorSet::Storage::Deferred, std::move(store));
        sharded.adopt(w);
        sharded.allocate_grads();
        Seen seen;
        sharded.before_forward(model::kGlobalGroup);
        const std::vector<int32_t> ids = {r, 300 + r, 7};
        const model::ParamStore::TableRows rows[] = {sharded.rows(embed, ids, true), sharded.rows(ple, ids, true)};
        for (int l = 0; l < cfg.num_layers; ++l) {
          sharded.before_forward(l);
          sharded.after_forward(l);
        }
        sharded.acquire_head(embed);
        float* head = sharded.grad(embed);
        for (int64_t e = 0; e < w.info(embed).numel; ++e) head[e] = value(r, embed, e);
        sharded.release_head(embed);
        for (int l = cfg.num_layers - 1; l >= 0; --l) {
          sharded.before_backward(l);
          for (size_t i = 0; i < w.size(); ++i) {
            if (w.info(i).layer != l) continue;
            float* g = sharded.grad(i);
            for (int64_t e = 0; e < w.info(i).numel; ++e) g[e] = value(r, i, e);
          }
          sharded.after_backward(l);
          seen.in_flight = std::max(seen.in_flight, sharded.held().comm_buffers);
        }
        // The embedding's backward: into the tables' gradient rows (the tied one seeded with the head's by now).
        for (size_t t = 0; t < 2; ++t) {
          const size_t slot = t == 0 ? embed : ple;
          const int64_t W = w.info(slot).shape[1];
          for (size_t k = 0; k < ids.size(); ++k)
            for (int64_t j = 0; j < W; ++j) rows[t].grads[rows[t].row[k] * W + j] += value(r, slot, ids[k] * W + j);
        }
        for (size_t i = 0; i < w.size(); ++i) {
          if (w.info(i).layer != model::kGlobalGroup || w.info(i).streamed) continue;
          float* g = sharded.grad(i);
          for (int64_t e = 0; e < w.info(i).numel; ++e) g[e] = value(r, i, e);
        }
        sharded.after_backward(model::kGlobalGroup);
        const std::span<const float> slice = sharded.flat(model::Role::Grads);
        seen.grads.assign(slice.begin(), slice.end());
        seen.largest = sharded.largest_reduce_buffer();
        return seen;
      };
      const Seen bounded = backward(kBudget);
      const Seen whole_part = backward(comm::Communicator::kReduceSliceBytes);
      EXPECT_EQ(bounded.grads, whole_part.grads) << at;
      EXPECT_LE(bounded.largest, static_cast<int64_t>(kBudget)) << at;
      // While a layer's reduction is in flight: its send copy and receive buffers, beside the staging of the next
      // layer's gather.
      int64_t largest_layer = 0;
      for (int l = 0; l < cfg.num_layers; ++l) {
        int64_t n = 0;
        for (const model::ParamInfo& p : w.infos())
          if (p.layer == l) n += p.numel;
        largest_layer = std::max(largest_layer, n);
      }
      EXPECT_LE(bounded.in_flight, 2 * largest_layer * kF + static_cast<int64_t>(kBudget)) << at;
      // Rank 0 holds most of the head: one receive of every rank's contributions to its part (the default budget's
      // single round here) takes N x most of 64 KiB.
      if (r == 0) {
        EXPECT_GT(whole_part.largest, 10 * static_cast<int64_t>(kBudget)) << at;
      }
    });
  }
}

// A token table's rows fetched under shard full (fetch_rows) are the whole table's values, bit for bit (as float32
// masters, and as bf16 working weights: float_to_bf16 of them), at N = 1 to 4: the table tied to a trained head (every
// rank holds the rows of every rank's ids, all-gathered in place) and the per-layer table (a rank's own ids' rows, sent
// by their owners in rounds), read without a run's hooks so that the store's communicator carries the rows alone.
// The ids are awkward: the rows that span two owners' pieces (each table has some at some N here), ids
// repeated within a rank and across ranks, and the last rank (N > 1) with no tokens at all, which still holds every
// rank's rows of the tied table. The traffic on the store's communicator, against the pieces computed here from
// slice_of alone: besides the ids' exchange (every rank's count, 8 bytes, and distinct ids, 4 bytes each), a rank
// receives exactly the rows it holds less its own part of them, and sends its part of the tied table's rows once to
// each other rank, of the per-layer table's to each rank whose ids reach into its piece: no more than an all-gather and
// an all-to-all move.
TEST(ShardFull, TableRowsKeepTheirBitsAndMoveOnlyTheirBytes) {
  // ple_kv_config's model with a vocabulary of 8192, so that the two tables are about half the parameters and the
  // pieces' boundaries fall inside them at N = 2 to 4.
  std::string json = ple_kv_config(true);
  for (size_t at = json.find(": 512,"); at != std::string::npos; at = json.find(": 512,"))
    json.replace(at, 6, ": 8192,");
  const model::Gemma4Config cfg = model::Gemma4Config::from_json(json, "test");
  model::Gemma4Model whole(cfg, model::TensorSet::Storage::Allocated);
  whole.init_random(7, 0.1f);
  const model::ParamStore& w = whole.params();
  const size_t embed = w.slot("model.embed_tokens.weight"), ple = w.slot("model.embed_tokens_per_layer.weight");
  ASSERT_TRUE(w.info(embed).trainable && w.info(ple).trainable);
  const int32_t vocab = static_cast<int32_t>(w.info(embed).shape[0]);
  ASSERT_EQ(w.info(ple).shape[0], vocab);
  // Elements of rows `ids` of `slot` inside rank q's piece: the rows' elements of the trainable layout (every
  // parameter trainable) inside q's slice of it.
  const auto part = [&](size_t slot, const std::vector<int32_t>& ids, int P, int q) {
    const comm::Slice s = comm::slice_of(static_cast<size_t>(w.trainable_elements()), P, q);
    const int64_t W = w.info(slot).shape[1];
    int64_t n = 0;
    for (int32_t id : ids) {
      const int64_t lo = w.info(slot).train_offset + int64_t{id} * W;
      n += std::max<int64_t>(0, std::min(lo + W, static_cast<int64_t>(s.end)) -
                                    std::max(lo, static_cast<int64_t>(s.begin)));
    }
    return n;
  };
  const auto distinct = [](std::vector<int32_t> ids) {
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    return ids;
  };
  std::set<size_t> spanned;  // the tables some N splits a requested row of
  for (const model::ParamDtype dtype : {model::ParamDtype::Float32, model::ParamDtype::Bfloat16}) {
    const uint64_t element_bytes = dtype == model::ParamDtype::Bfloat16 ? sizeof(bf16) : sizeof(float);
    for (int P = 1; P <= 4; ++P) {
      // The rows of the tables that two ranks' pieces split (none at N = 1).
      std::vector<int32_t> spanning;
      for (int q = 1; q < P; ++q) {
        const auto boundary =
            static_cast<int64_t>(comm::slice_of(static_cast<size_t>(w.trainable_elements()), P, q).begin);
        for (size_t slot : {embed, ple}) {
          const int64_t in_table = boundary - w.info(slot).train_offset, W = w.info(slot).shape[1];
          if (in_table <= 0 || in_table >= w.info(slot).numel || in_table % W == 0) continue;
          spanning.push_back(static_cast<int32_t>(in_table / W));
          spanned.insert(slot);
        }
      }
      std::vector<std::vector<int32_t>> ids_of(static_cast<size_t>(P));
      for (int q = 0; q < P; ++q) {
        if (P > 1 && q == P - 1) continue;  // no tokens
        std::vector<int32_t>& ids = ids_of[static_cast<size_t>(q)];
        ids = {7, q, vocab - 1 - q, 7};
        for (int32_t row : spanning) ids.insert(ids.end(), {row, row});
      }
      std::vector<int32_t> every;
      for (const std::vector<int32_t>& ids : ids_of) every.insert(every.end(), ids.begin(), ids.end());
      every = distinct(every);
      comm::run_ranks(P, [&](comm::Communicator& world) {
        const int r = world.rank();
        const std::string at = "N = " + std::to_string(P) + ", rank " + std::to_string(r) +
                               (dtype == model::ParamDtype::Bfloat16 ? ", bf16" : ", float32");
        auto store = std::make_unique<ShardedStore>(world.split(0, r), ShardedStore::Mode::Full,
                                                    comm::default_timeout(), std::vector<std::string>{}, dtype);
        ShardedStore& s = *store;
        const model::Gemma4Model m(cfg, model::TensorSet::Storage::Deferred, std::move(store));
        s.adopt(w);
        s.set_param_dtype(dtype);
        s.allocate_grads();
        const std::vector<int32_t>& ids = ids_of[static_cast<size_t>(r)];
        // The ids' exchange: P - 1 counts, and the other ranks' distinct ids.
        uint64_t ids_received = 0, ids_sent = 0;
        if (P > 1) {
          ids_sent = static_cast<uint64_t>(P - 1) * (sizeof(int64_t) + distinct(ids).size() * sizeof(int32_t));
          for (int q = 0; q < P; ++q)
            if (q != r)
              ids_received += sizeof(int64_t) + distinct(ids_of[static_cast<size_t>(q)]).size() * sizeof(int32_t);
        }
        for (size_t slot : {embed, ple}) {
          const bool tied = slot == embed;
          const std::string what = at + ", " + w.info(slot).name;
          const std::vector<int32_t> held = tied ? every : distinct(ids);
          const comm::Communicator::Traffic before = s.traffic();
          const model::ParamStore::TableRows rows = s.rows(slot, ids, true);
          const comm::Communicator::Traffic after = s.traffic();
          // Rows [held, W], in id order: each the table's row, rounded to bf16 as the working weights are.
          const int64_t W = w.info(slot).shape[1];
          std::vector<float> got(static_cast<size_t>(W)), want(static_cast<size_t>(W));
          for (size_t u = 0; u < held.size(); ++u) {
            model::widen(rows.values, static_cast<int64_t>(u) * W, W, got.data());
            const float* row = w.weight(slot) + int64_t{held[u]} * W;
            for (int64_t j = 0; j < W; ++j)
              want[static_cast<size_t>(j)] =
                  dtype == model::ParamDtype::Bfloat16 ? bf16_to_float(float_to_bf16(row[j])) : row[j];
            ASSERT_EQ(got, want) << what << ", row " << held[u];
          }
          for (size_t i = 0; i < ids.size(); ++i) EXPECT_EQ(held[static_cast<size_t>(rows.row[i])], ids[i]) << what;
          if (!held.empty()) {
            ASSERT_NE(rows.grads, nullptr) << what;
          }
          const int64_t own = part(slot, held, P, r);
          EXPECT_EQ(after.bytes_received - before.bytes_received,
                    ids_received + static_cast<uint64_t>(static_cast<int64_t>(held.size()) * W - own) * element_bytes)
              << what;
          uint64_t sent = 0;
          for (int q = 0; q < P; ++q)
            if (q != r)
              sent += static_cast<uint64_t>(part(slot, tied ? every : distinct(ids_of[static_cast<size_t>(q)]), P, r));
          EXPECT_EQ(after.bytes_sent - before.bytes_sent, ids_sent + sent * element_bytes) << what;
          if (tied) {
            EXPECT_EQ(sent, static_cast<uint64_t>((P - 1) * own)) << what;
          }
        }
      });
    }
  }
  EXPECT_EQ(spanned, (std::set<size_t>{embed, ple})) << "no N splits a row of each table (pick another vocabulary)";
}

// Under shard full no rank holds the global group whole: after the run's global hook a rank holds its pieces and the
// global group's small parameters (the final norm, the per-layer projection and its norm) gathered, never a token
// table; rows() gives each rank the rows of its own ids (forward-only here: no head gradient to seed every rank's)
// with the whole table's values, the head is whole between acquire_head and release_head only (beside the last layer,
// which stays gathered from its forward to its backward, until a forward-only run ends), and read outside them it is
// refused. At N = 1 to 4, the head tied to the token table and not.
TEST(ShardFull, NoRankHoldsTheWholeGlobalGroup) {
  for (bool tied : {true, false}) {
    const model::Gemma4Config cfg = model::Gemma4Config::from_json(ple_kv_config(tied), "test");
    model::Gemma4Model whole(cfg, model::TensorSet::Storage::Allocated);
    whole.init_random(5, 0.1f);
    const model::ParamStore& w = whole.params();
    // Elements: the global group's unstreamed parameters; all of them; the last layer's.
    int64_t small_global = 0, weights = 0, last_layer = 0;
    for (const model::ParamInfo& p : w.infos()) {
      weights += p.numel;
      if (p.layer == model::kGlobalGroup && !p.streamed) small_global += p.numel;
      if (p.layer == cfg.num_layers - 1) last_layer += p.numel;
    }
    const size_t embed = w.slot("model.embed_tokens.weight"), ple = w.slot("model.embed_tokens_per_layer.weight");
    const size_t head = tied ? embed : w.slot("lm_head.weight");
    EXPECT_TRUE(w.info(embed).streamed && w.info(ple).streamed && w.info(head).streamed);
    for (int P = 1; P <= 4; ++P) {
      comm::run_ranks(P, [&](comm::Communicator& world) {
        const std::string at = "N = " + std::to_string(P) + (tied ? ", tied" : ", untied");
        auto store = std::make_unique<ShardedStore>(world.split(0, world.rank()), ShardedStore::Mode::Full,
                                                    comm::default_timeout());
        ShardedStore& sharded = *store;
        const model::Gemma4Model m(cfg, model::TensorSet::Storage::Deferred, std::move(store));
        sharded.adopt(w);
        constexpr int64_t kF = sizeof(float);
        // The pieces: this rank's slice of the weights, at most ceil(total / N) elements of each layout.
        EXPECT_LE(sharded.held().weight_shard, (weights + 2 * P) / P * kF) << at;
        sharded.before_forward(model::kGlobalGroup);
        EXPECT_EQ(sharded.held().gathered, small_global * kF) << at;
        // Rank r looks up tokens r, 300 + r and 7 (twice): the rows fetched are its own three.
        const int r = world.rank();
        const std::vector<int32_t> ids = {r, 300 + r, 7, 7};
        for (size_t slot : {embed, ple}) {
          const model::ParamStore::TableRows rows = sharded.rows(slot, ids, false);
          const int64_t W = w.info(slot).shape[1];
          for (size_t i = 0; i < ids.size(); ++i) {
            std::vector<float> got(static_cast<size_t>(W));
            model::widen(rows.values, rows.row[i] * W, W, got.data());
            const float* want = w.weight(slot) + int64_t{ids[i]} * W;
            EXPECT_EQ(got, std::vector<float>(want, want + W)) << at << ", " << w.info(slot).name << " row " << ids[i];
          }
          EXPECT_EQ(rows.grads, nullptr);
        }
        const int64_t own_rows = 3;
        const int64_t table_rows = own_rows * (w.info(embed).shape[1] + w.info(ple).shape[1]);
        EXPECT_EQ(sharded.held().gathered, (small_global + table_rows) * kF) << at;
        EXPECT_NE(testing::error_of([&] { sharded.weight(head); }).find("outside acquire_head"), std::string::npos);
        for (int l = 0; l < cfg.num_layers; ++l) {
          sharded.before_forward(l);
          sharded.after_forward(l);
        }
        sharded.acquire_head(head);
        const float* hw = sharded.weight(head);
        EXPECT_EQ(std::vector<float>(hw, hw + w.info(head).numel),
                  std::vector<float>(w.weight(head), w.weight(head) + w.info(head).numel))
            << at;
        EXPECT_EQ(sharded.held().gathered, (small_global + table_rows + last_layer + w.info(head).numel) * kF) << at;
        // The memory check's figures (4 tokens a rank) bound what the rank holds at its fullest.
        std::vector<bool> trainable(w.size(), true);
        const ShardedStore::Bytes most = ShardedStore::bytes_for(w, trainable, ShardedStore::Mode::Full, P, 4 * P, 4);
        EXPECT_LE(sharded.held().weight_shard, most.weight_shard) << at;
        EXPECT_LE(sharded.held().gathered, most.gathered) << at;
        sharded.release_head(head);
        sharded.after_forward(model::kGlobalGroup);
        EXPECT_EQ(sharded.held().gathered, small_global * kF) << at;
      });
    }
  }
}

// Held experts under shard full (held_expert_store.h): the streamed global parameters stay the inner ShardedStore's,
// so no rank holds a token table whole either. After the global hook a rank holds its pieces and the global group's
// small parameters gathered (the inner store's held()); rows() through the held store gives the whole table's rows,
// this rank's own fetched as ShardedStore::rows does; resident_weight_bytes counts the pieces and this rank's experts.
// At N = 2 and 4 over ep 2. And a run of ep 2 x dp 2 under shard full trains as shard none does, bit for bit (one
// micro-batch a rank: shard full's reduce-scatter and none's all-reduce both sum the ranks in order, and the EDP group
// is one rank at N = 2).
TEST(HeldExperts, ShardFullStreamsTheGlobalGroupAndTrainsAsShardNone) {
  const model::Gemma4Config cfg =
      model::Gemma4Config::from_json(model::builtin_config_json("tiny_moe_vlm"), "tiny_moe_vlm");
  model::Gemma4Model whole(cfg, model::TensorSet::Storage::Allocated);
  whole.init_random(5, 0.1f);
  const model::ParamStore& w = whole.params();
  constexpr int kEp = 2;
  constexpr int64_t kF = sizeof(float);
  int64_t small_global = 0, experts = 0;
  for (const model::ParamInfo& p : w.infos()) {
    if (p.layer == model::kGlobalGroup && !p.streamed) small_global += p.numel;
    if (model::is_expert_tensor(p)) experts += p.numel;
  }
  const size_t embed = w.slot("model.embed_tokens.weight");
  ASSERT_TRUE(w.info(embed).streamed);
  for (int P : {2, 4}) {
    comm::run_ranks(P, [&](comm::Communicator& world) {
      const std::string at = "N = " + std::to_string(P);
      auto inner = std::make_unique<ShardedStore>(world.split(0, world.rank()), ShardedStore::Mode::Full,
                                                  comm::default_timeout());
      const ShardedStore& sharded = *inner;
      auto slices = std::make_unique<ExpertSlices>(world.split(world.rank() % kEp, world.rank() / kEp), true,
                                                   comm::default_timeout());
      const std::unique_ptr<HeldExpertStore> held =
          make_held_expert_store(w, HeldInner::of(std::move(inner)), std::move(slices),
                                 HeldPlacement{world.rank() % kEp, kEp, world.rank(), P});
      EXPECT_TRUE(held->info(embed).streamed) << at;
      EXPECT_EQ(held->resident_weight_bytes(), sharded.resident_weight_bytes() + experts / kEp * kF) << at;
      held->before_forward(model::kGlobalGroup);
      EXPECT_EQ(sharded.held().gathered, small_global * kF) << at;
      const int r = world.rank();
      const std::vector<int32_t> ids = {r, 7};
      const model::ParamStore::TableRows rows = held->rows(embed, ids, false);
      const int64_t W = w.info(embed).shape[1];
      for (size_t i = 0; i < ids.size(); ++i) {
        std::vector<float> got(static_cast<size_t>(W));
        model::widen(rows.values, rows.row[i] * W, W, got.data());
        const float* want = w.weight(embed) + int64_t{ids[i]} * W;
        EXPECT_EQ(got, std::vector<float>(want, want + W)) << at << ", row " << ids[i];
      }
      const int64_t own_rows = 2;  // this rank's distinct ids: the store fetches a rank's own rows (sharded_store.h)
      EXPECT_EQ(sharded.held().gathered, (small_global + own_rows * W) * kF) << at;
      held->after_forward(model::kGlobalGroup);
      EXPECT_EQ(sharded.held().gathered, small_global * kF) << at;  // the rows dropped, the small ones kept
    });
  }
  const auto config = [](const std::string& mode) {
    // One micro-batch a rank: shard full reduces each micro-batch's gradients as its backward ends, where none sums
    // a rank's micro-batches first (sharded_store.h), so accumulation would reassociate the sums.
    return small("tiny_moe_vlm", {"model.init_std=0.4", "parallelism.dp=2", "parallelism.ep=2", "train.global_batch=2",
                                  "parallelism.shard=" + mode, "train.steps=3", "train.val_every=2"});
  };
  const Trained none = run(config("none"));
  const Trained full = run(config("full"));
  ASSERT_EQ(full.steps.size(), none.steps.size());
  for (size_t s = 0; s < none.steps.size(); ++s) {
    EXPECT_EQ(full.steps[s].loss, none.steps[s].loss) << "step " << s + 1;
    EXPECT_EQ(full.steps[s].grad_norm, none.steps[s].grad_norm) << "step " << s + 1;
    EXPECT_EQ(full.steps[s].val_loss, none.steps[s].val_loss) << "step " << s + 1;
  }
}

// Held experts read and written with no whole copy (held_checkpoint.h). The files of a store holding every expert
// (weights, and moments of distinct values so that a misplaced element shows), loaded at ep 2 over N = 2 and 4 under
// shard none, optimizer and full, each rank placing its store before the loader allocates: its expert tensors are its
// EP rank's rows of the files and every other tensor the files' (bit for bit), its resident weights the experts'
// E / ep and the rest (its pieces under full), below the whole model's. Its moments are read by slice; then every
// rank writes through a HeldWriter, the writer receiving one tensor at a time from the ranks holding its parts:
// model.safetensors and optimizer.safetensors are the whole store's files byte for byte (so the moments came back
// where they were).
TEST(HeldExperts, LoadAndSaveWithoutAWholeCopy) {
  const fs::path dir = scratch("held_checkpoint");
  const model::Gemma4Config cfg =
      model::Gemma4Config::from_json(model::builtin_config_json("tiny_moe_vlm"), "tiny_moe_vlm");
  model::Checkpoint whole;
  whole.model = std::make_unique<model::Gemma4Multimodal>(cfg);
  whole.model->init_random(5, 0.1f);
  model::ParamStore& w = whole.model->params();
  w.allocate_moments();
  for (model::Role role : {model::Role::ExpAvg, model::Role::ExpAvgSq}) {
    const std::span<float> m = w.mutable_flat(role);
    const float sign = role == model::Role::ExpAvg ? -1.f : 1.f;  // a second moment is never negative
    for (size_t i = 0; i < m.size(); ++i) m[i] = sign * static_cast<float>(i + 1);
  }
  const fs::path files = dir / "whole";
  model::save_checkpoint(whole, files.string());
  write_moments_whole(files.string(), w);
  constexpr int kEp = 2;
  constexpr int64_t kF = sizeof(float);
  int64_t experts = 0;
  for (const model::ParamInfo& p : w.infos())
    if (model::is_expert_tensor(p)) experts += p.numel;
  const auto bytes_of = [](const fs::path& f) {
    std::ifstream in(f, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  for (const std::string mode : {"none", "optimizer", "full"}) {
    for (int P : {2, 4}) {
      const std::string at = "shard " + mode + ", N = " + std::to_string(P);
      const fs::path out = dir / (mode + std::to_string(P));
      comm::run_ranks(P, [&](comm::Communicator& world) {
        const std::unique_ptr<comm::Communicator> ep = world.split(world.rank() / kEp, world.rank() % kEp);
        const std::unique_ptr<comm::Communicator> edp = world.split(world.rank() % kEp, world.rank() / kEp);
        const HeldPlacement place_at{world.rank() % kEp, kEp, world.rank(), P};
        HeldExpertStore* held = nullptr;
        const model::PlaceParams place =
            [&](const model::Gemma4Multimodal& shapes) -> std::unique_ptr<model::ParamStore> {
          if (mode == "none") return model::hold_expert_rows(shapes.params(), place_at.ep_rank, kEp);
          HeldInner inner =
              mode == "full"
                  ? HeldInner::of(std::make_unique<ShardedStore>(world.split(0, world.rank()), ShardedStore::Mode::Full,
                                                                 comm::default_timeout()))
                  : HeldInner::replicated();
          auto slices = std::make_unique<ExpertSlices>(world.split(world.rank() % kEp, world.rank() / kEp),
                                                       mode == "full", comm::default_timeout());
          std::unique_ptr<HeldExpertStore> h = place_held_experts(shapes.params(), shapes.params().trainable_after({}),
                                                                  std::move(inner), std::move(slices), place_at);
          held = h.get();
          return h;
        };
        model::Checkpoint ck = model::load_checkpoint(files.string(), {}, nullptr, false, place);
        model::ParamStore& s = ck.model->params();
        const int64_t rest = w.total_elements() - experts;
        const int64_t rest_bytes = mode == "full" ? (model::shard_of(rest, world.rank(), P).padded + 1) * kF
                                                  : rest * kF;  // ShardedStore::resident_weight_bytes: its pieces
        EXPECT_EQ(s.resident_weight_bytes(), rest_bytes + experts / kEp * kF) << at;
        EXPECT_LT(s.resident_weight_bytes(), w.weight_bytes()) << at;
        for (size_t i = 0; i < s.size(); ++i) {
          const model::ParamInfo& p = s.info(i);
          const float* want = w.weight(i) + p.rows_begin * model::row_elements(p);
          std::vector<float> got(static_cast<size_t>(p.numel));
          if (p.holds_part())
            std::copy_n(s.weight(i), p.numel, got.data());
          else
            s.read_weight(i, got);  // every rank, in the same order: a collective under shard full
          EXPECT_EQ(got, std::vector<float>(want, want + p.numel)) << at << ", " << p.name;
        }
        if (held != nullptr) {
          set_held_moment_ranges(*held, place_at);
          load_held_moments(files.string(), *held);
        } else {
          load_optimizer_state(files.string(), s);
        }
        const HeldGroups g{world, *ep, *edp, comm::default_timeout()};
        HeldWriter view = held != nullptr ? HeldWriter(*held, g) : HeldWriter(s, g);
        const bool writes = world.rank() == 0;
        model::save_checkpoint(ck, view, out.string(), {model::SaveOptions::kDefaultMaxShardBytes, writes});
        write_moments_streamed(
            out.string(), view,
            [&view](model::Role role, size_t slot, std::span<float> values) { view.read_moment(role, slot, values); },
            writes);
      });
      for (const char* f : {"model.safetensors", "optimizer.safetensors"})
        EXPECT_TRUE(bytes_of(out / f) == bytes_of(files / f)) << at << ": " << f << " differs from the whole store's";
    }
  }
  fs::remove_all(dir);
}

// A checkpoint written under shard full holds whole tensors, each gathered to the writer while it is written, and each
// rank's moments in a file of its own: at the same grid shard none's weights' bytes and moments, and it resumes at
// other rank counts and modes (save at N = 4 full, resume at N = 2 optimizer and N = 1 none: the same training, the
// reduction order changing with the grid as GridInvariance allows for).
TEST(ShardFull, CheckpointsHoldWholeTensorsAndResumeAcrossModesAndRankCounts) {
  const fs::path dir = scratch("shard_full_resume");
  const auto config = [&](std::vector<std::string> sets, const std::string& root) {
    sets.insert(sets.end(), {"train.steps=4", "checkpoint.every=2", "checkpoint.dir=" + root});
    return small("tiny_dense", sets);
  };
  const Trained none =
      run(config({"parallelism.cp=2", "parallelism.dp=2", "train.micro_batch=2", "parallelism.shard=none"},
                 (dir / "none").string()));
  const Trained full =
      run(config({"parallelism.cp=2", "parallelism.dp=2", "train.micro_batch=2", "parallelism.shard=full"},
                 (dir / "full").string()));
  ASSERT_EQ(full.steps.size(), 4u);
  EXPECT_EQ(flat_params(*full.model), flat_params(*none.model));  // one micro-batch a replica: the bits
  for (const char* step : {"step-00000002", "step-00000004"}) {
    EXPECT_EQ(file_bytes(dir / "full" / step / "model.safetensors"),
              file_bytes(dir / "none" / step / "model.safetensors"))
        << step;
    EXPECT_EQ(moments_of(dir / "full" / step, full.model->params()),
              moments_of(dir / "none" / step, none.model->params()))
        << step;
  }
  EXPECT_TRUE(fs::exists(dir / "full" / "step-00000002" / "optimizer-00004-of-00004.safetensors"))
      << "each rank writes its moments";
  TrainOptions resume;
  resume.resume = (dir / "full" / "step-00000002").string();
  Trained tail;
  tail.steps.assign(full.steps.begin() + 2, full.steps.end());
  const std::string out = (dir / "out").string();
  expect_same_losses(tail, run(config({"parallelism.dp=2", "parallelism.shard=optimizer"}, out), resume), "N = 2");
  expect_same_losses(tail, run(config({"parallelism.shard=none"}, out), resume), "N = 1");
  expect_same_losses(tail, run(config({"parallelism.dp=4", "parallelism.shard=full"}, out), resume), "N = 4, dp");
  // The resume's load (load_train_checkpoint into a sharded store): each rank keeps its pieces as the tensors are
  // read, no rank holding the weights whole, and they are the checkpoint's tensors.
  const LoadedCheckpoint loaded = load_train_checkpoint(resume.resume);
  for (int P = 2; P <= 3; ++P) {
    comm::run_ranks(P, [&](comm::Communicator& world) {
      LoadedCheckpoint pieces =
          load_train_checkpoint(resume.resume, {}, false,
                                std::make_unique<ShardedStore>(world.split(0, world.rank()), ShardedStore::Mode::Full,
                                                               comm::default_timeout()));
      auto& sharded = dynamic_cast<ShardedStore&>(pieces.weights.model->params());
      EXPECT_TRUE(sharded.sharded() && sharded.flat(model::Role::Weights).empty()) << "N = " << P;
      for (size_t slot = 0; slot < sharded.size(); ++slot) {
        const model::ParamInfo& p = sharded.info(slot);
        std::vector<float> got(static_cast<size_t>(p.numel));
        sharded.read_weight(slot, got);
        const float* want = loaded.weights.model->params().weight(slot);
        EXPECT_EQ(got, std::vector<float>(want, want + p.numel)) << p.name << " at N = " << P;
      }
    });
  }
  // Without whole_model (the CLI) no rank gathers the weights at the end: the result keeps this rank's pieces.
  TrainOptions pieces;
  pieces.whole_model = false;
  const Trained kept = run(config({"parallelism.dp=2", "parallelism.shard=full"}, (dir / "kept").string()), pieces);
  EXPECT_TRUE(kept.model->params().weights_allocated());
  EXPECT_TRUE(kept.model->params().flat(model::Role::Weights).empty());
  fs::remove_all(dir);
}

// ParamStore::read_weight, the checkpoint writer's seam: under shard full a collective that gives every rank each
// whole tensor (trainable and frozen, their pieces spread over ranks however the slices fall), while a rank holds
// no whole copy; at N = 1 to 4.
TEST(ShardFull, ReadWeightGathersWholeTensorsFromTheirPieces) {
  const model::Gemma4Config cfg = model::Gemma4Config::from_json(model::builtin_config_json("tiny_moe_vlm"), "builtin");
  model::Gemma4Multimodal whole(cfg, model::MultimodalParts{model::kBuiltinFeatureDim},
                                model::TensorSet::Storage::Allocated);
  whole.init_random(5, 0.1f);
  whole.params().freeze({"embed_tokens", "layers.2."});
  for (int P = 1; P <= 4; ++P) {
    comm::run_ranks(P, [&](comm::Communicator& world) {
      auto store = std::make_unique<ShardedStore>(world.split(0, world.rank()), ShardedStore::Mode::Full,
                                                  comm::default_timeout());
      ShardedStore& sharded = *store;
      const model::Gemma4Multimodal m(cfg, model::MultimodalParts{model::kBuiltinFeatureDim},
                                      model::TensorSet::Storage::Deferred, std::move(store));
      sharded.adopt(whole.params());
      EXPECT_TRUE(sharded.sharded() && sharded.flat(model::Role::Weights).empty());
      for (size_t slot = 0; slot < sharded.size(); ++slot) {
        const model::ParamInfo& p = sharded.info(slot);
        std::vector<float> out(static_cast<size_t>(p.numel), -1.f);
        sharded.read_weight(slot, out);
        const float* want = whole.params().weight(slot);
        EXPECT_EQ(out, std::vector<float>(want, want + p.numel)) << p.name << " at N = " << P;
      }
    });
  }
}

// Overlap: the store's posted collectives complete through ParamStore::progress alone (what a run calls between a
// layer's ops), with no wait: the next layer's all-gather that before_forward posts, and a layer's gradient
// reduction that after_backward posts, have delivered every byte they receive (the loopback backend counts a
// message when it is taken into its buffer, which only a test or a wait of its request does) by the time progress()
// says so. What they deliver is the blocking path's: the layer's whole weights bit for bit, and in each owner's
// slice every element's contributions summed in rank order in double, rounded once. At N = 2 and 3. The layers are
// widened so that a gather takes several rounds of chunks, each posted by a progress call.
TEST(ShardFull, PostedCollectivesCompleteThroughProgressAlone) {
  nlohmann::json j = nlohmann::json::parse(model::builtin_config_json("tiny_dense"));
  // A layer of ~3.1M floats: a rank's part of its gather is 3 to 4 rounds of the collective's chunks at N = 2 and 3.
  constexpr int kWideIntermediate = 16384;
  j["text_config"]["intermediate_size"] = kWideIntermediate;
  const model::Gemma4Config cfg = model::Gemma4Config::from_json(j.dump(), "widened tiny_dense");
  model::Gemma4Model whole(cfg, model::TensorSet::Storage::Allocated);
  whole.init_random(11, 0.1f);
  const int last = cfg.num_layers - 1;
  // Rank q's gradient of element e of slot k: distinct per rank and element, so a wrong order or owner shows.
  const auto contribution = [](int q, size_t k, int64_t e) {
    return 0.25f * static_cast<float>(q + 1) + 1e-3f * static_cast<float>(k) + 1e-7f * static_cast<float>(e);
  };
  for (int P = 2; P <= 3; ++P) {
    comm::run_ranks(P, [&](comm::Communicator& world) {
      auto store = std::make_unique<ShardedStore>(world.split(0, world.rank()), ShardedStore::Mode::Full,
                                                  comm::default_timeout());
      ShardedStore& s = *store;
      const model::Gemma4Model m(cfg, model::TensorSet::Storage::Deferred, std::move(store));
      s.adopt(whole.params());
      s.allocate_grads();
      // Spins progress() as a computing layer would call it; the deadline only keeps a broken overlap from hanging.
      const auto progress_until_done = [&](const std::string& what) {
        const auto deadline = std::chrono::steady_clock::now() + comm::default_timeout();
        while (!s.progress()) {
          std::this_thread::yield();
          ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "progress() never completed " << what;
        }
      };

      // The bytes a posted collective receives: the other ranks' pieces of a group (gather), or their contributions
      // to this rank's pieces of it (reduction).
      const auto others_pieces = [&](int layer) {
        uint64_t bytes = 0;
        for (size_t slot : s.group(layer)) {
          int64_t first = 0;
          const int64_t mine = static_cast<int64_t>(s.own_piece(slot, &first).size());
          bytes += static_cast<uint64_t>(s.info(slot).numel - mine) * sizeof(float);
        }
        return bytes;
      };
      const auto own_trainable_pieces = [&](int layer) {
        uint64_t bytes = 0;
        for (size_t slot : s.group(layer)) {
          int64_t first = 0;
          if (s.info(slot).trainable) bytes += s.own_piece(slot, &first).size() * sizeof(float);
        }
        return bytes;
      };

      s.before_forward(model::kGlobalGroup);  // posts layer 0's gather
      const uint64_t before_gather = s.traffic().bytes_received;
      progress_until_done("layer 0's gather");
      EXPECT_EQ(s.traffic().bytes_received - before_gather, others_pieces(0)) << "N = " << P;
      s.before_forward(0);
      for (size_t slot : s.group(0)) {
        const int64_t n = s.info(slot).numel;
        const float* want = whole.params().weight(slot);
        ASSERT_EQ(std::vector<float>(s.weight(slot), s.weight(slot) + n), std::vector<float>(want, want + n))
            << s.info(slot).name << " at N = " << P;
      }
      s.after_forward(0);
      progress_until_done("layer 1's gather");  // posted by before_forward(0); not read here

      s.before_backward(last);
      for (size_t slot : s.group(last)) {
        float* g = s.grad(slot);
        for (int64_t e = 0; e < s.info(slot).numel; ++e) g[e] = contribution(world.rank(), slot, e);
      }
      s.after_backward(last);  // posts the last layer's reduction (and layer last - 1's gather was posted before it)
      const uint64_t before_reduce = s.traffic().bytes_received;
      progress_until_done("the last layer's reduction");
      EXPECT_EQ(s.traffic().bytes_received - before_reduce,
                static_cast<uint64_t>(P - 1) * own_trainable_pieces(last) + others_pieces(last - 1))
          << "N = " << P;
      s.before_backward(last - 1);
      s.after_backward(last - 1);  // finishes the last layer's reduction into the slice (and posts its own: zeros)
      s.after_backward(model::kGlobalGroup);
      const std::span<const float> slice = s.flat(model::Role::Grads);
      const int64_t begin = s.grads_begin();
      for (const model::ParamStore::Segment& seg :
           s.trainable_segments(begin, begin + static_cast<int64_t>(slice.size()))) {
        for (int64_t e = seg.first; e < seg.first + seg.n; ++e) {
          double sum = 0.0;
          if (s.info(seg.slot).layer == last)
            for (int q = 0; q < P; ++q) sum += contribution(q, seg.slot, e);
          ASSERT_EQ(slice[static_cast<size_t>(seg.train_index + e - seg.first - begin)], static_cast<float>(sum))
              << s.info(seg.slot).name << " element " << e << " at N = " << P;
        }
      }
    });
  }
}

// A checkpoint written under shard gradients holds whole tensors: it resumes in the other modes and at other
// rank counts (at the same grid with one micro-batch a replica, bit for bit).
TEST(ShardGradients, ResumesAcrossModesAndRankCounts) {
  const fs::path dir = scratch("shard_gradients_resume");
  const auto config = [&](std::vector<std::string> sets) {
    sets.insert(sets.end(), {"train.steps=4", "checkpoint.every=2", "checkpoint.dir=" + dir.string()});
    return small("tiny_dense", sets);
  };
  const Trained whole = run(config({"parallelism.cp=2", "parallelism.dp=4", "parallelism.shard=none"}));
  ASSERT_EQ(whole.steps.size(), 4u);
  const Trained saved = run(config({"parallelism.cp=2", "parallelism.dp=4", "parallelism.shard=gradients"}));
  EXPECT_EQ(flat_params(*saved.model), flat_params(*whole.model));  // N = 8, one micro-batch a replica
  TrainOptions resume;
  resume.resume = (dir / "step-00000002").string();
  Trained tail;
  tail.steps.assign(whole.steps.begin() + 2, whole.steps.end());
  expect_same_losses(tail, run(config({"parallelism.dp=2", "parallelism.shard=optimizer"}), resume), "N = 2");
  expect_same_losses(tail, run(config({"parallelism.dp=4", "parallelism.shard=gradients"}), resume), "N = 4");
  expect_same_losses(tail, run(config({"parallelism.shard=none"}), resume), "N = 1");
  fs::remove_all(dir);
}

// --stats: the memory check's per-rank terms for the run's shard mode (the same figures the up-front check used),
// by kind, and every rank's measured peak RSS: under full the weight shard, the gathered weights, the gradients, the
// moments, the communication buffers and the activations; under none the whole weights instead of a shard; in both
// the runtime baseline (the rank's resident set before the run allocated its state).
TEST(TrainStats, MemoryByKindAndEveryRanksPeak) {
  const fs::path dir = scratch("stats");
  fs::create_directories(dir);
  for (const std::string mode : {"none", "full"}) {
    TrainOptions o;
    o.stats_path = (dir / (mode + ".json")).string();
    const TrainConfig c = small("tiny_dense", {"train.steps=1", "parallelism.cp=2", "parallelism.shard=" + mode});
    const Trained t = run(c, o);
    std::ifstream in(o.stats_path);
    const nlohmann::json j = nlohmann::json::parse(in);
    EXPECT_EQ(j.at("shard"), mode);
    EXPECT_EQ(j.at("ranks"), 2);
    ASSERT_EQ(j.at("peak_rss_bytes").size(), 2u);
    for (const auto& p : j.at("peak_rss_bytes")) EXPECT_GT(p.get<int64_t>(), 0) << mode;
    // The run's recompute choice (train.recompute and keep_* at auto), as --stats says it, priced.
    const nlohmann::json& chosen = j.at("recompute");
    EXPECT_TRUE(chosen.at("auto").get<bool>());
    TrainConfig ran = c;
    ran.train.recompute = chosen.at("layers").get<bool>();
    ran.train.keep_mlp = chosen.at("keep_mlp").get<bool>();
    ran.train.keep_o_proj = chosen.at("keep_o_proj").get<bool>();
    ran.train.keep_down_proj = chosen.at("keep_down_proj").get<bool>();
    const MemoryBreakdown need = train_memory_at_least(ran, *t.model, 2);
    EXPECT_EQ(j.at("memory_per_rank").at("total_bytes").get<int64_t>(), need.total()) << mode;
    std::set<std::string> kinds;
    for (const auto& term : j.at("memory_per_rank").at("terms")) {
      kinds.insert(term.at("kind").get<std::string>());
      EXPECT_EQ(term.at("bytes").get<int64_t>(), need.of(term.at("kind").get<std::string>())) << mode;
    }
    const std::vector<std::string> expected =
        mode == "full"
            ? std::vector<std::string>{"weight shard",          "gathered weights", "gradients",     "AdamW moments",
                                       "communication buffers", "activations",      kRuntimeBaseline}
            : std::vector<std::string>{"weights", "gradients", "AdamW moments", "activations", kRuntimeBaseline};
    for (const std::string& kind : expected) EXPECT_TRUE(kinds.contains(kind)) << mode << ": no `" << kind << "`";
  }
  fs::remove_all(dir);
}

TEST(Checkpoints, AFailedSaveLeavesTheLastGoodOne) {
  const fs::path dir = scratch("crash");
  const TrainConfig c = small("tiny_dense", {"train.steps=4", "checkpoint.every=2", "checkpoint.dir=" + dir.string()});
  TrainOptions crash;
  crash.before_checkpoint_rename = [](const std::string& tmp) {
    if (tmp.find("step-00000004") != std::string::npos) rf::fail("simulated failure while saving ", tmp);
  };
  EXPECT_NE(error_of([&] { run(c, crash); }).find("simulated failure"), std::string::npos);
  EXPECT_FALSE(fs::exists(dir / "step-00000004"));
  EXPECT_FALSE(fs::exists(dir / ".step-00000004.tmp"));  // a save that fails removes its temporaries
  EXPECT_EQ(resolve_checkpoint(dir.string()), (dir / "step-00000002").string());
  const LoadedCheckpoint good = load_train_checkpoint(resolve_checkpoint(dir.string()));
  EXPECT_EQ(good.state.step, 2);
  EXPECT_EQ(good.state.data_position, 8);  // 2 steps of 4 rows

  // What a hard kill mid-save leaves (a hidden, half-written directory; io::AtomicFile's temporary of the loss
  // picture) is never taken for a checkpoint, and the resumed run removes it before its first step.
  fs::create_directories(dir / ".step-00000004.tmp");
  std::ofstream(dir / ".step-00000004.tmp" / "trainer_state.json") << "{\"step\": 4";
  std::ofstream(dir / ".loss.svg.tmp.12345.0") << "<svg";
  EXPECT_EQ(resolve_checkpoint(dir.string()), (dir / "step-00000002").string());
  TrainOptions resume;
  resume.resume = dir.string();
  EXPECT_EQ(run(c, resume).steps.size(), 2u);
  EXPECT_FALSE(fs::exists(dir / ".step-00000004.tmp"));
  EXPECT_FALSE(fs::exists(dir / ".loss.svg.tmp.12345.0"));
  EXPECT_TRUE(fs::exists(dir / "step-00000004" / "model.safetensors"));
}

// While rank 0 writes a checkpoint the other ranks wait --timeout plus the checkpoint's bytes at the slowest write
// rate: a save slower than --timeout (here the writer sleeps twice the timeout before its rename) is not taken for a
// silent rank, and the same save waited for only --timeout (an unbounded rate) still ends the job, as a rank that
// stopped answering should.
TEST(Checkpoints, ASaveSlowerThanTheTimeoutIsWaitedFor) {
  // Long enough that the steps' own waits (ranks are threads on a shared machine) never come near it.
  constexpr comm::Timeout kTimeout{3000};
  const comm::Timeout saved_default = comm::default_timeout();
  comm::set_default_timeout(kTimeout);
  TrainOptions slow;
  slow.before_checkpoint_rename = [&](const std::string&) { std::this_thread::sleep_for(2 * kTimeout); };
  slow.slowest_checkpoint_write = 1.0;  // bytes per second: the tiny checkpoint is waited for for days
  const fs::path dir = scratch("slow_save");
  const TrainConfig c = small("tiny_dense", {"parallelism.dp=2", "train.steps=2", "checkpoint.dir=" + dir.string()});
  EXPECT_EQ(run(c, slow).last_checkpoint, (dir / "step-00000002").string());
  EXPECT_TRUE(fs::exists(dir / "step-00000002" / "optimizer.safetensors"));
  slow.slowest_checkpoint_write = std::numeric_limits<double>::infinity();  // no allowance: --timeout alone
  const fs::path silent_dir = scratch("silent_save");
  const TrainConfig silent =
      small("tiny_dense", {"parallelism.dp=2", "train.steps=2", "checkpoint.dir=" + silent_dir.string()});
  const std::string error = error_of([&] { run(silent, slow); });
  comm::set_default_timeout(saved_default);
  EXPECT_NE(error.find("rank 1: timed out after 3000 ms"), std::string::npos) << error;
  fs::remove_all(dir);
  fs::remove_all(silent_dir);
}

TEST(Checkpoints, TheSaveWaitIsTheTimeoutPlusTheBytesAtTheSlowestRate) {
  EXPECT_EQ(save_wait(comm::Timeout{1000}, 0, kSlowestCheckpointWrite), comm::Timeout{1000});
  EXPECT_EQ(save_wait(comm::Timeout{1000}, 48 << 20, 16.0 * (1 << 20)), comm::Timeout{4000});  // 48 MiB at 16 MiB/s
  EXPECT_EQ(save_wait(comm::Timeout{1000}, 1, 3.0), comm::Timeout{1334});  // a third of a second, rounded up
}

// trainer_state.json is the one file of a checkpoint a user may edit by hand: every field is checked on load, with one
// line naming the file and the field, before a value reaches the data stream's indices, the step count or the loss
// picture's arrays.
TEST(Checkpoints, AHandEditedTrainerStateIsCheckedFieldByField) {
  const fs::path dir = scratch("state");
  const TrainConfig c = small("tiny_dense", {"train.steps=2", "train.val_every=1", "checkpoint.dir=" + dir.string()});
  run(c);
  const fs::path ck = dir / "step-00000002", state = ck / "trainer_state.json";
  std::ifstream in(state);
  const nlohmann::json good = nlohmann::json::parse(in);
  const auto load_with = [&](const std::string& pointer, const nlohmann::json& value) {
    nlohmann::json edited = good;
    edited[nlohmann::json::json_pointer(pointer)] = value;
    io::write_file_atomically(state.string(), edited.dump());
    return error_of([&] { load_train_checkpoint(ck.string()); });
  };
  const std::string file = state.string() + ": ";
  EXPECT_EQ(load_with("/step", -5), file + "`step` = -5 must be an integer in [0, 2147483647]");
  EXPECT_EQ(load_with("/step", 0.5), file + "`step` = 0.5 must be an integer in [0, 2147483647]");
  EXPECT_EQ(load_with("/data_position", -5),
            file + "`data_position` = -5 must be an integer in [0, 4611686018427387903]");
  EXPECT_EQ(load_with("/data_position", INT64_MAX),
            file + "`data_position` = 9223372036854775807 must be an integer in [0, 4611686018427387903]");
  EXPECT_EQ(load_with("/seed", -1), file + "`seed` = -1 must be an integer in [0, 18446744073709551615]");
  EXPECT_EQ(load_with("/history/steps", {1, 2, 2, 1, 2}),
            file + "`history.loss` has 2 entries but `history.steps` has 5");
  EXPECT_EQ(load_with("/history/val_steps", {1, 2, 2}),
            file + "`history.val_loss` has 2 entries but `history.val_steps` has 3");
  EXPECT_EQ(load_with("/history/steps", {1, 2147483647}),
            file + "`history.steps[1]` = 2147483647 must be an integer in [1, 2]");
  EXPECT_EQ(load_with("/history/val_steps", {0, 1}), file + "`history.val_steps[0]` = 0 must be an integer in [1, 2]");
  // A field given twice: nlohmann would keep the last silently, whichever a reader meant.
  io::write_file_atomically(state.string(), "{\"step\": 1, " + good.dump().substr(1));
  EXPECT_EQ(error_of([&] { load_train_checkpoint(ck.string()); }), file + "the key `step` appears twice");
  // The file as written loads, and a resume through train() stops on the same line as the loader.
  EXPECT_EQ(load_with("/step", 2), "");
  load_with("/data_position", -5);
  TrainOptions resume;
  resume.resume = ck.string();
  EXPECT_EQ(
      error_of([&] {
        run(small("tiny_dense", {"train.steps=3", "train.val_every=1", "checkpoint.dir=" + dir.string()}), resume);
      }),
      file + "`data_position` = -5 must be an integer in [0, 4611686018427387903]");
}

// A damaged optimizer.safetensors (a NaN moment, a negative second moment) or non-finite weights (resumed, or from
// model.path) stop the run before step 1 with the file and the tensor, rather than turning every weight NaN in the
// first update or failing after the first step as a non-finite loss.
TEST(Checkpoints, NonFiniteWeightsAndMomentsStopBeforeStepOne) {
  const fs::path dir = scratch("nonfinite");
  const auto config = [&](const std::string& root, std::vector<std::string> more = {}) {
    more.push_back("checkpoint.dir=" + root);
    return small("tiny_dense", more);
  };
  run(config((dir / "good").string(), {"train.steps=1"}));
  const std::string good = (dir / "good" / "step-00000001").string();
  // Writes the good checkpoint again under `name` after `edit` changed its weights or moments.
  const auto damaged = [&](const std::string& name, const std::function<void(model::ParamStore&)>& edit) {
    LoadedCheckpoint ck = load_train_checkpoint(good);
    load_optimizer_state(good, ck.weights.model->params());
    edit(ck.weights.model->params());
    return save_train_checkpoint((dir / name).string(), ck.weights, ck.weights.model->params(), ck.state, 1);
  };
  const auto resume_error = [&](const std::string& ck) {
    TrainOptions resume;
    resume.resume = ck;
    return error_of([&] { run(config((dir / "out").string(), {"train.steps=2"}), resume); });
  };
  const std::string name = "model.layers.0.self_attn.q_proj.weight";
  const std::string nan_moment =
      damaged("nan_moment", [&](model::ParamStore& p) { p.moment(model::Role::ExpAvg, p.slot(name))[1] = NAN; });
  EXPECT_EQ(resume_error(nan_moment),
            nan_moment + "/optimizer.safetensors: tensor `exp_avg." + name + "` has nan at [0, 1]");
  const std::string negative = damaged("negative_moment", [&](model::ParamStore& p) {
    p.moment(model::Role::ExpAvgSq, p.slot(name))[0] = -1.0f;
  });
  EXPECT_EQ(resume_error(negative), negative + "/optimizer.safetensors: tensor `exp_avg_sq." + name +
                                        "` has -1 at [0, 0] (a second moment is never negative)");
  const std::string nan_weight =
      damaged("nan_weight", [&](model::ParamStore& p) { p.mutable_weight(p.slot(name))[2] = INFINITY; });
  // Named as in the files, where a built-in (multimodal) model keeps its decoder under model.language_model.
  const std::string file_name = "model.language_model.layers.0.self_attn.q_proj.weight";
  EXPECT_EQ(resume_error(nan_weight), nan_weight + "/model.safetensors: tensor `" + file_name + "` has inf at [0, 2]");
  // The same weights as a model to fine-tune.
  const std::string path = (dir / "nan_weight" / "step-00000001").string();
  EXPECT_EQ(error_of([&] {
              run(config((dir / "out").string(), {"train.steps=1", "model.path=" + path}));
            }),
            path + "/model.safetensors: tensor `" + file_name + "` has inf at [0, 2]");
  // Under shard full each rank loads and checks only its pieces; rank 0, which holds the element, names it alike (the
  // ranks agree on its line).
  for (const char* n : {"2", "3"})
    EXPECT_EQ(error_of([&] {
                run(config((dir / "out").string(), {"train.steps=1", "model.path=" + path, "parallelism.shard=full",
                                                    std::string("parallelism.dp=") + n, "train.global_batch=6"}));
              }),
              "rank 0: " + path + "/model.safetensors: tensor `" + file_name + "` has inf at [0, 2]")
        << "N = " << n;
}

// The metrics file a resume continues keeps the whole lines of the steps its checkpoint holds: the lines of steps it
// does again go, and so does a line a hard kill cut off; a fresh run starts it empty.
TEST(Checkpoints, AResumedMetricsFileKeepsTheCheckpointsSteps) {
  const fs::path dir = scratch("metrics_resume");
  fs::create_directories(dir);
  const std::string path = (dir / "m.jsonl").string();
  const auto line = [](int64_t step) {
    StepMetrics m;
    m.step = step;
    m.loss = 1.0 / static_cast<double>(step);
    return metrics_json_line(m);
  };
  const auto read = [&] {
    std::ifstream in(path);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  {
    MetricsFile f(path, 0);
    for (int64_t step = 1; step <= 4; ++step) f.append(line(step));
    f.close();
  }
  std::ofstream(path, std::ios::app) << "{\"step\":5,\"loss\":0.2";  // cut off by a kill
  {
    MetricsFile f(path, 2);
    EXPECT_EQ(read(), line(1) + line(2));
    f.append(line(3));
  }  // closed by the destructor
  EXPECT_EQ(read(), line(1) + line(2) + line(3));
  { MetricsFile f(path, 9); }  // a resume past the file's steps keeps all of it
  EXPECT_EQ(read(), line(1) + line(2) + line(3));
  { MetricsFile f(path, 0); }
  EXPECT_EQ(read(), "");
}

TEST(Checkpoints, KeepLastKAndTheMetricsFile) {
  const fs::path dir = scratch("keep");
  const TrainConfig c = small("tiny_dense", {"train.steps=5", "checkpoint.every=1", "checkpoint.keep=2",
                                             "checkpoint.dir=" + (dir / "ck").string(), "train.val_every=2"});
  TrainOptions opt;
  opt.metrics_path = (dir / "metrics.jsonl").string();
  fs::create_directories(dir);
  const Trained r = run(c, opt);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir / "ck")) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"loss.svg", "step-00000004", "step-00000005"}));
  EXPECT_EQ(r.last_checkpoint, (dir / "ck" / "step-00000005").string());
  // The checkpoint's weights load back as a plain model checkpoint with the trained values.
  const model::Checkpoint back = model::load_checkpoint(r.last_checkpoint);
  EXPECT_EQ(flat_params(*back.model), flat_params(*r.model));

  std::ifstream in(dir / "metrics.jsonl");
  std::string line;
  int n = 0;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line);
    ++n;
    EXPECT_EQ(j["step"], n);
    for (const char* key : {"loss", "lr", "grad_norm", "tokens", "tokens_per_s", "peak_rss_bytes"})
      EXPECT_TRUE(j.contains(key)) << key;
    EXPECT_GT(j["peak_rss_bytes"].get<int64_t>(), 0);
    EXPECT_EQ(j.contains("val_loss"), n % 2 == 0 || n == 5) << line;
  }
  EXPECT_EQ(n, 5);
  std::ifstream svg(dir / "ck" / "loss.svg");
  const std::string text((std::istreambuf_iterator<char>(svg)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text.rfind("<svg", 0), 0u);
  EXPECT_NE(text.find("<polyline"), std::string::npos);
}

// data.val_rows = 0 turns validation off: no step reports a validation loss, the last included.
TEST(Validation, ZeroValRowsTrainsWithoutValidation) {
  const Trained off = run(small("tiny_dense", {"train.steps=3", "data.val_rows=0", "train.val_every=1"}));
  ASSERT_EQ(off.steps.size(), 3u);
  for (const StepMetrics& s : off.steps) EXPECT_FALSE(s.val_loss.has_value()) << "step " << s.step;
  const Trained on = run(small("tiny_dense", {"train.steps=3", "data.val_rows=2", "train.val_every=1"}));
  for (size_t i = 0; i < on.steps.size(); ++i) EXPECT_TRUE(on.steps[i].val_loss.has_value()) << "step " << i + 1;
}

TEST(Freeze, FrozenParametersKeepTheirBits) {
  const TrainConfig c = small("tiny_dense", {"model.freeze=[embed_tokens, layers.0.]", "train.steps=2"});
  const Trained r = run(c);
  model::Gemma4Multimodal init(model::Gemma4Config::from_json(model::builtin_config_json("tiny_dense")),
                               model::MultimodalParts{model::kBuiltinFeatureDim});
  init.init_random(c.train.seed, static_cast<float>(c.model.init_std));
  int frozen = 0, moved = 0;
  const model::TensorSet before = init.params().snapshot(model::Role::Weights);
  const model::TensorSet after = r.model->params().snapshot(model::Role::Weights);
  for (size_t i = 0; i < before.size(); ++i) {
    const std::string& name = before[i].name;
    const bool is_frozen =
        name.find("embed_tokens") != std::string::npos || name.find("layers.0.") != std::string::npos;
    const bool same = before[i].data == after[i].data;
    if (is_frozen) {
      EXPECT_TRUE(same) << name;
      ++frozen;
    } else {
      moved += !same;
    }
  }
  EXPECT_GT(frozen, 5);
  EXPECT_GT(moved, 20);
}

// The checkpoint holds moments for the trainable tensors only, and a run resumed from it continues bit for bit.
TEST(Freeze, ResumeWithoutTheFrozenMomentsContinuesBitForBit) {
  const fs::path dir = scratch("freeze_resume");
  const TrainConfig c = small("tiny_moe_vlm", {"model.freeze=[embed_tokens, experts]", "train.steps=4",
                                               "checkpoint.every=2", "checkpoint.dir=" + dir.string()});
  const Trained whole = run(c);
  const io::SafetensorsFile moments =
      io::SafetensorsFile::open((dir / "step-00000002" / "optimizer.safetensors").string());
  int stored = 0;
  for (const model::ParamInfo& t : whole.model->params().infos()) {
    const bool frozen = t.name.find("embed_tokens") != std::string::npos || t.name.find("experts") != std::string::npos;
    for (const char* prefix : {"exp_avg.", "exp_avg_sq."}) {
      EXPECT_EQ(moments.find(prefix + t.name) == nullptr, frozen) << prefix << t.name;
      stored += !frozen;
    }
  }
  EXPECT_GT(stored, 20);
  TrainOptions resume;
  resume.resume = (dir / "step-00000002").string();
  const Trained second = run(c, resume);
  ASSERT_EQ(second.steps.size(), 2u);
  for (size_t i = 0; i < 2; ++i) EXPECT_EQ(second.steps[i].loss, whole.steps[i + 2].loss) << "step " << i + 3;
  EXPECT_EQ(flat_params(*second.model), flat_params(*whole.model));
}

// model.compute_dtype = bfloat16 trains the same model along nearly the same loss curve. Step 1 runs the same weights,
// so its loss differs only by the bf16 rounding of the matmuls' operands (tests/model/test_model_bf16.cpp bounds a
// run: a few 2^-8 of the largest logit, ~1e-3 relative here). Later steps also carry the weights' drift: AdamW
// normalises each update to ~lr per element, so a gradient that differs by the bf16 rounding (~1% relative) moves the
// update by ~1% of lr, except where a gradient is near zero and its sign may flip; over 5 steps at lr 0.003 that
// moves the loss by well under 1% of it. kBf16TrajectoryRel = 2e-2 leaves that margin, while a wrong product (a
// transposed or stale weight, a missing accumulation) changes the loss by O(1) or stops it from falling.
constexpr double kBf16TrajectoryRel = 2e-2;

TEST(ComputeDtype, Bf16LossTrajectoryFollowsFloat32) {
  for (const std::string builtin : {"tiny_dense", "tiny_moe_vlm"}) {
    const Trained f32 = run(grid_case(builtin, {}));
    const Trained bf = run(grid_case(builtin, {"model.compute_dtype=bfloat16"}));
    // The same rows through the weights left as they were (an lr that moves nothing): a step's loss varies more from
    // row to row than 5 steps of training move it, so "bf16 trains" compares the last step's rows with and without
    // the training.
    const Trained still = run(grid_case(builtin, {"optimizer.lr=1e-12"}));
    ASSERT_EQ(bf.steps.size(), f32.steps.size());
    EXPECT_LT(bf.steps.back().loss, still.steps.back().loss) << builtin << ": bf16 trains";
    bool differs = false;
    for (size_t i = 0; i < f32.steps.size(); ++i) {
      EXPECT_NEAR(bf.steps[i].loss, f32.steps[i].loss, kBf16TrajectoryRel * f32.steps[i].loss)
          << builtin << " step " << i + 1;
      differs = differs || bf.steps[i].loss != f32.steps[i].loss;
    }
    EXPECT_TRUE(differs) << builtin << ": the bf16 mode computed in float32";
  }
}

// model.compute_dtype reaches the vision tower: a bfloat16 run's tower multiplies in bf16 as its decoder does
// (Gemma4Multimodal::set_vision_compute_dtype, set by the trainer before the data's images are encoded). Oracle: step
// 1's loss rebuilt outside the trainer (as LabelTokens does) from the same initial model and mock rows, the decoder in
// bf16 and the frozen tower's soft tokens made in bf16 or in float32, each row run as the trainer runs it: its own
// micro-batch, its token losses over the global batch's label count, the rows' shares summed in order. Those are the
// trainer's own calls, so its loss is the bf16 tower's bits on every path. (One 4-row batch is not: where bf16 is
// emulated, operands rounded onto float32 sgemm as on AVX2-only CPUs, a token's sums depend on its row's offset in
// the sgemm call, OpenBLAS's Haswell/Zen kernels summing a call's last M mod 12 rows in another order, and a ~1e-7
// float32 difference that crosses a bf16 rounding boundary moves the next product's operand by 2^-8: the loss moved
// 3.7e-6 relative under RINGFLEX_ISA=avx2 OPENBLAS_CORETYPE=Haswell and on a Zen 3.) The float32 tower's loss lies
// farther than 1e-6 relative, more than any float32 reordering moves a mean of ~900 token losses: the switch is
// taken. The two towers' soft tokens differ, by at most the 2e-2 relative that tests/model/vision_parity.py bounds
// the bf16 tower with (bf16 operands carry 2^-9 relative rounding, a few layers of linears accumulate it, and the soft
// tokens are their sums' differences).
TEST(ComputeDtype, TheVisionTowerRunsInTheTrainersDtype) {
  const TrainConfig c = small("tiny_moe_vlm", {"model.compute_dtype=bfloat16", "train.steps=1"});
  const Trained trained = run(c);
  ASSERT_EQ(trained.steps.size(), 1u);
  EXPECT_EQ(trained.model->vision_compute_dtype(), model::ComputeDtype::Bfloat16);
  EXPECT_EQ(run(small("tiny_moe_vlm", {"train.steps=1"})).model->vision_compute_dtype(), model::ComputeDtype::Float32);

  const std::string json = model::builtin_config_json("tiny_moe_vlm");
  const model::VisionConfig vc = model::VisionConfig::from_config_json(json, "tiny_moe_vlm").value();
  const io::Passthrough tower_weights = model::init_vision_tower(vc, c.train.seed);
  std::vector<float> soft[2];  // the first rows' image features: float32 tower, bf16 tower
  double loss[2] = {0.0, 0.0};
  for (int t = 0; t < 2; ++t) {
    model::Gemma4Multimodal m(model::Gemma4Config::from_json(json), model::MultimodalParts{model::kBuiltinFeatureDim});
    m.init_random(c.train.seed, static_cast<float>(c.model.init_std));
    model::VisionEncoder tower(vc, tower_weights);
    tower.set_compute_dtype(t == 0 ? model::ComputeDtype::Float32 : model::ComputeDtype::Bfloat16);
    ImageContract images;
    images.vision = [&]() -> const model::VisionEncoder* { return &tower; };
    const auto data = make_data_source(c, {m.config().vocab_size, 0, model::kBuiltinFeatureDim, ""}, images);
    std::vector<Row> rows;
    for (int64_t i = 0; i < c.train.global_batch; ++i) rows.push_back(data->train_row(i));
    const PackedBatch all = stack_rows(rows, model::kBuiltinFeatureDim);
    ASSERT_GT(all.n_image_features, 0) << "the rows hold no image";
    soft[t] = all.image_features;
    model::RunOptions ro;
    ro.compute_dtype = model::ComputeDtype::Bfloat16;
    ro.loss_normalizer = static_cast<double>(all.label_tokens());
    for (const Row& row : rows) loss[t] += m.run(stack_rows({row}, model::kBuiltinFeatureDim).batch(), ro).loss;
  }
  EXPECT_EQ(trained.steps[0].loss, loss[1]);
  EXPECT_GT(std::abs(trained.steps[0].loss - loss[0]), 1e-6 * loss[1]) << "the trainer's tower ran in float32";
  double diff = 0.0, norm = 0.0;  // squared L2 norms, as vision_parity.py's relative error
  for (size_t i = 0; i < soft[0].size(); ++i) {
    diff += std::pow(static_cast<double>(soft[1][i]) - soft[0][i], 2);
    norm += std::pow(static_cast<double>(soft[0][i]), 2);
  }
  EXPECT_GT(diff, 0.0) << "the bf16 tower computed in float32";
  EXPECT_LE(std::sqrt(diff / norm), 2e-2) << "bf16 soft tokens against float32";
}

// model.param_dtype = bfloat16 under every shard mode: the working weights are the masters rounded to bf16 however
// they got there (the replicated copy under none/optimizer/gradients, the gathered bf16 pieces under full), the
// gradients float32 and reduced as in float32, so every loss, gradient norm, validation loss, the final masters, the
// written model file and the moments are shard none's bits at the same grid: N = 1, 2 (dp, one micro-batch a
// replica) and 3 (cp), dense. (tests/trainer/CMakeLists.txt runs the same under mpirun at N = 2 and 3.)
TEST(ParamDtype, Bf16WorkingWeightsGiveShardNoneBitsInEveryMode) {
  const fs::path dir = scratch("param_bf16_modes");
  const std::vector<std::vector<std::string>> grids = {{"train.micro_batch=4"},
                                                       {"parallelism.dp=2", "train.micro_batch=2"},
                                                       {"parallelism.cp=3", "train.micro_batch=4"}};
  for (const std::vector<std::string>& grid : grids) {
    const std::string what = grid[0];
    const auto config = [&](const std::string& mode) {
      std::vector<std::string> sets = grid;
      sets.insert(sets.end(), {"train.steps=3", "train.val_every=2", "model.param_dtype=bfloat16",
                               "parallelism.shard=" + mode, "checkpoint.dir=" + (dir / what / mode).string()});
      return small("tiny_dense", sets);
    };
    const Trained none = run(config("none"));
    ASSERT_EQ(none.steps.size(), 3u) << what;
    for (const char* mode : {"optimizer", "gradients", "full"}) {
      const Trained sharded = run(config(mode));
      ASSERT_EQ(sharded.steps.size(), 3u) << what << ", " << mode;
      expect_same_bits(none, sharded, what + ", shard " + mode);
    }
  }
  fs::remove_all(dir);
}

// bf16 working weights train along the float32 run's loss curve (each weight rounded at 2^-9 relative at most, as
// compute_dtype bfloat16 rounds each weight operand, and that mode's kBf16TrajectoryRel reasoning, which also rounds
// the activations, bounds this one) and differ from it (the option is not ignored). The checkpoint holds the float32
// masters, written as F32 as with float32 working weights (most of them are not bf16 values after AdamW's steps), and
// a resume from it continues bit for bit (under shard full over dp 2).
TEST(ParamDtype, Bf16WorkingWeightsFollowFloat32AndCheckpointTheMasters) {
  const fs::path dir = scratch("param_bf16_resume");
  const Trained f32 = run(small("tiny_dense", {}));
  const Trained bf = run(small("tiny_dense", {"model.param_dtype=bfloat16"}));
  ASSERT_EQ(bf.steps.size(), f32.steps.size());
  bool differs = false;
  for (size_t i = 0; i < f32.steps.size(); ++i) {
    EXPECT_NEAR(bf.steps[i].loss, f32.steps[i].loss, kBf16TrajectoryRel * f32.steps[i].loss) << "step " << i + 1;
    differs = differs || bf.steps[i].loss != f32.steps[i].loss;
  }
  EXPECT_TRUE(differs) << "param_dtype bfloat16 read float32 weights";

  const TrainConfig c =
      small("tiny_dense", {"parallelism.dp=2", "train.micro_batch=2", "parallelism.shard=full", "train.steps=4",
                           "checkpoint.every=2", "model.param_dtype=bfloat16", "checkpoint.dir=" + dir.string()});
  const Trained whole = run(c);
  ASSERT_EQ(whole.steps.size(), 4u);
  const io::SafetensorsFile file = io::SafetensorsFile::open(whole.last_checkpoint + "/model.safetensors");
  const model::ParamStore& store = whole.model->params();
  int64_t not_bf16 = 0;
  for (size_t slot = 0; slot < store.size(); ++slot) {
    const model::ParamInfo& p = store.info(slot);
    const io::TensorView t = file.at(model::file_name_of(p.name, model::kMultimodalTextPrefix));
    ASSERT_EQ(t.dtype, io::StDType::F32) << p.name;
    std::vector<float> got(static_cast<size_t>(p.numel));
    ASSERT_EQ(t.bytes.size(), got.size() * sizeof(float)) << p.name;
    std::memcpy(got.data(), t.bytes.data(), t.bytes.size());
    const float* master = store.flat(model::Role::Weights).data() + p.offset;
    EXPECT_EQ(got, std::vector<float>(master, master + p.numel)) << p.name;
    for (float v : got) not_bf16 += bf16_to_float(float_to_bf16(v)) != v;
  }
  EXPECT_GT(not_bf16, store.total_elements() / 2) << "the checkpoint holds masters, not the working copy";
  TrainOptions resume;
  resume.resume = (dir / "step-00000002").string();
  const Trained second = run(c, resume);
  ASSERT_EQ(second.steps.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(second.steps[i].loss, whole.steps[i + 2].loss) << "step " << i + 3;
    EXPECT_EQ(second.steps[i].grad_norm, whole.steps[i + 2].grad_norm) << "step " << i + 3;
  }
  EXPECT_EQ(flat_params(*second.model), flat_params(*whole.model));
  fs::remove_all(dir);
}

// Under shard full the working weights travel as bf16: the global group's and a layer's all-gathers deliver to each
// rank exactly half the bytes of the float32 ones (the other ranks' pieces at 2 bytes an element instead of 4, counted
// by the store's communicator), and the gathered layer is the masters rounded to bf16 (float_to_bf16, the oracle),
// whose bits a bf16 compute run multiplies (find). At N = 2 and 3.
TEST(ShardFull, Bf16WorkingWeightsHalveTheGatherBytes) {
  const model::Gemma4Config cfg = model::Gemma4Config::from_json(model::builtin_config_json("tiny_dense"), "builtin");
  model::Gemma4Model whole(cfg, model::TensorSet::Storage::Allocated);
  whole.init_random(11, 0.1f);
  for (int P = 2; P <= 3; ++P) {
    comm::run_ranks(P, [&](comm::Communicator& world) {
      uint64_t received[2] = {0, 0};  // float32, bfloat16
      for (const model::ParamDtype dtype : {model::ParamDtype::Float32, model::ParamDtype::Bfloat16}) {
        auto store = std::make_unique<ShardedStore>(world.split(0, world.rank()), ShardedStore::Mode::Full,
                                                    comm::default_timeout());
        ShardedStore& s = *store;
        const model::Gemma4Model m(cfg, model::TensorSet::Storage::Deferred, std::move(store));
        s.adopt(whole.params());
        s.set_param_dtype(dtype);
        const model::Bf16Lookup& copies = s.bf16_weights();
        // The global group's small parameters (gathered here) and layer 0 (posted here): a small layer's message may
        // be taken in as it is posted.
        const uint64_t before = s.traffic().bytes_received;
        s.before_forward(model::kGlobalGroup);
        const auto deadline = std::chrono::steady_clock::now() + comm::default_timeout();
        while (!s.progress()) {  // layer 0's gather alone is in flight
          std::this_thread::yield();
          ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "progress() never completed layer 0's gather";
        }
        received[dtype == model::ParamDtype::Bfloat16] = s.traffic().bytes_received - before;
        s.before_forward(0);
        if (dtype == model::ParamDtype::Float32) continue;
        for (size_t slot : s.group(0)) {
          const model::ParamInfo& p = s.info(slot);
          const float* master = whole.params().weight(slot);
          const bf16* b16 = p.matmul ? copies.find(s.weight(slot), p.numel) : nullptr;
          ASSERT_EQ(b16 == nullptr, !p.matmul) << p.name;
          for (int64_t e = 0; e < p.numel; ++e) {
            const bf16 want = float_to_bf16(master[e]);
            ASSERT_EQ(s.weight(slot)[e], bf16_to_float(want)) << p.name << " element " << e << " at N = " << P;
            if (b16) {
              ASSERT_EQ(b16[e].bits, want.bits) << p.name << " element " << e << " at N = " << P;
            }
          }
        }
      }
      EXPECT_GT(received[0], 0u);
      EXPECT_EQ(2 * received[1], received[0]) << "N = " << P;
    });
  }
}

// model.param_dtype = bfloat16 under shard optimizer and gradients: a rank holds the float32 masters of its slice alone
// (ceil(total / N) elements at most: held()'s weight_shard, what the memory check counts) beside the whole bf16
// working copy (2 bytes a parameter). The run reads the masters rounded to bf16 (float_to_bf16, the oracle) on every
// rank: widened between a group's hooks, their own bits for a bf16 compute run (find), and a table's rows as they are;
// read_weight gathers a tensor's masters whole, and a weight read outside its hooks is refused. After the optimizer
// wrote this rank's masters (the working copy is refused until the update is gathered), after_update delivers every
// other rank's updated trainable pieces at 2 bytes an element (the store's communicator's count: half of float32's)
// and every rank's working copy is the new masters rounded. N = 1, 2, 3.
TEST(ShardMasters, Bf16WorkingWeightsKeepASliceOfTheMasters) {
  const model::Gemma4Config cfg = model::Gemma4Config::from_json(model::builtin_config_json("tiny_dense"), "builtin");
  model::Gemma4Model whole(cfg, model::TensorSet::Storage::Allocated);
  whole.init_random(13, 0.1f);
  const model::ParamStore& w = whole.params();
  const int64_t total = w.total_elements();
  constexpr int64_t kF = sizeof(float), kB = sizeof(bf16);
  // The update the test plays the optimizer with: its results are mostly not bf16 values.
  const auto updated = [](float x) { return x * 1.5f + 1e-3f; };
  const auto same = [](float x) { return x; };
  for (const ShardedStore::Mode mode : {ShardedStore::Mode::Optimizer, ShardedStore::Mode::Gradients}) {
    for (int P = 1; P <= 3; ++P) {
      comm::run_ranks(P, [&](comm::Communicator& world) {
        const std::string at = std::string(mode == ShardedStore::Mode::Optimizer ? "optimizer" : "gradients") +
                               ", N = " + std::to_string(P) + ", rank " + std::to_string(world.rank());
        auto store = std::make_unique<ShardedStore>(world.split(0, world.rank()), mode, comm::default_timeout(),
                                                    std::vector<std::string>{}, model::ParamDtype::Bfloat16);
        ShardedStore& s = *store;
        const model::Gemma4Model m(cfg, model::TensorSet::Storage::Deferred, std::move(store));
        s.allocate_weights();
        for (size_t slot = 0; slot < s.size(); ++slot)  // the loader's way: whole tensors, each rank keeps its piece
          s.write_weight(slot, std::span<const float>(w.weight(slot), static_cast<size_t>(w.info(slot).numel)));
        ASSERT_TRUE(s.masters_sharded()) << at;
        const model::Shard mine = model::shard_of(total, world.rank(), P);  // every parameter trains here
        EXPECT_EQ(s.held().weight_shard, mine.size() * kF) << at;
        EXPECT_EQ(s.held().working, total * kB) << at;
        const std::vector<bool> all(s.size(), true);
        EXPECT_EQ(ShardedStore::master_bytes_for(w, all, P), mine.padded * kF) << at;
        EXPECT_LE(s.held().weight_shard, ShardedStore::master_bytes_for(w, all, P)) << at;
        EXPECT_EQ(s.resident_weight_bytes(), (mine.padded + 1) * kF + total * kB) << at;

        const auto expect_working = [&](const std::function<float(float)>& f, const std::string& when) {
          const model::Bf16Lookup& copies = s.bf16_weights();
          for (int layer = model::kGlobalGroup; layer < cfg.num_layers; ++layer) {
            s.before_forward(layer);
            for (size_t slot : s.group(layer)) {
              const model::ParamInfo& p = s.info(slot);
              std::vector<float> got(static_cast<size_t>(p.numel));
              const bf16* b16 = nullptr;
              if (p.streamed) {  // a table's rows (every row here) come as the working copy's bf16 values
                std::vector<int32_t> ids(static_cast<size_t>(p.shape[0]));
                std::iota(ids.begin(), ids.end(), 0);
                const model::ParamStore::TableRows rows = s.rows(slot, ids, false);
                ASSERT_EQ(rows.values.dtype, model::HeldDType::BF16) << p.name;
                b16 = static_cast<const bf16*>(rows.values.data);
                model::widen(rows.values, 0, p.numel, got.data());
              } else {
                std::copy_n(s.weight(slot), p.numel, got.data());
                b16 = p.matmul ? copies.find(s.weight(slot), p.numel) : nullptr;
                ASSERT_EQ(b16 == nullptr, !p.matmul) << p.name;
              }
              for (int64_t e = 0; e < p.numel; ++e) {
                const bf16 want = float_to_bf16(f(w.weight(slot)[e]));
                ASSERT_EQ(got[static_cast<size_t>(e)], bf16_to_float(want))
                    << p.name << " element " << e << ", " << at << ", " << when;
                if (b16) {
                  ASSERT_EQ(b16[e].bits, want.bits) << p.name << " element " << e << ", " << at << ", " << when;
                }
              }
            }
            if (layer != model::kGlobalGroup) s.after_forward(layer);
          }
          s.after_forward(model::kGlobalGroup);
          for (size_t slot = 0; slot < s.size(); ++slot) {  // the masters, gathered whole (collective)
            const model::ParamInfo& p = s.info(slot);
            std::vector<float> got(static_cast<size_t>(p.numel)), want(got.size());
            s.read_weight(slot, got);
            std::transform(w.weight(slot), w.weight(slot) + p.numel, want.begin(), f);
            ASSERT_EQ(got, want) << p.name << ", " << at << ", " << when;
          }
        };
        expect_working(same, "loaded");
        const size_t first_layer_slot = s.group(0).front();
        EXPECT_NE(testing::error_of([&] { s.weight(first_layer_slot); }).find("is read outside its hooks"),
                  std::string::npos)
            << at;

        // The optimizer's part: this rank's masters updated in place.
        for (size_t slot = 0; slot < s.size(); ++slot) {
          int64_t first = 0;
          const std::span<const float> piece = s.own_piece(slot, &first);
          if (piece.empty()) continue;
          float* master = s.mutable_master(slot, first);
          for (size_t k = 0; k < piece.size(); ++k) master[k] = updated(master[k]);
        }
        const size_t table = s.slot("model.embed_tokens.weight");
        const std::vector<int32_t> one = {0};
        EXPECT_NE(testing::error_of([&] { s.rows(table, one, false); }).find("before after_update"), std::string::npos)
            << at;
        const uint64_t before = s.traffic().bytes_received;
        s.after_update();
        EXPECT_EQ(s.traffic().bytes_received - before, static_cast<uint64_t>((total - mine.size()) * kB)) << at;
        expect_working(updated, "updated");

        // The gradients: the replicated store's whole arena under optimizer (step.cpp reduce-scatters it), the
        // rank's slice under gradients.
        s.allocate_grads();
        EXPECT_EQ(s.flat(model::Role::Grads).size(),
                  static_cast<size_t>(mode == ShardedStore::Mode::Optimizer ? total : mine.size()))
            << at;
        EXPECT_EQ(s.grads_begin(), mode == ShardedStore::Mode::Optimizer ? 0 : mine.begin) << at;
      });
    }
  }
}

// model.param_dtype = bfloat16 with the masters in the shards (optimizer, gradients): the checkpoint holds the float32
// masters, each tensor gathered from its owners while it is written, and resumes anywhere. Saved at N = 2 (dp 2) under
// gradients at step 2, it resumes there with the uninterrupted run's bits; at N = 3 (cp 3) under optimizer and at
// N = 1 under gradients, with the bits of shard none resumed from the same checkpoint at that grid (losses, norms,
// validation losses, the final masters, the written model file and the moments).
TEST(ParamDtype, Bf16ShardedMastersResumeAcrossModesAndRankCounts) {
  const fs::path dir = scratch("param_bf16_reshard");
  const auto config = [&](std::vector<std::string> sets, const std::string& name) {
    sets.insert(sets.end(), {"train.steps=4", "checkpoint.every=2", "train.val_every=2", "model.param_dtype=bfloat16",
                             "checkpoint.dir=" + (dir / name).string()});
    return small("tiny_dense", sets);
  };
  const std::vector<std::string> dp2 = {"parallelism.dp=2", "train.micro_batch=2", "parallelism.shard=gradients"};
  const Trained whole = run(config(dp2, "dp2"));
  ASSERT_EQ(whole.steps.size(), 4u);
  TrainOptions resume;
  resume.resume = (dir / "dp2" / "step-00000002").string();
  const Trained again = run(config(dp2, "dp2_again"), resume);
  ASSERT_EQ(again.steps.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(again.steps[i].loss, whole.steps[i + 2].loss) << "step " << i + 3;
    EXPECT_EQ(again.steps[i].grad_norm, whole.steps[i + 2].grad_norm) << "step " << i + 3;
    EXPECT_EQ(again.steps[i].val_loss, whole.steps[i + 2].val_loss) << "step " << i + 3;
  }
  EXPECT_EQ(flat_params(*again.model), flat_params(*whole.model));
  const std::vector<std::pair<std::string, std::string>> elsewhere = {{"parallelism.cp=3", "optimizer"},
                                                                      {"parallelism.cp=1", "gradients"}};
  for (const auto& [grid, mode] : elsewhere) {
    const std::string what = grid + ", shard " + mode;
    const Trained none = run(config({grid, "train.micro_batch=4", "parallelism.shard=none"}, grid + "none"), resume);
    const Trained sharded =
        run(config({grid, "train.micro_batch=4", "parallelism.shard=" + mode}, grid + mode), resume);
    ASSERT_EQ(none.steps.size(), 2u) << what;
    ASSERT_EQ(sharded.steps.size(), 2u) << what;
    expect_same_bits(none, sharded, what);
  }
  fs::remove_all(dir);
}

// The "same bits as shard none" grids, in process on loopback ranks: every shard mode against shard none at the same
// grid, 3 steps of a global batch of 12 rows (tests/trainer/same_bits_shard_mpirun.sh runs the same checks on one
// grid under a real mpirun, once per mode). shard optimizer gives none's bits: every loss, gradient norm and
// validation loss, the checkpoint's weights byte for byte and its AdamW moments value for value. shard full gives
// shard gradients' bits (the same sums added in the same order). With one micro-batch a replica (kBits) gradients
// gives none's bits too; with gradient accumulation (kRounding) it reduces each micro-batch where none reduces their
// sum, so it is held to rounding: every weight of the final checkpoint within 9e-5 (1% of the 3 steps' lr 0.003:
// AdamW normalises an element's update to about lr, and an element whose micro-batches nearly cancel may move by a
// fraction of it; ShardGradients.* above says more), and losses, norms and validation losses within 1e-4 relative:
// from step 2 on they are computed on weights that already differ by up to that 9e-5, and the mock rows' step-3
// gradient norm was measured 2.3e-5 apart (a broken reduction or gather moves them by whole percents).
struct ShardGridCase {
  std::string name;
  bool bits;  // one micro-batch a replica: shard gradients gives none's bits (else: rounding)
  std::vector<std::string> sets;
};

// The case's name, for the test's name and its failure messages (gtest otherwise prints the struct's bytes).
void PrintTo(const ShardGridCase& c, std::ostream* os) { *os << c.name; }

class ShardGrid : public ::testing::TestWithParam<ShardGridCase> {};

TEST_P(ShardGrid, EveryModeTrainsAsShardNone) {
  constexpr double kLossRel = 1e-4, kWeightAbs = 9e-5;  // the rounding bounds above
  const ShardGridCase& c = GetParam();
  const fs::path dir = scratch("shard_grid_" + c.name);
  std::map<std::string, Trained> runs;
  for (const std::string mode : {"none", "optimizer", "gradients", "full"}) {
    std::vector<std::string> sets = {"train.seq_len=64",   "train.steps=3",           "train.global_batch=12",
                                     "data.val_rows=2",    "train.threads=1",         "train.val_every=2",
                                     "optimizer.lr=0.003", "schedule.warmup_steps=1", "optimizer.grad_clip=0.5"};
    sets.insert(sets.end(), c.sets.begin(), c.sets.end());
    sets.insert(sets.end(), {"parallelism.shard=" + mode, "checkpoint.dir=" + (dir / mode).string()});
    runs[mode] = run(parse_config("", "test", sets));
    ASSERT_EQ(runs[mode].steps.size(), 3u) << mode;
  }
  const fs::path none = runs["none"].last_checkpoint, optimizer = runs["optimizer"].last_checkpoint;
  const fs::path gradients = runs["gradients"].last_checkpoint, full = runs["full"].last_checkpoint;
  const auto same_steps = [&](const std::string& a, const std::string& b) {
    for (size_t s = 0; s < 3; ++s) {
      EXPECT_EQ(runs[b].steps[s].loss, runs[a].steps[s].loss) << b << " against " << a << ", step " << s + 1;
      EXPECT_EQ(runs[b].steps[s].grad_norm, runs[a].steps[s].grad_norm) << b << " against " << a << ", step " << s + 1;
      EXPECT_EQ(runs[b].steps[s].val_loss, runs[a].steps[s].val_loss) << b << " against " << a << ", step " << s + 1;
    }
  };
  // The moments of two checkpoints, equal value for value: none's optimizer.safetensors (per parameter) against a
  // sharded run's optimizer.json and one file a rank, or byte for byte against a sharded run's optimizer.safetensors
  // (experts held apart, parallelism.ep > 1: the writer gathers the moments whole).
  const auto same_moments = [&](const std::string& sharded) {
    const fs::path ck = runs[sharded].last_checkpoint;
    if (!fs::exists(ck / "optimizer.json")) {
      EXPECT_EQ(file_bytes(ck / "optimizer.safetensors"), file_bytes(none / "optimizer.safetensors")) << sharded;
    } else {
      EXPECT_EQ(moments_of(ck, runs[sharded].model->params()), moments_of(none, runs["none"].model->params()))
          << sharded;
    }
  };
  same_steps("none", "optimizer");
  EXPECT_EQ(file_bytes(optimizer / "model.safetensors"), file_bytes(none / "model.safetensors"));
  same_moments("optimizer");
  // shard full: shard gradients' losses, norms and checkpoint bytes, every file of them.
  for (const auto& entry : fs::directory_iterator(gradients)) {
    const std::string file = entry.path().filename().string();
    if (file == "model.safetensors" || (file.starts_with("optimizer") && file.ends_with(".safetensors"))) {
      EXPECT_EQ(file_bytes(full / file), file_bytes(entry.path())) << file;
    }
  }
  same_steps("gradients", "full");
  // The exposed communication: a wait time, reported by the sharded modes only.
  for (size_t s = 0; s < 3; ++s) {
    EXPECT_FALSE(runs["none"].steps[s].shard_comm_wait_s.has_value());
    for (const std::string mode : {"gradients", "full"}) {
      ASSERT_TRUE(runs[mode].steps[s].shard_comm_wait_s.has_value()) << mode;
      EXPECT_GE(*runs[mode].steps[s].shard_comm_wait_s, 0.0) << mode;
    }
  }
  if (c.bits) {
    EXPECT_EQ(file_bytes(gradients / "model.safetensors"), file_bytes(none / "model.safetensors"));
    same_moments("gradients");
    same_steps("none", "gradients");
  } else {
    for (size_t s = 0; s < 3; ++s) {
      const StepMetrics &a = runs["none"].steps[s], &b = runs["gradients"].steps[s];
      EXPECT_NEAR(b.loss, a.loss, kLossRel * std::abs(a.loss)) << "step " << s + 1;
      EXPECT_NEAR(b.grad_norm, a.grad_norm, kLossRel * std::abs(a.grad_norm)) << "step " << s + 1;
      ASSERT_EQ(b.val_loss.has_value(), a.val_loss.has_value()) << "step " << s + 1;
      if (a.val_loss) {
        EXPECT_NEAR(*b.val_loss, *a.val_loss, kLossRel * std::abs(*a.val_loss)) << "step " << s + 1;
      }
    }
    const io::SafetensorsFile x = io::SafetensorsFile::open((none / "model.safetensors").string());
    const io::SafetensorsFile y = io::SafetensorsFile::open((gradients / "model.safetensors").string());
    ASSERT_EQ(x.tensors().size(), y.tensors().size());
    double worst = 0.0;
    for (size_t t = 0; t < x.tensors().size(); ++t) {
      const io::TensorView &a = x.tensors()[t], &b = y.tensors()[t];
      ASSERT_EQ(a.name, b.name);
      if (a.dtype != io::StDType::F32) continue;
      ASSERT_EQ(a.bytes.size(), b.bytes.size()) << a.name;
      std::vector<float> u(a.bytes.size() / sizeof(float)), v(u.size());
      std::memcpy(u.data(), a.bytes.data(), a.bytes.size());
      std::memcpy(v.data(), b.bytes.data(), b.bytes.size());
      for (size_t k = 0; k < u.size(); ++k) worst = std::max(worst, std::abs(static_cast<double>(u[k]) - v[k]));
    }
    EXPECT_LE(worst, kWeightAbs) << "weights of shard gradients against none";
  }
  fs::remove_all(dir);
}

// Dense over dp 3 (the trainable count does not divide by 3) and the MoE VLM over cp 2 x dp 2 with frozen parameters,
// accumulating micro-batches; model.train_vision under every shard mode (the tower's parameters are a sharded store's
// pieces, its gradients reduced into their owners' slices after the decoder's run) at N = 1, 2 (cp 2: the tower's
// work split) and 3 (dp 3: replicas whose rows hold no image join the reduction with zeros), one micro-batch a
// replica; with held experts (ep 2: the tower's parameters in the held experts' inner store) over cp 2 (one
// replica) and dp 2 (one micro-batch a replica); and model.param_dtype = bfloat16 (bf16 working weights, float32
// masters) with one micro-batch a replica, dense alone and over dp 3. Under mpirun instead: the MoE VLM over
// cp 2 x dp 2 x ep 2, and in bfloat16 over cp 2.
INSTANTIATE_TEST_SUITE_P(
    SameBitsAsShardNone, ShardGrid,
    ::testing::Values(ShardGridCase{"dense_dp3", false, {"model.builtin=tiny_dense", "parallelism.dp=3"}},
                      ShardGridCase{"moe_cp2_dp2",
                                    false,
                                    {"model.builtin=tiny_moe_vlm", "parallelism.cp=2", "parallelism.dp=2",
                                     "model.freeze=[embed_tokens, experts]"}},
                      ShardGridCase{"vision_n1",
                                    true,
                                    {"model.builtin=tiny_dense", "model.train_vision=true", "train.global_batch=1"}},
                      ShardGridCase{"vision_n2",
                                    true,
                                    {"model.builtin=tiny_dense", "model.train_vision=true", "parallelism.cp=2",
                                     "train.global_batch=1"}},
                      ShardGridCase{"vision_n3",
                                    true,
                                    {"model.builtin=tiny_dense", "model.train_vision=true", "parallelism.dp=3",
                                     "train.global_batch=3"}},
                      ShardGridCase{"vision_ep2_cp2",
                                    true,
                                    {"model.builtin=tiny_moe_vlm", "model.train_vision=true", "parallelism.cp=2",
                                     "parallelism.ep=2", "train.global_batch=1"}},
                      ShardGridCase{"vision_ep2_dp2",
                                    true,
                                    {"model.builtin=tiny_moe_vlm", "model.train_vision=true", "parallelism.dp=2",
                                     "parallelism.ep=2", "train.global_batch=2"}},
                      ShardGridCase{"param_bf16_dense_n1",
                                    true,
                                    {"model.builtin=tiny_dense", "train.global_batch=1", "model.param_dtype=bfloat16"}},
                      ShardGridCase{"param_bf16_dense_dp3",
                                    true,
                                    {"model.builtin=tiny_dense", "parallelism.dp=3", "train.global_batch=3",
                                     "model.param_dtype=bfloat16"}}),
    [](const ::testing::TestParamInfo<ShardGridCase>& param) { return param.param.name; });

}  // namespace
}  // namespace rf::trainer
