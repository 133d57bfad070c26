// Test-only tool behind tests/model/vision_parity.py: runs the C++ vision encoder on a checkpoint's tower.
//
//     vision_case CHECKPOINT_DIR IMAGES.safetensors OUT.safetensors [COMPUTE_DTYPE]
//
// CHECKPOINT_DIR  a multimodal Gemma 4 checkpoint (config.json with a vision_config, the tower under
//                 model.vision_tower.), loaded as ringflex loads any checkpoint: the tower is what load_checkpoint
//                 carries through unchanged (model::Checkpoint::passthrough)
// IMAGES          pixel_values [n, P, 3 * patch^2] F32 and pixel_position_ids [n, P, 2] I32, as the image processor
//                 lays them out ((-1, -1) for padding patches)
//                 and, optionally, d_soft_tokens [N, hidden_size] F32: then the backward runs too
// OUT             soft_tokens [N, hidden_size] F32 and counts [n] I64; with d_soft_tokens, grad.<name> of every
//                 trainable tower tensor (its checkpoint name) F32
// COMPUTE_DTYPE   float32 (the default) or bfloat16: what the encoder's matmuls multiply in (set_compute_dtype)
// Exits 1 with the error's one line on any failure.
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "common/vision_tower.h"
#include "io/safetensors.h"
#include "io/tensor_access.h"
#include "model/vision_encoder.h"

int main(int argc, char** argv) {
  if (argc != 4 && argc != 5) {
    std::fprintf(stderr, "usage: vision_case CHECKPOINT_DIR IMAGES.safetensors OUT.safetensors [COMPUTE_DTYPE]\n");
    return 2;
  }
  try {
    rf::model::VisionEncoder encoder = rf::testing::load_checkpoint_tower(argv[1]);
    if (argc == 5) encoder.set_compute_dtype(rf::model::parse_compute_dtype(argv[4]));
    const rf::io::SafetensorsFile in = rf::io::SafetensorsFile::open(argv[2]);
    const rf::testing::ImageArrays images = rf::testing::read_images(in);
    const rf::model::VisionBatch b = images.view();
    rf::model::VisionTape tape;
    const rf::model::VisionOutput out = encoder.forward(b, argv[2], &tape);
    rf::model::VisionGrads grads;
    std::vector<float> d_soft;
    if (const rf::io::TensorView* d = in.find("d_soft_tokens")) {
      d_soft = rf::io::copy_as<float>(*d);
      if (d_soft.size() != out.soft_tokens.size()) throw rf::Error("d_soft_tokens does not match the soft tokens");
      encoder.backward(b, tape, d_soft.data(), grads);
    }
    rf::io::SafetensorsWriter w;
    for (const auto& [name, g] : grads)
      w.add("grad." + name, rf::io::StDType::F32, {static_cast<int64_t>(g.size())}, std::span<const float>(g));
    const int64_t H = encoder.config().hidden_size;
    w.add("soft_tokens", rf::io::StDType::F32, {static_cast<int64_t>(out.soft_tokens.size()) / H, H},
          std::span<const float>(out.soft_tokens));
    w.add("counts", rf::io::StDType::I64, {static_cast<int64_t>(out.counts.size())},
          std::span<const int64_t>(out.counts));
    w.write(argv[3]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
