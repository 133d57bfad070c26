// The parameter store: its registry's offsets in each arena, padded shards for any element count and rank count,
// freezing (no gradient, no moments, a compact layout), the version that keeps the bf16 compute copies current, and
// the layer hooks as the model calls them (each layer's gradients final at its after_backward).
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "model/gemma4.h"
#include "model/param_store.h"

namespace rf::model {
namespace {

// Four parameters of awkward sizes over two layers and the global group; two are matmul operands.
void register_four(ParamStore& s) {
  s.add("embed", {5, 3}, kGlobalGroup, false);  // a lookup table: no bf16 copy
  s.add("layers.0.w", {7, 3}, 0, true);
  s.add("layers.0.norm", {3}, 0, false);
  s.add("layers.1.w", {2, 5}, 1, true);
}

TEST(ParamStore, OffsetsAreRegistrationOrderInEachArena) {
  ReplicatedStore s;
  register_four(s);
  EXPECT_EQ(s.size(), 4u);
  EXPECT_EQ(s.total_elements(), 15 + 21 + 3 + 10);
  EXPECT_EQ(s.weight_bytes(), 49 * 4);
  const std::vector<int64_t> offsets = {0, 15, 36, 39};
  for (size_t i = 0; i < s.size(); ++i) {
    EXPECT_EQ(s.info(i).offset, offsets[i]) << s.info(i).name;
    EXPECT_EQ(s.info(i).train_offset, offsets[i]) << "all trainable: the same layout";
  }
  EXPECT_EQ(s.info(0).bf16_offset, -1);
  EXPECT_EQ(s.info(1).bf16_offset, 0);
  EXPECT_EQ(s.info(2).bf16_offset, -1);
  EXPECT_EQ(s.info(3).bf16_offset, 21);
  EXPECT_EQ(s.bf16_bytes(), (21 + 10) * 2);
  EXPECT_TRUE(s.info(1).decays());
  EXPECT_FALSE(s.info(2).decays());
  EXPECT_EQ(s.group(0), (std::vector<size_t>{1, 2}));
  EXPECT_EQ(s.group(kGlobalGroup), (std::vector<size_t>{0}));
  EXPECT_EQ(s.slot("layers.0.norm"), 2u);
  EXPECT_THROW(s.slot("nope"), rf::Error);
  EXPECT_THROW(s.add("embed", {1}), rf::Error);  // a name twice

  s.allocate_weights();
  for (size_t i = 0; i < s.size(); ++i) EXPECT_EQ(s.weight(i), s.flat(Role::Weights).data() + offsets[i]);
  EXPECT_EQ(s.flat(Role::Weights).size(), 49u);
  EXPECT_THROW(s.add("late", {1}), rf::Error);  // the layout is fixed once memory exists
  EXPECT_TRUE(s.flat(Role::Grads).empty());     // nothing until asked for
  EXPECT_EQ(s.grad(1), nullptr);
  s.allocate_grads();
  for (size_t i = 0; i < s.size(); ++i) EXPECT_EQ(s.grad(i), s.flat(Role::Grads).data() + offsets[i]);
}

TEST(ParamStore, DeferredWeightsHaveShapesButNoMemory) {
  ReplicatedStore s;
  register_four(s);
  EXPECT_FALSE(s.weights_allocated());
  EXPECT_TRUE(s.flat(Role::Weights).empty());
  EXPECT_THROW(s.weight(0), rf::Error);
  const TensorSet shapes = s.snapshot(Role::Weights);
  EXPECT_EQ(shapes[1].shape, (std::vector<int64_t>{7, 3}));
  EXPECT_FALSE(shapes.allocated(1));
}

// Every element count against N = 1..8 ranks: the shards are consecutive, cover [0, n) exactly once, and are at
// most the padded size ceil(n / N), which N buffers of hold all n (no count has to divide).
TEST(ParamStore, ShardsArePaddedForAnyCount) {
  for (int64_t n : {0, 1, 2, 3, 5, 7, 8, 13, 64, 97, 1000003}) {
    for (int N = 1; N <= 8; ++N) {
      int64_t next = 0;
      for (int r = 0; r < N; ++r) {
        const Shard sh = shard_of(n, r, N);
        EXPECT_EQ(sh.padded, (n + N - 1) / N);
        EXPECT_EQ(sh.begin, next) << n << " over " << N << ", rank " << r;
        EXPECT_GE(sh.size(), 0);
        EXPECT_LE(sh.size(), sh.padded);
        next = sh.end;
      }
      EXPECT_EQ(next, n) << n << " over " << N;
      EXPECT_GE(shard_of(n, 0, N).padded * N, n);
    }
  }
  EXPECT_THROW(shard_of(5, 2, 2), rf::Error);
  EXPECT_THROW(shard_of(5, 0, 0), rf::Error);

  // A store's arena shards in the same way: rank r's span starts where rank r - 1's ended.
  ReplicatedStore s;
  register_four(s);
  s.allocate_weights();
  s.allocate_grads();
  for (int N = 1; N <= 8; ++N) {
    const float* expect = s.flat(Role::Grads).data();
    size_t covered = 0;
    for (int r = 0; r < N; ++r) {
      const std::span<float> part = s.shard(Role::Grads, r, N);
      if (!part.empty()) {
        EXPECT_EQ(part.data(), expect);
      }
      expect += part.size();
      covered += part.size();
    }
    EXPECT_EQ(covered, 49u) << N;
  }
}

TEST(ParamStore, FrozenParametersHaveNoGradientAndNoMoments) {
  ReplicatedStore s;
  register_four(s);
  s.allocate_weights();
  s.allocate_grads();
  s.allocate_moments();
  s.freeze({"norm", "embed"});
  // The training state of the old layout is dropped; the new one is compact over the trainable parameters.
  EXPECT_FALSE(s.has_grads());
  EXPECT_FALSE(s.has_moments());
  EXPECT_EQ(s.trainable_elements(), 21 + 10);
  EXPECT_EQ(s.trainable_bytes(), 31 * 4);
  EXPECT_EQ(s.info(0).train_offset, -1);
  EXPECT_EQ(s.info(1).train_offset, 0);
  EXPECT_EQ(s.info(2).train_offset, -1);
  EXPECT_EQ(s.info(3).train_offset, 21);
  s.allocate_grads();
  s.allocate_moments();
  for (Role role : {Role::Grads, Role::ExpAvg, Role::ExpAvgSq}) EXPECT_EQ(s.flat(role).size(), 31u) << role_name(role);
  EXPECT_EQ(s.grad(0), nullptr);
  EXPECT_EQ(s.grad(2), nullptr);
  EXPECT_EQ(s.moment(Role::ExpAvg, 2), nullptr);
  EXPECT_EQ(s.grad(3), s.flat(Role::Grads).data() + 21);
  EXPECT_EQ(s.moment(Role::ExpAvgSq, 3), s.flat(Role::ExpAvgSq).data() + 21);
  EXPECT_FALSE(s.snapshot(Role::Grads).allocated(0));
  EXPECT_TRUE(s.snapshot(Role::Grads).allocated(1));
  EXPECT_EQ(s.trainable_after({}), (std::vector<bool>{false, true, false, true}));
  EXPECT_THROW(s.freeze({"absent"}), rf::Error);
  // The same flags again keep the training state (nothing to lay out again).
  s.freeze({"norm"});
  EXPECT_TRUE(s.has_grads());
}

// ZeRO-1's view: the moments of one range of the trainable layout, and where that range lies in the weights.
TEST(ParamStore, MomentRangeKeepsOverlappingValuesAndMapsToTheWeights) {
  ReplicatedStore s;
  register_four(s);
  s.allocate_weights();
  s.freeze({"layers.0.norm"});  // trainable layout: embed [0, 15), layers.0.w [15, 36), layers.1.w [36, 46)
  EXPECT_EQ(s.moment_range().begin, 0);
  EXPECT_EQ(s.moment_range().end, 46);
  s.allocate_moments();
  for (size_t i = 0; i < 46; ++i) s.mutable_flat(Role::ExpAvg)[i] = static_cast<float>(i);
  const Shard second = shard_of(46, 1, 3);  // [16, 32)
  s.set_moment_range(second.begin, second.end);
  EXPECT_EQ(s.flat(Role::ExpAvg).size(), 16u);
  EXPECT_EQ(s.flat(Role::ExpAvgSq).size(), 16u);
  for (size_t i = 0; i < 16; ++i) EXPECT_EQ(s.flat(Role::ExpAvg)[i], static_cast<float>(16 + i));
  EXPECT_EQ(s.moment(Role::ExpAvg, 1), nullptr);  // layers.0.w is only partly inside
  // Widening keeps what it held and zeroes the rest.
  s.set_moment_range(10, 46);
  EXPECT_EQ(s.flat(Role::ExpAvg)[0], 0.f);
  EXPECT_EQ(s.flat(Role::ExpAvg)[6], 16.f);
  EXPECT_EQ(s.moment(Role::ExpAvg, 1), s.flat(Role::ExpAvg).data() + 5);
  EXPECT_THROW(s.set_moment_range(10, 47), rf::Error);

  const std::vector<ParamStore::Segment> segs = s.trainable_segments(second.begin, second.end);
  ASSERT_EQ(segs.size(), 1u);
  EXPECT_EQ(segs[0].slot, 1u);
  EXPECT_EQ(segs[0].first, 1);
  EXPECT_EQ(segs[0].n, 16);
  const std::vector<ParamStore::Segment> across = s.trainable_segments(12, 40);  // embed's end to layers.1.w's start
  ASSERT_EQ(across.size(), 3u);
  EXPECT_EQ(across[0].slot, 0u);
  EXPECT_EQ(across[0].first, 12);
  EXPECT_EQ(across[0].n, 3);
  EXPECT_EQ(across[1].slot, 1u);
  EXPECT_EQ(across[1].n, 21);
  EXPECT_EQ(across[2].slot, 3u);
  EXPECT_EQ(across[2].train_index, 36);
  EXPECT_EQ(across[2].n, 4);
  // A new trainable layout starts over with all of it.
  s.freeze({"embed"});
  EXPECT_EQ(s.moment_range().end, 31);
}

TEST(ParamStore, VersionMovesOnlyWithWritesAndKeepsTheBf16CopiesCurrent) {
  ReplicatedStore s;
  register_four(s);
  s.allocate_weights();
  s.allocate_grads();
  uint64_t v = s.version();
  // Reading, and writing anything but the weights, leaves the version.
  (void)s.weight(1);
  (void)s.flat(Role::Weights);
  s.mutable_flat(Role::Grads)[0] = 1.f;
  s.grad(1)[0] = 2.f;
  s.zero_grads();
  EXPECT_EQ(s.version(), v);
  float* w = s.mutable_weight(1);
  EXPECT_GT(s.version(), v);
  for (int64_t e = 0; e < 21; ++e) w[e] = 1.f + static_cast<float>(e) / 1024.f;  // not all exact in bf16
  v = s.version();

  const Bf16Lookup& copies = s.bf16_weights();
  const bf16* c = copies.find(s.weight(1), 21);
  ASSERT_NE(c, nullptr);
  for (int64_t e = 0; e < 21; ++e) EXPECT_EQ(c[e].bits, float_to_bf16(s.weight(1)[e]).bits) << e;
  EXPECT_EQ(copies.find(s.weight(1) + 3, 18), c + 3);    // an operand inside a weight
  EXPECT_EQ(copies.find(s.weight(1) + 3, 19), nullptr);  // one past its end: not this weight's copy
  EXPECT_EQ(copies.find(s.weight(0), 1), nullptr);       // a lookup table has no copy
  EXPECT_EQ(copies.find(s.weight(2), 1), nullptr);       // nor has a norm scale
  const std::vector<float> elsewhere(4);
  EXPECT_EQ(copies.find(elsewhere.data(), 1), nullptr);  // outside the arena
  EXPECT_EQ(s.version(), v);                             // rounding reads the weights

  // A write through the store, and the next request rounds again.
  s.mutable_flat(Role::Weights)[15] = 3.0f;  // layers.0.w[0]
  EXPECT_GT(s.version(), v);
  EXPECT_EQ(s.bf16_weights().find(s.weight(1), 1)[0].bits, float_to_bf16(3.0f).bits);
  const WeightView view = s.weight_view(3, ComputeDtype::Bfloat16);
  EXPECT_EQ(view.f32, s.weight(3));
  EXPECT_NE(view.b16, nullptr);
  EXPECT_EQ(s.weight_view(3, ComputeDtype::Float32).b16, nullptr);
}

// A store that records the model's hook calls and, at each after_backward, that layer's gradients.
class RecordingStore final : public ReplicatedStore {
 public:
  std::vector<std::string> calls;
  std::vector<TensorSet> at_backward_end;  // per call of after_backward: the whole gradient set then

  void before_forward(int layer) override { calls.push_back("F" + std::to_string(layer)); }
  void after_forward(int layer) override { calls.push_back("f" + std::to_string(layer)); }
  void before_backward(int layer) override { calls.push_back("B" + std::to_string(layer)); }
  void after_backward(int layer) override {
    calls.push_back("b" + std::to_string(layer));
    at_backward_end.push_back(snapshot(Role::Grads));
  }
};

const char* const kTwoLayers = R"({"vocab_size": 40, "hidden_size": 16, "intermediate_size": 24,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 3,
  "layer_types": ["sliding_attention", "full_attention"], "final_logit_softcapping": 4.0,
  "hidden_size_per_layer_input": 0, "rms_norm_eps": 1e-6})";

// One row of 12 tokens of kTwoLayers' vocabulary (40): ids and labels drawn by two strides.
struct TwelveTokenRow {
  std::vector<int32_t> ids, labels;
  TwelveTokenRow() : ids(12), labels(12) {
    for (int i = 0; i < 12; ++i) {
      ids[static_cast<size_t>(i)] = (i * 7 + 1) % 40;
      labels[static_cast<size_t>(i)] = (i * 5 + 2) % 40;
    }
  }
  Batch batch() const {
    Batch b;
    b.B = 1;
    b.S = 12;
    b.input_ids = ids.data();
    b.labels = labels.data();
    return b;
  }
};

TEST(ParamStore, ModelCallsTheLayerHooksAndEachLayersGradientsAreFinalAtItsEnd) {
  auto owned = std::make_unique<RecordingStore>();
  RecordingStore& store = *owned;
  Gemma4Model m(Gemma4Config::from_json(kTwoLayers), TensorSet::Storage::Allocated, std::move(owned));
  m.init_random(3, 0.3f);
  // Registered by layer: each decoder layer's slots in its group, the rest global.
  for (size_t slot : store.group(1)) EXPECT_EQ(store.info(slot).name.rfind("model.layers.1.", 0), 0u);
  EXPECT_EQ(store.info(store.slot("model.embed_tokens.weight")).layer, kGlobalGroup);
  EXPECT_TRUE(store.info(store.slot("model.embed_tokens.weight")).matmul);  // tied: also the head

  const TwelveTokenRow row;
  const Batch b = row.batch();
  (void)m.run(b, RunOptions{});
  EXPECT_EQ(store.calls, (std::vector<std::string>{"F-1", "F0", "f0", "F1", "f1", "f-1"}));

  store.calls.clear();
  RunOptions opt;
  opt.want_grad = true;
  (void)m.run(b, opt);
  EXPECT_EQ(store.calls, (std::vector<std::string>{"F-1", "F0", "f0", "F1", "f1", "B1", "b1", "B0", "b0", "b-1"}));
  // At a layer's after_backward its gradients are what the run ends with (a sharded store reduce-scatters them
  // there); layer 0's were still zero when layer 1 ended.
  ASSERT_EQ(store.at_backward_end.size(), 3u);
  const TensorSet final_grads = store.snapshot(Role::Grads);
  for (int layer : {1, 0}) {
    const TensorSet& then = store.at_backward_end[layer == 1 ? 0 : 1];
    for (size_t slot : store.group(layer)) EXPECT_EQ(then[slot].data, final_grads[slot].data) << then[slot].name;
  }
  double layer0_when_layer1_ended = 0;
  for (size_t slot : store.group(0))
    for (float g : store.at_backward_end[0][slot].data) layer0_when_layer1_ended += std::abs(g);
  EXPECT_EQ(layer0_when_layer1_ended, 0.0);
}

// model.param_dtype = bfloat16 (param_store.h): the run reads every weight rounded to bf16 from the float32 masters, so
// its loss and its float32 gradients are those of a float32 model whose weights are those rounded values (the
// oracle: a second model holding them, read as they are), in either compute dtype (in bf16 the working copy's bits are
// the operands themselves, which the float32 model's copies round to again); the masters are left as they were and
// read outside the hooks.
TEST(ParamStore, Bf16WorkingWeightsAreTheRoundedMastersAndGradientsStayFloat32) {
  const Gemma4Config cfg = Gemma4Config::from_json(kTwoLayers);
  Gemma4Model working(cfg, TensorSet::Storage::Allocated);
  working.init_random(3, 0.3f);
  working.params().set_param_dtype(ParamDtype::Bfloat16);
  const std::span<const float> masters = working.params().flat(Role::Weights);
  const std::vector<float> before(masters.begin(), masters.end());
  Gemma4Model rounded(cfg, TensorSet::Storage::Allocated);
  const std::span<float> r = rounded.params().mutable_flat(Role::Weights);
  int64_t moved = 0;  // masters that bf16 does not represent: the rounding is exercised
  for (size_t i = 0; i < r.size(); ++i) {
    r[i] = bf16_to_float(float_to_bf16(before[i]));
    moved += r[i] != before[i];
  }
  EXPECT_GT(moved, static_cast<int64_t>(r.size()) / 2);

  const TwelveTokenRow row;
  const Batch b = row.batch();
  for (ComputeDtype compute : {ComputeDtype::Float32, ComputeDtype::Bfloat16}) {
    RunOptions opt;
    opt.want_grad = true;
    opt.compute_dtype = compute;
    working.params().zero_grads();
    rounded.params().zero_grads();
    const Result got = working.run(b, opt);
    const Result want = rounded.run(b, opt);
    EXPECT_EQ(got.loss, want.loss) << compute_dtype_name(compute);
    const std::span<const float> g = working.params().flat(Role::Grads), w = rounded.params().flat(Role::Grads);
    EXPECT_EQ(std::vector<float>(g.begin(), g.end()), std::vector<float>(w.begin(), w.end()))
        << compute_dtype_name(compute);
  }
  const std::span<const float> after = working.params().flat(Role::Weights);
  EXPECT_EQ(std::vector<float>(after.begin(), after.end()), before);
  ParamStore& store = working.params();
  const size_t q = store.slot("model.layers.0.self_attn.q_proj.weight");
  const int64_t at = store.info(q).offset, n = store.info(q).numel;
  EXPECT_EQ(store.weight(q), after.data() + at) << "outside the hooks";
  // Between layer 0's hooks: the rounded values, and a bf16 run's lookup gives the working copy's bits.
  store.before_forward(0);
  const bf16* bits = store.bf16_weights().find(store.weight(q), n);
  ASSERT_NE(bits, nullptr);
  for (int64_t e = 0; e < n; ++e) {
    ASSERT_EQ(store.weight(q)[e], r[static_cast<size_t>(at + e)]) << e;
    ASSERT_EQ(bits[e].bits, float_to_bf16(before[static_cast<size_t>(at + e)]).bits) << e;
  }
  store.after_forward(0);
  EXPECT_EQ(store.weight(q), after.data() + at) << "after the hooks";
}

}  // namespace
}  // namespace rf::model
