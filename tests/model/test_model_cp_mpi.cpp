// The Gemma 4 model under context parallelism, under a real `mpirun -n P` (CTest runs it at P = 1, 2, 3, 4, 8).
//
// Oracle: every rank also runs the same model on the whole batch in-process with the local kernels
// (rf::cpu::LocalAttention, P = 1) and compares, against it, the CP run's loss, label count, its own tokens' logits
// and token losses (placed by the shard's positions), every parameter gradient and d image_features after the
// rank-ordered reduction over the ranks (comm::Communicator::allreduce). Configs: dense (k_eq_v, vision-bidirectional
// groups), MoE with an untied head, the small variant (per-layer embeddings, KV sharing, double-wide MLP, image
// projection), and GQA 16:1 with head dims 72 and 512; rows of awkward length (S not divisible by P or by the
// 64-token plan block; one-token documents, image groups crossing shard boundaries, trailing padding, whole ranks of
// sharding padding at large P), B = 2.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/mpi_world.h"
#include "common/row_arrays.h"
#include "core/error.h"
#include "cp/cp_backend.h"
#include "cpu/isa.h"
#include "cpu/local_attention.h"
#include "model/multimodal.h"
#include "model/run_grads.h"

namespace rf::model {
namespace {

comm::Communicator& world() { return testing::mpi_world(); }

constexpr int kVocab = 40;

// A tiny config.json (the shapes of tests/model/test_model_grad.cpp); `extra` switches parts on. GQA 2:1 on sliding
// layers and 4:1 on full ones, D = 8 and 16, window 3.
std::string tiny_config(const std::string& extra) {
  return R"({"vocab_size": 40, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 3,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    "per_layer_config": {"1": {"head_dim": 16, "num_key_value_heads": 1}, "3": {"head_dim": 16, "num_key_value_heads": 1}},
    "final_logit_softcapping": 4.0, "hidden_size_per_layer_input": 0, "rms_norm_eps": 1e-6)" +
         extra + "}";
}

const std::string kDense = R"(, "attention_k_eq_v": true, "use_bidirectional_attention": "vision")";
const std::string kMoe = R"(, "attention_k_eq_v": true, "enable_moe_block": true, "num_experts": 4,
    "top_k_experts": 2, "moe_intermediate_size": 8, "tie_word_embeddings": false)";
const std::string kSmall = R"(, "hidden_size_per_layer_input": 4, "vocab_size_per_layer_input": 40,
    "num_kv_shared_layers": 2, "use_double_wide_mlp": true)";

Gemma4Multimodal make_model(const std::string& extra, int vision_dim) {
  Gemma4Multimodal m(Gemma4Config::from_json(tiny_config(extra)), MultimodalParts{vision_dim});
  constexpr float kInitStd = 0.3f;  // every path (norm scales, router, softcap) carries an O(1) signal
  m.init_random(42, kInitStd);
  // Scale-1 attention on RMS-normed q/k: norm scales of D^-1/4 keep the logits O(1) (test_model_grad.cpp).
  for (size_t slot = 0; slot < m.params().size(); ++slot) {
    const ParamInfo& t = m.params().info(slot);
    if (!t.name.ends_with("q_norm.weight") && !t.name.ends_with("k_norm.weight")) continue;
    float* w = m.params().mutable_weight(slot);
    for (int64_t e = 0; e < t.numel; ++e) w[e] *= std::pow(static_cast<float>(t.shape[0]), -0.25f);
  }
  return m;
}

using testing::RowArrays;

// Row 0: packed documents of 1, 7, 1, 11, ... tokens (one-token ones included) with a 5-token image at the start of
// every other document; row 1: one document with 4-token video runs every 9 tokens, the last 20% padding. Labels
// -100 on every third token and on padding. Image runs are longer than the window (3), so groups matter.
RowArrays make_batch(int S, int feature_dim, uint64_t seed) {
  RowArrays t;
  t.S = S;
  std::mt19937 rng(static_cast<uint32_t>(seed));
  const int doc_lengths[] = {1, 7, 1, 11, 2, 16, 9};
  int d = 1, left = doc_lengths[0], in_doc = 0;
  for (int s = 0; s < S; ++s) {
    if (left == 0) {
      ++d;
      left = doc_lengths[(d - 1) % 7];
      in_doc = 0;
    }
    t.doc.push_back(d);
    t.mm.push_back(d % 2 == 0 && in_doc < 5 && left > 1 ? 1 : 0);
    t.pos.push_back(in_doc++);
    --left;
  }
  const int padded_from = S - S / 5;
  for (int s = 0; s < S; ++s) {
    const bool pad = s >= padded_from;
    t.doc.push_back(pad ? 0 : 1);
    t.mm.push_back(!pad && s % 9 >= 2 && s % 9 < 6 ? 2 : 0);
    t.pos.push_back(s);
  }
  for (int i = 0; i < 2 * S; ++i) {
    t.ids.push_back(1 + static_cast<int32_t>(rng() % (kVocab - 1)));
    const bool ignored = i % 3 == 2 || t.doc[i] == 0;
    t.labels.push_back(ignored ? -100 : static_cast<int32_t>(rng() % kVocab));
  }
  std::normal_distribution<float> normal(0.f, 1.f);
  for (int32_t m : t.mm)
    if (m != 0) {
      for (int f = 0; f < feature_dim; ++f) t.features.push_back(normal(rng));
    }
  return t;
}

// ||a - b|| / ||b||, in double.
double relative_error(const float* a, const float* b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    num += (double{a[i]} - b[i]) * (double{a[i]} - b[i]);
    den += double{b[i]} * b[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// The bound. The CP run computes the same float32 operations as the P = 1 run, only grouped differently: attention
// merges partial softmaxes per key chunk (rf::merge_partial) instead of one pass, each rank's parameter gradient
// sums its own tokens and the ranks' partial sums are added in double, and MoE experts batch different token
// sets. Each regrouping is float32 rounding (~6e-8 relative per op) amplified through 4 layers forward and
// backward; the two runs are each within ~3e-5 of float64 (tests/model/parity.py measures ringflex's float32
// against transformers' float64), so per tensor their distance is bounded by 1e-4 in relative norm, and any
// wrong term (a token counted twice or missed, a wrong key range) shows up at 1e-2 or more.
constexpr double kRelTol = 1e-4;

struct Outcome {
  Result result;
  TensorSet grads;
};

Outcome run_cp(Gemma4Multimodal& m, const Batch& b, const std::string& scheme,
               ComputeDtype dtype = ComputeDtype::Float32) {
  cp::CpAttentionOptions o;
  o.scheme = scheme;
  cp::CpAttention attn(world(), o);
  RunOptions opt;
  opt.want_grad = true;
  opt.want_logits = true;
  opt.loss_chunk_tokens = 5;  // several loss chunks, one partial
  opt.compute_dtype = dtype;
  m.params().allocate_grads();
  m.params().zero_grads();
  Outcome out{m.run(b, opt, attn), {}};
  const std::span<float> grads = m.params().mutable_flat(Role::Grads);
  world().allreduce(grads.data(), grads.size(), comm::ReduceOp::Sum);
  out.grads = m.params().snapshot(Role::Grads);
  if (!out.result.d_image_features.empty())
    world().allreduce(out.result.d_image_features.data(), out.result.d_image_features.size(), comm::ReduceOp::Sum);
  return out;
}

void check_against_one_rank(Gemma4Multimodal& m, const Batch& b, const std::string& scheme, const std::string& what) {
  SCOPED_TRACE(what + ", scheme " + scheme + ", P = " + std::to_string(world().size()));
  RunOptions opt;
  opt.want_grad = true;
  opt.want_logits = true;
  opt.loss_chunk_tokens = 5;
  TensorSet ref_grads;
  const Result ref = run_with_grads(m, b, opt, ref_grads);  // P = 1, the whole batch, local kernels
  const Outcome cp = run_cp(m, b, scheme);
  const Result& r = cp.result;

  EXPECT_EQ(r.label_tokens, ref.label_tokens);
  EXPECT_NEAR(r.loss, ref.loss, kRelTol * std::fabs(ref.loss));
  // This rank's tokens against the same positions of the full run.
  const RowShard& sh = r.shard;
  ASSERT_EQ(sh.P, world().size());
  ASSERT_EQ(r.token_loss.size(), static_cast<size_t>(b.B) * sh.L);
  const int64_t V = m.config().vocab_size;
  std::vector<float> mine, theirs, loss_mine, loss_theirs;
  for (int row = 0; row < b.B; ++row)
    for (int j = 0; j < sh.L; ++j) {
      const int32_t p = sh.mine()[static_cast<size_t>(j)];
      const int64_t local = int64_t{row} * sh.L + j;
      if (sh.is_pad(p)) {
        EXPECT_EQ(r.token_loss[local], 0.f) << "sharding padding carries no loss";
        continue;
      }
      const int64_t global = int64_t{row} * b.S + p;
      if (b.doc[global] == 0) continue;  // the row's own padding: logits of a token that sees nothing are moot
      loss_mine.push_back(r.token_loss[local]);
      loss_theirs.push_back(ref.token_loss[global]);
      mine.insert(mine.end(), r.logits.begin() + local * V, r.logits.begin() + (local + 1) * V);
      theirs.insert(theirs.end(), ref.logits.begin() + global * V, ref.logits.begin() + (global + 1) * V);
    }
  EXPECT_LE(relative_error(mine.data(), theirs.data(), mine.size()), kRelTol) << "logits";
  EXPECT_LE(relative_error(loss_mine.data(), loss_theirs.data(), loss_mine.size()), kRelTol) << "token_loss";
  double worst = 0;
  for (size_t s = 0; s < ref_grads.size(); ++s) {
    const double err = relative_error(cp.grads[s].data.data(), ref_grads[s].data.data(), ref_grads[s].data.size());
    EXPECT_LE(err, kRelTol) << "gradient of " << ref_grads[s].name;
    worst = std::max(worst, err);
  }
  int64_t pad_ranks = 0;  // ranks holding nothing but sharding padding
  for (const std::vector<int32_t>& pos : sh.positions)
    pad_ranks += std::all_of(pos.begin(), pos.end(), [&](int32_t p) { return sh.is_pad(p); });
  if (world().rank() == 0)
    std::printf("  %s, scheme %s, P = %d, L = %d, %lld all-padding ranks: worst gradient error %.2e\n", what.c_str(),
                scheme.c_str(), sh.P, sh.L, static_cast<long long>(pad_ranks), worst);
  ASSERT_EQ(r.d_image_features.size(), ref.d_image_features.size());
  if (!ref.d_image_features.empty()) {
    EXPECT_LE(relative_error(r.d_image_features.data(), ref.d_image_features.data(), ref.d_image_features.size()),
              kRelTol)
        << "d image_features";
  }
}

// S = 9: at P = 4 and 8 some ranks hold only sharding padding.
constexpr int kTinyRow = 9;
// S = 37: not divisible by 2, 3, 4 or 8, and short enough that at P = 8 the balanced deal's blocks are a few tokens.
constexpr int kShortRow = 37;
// S = 301: several 64-token plan blocks per rank at P <= 2, documents and images crossing block boundaries.
constexpr int kLongRow = 301;

TEST(ModelCp, DenseWithImageGroupsMatchesOneRank) {
  Gemma4Multimodal m = make_model(kDense, 0);
  for (int S : {kTinyRow, kShortRow, kLongRow}) {
    const RowArrays b = make_batch(S, m.config().hidden_size, 3);
    check_against_one_rank(m, b.view(true), "balanced", "dense, S = " + std::to_string(S));
  }
}

TEST(ModelCp, FixedSchemesMatchOneRank) {
  Gemma4Multimodal m = make_model(kDense, 0);
  for (int S : {kTinyRow, kLongRow}) {
    // Contiguous shards of the 9-token row leave the last ranks nothing but sharding padding at P = 8.
    const RowArrays b = make_batch(S, m.config().hidden_size, 4);
    for (const char* scheme : {"contiguous", "zigzag"})
      check_against_one_rank(m, b.view(true), scheme, "dense, S = " + std::to_string(S));
  }
}

TEST(ModelCp, MixtureOfExpertsMatchesOneRank) {
  Gemma4Multimodal m = make_model(kMoe, 0);
  const RowArrays b = make_batch(kShortRow, 0, 5);
  check_against_one_rank(m, b.view(false), "balanced", "moe");
}

TEST(ModelCp, PerLayerEmbeddingsKvSharingAndImageProjectionMatchOneRank) {
  constexpr int kFeatureDim = 6;
  Gemma4Multimodal m = make_model(kSmall, kFeatureDim);
  const RowArrays b = make_batch(kShortRow, kFeatureDim, 6);
  check_against_one_rank(m, b.view(true), "balanced", "small");
}

// GQA 16:1 with awkward head dims: D = 72 on sliding layers (not a power of two) and 512 (the kernels' largest,
// Gemma 4's global head dim) on full ones.
TEST(ModelCp, Gqa16AndHeadDims72And512MatchOneRank) {
  const std::string wide = R"({"vocab_size": 40, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
    "num_attention_heads": 16, "num_key_value_heads": 1, "head_dim": 72, "sliding_window": 3,
    "layer_types": ["sliding_attention", "full_attention"],
    "per_layer_config": {"1": {"head_dim": 512, "num_key_value_heads": 1}},
    "final_logit_softcapping": 4.0, "hidden_size_per_layer_input": 0, "rms_norm_eps": 1e-6,
    "use_bidirectional_attention": "vision"})";
  Gemma4Multimodal m(Gemma4Config::from_json(wide));
  constexpr float kInitStd = 0.3f;
  m.init_random(43, kInitStd);
  for (size_t slot = 0; slot < m.params().size(); ++slot) {
    const ParamInfo& t = m.params().info(slot);
    if (!t.name.ends_with("q_norm.weight") && !t.name.ends_with("k_norm.weight")) continue;
    float* w = m.params().mutable_weight(slot);
    for (int64_t e = 0; e < t.numel; ++e) w[e] *= std::pow(static_cast<float>(t.shape[0]), -0.25f);
  }
  const RowArrays b = make_batch(kShortRow, m.config().hidden_size, 10);
  check_against_one_rank(m, b.view(true), "balanced", "GQA 16:1, D = 72 / 512");
}

// Issue 8 item 13: the loss is divided by the label tokens of the whole batch counted once. Counting per rank and
// summing would give P times the count (every rank holds the full labels), and the loss 1/P of the right one.
TEST(ModelCp, LabelTokensCountedOnce) {
  Gemma4Multimodal m = make_model(kDense, 0);
  const RowArrays rb = make_batch(kShortRow, 0, 7);
  const Batch b = rb.view(false);
  int64_t expected = 0;
  for (int32_t l : rb.labels) expected += l != -100;
  cp::CpAttention attn(world());
  const Result r = m.run(b, RunOptions{}, attn);
  EXPECT_EQ(r.label_tokens, expected);
  // Independent of the split: the sum of this rank's token losses, summed over ranks, over the hand count.
  double local = 0;
  for (float x : r.token_loss) local += x;
  world().allreduce(&local, 1, comm::ReduceOp::Sum);
  EXPECT_NEAR(r.loss, local / static_cast<double>(expected), 1e-6 * std::fabs(r.loss))
      << "float32 token losses summed in double: 1e-6 relative is far above their rounding and far below 1/P";
  // An explicit normaliser (the trainer's global batch count) replaces the denominator on every rank.
  RunOptions with_normalizer;
  with_normalizer.loss_normalizer = 2.0 * static_cast<double>(expected);
  cp::CpAttention attn2(world());
  const Result half = m.run(b, with_normalizer, attn2);
  EXPECT_NEAR(half.loss, r.loss / 2, 1e-6 * std::fabs(r.loss)) << "same sums, one rounding of the scale apart";
}

// Issue 8 item 14: two runs at the same P give the same bits (loss, logits, every reduced gradient).
TEST(ModelCp, GradientsAreDeterministic) {
  Gemma4Multimodal m = make_model(kMoe, 0);
  const RowArrays rb = make_batch(kShortRow, 0, 8);
  const Outcome a = run_cp(m, rb.view(false), "balanced"), b = run_cp(m, rb.view(false), "balanced");
  EXPECT_EQ(a.result.loss, b.result.loss);
  EXPECT_EQ(a.result.logits, b.result.logits);
  for (size_t s = 0; s < a.grads.size(); ++s) EXPECT_EQ(a.grads[s].data, b.grads[s].data) << a.grads[s].name;
}

// The bf16 training step under CP (RunOptions::compute_dtype = Bfloat16: bf16 matmuls, and attention on the CP
// engine with q, k, v and dout in the storage attention_dtype chooses: bf16 on the bf16 kernels where this CPU has
// bf16 units that pay) against the float32 step on one rank. The bound is test_model_bf16.cpp's, for this config:
// each bf16 product in the chain from the input to the loss perturbs it by at most 2^-8 relative (two operands
// rounded to 2^-9 each; attention's P rounded to 2^-8 on bf16 units), and the chain crosses kBf16Chain of them: per
// layer q/k/v -> q.k -> P V -> o_proj and gate/up -> down (6), 4 layers, and the head (25). So |d loss| <=
// kBf16Chain 2^-8 max|logit| (the loss is 1-Lipschitz in the logits' max norm), and each gradient, crossing the chain
// twice, within 2 kBf16Chain 2^-8 relative (~0.2). CP's regrouping adds float32 rounding (kRelTol), far below it. A
// bf16 tensor read as float32, a shard's dout in the wrong dtype, or a missing term gives O(1) differences.
constexpr int kBf16Chain = 25;

TEST(ModelCp, Bf16StepNearFloat32OneRank) {
  try {
    cpu::kernel_path();
  } catch (const Error& e) {
    GTEST_SKIP() << e.what();  // RINGFLEX_ISA names a path this CPU lacks (CTest's forced runs)
  }
  Gemma4Multimodal m = make_model(kDense, 0);
  const RowArrays rb = make_batch(kLongRow, m.config().hidden_size, 11);
  const Batch b = rb.view(true);
  RunOptions opt;
  opt.want_grad = true;
  opt.want_logits = true;
  opt.loss_chunk_tokens = 5;
  TensorSet ref_grads;
  const Result ref = run_with_grads(m, b, opt, ref_grads);  // float32, P = 1
  const Outcome bf = run_cp(m, b, "balanced", ComputeDtype::Bfloat16);
  if (world().rank() == 0)
    std::printf("  bf16 attention storage: %s (%s)\n",
                std::string(dtype_name(attention_dtype(ComputeDtype::Bfloat16))).c_str(),
                cpu::describe(cpu::kernel_path()).c_str());
  double max_logit = 0;
  for (float z : ref.logits) max_logit = std::max(max_logit, std::fabs(double{z}));
  const double bf16_unit = std::ldexp(1.0, -9);
  EXPECT_NEAR(bf.result.loss, ref.loss, kBf16Chain * 2 * bf16_unit * max_logit);
  EXPECT_NE(bf.result.loss, ref.loss) << "the bf16 step computed in float32";
  const double grad_bound = 2 * kBf16Chain * 2 * bf16_unit;
  double worst = 0;
  for (size_t s = 0; s < ref_grads.size(); ++s) {
    const double err = relative_error(bf.grads[s].data.data(), ref_grads[s].data.data(), ref_grads[s].data.size());
    EXPECT_LE(err, grad_bound) << "gradient of " << ref_grads[s].name;
    worst = std::max(worst, err);
  }
  if (world().rank() == 0)
    std::printf("  bf16 step, P = %d: loss %.6f against float32 %.6f, worst gradient error %.3e (bound %.3e)\n",
                world().size(), bf.result.loss, ref.loss, worst, grad_bound);
}

// More ranks than tokens: the same one-line error on every rank, before any collective (so nobody waits).
TEST(ModelCp, MoreRanksThanTokensFailsOnEveryRank) {
  const int P = world().size();
  if (P < 2) GTEST_SKIP() << "needs two ranks";
  Gemma4Multimodal m = make_model(kDense, 0);
  const RowArrays rb = make_batch(P - 1, 0, 9);
  cp::CpAttention attn(world());
  try {
    m.run(rb.view(false), RunOptions{}, attn);
    ADD_FAILURE() << "P > S must fail";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "batch: context parallelism over " + std::to_string(P) + " ranks needs at least " +
                                         std::to_string(P) + " tokens per row, the batch's rows have " +
                                         std::to_string(P - 1));
  }
  world().barrier();  // every rank got here: nobody is stuck in a collective
}

}  // namespace
}  // namespace rf::model

namespace rf::model {
namespace {

// The tile race (cpu/isa.h) is a timing each rank would run alone; before any test the ranks agree on the slowest
// result, as the CLI does, so a job never splits over two bf16 paths (the CP header would reject the mixed dtypes).
class AgreedTileRace : public ::testing::Environment {
 public:
  void SetUp() override {
    double race = cpu::needs_tile_race(cpu::detect_cpu(), std::getenv(cpu::kIsaEnv))
                      ? cpu::bf16_tile_race()
                      : std::numeric_limits<double>::infinity();
    world().allreduce(&race, 1, comm::ReduceOp::Min);
    cpu::set_tile_race([race] { return race; });
  }
};

}  // namespace
}  // namespace rf::model

int main(int argc, char** argv) {
  ::testing::AddGlobalTestEnvironment(new rf::model::AgreedTileRace);  // gtest owns it
  return rf::testing::run_mpi_tests(argc, argv);
}
