// Test and benchmark helper: a checkpoint's vision tower, and images read from a safetensors file as the tower's
// batch. Shared by tests/model/vision_case (against transformers) and bench/model/bench_vision (timed).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/safetensors.h"
#include "io/tensor_access.h"
#include "model/checkpoint.h"
#include "model/vision_encoder.h"

namespace rf::testing {

// The vision tower of the multimodal checkpoint in `dir` (config.json with a vision_config, the tower under
// model.vision_tower.), loaded as ringflex loads any checkpoint: the tower is what load_checkpoint carries through
// unchanged (model::Gemma4Multimodal::kept). Throws rf::Error naming config.json when it has no vision_config.
inline model::VisionEncoder load_checkpoint_tower(const std::string& dir) {
  const model::Checkpoint ck = model::load_checkpoint(dir);
  const std::string source = dir + "/config.json";
  const std::optional<model::VisionConfig> cfg =
      model::VisionConfig::from_config_json(ck.model->config().source_json, source);
  RF_CHECK(cfg.has_value(), source, ": no vision_config");
  return model::VisionEncoder(*cfg, ck.model->kept());
}

// Images as the image processor lays them out: pixel_values [n, P, 3 * patch^2] F32 and pixel_position_ids
// [n, P, 2] I32 ((-1, -1) for padding patches), held here and viewed as the tower's batch.
struct ImageArrays {
  int n = 0;
  int64_t P = 0;
  std::vector<float> pixels;
  std::vector<int32_t> positions;

  model::VisionBatch view() const {
    model::VisionBatch b;
    b.n = n;
    b.P = P;
    b.pixels = pixels.data();
    b.positions = positions.data();
    return b;
  }
};

inline ImageArrays read_images(const io::SafetensorsFile& in) {
  const io::TensorView& pixels = in.at("pixel_values");
  ImageArrays images;
  images.n = static_cast<int>(pixels.shape.at(0));
  images.P = pixels.shape.at(1);
  images.pixels = io::copy_as<float>(pixels);
  images.positions = io::copy_as<int32_t>(in.at("pixel_position_ids"));
  return images;
}

}  // namespace rf::testing
