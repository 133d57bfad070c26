// Tests of the Gemma 4 decoder's backward: for every parameter tensor, the analytic gradient's projection on a
// random ±1 direction against a central finite difference of the loss along that direction, on tiny configs
// covering each part (sliding/full mix with k_eq_v, MoE, per-layer embeddings with KV sharing and the double-wide
// MLP, image features with their projection), with packed documents, image groups and padding.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/row_arrays.h"
#include "core/error.h"
#include "model/multimodal.h"
#include "model/run_grads.h"

namespace rf::model {
namespace {

// A tiny config.json; `extra` is spliced in to switch parts on.
std::string tiny_config(const std::string& extra) {
  return R"({"vocab_size": 40, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 3,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    "per_layer_config": {"1": {"head_dim": 16, "num_key_value_heads": 1}, "3": {"head_dim": 16, "num_key_value_heads": 1}},
    "final_logit_softcapping": 4.0, "hidden_size_per_layer_input": 0, "rms_norm_eps": 1e-6)" +
         extra + "}";
}

using TinyBatch = testing::RowArrays;  // B = 2 rows of S = 10 (make_batch)

// Row 0: two documents, an image run of 4 tokens (longer than the window) in the first; row 1: one document with
// an image run, then two padding tokens.
TinyBatch make_batch(int V, int feature_dim) {
  TinyBatch t;
  t.S = 10;
  const int T = t.B * t.S;
  std::mt19937 rng(7);
  for (int i = 0; i < T; ++i) {
    t.ids.push_back(1 + static_cast<int32_t>(rng() % (V - 1)));
    t.labels.push_back(i % 3 == 2 ? -100 : static_cast<int32_t>(rng() % V));
  }
  t.doc = {1, 1, 1, 1, 1, 1, 2, 2, 2, 2, /**/ 1, 1, 1, 1, 1, 1, 1, 1, 0, 0};
  t.mm = {0, 1, 1, 1, 1, 0, 0, 0, 2, 2, /**/ 0, 0, 1, 1, 0, 0, 0, 0, 0, 0};
  for (int r = 0; r < t.B; ++r) {
    int p = 0;
    for (int s = 0; s < t.S; ++s) {
      const int i = r * t.S + s;
      if (s > 0 && t.doc[i] != t.doc[i - 1]) p = 0;
      t.pos.push_back(p++);
    }
  }
  for (int i = 18; i < 20; ++i) t.labels[i] = -100;
  std::normal_distribution<float> normal(0.f, 1.f);
  for (int32_t m : t.mm)
    if (m != 0)
      for (int f = 0; f < feature_dim; ++f) t.features.push_back(normal(rng));
  return t;
}

// Central difference along a random unit direction (±1/sqrt(n) per element) with step h = 1e-3. The float32
// loss carries ~1e-6 absolute rounding noise (a loss of ~4 through a few hundred float ops), which over 2h is
// ~5e-4; the O(h^2) truncation is ~1e-4 at the curvature of these configs. A small perturbation norm also keeps
// the MoE top-k choices from flipping inside the step (a flip is a jump, not a derivative). Tolerance:
// 1.5e-3 absolute + 2e-2 relative.
constexpr float kStep = 1e-3f;
constexpr double kAbsTol = 1.5e-3, kRelTol = 2e-2;

void check_gradients(Gemma4Multimodal& model, const Batch& batch) {
  // A few hundred runs of a 20-token model: one thread, since OpenMP's barriers would cost more than the work
  // (especially on a loaded CI machine). The result does not depend on it
  // (ModelRun.SameBitsOnRepeatAndAcrossThreadCounts).
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  RunOptions opt;
  opt.want_grad = true;
  opt.loss_chunk_tokens = 7;  // several loss chunks, one of them partial
  TensorSet grads;
  const Result base = run_with_grads(model, batch, opt, grads);
  ASSERT_TRUE(std::isfinite(base.loss));
  RunOptions fwd;
  fwd.loss_chunk_tokens = 7;
  std::mt19937 rng(11);
  for (size_t s = 0; s < model.params().size(); ++s) {
    const ParamInfo& p = model.params().info(s);
    const float* w = model.params().weight(s);
    std::vector<float> dir(static_cast<size_t>(p.numel)), keep(w, w + p.numel);
    const float unit = 1.f / std::sqrt(static_cast<float>(dir.size()));
    double analytic = 0;
    // transformers' nn.Embedding(padding_idx = pad) treats the pad row as a constant (no gradient) although
    // vision slots read it for their per-layer input, so that row is left out of the per-layer table's check.
    const size_t frozen = p.name == "model.embed_tokens_per_layer.weight" ? static_cast<size_t>(p.shape[1]) : 0;
    for (size_t i = 0; i < dir.size(); ++i) {
      dir[i] = i < frozen ? 0.f : (rng() % 2 ? unit : -unit);
      analytic += double{grads[s].data[i]} * dir[i];
    }
    float* moved = model.params().mutable_weight(s);
    for (size_t i = 0; i < dir.size(); ++i) moved[i] = keep[i] + kStep * dir[i];
    const double up = model.run(batch, fwd).loss;
    moved = model.params().mutable_weight(s);
    for (size_t i = 0; i < dir.size(); ++i) moved[i] = keep[i] - kStep * dir[i];
    const double down = model.run(batch, fwd).loss;
    std::copy(keep.begin(), keep.end(), model.params().mutable_weight(s));
    const double fd = (up - down) / (2.0 * kStep);
    EXPECT_NEAR(fd, analytic, kAbsTol + kRelTol * std::fabs(analytic)) << p.name;
  }
  omp_set_num_threads(threads);
}

Gemma4Multimodal make_model(const std::string& extra, int vision_dim = 0) {
  Gemma4Multimodal m(Gemma4Config::from_json(tiny_config(extra)), MultimodalParts{vision_dim});
  // std 0.3: large enough that every path (norm scales, router, softcap) carries an O(1) signal.
  constexpr float kInitStd = 0.3f;
  m.init_random(42, kInitStd);
  // Gemma 4 attention has scale 1 on RMS-normed q and k, so with norm scales ~1 the logits reach ~D and the
  // softmax saturates, which makes the loss too curved for finite differences. Scales of D^-1/4 on both give
  // logits of O(1), as a 1/sqrt(D) scale would.
  for (size_t slot = 0; slot < m.params().size(); ++slot) {
    const ParamInfo& t = m.params().info(slot);
    if (t.name.ends_with("q_norm.weight") || t.name.ends_with("k_norm.weight")) {
      const float s = std::pow(static_cast<float>(t.shape[0]), -0.25f);
      float* w = m.params().mutable_weight(slot);
      for (int64_t e = 0; e < t.numel; ++e) w[e] *= s;
    }
  }
  return m;
}

TEST(ModelGrad, DenseSlidingFullKEqV) {
  Gemma4Multimodal m = make_model(R"(, "attention_k_eq_v": true)");
  const TinyBatch b = make_batch(40, 0);
  check_gradients(m, b.view(false));
}

TEST(ModelGrad, DenseVisionGroupsWithFeaturesInHiddenSize) {
  Gemma4Multimodal m = make_model(R"(, "attention_k_eq_v": true, "use_bidirectional_attention": "vision")");
  const TinyBatch b = make_batch(40, 16);
  check_gradients(m, b.view(true));
}

TEST(ModelGrad, MixtureOfExpertsWithUntiedHead) {
  Gemma4Multimodal m = make_model(
      R"(, "attention_k_eq_v": true, "enable_moe_block": true, "num_experts": 4, "top_k_experts": 2,
         "moe_intermediate_size": 8, "tie_word_embeddings": false)");
  ASSERT_TRUE(m.params().contains("lm_head.weight"));
  const TinyBatch b = make_batch(40, 0);
  check_gradients(m, b.view(false));
}

TEST(ModelGrad, PerLayerEmbeddingsKvSharingDoubleWideAndImageProjection) {
  Gemma4Multimodal m = make_model(
      R"(, "hidden_size_per_layer_input": 4, "vocab_size_per_layer_input": 40, "num_kv_shared_layers": 2,
         "use_double_wide_mlp": true)",
      6);
  const TinyBatch b = make_batch(40, 6);
  check_gradients(m, b.view(true));
}

TEST(ModelConfig, ResolvesLayersAndKvSharing) {
  const Gemma4Config c = Gemma4Config::from_json(
      tiny_config(R"(, "attention_k_eq_v": true, "num_kv_shared_layers": 2, "use_double_wide_mlp": true,
                     "use_bidirectional_attention": "vision")"));
  const LayerSpec s0 = c.layer(0), s1 = c.layer(1), s2 = c.layer(2), s3 = c.layer(3);
  EXPECT_TRUE(s0.sliding && s0.stores_kv && s0.has_v_proj);
  EXPECT_EQ(s0.mask, (LayerMask{true, 3, true}));
  EXPECT_TRUE(!s1.sliding && s1.stores_kv && !s1.has_v_proj);
  EXPECT_EQ(s1.head_dim, 16);
  EXPECT_EQ(s1.kv_heads, 1);
  EXPECT_EQ(s1.mask, (LayerMask{true, 0, false}));  // transformers 5.24: no image groups on full layers
  EXPECT_EQ(s2.kv_source, 0);
  EXPECT_EQ(s3.kv_source, 1);
  EXPECT_EQ(s2.intermediate, 48);
  EXPECT_EQ(s0.intermediate, 24);
}

TEST(ModelConfig, RejectsUnsupportedFieldsByName) {
  auto message = [](const std::string& extra) {
    try {
      Gemma4Config::from_json(tiny_config(extra));
    } catch (const rf::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message(R"(, "attention_bias": true)").find("attention_bias"), std::string::npos);
  EXPECT_NE(message(R"(, "hidden_activation": "relu")").find("hidden_activation"), std::string::npos);
  EXPECT_NE(message(R"(, "use_bidirectional_attention": "all")").find("use_bidirectional_attention"),
            std::string::npos);
  EXPECT_NE(message(R"(, "num_attention_heads": 3)").find("key/value heads"), std::string::npos);
}

TEST(ModelRun, RejectsMismatchedImageFeatures) {
  Gemma4Multimodal m = make_model("");
  TinyBatch b = make_batch(40, 16);
  Batch v = b.view(true);
  v.n_image_features -= 1;
  EXPECT_THROW(m.run(v, RunOptions{}), rf::Error);
}

// A bad value is named with its source, its tensor and its [row, position] (the batch is [2, 10]).
TEST(ModelRun, BatchErrorsNameSourceTensorAndPosition) {
  const Gemma4Multimodal m = make_model("");
  const auto message = [&](auto edit) {
    TinyBatch b = make_batch(40, 0);
    edit(b);
    try {
      m.check_batch(b.view(false), 1, "in.safetensors");
    } catch (const rf::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message([](TinyBatch& b) { b.ids[13] = 40; }),
            "in.safetensors: input_ids: token 40 at [1, 3] is outside [0, vocab_size = 40)");
  EXPECT_EQ(message([](TinyBatch& b) { b.labels[4] = -1; }),
            "in.safetensors: labels: -1 at [0, 4] is neither -100 nor in [0, vocab_size = 40)");
  EXPECT_EQ(message([](TinyBatch& b) { b.doc[11] = -1; }),
            "in.safetensors: doc: value -1 at [1, 1] is negative (0 = padding, documents are 1-based)");
  EXPECT_EQ(message([](TinyBatch& b) { b.mm[12] = 3; }),
            "in.safetensors: mm_token_type_ids: value 3 at [1, 2] is not 0, 1 or 2");
}

// Padding (doc 0) is not trained on (docs/model-fidelity.md): labels a batch puts on its padding tokens change
// neither the loss, nor the label count, nor a gradient bit.
TEST(ModelRun, LabelsOnPaddingAreIgnored) {
  Gemma4Multimodal m = make_model("");
  const TinyBatch clean = make_batch(40, 0);
  TinyBatch labelled = clean;
  for (size_t i = 0; i < labelled.doc.size(); ++i)
    if (labelled.doc[i] == 0) labelled.labels[i] = 3;
  RunOptions opt;
  opt.want_grad = true;
  TensorSet g_clean, g_labelled;
  const Result r_clean = run_with_grads(m, clean.view(false), opt, g_clean);
  const Result r_labelled = run_with_grads(m, labelled.view(false), opt, g_labelled);
  EXPECT_EQ(r_clean.label_tokens, r_labelled.label_tokens);
  EXPECT_EQ(r_clean.loss, r_labelled.loss);
  for (size_t s = 0; s < g_clean.size(); ++s) EXPECT_EQ(g_clean[s].data, g_labelled[s].data) << g_clean[s].name;
}

// An image slot on padding takes no feature, so a non-finite feature there changes no bit of the loss or of any
// gradient (0 · NaN in a weight gradient would otherwise spread it to every parameter).
TEST(ModelRun, FeatureOfAPaddingImageSlotIsNotRead) {
  constexpr int kFeatureDim = 6;
  Gemma4Multimodal m = make_model("", kFeatureDim);
  TinyBatch zero = make_batch(40, kFeatureDim);
  ASSERT_EQ(zero.doc.back(), 0);
  zero.mm.back() = 1;  // the last slot in row-major order
  zero.features.insert(zero.features.end(), kFeatureDim, 0.f);
  TinyBatch nan = zero;
  std::fill(nan.features.end() - kFeatureDim, nan.features.end(), std::numeric_limits<float>::quiet_NaN());
  RunOptions opt;
  opt.want_grad = true;
  TensorSet g_zero, g_nan;
  const Result r_zero = run_with_grads(m, zero.view(true), opt, g_zero);
  const Result r_nan = run_with_grads(m, nan.view(true), opt, g_nan);
  ASSERT_TRUE(std::isfinite(r_zero.loss));
  EXPECT_EQ(r_zero.loss, r_nan.loss);
  for (size_t s = 0; s < g_zero.size(); ++s) EXPECT_EQ(g_zero[s].data, g_nan[s].data) << g_zero[s].name;
  EXPECT_EQ(r_zero.d_image_features, r_nan.d_image_features);
}

TEST(ModelRun, SameBitsOnRepeatAndAcrossThreadCounts) {
  Gemma4Multimodal m = make_model(R"(, "enable_moe_block": true, "num_experts": 4, "top_k_experts": 2,
                                   "moe_intermediate_size": 8)");
  const TinyBatch b = make_batch(40, 0);
  RunOptions opt;
  opt.want_grad = true;
  TensorSet g1, g2, g3;
  const int threads = omp_get_max_threads();
  const Result r1 = run_with_grads(m, b.view(false), opt, g1), r2 = run_with_grads(m, b.view(false), opt, g2);
  omp_set_num_threads(threads == 1 ? 2 : 1);
  const Result r3 = run_with_grads(m, b.view(false), opt, g3);
  omp_set_num_threads(threads);
  EXPECT_EQ(r1.loss, r2.loss);
  EXPECT_EQ(r1.loss, r3.loss);
  for (size_t s = 0; s < g1.size(); ++s) {
    EXPECT_EQ(g1[s].data, g2[s].data) << g1[s].name;
    EXPECT_EQ(g1[s].data, g3[s].data) << g1[s].name << " with another thread count";
  }
}

// Keeping every layer's activations instead of recomputing them in the backward changes memory, not numbers: the
// recompute runs the forward's own code on the same inputs, so the gradients are the same bits.
TEST(ModelRun, KeepingLayerActivationsGivesTheRecomputedBits) {
  Gemma4Multimodal m = make_model(
      R"(, "hidden_size_per_layer_input": 4, "vocab_size_per_layer_input": 40, "num_kv_shared_layers": 2,
         "enable_moe_block": true, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 8)",
      6);
  const TinyBatch b = make_batch(40, 6);
  RunOptions recompute, keep;
  recompute.want_grad = keep.want_grad = true;
  keep.recompute_layers = false;
  TensorSet g1, g2;
  const Result r1 = run_with_grads(m, b.view(true), recompute, g1), r2 = run_with_grads(m, b.view(true), keep, g2);
  EXPECT_EQ(r1.loss, r2.loss);
  EXPECT_EQ(r1.d_image_features, r2.d_image_features);
  for (size_t s = 0; s < g1.size(); ++s) EXPECT_EQ(g1[s].data, g2[s].data) << g1[s].name;
  EXPECT_GT(r2.kept_activation_bytes, r1.kept_activation_bytes);
  EXPECT_EQ(r2.layer_recompute_bytes, 0);
  // Keeping only the MLP projections: the same bits again, memory between the two.
  RunOptions keep_mlp = recompute;
  keep_mlp.keep_mlp_projections = true;
  TensorSet g3;
  const Result r3 = run_with_grads(m, b.view(true), keep_mlp, g3);
  EXPECT_EQ(r1.loss, r3.loss);
  EXPECT_EQ(r1.d_image_features, r3.d_image_features);
  for (size_t s = 0; s < g1.size(); ++s) EXPECT_EQ(g1[s].data, g3[s].data) << g3[s].name << " keeping the MLP";
  EXPECT_GT(r3.kept_activation_bytes, r1.kept_activation_bytes);
  EXPECT_LT(r3.kept_activation_bytes, r2.kept_activation_bytes);
  EXPECT_LT(r3.layer_recompute_bytes, r1.layer_recompute_bytes);
  // Recomputing the o_proj and down_proj outputs instead of keeping them (one, then both): the same bits, less kept.
  RunOptions no_o = recompute, no_out = recompute;
  no_o.keep_o_proj_output = false;
  no_out.keep_o_proj_output = false;
  no_out.keep_down_proj_output = false;
  TensorSet g4, g5;
  const Result r4 = run_with_grads(m, b.view(true), no_o, g4), r5 = run_with_grads(m, b.view(true), no_out, g5);
  for (const auto& [r, g, what] : {std::tuple{&r4, &g4, "recomputing o_proj"}, {&r5, &g5, "recomputing both"}}) {
    EXPECT_EQ(r1.loss, r->loss) << what;
    EXPECT_EQ(r1.d_image_features, r->d_image_features) << what;
    for (size_t s = 0; s < g1.size(); ++s) EXPECT_EQ(g1[s].data, (*g)[s].data) << (*g)[s].name << " " << what;
  }
  EXPECT_LT(r4.kept_activation_bytes, r1.kept_activation_bytes);
  EXPECT_LT(r5.kept_activation_bytes, r4.kept_activation_bytes);
}

// Frozen parameters (a trainer's model.freeze) get no gradient, and the others keep the bits of a fully trainable
// run: skipping a weight-gradient product changes no other sum.
TEST(ModelRun, UnallocatedGradientsAreSkippedAndTheOthersKeepTheirBits) {
  Gemma4Multimodal m = make_model(
      R"(, "hidden_size_per_layer_input": 4, "vocab_size_per_layer_input": 40, "num_kv_shared_layers": 2,
         "enable_moe_block": true, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 8)",
      6);
  const TinyBatch b = make_batch(40, 6);
  RunOptions opt;
  opt.want_grad = true;
  // Frozen: both embedding tables (their scatter-adds), the experts (MoE weight products), every second other
  // tensor (linear, norm and router gradients).
  std::vector<bool> wanted(m.params().size());
  for (size_t s = 0; s < wanted.size(); ++s) {
    const std::string& n = m.params().info(s).name;
    const bool always_frozen = n.find("embed_tokens") != std::string::npos || n.find("experts") != std::string::npos;
    wanted[s] = !always_frozen && s % 2 == 0;
  }
  TensorSet all, some;
  const Result full = run_with_grads(m, b.view(true), opt, all);
  m.params().set_trainable(wanted);
  const Result partial = run_with_grads(m, b.view(true), opt, some);
  EXPECT_EQ(full.loss, partial.loss);
  EXPECT_EQ(full.d_image_features, partial.d_image_features);
  int skipped = 0;
  for (size_t s = 0; s < all.size(); ++s) {
    if (wanted[s]) {
      EXPECT_EQ(all[s].data, some[s].data) << all[s].name;
    } else {
      EXPECT_TRUE(some[s].data.empty()) << some[s].name;
      ++skipped;
    }
  }
  EXPECT_GT(skipped, 10);
}

// A batch of text rows, one document each, long enough that every parallel loop of the MoE block (router, expert
// tasks, per-token sums, weight gradients) runs on several threads: their thresholds are in elements or
// multiply-adds, and 2 x 2048 tokens with 8 experts pass them all.
TinyBatch long_text_batch(int V, int B, int S) {
  TinyBatch t;
  t.B = B;
  t.S = S;
  std::mt19937 rng(11);
  for (int r = 0; r < B; ++r) {
    for (int s = 0; s < S; ++s) {
      t.ids.push_back(1 + static_cast<int32_t>(rng() % (V - 1)));
      t.labels.push_back(static_cast<int32_t>(rng() % V));
      t.pos.push_back(s);
      t.doc.push_back(1);
      t.mm.push_back(0);
    }
  }
  return t;
}

// The MoE block's experts run as parallel tasks and its reductions in fixed orders (moe.cpp): 1, 2 and 3 threads
// (3: more threads than cores, and an uneven share of tasks) give the same bits. Vocabulary 4096: with the tiny
// configs' 40 the tied head's gradient sgemm (40 x 16 x 4096) is cut by thread count into blocks below OpenBLAS's
// small-matrix threshold, whose kernel sums K in another order (a separate issue of ops.cpp's gemm split).
// moe_extra: the MoE settings of the config.
void expect_moe_same_bits_across_thread_counts(const std::string& moe_extra) {
  constexpr int kVocab = 4096;
  Gemma4Multimodal m = make_model(R"(, "vocab_size": 4096, "enable_moe_block": true)" + moe_extra);
  const TinyBatch b = long_text_batch(kVocab, 2, 2048);
  RunOptions opt;
  opt.want_grad = true;
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  TensorSet g1;
  const Result r1 = run_with_grads(m, b.view(false), opt, g1);
  ASSERT_TRUE(std::isfinite(r1.loss));
  for (int n : {2, 3}) {
    omp_set_num_threads(n);
    TensorSet gn;
    const Result rn = run_with_grads(m, b.view(false), opt, gn);
    EXPECT_EQ(r1.loss, rn.loss) << n << " threads";
    for (size_t s = 0; s < g1.size(); ++s) EXPECT_EQ(g1[s].data, gn[s].data) << g1[s].name << ", " << n << " threads";
  }
  omp_set_num_threads(threads);
}

// Im * H = 32 * 16 puts a step of the cut at 2^21 / 512 = 4096 rows: each expert's ~1024 rows are one task.
TEST(ModelRun, MoeSameBitsAcrossThreadCountsAtParallelSizes) {
  expect_moe_same_bits_across_thread_counts(R"(, "num_experts": 8, "top_k_experts": 2, "moe_intermediate_size": 32)");
}

// Im * H = 1024 * 16 puts a step of the cut at 128 rows: each expert's ~1024 rows make several tasks of up to four
// steps and a remainder task, so the tasks differ in size and the dynamic schedule gives them out unevenly.
TEST(ModelRun, MoeSameBitsAcrossThreadCountsWithSeveralTasksAnExpert) {
  expect_moe_same_bits_across_thread_counts(R"(, "num_experts": 8, "top_k_experts": 2, "moe_intermediate_size": 1024)");
}

}  // namespace
}  // namespace rf::model
