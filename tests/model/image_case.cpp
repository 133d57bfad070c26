// Test-only tool behind tests/model/image_parity.py: decodes and preprocesses image files as ringflex does.
//
//     image_case PATCH_SIZE POOLING_KERNEL MAX_SOFT_TOKENS OUT.safetensors IMAGE...
//
// OUT  for image i: image.<i>.rgb [height, width, 3] U8 (decoded), image.<i>.pixel_values [max_patches, 3 *
//      patch^2] F32, image.<i>.position_ids [max_patches, 2] I32 and image.<i>.soft_tokens [1] I64
// Exits 1 with the error's one line on any failure (a bad image names its file).
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "io/image.h"
#include "io/safetensors.h"
#include "model/image_processor.h"

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: image_case PATCH_SIZE POOLING_KERNEL MAX_SOFT_TOKENS OUT.safetensors IMAGE...\n");
    return 2;
  }
  try {
    rf::model::ImageProcessorConfig c;
    c.patch_size = std::stoi(argv[1]);
    c.pooling_kernel_size = std::stoi(argv[2]);
    c.max_soft_tokens = std::stoi(argv[3]);
    std::vector<rf::io::RgbImage> decoded;
    std::vector<rf::model::ProcessedImage> processed;
    std::vector<int64_t> counts;
    for (int i = 5; i < argc; ++i) {
      decoded.push_back(rf::io::read_image(argv[i]));
      processed.push_back(rf::model::preprocess_image(decoded.back(), c, argv[i]));
    }
    for (const auto& p : processed) counts.push_back(p.soft_tokens);
    rf::io::SafetensorsWriter w;
    const int64_t values = 3 * int64_t{c.patch_size} * c.patch_size;
    for (size_t i = 0; i < processed.size(); ++i) {
      const std::string at = "image." + std::to_string(i) + ".";
      const rf::io::RgbImage& d = decoded[i];
      const rf::model::ProcessedImage& p = processed[i];
      w.add(at + "rgb", rf::io::StDType::U8, {d.height, d.width, 3}, std::span<const uint8_t>(d.rgb));
      w.add(at + "pixel_values", rf::io::StDType::F32, {static_cast<int64_t>(p.pixels.size()) / values, values},
            std::span<const float>(p.pixels));
      w.add(at + "position_ids", rf::io::StDType::I32, {static_cast<int64_t>(p.positions.size()) / 2, 2},
            std::span<const int32_t>(p.positions));
      w.add(at + "soft_tokens", rf::io::StDType::I64, {1}, std::span<const int64_t>(&counts[i], 1));
    }
    w.write(argv[4]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
