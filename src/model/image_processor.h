// ringflex model: Gemma 4's image preprocessing (transformers 5.24's Gemma4ImageProcessorPil), RGB to patches.
//
// Per image, as the processor does:
//   1. the aspect-preserving size: scale the image to about max_patches = max_soft_tokens * k^2 patches
//      (k = pooling_kernel_size), each side floored to a multiple of k * patch_size (a side that would become 0 is
//      k * patch_size and the other floor(ratio) * k * patch_size, capped);
//   2. Pillow's bicubic resize to that size (Resample.c's separable filter, support widened by the scale when
//      shrinking, coefficients in 22-bit fixed point, a horizontal pass then a vertical one, each rounded to 8 bits),
//      skipped when the size is unchanged;
//   3. rescale by 1/255 (in double, stored as float32), no normalisation (Gemma 4 takes pixels in [0, 1]);
//   4. patchify: patch_size x patch_size squares in row-major grid order, each flattened as [row][column][channel];
//      positions (x, y) in the patch grid; padded to max_patches with zero pixels and position (-1, -1).
// The soft-token count of an image is its patch count / k^2. The result is what VisionEncoder takes
// (vision_encoder.h), bit for bit what the processor gives for the same RGB pixels.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "io/image.h"

namespace rf::model {

// Whether Gemma4ImageProcessor supports `soft_tokens` as its max_soft_tokens: 70, 140, 280, 560 or 1120.
bool supported_soft_tokens(int64_t soft_tokens);

struct ImageProcessorConfig {
  int patch_size = 16;
  int pooling_kernel_size = 3;
  int max_soft_tokens = 280;  // one of 70, 140, 280, 560, 1120 (Gemma4ImageProcessor's supported counts)
};

struct ProcessedImage {
  int height = 0, width = 0;       // after the resize
  int64_t soft_tokens = 0;         // patches / k^2
  std::vector<float> pixels;       // [max_patches, 3 * patch_size^2]
  std::vector<int32_t> positions;  // [max_patches, 2]
};

// Gemma4's get_aspect_ratio_preserving_size: {height, width}. Throws rf::Error (naming `source`) where the processor
// raises: an image too small or too thin to keep one k * patch_size square, or a result over the patch budget.
std::pair<int, int> aspect_preserving_size(int height, int width, const ImageProcessorConfig& c,
                                           const std::string& source);

// Pillow's Image.resize(..., BICUBIC) of an RGB image.
io::RgbImage resize_bicubic(const io::RgbImage& in, int width, int height);

// Throws rf::Error naming `source` for an unsupported max_soft_tokens or a size the processor rejects.
ProcessedImage preprocess_image(const io::RgbImage& image, const ImageProcessorConfig& c, const std::string& source);

}  // namespace rf::model
