// ringflex trainer: mock VLM rows, JSONL token and text files, packing and per-epoch shuffling (see data.h).
#include "trainer/data.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>

#include "core/error.h"
#include "core/mask.h"
#include "io/image.h"
#include "io/json_text.h"
#include "io/jsonl.h"
#include "io/safetensors.h"
#include "io/tensor_access.h"
#include "model/image_processor.h"
#include "text/tokenizer.h"

namespace rf::trainer {
namespace {

using nlohmann::json;
constexpr int32_t kIgnore = -100;

// splitmix64: a fixed, portable generator (std's distributions differ between standard libraries, and the data
// must be the same bits on every machine for resume and for the cross-P tests).
struct Rng {
  uint64_t state;
  explicit Rng(uint64_t seed) : state(seed) {}
  uint64_t next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  int uniform(int lo, int hi) {
    return lo + static_cast<int>(next() % static_cast<uint64_t>(hi - lo + 1));
  }                                                                       // [lo, hi]
  float unit() { return static_cast<float>(next() >> 40) * 0x1.0p-24f; }  // [0, 1)
  float normal() {  // Box-Muller; float64 inside so the bits do not depend on libm's float paths
    const double u1 = (static_cast<double>(next() >> 11) + 1.0) * 0x1.0p-53,
                 u2 = static_cast<double>(next() >> 11) * 0x1.0p-53;
    return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
  }
};

uint64_t mix(uint64_t a, uint64_t b) { return Rng(a * 0x100000001B3ull ^ b).next(); }

// One document before packing: tokens, unshifted labels (the token itself, or -100 where it must not be
// predicted), which tokens are image slots, and one feature vector per slot.
struct Document {
  std::vector<int32_t> ids, labels, mm;
  std::vector<float> features;  // [slots, F]
  ImagePatches images;          // ImageContract::train_vision: the images behind the slots
};

// Appends `d` to `row` as document `doc_id` at offset `at`; the shifted label of the document's last token is
// ignored (the next token belongs to another document).
void place(Row& row, const Document& d, int at, int doc_id) {
  const int n = static_cast<int>(d.ids.size());
  for (int t = 0; t < n; ++t) {
    row.input_ids[at + t] = d.ids[t];
    row.labels[at + t] = t + 1 < n ? d.labels[t + 1] : kIgnore;
    row.position_ids[at + t] = t;
    row.doc[at + t] = doc_id;
    row.mm_token_type[at + t] = d.mm[t];
  }
  row.image_features.insert(row.image_features.end(), d.features.begin(), d.features.end());
  row.images.append(d.images);
}

Row empty_row(int S, int pad_id) {
  Row r;
  r.input_ids.assign(S, pad_id);
  r.labels.assign(S, kIgnore);
  r.position_ids.assign(S, 0);
  r.doc.assign(S, 0);
  r.mm_token_type.assign(S, 0);
  return r;
}

// ---------------------------------------------------------------------------------------------------------------
// Mock VLM data: counting sequences (token k = start + k * step, mod the text vocabulary), predictable after two
// tokens, so the loss falls quickly; half the documents open with an image whose class decides the caption token and
// the step of the counting that follows, so the loss can only reach its floor by reading images.
//
// With a vision tower (the built-in models have one), an image is pixels: one of kClasses = 4 colours x 4 shapes
// (filled square, disc, horizontal bar, vertical bar) drawn in memory on a noisy dark background, with its position,
// size and colour jittered, kVariants drawings per class. The drawings are encoded once, when the source is built,
// by the frozen tower (split over the ranks as file images are, ImageContract), and a document's image slots take
// the soft tokens of one drawing (with model.train_vision, its patches, which the trainer encodes every step). Without
// a tower (a text-only checkpoint), an image is a class prototype vector with per-slot noise, given to the projection
// as features.
// ---------------------------------------------------------------------------------------------------------------
namespace mock_image {
constexpr int kColours = 4, kShapes = 4;  // kColours * kShapes = mock::kClasses
constexpr uint8_t kPalette[kColours][3] = {{220, 40, 40}, {40, 200, 60}, {50, 80, 230}, {230, 210, 40}};
constexpr int kBackground = 30, kBackgroundNoise = 15, kColourJitter = 20;  // 8-bit levels
constexpr float kCentreJitter = 0.12f;                                      // of the side, around the middle
constexpr float kMinHalfSide = 0.22f, kMaxHalfSide = 0.38f;                 // the shape's half extent, of the side
constexpr float kBarThickness = 0.35f;                                      // a bar's half width, of its half length
static_assert(kColours * kShapes == mock::kClasses);

uint8_t clamp8(int v) { return static_cast<uint8_t>(std::clamp(v, 0, 255)); }

// Class `cls` = colour cls / kShapes, shape cls % kShapes, drawn `height` x `width` with `rng`'s jitter.
io::RgbImage draw(int cls, int height, int width, Rng& rng) {
  io::RgbImage im;
  im.height = height;
  im.width = width;
  im.rgb.resize(static_cast<size_t>(height) * width * 3);
  const uint8_t* base = kPalette[cls / kShapes];
  const int shape = cls % kShapes;
  int colour[3];
  for (int ch = 0; ch < 3; ++ch) colour[ch] = base[ch] + rng.uniform(-kColourJitter, kColourJitter);
  const float cx = 0.5f + kCentreJitter * (2 * rng.unit() - 1), cy = 0.5f + kCentreJitter * (2 * rng.unit() - 1);
  const float half = kMinHalfSide + (kMaxHalfSide - kMinHalfSide) * rng.unit();
  for (int y = 0; y < height; ++y)
    for (int x = 0; x < width; ++x) {
      // Pixel centres in [0, 1] of each side, relative to the shape's centre.
      const float dx = (x + 0.5f) / width - cx, dy = (y + 0.5f) / height - cy;
      bool inside = false;
      switch (shape) {
        case 0:
          inside = std::abs(dx) < half && std::abs(dy) < half;
          break;
        case 1:
          inside = dx * dx + dy * dy < half * half;
          break;
        case 2:
          inside = std::abs(dx) < half && std::abs(dy) < kBarThickness * half;
          break;
        default:
          inside = std::abs(dy) < half && std::abs(dx) < kBarThickness * half;
          break;
      }
      uint8_t* px = &im.rgb[(static_cast<size_t>(y) * width + x) * 3];
      const int noise = rng.uniform(-kBackgroundNoise, kBackgroundNoise);
      for (int ch = 0; ch < 3; ++ch) px[ch] = clamp8((inside ? colour[ch] : kBackground) + noise);
    }
  return im;
}

// The image processor's patchify (model/image_processor.h step 4) of an image whose sides are already multiples of
// the patch size, no padding: pixels [P, 3 * patch^2] in [0, 1], positions [P, 2].
void patchify(const io::RgbImage& im, int patch, std::vector<float>& pixels, std::vector<int32_t>& positions) {
  for (int py = 0; py < im.height / patch; ++py)
    for (int px = 0; px < im.width / patch; ++px) {
      for (int r = 0; r < patch; ++r)
        for (int c = 0; c < patch; ++c)
          for (int ch = 0; ch < 3; ++ch)
            pixels.push_back(static_cast<float>(
                                 im.rgb[((static_cast<size_t>(py) * patch + r) * im.width + px * patch + c) * 3 + ch]) /
                             255.f);
      positions.push_back(px);
      positions.push_back(py);
    }
}

const char* const kColourNames[kColours] = {"red", "green", "blue", "yellow"};
const char* const kShapeNames[kShapes] = {"square", "disc", "wide bar", "tall bar"};  // draw()'s cases 0..3
}  // namespace mock_image

class MockSource final : public DataSource {
 public:
  MockSource(const TrainConfig& c, const DataContract& k, const ImageContract& im)
      : S_(c.train.seq_len),
        F_(k.feature_dim),
        image_tokens_(c.data.mock_image_tokens),
        vocab_(k.vocab_size),
        pad_(k.pad_token_id),
        seed_(c.train.seed),
        val_rows_(c.data.val_rows) {
    RF_CHECK(vocab_ > mock::kFirstTextToken + 2 * mock::kClasses, "data.source = mock needs a vocabulary of more than ",
             mock::kFirstTextToken + 2 * mock::kClasses, " tokens, the model has ", vocab_);
    // More slots than any mock document holds would never make an image (and would overflow the length test).
    RF_CHECK(image_tokens_ <= mock::kMaxImageTokens, "config: data.mock_image_tokens = ", image_tokens_,
             " is more than ", mock::kMaxImageTokens, " (a mock document has at most ", mock::kMaxDocument,
             " tokens, and an image leaves ", mock::kMinDocument / 2, " of them to text)");
    const model::VisionEncoder* tower = F_ > 0 && im.vision ? im.vision() : nullptr;
    if (tower != nullptr) {
      encode_drawings(*tower, c, im);
      return;
    }
    Rng rng(mix(seed_, kPrototypeStream));
    prototypes_.resize(static_cast<size_t>(mock::kClasses) * F_);
    for (float& x : prototypes_) x = rng.normal();
  }
  Row train_row(int64_t index) const override {
    return make(mix(mix(seed_, kTrainStream), static_cast<uint64_t>(index)));
  }
  Row val_row(int index) const override { return make(mix(mix(seed_, kValStream), static_cast<uint64_t>(index))); }
  int val_rows() const override { return val_rows_; }
  int feature_dim() const override { return F_; }
  void sum_image_features(const std::function<void(std::vector<float>&)>& sum) override {
    if (!split_) return;
    split_ = false;  // once
    sum(drawings_);
  }

 private:
  static constexpr uint64_t kTrainStream = 1, kValStream = 2, kPrototypeStream = 3, kDrawingStream = 4;
  static constexpr float kFeatureNoise = 0.3f;  // per-slot noise around the class prototype
  static constexpr int kMaxStep = 7;
  static constexpr int kVariants = 4;  // drawings per class: few, as a large checkpoint's tower encodes them all

  // Draws kVariants images of every class as a grid of image_tokens_ soft tokens (rows x columns, the most square
  // factorisation), each pooling cell k x k patches, and encodes this rank's share of them (drawing i is rank
  // i % ranks's) into drawings_; the others stay zero until sum_image_features.
  void encode_drawings(const model::VisionEncoder& tower, const TrainConfig& c, const ImageContract& im) {
    const model::VisionConfig& vc = tower.config();
    RF_CHECK(vc.hidden_size == F_, "data.source = mock: the vision tower's soft tokens are ", vc.hidden_size,
             " wide, the model's vision projection takes ", F_);
    int rows = 1;
    for (int r = 1; r * r <= image_tokens_; ++r)
      if (image_tokens_ % r == 0) rows = r;
    const int cols = image_tokens_ / rows, k = vc.pooling_kernel_size, patch = vc.patch_size;
    const int height = rows * k * patch, width = cols * k * patch;
    const int n = mock::kClasses * kVariants;
    Rng rng(mix(c.train.seed, kDrawingStream));
    std::vector<float> pixels;
    std::vector<int32_t> positions;
    std::vector<int> mine;
    for (int i = 0; i < n; ++i) {
      const io::RgbImage drawing = mock_image::draw(i / kVariants, height, width, rng);  // every rank draws all
      if (!im.train_vision && i % im.ranks != im.rank) continue;
      mock_image::patchify(drawing, patch, pixels, positions);
      mine.push_back(i);
    }
    drawings_.assign(static_cast<size_t>(n) * image_tokens_ * F_, 0.f);
    model::VisionBatch b;
    b.n = static_cast<int>(mine.size());
    b.P = static_cast<int64_t>(rows) * k * cols * k;
    b.pixels = pixels.data();
    b.positions = positions.data();
    const std::string source = "data.source = mock's " + std::to_string(height) + " x " + std::to_string(width) +
                               " drawings (data.mock_image_tokens = " + std::to_string(image_tokens_) + ")";
    tower.check(b, source);  // on every rank, even one with no share
    if (im.train_vision) {   // every drawing kept as patches, encoded by the trainer every step (zero features here)
      drawing_patches_.n = n;
      drawing_patches_.P = b.P;
      drawing_patches_.pixels = std::move(pixels);
      drawing_patches_.positions = std::move(positions);
      return;
    }
    split_ = im.ranks > 1;
    if (mine.empty()) return;
    const model::VisionOutput soft = tower.forward(b, source);
    for (size_t j = 0; j < mine.size(); ++j) {
      RF_CHECK(soft.counts[j] == image_tokens_, source, ": the tower made ", soft.counts[j], " soft tokens, not ",
               image_tokens_);
      const size_t size = static_cast<size_t>(image_tokens_) * F_;
      std::copy_n(soft.soft_tokens.begin() + static_cast<std::ptrdiff_t>(j * size), size,
                  drawings_.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(mine[j]) * size));
    }
  }

  Document document(Rng& rng, int max_len) const {
    Document d;
    const int len = std::min(max_len, rng.uniform(mock::kMinDocument, mock::kMaxDocument));
    const int text_vocab = vocab_ - mock::kFirstTextToken;
    int start = rng.uniform(0, text_vocab - 1), step = rng.uniform(1, kMaxStep);
    d.ids.push_back(mock::kBos);
    d.mm.push_back(0);
    const bool image = F_ > 0 && rng.uniform(0, 1) == 1 && len >= image_tokens_ + mock::kMinDocument / 2;
    if (image) {
      const int cls = rng.uniform(0, mock::kClasses - 1);
      const size_t size = static_cast<size_t>(image_tokens_) * F_;
      if (!drawings_.empty()) {
        const size_t drawing =
            static_cast<size_t>(cls) * kVariants + static_cast<size_t>(rng.uniform(0, kVariants - 1));
        d.features.assign(drawings_.begin() + static_cast<std::ptrdiff_t>(drawing * size),
                          drawings_.begin() + static_cast<std::ptrdiff_t>((drawing + 1) * size));
        if (drawing_patches_.n > 0) {
          const ImagePatches& all = drawing_patches_;
          const size_t pixels = all.pixels.size() / static_cast<size_t>(all.n),
                       positions = static_cast<size_t>(2 * all.P);
          d.images.n = 1;
          d.images.P = all.P;
          d.images.pixels.assign(all.pixels.begin() + static_cast<std::ptrdiff_t>(drawing * pixels),
                                 all.pixels.begin() + static_cast<std::ptrdiff_t>((drawing + 1) * pixels));
          d.images.positions.assign(all.positions.begin() + static_cast<std::ptrdiff_t>(drawing * positions),
                                    all.positions.begin() + static_cast<std::ptrdiff_t>((drawing + 1) * positions));
        }
      }
      for (int s = 0; s < image_tokens_; ++s) {
        d.ids.push_back(mock::kImageSlot);
        d.mm.push_back(1);
        if (drawings_.empty())
          for (int f = 0; f < F_; ++f)
            d.features.push_back(prototypes_[static_cast<size_t>(cls) * F_ + f] + kFeatureNoise * rng.normal());
      }
      d.ids.push_back(mock::kFirstCaptionToken + cls);
      d.mm.push_back(0);
      step = 1 + cls % kMaxStep;
      start = cls * (text_vocab / mock::kClasses);
    }
    for (int k = 0; static_cast<int>(d.ids.size()) < len; ++k) {
      d.ids.push_back(mock::kFirstTextToken + (start + k * step) % text_vocab);
      d.mm.push_back(0);
    }
    d.labels = d.ids;
    for (size_t t = 0; t < d.ids.size(); ++t)
      if (d.mm[t] != 0 || t == 0) d.labels[t] = kIgnore;  // image slots and the document opener are never targets
    return d;
  }

  Row make(uint64_t seed) const {
    Rng rng(seed);
    Row row = empty_row(S_, pad_);
    int at = 0, doc_id = 0;
    // Documents until fewer than the shortest fit; the rest of the row is padding.
    while (S_ - at >= std::min(S_, mock::kMinDocument)) {
      const Document d = document(rng, S_ - at);
      place(row, d, at, ++doc_id);
      at += static_cast<int>(d.ids.size());
    }
    return row;
  }

  int S_, F_, image_tokens_, vocab_, pad_;
  uint64_t seed_;
  int val_rows_;
  std::vector<float> prototypes_;  // [kClasses, F] (without a tower)
  std::vector<float> drawings_;    // [kClasses * kVariants, image_tokens_, F] soft tokens (with a tower)
  bool split_ = false;             // drawings_ holds this rank's share until sum_image_features
  ImagePatches drawing_patches_;   // ImageContract::train_vision: every drawing's patches (drawings_ stays zero)
};

// ---------------------------------------------------------------------------------------------------------------
// Files: every sample is a document; documents are packed in file order into rows (next-fit: a document that does
// not fit the current row starts the next one, so the rows keep the file's order), then served in a seeded
// permutation per epoch.
// ---------------------------------------------------------------------------------------------------------------
class PackedSource final : public DataSource {
 public:
  // split: the rows' image features are this rank's share (ImageContract), completed by sum_image_features.
  PackedSource(std::vector<Row> rows, int val_rows, uint64_t seed, int F, const std::string& path, bool split)
      : F_(F), seed_(seed), split_(split) {
    RF_CHECK(static_cast<int64_t>(rows.size()) > val_rows, path, ": packs into ", rows.size(),
             " rows, not more than data.val_rows = ", val_rows, " (nothing would be left to train on)");
    val_.assign(std::make_move_iterator(rows.end() - val_rows), std::make_move_iterator(rows.end()));
    rows.resize(rows.size() - static_cast<size_t>(val_rows));
    train_ = std::move(rows);
  }
  Row train_row(int64_t index) const override {
    const int64_t n = static_cast<int64_t>(train_.size());
    const int64_t epoch = index / n;
    // Fisher-Yates with the portable generator, once per epoch: O(rows) work, which per row fetched would cost
    // more than a tiny model's step on a large data set. Rows are fetched in order, so one cached epoch suffices.
    if (epoch != order_epoch_) {
      order_.resize(static_cast<size_t>(n));
      std::iota(order_.begin(), order_.end(), 0);
      Rng rng(mix(seed_, static_cast<uint64_t>(epoch)));
      for (int64_t i = n - 1; i > 0; --i) std::swap(order_[i], order_[rng.next() % static_cast<uint64_t>(i + 1)]);
      order_epoch_ = epoch;
    }
    return train_[order_[index % n]];
  }
  Row val_row(int index) const override { return val_[index]; }
  int val_rows() const override { return static_cast<int>(val_.size()); }
  int feature_dim() const override { return F_; }
  void sum_image_features(const std::function<void(std::vector<float>&)>& sum) override {
    if (!split_) return;
    split_ = false;           // once
    std::vector<float> flat;  // every row's features, training rows then validation rows
    for (const auto* rows : {&train_, &val_})
      for (const Row& r : *rows) flat.insert(flat.end(), r.image_features.begin(), r.image_features.end());
    sum(flat);
    size_t at = 0;
    for (auto* rows : {&train_, &val_})
      for (Row& r : *rows) {
        std::copy_n(flat.begin() + static_cast<std::ptrdiff_t>(at), r.image_features.size(), r.image_features.begin());
        at += r.image_features.size();
      }
  }

 private:
  int F_;
  uint64_t seed_;
  bool split_;
  std::vector<Row> train_, val_;
  // The permutation of the epoch last fetched from (a cache: train_row is logically const, called by one thread).
  mutable int64_t order_epoch_ = -1;
  mutable std::vector<int64_t> order_;
};

std::vector<Row> pack(const std::vector<Document>& docs, int S, int pad) {
  std::vector<Row> rows;
  Row row = empty_row(S, pad);
  int at = 0, doc_id = 0;
  for (const Document& d : docs) {
    const int n = static_cast<int>(d.ids.size());
    if (at + n > S) {
      rows.push_back(std::move(row));
      row = empty_row(S, pad);
      at = 0;
      doc_id = 0;
    }
    place(row, d, at, ++doc_id);
    at += n;
  }
  if (at > 0) rows.push_back(std::move(row));
  return rows;
}

std::vector<int32_t> int_array(const json& j, const char* key, const std::string& where) {
  RF_CHECK(j[key].is_array(), where, ": `", key, "` must be an array of integers");
  std::vector<int32_t> out;
  for (const json& v : j[key]) {
    RF_CHECK(v.is_number_integer(), where, ": `", key, "` must be an array of integers");
    // Read wide and range-checked: get<int32_t> would wrap 2^32 + 5 to token 5.
    const bool fits = v.is_number_unsigned() ? v.get<uint64_t>() <= uint64_t{INT32_MAX}
                                             : v.get<int64_t>() >= INT32_MIN && v.get<int64_t>() <= INT32_MAX;
    RF_CHECK(fits, where, ": `", key, "`[", out.size(), "] = ", v.dump(), " is outside the int32 range");
    out.push_back(static_cast<int32_t>(v.get<int64_t>()));
  }
  return out;
}

void check_document(const Document& d, const std::string& where, const TrainConfig& c, const DataContract& k) {
  const int n = static_cast<int>(d.ids.size());
  RF_CHECK(n > 0, where, ": the sample has no tokens");
  RF_CHECK(n <= c.train.seq_len, where, ": the sample has ", n,
           " tokens, longer than a row (train.seq_len = ", c.train.seq_len, ")");
  for (int t = 0; t < n; ++t) {
    RF_CHECK(d.ids[t] >= 0 && d.ids[t] < k.vocab_size, where, ": token id ", d.ids[t], " at position ", t,
             " is outside the model's vocabulary [0, ", k.vocab_size, ")");
    RF_CHECK(d.labels[t] == kIgnore || (d.labels[t] >= 0 && d.labels[t] < k.vocab_size), where, ": label ", d.labels[t],
             " at position ", t, " is neither -100 nor in [0, ", k.vocab_size, ")");
  }
}

// A sample's `images` (file names, relative to the JSONL file's folder), one per image placeholder token in its
// input_ids, in order: each placeholder becomes boi, the image's soft-token slots (the placeholder id, mm type 1,
// label ignored, one feature row each: the frozen tower's soft tokens of the decoded and preprocessed image) and eoi,
// as Gemma4Processor lays images out. boi and eoi are trained as tokens where the placeholder's label was the
// placeholder itself (the default, labels = input_ids), and ignored where it was -100.
void expand_images(Document& d, const json& images, const std::string& where, const TrainConfig& c,
                   const DataContract& k, const ImageContract& im, int64_t& images_seen) {
  RF_CHECK(images.is_array(), where, ": `images` must be a list of image file names");
  const model::VisionEncoder* tower = im.processor_only ? nullptr : im.vision ? im.vision() : nullptr;
  model::ImageProcessorConfig proc;
  if (im.processor_only) {
    proc = *im.processor_only;
  } else {
    RF_CHECK(tower != nullptr, where, ": has `images`, but the model has no vision tower (a vision_config and its ",
             "model.vision_tower.* tensors)");
    RF_CHECK(tower->config().hidden_size == k.feature_dim, where, ": the vision tower's soft tokens are ",
             tower->config().hidden_size, " wide, the model's vision projection takes ", k.feature_dim);
    proc.patch_size = tower->config().patch_size;
    proc.pooling_kernel_size = tower->config().pooling_kernel_size;
  }
  const model::MultimodalTokens& tok = im.tokens;
  const int64_t placeholders = std::count(d.ids.begin(), d.ids.end(), tok.image);
  RF_CHECK(placeholders == static_cast<int64_t>(images.size()), where, ": has ", images.size(), " images and ",
           placeholders, " image placeholder tokens (id ", tok.image, ", the config's image_token_id): one each");
  proc.max_soft_tokens = c.data.image_soft_tokens;
  const std::filesystem::path folder = std::filesystem::path(c.data.path).parent_path();
  Document out;
  size_t next = 0;
  for (size_t t = 0; t < d.ids.size(); ++t) {
    if (d.ids[t] != tok.image) {
      out.ids.push_back(d.ids[t]);
      out.labels.push_back(d.labels[t]);
      out.mm.push_back(0);
      continue;
    }
    const json& name = images[next++];
    RF_CHECK(name.is_string() && !name.get<std::string>().empty(), where, ": `images[", next - 1,
             "]` must be a file name");
    const std::filesystem::path given(name.get<std::string>());
    const std::string path = (given.is_absolute() ? given : folder / given).string();
    const int64_t F = k.feature_dim, row = F > 0 ? static_cast<int64_t>(out.features.size()) / F : 0;
    int64_t count = 0;
    try {
      const model::ProcessedImage p = model::preprocess_image(io::read_image(path), proc, path);
      count = p.soft_tokens;  // whole pooling cells: the processor's sides are multiples of k * patch_size
      model::VisionBatch b;
      b.n = 1;
      b.P = static_cast<int64_t>(p.positions.size()) / 2;
      b.pixels = p.pixels.data();
      b.positions = p.positions.data();
      if (tower != nullptr) {
        tower->check(b, path);
        out.features.resize(static_cast<size_t>((row + count) * F), 0.f);
      }
      if (tower == nullptr) {
        // processor_only: the slots, no features
      } else if (im.train_vision) {  // encoded by the trainer, every step
        ImagePatches one;
        one.n = 1;
        one.P = b.P;
        one.pixels = p.pixels;
        one.positions = p.positions;
        out.images.append(one);
      } else if (images_seen % im.ranks == im.rank) {  // this rank's share of the tower's work
        const model::VisionOutput soft = tower->forward(b, path);
        RF_CHECK(soft.counts[0] == count, path, ": the tower made ", soft.counts[0], " soft tokens, the processor ",
                 count);
        std::copy(soft.soft_tokens.begin(), soft.soft_tokens.end(), out.features.begin() + row * F);
      }
    } catch (const rf::Error& e) {
      rf::fail(where, ": ", e.what());
    }
    ++images_seen;
    const bool trained = d.labels[t] == tok.image;
    out.ids.push_back(tok.boi);
    out.labels.push_back(trained ? tok.boi : kIgnore);
    out.mm.push_back(0);
    for (int64_t s = 0; s < count; ++s) {
      out.ids.push_back(tok.image);
      out.labels.push_back(kIgnore);
      out.mm.push_back(1);
    }
    out.ids.push_back(tok.eoi);
    out.labels.push_back(trained ? tok.eoi : kIgnore);
    out.mm.push_back(0);
  }
  d = std::move(out);
}

std::vector<Document> read_token_file(const TrainConfig& c, const DataContract& k, const ImageContract& im, int& F,
                                      bool& split) {
  std::vector<float> features;
  int64_t n_features = 0;
  std::unique_ptr<io::SafetensorsFile> file;
  if (!c.data.features.empty()) {
    file = std::make_unique<io::SafetensorsFile>(io::SafetensorsFile::open(c.data.features));
    io::DimSizes dims;
    const io::TensorView& v =
        io::require(*file, {"image_features", {io::StDType::F32, io::StDType::BF16}, {"N", "F"}, ""}, dims);
    RF_CHECK(dims["F"] == k.feature_dim, c.data.features, ": image_features has ", dims["F"],
             " columns, the model expects ", k.feature_dim);
    features = io::to_float32(v);
    n_features = dims["N"];
    for (size_t i = 0; i < features.size(); ++i)
      RF_CHECK(std::isfinite(features[i]), c.data.features, ": image_features has ", features[i], " at [",
               static_cast<int64_t>(i) / dims["F"], ", ", static_cast<int64_t>(i) % dims["F"], "] [N, F]");
    F = k.feature_dim;
  }
  std::vector<Document> docs;
  int64_t images_seen = 0;        // the file's images so far, in file order (image i is encoded by rank i % ranks)
  std::vector<size_t> span_docs;  // documents whose features came whole from data.features
  int64_t used = 0;
  io::for_each_line(c.data.path, [&](const json& j, const std::string& where) {
    RF_CHECK(j.contains("input_ids"), where, ": missing `input_ids`");
    Document d;
    d.ids = int_array(j, "input_ids", where);
    d.labels = j.contains("labels") ? int_array(j, "labels", where) : d.ids;
    RF_CHECK(d.labels.size() == d.ids.size(), where, ": `labels` has ", d.labels.size(), " entries, `input_ids` ",
             d.ids.size());
    d.mm.assign(d.ids.size(), 0);
    if (j.contains("images")) {
      RF_CHECK(!j.contains("image_spans"), where, ": give `images` or `image_spans`, not both");
      expand_images(d, j["images"], where, c, k, im, images_seen);
      F = k.feature_dim;
    }
    if (j.contains("image_spans")) {
      RF_CHECK(!im.train_vision, where, ": `image_spans` (precomputed image features) with model.train_vision: a ",
               "trained tower encodes pixels, give the sample's `images`");
      RF_CHECK(j["image_spans"].is_array(), where, ": `image_spans` must be a list of [start, length] pairs");
      RF_CHECK(file != nullptr || j["image_spans"].empty(), where,
               ": has `image_spans` but data.features names no features file");
      for (const json& span : j["image_spans"]) {
        RF_CHECK(span.is_array() && span.size() == 2 && span[0].is_number_integer() && span[1].is_number_integer(),
                 where, ": `image_spans` must be a list of [start, length] pairs");
        const int64_t start = span[0], len = span[1];
        // Compared without forming start + len, which overflows for a start near INT64_MAX.
        const int64_t n = static_cast<int64_t>(d.ids.size());
        RF_CHECK(start >= 0 && len >= 1 && start < n && len <= n - start, where, ": image span [", start, ", ", len,
                 "] is outside the sample's ", d.ids.size(), " tokens");
        for (int64_t t = start; t < start + len; ++t) {
          RF_CHECK(d.mm[t] == 0, where, ": image spans overlap at position ", t);
          d.mm[t] = 1;
          d.labels[t] = kIgnore;
        }
      }
      // Features are taken in slot order, i.e. by position within the sample.
      const int64_t slots = std::count(d.mm.begin(), d.mm.end(), 1);
      RF_CHECK(used + slots <= n_features, where, ": image spans need feature rows up to ", used + slots, ", ",
               c.data.features, " has ", n_features);
      d.features.assign(features.begin() + used * F, features.begin() + (used + slots) * F);
      used += slots;
      span_docs.push_back(docs.size());
    }
    check_document(d, where, c, k);
    docs.push_back(std::move(d));
  });
  RF_CHECK(used == n_features, c.data.features, ": has ", n_features, " feature rows, the image spans of ", c.data.path,
           " use ", used);
  // Split tower work is completed by a sum over the ranks (DataSource::sum_image_features): the features every rank
  // read whole from data.features then count once, on rank 0.
  split = images_seen > 0 && im.ranks > 1 && !im.train_vision;
  if (split && im.rank != 0)
    for (size_t doc : span_docs) std::fill(docs[doc].features.begin(), docs[doc].features.end(), 0.f);
  return docs;
}

// A text's pieces with the image placeholder kept whole: the text is split at every occurrence of `placeholder` (the
// tokenizer's piece of the config's image_token_id) and each part encoded on its own, the placeholder becoming that
// one id wherever it stands, whatever kind of piece (normal, user-defined, control) the tokenizer makes of it, as
// Hugging Face tokenizers split a text at their special tokens.
std::vector<int32_t> encode_with_placeholders(const text::Tokenizer& tok, const std::string& text,
                                              const std::string& placeholder, int32_t image_id) {
  std::vector<int32_t> out;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t next = std::min(text.find(placeholder, at), text.size());
    if (next > at) {
      const std::vector<int32_t> pieces = tok.encode(std::string_view(text).substr(at, next - at));
      out.insert(out.end(), pieces.begin(), pieces.end());
    }
    if (next == text.size()) break;
    out.push_back(image_id);
    at = next + placeholder.size();
  }
  return out;
}

}  // namespace

// model.path's files are not checked with the config's files: a FIFO there would block the read forever, so it is
// refused here by kind.
std::filesystem::path text_tokenizer_file(const TrainConfig& c, const DataContract& k) {
  std::filesystem::path file = c.data.tokenizer;
  std::error_code ec;
  if (file.empty()) {
    const std::filesystem::path dir(k.model_path);
    file = std::filesystem::exists(dir / "tokenizer.json", ec) ? dir / "tokenizer.json" : dir / "tokenizer.model";
  }
  const bool json_file = file.extension() == ".json";
  RF_CHECK(std::filesystem::is_regular_file(file, ec), file.string(), ": not a regular file (the ",
           json_file ? "tokenizer.json" : "SentencePiece model", " data.source = ", name_of(c.data.source), " reads)");
  return file;
}

namespace {

// A sample's `images`, as jsonl_tokens takes them (expand_images): each marked in `text` by the tokenizer's piece of
// the config's image_token_id (for Gemma 4's tokenizer the processor's image token).
std::vector<Document> read_text_file(const TrainConfig& c, const DataContract& k, const ImageContract& im, int& F,
                                     bool& split) {
  const std::string model_file = text_tokenizer_file(c, k).string();
  const std::unique_ptr<text::Tokenizer> tok = text::load_tokenizer(model_file);
  RF_CHECK(tok->vocab_size() <= k.vocab_size, model_file, ": the tokenizer has ", tok->vocab_size(),
           " pieces, more than the model's vocabulary of ", k.vocab_size);
  const std::optional<int32_t> bos = tok->bos_id(), eos = tok->eos_id();
  std::vector<Document> docs;
  int64_t images_seen = 0;  // the file's images so far, in file order (image i is encoded by rank i % ranks)
  io::for_each_line(c.data.path, [&](const json& j, const std::string& where) {
    RF_CHECK(j.contains("text") && j["text"].is_string(), where, ": missing `text` (a string)");
    Document d;
    std::vector<int32_t> pieces;
    try {
      if (j.contains("images")) {
        const int image = im.tokens.image;
        const std::optional<std::string> placeholder = tok->id_to_token(image);
        RF_CHECK(placeholder.has_value(), where, ": has `images`, but the tokenizer ", model_file,
                 " has no piece for the image placeholder (image_token_id ", image, "; it has ", tok->vocab_size(),
                 " pieces)");
        pieces = encode_with_placeholders(*tok, j["text"].get<std::string>(), *placeholder, image);
      } else {
        pieces = tok->encode(j["text"].get<std::string>());
      }
    } catch (const Error& e) {
      fail(where, ": ", e.what());
    }
    if (bos) d.ids.push_back(*bos);
    d.ids.insert(d.ids.end(), pieces.begin(), pieces.end());
    if (eos) d.ids.push_back(*eos);
    d.labels = d.ids;
    if (bos) d.labels[0] = kIgnore;
    d.mm.assign(d.ids.size(), 0);
    if (j.contains("images")) {
      expand_images(d, j["images"], where, c, k, im, images_seen);
      F = k.feature_dim;
    }
    check_document(d, where, c, k);
    docs.push_back(std::move(d));
  });
  split = images_seen > 0 && im.ranks > 1 && !im.train_vision;
  return docs;
}

// A rendered conversation as a document: targets where the sample trains, its images expanded to their slots.
Document chat_document(const text::ChatSample& sample, const std::string& where, const TrainConfig& c,
                       const DataContract& k, const ImageContract& im, int64_t& images_seen) {
  Document d;
  d.ids = sample.ids;
  d.labels.resize(d.ids.size());
  for (size_t t = 0; t < d.ids.size(); ++t) d.labels[t] = sample.trained[t] ? d.ids[t] : kIgnore;
  d.mm.assign(d.ids.size(), 0);
  if (!sample.images.empty()) expand_images(d, json(sample.images), where, c, k, im, images_seen);
  return d;
}

// data.source = jsonl_chat (docs/text.md): each line a conversation, rendered through the chat template and
// tokenized (text/conversation.h); longer than a row: data.chat.overlength; nothing to train on: skipped. Both
// counted in `report`.
std::vector<Document> read_chat_file(const TrainConfig& c, const DataContract& k, const ImageContract& im, int& F,
                                     bool& split, ChatReport& report, int show) {
  const std::filesystem::path tokenizer_at = text_tokenizer_file(c, k);
  const std::unique_ptr<text::Tokenizer> tok = text::load_tokenizer(tokenizer_at);
  RF_CHECK(tok->vocab_size() <= k.vocab_size, tokenizer_at.string(), ": the tokenizer has ", tok->vocab_size(),
           " tokens, more than the model's vocabulary of ", k.vocab_size);
  text::ChatOptions options;
  options.train_on = c.data.chat_train_on;
  options.thought_prefix = c.data.chat_thought_prefix;
  options.enable_thinking = c.data.chat_enable_thinking;
  // The special tokens the template writes (bos_token, ...) from the tokenizer_config.json beside the tokenizer.
  const text::ChatRenderer renderer(text::load_chat_template(k.model_path, c.data.chat_template,
                                                             tokenizer_at.parent_path() / "tokenizer_config.json"),
                                    *tok, options);
  const std::filesystem::path folder = std::filesystem::path(c.data.path).parent_path();
  const int S = c.train.seq_len;
  std::vector<Document> docs;
  int64_t images_seen = 0;  // the file's images so far, in file order (image i is encoded by rank i % ranks)
  io::for_each_line<nlohmann::ordered_json>(c.data.path, [&](const nlohmann::ordered_json& j,
                                                             const std::string& where) {
    ++report.conversations;
    text::check_conversation(j, where, folder);
    text::ChatSample sample = renderer.render(j, where);
    Document d = chat_document(sample, where, c, k, im, images_seen);
    if (static_cast<int>(d.ids.size()) > S) {
      RF_CHECK(c.data.chat_overlength != Overlength::Error, where, ": the conversation has ", d.ids.size(),
               " tokens, longer than a row (train.seq_len = ", S, "; data.chat.overlength = drop or truncate)");
      bool fits = false;
      if (c.data.chat_overlength == Overlength::Truncate) {
        // The longest prefix of whole turns that fits and ends on a model turn's `<turn|>`, so the model still
        // learns to stop (a cut inside a turn would teach it never to).
        const std::vector<size_t> ends = text::ChatRenderer::turn_ends(j);
        for (auto e = ends.rbegin(); e != ends.rend() && !fits; ++e) {
          if (*e == j["messages"].size()) continue;
          sample = renderer.render_prefix(j, *e, where);
          d = chat_document(sample, where, c, k, im, images_seen);
          fits = static_cast<int>(d.ids.size()) <= S && sample.trained_tokens() > 0;
        }
      }
      if (!fits) {
        ++report.dropped;
        return;
      }
      ++report.truncated;
    }
    if (sample.trained_tokens() == 0) {
      ++report.skipped;
      return;
    }
    check_document(d, where, c, k);
    report.tokens += static_cast<int64_t>(d.ids.size());
    report.trained_tokens += count_label_tokens(d.labels);
    if (!sample.images.empty() && !im.processor_only) F = k.feature_dim;
    if (static_cast<int>(report.shown.size()) < show) {
      ChatReport::Shown s{where, std::move(sample), {}};
      for (size_t t = 0; t < d.mm.size(); ++t) {  // each run of slots is one image
        if (d.mm[t] != 1) continue;
        if (t == 0 || d.mm[t - 1] != 1) s.image_slots.push_back(0);
        ++s.image_slots.back();
      }
      report.shown.push_back(std::move(s));
    }
    docs.push_back(std::move(d));
  });
  RF_CHECK(!docs.empty(), c.data.path, ": no conversation is left to train on (", report.dropped,
           " longer than train.seq_len = ", S, ", ", report.skipped, " with nothing to train on)");
  split = images_seen > 0 && im.ranks > 1 && !im.train_vision && !im.processor_only;
  return docs;
}

}  // namespace

int64_t count_label_tokens(std::span<const int32_t> labels) {
  return std::count_if(labels.begin(), labels.end(), [](int32_t l) { return l != kIgnore; });
}

int64_t count_real_tokens(std::span<const int32_t> doc) {
  return std::count_if(doc.begin(), doc.end(), [](int32_t d) { return d != 0; });
}

void ImagePatches::append(const ImagePatches& o) {
  if (o.n == 0) return;
  RF_CHECK(n == 0 || P == o.P, "images of ", P, " and ", o.P, " patches in one batch (one image processor config ",
           "pads every image to one patch count)");
  P = o.P;
  n += o.n;
  pixels.insert(pixels.end(), o.pixels.begin(), o.pixels.end());
  positions.insert(positions.end(), o.positions.begin(), o.positions.end());
}

model::VisionBatch ImagePatches::batch() const {
  model::VisionBatch b;
  b.n = n;
  b.P = P;
  b.pixels = pixels.data();
  b.positions = positions.data();
  return b;
}

model::Batch PackedBatch::batch() const {
  model::Batch b;
  b.B = B;
  b.S = S;
  b.input_ids = input_ids.data();
  b.labels = labels.data();
  b.position_ids = position_ids.data();
  b.doc = doc.data();
  b.mm_token_type = mm_token_type.data();
  b.image_features = image_features.empty() ? nullptr : image_features.data();
  b.n_image_features = n_image_features;
  return b;
}

PackedBatch stack_rows(const std::vector<Row>& rows, int feature_dim) {
  PackedBatch b;
  b.B = static_cast<int>(rows.size());
  b.S = rows.empty() ? 0 : static_cast<int>(rows[0].input_ids.size());
  for (const Row& r : rows) {
    b.input_ids.insert(b.input_ids.end(), r.input_ids.begin(), r.input_ids.end());
    b.labels.insert(b.labels.end(), r.labels.begin(), r.labels.end());
    b.position_ids.insert(b.position_ids.end(), r.position_ids.begin(), r.position_ids.end());
    b.doc.insert(b.doc.end(), r.doc.begin(), r.doc.end());
    b.mm_token_type.insert(b.mm_token_type.end(), r.mm_token_type.begin(), r.mm_token_type.end());
    b.image_features.insert(b.image_features.end(), r.image_features.begin(), r.image_features.end());
    b.images.append(r.images);
  }
  b.n_image_features = feature_dim > 0 ? static_cast<int64_t>(b.image_features.size()) / feature_dim : 0;
  return b;
}

std::unique_ptr<DataSource> make_data_source(const TrainConfig& c, const DataContract& k, const ImageContract& im,
                                             ChatReport* report, int show) {
  if (c.data.source == SourceKind::Mock) return std::make_unique<MockSource>(c, k, im);
  int F = 0;
  bool split = false;
  ChatReport chat;
  std::vector<Document> docs;
  if (c.data.source == SourceKind::JsonlTokens)
    docs = read_token_file(c, k, im, F, split);
  else if (c.data.source == SourceKind::JsonlText)
    docs = read_text_file(c, k, im, F, split);
  else
    docs = read_chat_file(c, k, im, F, split, chat, show);
  std::vector<Row> rows = pack(docs, c.train.seq_len, k.pad_token_id);
  if (report != nullptr) {
    *report = std::move(chat);
    report->rows = static_cast<int64_t>(rows.size());
    report->row_tokens = report->rows * c.train.seq_len;
    for (const Row& r : rows) report->padding += c.train.seq_len - count_real_tokens(r.doc);
  }
  return std::make_unique<PackedSource>(std::move(rows), c.data.val_rows, c.train.seed, F, c.data.path, split);
}

namespace mock {
std::string token_names(std::span<const int32_t> ids) {
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    if (!out.empty()) out += ' ';
    if (id == kImageSlot) {  // a picture's run of slots as one word
      size_t run = 1;
      while (i + run < ids.size() && ids[i + run] == kImageSlot) ++run;
      out += run == 1 ? "<image>" : rf::concat("<image x", run, ">");
      i += run - 1;
    } else if (id == 0) {
      out += "<pad>";
    } else if (id == kBos) {
      out += "<bos>";
    } else if (id >= kFirstCaptionToken && id < kFirstCaptionToken + kClasses) {
      out += rf::concat("<", mock_image::kColourNames[(id - kFirstCaptionToken) / mock_image::kShapes], " ",
                        mock_image::kShapeNames[(id - kFirstCaptionToken) % mock_image::kShapes], ">");
    } else if (id >= kFirstTextToken) {
      out += std::to_string(id - kFirstTextToken);
    } else {
      out += rf::concat("<", id, ">");
    }
  }
  return out;
}
}  // namespace mock

HeldOutPrompt held_out_prompt(const DataSource& d, int max_expected) {
  RF_CHECK(d.val_rows() > 0, "no validation rows (data.val_rows = 0): no held-out document to ask about");
  RF_CHECK(max_expected >= 1, "the held-out continuation must be at least 1 token, not ", max_expected);
  const int64_t F = d.feature_dim();
  // [begin, end) of a row's document starting at `begin`, and whether it holds an image slot.
  const auto document_end = [](const Row& row, size_t begin) {
    size_t end = begin;
    while (end < row.doc.size() && row.doc[end] == row.doc[begin]) ++end;
    return end;
  };
  std::optional<std::pair<int, size_t>> chosen;  // (row, the document's first position)
  for (int j = 0; j < d.val_rows() && !chosen; ++j) {
    const Row row = d.val_row(j);
    for (size_t at = 0; at < row.doc.size() && row.doc[at] != kPaddingDoc; at = document_end(row, at))
      if (std::any_of(row.mm_token_type.begin() + static_cast<std::ptrdiff_t>(at),
                      row.mm_token_type.begin() + static_cast<std::ptrdiff_t>(document_end(row, at)),
                      [](int32_t t) { return t != 0; })) {
        chosen = {j, at};
        break;
      }
  }
  if (!chosen) chosen = {0, 0};
  const Row row = d.val_row(chosen->first);
  const size_t begin = chosen->second, end = document_end(row, begin);
  RF_CHECK(end - begin >= 2 && row.doc[begin] != kPaddingDoc, "validation row ", chosen->first,
           " opens with no document of two tokens or more");
  size_t cut = begin + (end - begin) / 2;  // the prompt's last position
  for (size_t t = begin; t < end; ++t)
    if (row.mm_token_type[t] != 0 && t + 1 < end && row.mm_token_type[t + 1] == 0) cut = t + 1;
  HeldOutPrompt out;
  out.row = chosen->first;
  const int64_t slots_before =
      std::count_if(row.mm_token_type.begin(), row.mm_token_type.begin() + static_cast<std::ptrdiff_t>(begin),
                    [](int32_t t) { return t != 0; });
  for (size_t t = begin; t <= cut; ++t) {
    out.ids.push_back(row.input_ids[t]);
    out.mm_token_type.push_back(row.mm_token_type[t]);
    out.slots += row.mm_token_type[t] != 0;
  }
  out.image_features.assign(row.image_features.begin() + slots_before * F,
                            row.image_features.begin() + (slots_before + out.slots) * F);
  for (size_t t = cut + 1; t < end && static_cast<int>(out.expected.size()) < max_expected; ++t)
    out.expected.push_back(row.input_ids[t]);
  RF_CHECK(!out.expected.empty(), "validation row ", out.row, ": the held-out document ends at its prompt");
  return out;
}

}  // namespace rf::trainer
