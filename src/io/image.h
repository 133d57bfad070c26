// ringflex io: image files (PNG and JPEG) decoded to 8-bit RGB, as the Gemma 4 image processor sees them.
//
// Decoded with the system's libpng and libjpeg (Debian: libpng-dev, libjpeg-dev; libjpeg-turbo behind the latter),
// the same libraries Pillow wraps, and converted to RGB as transformers' processor converts a Pillow image
// (do_convert_rgb, image_transforms.convert_to_rgb): a palette expands to its colours, grey is repeated into the
// three channels, 16-bit samples keep their high byte (but 16-bit grey, Pillow's mode I;16, is clamped to 255, as
// Pillow converts that mode), sub-byte grey is scaled to 8 bits, and an image with any transparency (an alpha channel,
// or a tRNS chunk's palette alphas or colour key) is composited onto opaque white with Pillow's alpha_composite
// arithmetic. The image is then turned upright by its EXIF orientation (a JPEG's APP1
// segment, a PNG's eXIf chunk), as transformers' load_image does with Pillow's ImageOps.exif_transpose for every file
// it reads (a photo taken sideways is stored sideways, with orientation 6 or 8). The format is recognised by its
// signature, not by the file name.
//
// Every problem is one rf::Error naming the file: missing or unreadable, not a PNG or JPEG, truncated or corrupt
// (whatever the decoder reports), zero-sized, or larger than kMaxImagePixels (a decompression bomb: a few KiB of
// PNG can claim gigapixels).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace rf::io {

// Far above any photograph a model is fed (Gemma 4 resizes every image to at most 1120 soft tokens, ~1 MP), and
// small enough that the decoded buffer stays below 1 GiB.
inline constexpr int64_t kMaxImagePixels = int64_t{1} << 28;

struct RgbImage {
  int width = 0, height = 0;
  std::vector<uint8_t> rgb;  // [height, width, 3] row-major
};

// Throws rf::Error "<path>: <problem>".
RgbImage read_image(const std::string& path);

}  // namespace rf::io
