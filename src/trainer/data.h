// ringflex trainer: training data, packed into rows of S tokens with document ids, image slots and padding.
//
// A source turns documents into packed rows once (files) or on demand (mock), and serves them by index: row i of
// the training stream is a pure function of (seed, i), so the data position saved in a checkpoint is one number
// (the next row index) and any DP replica can fetch its own rows of a global batch without talking to the others.
// Files cycle in epochs, each epoch in a seeded permutation of the packed rows; the last `data.val_rows` packed
// rows of a file are the validation split and never train.
//
// A packed row (docs/spec.md §2 metadata): doc ids count from 1 in each row, 0 is padding; position ids restart at 0 in
// every document; labels are already shifted (labels[t] = the token at t + 1 of the same document, -100 where that
// is an image slot, the document's end or padding); vision slots carry mm_token_type 1 and one feature vector each.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "model/gemma4.h"
#include "model/image_processor.h"
#include "model/vision.h"
#include "model/vision_encoder.h"
#include "text/conversation.h"
#include "trainer/config.h"

namespace rf::trainer {

// With model.train_vision: images as the tower takes them (ImageContract::train_vision), so that the trainer encodes
// them on every step (the tower changes): n images of P patches each, in the order of their soft-token slots.
struct ImagePatches {
  int n = 0;
  int64_t P = 0;                   // patches per image, padding included (one image processor config: one P)
  std::vector<float> pixels;       // [n, P, 3 * patch_size^2], values in [0, 1]
  std::vector<int32_t> positions;  // [n, P, 2] (x, y); (-1, -1) pads
  // Appends `o`'s images after these; throws rf::Error when both hold images of different P.
  void append(const ImagePatches& o);
  model::VisionBatch batch() const;
};

struct Row {
  std::vector<int32_t> input_ids;      // [S]
  std::vector<int32_t> labels;         // [S] shifted targets, -100 = ignored
  std::vector<int32_t> position_ids;   // [S]
  std::vector<int32_t> doc;            // [S] 1, 2, ... per document; 0 = padding
  std::vector<int32_t> mm_token_type;  // [S] 0 text, 1 image slot
  std::vector<float> image_features;   // [slots, F] in slot order (zero with ImageContract::train_vision)
  ImagePatches images;                 // with ImageContract::train_vision: the images behind the slots
};

// The tokens that count: label tokens (the loss's denominator: every label not ignored) and non-padding tokens
// (doc != 0), of a row's or a batch's arrays. The one definition the trainer's counts use.
int64_t count_label_tokens(std::span<const int32_t> labels);
int64_t count_real_tokens(std::span<const int32_t> doc);

// Rows of one micro-batch laid out as the model's Batch wants them: [B, S] arrays, features [N, F] row-major.
struct PackedBatch {
  int B = 0, S = 0;
  std::vector<int32_t> input_ids, labels, position_ids, doc, mm_token_type;  // [B, S]
  std::vector<float> image_features;                                         // [N, F]
  int64_t n_image_features = 0;
  ImagePatches images;  // the rows' images in slot order (ImageContract::train_vision; else none)
  int64_t label_tokens() const { return count_label_tokens(labels); }
  int64_t real_tokens() const { return count_real_tokens(doc); }  // non-padding tokens
  model::Batch batch() const;  // the model's view of these arrays (no copy; valid while this batch lives)
};
PackedBatch stack_rows(const std::vector<Row>& rows, int feature_dim);

class DataSource {
 public:
  virtual ~DataSource() = default;
  virtual Row train_row(int64_t index) const = 0;
  virtual Row val_row(int index) const = 0;
  virtual int val_rows() const = 0;
  virtual int feature_dim() const = 0;  // F of image features (0: the source has no images)
  // Replaces every row's image features by their sum over the ranks (`sum`: an elementwise sum, collective), for
  // image files whose tower work was split over the ranks (ImageContract): called once, by every rank, after the
  // setup agreed that all ranks read the data. Sources without such images do nothing.
  virtual void sum_image_features(const std::function<void(std::vector<float>&)>& sum) { (void)sum; }
};

// What the data must agree with: the model's vocabulary, pad id and image feature width.
struct DataContract {
  int vocab_size = 0;
  int pad_token_id = 0;
  int feature_dim = 0;     // F the model accepts (its vision projection's width, or its hidden size)
  std::string model_path;  // where jsonl_text looks for tokenizer.model by default
};

// For jsonl_tokens and jsonl_text samples with `images` and the mock source's drawings: the model's vision tower (built
// on first use; null when the model has none; frozen, so each image is encoded once, when the source is built, into the
// features of its slots) and its image tokens.
struct ImageContract {
  std::function<const model::VisionEncoder*()> vision;
  model::MultimodalTokens tokens;  // the placeholder that marks an image in input_ids, and boi / eoi
  // The tower's work split over the job's ranks: every rank reads, decodes and checks every image (a bad one fails
  // everywhere), rank r encodes images r, r + ranks, ... and leaves the others' features zero; the caller then
  // calls DataSource::sum_image_features once on every rank (the others contribute zeros, and x + 0 is x).
  int rank = 0, ranks = 1;
  // model.train_vision: the tower trains, so nothing is encoded here (and nothing split): every image is read,
  // preprocessed and checked as above and kept as patches (Row::images), its slots' features zero until the trainer
  // encodes the micro-batch's images with the tower of that step. Precomputed features (`image_spans`) cannot train a
  // tower and are refused.
  bool train_vision = false;
  // `ringflex data`: images are read, checked and laid out (their slot counts, from the processor) without a tower
  // or features: with processor_only set, `vision` is not called and rows carry no image features.
  std::optional<model::ImageProcessorConfig> processor_only;
};

// What data.source = jsonl_chat made of its file (`ringflex data` prints it; docs/text.md): conversations read,
// dropped as longer than a row (data.chat.overlength = drop), shortened by whole turns (truncate), skipped with
// nothing to train on; the tokens and trained tokens of the documents kept; the packed rows and their padding.
struct ChatReport {
  int64_t conversations = 0, dropped = 0, truncated = 0, skipped = 0;
  int64_t tokens = 0, trained_tokens = 0;         // of the kept documents, image slots included
  int64_t rows = 0, row_tokens = 0, padding = 0;  // every packed row (validation rows included): rows x S, doc 0
  struct Shown {
    std::string where;                 // "FILE:LINE"
    text::ChatSample sample;           // as rendered, before the images' soft tokens
    std::vector<int64_t> image_slots;  // soft tokens of each image
  };
  std::vector<Shown> shown;  // the first `show` conversations kept
};

// Builds the configured source; reads and checks the whole file (ids against the vocabulary, sample lengths
// against train.seq_len, image spans against the features file, image files and their placeholders) and throws
// rf::Error naming file and line (and the image file).
// With `report` (jsonl_chat only), fills it and keeps the first `show` rendered conversations.
std::unique_ptr<DataSource> make_data_source(const TrainConfig& c, const DataContract& contract,
                                             const ImageContract& images = {}, ChatReport* report = nullptr,
                                             int show = 0);

// A held-out document cut for generation (`ringflex data --held-out`, scripts/demo.sh): the first validation document
// with an image (else the first document of the first validation row), as a prompt through the first text token after
// its image (for the mock data, the caption its picture decides; without an image, its first half), and the tokens
// the document continues with, at most `max_expected` of them.
struct HeldOutPrompt {
  std::vector<int32_t> ids, mm_token_type;  // [S] the prompt
  std::vector<float> image_features;        // [slots, F] of its image slots (F: the source's feature_dim)
  int64_t slots = 0;
  std::vector<int32_t> expected;  // [<= max_expected] the document's next tokens
  int row = 0;                    // the validation row it came from
};
HeldOutPrompt held_out_prompt(const DataSource& d, int max_expected);

// The tokenizer jsonl_text, jsonl_chat and train.samples' conversations read: data.tokenizer (tokenizer.json or a
// SentencePiece tokenizer.model), else model.path's tokenizer.json, else its tokenizer.model (text/tokenizer.h).
// Throws rf::Error when it is not a regular file.
std::filesystem::path text_tokenizer_file(const TrainConfig& c, const DataContract& k);

// The mock VLM data's fixed shape, exposed for tests and docs.
namespace mock {
constexpr int kFirstTextToken = 32;  // ids below are special: 0 pad, 1 beginning of document, 2 image slot
constexpr int kBos = 1, kImageSlot = 2;
constexpr int kFirstCaptionToken = 8;  // caption token of image class c is kFirstCaptionToken + c
constexpr int kClasses = 16;
constexpr int kMinDocument = 24, kMaxDocument = 96;
// A document opens with an image only if its slots leave kMinDocument / 2 tokens of text, so no more slots fit one.
constexpr int kMaxImageTokens = kMaxDocument - kMinDocument / 2;
// The mock vocabulary as words, space-separated: <pad>, <bos>, <image xN> (a picture's N slots), a caption token as its
// picture's class (colour and shape, e.g. `<red square>`), a text token kFirstTextToken + n as the number n of the
// document's count, any other id as <id>. What the counting looks like to a reader (train.samples, scripts/demo.sh).
std::string token_names(std::span<const int32_t> ids);
}  // namespace mock

}  // namespace rf::trainer
