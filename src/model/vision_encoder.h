// ringflex model: Gemma 4's vision encoder, forward (transformers 5.24's Gemma4VisionModel.forward).
//
// Images arrive as the image processor leaves them: each image a padded sequence of P patches, a patch the
// 3 * patch_size^2 pixel values in [0, 1] of one patch_size x patch_size square, with its (x, y) position in the
// patch grid; padding patches have position (-1, -1). Per image, in order:
//   1. patch embedding: input_proj(2 * (pixels - 0.5)) + table[0][x] + table[1][y] (the 2-D position table; padding
//      patches get no position term);
//   2. num_layers encoder layers: h += post_attention_norm(attention(input_norm(h))), then
//      h += post_feedforward_norm(mlp(pre_feedforward_norm(h))). Attention: q/k/v projections, per-head RMSNorm of
//      q and k (with scales) and of v (without), 2-D rotary embedding on q and k (the first half of each head
//      rotated by the x position, the second by y, rotate_half within each half, theta = rope_theta), scale 1,
//      bidirectional over the image's valid patches (padding keys are masked; the project's attention kernels with
//      doc = 1 for a valid patch and 0 for padding, so images never see each other); the MLP is
//      down(gelu_tanh(gate(x)) * up(x)). With use_clipped_linears every projection clamps its input and its output
//      to the checkpoint's bounds;
//   3. pooling: padding patches zeroed, then, when P exceeds the soft-token count P / k^2 (k = pooling_kernel_size),
//      the mean over each k x k cell of the grid (cell = x / k + (max_x / k) * (y / k), max_x the image's widest x
//      + 1); the cells no patch falls in are dropped. Then the sqrt(hidden_size) scale, and with standardize
//      (h - std_bias) * std_scale.
// The result is the images' soft tokens, one row per kept cell, image after image: what Gemma4MultimodalEmbedder
// (ringflex's vision projection, gemma4.h) takes as image features.
//
// Float32 throughout (the model's ops, ops.h); the weights are read from the checkpoint in any float dtype.
// Backward (model.train_vision) is not implemented: the tower is frozen, as in every Gemma 4 recipe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "io/passthrough.h"
#include "model/vision.h"

namespace rf::model {

// A batch of images for the tower: n images of P patches each (padded to the longest).
struct VisionBatch {
  int n = 0;                           // images
  int64_t P = 0;                       // patches per image, padding included
  const float* pixels = nullptr;       // [n, P, 3 * patch_size^2], values in [0, 1]
  const int32_t* positions = nullptr;  // [n, P, 2] (x, y) in the patch grid; (-1, -1) marks a padding patch
};

struct VisionOutput {
  std::vector<float> soft_tokens;  // [N, hidden_size], N = the sum of `counts`
  std::vector<int64_t> counts;     // [n] soft tokens of each image
};

class VisionEncoder {
 public:
  // Reads every tower tensor of `c` (vision_tower_tensors, under kVisionTowerPrefix) from `tensors`, widened to
  // float32. Throws rf::Error naming a missing tensor, a shape against the config, or a head_dim the 2-D rotary
  // embedding cannot split (it must be a multiple of 4).
  VisionEncoder(VisionConfig c, const io::Passthrough& tensors);

  const VisionConfig& config() const { return cfg_; }

  // Throws rf::Error (naming `source`) for a batch the tower cannot pool: P not a multiple of pooling_kernel_size^2,
  // a position outside the position table, a padding patch with only one coordinate -1.
  VisionOutput forward(const VisionBatch& b, const std::string& source = "images") const;

 private:
  struct Linear {
    std::vector<float> w;  // [out, in]
    float in_min, in_max, out_min, out_max;
  };
  struct Layer {
    std::vector<float> input_norm, post_attention_norm, pre_feedforward_norm, post_feedforward_norm;  // [H]
    Linear q, k, v, o, gate, up, down;
    std::vector<float> q_norm, k_norm;  // [head_dim]
  };
  std::vector<float> take(const io::Passthrough& tensors, const std::string& name,
                          const std::vector<int64_t>& shape) const;
  Linear take_linear(const io::Passthrough& tensors, const std::string& name, int64_t in, int64_t out) const;
  void clipped_linear(const Linear& l, const float* x, float* y, int64_t T, int64_t in, int64_t out) const;

  VisionConfig cfg_;
  std::vector<Layer> layers_;
  std::vector<float> input_proj_;  // [H, 3 * patch^2]
  std::vector<float> pos_table_;   // [2, position_embedding_size, H]
  std::vector<float> std_bias_, std_scale_;
  std::vector<float> inv_freq_;  // [head_dim / 4]: the rotary frequencies of one axis
};

}  // namespace rf::model
