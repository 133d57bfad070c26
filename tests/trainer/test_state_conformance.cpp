// The training states' conformance suite (trainer/state/, docs/parallel-state.md): one table of modes, every case run
// over every mode, as tests/comm runs every backend over the same cases (nccl-tests' pattern). Ranks are loopback
// threads in this process; one micro-batch a rank a step, so the sharded modes promise shard none's bits (with
// accumulation shard gradients and full reassociate the sums, docs/parallel-state.md).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <ostream>

#include <nlohmann/json.hpp>

#include "comm/loopback_comm.h"
#include "core/memory.h"
#include "model/builtin_configs.h"
#include "model/multimodal.h"
#include "trainer/plan.h"
#include "trainer/state/state.h"
#include "trainer/trainer.h"

namespace rf::trainer {
namespace {

namespace fs = std::filesystem;

struct Mode {
  std::string name;               // the test's name
  std::vector<std::string> sets;  // the config's fields beyond the base
  std::vector<std::string> ref;   // the reference's fields in place of `sets`; empty: the mode is a reference
};

// gtest names a parameter by this (the test lists show the mode, not its bytes).
void PrintTo(const Mode& m, std::ostream* os) { *os << m.name; }

// Every mode of trainer/state/ at two ranks: the replicated state (none, optimizer), the sharded one (gradients,
// full, optimizer with bf16 working weights), held experts (none, optimizer, full) and LoRA (none, optimizer with
// the experts' adapters placed); and with model.train_vision, the tower's parameters store slots of their own groups
// (model::tower_group): float32 under gradients and full against none, bf16 working weights under optimizer,
// gradients and full against bf16 none.
std::vector<Mode> modes() {
  const std::vector<std::string> moe = {"model.builtin=tiny_moe_vlm", "model.init_std=0.4", "parallelism.ep=2"};
  const auto with = [](std::vector<std::string> a, const std::vector<std::string>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  const std::vector<std::string> tower_bf16 = {"model.train_vision=true", "model.param_dtype=bfloat16"};
  const std::vector<std::string> lora_moe =
      with(moe, {"model.lora.rank=4", "model.lora.target_parameters=[experts.gate_up_proj]"});
  return {
      {"ReplicatedNone", {"parallelism.shard=none"}, {}},
      {"ReplicatedOptimizer", {"parallelism.shard=optimizer"}, {"parallelism.shard=none"}},
      {"ShardedGradients", {"parallelism.shard=gradients"}, {"parallelism.shard=none"}},
      {"ShardedFull", {"parallelism.shard=full"}, {"parallelism.shard=none"}},
      {"ShardedOptimizerBf16",
       {"parallelism.shard=optimizer", "model.param_dtype=bfloat16"},
       {"parallelism.shard=none", "model.param_dtype=bfloat16"}},
      {"HeldExpertsNone", with(moe, {"parallelism.shard=none"}), {}},
      {"HeldExpertsOptimizer", with(moe, {"parallelism.shard=optimizer"}), with(moe, {"parallelism.shard=none"})},
      {"HeldExpertsFull", with(moe, {"parallelism.shard=full"}), with(moe, {"parallelism.shard=none"})},
      {"TowerNone", {"model.train_vision=true", "parallelism.shard=none"}, {}},
      {"TowerGradients", {"model.train_vision=true", "parallelism.shard=gradients"}, {"model.train_vision=true"}},
      {"TowerFull", {"model.train_vision=true", "parallelism.shard=full"}, {"model.train_vision=true"}},
      {"TowerBf16None", with(tower_bf16, {"parallelism.shard=none"}), {}},
      {"TowerBf16Optimizer", with(tower_bf16, {"parallelism.shard=optimizer"}), tower_bf16},
      {"TowerBf16Gradients", with(tower_bf16, {"parallelism.shard=gradients"}), tower_bf16},
      {"TowerBf16Full", with(tower_bf16, {"parallelism.shard=full"}), tower_bf16},
      {"LoraNone", {"model.lora.rank=4", "parallelism.shard=none"}, {}},
      {"LoraPlacedOptimizer", with(lora_moe, {"parallelism.shard=optimizer"}),
       with(lora_moe, {"parallelism.shard=none"})},
  };
}

TrainConfig config(const std::vector<std::string>& sets, const fs::path& dir) {
  std::vector<std::string> base = {"model.builtin=tiny_dense", "train.seq_len=64",   "train.global_batch=2",
                                   "parallelism.dp=2",         "train.steps=3",      "train.threads=1",
                                   "data.val_rows=0",          "optimizer.lr=0.003", "model.init_std=0.1",
                                   "checkpoint.every=2",       "checkpoint.keep=5",  "checkpoint.dir=" + dir.string()};
  base.insert(base.end(), sets.begin(), sets.end());
  return parse_config("", "test", base);
}

struct Trained {
  std::vector<StepMetrics> steps;
  std::string last_checkpoint;
  // Rank 0's store after the run, by role: what its mode allocated (elements).
  size_t grads = 0, moments = 0;
};

Trained run(const TrainConfig& c, const std::string& resume = "") {
  TrainOptions opt;
  opt.progress = nullptr;
  opt.resume = resume;
  Trained out;
  std::mutex mu;
  validate(c, 2);
  comm::run_ranks(2, [&](comm::Communicator& world) {
    TrainResult r = train(c, world, opt);
    if (world.rank() != 0) return;
    std::lock_guard lock(mu);
    out.steps = r.steps;
    out.last_checkpoint = r.last_checkpoint;
    const model::ParamStore& s = r.model->params();
    out.grads = s.flat(model::Role::Grads).size();
    out.moments = s.flat(model::Role::ExpAvg).size() + s.flat(model::Role::ExpAvgSq).size();
  });
  return out;
}

std::string file_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}

// Every file of a checkpoint directory but trainer_state.json (which records the run's config, its checkpoint.dir).
std::map<std::string, std::string> checkpoint_files(const fs::path& dir) {
  std::map<std::string, std::string> files;
  for (const fs::directory_entry& e : fs::directory_iterator(dir))
    if (e.path().filename() != "trainer_state.json") files[e.path().filename().string()] = file_bytes(e.path());
  return files;
}

fs::path scratch(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("rf_state_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p;
}

class StateConformance : public ::testing::TestWithParam<Mode> {};
class StateBits : public ::testing::TestWithParam<Mode> {};

// The modes compared with a reference (the references themselves are the other modes' oracle).
std::vector<Mode> referred_modes() {
  std::vector<Mode> out;
  for (const Mode& m : modes())
    if (!m.ref.empty()) out.push_back(m);
  return out;
}

// The same gradients give the reference state's update bits: every step's loss and norm, and the last checkpoint's
// files (weights and moments) byte for byte.
TEST_P(StateBits, SameUpdateBitsAsTheReferenceState) {
  const Mode& m = GetParam();
  const fs::path dir = scratch(m.name + "_bits");
  const Trained got = run(config(m.sets, dir / "mode"));
  const Trained want = run(config(m.ref, dir / "ref"));
  ASSERT_EQ(got.steps.size(), want.steps.size());
  for (size_t s = 0; s < want.steps.size(); ++s) {
    EXPECT_EQ(got.steps[s].loss, want.steps[s].loss) << m.name << ", step " << s + 1;
    EXPECT_EQ(got.steps[s].grad_norm, want.steps[s].grad_norm) << m.name << ", step " << s + 1;
  }
  // The weights' files alike; the moments' files differ in layout (one a rank under ZeRO), so the weights only.
  for (const char* f : {"model.safetensors", "adapter_model.safetensors"}) {
    const fs::path a = fs::path(got.last_checkpoint) / f, b = fs::path(want.last_checkpoint) / f;
    EXPECT_EQ(fs::exists(a), fs::exists(b)) << m.name << ": " << f;
    if (fs::exists(b)) {
      EXPECT_TRUE(file_bytes(a) == file_bytes(b)) << m.name << ": " << f;
    }
  }
  fs::remove_all(dir);
}

// Save then load round-trips: resumed from step 2's checkpoint, step 3 and its checkpoint are the uninterrupted run's
// bits.
TEST_P(StateConformance, SaveThenLoadRoundTrips) {
  const Mode& m = GetParam();
  const fs::path dir = scratch(m.name + "_resume");
  const Trained whole = run(config(m.sets, dir / "whole"));
  const Trained resumed = run(config(m.sets, dir / "resumed"), (dir / "whole" / "step-00000002").string());
  ASSERT_EQ(whole.steps.size(), 3u);
  ASSERT_EQ(resumed.steps.size(), 1u);
  EXPECT_EQ(resumed.steps[0].loss, whole.steps[2].loss) << m.name;
  EXPECT_EQ(resumed.steps[0].grad_norm, whole.steps[2].grad_norm) << m.name;
  const auto a = checkpoint_files(whole.last_checkpoint), b = checkpoint_files(resumed.last_checkpoint);
  EXPECT_FALSE(a.empty()) << m.name;
  EXPECT_TRUE(a == b) << m.name << ": step 3's checkpoint files differ after a resume";
  fs::remove_all(dir);
}

// The state's bytes by kind cover what its store allocated: rank 0's gradient arena and moments (rank 0 holds the
// largest, padded slice, as the figure counts it).
TEST_P(StateConformance, BytesCoverWhatItAllocates) {
  const Mode& m = GetParam();
  const fs::path dir = scratch(m.name + "_bytes");
  const TrainConfig c = config(m.sets, dir);
  const Trained got = run(c);
  // The shapes the memory check sees before anything is allocated (set_up's check_fits).
  const std::string text = model::builtin_config_json(c.model.builtin);
  const model::Gemma4Config mc = model::Gemma4Config::from_json(text, "builtin");
  const model::VisionConfig tower = model::VisionConfig::from_config_json(text, "builtin").value();
  const model::Gemma4Multimodal shapes(mc,
                                       model::MultimodalParts(model::kBuiltinFeatureDim, tower, c.model.train_vision),
                                       model::TensorSet::Storage::Deferred, nullptr);
  const detail::StateBytes b = detail::plan_state(c)->bytes(c, shapes, 2, 1);
  constexpr int64_t kF = sizeof(float);
  // Gradients: the arena at least (the sharded modes add the layer buffers their reductions send from).
  EXPECT_GE(b.terms.of("gradients"), static_cast<int64_t>(got.grads) * kF) << m.name;
  EXPECT_EQ(b.terms.of("AdamW moments"), static_cast<int64_t>(got.moments) * kF) << m.name;
  EXPECT_GT(b.terms.total(), 0) << m.name;
  fs::remove_all(dir);
}

// --stats, the memory check and `ringflex train --plan` give one figure, term for term: every mode, and the modes
// whose live store registers other slots than the model's own registry: held experts under shard gradients (the
// held store registers a rank's experts only; its token tables' rows were once counted as 0 bytes by --stats, where
// the check counted them) and LoRA over a base mapped from model.path (a LoRA store registers its adapters beside
// the base, which no file holds).
struct StatsCase {
  Mode mode;
  std::string mapped_base;  // the built-in model whose checkpoint (written by a first run) is model.path; empty: none
};
void PrintTo(const StatsCase& c, std::ostream* os) { *os << c.mode.name; }

std::vector<StatsCase> stats_cases() {
  std::vector<StatsCase> out;
  for (const Mode& m : modes()) out.push_back({m, ""});
  out.push_back(
      {{"HeldExpertsGradients",
        {"model.builtin=tiny_moe_vlm", "model.init_std=0.4", "parallelism.ep=2", "parallelism.shard=gradients"},
        {}},
       ""});
  out.push_back({{"LoraMappedBase", {"model.lora.rank=4", "parallelism.shard=none"}, {}}, "tiny_dense"});
  out.push_back({{"LoraMappedPlacedOptimizer",
                  {"parallelism.ep=2", "model.lora.rank=4", "model.lora.target_parameters=[experts.gate_up_proj]",
                   "parallelism.shard=optimizer"},
                  {}},
                 "tiny_moe_vlm"});
  return out;
}

class StateStats : public ::testing::TestWithParam<StatsCase> {};

TEST_P(StateStats, StatsAreTheChecksAndThePlansFigures) {
  const StatsCase& sc = GetParam();
  const std::string& name = sc.mode.name;
  const fs::path dir = scratch(name + "_stats");
  fs::create_directories(dir);
  std::vector<std::string> sets = sc.mode.sets;
  if (!sc.mapped_base.empty()) {
    // A one-step run's last checkpoint of the built-in (its weights float32 in model.safetensors).
    const TrainConfig base =
        config({"model.builtin=" + sc.mapped_base, "train.steps=1", "checkpoint.every=1"}, dir / "base");
    sets.insert(sets.end(), {"model.builtin=", "model.path=" + run(base).last_checkpoint});
  }
  sets.push_back("train.steps=1");
  const TrainConfig c = config(sets, dir / "run");
  validate(c, 2);
  TrainOptions opt;
  opt.progress = nullptr;
  opt.stats_path = (dir / "stats.json").string();
  comm::run_ranks(2, [&](comm::Communicator& world) { train(c, world, opt); });
  std::ifstream in(opt.stats_path);
  const nlohmann::json stats = nlohmann::json::parse(in);
  // The plan's row for this run's own layout, on this machine (the process's ranks on one node, as the check sees).
  PlanMachine machine;
  machine.ranks = 2;
  machine.ranks_per_node = std::min(local_ranks(), 2);
  machine.rank_bytes = int64_t{1} << 40;
  const Plan plan = plan_training(c, machine);
  const auto row = std::find_if(plan.rows.begin(), plan.rows.end(), [&](const PlanRow& r) {
    return r.cp == c.parallelism.cp && r.dp == c.parallelism.dp && r.ep == c.parallelism.ep &&
           r.shard == c.parallelism.shard && r.param_dtype == c.model.param_dtype && r.lora == (c.model.lora_rank != 0);
  });
  ASSERT_NE(row, plan.rows.end()) << name << ": no plan row for the run's layout";
  const nlohmann::json& terms = stats.at("memory_per_rank").at("terms");
  ASSERT_EQ(terms.size(), row->need.terms().size()) << name;
  for (size_t t = 0; t < terms.size(); ++t) {
    const MemoryBreakdown::Term& planned = row->need.terms()[t];
    EXPECT_EQ(terms[t].at("kind").get<std::string>(), planned.name) << name;
    EXPECT_EQ(terms[t].at("bytes").get<int64_t>(), planned.bytes) << name << ": " << planned.name;
  }
  EXPECT_EQ(stats.at("memory_per_rank").at("total_bytes").get<int64_t>(), row->need.total()) << name;
  fs::remove_all(dir);
}

const auto kModeName = [](const ::testing::TestParamInfo<Mode>& i) { return i.param.name; };
INSTANTIATE_TEST_SUITE_P(EveryMode, StateConformance, ::testing::ValuesIn(modes()), kModeName);
INSTANTIATE_TEST_SUITE_P(EveryMode, StateBits, ::testing::ValuesIn(referred_modes()), kModeName);
INSTANTIATE_TEST_SUITE_P(EveryMode, StateStats, ::testing::ValuesIn(stats_cases()),
                         [](const ::testing::TestParamInfo<StatsCase>& i) { return i.param.mode.name; });

}  // namespace
}  // namespace rf::trainer
