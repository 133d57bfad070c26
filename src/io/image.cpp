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
#include <utility>

#include "core/error.h"

namespace rf::io {

namespace {

constexpr size_t kChannels = 3;
constexpr std::array<unsigned char, 8> kPngSignature = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
constexpr std::array<unsigned char, 3> kJpegSignature = {0xff, 0xd8, 0xff};  // SOI, then any marker
constexpr size_t kMessageBytes = 200;         // JMSG_LENGTH_MAX and libpng's messages fit
constexpr int kExifMarker = JPEG_APP0 + 1;    // APP1, where a JPEG keeps its EXIF
constexpr unsigned kMaxMarkerBytes = 0xffff;  // a marker segment's largest payload: keep APP1 whole

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

// The TIFF block of an EXIF payload: past its "Exif\0\0" header where it has one (a JPEG's APP1 segment always does, a
// PNG's eXIf chunk should not but some writers add it, and Pillow takes both).
constexpr std::array<unsigned char, 6> kExifHeader = {'E', 'x', 'i', 'f', 0, 0};
std::pair<const unsigned char*, size_t> skip_exif_header(const unsigned char* data, size_t n) {
  if (n >= kExifHeader.size() && std::equal(kExifHeader.begin(), kExifHeader.end(), data))
    return {data + kExifHeader.size(), n - kExifHeader.size()};
  return {data, n};
}

// The EXIF orientation (tag 0x0112 of IFD0) of a TIFF-structured EXIF block (a JPEG's APP1 segment after its
// "Exif\0\0" header, a PNG's eXIf chunk), as Pillow's Image.getexif() reads it; 1 (as stored) when the block has no
// such tag, is malformed, or gives it another type or count (Pillow's exif_transpose then leaves the image alone).
int exif_orientation(std::pair<const unsigned char*, size_t> block) {
  const auto [tiff, n] = block;
  constexpr int kAsStored = 1;
  constexpr uint16_t kOrientationTag = 0x0112, kShort = 3;
  constexpr size_t kHeader = 8, kEntry = 12;
  if (n < kHeader) return kAsStored;
  const bool little = tiff[0] == 'I' && tiff[1] == 'I';
  if (!little && !(tiff[0] == 'M' && tiff[1] == 'M')) return kAsStored;
  const auto u16 = [&](size_t at) {
    return static_cast<uint16_t>(little ? tiff[at] | tiff[at + 1] << 8 : tiff[at] << 8 | tiff[at + 1]);
  };
  const auto u32 = [&](size_t at) {
    return little ? uint32_t{u16(at)} | uint32_t{u16(at + 2)} << 16 : uint32_t{u16(at)} << 16 | u16(at + 2);
  };
  if (u16(2) != 42) return kAsStored;  // the TIFF magic number
  const size_t ifd = u32(4);
  if (ifd > n || n - ifd < 2) return kAsStored;
  const size_t entries = u16(ifd);
  for (size_t e = 0; e < entries; ++e) {
    const size_t at = ifd + 2 + e * kEntry;
    if (at > n || n - at < kEntry) return kAsStored;
    if (u16(at) != kOrientationTag) continue;
    return u16(at + 2) == kShort && u32(at + 4) == 1 ? u16(at + 8) : kAsStored;
  }
  return kAsStored;
}

// The image turned upright as Pillow's ImageOps.exif_transpose turns it (transformers' load_image does, for every file
// it reads): orientation 2 mirrors, 3 rotates by 180 degrees, 4 flips, 5 transposes, 6 rotates by 90 degrees
// clockwise, 7 transverses, 8 rotates by 90 degrees counter-clockwise; any other value leaves it as stored.
void apply_orientation(RgbImage& img, int orientation) {
  constexpr int kMirror = 2, kCounterClockwise = 8;
  if (orientation < kMirror || orientation > kCounterClockwise) return;
  const int64_t W = img.width, H = img.height;
  const bool swapped = orientation >= 5;  // 5..8 exchange the axes
  const int64_t ow = swapped ? H : W, oh = swapped ? W : H;
  std::vector<uint8_t> out(img.rgb.size());
  for (int64_t y = 0; y < oh; ++y)
    for (int64_t x = 0; x < ow; ++x) {
      int64_t r = 0, c = 0;  // the stored pixel that lands at (x, y)
      switch (orientation) {
        case 2:
          r = y, c = W - 1 - x;
          break;
        case 3:
          r = H - 1 - y, c = W - 1 - x;
          break;
        case 4:
          r = H - 1 - y, c = x;
          break;
        case 5:
          r = x, c = y;
          break;
        case 6:
          r = H - 1 - x, c = y;
          break;
        case 7:
          r = H - 1 - x, c = W - 1 - y;
          break;
        default:
          r = x, c = W - 1 - y;
          break;  // 8
      }
      std::memcpy(&out[(y * ow + x) * kChannels], &img.rgb[(r * W + c) * kChannels], kChannels);
    }
  img.rgb = std::move(out);
  img.width = static_cast<int>(ow);
  img.height = static_cast<int>(oh);
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
  std::vector<uint8_t> grey16;  // 16-bit grey samples (and their tRNS alpha), big-endian, before the clamp
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
  // 16-bit grey is the one 16-bit layout Pillow does not cut to its high byte: it opens it as mode I;16, whose
  // conversion to RGB clamps each value to 255 (Convert.c's I16_L), so it is read whole and clamped below.
  const bool wide_grey = type == PNG_COLOR_TYPE_GRAY && depth == 16;
  const size_t grey_channels = alpha ? 2 : 1;  // wide_grey: the grey sample and tRNS's alpha
  if (type == PNG_COLOR_TYPE_PALETTE) png_set_palette_to_rgb(png);
  if (type == PNG_COLOR_TYPE_GRAY && depth < 8) png_set_expand_gray_1_2_4_to_8(png);
  if (png_get_valid(png, info, PNG_INFO_tRNS)) png_set_tRNS_to_alpha(png);
  if (depth == 16 && !wide_grey) png_set_strip_16(png);  // the high byte, as Pillow's other 16-bit unpackers
  if (!wide_grey && (type == PNG_COLOR_TYPE_GRAY || type == PNG_COLOR_TYPE_GRAY_ALPHA)) png_set_gray_to_rgb(png);
  png_set_interlace_handling(png);
  png_read_update_info(png, info);
  const size_t row_bytes = wide_grey ? width * grey_channels * 2 : width * channels;
  if (png_get_rowbytes(png, info) != row_bytes) png_error(png, "unexpected row layout after conversion");
  img.width = static_cast<int>(width);
  img.height = static_cast<int>(height);
  img.rgb.resize(size_t{width} * height * channels);
  if (wide_grey) grey16.resize(row_bytes * height);
  rows.resize(height);
  for (png_uint_32 y = 0; y < height; ++y)
    rows[y] = wide_grey ? grey16.data() + y * row_bytes : img.rgb.data() + size_t{y} * width * channels;
  png_read_image(png, rows.data());
  png_read_end(png, info);  // an eXIf chunk may follow the image data
  png_uint_32 exif_bytes = 0;
  png_bytep exif = nullptr;
  const int orientation =
      png_get_eXIf_1(png, info, &exif_bytes, &exif) != 0 ? exif_orientation(skip_exif_header(exif, exif_bytes)) : 1;
  png_destroy_read_struct(&png, &info, nullptr);
  if (wide_grey) {
    constexpr uint32_t kMax8 = 255;
    for (size_t i = 0; i < size_t{width} * height; ++i) {
      const uint8_t* in = grey16.data() + i * grey_channels * 2;
      const auto grey = static_cast<uint8_t>(std::min<uint32_t>(uint32_t{in[0]} << 8 | in[1], kMax8));
      uint8_t* out = img.rgb.data() + i * channels;
      std::fill(out, out + kChannels, grey);
      if (alpha) out[kChannels] = in[2];  // tRNS's alpha is 0 or 65535: its high byte is Pillow's
    }
  }
  if (alpha) img.rgb = over_white(img.rgb);
  apply_orientation(img, orientation);
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
  int orientation = 1;  // as stored, until the EXIF segment says otherwise
  if (setjmp(error.jump)) {
    jpeg_destroy_decompress(&cinfo);
    fail(path, ": not a valid JPEG file (", error.message, ")");
  }
  jpeg_create_decompress(&cinfo);
  jpeg_stdio_src(&cinfo, f);
  jpeg_save_markers(&cinfo, kExifMarker, kMaxMarkerBytes);
  jpeg_read_header(&cinfo, TRUE);
  // Read now: the saved markers live in the image's memory pool, which jpeg_finish_decompress frees.
  for (jpeg_saved_marker_ptr m = cinfo.marker_list; m != nullptr; m = m->next) {
    // The first APP1 segment that holds EXIF, as Pillow takes it.
    if (m->marker != kExifMarker || m->data_length < kExifHeader.size() ||
        !std::equal(kExifHeader.begin(), kExifHeader.end(), m->data))
      continue;
    orientation = exif_orientation(skip_exif_header(m->data, m->data_length));
    break;
  }
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
  apply_orientation(img, orientation);
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
