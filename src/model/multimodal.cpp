// ringflex model: the multimodal Gemma 4 model: its parts registered in one store (see multimodal.h).
#include "model/multimodal.h"

#include <vector>

#include "core/error.h"

namespace rf::model {

VisionEmbedder::VisionEmbedder(ParamStore& store, int64_t hidden, int64_t feature_dim, double eps)
    : slot_(store.add(kProjection, {hidden, feature_dim}, kGlobalGroup, true)),
      H_(hidden),
      F_(feature_dim),
      eps_(static_cast<float>(eps)) {}

void VisionEmbedder::forward(const Matmul& mm, const float* w, const float* raw, int64_t n, float* normed,
                             float* inv_rms, float* out) const {
  rmsnorm_forward(raw, nullptr, eps_, normed, inv_rms, n, F_);
  linear_forward(mm, normed, w, out, n, F_, H_);
}

void VisionEmbedder::backward(const Matmul& mm, const float* w, const float* raw, const float* normed,
                              const float* inv_rms, const float* dout, int64_t n, float* draw, float* gw) const {
  std::vector<float> dnormed(static_cast<size_t>(n * F_), 0.f);  // [n, F]
  linear_backward(mm, normed, w, dout, dnormed.data(), gw, n, F_, H_);
  rmsnorm_backward(raw, nullptr, inv_rms, dnormed.data(), draw, nullptr, n, F_);
}

Gemma4Multimodal::Gemma4Multimodal(Gemma4Config text, MultimodalParts parts, TensorSet::Storage storage,
                                   std::unique_ptr<ParamStore> store)
    : parts_(std::move(parts)) {
  RF_CHECK(parts_.vision_feature_dim >= 0, "vision feature dim must be non-negative, not ", parts_.vision_feature_dim);
  RF_CHECK(!parts_.train_vision || parts_.vision, "model.train_vision, but the model has no vision tower");
  const int64_t H = text.hidden_size;
  const double eps = text.vision_rms_norm_eps;
  // transformers' order: the decoder's parameters, the embedder's, the tower's.
  decoder_ = std::make_unique<Gemma4Model>(std::move(text), TensorSet::Storage::Deferred, std::move(store));
  if (parts_.vision_feature_dim > 0) {
    embed_vision_ = std::make_unique<VisionEmbedder>(decoder_->params(), H, parts_.vision_feature_dim, eps);
    decoder_->set_vision_embedder(embed_vision_.get());
  }
  if (parts_.train_vision) register_vision_tower(decoder_->params(), *parts_.vision);
  if (storage == TensorSet::Storage::Deferred) return;
  decoder_->params().allocate_weights();
  decoder_->init_scales();
}

}  // namespace rf::model
