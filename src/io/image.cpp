// ringflex io: PNG and JPEG decoding to RGB (see image.h).
//
// Both libraries report errors by longjmp (libpng through png_error, libjpeg through error_exit): each decoder keeps
// its setjmp in one function whose locals are declared before it, records the library's message, and turns it into
// an rf::Error after the jump, once the library's state is destroyed; no C++ exception crosses a C frame.
#include "io/image.h"

#include <jpeglib.h>
// After jpeglib.h, which it needs: the message codes (JWRN_JPEG_EOF).
#include <jerror.h>
#include <png.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>

#include "core/error.h"

namespace rf::io {

namespace {

constexpr size_t kChannels = 3;
constexpr std::array<unsigned char, 8> kPngSignature = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
constexpr std::array<unsigned char, 3> kJpegSignature = {0xff, 0xd8, 0xff};  // SOI, then any marker
constexpr size_t kMessageBytes = 200;  // JMSG_LENGTH_MAX and libpng's messages fit

struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};

void check_size(const std::string& path, int64_t width, int64_t height) {
  RF_CHECK(width > 0 && height > 0, path, ": the image is ", width, " x ", height, " pixels (zero-sized)");
  RF_CHECK(width * height <= kMaxImagePixels, path, ": the image claims ", width, " x ", height,
           " pixels, more than the ", kMaxImagePixels, " read");
}

// RGBA [n, 4] composited onto opaque white, as transformers' convert_to_rgb does with Pillow's alpha_composite
// (AlphaComposite.c's integer arithmetic: 7 fraction bits, rounded divisions by 255). With an opaque white
// background its general formula reduces to coef1 = 128 a, coef2 = 128 (255 - a).
std::vector<uint8_t> over_white(const std::vector<uint8_t>& rgba) {
  constexpr uint32_t kBits = 7, kWhite = 255;
  const auto div255 = [](uint32_t v) { return ((v >> 8) + v) >> 8; };  // Pillow's SHIFTFORDIV255
  std::vector<uint8_t> rgb(rgba.size() / (kChannels + 1) * kChannels);
  for (size_t i = 0, o = 0; i < rgba.size(); i += kChannels + 1, o += kChannels) {
    const uint32_t a = rgba[i + kChannels];
    const uint32_t coef1 = a * kWhite * kWhite * (1u << kBits) / (kWhite * kWhite);
    const uint32_t coef2 = kWhite * (1u << kBits) - coef1;
    for (size_t c = 0; c < kChannels; ++c) {
      const uint32_t tmp = rgba[i + c] * coef1 + kWhite * coef2;
      rgb[o + c] = a == 0 ? kWhite : static_cast<uint8_t>(div255(tmp + (0x80u << kBits)) >> kBits);
    }
  }
  return rgb;
}

// ---------------------------------------------------------------------------------------------------------------
// PNG (libpng's classic API: its transforms give Pillow's RGB conversion; the simplified API converts 16-bit and
// gamma-tagged files to sRGB, which Pillow does not)
// ---------------------------------------------------------------------------------------------------------------

struct PngError {
  char message[kMessageBytes] = "";
};

void png_fail(png_structp png, png_const_charp message) {
  auto* e = static_cast<PngError*>(png_get_error_ptr(png));
  std::snprintf(e->message, sizeof e->message, "%s", message);
  png_longjmp(png, 1);
}

void png_ignore_warning(png_structp, png_const_charp) {}

RgbImage decode_png(std::FILE* f, const std::string& path) {
  PngError error;
  png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &error, png_fail, png_ignore_warning);
  png_infop info = png ? png_create_info_struct(png) : nullptr;
  RF_CHECK(png && info, path, ": cannot start the PNG decoder (out of memory)");
  RgbImage img;
  std::vector<png_bytep> rows;
  if (setjmp(png_jmpbuf(png))) {
    png_destroy_read_struct(&png, &info, nullptr);
    fail(path, ": not a valid PNG file (", error.message, ")");
  }
  png_init_io(png, f);
  png_read_info(png, info);
  const png_uint_32 width = png_get_image_width(png, info), height = png_get_image_height(png, info);
  if (int64_t{width} * height > kMaxImagePixels) png_error(png, "more pixels than ringflex reads");
  const int depth = png_get_bit_depth(png, info), type = png_get_color_type(png, info);
  // transformers composites any transparency (an alpha channel, or a tRNS chunk: palette alphas or a colour key)
  // onto white; the rest converts straight to RGB.
  const bool alpha = (type & PNG_COLOR_MASK_ALPHA) || png_get_valid(png, info, PNG_INFO_tRNS);
  const size_t channels = alpha ? kChannels + 1 : kChannels;
  if (type == PNG_COLOR_TYPE_PALETTE) png_set_palette_to_rgb(png);
  if (type == PNG_COLOR_TYPE_GRAY && depth < 8) png_set_expand_gray_1_2_4_to_8(png);
  if (png_get_valid(png, info, PNG_INFO_tRNS)) png_set_tRNS_to_alpha(png);
  if (depth == 16) png_set_strip_16(png);  // the high byte, as Pillow's 16-bit unpackers
  if (type == PNG_COLOR_TYPE_GRAY || type == PNG_COLOR_TYPE_GRAY_ALPHA) png_set_gray_to_rgb(png);
  png_set_interlace_handling(png);
  png_read_update_info(png, info);
  if (png_get_rowbytes(png, info) != width * channels) png_error(png, "unexpected row layout after conversion");
  img.width = static_cast<int>(width);
  img.height = static_cast<int>(height);
  img.rgb.resize(size_t{width} * height * channels);
  rows.resize(height);
  for (png_uint_32 y = 0; y < height; ++y) rows[y] = img.rgb.data() + size_t{y} * width * channels;
  png_read_image(png, rows.data());
  png_read_end(png, nullptr);
  png_destroy_read_struct(&png, &info, nullptr);
  if (alpha) img.rgb = over_white(img.rgb);
  return img;
}

// ---------------------------------------------------------------------------------------------------------------
// JPEG
// ---------------------------------------------------------------------------------------------------------------

struct JpegError {
  jpeg_error_mgr mgr;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX] = "";
};

[[noreturn]] void jpeg_fail(j_common_ptr c) {
  auto* e = reinterpret_cast<JpegError*>(c->err);
  (*c->err->format_message)(c, e->message);
  std::longjmp(e->jump, 1);
}

// Warnings are ignored as Pillow ignores them, except a file that ends early: libjpeg fills the rest with grey and
// goes on, Pillow refuses the file as truncated, and so does ringflex.
void jpeg_message(j_common_ptr c, int level) {
  if (level < 0 && c->err->msg_code == JWRN_JPEG_EOF) jpeg_fail(c);
}

RgbImage decode_jpeg(std::FILE* f, const std::string& path) {
  jpeg_decompress_struct cinfo{};
  JpegError error{};
  cinfo.err = jpeg_std_error(&error.mgr);
  error.mgr.error_exit = jpeg_fail;
  error.mgr.emit_message = jpeg_message;
  RgbImage img;
  if (setjmp(error.jump)) {
    jpeg_destroy_decompress(&cinfo);
    fail(path, ": not a valid JPEG file (", error.message, ")");
  }
  jpeg_create_decompress(&cinfo);
  jpeg_stdio_src(&cinfo, f);
  jpeg_read_header(&cinfo, TRUE);
  if (cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK) {
    std::snprintf(error.message, sizeof error.message, "CMYK JPEGs are not supported");
    std::longjmp(error.jump, 1);
  }
  if (int64_t{cinfo.image_width} * cinfo.image_height > kMaxImagePixels) {
    std::snprintf(error.message, sizeof error.message, "more pixels than ringflex reads");
    std::longjmp(error.jump, 1);
  }
  cinfo.out_color_space = JCS_RGB;  // grey repeated into the three channels, as Pillow's convert("RGB")
  jpeg_start_decompress(&cinfo);
  img.width = static_cast<int>(cinfo.output_width);
  img.height = static_cast<int>(cinfo.output_height);
  img.rgb.resize(size_t{cinfo.output_width} * cinfo.output_height * kChannels);
  while (cinfo.output_scanline < cinfo.output_height) {
    JSAMPROW row = img.rgb.data() + size_t{cinfo.output_scanline} * cinfo.output_width * kChannels;
    jpeg_read_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_decompress(&cinfo);
  jpeg_destroy_decompress(&cinfo);
  return img;
}

}  // namespace

RgbImage read_image(const std::string& path) {
  // fopen of a FIFO waits for a writer forever (on every rank: each one reads every image), and a directory opens
  // and reads nothing: an image is a regular file.
  std::error_code ec;
  RF_CHECK(!std::filesystem::exists(path, ec) || std::filesystem::is_regular_file(path, ec), path,
           ": not a regular file (a FIFO, device or directory is no image)");
  std::unique_ptr<std::FILE, FileCloser> f(std::fopen(path.c_str(), "rb"));
  RF_CHECK(f != nullptr, path, ": cannot open the image: ", std::strerror(errno));
  std::array<unsigned char, kPngSignature.size()> head{};
  const size_t got = std::fread(head.data(), 1, head.size(), f.get());
  RF_CHECK(got > 0, path, ": an empty file, not an image");
  std::rewind(f.get());
  RgbImage img;
  if (got >= kPngSignature.size() && std::equal(kPngSignature.begin(), kPngSignature.end(), head.begin())) {
    img = decode_png(f.get(), path);
  } else if (got >= kJpegSignature.size() && std::equal(kJpegSignature.begin(), kJpegSignature.end(), head.begin())) {
    img = decode_jpeg(f.get(), path);
  } else {
    fail(path, ": not a PNG or JPEG image (its first bytes are neither signature)");
  }
  check_size(path, img.width, img.height);
  return img;
}

}  // namespace rf::io
