// ringflex model: Gemma 4 as a multimodal model: the vision tower, the multimodal embedder, the text decoder.
//
// transformers 5.24's Gemma4Model is the same three parts: `vision_tower` (Gemma4VisionModel, vision.h and
// vision_encoder.h), `embed_vision` (Gemma4MultimodalEmbedder: a scale-free RMSNorm of the tower's soft tokens, then
// the linear `embedding_projection` [hidden, F] into the decoder's width) and `language_model` (the text decoder,
// gemma4.h). Gemma4Multimodal is the whole: one ParamStore holds every parameter of every part, registered in
// transformers' save order (the decoder's, then the projection, then with model.train_vision the tower's), so the
// optimizer, the gradient reduction, the checkpoint writer and the memory check see the whole model through it.
//
// The projection runs inside the decoder's embedding step (the decoder calls the embedder it was handed), on the
// image slots this rank's tokens hold: it reads its weight and writes its gradient through the store between the
// store's kGlobalGroup hooks, like the token embedding, so a sharded store and the bf16 compute copies treat it as
// any other global parameter.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "io/passthrough.h"
#include "model/gemma4.h"
#include "model/param_store.h"
#include "model/vision.h"
#include "model/vision_encoder.h"

namespace rf::model {

// Gemma4MultimodalEmbedder for images: y = RMSNorm(x) W^T, RMSNorm without a scale (with_scale = False), eps
// vision_config.rms_norm_eps; x [n, F] the tower's soft tokens (or precomputed features of that width), y [n, H].
class VisionEmbedder {
 public:
  // The projection's name in a multimodal checkpoint (transformers': model.embed_vision.embedding_projection).
  static constexpr const char* kProjection = "model.embed_vision.embedding_projection.weight";

  // Registers the projection [hidden, feature_dim] in `store` (kGlobalGroup, a matmul operand).
  VisionEmbedder(ParamStore& store, int64_t hidden, int64_t feature_dim, double eps);

  size_t slot() const { return slot_; }
  int64_t feature_dim() const { return F_; }

  // raw [n, F] -> normed [n, F], inv_rms [n] (kept for the backward) and out [n, H]; `w` the projection's weight.
  void forward(const Matmul& mm, const float* w, const float* raw, int64_t n, float* normed, float* inv_rms,
               float* out) const;
  // d out [n, H] -> d raw [n, F] (zero on entry), and with `gw` non-null d W accumulated (+=).
  void backward(const Matmul& mm, const float* w, const float* raw, const float* normed, const float* inv_rms,
                const float* dout, int64_t n, float* draw, float* gw) const;

 private:
  size_t slot_;
  int64_t H_, F_;
  float eps_;
};

// What a multimodal model has beside its text decoder.
struct MultimodalParts {
  MultimodalParts() = default;
  explicit MultimodalParts(int feature_dim, std::optional<VisionConfig> tower = std::nullopt, bool train = false)
      : vision_feature_dim(feature_dim), vision(std::move(tower)), train_vision(train) {}

  // F, the width of the image features the embedder projects (the tower's hidden size); 0: no vision embedder, the
  // features arrive in the decoder's hidden size and are placed as they are.
  int vision_feature_dim = 0;
  // The vision tower's config, when the model has one (its tensors: vision.h; in kept() until they train).
  std::optional<VisionConfig> vision;
  // model.train_vision: the tower's parameters (register_vision_tower) join the store after the projection. Needs
  // `vision`.
  bool train_vision = false;
};

class Gemma4Multimodal {
 public:
  // Registers the decoder's parameters (Gemma4Model), then the embedder's projection, then with parts.train_vision
  // the tower's, all in `store` (null: a ReplicatedStore). Storage::Allocated allocates the weights and gives the
  // decoder's scales their initial 1 (the rest is zero until a checkpoint or init_random fills it); Deferred leaves
  // the shapes only (params().allocate_weights() later). Throws rf::Error for train_vision without a vision config.
  explicit Gemma4Multimodal(Gemma4Config text, MultimodalParts parts = {},
                            TensorSet::Storage storage = TensorSet::Storage::Allocated,
                            std::unique_ptr<ParamStore> store = nullptr);
  // A move keeps the parts where they are (the decoder holds the embedder's address); no copy.
  Gemma4Multimodal(Gemma4Multimodal&&) = default;
  Gemma4Multimodal& operator=(Gemma4Multimodal&&) = default;

  Gemma4Model& decoder() { return *decoder_; }
  const Gemma4Model& decoder() const { return *decoder_; }
  // null when the model has no vision embedder.
  const VisionEmbedder* embed_vision() const { return embed_vision_.get(); }
  const MultimodalParts& parts() const { return parts_; }

  // The whole model's parameters (every part's), in the store the decoder object holds and runs on.
  ParamStore& params() { return decoder_->params(); }
  const ParamStore& params() const { return decoder_->params(); }
  // As Gemma4Model::replace_params, for the whole model's store.
  std::unique_ptr<ParamStore> replace_params(std::unique_ptr<ParamStore> store) {
    return decoder_->replace_params(std::move(store));
  }
  // The decoder's (text) config.
  const Gemma4Config& config() const { return decoder_->config(); }
  // F of the vision embedder's input (0: the model has none).
  int vision_feature_dim() const { return parts_.vision_feature_dim; }
  // The width of Batch::image_features: the embedder's input F, or the hidden size without an embedder.
  int image_feature_width() const { return embed_vision_ ? parts_.vision_feature_dim : config().hidden_size; }
  int64_t bf16_weight_bytes() const { return decoder_->bf16_weight_bytes(); }
  TensorSet& buffers() { return decoder_->buffers(); }
  const TensorSet& buffers() const { return decoder_->buffers(); }

  // The files' tensors the model neither computes with nor trains, carried into every checkpoint it writes with the
  // same name, dtype and bits (io/passthrough.h): the audio tower and its embedder model.embed_audio.* (ringflex has
  // no audio code), the vision tower's buffers and, while it is frozen, its parameters, any name ringflex does not
  // know.
  io::Passthrough& kept() { return kept_; }
  const io::Passthrough& kept() const { return kept_; }

  // The vision tower, built by the first call (and the first after drop_vision_tower). With train_vision it holds no
  // weights of its own: its parameters are the store's slots, read and written between the store's hooks of their
  // groups as it computes (vision.h register_vision_tower), so an update needs no rebuild. A frozen tower reads its
  // tensors from kept() into a float32 copy of its own. Null when the model has no vision tower. Throws rf::Error
  // naming a tower tensor that is missing or of the wrong shape.
  const VisionEncoder* vision_tower();
  // What the tower multiplies in (VisionEncoder::set_compute_dtype), from now on: applied to the tower built now and
  // to every one vision_tower() builds later (the trainer hands it model.compute_dtype, so a
  // bf16 run's tower runs in bf16 as its decoder does). Float32 until called.
  void set_vision_compute_dtype(ComputeDtype t);
  ComputeDtype vision_compute_dtype() const { return vision_dtype_; }
  // Frees the tower's float32 copy (a frozen tower, once the data's images are encoded).
  void drop_vision_tower() { tower_.reset(); }
  // train_vision on a fresh model: the tower's parameters, initialised in kept() (vision.h init_vision_tower), move
  // into the store. Throws rf::Error naming a parameter kept() lacks.
  void adopt_tower_parameters();

  // Every slot of the store in registration order, as Gemma4Model::init_random (the tower's last, so the decoder
  // draws the same values with and without train_vision).
  void init_random(uint64_t seed, float stddev) { decoder_->init_random(seed, stddev); }

  // The embedder and the decoder on a batch whose image features are [N, F] (F = image_feature_width()): see
  // Gemma4Model::run; Result::d_image_features is d loss / d those features.
  Result run(const Batch& batch, const RunOptions& opt, AttentionBackend& attn) const {
    return decoder_->run(batch, opt, attn);
  }
  Result run(const Batch& batch, const RunOptions& opt) const { return decoder_->run(batch, opt); }
  void check_batch(const Batch& batch, int ranks = 1, const std::string& source = "batch") const {
    decoder_->check_batch(batch, ranks, source);
  }

 private:
  MultimodalParts parts_;
  std::unique_ptr<Gemma4Model> decoder_;
  std::unique_ptr<VisionEmbedder> embed_vision_;
  io::Passthrough kept_;
  std::unique_ptr<TowerParams> tower_params_;  // train_vision: the store's slots, as the tower reads them
  std::unique_ptr<VisionEncoder> tower_;       // vision_tower(), when built
  ComputeDtype vision_dtype_ = ComputeDtype::Float32;
};

}  // namespace rf::model
