// ringflex model: the multimodal Gemma 4 model: its parts registered in one store (see multimodal.h).
#include "model/multimodal.h"

#include <algorithm>
#include <vector>

#include "core/error.h"
#include "io/tensor_access.h"

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

namespace {

// model.train_vision: the tower's parameters are the store's slots, read and written between the store's hooks of
// their group (tower_group), as a decoder layer's; the store is the decoder's current one (a save's stand-in too).
class StoreTowerParams final : public TowerParams {
 public:
  explicit StoreTowerParams(Gemma4Model& decoder) : decoder_(decoder) {}
  void begin(int group, bool backward) override {
    ParamStore& s = decoder_.params();
    if (backward)
      s.before_backward(tower_group(group));
    else
      s.before_forward(tower_group(group));
  }
  void end(int group, bool backward) override {
    ParamStore& s = decoder_.params();
    if (backward)
      s.after_backward(tower_group(group));
    else
      s.after_forward(tower_group(group));
  }
  const float* weight(const std::string& name) override {
    const ParamStore& s = decoder_.params();
    return s.weight(s.slot(name));
  }
  float* grad(const std::string& name) override {
    ParamStore& s = decoder_.params();
    return s.grad(s.slot(name));
  }
  const Bf16Lookup* bf16() override { return &decoder_.params().bf16_weights(); }

 private:
  Gemma4Model& decoder_;
};

}  // namespace

const VisionEncoder* Gemma4Multimodal::vision_tower() {
  if (tower_ || !parts_.vision) return tower_.get();
  const auto kept = [&](const std::string& name) -> std::optional<VisionEncoder::Found> {
    const io::Passthrough::Entry* e = kept_.find(name);
    if (e == nullptr) return std::nullopt;
    return VisionEncoder::Found{e->shape, io::to_float32(io::TensorView{name, e->dtype, e->shape, e->bytes})};
  };
  if (parts_.train_vision) {
    if (!tower_params_) tower_params_ = std::make_unique<StoreTowerParams>(*decoder_);
    tower_ = std::make_unique<VisionEncoder>(*parts_.vision, kept, *tower_params_);
  } else {
    tower_ = std::make_unique<VisionEncoder>(*parts_.vision, kept);
  }
  tower_->set_compute_dtype(vision_dtype_);
  return tower_.get();
}

void Gemma4Multimodal::set_vision_compute_dtype(ComputeDtype t) {
  vision_dtype_ = t;
  if (tower_) tower_->set_compute_dtype(t);
}

void Gemma4Multimodal::adopt_tower_parameters() {
  ParamStore& store = params();
  for (size_t slot = 0; slot < store.size(); ++slot) {
    const ParamInfo& p = store.info(slot);
    if (p.name.rfind(kVisionTowerPrefix, 0) != 0) continue;
    const io::Passthrough::Entry* e = kept_.find(p.name);
    RF_CHECK(e != nullptr && e->shape == p.shape, "model.train_vision: the tower has no tensor `", p.name,
             "` of shape ", io::shape_string(p.shape));
    store.write_weight(slot, io::to_float32(io::TensorView{p.name, e->dtype, e->shape, e->bytes}));
    kept_.drop(p.name);
  }
  tower_.reset();
}

}  // namespace rf::model
