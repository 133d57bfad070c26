// The LoRA store (model/lora_store.h): only the adapters train, PEFT's initial values (A Kaiming-uniform from the
// seed alone, B zero), and the loss and adapter gradients of a run against an independent oracle: the plain model
// (ReplicatedStore, whose gradients tests/model/parity.py checks against transformers) run on the merged weights
// W + scale * B A, its full weight gradients dW contracted in double by the chain rule (dA = scale B^T dW,
// dB = scale dW A^T), and a central finite difference of the loss in one element of A and of B.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/error_of.h"
#include "core/error.h"
#include "io/json_text.h"
#include "io/safetensors.h"
#include "model/checkpoint.h"
#include "model/gemma4.h"
#include "model/lora_store.h"
#include "model/peft_files.h"

namespace rf::model {
namespace {

const char* const kTwoLayers = R"({"vocab_size": 40, "hidden_size": 16, "intermediate_size": 24,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 3,
  "layer_types": ["sliding_attention", "full_attention"], "final_logit_softcapping": 4.0,
  "hidden_size_per_layer_input": 0, "rms_norm_eps": 1e-6})";

constexpr int kRank = 2;
constexpr double kAlpha = 3.0;
constexpr int kSeq = 12;

LoraConfig lora_config(uint64_t seed) {
  LoraConfig c;
  c.rank = kRank;
  c.alpha = kAlpha;
  c.seed = seed;
  return c;
}

struct Rows {
  std::vector<int32_t> ids, labels;
  Batch batch() {
    Batch b;
    b.B = 1;
    b.S = kSeq;
    b.input_ids = ids.data();
    b.labels = labels.data();
    return b;
  }
};

Rows rows() {
  Rows r{std::vector<int32_t>(kSeq), std::vector<int32_t>(kSeq)};
  for (int i = 0; i < kSeq; ++i) {
    r.ids[static_cast<size_t>(i)] = (i * 7 + 1) % 40;
    r.labels[static_cast<size_t>(i)] = (i * 5 + 2) % 40;
  }
  return r;
}

std::unique_ptr<Gemma4Model> lora_model(uint64_t seed) {
  auto m = std::make_unique<Gemma4Model>(Gemma4Config::from_json(kTwoLayers), TensorSet::Storage::Allocated,
                                         std::make_unique<LoraStore>(lora_config(seed)));
  m->init_random(3, 0.3f);
  dynamic_cast<LoraStore&>(m->params()).init_adapters();
  return m;
}

TEST(LoraStore, OnlyTheAdaptersTrainAndStartAsPeftDoes) {
  auto m = lora_model(11);
  const auto& store = dynamic_cast<const LoraStore&>(m->params());
  // Seven targets a layer (q, k, v, o, gate, up, down), two layers.
  ASSERT_EQ(store.adapters().size(), 14u);
  int64_t adapter_elements = 0;
  for (const LoraStore::Adapter& a : store.adapters()) {
    adapter_elements += kRank * (a.in + a.out);
    EXPECT_EQ(store.info(a.a).name, module_of(store.info(a.base).name) + ".lora_A.weight");
    EXPECT_EQ(store.info(a.a).shape, (std::vector<int64_t>{kRank, a.in}));
    EXPECT_EQ(store.info(a.b).shape, (std::vector<int64_t>{a.out, kRank}));
    EXPECT_FALSE(store.info(a.base).trainable);
    const float bound = static_cast<float>(1.0 / std::sqrt(static_cast<double>(a.in)));
    double sum_sq = 0;
    for (int64_t e = 0; e < kRank * a.in; ++e) {
      const float v = store.weight(a.a)[e];
      EXPECT_LE(std::abs(v), bound);
      sum_sq += static_cast<double>(v) * v;
    }
    EXPECT_GT(sum_sq, 0.0);
    for (int64_t e = 0; e < a.out * kRank; ++e) EXPECT_EQ(store.weight(a.b)[e], 0.f);
  }
  EXPECT_EQ(store.trainable_elements(), adapter_elements);
  for (const ParamInfo& p : store.infos()) EXPECT_EQ(p.trainable, p.name.find(".lora_") != std::string::npos) << p.name;

  // A's values are a function of the seed alone; another seed gives others.
  auto same = lora_model(11), other = lora_model(12);
  const size_t a0 = store.adapters()[0].a;
  for (int64_t e = 0; e < store.info(a0).numel; ++e) EXPECT_EQ(same->params().weight(a0)[e], store.weight(a0)[e]);
  EXPECT_NE(other->params().weight(a0)[0], store.weight(a0)[0]);
}

// Expert parallelism (LoraStore::place_experts): EP rank q of ep holds its experts' rows of A and B, expert-major,
// with the whole tensor's initial values; PEFT's file layout of B interleaves the experts and round-trips.
TEST(LoraStore, PlacedExpertAdaptersHoldTheirExpertsRowsOfTheWholeTensors) {
  const char* const moe = R"({"vocab_size": 32, "hidden_size": 8, "intermediate_size": 12, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "sliding_window": 3,
    "layer_types": ["sliding_attention", "full_attention"], "hidden_size_per_layer_input": 0, "rms_norm_eps": 1e-6,
    "enable_moe_block": true, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 6})";
  constexpr int64_t kExperts = 4, kEp = 2;
  LoraConfig c = lora_config(5);
  c.target = {"q_proj"};
  c.target_parameters = {"experts.gate_up_proj", "experts.down_proj"};
  const auto make = [&](int ep_rank, int ep) {
    auto store = std::make_unique<LoraStore>(c);
    if (ep > 1) store->place_experts(ep_rank, ep);
    auto m =
        std::make_unique<Gemma4Model>(Gemma4Config::from_json(moe), TensorSet::Storage::Allocated, std::move(store));
    dynamic_cast<LoraStore&>(m->params()).init_adapters();
    return m;
  };
  const auto whole_model = make(0, 1);
  const auto& whole = dynamic_cast<const LoraStore&>(whole_model->params());
  for (int q = 0; q < kEp; ++q) {
    const auto part_model = make(q, kEp);
    const auto& part = dynamic_cast<const LoraStore&>(part_model->params());
    ASSERT_EQ(part.size(), whole.size());
    int64_t held = 0;
    for (const LoraStore::Adapter& a : part.adapters()) {
      if (a.experts == 1) {
        EXPECT_FALSE(part.info(a.a).holds_part());
        continue;
      }
      EXPECT_EQ(a.experts, kExperts);
      EXPECT_EQ(a.experts_held, kExperts / kEp);
      EXPECT_EQ(a.experts_begin, q * kExperts / kEp);
      for (const size_t slot : {a.a, a.b}) {
        const ParamInfo& p = part.info(slot);
        const ParamInfo& w = whole.info(slot);
        ASSERT_TRUE(p.holds_part()) << p.name;
        EXPECT_EQ(p.whole_shape(), w.shape) << p.name;
        EXPECT_EQ(p.numel * kEp, w.numel) << p.name;
        const int64_t at = p.rows_begin * (w.numel / w.shape[0]);
        EXPECT_EQ(at, q * p.numel) << p.name;
        // A's values (B's zeros) are the whole tensor's rows.
        for (int64_t i = 0; i < p.numel; ++i) ASSERT_EQ(part.weight(slot)[i], whole.weight(slot)[at + i]) << p.name;
        held += p.numel;
      }
    }
    EXPECT_GT(held, 0);
    // The trainable layout is the placed adapters': gradients and moments E / ep experts' worth of them.
    EXPECT_EQ(part.trainable_elements() + held, whole.trainable_elements());
  }
  // B in PEFT's layout: [out, r * E], expert e's B_e[o, k] at column k * E + e; and back.
  const LoraStore::Adapter& gu = whole.adapters().at(1);
  ASSERT_EQ(gu.experts, kExperts);
  const ParamInfo& b = whole.info(gu.b);
  EXPECT_EQ(whole.file_shape(gu.b), (std::vector<int64_t>{gu.out, kRank * kExperts}));
  EXPECT_EQ(whole.file_shape(gu.a), whole.info(gu.a).shape);
  std::vector<float> held(static_cast<size_t>(b.numel)), file(held.size()), back(held.size());
  for (size_t i = 0; i < held.size(); ++i) held[i] = static_cast<float>(i);
  whole.to_file_layout(gu.b, held, file);
  for (int64_t e = 0; e < kExperts; ++e)
    for (int64_t o = 0; o < gu.out; ++o)
      for (int64_t k = 0; k < kRank; ++k)
        ASSERT_EQ(file[static_cast<size_t>(o * kRank * kExperts + k * kExperts + e)],
                  held[static_cast<size_t>((e * gu.out + o) * kRank + k)]);
  whole.from_file_layout(gu.b, file, back);
  EXPECT_EQ(back, held);
  // A placement after the adapters exist, or one that does not divide the experts, is refused.
  auto late = make(0, 1);
  EXPECT_THROW(dynamic_cast<LoraStore&>(late->params()).place_experts(0, 2), rf::Error);
  EXPECT_THROW(make(0, 3), rf::Error);
}

TEST(LoraStore, TargetsFollowPeft) {
  LoraConfig c = lora_config(1);
  c.target = {"model\\.layers\\.1\\.self_attn\\.(q|v)_proj"};
  c.target_regex = true;
  Gemma4Model m(Gemma4Config::from_json(kTwoLayers), TensorSet::Storage::Allocated, std::make_unique<LoraStore>(c));
  EXPECT_EQ(dynamic_cast<const LoraStore&>(m.params()).target_modules(),
            (std::vector<std::string>{"model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"}));
  c.target = {"o_proj", "nothing_proj"};
  c.target_regex = false;
  EXPECT_THROW(Gemma4Model(Gemma4Config::from_json(kTwoLayers), TensorSet::Storage::Allocated,
                           std::make_unique<LoraStore>(c)),
               rf::Error);
  c.dropout = 1.0;
  EXPECT_THROW(LoraStore{c}, rf::Error);
}

// An MoE of one expert: its experts weights are still 3-D parameters (target_parameters), and their adapters are
// named as PEFT's ParamWrapper names them, as for any E (tests/model/random_parity.py's seed 12 found them named as
// linears', so `ringflex forward --lora` refused PEFT's file as "no adapter of this model").
TEST(LoraStore, OneExpertsAdaptersAreNamedAsPeftsParamWrapper) {
  const char* const kOneExpert = R"({"vocab_size": 40, "hidden_size": 16, "intermediate_size": 24,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "sliding_window": 3,
    "hidden_size_per_layer_input": 0, "enable_moe_block": true, "num_experts": 1, "top_k_experts": 1,
    "moe_intermediate_size": 4})";
  for (const auto& [parameters, names] :
       {std::pair{std::vector<std::string>{"experts.gate_up_proj"},
                  std::vector<std::string>{"model.layers.0.experts.lora_A.weight"}},
        std::pair{std::vector<std::string>{"experts.gate_up_proj", "experts.down_proj"},
                  std::vector<std::string>{"model.layers.0.experts.base_layer.lora_A.weight",
                                           "model.layers.0.experts.lora_A.weight"}}}) {
    LoraConfig c = lora_config(1);
    c.target = {};
    c.target_parameters = parameters;
    Gemma4Model m(Gemma4Config::from_json(kOneExpert), TensorSet::Storage::Allocated, std::make_unique<LoraStore>(c));
    const auto& store = dynamic_cast<const LoraStore&>(m.params());
    EXPECT_TRUE(store.target_modules().empty());
    ASSERT_EQ(store.target_parameters().size(), parameters.size());
    std::vector<std::string> a_names;
    for (const LoraStore::Adapter& a : store.adapters()) {
      EXPECT_TRUE(a.experts_weight);
      EXPECT_EQ(a.experts, 1);
      a_names.push_back(store.info(a.a).name);
    }
    EXPECT_EQ(a_names, names);
  }
}

// The base's held bytes (its dtype, as the store holds them).
std::vector<uint8_t> held_bytes(const ParamStore& store, size_t slot) {
  const HeldWeight h = store.held_weight(slot);
  const auto* p = static_cast<const uint8_t*>(h.data);
  return std::vector<uint8_t>(p, p + store.info(slot).numel * held_dtype_size(h.dtype));
}

// The base moved to bfloat16 buffers the store holds as a loader's mapped files (hold_mapped): the store keeps no
// float32 copy of it.
std::shared_ptr<std::vector<std::vector<bf16>>> hold_base_in_bf16(LoraStore& store) {
  auto images = std::make_shared<std::vector<std::vector<bf16>>>();
  std::vector<size_t> base;
  for (size_t slot = 0; slot < store.size(); ++slot)
    if (!store.info(slot).trainable) base.push_back(slot);
  images->reserve(base.size());
  for (size_t slot : base) {
    const int64_t n = store.info(slot).numel;
    images->emplace_back(static_cast<size_t>(n));
    round_to_bf16(store.weight(slot), images->back().data(), n);
  }
  for (size_t i = 0; i < base.size(); ++i)
    EXPECT_TRUE(store.hold_mapped(base[i], HeldWeight{HeldDType::BF16, (*images)[i].data()}, images));
  return images;
}

void loss_and_gradients_match_the_merged_model(bool bf16_base) {
  SCOPED_TRACE(bf16_base ? "bf16 base" : "float32 base");
  auto m = lora_model(5);
  auto& store = dynamic_cast<LoraStore&>(m->params());
  const auto images = bf16_base ? hold_base_in_bf16(store) : nullptr;
  if (bf16_base) {
    EXPECT_EQ(store.held_base_bytes(), store.mapped_base_bytes());
  }
  const double scale = kAlpha / kRank;
  // B away from zero, so A's gradients are not zero too.
  for (const LoraStore::Adapter& a : store.adapters()) {
    float* B = store.mutable_weight(a.b);
    for (int64_t e = 0; e < a.out * kRank; ++e) B[e] = 0.2f * std::sin(static_cast<float>(e + a.b));
  }
  std::vector<std::vector<uint8_t>> base_before;
  for (const LoraStore::Adapter& a : store.adapters()) base_before.push_back(held_bytes(store, a.base));

  // The oracle: the plain model on W' = W + scale * B A (in double, rounded once).
  Gemma4Model plain(Gemma4Config::from_json(kTwoLayers));
  ParamStore& ps = plain.params();
  for (size_t slot = 0; slot < ps.size(); ++slot)
    std::copy_n(store.weight(slot), ps.info(slot).numel, ps.mutable_weight(slot));
  for (const LoraStore::Adapter& a : store.adapters()) {
    float* W = ps.mutable_weight(a.base);
    const float *A = store.weight(a.a), *B = store.weight(a.b);
    for (int64_t o = 0; o < a.out; ++o)
      for (int64_t i = 0; i < a.in; ++i) {
        double d = 0;
        for (int k = 0; k < kRank; ++k) d += static_cast<double>(B[o * kRank + k]) * A[k * a.in + i];
        W[o * a.in + i] = static_cast<float>(W[o * a.in + i] + scale * d);
      }
  }
  Rows r = rows();
  RunOptions opt;
  opt.want_grad = true;
  ps.allocate_grads();
  const Result want = plain.run(r.batch(), opt);
  store.allocate_grads();
  store.zero_grads();
  const Result got = m->run(r.batch(), opt);
  // float32 runs of the same function, summed in another order (B A added to W before, x A^T B^T to x W^T after).
  constexpr double kLossTol = 1e-6;
  EXPECT_NEAR(got.loss, want.loss, kLossTol * std::abs(want.loss));

  double worst = 0;
  for (const LoraStore::Adapter& a : store.adapters()) {
    const float* dW = ps.grad(a.base);
    const float *A = store.weight(a.a), *B = store.weight(a.b);
    std::vector<double> dA(static_cast<size_t>(kRank * a.in), 0.0), dB(static_cast<size_t>(a.out * kRank), 0.0);
    for (int64_t o = 0; o < a.out; ++o)
      for (int64_t i = 0; i < a.in; ++i)
        for (int k = 0; k < kRank; ++k) {
          dA[static_cast<size_t>(k * a.in + i)] += scale * B[o * kRank + k] * dW[o * a.in + i];
          dB[static_cast<size_t>(o * kRank + k)] += scale * dW[o * a.in + i] * A[k * a.in + i];
        }
    for (const auto& [slot, ref] : {std::pair{a.a, &dA}, std::pair{a.b, &dB}}) {
      double diff = 0, norm = 0;
      for (size_t e = 0; e < ref->size(); ++e) {
        diff += std::pow(store.grad(slot)[e] - (*ref)[e], 2);
        norm += (*ref)[e] * (*ref)[e];
      }
      ASSERT_GT(norm, 0.0) << store.info(slot).name;
      worst = std::max(worst, std::sqrt(diff / norm));
    }
  }
  // The same function in float32 with W' rounded differently (B A summed in float32 here, in double there: an ulp of
  // W') and dW contracted in float32 here, in double there; the tiny random model amplifies float32 rounding to ~2e-5
  // (tests/model/parity.py measures the same against float64), while a wrong term or transpose gives 1e-1 or more.
  constexpr double kGradTol = 1e-4;
  EXPECT_LT(worst, kGradTol);
  // The base was never written (its held bytes are the same), and has no gradient.
  for (size_t i = 0; i < store.adapters().size(); ++i) {
    EXPECT_EQ(store.grad(store.adapters()[i].base), nullptr);
    ASSERT_EQ(held_bytes(store, store.adapters()[i].base), base_before[i]);
  }

  // A central finite difference of the loss in one element of an A and of a B (double-checks the contraction's
  // transposes against the loss itself, not the formula).
  const LoraStore::Adapter& q1 = store.adapters()[7];
  for (const auto& [slot, e] : {std::pair{q1.a, int64_t{5}}, std::pair{q1.b, int64_t{3}}}) {
    constexpr float kStep = 1e-2f;
    const float keep = store.weight(slot)[e];
    const float analytic = store.grad(slot)[e];
    store.mutable_weight(slot)[e] = keep + kStep;
    const double up = m->run(r.batch(), RunOptions{}).loss;
    store.mutable_weight(slot)[e] = keep - kStep;
    const double down = m->run(r.batch(), RunOptions{}).loss;
    store.mutable_weight(slot)[e] = keep;
    // O(step^2) truncation plus float32 loss noise / step: a few 1e-4 absolute at these magnitudes.
    constexpr double kFdTol = 2e-3;
    EXPECT_NEAR((up - down) / (2 * kStep), analytic, kFdTol) << store.info(slot).name;
  }
}

TEST(LoraStore, LossAndAdapterGradientsMatchTheMergedModel) { loss_and_gradients_match_the_merged_model(false); }

TEST(LoraStore, ABf16BaseIsHeldAsItIsAndComputesTheSame) {
  // The oracle's base is the same bf16 values widened (exact), so float32 runs agree as tightly as above.
  loss_and_gradients_match_the_merged_model(true);
}

TEST(LoraStore, ABf16BaseIsWidenedOneLayerAtATimeAndTheHeadNever) {
  // The hooks' float32 widenings, in the phases the memory check counts them (lora_*_buffer_bytes): the global
  // group's projections for the whole run, one layer's base while it runs; the tied head (the token table, [V, H])
  // never: the loss reads it as held, by panels (loss.h), so the memory check counts the loss's panel scratch instead,
  // here one panel of all 40 rows (head_panel_bytes). Byte counts by hand for kTwoLayers (V 40, H 16, I 24, Hq 4, Hkv
  // 2, no per-layer inputs): the global group but the head is the final norm [H]; a layer is q_proj [Hq*D, 16], k_proj
  // and v_proj [Hkv*D, 16], o_proj [16, Hq*D], gate/up/down [24, 16] x 3, q_norm and k_norm [D], and four [H] norms,
  // D = 8 in the sliding layer 0 and 512 (global_head_dim's default) in the full layer 1, the largest.
  auto m = lora_model(5);
  auto& store = dynamic_cast<LoraStore&>(m->params());
  const auto images = hold_base_in_bf16(store);
  constexpr int64_t kF = sizeof(float);
  constexpr int64_t kGlobal = 16 * kF, kHead = 40 * 16 * kF;
  const auto layer = [](int64_t D) { return (4 * D * 16 * 2 + 2 * 2 * D * 16 + 3 * 24 * 16 + 2 * D + 4 * 16) * kF; };
  EXPECT_EQ(lora_global_buffer_bytes(store), kGlobal);
  EXPECT_EQ(lora_head_buffer_bytes(store), kHead);
  EXPECT_EQ(lora_layer_buffer_bytes(store), layer(512));
  const int64_t kLayer = layer(8);
  const size_t head = store.slot("model.embed_tokens.weight");
  EXPECT_EQ(store.widened_bytes(), 0);
  store.before_forward(kGlobalGroup);
  EXPECT_EQ(store.widened_bytes(), kGlobal);
  store.before_forward(0);
  EXPECT_EQ(store.widened_bytes(), kGlobal + kLayer);
  store.after_forward(0);
  store.acquire_head(head);
  // The head is read by the loss as it is held (by panels, loss.h): nothing of it is widened in the store.
  EXPECT_EQ(store.widened_bytes(), kGlobal);
  store.release_head(head);
  EXPECT_EQ(store.widened_bytes(), kGlobal);
  store.after_backward(kGlobalGroup);
  EXPECT_EQ(store.widened_bytes(), 0);
  // A run releases all of it, and its loss is that of the same weights in float32 (the head's bits are the same
  // wherever they are widened: ABf16BaseIsHeldAsItIsAndComputesTheSame checks the gradients).
  Rows r = rows();
  RunOptions opt;
  opt.want_grad = true;
  store.allocate_grads();
  store.zero_grads();
  const Result got = m->run(r.batch(), opt);
  EXPECT_EQ(store.widened_bytes(), 0);
  const std::vector<float> grads(store.flat(Role::Grads).begin(), store.flat(Role::Grads).end());
  // The recompute redoing the adapted o_proj and down_proj products instead of being handed them: the same bits.
  RunOptions recompute_outputs = opt;
  recompute_outputs.keep_o_proj_output = recompute_outputs.keep_down_proj_output = false;
  store.zero_grads();
  EXPECT_EQ(m->run(r.batch(), recompute_outputs).loss, got.loss);
  EXPECT_TRUE(std::equal(grads.begin(), grads.end(), store.flat(Role::Grads).begin()));
  for (size_t slot = 0; slot < store.size(); ++slot)
    if (!store.info(slot).trainable) store.mutable_weight(slot);  // the same values, now float32
  EXPECT_EQ(m->run(r.batch(), RunOptions{}).loss, got.loss);
}

TEST(LoraStore, TheBf16ModeMultipliesABf16BaseAsItIsHeld) {
  // The bf16 compute mode on a base held in bf16 (the matmuls find its held values through the store's Bf16Lookup,
  // no copy) against the same values held in float32 (rounded by each matmul): the same bf16 operands, so the same
  // bits, loss and every adapter gradient.
  Rows r = rows();
  RunOptions opt;
  opt.want_grad = true;
  opt.compute_dtype = ComputeDtype::Bfloat16;
  std::vector<Result> results;
  std::vector<std::vector<float>> grads;
  for (bool held_in_bf16 : {true, false}) {
    auto m = lora_model(5);
    auto& store = dynamic_cast<LoraStore&>(m->params());
    for (const LoraStore::Adapter& a : store.adapters()) {
      float* B = store.mutable_weight(a.b);
      for (int64_t e = 0; e < a.out * kRank; ++e) B[e] = 0.2f * std::sin(static_cast<float>(e + a.b));
    }
    const auto images = hold_base_in_bf16(store);
    if (!held_in_bf16)
      for (size_t slot = 0; slot < store.size(); ++slot)
        if (!store.info(slot).trainable) store.mutable_weight(slot);  // the same values, now float32
    EXPECT_EQ(store.held_base_bytes() == store.mapped_base_bytes(), held_in_bf16);
    store.allocate_grads();
    store.zero_grads();
    results.push_back(m->run(r.batch(), opt));
    grads.emplace_back(store.flat(Role::Grads).begin(), store.flat(Role::Grads).end());
  }
  EXPECT_EQ(results[0].loss, results[1].loss);
  ASSERT_EQ(grads[0].size(), grads[1].size());
  for (size_t i = 0; i < grads[0].size(); ++i) ASSERT_EQ(grads[0][i], grads[1][i]) << i;
}

TEST(LoraStore, DropoutKeepsItsFractionAndItsGradientsFollowTheLoss) {
  // The masks keep 1 - p of the elements: over n draws the mean is within 5 standard deviations, sqrt(p (1 - p) / n).
  constexpr float kP = 0.25f;
  constexpr int64_t kDraws = 1 << 20;
  int64_t kept = 0;
  for (int64_t i = 0; i < kDraws; ++i) kept += lora_dropout_keeps(42, 7, i % 3, i / 3 % 1000, i / 3000, kP) ? 1 : 0;
  const double fraction = static_cast<double>(kept) / kDraws;
  EXPECT_NEAR(fraction, 1.0 - kP, 5 * std::sqrt(kP * (1 - kP) / kDraws));

  LoraConfig c = lora_config(5);
  c.dropout = 0.3;
  auto m = std::make_unique<Gemma4Model>(Gemma4Config::from_json(kTwoLayers), TensorSet::Storage::Allocated,
                                         std::make_unique<LoraStore>(c));
  m->init_random(3, 0.3f);
  auto& store = dynamic_cast<LoraStore&>(m->params());
  store.init_adapters();
  for (const LoraStore::Adapter& a : store.adapters()) {
    float* B = store.mutable_weight(a.b);
    for (int64_t e = 0; e < a.out * kRank; ++e) B[e] = 0.2f * std::sin(static_cast<float>(e + a.b));
  }
  auto plain = lora_model(5);  // the same weights without dropout
  for (size_t slot = 0; slot < store.size(); ++slot)
    std::copy_n(store.weight(slot), store.info(slot).numel, plain->params().mutable_weight(slot));
  Rows r = rows();
  RunOptions train;
  train.want_grad = true;
  train.dropout_key = 11;
  store.allocate_grads();
  store.zero_grads();
  const double loss = m->run(r.batch(), train).loss;
  // Evaluation (no gradients) has no dropout: the plain model's loss, bit for bit.
  EXPECT_EQ(m->run(r.batch(), RunOptions{}).loss, plain->run(r.batch(), RunOptions{}).loss);
  // Training runs draw their masks from the key alone: the same key, the same loss; another, another.
  EXPECT_EQ(m->run(r.batch(), train).loss, loss);
  RunOptions other = train;
  other.dropout_key = 12;
  EXPECT_NE(m->run(r.batch(), other).loss, loss);
  EXPECT_NE(loss, plain->run(r.batch(), RunOptions{}).loss);
  // The gradients of A and B against a central finite difference of the loss under the same masks (the backward's
  // masks must be the forward's, its dx scaled as its x).
  store.zero_grads();
  m->run(r.batch(), train);
  const std::vector<float> g(store.flat(Role::Grads).begin(), store.flat(Role::Grads).end());
  const LoraStore::Adapter& q1 = store.adapters()[7];
  for (const auto& [slot, e] :
       {std::pair{q1.a, int64_t{5}}, std::pair{q1.b, int64_t{3}}, std::pair{store.adapters()[3].a, int64_t{2}}}) {
    constexpr float kStep = 1e-2f;
    const float keep = store.weight(slot)[e];
    const float analytic = g[static_cast<size_t>(store.info(slot).train_offset + e)];
    store.mutable_weight(slot)[e] = keep + kStep;
    const double up = m->run(r.batch(), train).loss;
    store.mutable_weight(slot)[e] = keep - kStep;
    const double down = m->run(r.batch(), train).loss;
    store.mutable_weight(slot)[e] = keep;
    // As in LossAndAdapterGradientsMatchTheMergedModel.
    constexpr double kFdTol = 2e-3;
    EXPECT_NEAR((up - down) / (2 * kStep), analytic, kFdTol) << store.info(slot).name;
  }
  c.target_parameters = {"experts.down_proj"};
  EXPECT_THROW(LoraStore{c}, rf::Error);  // PEFT's 3-D adapters take no dropout
}

// An adapter directory whose adapter_config.json is missing, not a regular file (a FIFO would block the read forever),
// too large to be one, not JSON, or not a LoRA config is refused in one line naming the file and the problem, before
// any weight file is opened.
TEST(LoraStore, AnAdapterConfigThatIsNotOneIsRefusedByName) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("rf_peft_config_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fs::path config = dir / kPeftConfigFile;
  const auto write = [&](const std::string& text) {
    fs::remove(config);
    std::ofstream(config) << text;
  };
  const auto refusal = [&] { return testing::error_of([&] { read_peft_config(dir.string()); }); };
  const auto names = [&](const std::string& message, const std::string& problem) {
    return message.find(config.string()) != std::string::npos && message.find(problem) != std::string::npos;
  };

  EXPECT_NE(refusal().find(std::string("no ") + kPeftConfigFile), std::string::npos) << refusal();
  ASSERT_EQ(::mkfifo(config.c_str(), 0600), 0);
  EXPECT_TRUE(names(refusal(), "not a regular file")) << refusal();
  write(std::string(io::kMaxConfigFileBytes + 1, ' '));
  EXPECT_TRUE(names(refusal(), "not a JSON config")) << refusal();
  write("{\"peft_type\": \"LORA\", \"r\": 4,");
  EXPECT_TRUE(names(refusal(), "not valid JSON")) << refusal();
  write("{\"peft_type\": \"IA3\", \"r\": 4, \"lora_alpha\": 8}");
  EXPECT_TRUE(names(refusal(), "peft_type is not LORA")) << refusal();
  write("{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 8, \"use_dora\": true}");
  EXPECT_TRUE(names(refusal(), "use_dora is not implemented")) << refusal();
  // get<int> would read 2.5 as 2 and 2^32 + 1 as 1.
  for (const char* r : {"2.5", "4294967297", "\"4\""}) {
    write(std::string("{\"peft_type\": \"LORA\", \"r\": ") + r + ", \"lora_alpha\": 8}");
    EXPECT_TRUE(names(refusal(), std::string("r = ") + r + " is not an integer rank")) << refusal();
  }
  write("{\"peft_type\": \"LORA\", \"r\": 4}");
  EXPECT_TRUE(names(refusal(), "key 'lora_alpha' not found")) << refusal();
  fs::remove_all(dir);
}

// PEFT writes a text model's modules as `model.language_model.X` or `model.X`: both name one adapter. A file holding
// both spellings of one lora_A and no lora_B of that module has as many tensors as adapters need, so only a check of
// which adapter each tensor fills tells that B is missing (it would have kept its zeros).
TEST(LoraStore, AFileNamingOneAdapterTwiceIsRefused) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("rf_peft_twice_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  auto saved = lora_model(11);
  save_peft_adapter(dynamic_cast<const LoraStore&>(saved->params()), kMultimodalTextPrefix, "base", dir.string());
  auto loaded = lora_model(12);
  auto& store = dynamic_cast<LoraStore&>(loaded->params());
  load_peft_adapter(store, dir.string());  // the file as written loads
  const size_t a0 = store.adapters()[0].a;
  EXPECT_EQ(store.weight(a0)[0], saved->params().weight(a0)[0]);
  // An r the tensors do not have is refused before any adapter is sized by it (r = 2e9 ended in std::bad_alloc).
  {
    const fs::path config = dir / kPeftConfigFile;
    std::ifstream in(config);
    nlohmann::json j = nlohmann::json::parse(in);
    in.close();
    j["r"] = 2000000000;
    std::ofstream(config) << j.dump();
    const std::string message = testing::error_of([&] { read_peft_config(dir.string()); });
    EXPECT_NE(message.find(".lora_A.weight` has shape [2, 24], but adapter_config.json gives r = 2000000000"),
              std::string::npos)
        << message;
    j["r"] = kRank;
    j["lora_alpha"] = "8";
    std::ofstream(config) << j.dump();
    EXPECT_NE(testing::error_of([&] { read_peft_config(dir.string()); }).find("lora_alpha = \"8\" is not a number"),
              std::string::npos);
  }

  const fs::path weights = dir / kPeftWeightsFile;
  std::vector<std::byte> image;
  {
    const io::SafetensorsFile file = io::SafetensorsFile::open(weights.string());
    const std::string module = "base_model.model.model.language_model.layers.0.self_attn.q_proj";
    io::SafetensorsWriter w;
    for (const io::TensorView& v : file.tensors()) {
      if (v.name == module + ".lora_B.weight") continue;
      w.add(v.name, v.dtype, v.shape, v.bytes);
      if (v.name == module + ".lora_A.weight")
        w.add("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", v.dtype, v.shape, v.bytes);
    }
    image = w.serialize();
  }
  std::ofstream(weights, std::ios::binary)
      .write(reinterpret_cast<const char*>(image.data()), static_cast<std::streamsize>(image.size()));
  const std::string message = testing::error_of([&] { load_peft_adapter(store, dir.string()); });
  EXPECT_NE(message.find("are the same adapter, model.layers.0.self_attn.q_proj.lora_A.weight"), std::string::npos)
      << message;
  fs::remove_all(dir);
}

// The layers multiply by alpha / r in float32: a scale beyond its range would be inf, and inf times the zero B NaN.
TEST(LoraStore, AnAlphaWhoseScaleOverflowsFloat32IsRefused) {
  LoraConfig c;
  c.rank = 2;
  c.alpha = 1e39;
  EXPECT_NE(testing::error_of([&] {
              c.validate();
            }).find("model.lora.alpha = 1e+39 over rank 2 gives a scale of 5e+38, beyond float32's range"),
            std::string::npos)
      << testing::error_of([&] { c.validate(); });
  c.alpha = 1e38;  // a scale of 5e37 is a float32
  EXPECT_NO_THROW(c.validate());
}

// A target regex is compiled when the config is checked, and one std::regex would match in exponential time (a group
// holding a repetition, repeated: every rank would hang matching it against the module names) is refused.
TEST(LoraStore, ATargetRegexThatCannotBeMatchedIsRefused) {
  LoraConfig c = lora_config(1);
  c.target_regex = true;
  const auto refusal = [&](const std::string& pattern) {
    c.target = {pattern};
    return testing::error_of([&] { c.validate(); });
  };
  EXPECT_NE(refusal("(").find("config: model.lora.target '(' is not a regular expression: "), std::string::npos);
  for (const char* nested : {"((((.*)*)*)*)*x", "(a+)*", "(.*\\.(q|v)_proj)+", "(x(ab*)c)*", "(a{2,})+"})
    EXPECT_NE(refusal(nested).find("repeats a group that holds a repetition"), std::string::npos) << nested;
  // Repetitions side by side, inside brackets or escaped are not nested.
  for (const char* fine :
       {".*\\.(q|v)_proj", "model\\.layers\\.[0-9]+\\.(self_attn|mlp)\\..*", "([*+])*", "(\\*)+", "(ab)*.*"})
    EXPECT_EQ(refusal(fine), "") << fine;
}

}  // namespace
}  // namespace rf::model
