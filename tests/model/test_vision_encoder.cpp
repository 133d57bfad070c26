// Tests of the vision encoder's layer recompute (VisionEncoder::forward's recompute_layers): the tape keeps each
// layer's input only and the backward runs each layer's forward again before differentiating it. It is the forward's
// own code on the same input, so the soft tokens and every gradient are the bits of a tape that keeps everything
// (whose gradients tests/model/vision_parity.py holds against transformers in float64), in float32 and in the bf16
// mode, with and without clipped linears; and the tape's size against VisionEncoder::tape_bytes, its estimate.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "model/vision.h"
#include "model/vision_encoder.h"

namespace rf::model {
namespace {

// A tiny tower: three layers (a recompute between layers, not only of one), grouped-query attention, pooling 2 x 2.
VisionConfig tiny_tower(bool clipped) {
  VisionConfig c;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_layers = 3;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.pooling_kernel_size = 2;
  c.patch_size = 2;
  c.position_embedding_size = 8;
  c.use_clipped_linears = clipped;
  c.standardize = true;
  return c;
}

// Every tower tensor drawn at random (init_vision_tower's ones and zeros would leave the norms and the position table
// without effect): weights N(0, 0.3), scales 1 + N(0, 0.1), the clip bounds at +-kInputBound / +-kOutputBound, tight
// enough that some inputs and outputs are clamped (so the clamps' masks reach the gradients).
constexpr float kInputBound = 1.5f, kOutputBound = 0.8f;
VisionEncoder random_tower(const VisionConfig& c) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::map<std::string, VisionEncoder::Found> all;
  for (const TowerTensor& t : vision_tower_tensors(c)) {
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    std::vector<float> v(static_cast<size_t>(numel));
    for (float& x : v) {
      if (t.name.ends_with("input_min"))
        x = -kInputBound;
      else if (t.name.ends_with("input_max"))
        x = kInputBound;
      else if (t.name.ends_with("output_min"))
        x = -kOutputBound;
      else if (t.name.ends_with("output_max"))
        x = kOutputBound;
      else if (t.init == TowerInit::Ones)
        x = 1.f + 0.1f * normal(rng);
      else
        x = 0.3f * normal(rng);
    }
    all[kVisionTowerPrefix + t.name] = VisionEncoder::Found{t.shape, std::move(v)};
  }
  return VisionEncoder(c, [&](const std::string& name) -> std::optional<VisionEncoder::Found> {
    const auto it = all.find(name);
    if (it == all.end()) return std::nullopt;
    return it->second;
  });
}

// Two images of P = 16 patches: a whole 4 x 4 grid, and a 4 x 2 grid padded with 8 padding patches.
struct Images {
  static constexpr int kImages = 2;
  static constexpr int64_t kPatches = 16;
  std::vector<float> pixels;
  std::vector<int32_t> positions;

  explicit Images(const VisionConfig& c) {
    std::mt19937 rng(5);
    std::uniform_real_distribution<float> unit(0.f, 1.f);
    const int64_t values = 3 * int64_t{c.patch_size} * c.patch_size;
    pixels.resize(static_cast<size_t>(kImages * kPatches * values));
    for (float& x : pixels) x = unit(rng);
    constexpr int kSide = 4;
    for (int p = 0; p < kPatches; ++p) positions.insert(positions.end(), {p % kSide, p / kSide});
    for (int p = 0; p < kPatches; ++p) {
      const bool valid = p < kPatches / 2;
      positions.insert(positions.end(), {valid ? p % kSide : -1, valid ? p / kSide : -1});
    }
  }
  VisionBatch batch() const { return VisionBatch{kImages, kPatches, pixels.data(), positions.data()}; }
};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// The tape's bytes that tape_bytes leaves out: the [N] pooling cells and [n] counts.
int64_t pooling_bytes(const VisionTape& t) {
  return static_cast<int64_t>((t.cells.size() + t.counts.size()) * sizeof(int64_t));
}

void expect_recompute_gives_the_kept_bits(bool clipped, ComputeDtype dtype) {
  const VisionConfig c = tiny_tower(clipped);
  VisionEncoder tower = random_tower(c);
  tower.set_compute_dtype(dtype);
  const Images images(c);
  const VisionBatch b = images.batch();
  VisionTape kept, inputs;
  const VisionOutput whole = tower.forward(b, "test", &kept), light = tower.forward(b, "test", &inputs, true);
  EXPECT_FALSE(kept.recompute_layers);
  EXPECT_TRUE(inputs.recompute_layers);
  ASSERT_EQ(whole.counts, (std::vector<int64_t>{4, 2}));  // the padded image pools to 2 cells
  EXPECT_TRUE(same_bits(whole.soft_tokens, light.soft_tokens));
  EXPECT_TRUE(same_bits(whole.soft_tokens, tower.forward(b, "test").soft_tokens)) << "without a tape";

  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> d_soft(whole.soft_tokens.size());
  for (float& x : d_soft) x = normal(rng);
  VisionGrads from_kept, from_inputs;
  tower.backward(b, kept, d_soft.data(), from_kept);
  tower.backward(b, inputs, d_soft.data(), from_inputs);
  ASSERT_EQ(from_kept.size(), from_inputs.size());
  int64_t nonzero = 0;
  for (const auto& [name, g] : from_kept) {
    ASSERT_EQ(from_inputs.count(name), 1u) << name;
    EXPECT_TRUE(same_bits(g, from_inputs.at(name))) << name;
    for (float x : g) nonzero += x != 0.f;
  }
  EXPECT_GT(nonzero, 0);
  // The tapes' sizes: tape_bytes to the byte (but the pooling's [N] cells and [n] counts), and the recomputing tape
  // keeps one [T, hidden] input a layer where the other keeps every activation.
  EXPECT_EQ(kept.bytes() - pooling_bytes(kept), VisionEncoder::tape_bytes(c, b.n, b.P, false));
  EXPECT_EQ(inputs.bytes() - pooling_bytes(inputs), VisionEncoder::tape_bytes(c, b.n, b.P, true));
  const size_t T = static_cast<size_t>(b.n * b.P);
  ASSERT_EQ(inputs.layers.size(), static_cast<size_t>(c.num_layers));
  for (const VisionTape::Layer& S : inputs.layers) {
    EXPECT_EQ(S.h_in.size(), T * static_cast<size_t>(c.hidden_size));
    EXPECT_TRUE(S.a.empty() && S.q.x.empty() && S.qh.empty() && S.g.empty() && S.h_mid.empty());
  }
  EXPECT_LT(inputs.bytes(), kept.bytes() / 4);
}

TEST(VisionEncoderRecompute, SameBitsFloat32) { expect_recompute_gives_the_kept_bits(false, ComputeDtype::Float32); }
TEST(VisionEncoderRecompute, SameBitsFloat32Clipped) {
  expect_recompute_gives_the_kept_bits(true, ComputeDtype::Float32);
}
TEST(VisionEncoderRecompute, SameBitsBf16) { expect_recompute_gives_the_kept_bits(false, ComputeDtype::Bfloat16); }
TEST(VisionEncoderRecompute, SameBitsBf16Clipped) {
  expect_recompute_gives_the_kept_bits(true, ComputeDtype::Bfloat16);
}

}  // namespace
}  // namespace rf::model
