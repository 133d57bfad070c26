// ringflex model: Gemma 4's image preprocessing (see image_processor.h).
#include "model/image_processor.h"

#include <algorithm>
#include <array>
#include <cmath>

#include "core/error.h"

namespace rf::model {

namespace {

constexpr int kChannels = 3;
constexpr std::array<int, 5> kSupportedSoftTokens = {70, 140, 280, 560, 1120};
// Pillow's Resample.c: coefficients in fixed point with 32 - 8 - 2 fraction bits (8 for the result, 2 for the
// filter's negative lobes and overshoot), and bicubic's support and a = -0.5.
constexpr int kPrecisionBits = 32 - 8 - 2;
constexpr double kBicubicSupport = 2.0;
constexpr double kBicubicA = -0.5;
constexpr double kRescale = 1.0 / 255.0;  // the processor's rescale_factor

double bicubic(double x) {
  x = std::fabs(x);
  if (x < 1.0) return ((kBicubicA + 2.0) * x - (kBicubicA + 3.0)) * x * x + 1;
  if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * kBicubicA;
  return 0.0;
}

// One axis of Pillow's resample: for each output index, its first input index, its count, and its fixed-point
// weights (precompute_coeffs + normalize_coeffs_8bpc, box = the whole input).
struct Coeffs {
  int ksize = 0;
  std::vector<int> first, count;
  std::vector<int32_t> k;  // [out, ksize]
};

Coeffs coeffs(int in_size, int out_size) {
  const double scale = static_cast<double>(in_size) / out_size;
  const double filterscale = std::max(scale, 1.0);
  const double support = kBicubicSupport * filterscale;
  Coeffs c;
  c.ksize = static_cast<int>(std::ceil(support)) * 2 + 1;
  c.first.resize(out_size);
  c.count.resize(out_size);
  c.k.assign(static_cast<size_t>(out_size) * c.ksize, 0);
  std::vector<double> w(static_cast<size_t>(c.ksize));
  for (int xx = 0; xx < out_size; ++xx) {
    const double center = (xx + 0.5) * scale;
    const double ss = 1.0 / filterscale;
    const int xmin = std::max(static_cast<int>(center - support + 0.5), 0);  // (int) truncates, as in C
    const int xmax = std::min(static_cast<int>(center + support + 0.5), in_size) - xmin;
    double ww = 0.0;
    for (int x = 0; x < xmax; ++x) {
      w[x] = bicubic((x + xmin - center + 0.5) * ss);
      ww += w[x];
    }
    for (int x = 0; x < xmax; ++x) {
      const double v = ww != 0.0 ? w[x] / ww : w[x];
      const double fixed = v * (1 << kPrecisionBits);
      c.k[static_cast<size_t>(xx) * c.ksize + x] = static_cast<int32_t>(v < 0 ? -0.5 + fixed : 0.5 + fixed);
    }
    c.first[xx] = xmin;
    c.count[xx] = xmax;
  }
  return c;
}

uint8_t clip8(int32_t sum) {  // Pillow's clip8: the integer part of the fixed-point sum, clamped to a byte
  return static_cast<uint8_t>(std::clamp(sum >> kPrecisionBits, 0, 255));
}

}  // namespace

std::pair<int, int> aspect_preserving_size(int height, int width, const ImageProcessorConfig& c,
                                           const std::string& source) {
  const int64_t k = c.pooling_kernel_size, patch = c.patch_size;
  const int64_t max_patches = int64_t{c.max_soft_tokens} * k * k;
  const double total_px = static_cast<double>(height) * width;
  const double target_px = static_cast<double>(max_patches * patch * patch);
  const double factor = std::sqrt(target_px / total_px);
  const double side = static_cast<double>(k * patch);
  int64_t th = static_cast<int64_t>(std::floor(factor * height / side)) * k * patch;
  int64_t tw = static_cast<int64_t>(std::floor(factor * width / side)) * k * patch;
  RF_CHECK(th > 0 || tw > 0, source, ": a ", width, " x ", height, " image resizes to 0 x 0 (sides must be multiples ",
           "of pooling_kernel_size * patch_size = ", k * patch, ")");
  const int64_t max_side = (max_patches / (k * k)) * k * patch;
  if (th == 0) {
    th = k * patch;
    tw = std::min(static_cast<int64_t>(std::floor(static_cast<double>(width) / height)) * k * patch, max_side);
  } else if (tw == 0) {
    tw = k * patch;
    th = std::min(static_cast<int64_t>(std::floor(static_cast<double>(height) / width)) * k * patch, max_side);
  }
  RF_CHECK(static_cast<double>(th * tw) <= target_px, source, ": a ", width, " x ", height, " image resizes to ", tw,
           " x ", th, ", more than ", max_patches, " patches of ", patch, " x ", patch);
  return {static_cast<int>(th), static_cast<int>(tw)};
}

io::RgbImage resize_bicubic(const io::RgbImage& in, int width, int height) {
  io::RgbImage cur = in;
  constexpr int32_t kHalf = int32_t{1} << (kPrecisionBits - 1);  // rounds the fixed-point sum to nearest
  if (width != in.width) {                                       // the horizontal pass first, as Pillow
    const Coeffs c = coeffs(in.width, width);
    io::RgbImage out{width, cur.height, std::vector<uint8_t>(static_cast<size_t>(width) * cur.height * kChannels)};
    for (int y = 0; y < cur.height; ++y)
      for (int xx = 0; xx < width; ++xx) {
        const int32_t* k = c.k.data() + static_cast<size_t>(xx) * c.ksize;
        for (int ch = 0; ch < kChannels; ++ch) {
          int32_t s = kHalf;
          for (int x = 0; x < c.count[xx]; ++x)
            s += cur.rgb[(static_cast<size_t>(y) * cur.width + c.first[xx] + x) * kChannels + ch] * k[x];
          out.rgb[(static_cast<size_t>(y) * width + xx) * kChannels + ch] = clip8(s);
        }
      }
    cur = std::move(out);
  }
  if (height != in.height) {
    const Coeffs c = coeffs(in.height, height);
    io::RgbImage out{cur.width, height, std::vector<uint8_t>(static_cast<size_t>(cur.width) * height * kChannels)};
    for (int yy = 0; yy < height; ++yy) {
      const int32_t* k = c.k.data() + static_cast<size_t>(yy) * c.ksize;
      for (int x = 0; x < cur.width; ++x)
        for (int ch = 0; ch < kChannels; ++ch) {
          int32_t s = kHalf;
          for (int y = 0; y < c.count[yy]; ++y)
            s += cur.rgb[(static_cast<size_t>(c.first[yy] + y) * cur.width + x) * kChannels + ch] * k[y];
          out.rgb[(static_cast<size_t>(yy) * cur.width + x) * kChannels + ch] = clip8(s);
        }
    }
    cur = std::move(out);
  }
  return cur;
}

bool supported_soft_tokens(int64_t soft_tokens) {
  return std::find(kSupportedSoftTokens.begin(), kSupportedSoftTokens.end(), soft_tokens) != kSupportedSoftTokens.end();
}

ProcessedImage preprocess_image(const io::RgbImage& image, const ImageProcessorConfig& c, const std::string& source) {
  RF_CHECK(supported_soft_tokens(c.max_soft_tokens), source, ": max_soft_tokens = ", c.max_soft_tokens,
           " is not one of 70, 140, 280, 560, 1120");
  RF_CHECK(c.patch_size > 0 && c.pooling_kernel_size > 0, source,
           ": patch_size and pooling_kernel_size must be positive");
  const auto [th, tw] = aspect_preserving_size(image.height, image.width, c, source);
  const io::RgbImage resized = th == image.height && tw == image.width ? image : resize_bicubic(image, tw, th);
  const int p = c.patch_size, k = c.pooling_kernel_size;
  const int64_t max_patches = int64_t{c.max_soft_tokens} * k * k, values = int64_t{kChannels} * p * p;
  const int gw = tw / p, gh = th / p;
  ProcessedImage out;
  out.height = th;
  out.width = tw;
  out.soft_tokens = int64_t{gw} * gh / (int64_t{k} * k);
  out.pixels.assign(static_cast<size_t>(max_patches * values), 0.f);
  out.positions.assign(static_cast<size_t>(max_patches * 2), -1);
  for (int py = 0; py < gh; ++py)
    for (int px = 0; px < gw; ++px) {
      const int64_t patch = int64_t{py} * gw + px;
      float* dst = out.pixels.data() + patch * values;
      for (int r = 0; r < p; ++r)
        for (int col = 0; col < p; ++col)
          for (int ch = 0; ch < kChannels; ++ch) {
            const uint8_t v = resized.rgb[(static_cast<size_t>(py * p + r) * tw + px * p + col) * kChannels + ch];
            *dst++ = static_cast<float>(v * kRescale);
          }
      out.positions[2 * patch] = px;
      out.positions[2 * patch + 1] = py;
    }
  return out;
}

}  // namespace rf::model
