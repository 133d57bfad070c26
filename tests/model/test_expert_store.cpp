// Expert parallelism's placement of the experts (model/expert_store.h), on one process: a rank's store holds its
// EP rank's rows of every expert tensor (weights and AdamW moments, the same values as the whole store's rows), the
// other parameters whole; every rank's rows put back into the whole layout give the whole store's bits; a split that
// does not divide the experts fails naming the tensor; a model takes a store with the same names only.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "model/expert_store.h"
#include "model/gemma4.h"

namespace rf::model {
namespace {

Gemma4Model moe_model() {
  const std::string json = R"({"vocab_size": 32, "hidden_size": 8, "intermediate_size": 12, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "sliding_window": 3,
    "layer_types": ["sliding_attention", "full_attention"], "hidden_size_per_layer_input": 0, "rms_norm_eps": 1e-6,
    "enable_moe_block": true, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 6,
    "tie_word_embeddings": true})";
  Gemma4Model m(Gemma4Config::from_json(json));
  m.init_random(7, 0.5f);
  return m;
}

// Distinct moment values (element i of exp_avg is i, of exp_avg_sq 2i): a row copied to the wrong place shows.
void fill_moments(ParamStore& s) {
  s.allocate_moments();
  const std::span<float> m = s.mutable_flat(Role::ExpAvg), v = s.mutable_flat(Role::ExpAvgSq);
  for (size_t i = 0; i < m.size(); ++i) {
    m[i] = static_cast<float>(i);
    v[i] = static_cast<float>(2 * i);
  }
}

std::vector<float> values(const float* p, int64_t n) { return std::vector<float>(p, p + n); }

TEST(ExpertStore, RanksHoldTheirRowsAndTheWholeComesBack) {
  Gemma4Model m = moe_model();
  ParamStore& whole = m.params();
  fill_moments(whole);
  constexpr int kRanks = 2;  // 4 experts: 2 rows each
  std::vector<std::unique_ptr<ParamStore>> parts;
  for (int r = 0; r < kRanks; ++r) parts.push_back(hold_expert_rows(whole, r, kRanks));
  for (int r = 0; r < kRanks; ++r) {
    const ParamStore& part = *parts[static_cast<size_t>(r)];
    ASSERT_EQ(part.size(), whole.size());
    int experts = 0;
    for (size_t s = 0; s < whole.size(); ++s) {
      const ParamInfo& w = whole.info(s);
      const ParamInfo& p = part.info(s);
      EXPECT_EQ(p.name, w.name);
      EXPECT_EQ(p.holds_part(), is_expert_tensor(w)) << w.name;
      const int64_t first = is_expert_tensor(w) ? r * p.numel : 0;  // element of the whole tensor held first
      if (is_expert_tensor(w)) {
        ++experts;
        EXPECT_EQ(p.shape[0], 2) << w.name;
        EXPECT_EQ(p.numel * kRanks, w.numel) << w.name;
      } else {
        EXPECT_EQ(p.numel, w.numel) << w.name;
      }
      EXPECT_EQ(values(part.weight(s), p.numel), values(whole.weight(s) + first, p.numel)) << w.name;
      for (Role role : {Role::ExpAvg, Role::ExpAvgSq})
        EXPECT_EQ(values(part.moment(role, s), p.numel), values(whole.moment(role, s) + first, p.numel)) << w.name;
    }
    EXPECT_EQ(experts, 4);  // gate_up and down of 2 layers
  }
  // Every rank's rows copied into a store of the whole layout: the whole store's bits.
  const std::unique_ptr<ParamStore> again = whole_registry(*parts[0]);
  again->allocate_weights();
  again->allocate_moments();
  for (const std::unique_ptr<ParamStore>& part : parts) copy_held_rows(*part, *again);
  for (Role role : {Role::Weights, Role::ExpAvg, Role::ExpAvgSq}) {
    const std::span<const float> a = again->flat(role), b = whole.flat(role);
    EXPECT_EQ(std::vector<float>(a.begin(), a.end()), std::vector<float>(b.begin(), b.end())) << role_name(role);
  }
}

TEST(ExpertStore, FrozenExpertsHoldWeightsWithoutMoments) {
  Gemma4Model m = moe_model();
  m.params().freeze({"experts.down_proj"});
  fill_moments(m.params());
  const std::unique_ptr<ParamStore> part = hold_expert_rows(m.params(), 1, 2);
  for (size_t s = 0; s < part->size(); ++s) {
    const ParamInfo& p = part->info(s);
    EXPECT_EQ(p.trainable, m.params().info(s).trainable) << p.name;
    if (p.name.ends_with("experts.down_proj")) {
      EXPECT_EQ(part->moment(Role::ExpAvg, s), nullptr);
    }
  }
  EXPECT_LT(part->trainable_elements(), m.params().trainable_elements());
}

TEST(ExpertStore, ExpertsNotDividingFailNamingTheTensor) {
  Gemma4Model m = moe_model();
  try {
    hold_expert_rows(m.params(), 0, 3);
    FAIL() << "4 experts over 3 ranks must fail";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "expert parallelism: model.layers.0.experts.gate_up_proj's 4 experts do not divide over 3 EP ranks");
  }
}

TEST(ExpertStore, ModelTakesOnlyAStoreWithItsNames) {
  Gemma4Model m = moe_model();
  const std::vector<float> before = values(m.params().flat(Role::Weights).data(), m.params().total_elements());
  m.replace_params(hold_expert_rows(m.params(), 0, 2));
  EXPECT_LT(m.params().total_elements(), static_cast<int64_t>(before.size()));
  auto other = std::make_unique<ReplicatedStore>();
  other->add("something.else", {1});
  try {
    m.replace_params(std::move(other));
    FAIL() << "a store with other names must be refused";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("replace_params: the new store registers 1 parameters"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace rf::model
