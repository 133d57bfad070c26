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
// Float32 by default, bf16 matmuls on request (set_compute_dtype), on the decoder's building blocks: the linears are
// model::gemm (ops.h: blocked sgemm or oneDNN bf16 over the OpenMP threads), attention the project's cpu kernels, and
// the elementwise passes run over the threads, fused where they meet (each q/k/v head's norm, rotation and move to the
// kernels' layout; each post-norm and its residual add). The weights are read from the checkpoint in any float dtype.
// Backward: given d loss / d soft tokens, the gradient of every trainable tower tensor (nn.Parameter in
// transformers: linear weights, norm scales, the patch projection and the position table; the clip bounds and the
// std buffers are buffers, without gradients), from what forward kept on a VisionTape: every layer's activations, or
// with recompute_layers (the trainer's train.recompute, as the decoder's layers) only each layer's input, the layer's
// forward then run again just before its backward (the same code on the same input: the same bits). By default the
// trainer never
// calls it: the tower is frozen, as in every Gemma 4 recipe, and encodes each image of the data once, when the data is
// read (trainer/data.h). With model.train_vision the tower's parameters live in the parameter store and the trainer
// runs forward and backward on every micro-batch's images (model/image_run.h).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/mask.h"
#include "io/passthrough.h"
#include "model/ops.h"
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

// What forward keeps for backward: every layer's activations (float32, a few times the hidden states' size per
// layer), or with recompute_layers each layer's input h_in only (the rest of a Layer stays empty; backward recomputes
// it), beside the patches, the rotary tables and the attention metadata of the whole batch.
struct VisionTape {
  struct LinearTape {
    std::vector<float> x;  // the input the weight saw (clamped; empty without clipping: the caller's input)
    std::vector<float> y;  // the output before its clamp (empty without clipping)
  };
  struct Layer {
    std::vector<float> h_in, a, inv_in;        // layer input, input_layernorm output, its 1/rms
    LinearTape q, k, v, o, gate, up, down;     // the seven projections
    std::vector<float> q_raw, k_raw, v_raw;    // projections before the per-head norms [T, heads, D]
    std::vector<float> inv_q, inv_k, inv_v;    // their 1/rms [T * heads]
    std::vector<float> qh, kh, vh, out, lse;   // attention inputs and outputs, head-major
    std::vector<float> o_tok, attn, inv_attn;  // o_proj input and output, post_attention_layernorm 1/rms
    std::vector<float> h_mid, m, inv_mid;      // MLP input, pre_feedforward_layernorm output and 1/rms
    std::vector<float> g, u, gu, ff, inv_ff;   // MLP activations, down output, its norm's 1/rms
  };
  std::vector<float> scaled;    // [T, 3 * patch^2] the patches as input_proj sees them
  std::vector<bool> pad;        // [T]
  std::vector<float> cos, sin;  // [T, 2, D/4] rotary tables
  std::vector<TokenMeta> meta;  // [T] attention metadata
  std::vector<int64_t> cells;   // [N] the pooling cell of each soft token
  std::vector<int64_t> counts;  // [n] soft tokens of each image
  std::vector<Layer> layers;
  bool recompute_layers = false;  // layers hold their inputs only

  // The bytes of the tape's buffers (their sizes: what forward filled, not the vectors' capacities).
  int64_t bytes() const;
};

// Gradients by full tensor name (model.vision_tower.*), float32, in the tensor's shape, accumulated (+=): what an
// encoder that holds its own weights (a checkpoint's frozen tower, tests) hands back.
using VisionGrads = std::map<std::string, std::vector<float>>;

// Where the tower's parameters are read and their gradients written. The tower works a group at a time (0: the patch
// embedder, 1 + l: encoder layer l; forward 0, 1, ..., backward ..., 1, 0), between begin(group) and end(group); a
// parameter's weight and gradient (by full name) are valid there only. model.train_vision's are the parameter
// store's slots (model/multimodal.h): the groups are the store's tower_group hooks, so a sharded store gathers one
// group at a time and reduces its gradients after its backward, and bf16 working weights are widened as a decoder
// layer's are.
class TowerParams {
 public:
  virtual ~TowerParams() = default;
  virtual void begin(int group, bool backward) = 0;
  virtual void end(int group, bool backward) = 0;
  // float32 values [numel], as the run multiplies them.
  virtual const float* weight(const std::string& name) = 0;
  // The gradient [numel] the backward accumulates into; null: none (frozen, or no gradients).
  virtual float* grad(const std::string& name) = 0;
  // The bf16 compute copies the matmuls find the weights' in (ComputeDtype::Bfloat16), asked once a pass before the
  // first begin.
  virtual const Bf16Lookup* bf16() = 0;
};

class VisionEncoder {
 public:
  // Reads every tower tensor of `c` (vision_tower_tensors, under kVisionTowerPrefix) from `tensors`, widened to
  // float32. Throws rf::Error naming a missing tensor, a shape against the config, or a head_dim the 2-D rotary
  // embedding cannot split (it must be a multiple of 4).
  VisionEncoder(VisionConfig c, const io::Passthrough& tensors);
  // The tower's tensors from anywhere (model.train_vision: the parameters from the parameter store, the buffers from
  // the passthrough tensors): `find(full name)` returns the tensor's shape and float32 values, or nullopt when it has
  // none. Throws as above.
  struct Found {
    std::vector<int64_t> shape;
    std::vector<float> values;
  };
  using Lookup = std::function<std::optional<Found>(const std::string& name)>;
  VisionEncoder(VisionConfig c, const Lookup& find);
  // The parameters (TowerTensor::parameter) read from `params` as each group computes, none copied (`params` must
  // outlive the encoder); the buffers (clip bounds, standardize) copied from `buffers`. Throws as above.
  VisionEncoder(VisionConfig c, const Lookup& buffers, TowerParams& params);
  ~VisionEncoder();
  VisionEncoder(VisionEncoder&&) noexcept;
  VisionEncoder& operator=(VisionEncoder&&) noexcept;

  const VisionConfig& config() const { return cfg_; }

  // What the tower's matmuls multiply in (ops.h ComputeDtype; Float32 until this is called). Bfloat16, as the
  // decoder's bf16 mode: every linear's operands are rounded to bf16 (the weights once: an encoder holding its own
  // makes a bf16 copy of each here, half its float32 bytes; the store's slots have the store's compute copies,
  // TowerParams::bf16; an activation that several linears read, once for them all) with float32
  // accumulation, and attention reads q, k and v rounded to bf16 (float32 storage on the float32 kernels); the norms,
  // rotary embedding, softmax, residual stream and pooling stay float32. backward multiplies its linears the same way.
  // The copies belong to this object's weights: call it again on a copy of the encoder.
  void set_compute_dtype(ComputeDtype t);
  ComputeDtype compute_dtype() const { return dtype_; }

  // Throws rf::Error (naming `source`) for a batch the tower cannot pool: P not a multiple of pooling_kernel_size^2,
  // a position outside the position table, a padding patch with only one coordinate -1.
  // The checks forward makes before any work, alone: a job that splits its images over ranks runs them on every
  // rank, so that a bad image fails everywhere and not only where it is encoded.
  void check(const VisionBatch& b, const std::string& source = "images") const;

  // With `tape`, keeps what backward needs: every layer's activations, or with recompute_layers each layer's input
  // only (backward runs each layer's forward again: one [n * P, hidden] buffer a layer kept instead of some 26, or 49
  // with clipped linears, at Gemma 4's tower shapes, for one more forward of the tower).
  VisionOutput forward(const VisionBatch& b, const std::string& source = "images", VisionTape* tape = nullptr,
                       bool recompute_layers = false) const;

  // The bytes forward leaves on a tape for `images` images of P patches each (padding patches included: the tower
  // computes on them too), all but the [N] pooling cells and [n] counts (N depends on each image's grid). With
  // recompute_layers backward holds one layer's activations beside these while it differentiates that layer. -1 when
  // the size overflows int64 (MemoryBreakdown's overflow).
  static int64_t tape_bytes(const VisionConfig& c, int64_t images, int64_t P, bool recompute_layers);

  // Accumulates into `grads` the gradient of every trainable tower tensor, given d loss / d soft tokens
  // ([N, hidden_size], N as forward returned) for the batch `tape` was recorded on. A recompute_layers tape: each
  // layer's forward runs again from its kept input just before that layer's backward, into one set of buffers that
  // serves every layer and is freed on return.
  void backward(const VisionBatch& b, const VisionTape& tape, const float* d_soft_tokens, VisionGrads& grads) const;
  // The same into the TowerParams' gradients (the store's slots, a group at a time between its hooks).
  void backward(const VisionBatch& b, const VisionTape& tape, const float* d_soft_tokens) const;
  // The TowerParams' begin and end of every group in a forward's (backward: a backward's) order, with no work: a rank
  // with no images of its own joins a store's collective hooks so (a sharded store's gathers and reductions, to which
  // it contributes zero gradients).
  void join_hooks(bool backward) const;

 private:
  // A group's weights as one pass reads them (pointers into the TowerParams' storage, valid between its begin and
  // end), beside the clip bounds, which are buffers the encoder keeps.
  struct Linear {
    const float* w = nullptr;  // [out, in]
    int64_t n = 0;             // out * in
    std::string name;          // the weight's full name
    float in_min, in_max, out_min, out_max;
  };
  struct Layer {
    const float *input_norm = nullptr, *post_attention_norm = nullptr, *pre_feedforward_norm = nullptr,
                *post_feedforward_norm = nullptr;  // [H]
    Linear q, k, v, o, gate, up, down;
    const float *q_norm = nullptr, *k_norm = nullptr;  // [head_dim]
    std::string prefix;                                // "model.vision_tower.encoder.layers.<l>."
  };
  class OwnedParams;
  // Checks the parameters `find` has against the config (the owned encoder's) and reads the buffers.
  void read_buffers(const Lookup& find);
  // Encoder layer l's weights from params_ (between its group's begin and end).
  Layer layer_view(int l) const;
  std::vector<float> take(const Lookup& find, const std::string& name, const std::vector<int64_t>& shape) const;
  Linear take_bounds(const Lookup& find, const std::string& name, int64_t in, int64_t out) const;
  // The forward's reusable buffers for the bf16 mode on sgemm (widen_on_sgemm): an activation and a weight rounded to
  // bf16 values, held in float32. Sized by the first layer, reused by the others (model::gemm would allocate both
  // afresh in every call, a page fault per 4 KiB of them).
  struct Widened {
    std::vector<float> x, w;
  };
  // Whether the bf16 mode multiplies bf16-rounded float32 operands on sgemm (model::gemm's choice where oneDNN's bf16
  // matmul does not pay, ops.h), which forward then rounds itself into Widened buffers.
  bool widen_on_sgemm() const;
  // x[0, n) as the matmul takes it: rounded to bf16 values into wide.x with widen_on_sgemm, else x itself.
  const float* rounded(const float* x, int64_t n, Widened& wide) const;
  // y[T, out] = x[T, in] W^T in this encoder's dtype, T = images x P rows, one matmul per image; x from rounded().
  void project(const Matmul& mm, const float* x, const float* W, int64_t n, float* y, int64_t T, int64_t P, int64_t in,
               int64_t out, Widened& wide) const;
  // y = clamp(clamp(x) W^T) (no clamps without clipped linears); tape.x gets the clamped input, and with `keep`
  // tape.y the output before its clamp. x_rounded: rounded(x) when the caller made it once for several linears.
  void clipped_linear(const Matmul& mm, const Linear& l, const float* x, float* y, int64_t T, int64_t P, int64_t in,
                      int64_t out, VisionTape::LinearTape& tape, bool keep, Widened& wide,
                      const float* x_rounded = nullptr) const;
  // One encoder layer on h [n * P, H], in place (its input in, its output out), its activations into S: with `keep`
  // everything backward reads (the layer's input and MLP input, the clipped linears' outputs before their clamps),
  // else only the buffers the computation itself needs (S then serves every layer). The rotary tables and attention
  // metadata are the tape's.
  void layer_forward(const Layer& L, const VisionTape& tape, int n, int64_t P, std::vector<float>& h,
                     VisionTape::Layer& S, bool keep, Widened& wide) const;
  // dx += (d/dx of the clamped linear) dy, dW += ...; x the caller's input (the clamp's gradient is 1 inside the
  // bounds, 0 outside, as torch.clamp's).
  void clipped_linear_backward(const Linear& l, const float* x, const VisionTape::LinearTape& tape, const float* dy,
                               float* dx, float* dW, int64_t T, int64_t in, int64_t out) const;

  // The pooling cell of each of image `img`'s P patches (padding: cell 0, as transformers clamps it to (0, 0)).
  std::vector<int64_t> pool_cells(const VisionBatch& b, int img) const;

  VisionConfig cfg_;
  std::vector<Layer> layers_;  // the clip bounds and names; the weights' pointers filled by layer_view
  std::vector<float> std_bias_, std_scale_;
  std::vector<float> inv_freq_;  // [head_dim / 4]: the rotary frequencies of one axis
  ComputeDtype dtype_ = ComputeDtype::Float32;
  std::unique_ptr<OwnedParams> owned_;  // the encoder's own float32 weights and bf16 copies, or null
  TowerParams* params_ = nullptr;       // owned_, or the caller's
  Matmul matmul() const;                // how this encoder's linears multiply
};

}  // namespace rf::model
