// Training data: the packed-row invariants (docs/spec.md §2 metadata, shifted labels, one feature vector per image
// slot), determinism by row index, JSONL token and text files (a SentencePiece model trained here at test time), and
// one clear error per kind of bad data.
#include <gtest/gtest.h>
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>

#include "common/error_of.h"
#include "io/image.h"
#include "io/safetensors.h"
#include "model/image_processor.h"
#include "model/vision.h"
#include "model/vision_encoder.h"
#include "trainer/data.h"

namespace rf::trainer {
namespace {

namespace fs = std::filesystem;
using testing::error_of;

constexpr int kVocab = 512, kF = 8;

fs::path scratch(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("rf_trainer_data_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

void write(const fs::path& p, const std::string& text) { std::ofstream(p) << text; }

// Every invariant a packed row must keep, whatever its source.
void expect_well_formed(const Row& r, int S, int F) {
  ASSERT_EQ(static_cast<int>(r.input_ids.size()), S);
  int slots = 0;
  for (int t = 0; t < S; ++t) {
    if (r.doc[t] == 0) {  // padding: nothing to learn, nothing after it
      EXPECT_EQ(r.labels[t], -100);
      for (int u = t; u < S; ++u) EXPECT_EQ(r.doc[u], 0);
      break;
    }
    const bool starts = t == 0 || r.doc[t] != r.doc[t - 1];
    EXPECT_EQ(r.position_ids[t], starts ? 0 : r.position_ids[t - 1] + 1) << "t=" << t;
    if (!starts) {
      EXPECT_EQ(r.doc[t], r.doc[t - 1]);
    } else {
      EXPECT_EQ(r.doc[t], t == 0 ? 1 : r.doc[t - 1] + 1);
    }
    const bool last_of_doc = t + 1 == S || r.doc[t + 1] != r.doc[t];
    if (last_of_doc || r.mm_token_type[t + 1] != 0) {
      EXPECT_EQ(r.labels[t], -100) << "t=" << t;
    } else if (r.labels[t] != -100) {
      EXPECT_EQ(r.labels[t], r.input_ids[t + 1]) << "t=" << t;
    }
    slots += r.mm_token_type[t] != 0;
  }
  EXPECT_EQ(r.image_features.size(), static_cast<size_t>(slots) * F);
}

TrainConfig config_with(const std::vector<std::string>& sets) { return parse_config("", "test", sets); }

TEST(MockData, RowsAreWellFormedDeterministicAndVaried) {
  const TrainConfig c = config_with({"train.seq_len=300", "data.mock_image_tokens=12"});
  const auto src = make_data_source(c, {kVocab, 0, kF, ""});
  int images = 0;
  for (int i = 0; i < 20; ++i) {
    const Row r = src->train_row(i);
    expect_well_formed(r, 300, kF);
    images += std::count(r.mm_token_type.begin(), r.mm_token_type.end(), 1) / 12;
    const Row again = src->train_row(i);
    EXPECT_EQ(r.input_ids, again.input_ids);
    EXPECT_EQ(r.image_features, again.image_features);
  }
  EXPECT_GT(images, 10);  // about half the documents open with an image
  EXPECT_NE(src->train_row(0).input_ids, src->train_row(1).input_ids);
  EXPECT_NE(src->train_row(0).input_ids, src->val_row(0).input_ids);  // validation is its own stream
  // A row shorter than the shortest document is one truncated document; a one-token row has nothing to learn.
  const auto tiny = make_data_source(config_with({"train.seq_len=1"}), {kVocab, 0, kF, ""});
  expect_well_formed(tiny->train_row(3), 1, kF);
}

// The mock vocabulary as words (hand-written): a run of slots is one word, class 6 is colour 6 / 4 = green with shape
// 6 % 4 = the wide bar, a counting token its number, an id below the text tokens that is none of these <id>.
TEST(MockData, TokenNames) {
  const std::vector<int32_t> ids = {mock::kBos, 2, 2, 2, mock::kFirstCaptionToken + 6, 32, 35, 0, 5, 2};
  EXPECT_EQ(mock::token_names(ids), "<bos> <image x3> <green wide bar> 0 3 <pad> <5> <image>");
  EXPECT_EQ(mock::token_names(std::vector<int32_t>{mock::kFirstCaptionToken + 15}), "<yellow tall bar>");
}

// A held-out prompt is a validation document with a picture, from its opener through the caption after the picture,
// its features the row's for those slots, and the expected tokens the document's next ones.
TEST(MockData, HeldOutPromptIsAValidationDocumentCutAfterItsCaption) {
  const TrainConfig c = config_with({"train.seq_len=300", "data.mock_image_tokens=12", "data.val_rows=3"});
  const auto src = make_data_source(c, {kVocab, 0, kF, ""});
  const HeldOutPrompt q = held_out_prompt(*src, 5);
  const Row row = src->val_row(q.row);
  ASSERT_EQ(q.slots, 12);
  ASSERT_EQ(q.ids.size(), 14u);  // the opener, 12 slots, the caption
  EXPECT_EQ(q.ids.front(), mock::kBos);
  EXPECT_GE(q.ids.back(), mock::kFirstCaptionToken);
  EXPECT_LT(q.ids.back(), mock::kFirstCaptionToken + mock::kClasses);
  // Where the prompt lies in its row: at a document's start, every position of the document's.
  const auto at = std::search(row.input_ids.begin(), row.input_ids.end(), q.ids.begin(), q.ids.end());
  ASSERT_NE(at, row.input_ids.end());
  const size_t begin = static_cast<size_t>(at - row.input_ids.begin()), cut = begin + q.ids.size();
  EXPECT_TRUE(begin == 0 || row.doc[begin - 1] != row.doc[begin]);
  EXPECT_EQ(std::vector<int32_t>(row.mm_token_type.begin() + begin, row.mm_token_type.begin() + cut), q.mm_token_type);
  const size_t slots_before = std::count(row.mm_token_type.begin(), row.mm_token_type.begin() + begin, 1);
  EXPECT_EQ(std::vector<float>(row.image_features.begin() + slots_before * kF,
                               row.image_features.begin() + (slots_before + 12) * kF),
            q.image_features);
  ASSERT_EQ(q.expected.size(), 5u);
  EXPECT_EQ(std::vector<int32_t>(row.input_ids.begin() + cut, row.input_ids.begin() + cut + 5), q.expected);
  EXPECT_EQ(row.doc[cut + 4], row.doc[begin]);
  // No earlier validation document has a picture.
  for (int j = 0; j < q.row; ++j) {
    const Row earlier = src->val_row(j);
    EXPECT_EQ(std::count(earlier.mm_token_type.begin(), earlier.mm_token_type.end(), 1), 0) << "row " << j;
  }
  EXPECT_EQ(std::count(row.mm_token_type.begin(), row.mm_token_type.begin() + begin, 1), 0);
  EXPECT_EQ(error_of([&] {
              (void)held_out_prompt(*make_data_source(config_with({"data.val_rows=0"}), {kVocab, 0, kF, ""}), 5);
            }),
            "no validation rows (data.val_rows = 0): no held-out document to ask about");
}

// An image of more slots than a mock document holds is refused by name (2^31 - 1 slots overflowed the length test
// and made a row of 2^31 image slots); the largest that fits still makes images.
TEST(MockData, ImageTokensBeyondADocumentAreRefused) {
  EXPECT_EQ(error_of([] {
              make_data_source(config_with({"data.mock_image_tokens=2147483647"}), {kVocab, 0, kF, ""});
            }),
            "config: data.mock_image_tokens = 2147483647 is more than 84 (a mock document has at most 96 tokens, and "
            "an image leaves 12 of them to text)");
  const auto largest = make_data_source(config_with({"train.seq_len=300", "data.mock_image_tokens=" +
                                                                              std::to_string(mock::kMaxImageTokens)}),
                                        {kVocab, 0, kF, ""});
  int slots = 0;
  for (int i = 0; i < 20; ++i) {
    const Row r = largest->train_row(i);
    expect_well_formed(r, 300, kF);
    slots += static_cast<int>(std::count(r.mm_token_type.begin(), r.mm_token_type.end(), 1));
  }
  EXPECT_GT(slots, 0);
}

// With a vision tower, a mock image is a drawing encoded by the tower: its slots carry soft tokens that depend on the
// class (the caption token after the slots), and a job whose ranks each encode a share of the drawings gets, once
// the shares are summed (sum_image_features, as the trainer's allreduce does), the bits of a single rank's rows.
TEST(MockData, DrawingsThroughTheTowerSplitOverRanksSumToTheWhole) {
  model::VisionConfig vc;
  vc.hidden_size = kF;
  vc.intermediate_size = 2 * kF;
  vc.num_layers = 1;
  vc.num_heads = vc.num_kv_heads = 2;
  vc.head_dim = 4;  // a multiple of 4: the 2-D rotary embedding splits it per axis
  vc.patch_size = 4;
  vc.pooling_kernel_size = 2;
  vc.position_embedding_size = 16;
  const io::Passthrough weights = model::init_vision_tower(vc, 7);
  const model::VisionEncoder tower(vc, weights);
  const TrainConfig c = config_with({"train.seq_len=256"});
  auto source = [&](int rank, int ranks) {
    ImageContract im;
    im.vision = [&]() -> const model::VisionEncoder* { return &tower; };
    im.rank = rank;
    im.ranks = ranks;
    return make_data_source(c, {kVocab, 0, kF, ""}, im);
  };
  const auto whole = source(0, 1), first = source(0, 2), second = source(1, 2);
  std::vector<float> share;  // the second rank's share, read out through the hook without changing it
  second->sum_image_features([&](std::vector<float>& v) { share = v; });
  first->sum_image_features([&](std::vector<float>& v) {
    ASSERT_EQ(v.size(), share.size());
    for (size_t i = 0; i < v.size(); ++i) v[i] += share[i];
  });
  std::map<int, std::vector<float>> first_slot;  // caption token (the class) -> one image's first soft token
  int images = 0;
  for (int i = 0; i < 16; ++i) {
    const Row r = whole->train_row(i), split = first->train_row(i);
    expect_well_formed(r, 256, kF);
    EXPECT_EQ(r.input_ids, split.input_ids);
    EXPECT_EQ(r.image_features, split.image_features) << "row " << i;
    size_t slot = 0;
    for (int t = 0; t + 1 < 256; ++t) {
      if (r.mm_token_type[t] == 0) continue;
      if (r.mm_token_type[t + 1] == 0) {  // the image's last slot: the caption follows
        const int cls = r.input_ids[t + 1] - mock::kFirstCaptionToken;
        ASSERT_TRUE(cls >= 0 && cls < mock::kClasses) << "row " << i << " t " << t;
        const size_t begin = (slot + 1 - static_cast<size_t>(c.data.mock_image_tokens)) * kF;
        first_slot[cls].assign(r.image_features.begin() + static_cast<std::ptrdiff_t>(begin),
                               r.image_features.begin() + static_cast<std::ptrdiff_t>(begin + kF));
        ++images;
      }
      ++slot;
    }
  }
  ASSERT_GE(first_slot.size(), 2u) << images << " images";
  for (const auto& [cls, v] : first_slot) {
    for (float x : v) EXPECT_TRUE(std::isfinite(x));
    if (cls != first_slot.begin()->first) {
      EXPECT_NE(v, first_slot.begin()->second) << "class " << cls;
    }
  }
}

TEST(JsonlTokens, PacksInFileOrderWithImagesAndShuffles) {
  const fs::path dir = scratch("tokens");
  write(dir / "d.jsonl",
        "{\"input_ids\": [1, 5, 6, 7]}\n"
        "\n"
        "{\"input_ids\": [1, 2, 2, 9, 10], \"image_spans\": [[1, 2]]}\n"
        "{\"input_ids\": [1, 11, 12], \"labels\": [-100, 11, -100]}\n"
        "{\"input_ids\": [1, 13, 14, 15, 16, 17, 18, 19]}\n"
        "{\"input_ids\": [1, 20]}\n");
  std::vector<float> feats(2 * kF);
  for (size_t i = 0; i < feats.size(); ++i) feats[i] = static_cast<float>(i);
  io::SafetensorsWriter w;
  w.add("image_features", io::StDType::F32, {2, kF}, std::span<const float>(feats));
  w.write((dir / "f.safetensors").string());
  const TrainConfig c =
      config_with({"data.source=jsonl_tokens", "data.path=" + (dir / "d.jsonl").string(),
                   "data.features=" + (dir / "f.safetensors").string(), "train.seq_len=10", "data.val_rows=1"});
  const auto src = make_data_source(c, {kVocab, 0, kF, ""});
  // Rows: [4 + 5 tokens], [3 tokens], [8 + 2 tokens]; the last row is validation.
  ASSERT_EQ(src->val_rows(), 1);
  const Row val = src->val_row(0);
  expect_well_formed(val, 10, kF);
  EXPECT_EQ(val.input_ids, (std::vector<int32_t>{1, 13, 14, 15, 16, 17, 18, 19, 1, 20}));
  std::vector<std::vector<int32_t>> seen;
  for (int i = 0; i < 2; ++i) {
    const Row r = src->train_row(i);
    expect_well_formed(r, 10, kF);
    seen.push_back(r.input_ids);
    if (r.input_ids[0] == 1 && r.input_ids[1] == 5) {
      EXPECT_EQ(r.doc, (std::vector<int32_t>{1, 1, 1, 1, 2, 2, 2, 2, 2, 0}));
      EXPECT_EQ(r.mm_token_type, (std::vector<int32_t>{0, 0, 0, 0, 0, 1, 1, 0, 0, 0}));
      EXPECT_EQ(r.labels, (std::vector<int32_t>{5, 6, 7, -100, -100, -100, 9, 10, -100, -100}));
      EXPECT_EQ(r.image_features, feats);
    } else {
      EXPECT_EQ(r.labels[0], 11);  // given labels, shifted: position 0 predicts 11, position 1's target is ignored
      EXPECT_EQ(r.labels[1], -100);
    }
  }
  EXPECT_NE(seen[0], seen[1]);  // one epoch visits every training row once
}

// A sample may say it has no images (`image_spans: []`) without a features file.
TEST(JsonlTokens, EmptyImageSpansNeedNoFeatures) {
  const fs::path dir = scratch("no_images");
  write(dir / "d.jsonl", "{\"input_ids\": [1, 2, 3], \"image_spans\": []}\n{\"input_ids\": [4, 5]}\n");
  const auto src = make_data_source(config_with({"data.source=jsonl_tokens", "data.path=" + (dir / "d.jsonl").string(),
                                                 "train.seq_len=4", "data.val_rows=1"}),
                                    {kVocab, 0, kF, ""});
  EXPECT_EQ(src->val_rows(), 1);
  EXPECT_EQ(src->train_row(0).input_ids, (std::vector<int32_t>{1, 2, 3, 0}));  // next-fit: [1 2 3 pad], [4 5 pad pad]
}

TEST(JsonlTokens, BadDataNamesFileAndLine) {
  const fs::path dir = scratch("bad");
  const auto err = [&](const std::string& text, std::vector<std::string> extra = {}) {
    write(dir / "d.jsonl", text);
    extra.push_back("data.source=jsonl_tokens");
    extra.push_back("data.path=" + (dir / "d.jsonl").string());
    extra.push_back("train.seq_len=6");
    extra.push_back("data.val_rows=1");
    const std::string e = error_of([&] { make_data_source(config_with(extra), {kVocab, 0, kF, ""}); });
    const std::string prefix = (dir / "d.jsonl").string();
    EXPECT_EQ(e.rfind(prefix, 0), 0u) << e;
    return e.substr(std::min(e.size(), prefix.size()));
  };
  EXPECT_EQ(err(""), ": the file has no samples");
  EXPECT_EQ(err("{\"input_ids\": [1, 512]}\n"),
            ":1: token id 512 at position 1 is outside the model's vocabulary [0, 512)");
  EXPECT_EQ(err("{\"input_ids\": [1, 2]}\n{\"input_ids\": [1, 2, 3, 4, 5, 6, 7]}\n"),
            ":2: the sample has 7 tokens, longer than a row (train.seq_len = 6)");
  EXPECT_EQ(err("{\"input_ids\": [1, -3]}\n"),
            ":1: token id -3 at position 1 is outside the model's vocabulary [0, 512)");
  EXPECT_EQ(err("{\"input_ids\": [1, 2], \"labels\": [1]}\n"), ":1: `labels` has 1 entries, `input_ids` 2");
  EXPECT_EQ(err("{\"text\": \"hi\"}\n"), ":1: missing `input_ids`");
  EXPECT_EQ(err("{\"input_ids\": [1, 2]\n").rfind(":1: not valid JSON: parse error at line 1", 0), 0u);
  constexpr char kNulLine[] = "{\"input_ids\": [1, 2]}\0{\n";  // nlohmann alone would stop at the NUL
  EXPECT_EQ(err(std::string(kNulLine, sizeof kNulLine - 1)), ":1: byte 21 is a NUL, which JSON text cannot hold");
  EXPECT_EQ(err("{\"input_ids\": [1, 2, 3], \"image_spans\": [[1, 1]]}\n"),
            ":1: has `image_spans` but data.features names no features file");
  EXPECT_EQ(err("{\"input_ids\": [1, 2]}\n"),
            ": packs into 1 rows, not more than data.val_rows = 1 (nothing would be left to train on)");
  EXPECT_EQ(err("{\"input_ids\": [1, 4294967301]}\n"), ":1: `input_ids`[1] = 4294967301 is outside the int32 range");
}

// Image spans and features: a span whose end overflows int64 is out of range (not a write past the sample), a
// features file with no rows is a file (not "no features file"), and a non-finite feature is named.
TEST(JsonlTokens, BadImageSpansAndFeatures) {
  const fs::path dir = scratch("bad_images");
  const auto features = [&](const char* name, int rows, float value) {
    const std::vector<float> f(static_cast<size_t>(rows) * kF, value);
    io::SafetensorsWriter w;
    w.add("image_features", io::StDType::F32, {rows, kF}, std::span<const float>(f));
    w.write((dir / name).string());
    return (dir / name).string();
  };
  const auto err = [&](const std::string& text, const std::string& feature_file) {
    write(dir / "d.jsonl", text);
    const TrainConfig c = config_with({"data.source=jsonl_tokens", "data.path=" + (dir / "d.jsonl").string(),
                                       "data.features=" + feature_file, "train.seq_len=6", "data.val_rows=1"});
    return error_of([&] { make_data_source(c, {kVocab, 0, kF, ""}); });
  };
  const std::string two = features("two.safetensors", 2, 0.5f);
  EXPECT_NE(err("{\"input_ids\": [1, 2, 3], \"image_spans\": [[9223372036854775807, 1]]}\n", two)
                .find(":1: image span [9223372036854775807, 1] is outside the sample's 3 tokens"),
            std::string::npos);
  EXPECT_NE(err("{\"input_ids\": [1, 2, 3], \"image_spans\": [[1, 1]]}\n", features("none.safetensors", 0, 0.f))
                .find(":1: image spans need feature rows up to 1, "),
            std::string::npos);
  EXPECT_NE(err("{\"input_ids\": [1, 2, 3], \"image_spans\": [[1, 2]]}\n",
                features("nan.safetensors", 2, std::numeric_limits<float>::quiet_NaN()))
                .find("nan.safetensors: image_features has nan at [0, 0] [N, F]"),
            std::string::npos);
}

TEST(JsonlText, SentencePieceTokenizerTrainedHere) {
  const fs::path dir = scratch("text");
  std::ofstream corpus(dir / "corpus.txt");
  for (int i = 0; i < 200; ++i) corpus << "the ring passes keys and values around the ranks " << i % 7 << "\n";
  corpus.close();
  const auto status = sentencepiece::SentencePieceTrainer::Train(
      "--input=" + (dir / "corpus.txt").string() + " --model_prefix=" + (dir / "tokenizer").string() +
      " --vocab_size=40 --hard_vocab_limit=false --model_type=unigram --minloglevel=2");
  ASSERT_TRUE(status.ok()) << status.ToString();
  std::string lines;
  for (const char* t : {"the ring passes keys", "values around the ranks", "the ranks", "keys and values 3",
                        "around the ring 5", "the ring passes values around the ranks 6"})
    lines += std::string("{\"text\": \"") + t + "\"}\n";
  write(dir / "d.jsonl", lines);
  const TrainConfig c =
      config_with({"data.source=jsonl_text", "data.path=" + (dir / "d.jsonl").string(),
                   "data.tokenizer=" + (dir / "tokenizer.model").string(), "train.seq_len=64", "data.val_rows=1"});
  const auto src = make_data_source(c, {kVocab, 0, 0, ""});
  for (int i = 0; i < 3; ++i) expect_well_formed(src->train_row(i), 64, 0);
  expect_well_formed(src->val_row(0), 64, 0);
  // The tokenizer must fit the model's vocabulary.
  EXPECT_NE(error_of([&] {
              make_data_source(c, {10, 0, 0, ""});
            }).find("pieces, more than the model's vocabulary of 10"),
            std::string::npos);
  // Without data.tokenizer, model.path's tokenizer.model: a FIFO there is refused, not waited on.
  const fs::path fifo_model = dir / "fifo_model";
  fs::create_directories(fifo_model);
  ASSERT_EQ(::mkfifo((fifo_model / "tokenizer.model").c_str(), 0600), 0);
  const TrainConfig by_model = config_with(
      {"data.source=jsonl_text", "data.path=" + (dir / "d.jsonl").string(), "train.seq_len=64", "data.val_rows=1"});
  EXPECT_EQ(error_of([&] {
              make_data_source(by_model, {kVocab, 0, 0, fifo_model.string()});
            }),
            (fifo_model / "tokenizer.model").string() +
                ": not a regular file (the SentencePiece model data.source = jsonl_text reads)");
}

// A checkpoint as the hub ships Gemma 4's: tokenizer.json and tokenizer_config.json, no tokenizer.model. jsonl_text
// reads model.path's tokenizer.json (or data.tokenizer naming it), each document <bos> + its ids + <eos>. The ids are
// worked out by hand from the merges (tests/text has the tokenizer's own tests).
TEST(JsonlText, TokenizerJsonFromTheCheckpoint) {
  const fs::path dir = scratch("text_json");
  fs::create_directories(dir / "model");
  write(dir / "model" / "tokenizer.json", R"({"added_tokens": [
      {"id": 1, "content": "<eos>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
      {"id": 2, "content": "<bos>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
    "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
    "model": {"type": "BPE", "byte_fallback": true, "fuse_unk": true, "unk_token": "<unk>",
              "vocab": {"<unk>": 0, "<eos>": 1, "<bos>": 2, "a": 3, "b": 4, "c": 5, "ab": 6, "bc": 7, "abc": 8, "\u2581": 9},
              "merges": [["a", "b"], ["b", "c"], ["ab", "c"]]}})");
  write(dir / "model" / "tokenizer_config.json", R"({"bos_token": "<bos>", "eos_token": "<eos>"})");
  write(dir / "d.jsonl", "{\"text\": \"abc bca\"}\n");
  const std::vector<int32_t> want = {2, 8, 9, 7, 3, 1};  // <bos> abc ▁ bc a <eos>
  for (const std::string& tokenizer : {std::string(), (dir / "model" / "tokenizer.json").string()}) {
    std::vector<std::string> sets = {"data.source=jsonl_text", "data.path=" + (dir / "d.jsonl").string(),
                                     "train.seq_len=16", "data.val_rows=0"};
    if (!tokenizer.empty()) sets.push_back("data.tokenizer=" + tokenizer);
    const auto src = make_data_source(config_with(sets), {kVocab, 0, 0, (dir / "model").string()});
    const Row r = src->train_row(0);
    expect_well_formed(r, 16, 0);
    EXPECT_EQ(std::vector<int32_t>(r.input_ids.begin(), r.input_ids.begin() + 6), want);
  }
}

// A PNG file's bytes, 8-bit RGB, its IDAT a zlib stream of stored (uncompressed) deflate blocks, so the test needs no
// zlib of its own; `height_field` overrides the header's height (0: a zero-sized image).
std::string png_rgb(int width, int height, uint32_t seed, int height_field) {
  const auto crc32 = [](const std::string& bytes) {
    uint32_t c = 0xFFFFFFFFu;
    for (unsigned char b : bytes) {
      c ^= b;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
    }
    return ~c;
  };
  const auto be32 = [](uint32_t v) {
    return std::string{static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8),
                       static_cast<char>(v)};
  };
  const auto chunk = [&](const std::string& kind, const std::string& data) {
    return be32(static_cast<uint32_t>(data.size())) + kind + data + be32(crc32(kind + data));
  };
  std::string raw;  // each scanline: filter byte 0, then the pixels
  uint32_t x = seed;
  for (int y = 0; y < height; ++y) {
    raw += '\0';
    for (int i = 0; i < 3 * width; ++i) raw += static_cast<char>((x = x * 1103515245u + 12345u) >> 24);
  }
  std::string z = "\x78\x01";  // zlib header: deflate, no preset dictionary
  constexpr size_t kStored = 65535;
  for (size_t at = 0; at < raw.size() || at == 0; at += kStored) {
    const size_t n = std::min(kStored, raw.size() - at);
    z += static_cast<char>(at + n >= raw.size() ? 1 : 0);  // BFINAL on the last block, BTYPE 00 (stored)
    z += {static_cast<char>(n & 0xFF), static_cast<char>(n >> 8), static_cast<char>(~n & 0xFF),
          static_cast<char>((~n >> 8) & 0xFF)};
    z += raw.substr(at, n);
  }
  uint32_t a = 1, b = 0;  // Adler-32 of the raw data
  for (unsigned char c : raw) {
    a = (a + c) % 65521u;
    b = (b + a) % 65521u;
  }
  z += be32((b << 16) | a);
  const std::string ihdr = be32(static_cast<uint32_t>(width)) + be32(static_cast<uint32_t>(height_field)) +
                           std::string{8, 2, 0, 0, 0};  // 8 bits, RGB, deflate, adaptive filters, no interlace
  return std::string("\x89PNG\r\n\x1a\n", 8) + chunk("IHDR", ihdr) + chunk("IDAT", z) + chunk("IEND", "");
}

// jsonl_text samples with `images`: the placeholder (the tokenizer's piece of image_token_id, here a user-defined
// symbol) marks each image in the text; it becomes boi, the image's soft-token slots (the tower's soft tokens of the
// preprocessed file) and eoi, as for jsonl_tokens, and the text around it is tokenized as it would be alone. Every bad
// image is one error naming the JSONL line and the file.
TEST(JsonlText, ImagesMarkedInTheText) {
  const fs::path dir = scratch("text_images");
  std::ofstream corpus(dir / "corpus.txt");
  for (int i = 0; i < 200; ++i) corpus << "the ring passes keys and values around the ranks " << i % 7 << "\n";
  corpus.close();
  const auto status = sentencepiece::SentencePieceTrainer::Train(
      "--input=" + (dir / "corpus.txt").string() + " --model_prefix=" + (dir / "tokenizer").string() +
      " --vocab_size=40 --hard_vocab_limit=false --model_type=unigram --minloglevel=2 --user_defined_symbols=<img>");
  ASSERT_TRUE(status.ok()) << status.ToString();
  sentencepiece::SentencePieceProcessor sp;
  ASSERT_TRUE(sp.Load((dir / "tokenizer.model").string()).ok());
  model::VisionConfig vc;
  vc.hidden_size = kF;
  vc.intermediate_size = 2 * kF;
  vc.num_layers = 1;
  vc.num_heads = vc.num_kv_heads = 2;
  vc.head_dim = 4;
  vc.patch_size = 4;
  vc.pooling_kernel_size = 2;
  vc.position_embedding_size = 64;  // the resized 13 x 9 image's patch grid fits
  const io::Passthrough weights = model::init_vision_tower(vc, 7);
  const model::VisionEncoder tower(vc, weights);
  ImageContract im;
  im.vision = [&]() -> const model::VisionEncoder* { return &tower; };
  im.tokens.image = sp.PieceToId("<img>");
  im.tokens.boi = 100;  // beyond the tokenizer's pieces, inside the model's vocabulary
  im.tokens.eoi = 101;
  ASSERT_GT(im.tokens.image, 0);
  fs::create_directories(dir / "img");
  std::ofstream(dir / "img" / "a.png", std::ios::binary) << png_rgb(13, 9, 1, 9);
  const std::string good =
      "{\"text\": \"the ring <img> passes keys\", \"images\": [\"img/a.png\"]}\n"
      "{\"text\": \"values <img> around <img>\", \"images\": [\"img/a.png\", \"img/a.png\"]}\n"
      "{\"text\": \"around the ranks\"}\n";
  write(dir / "d.jsonl", good);
  const TrainConfig c = config_with({"data.source=jsonl_text", "data.path=" + (dir / "d.jsonl").string(),
                                     "data.tokenizer=" + (dir / "tokenizer.model").string(), "train.seq_len=400",
                                     "data.val_rows=0", "data.image_soft_tokens=70"});
  const auto src = make_data_source(c, {kVocab, 0, kF, ""}, im);
  // What the image must become: the processor's patches through the tower.
  model::ImageProcessorConfig proc;
  proc.patch_size = vc.patch_size;
  proc.pooling_kernel_size = vc.pooling_kernel_size;
  proc.max_soft_tokens = 70;
  const std::string a_png = (dir / "img" / "a.png").string();
  const model::ProcessedImage p = model::preprocess_image(io::read_image(a_png), proc, a_png);
  model::VisionBatch one;
  one.n = 1;
  one.P = static_cast<int64_t>(p.positions.size()) / 2;
  one.pixels = p.pixels.data();
  one.positions = p.positions.data();
  const model::VisionOutput soft = tower.forward(one);
  const int64_t n = p.soft_tokens;
  ASSERT_GT(n, 0);
  const Row r = src->train_row(0);  // every sample fits one row
  expect_well_formed(r, 400, kF);
  std::vector<int> before;  // "the ring " alone, then the image
  ASSERT_TRUE(sp.Encode("the ring ", &before).ok());
  int boi_seen = 0;
  size_t slot = 0;
  for (int t = 0; t < 400; ++t) {
    if (r.input_ids[t] != im.tokens.boi) {
      if (r.mm_token_type[t] == 1) ++slot;
      continue;
    }
    ++boi_seen;
    if (boi_seen == 1) {
      ASSERT_GE(t, static_cast<int>(before.size()));
      for (size_t i = 0; i < before.size(); ++i)
        EXPECT_EQ(r.input_ids[t - before.size() + i], before[i]) << "position " << t - before.size() + i;
    }
    for (int64_t s = 1; s <= n; ++s) {
      EXPECT_EQ(r.input_ids[t + s], im.tokens.image);
      EXPECT_EQ(r.mm_token_type[t + s], 1);
    }
    EXPECT_EQ(r.input_ids[t + n + 1], im.tokens.eoi);
    EXPECT_EQ(r.mm_token_type[t + n + 1], 0);
    const std::vector<float> got(r.image_features.begin() + static_cast<std::ptrdiff_t>(slot * kF),
                                 r.image_features.begin() + static_cast<std::ptrdiff_t>((slot + n) * kF));
    EXPECT_EQ(got, soft.soft_tokens) << "image " << boi_seen;
  }
  EXPECT_EQ(boi_seen, 3);
  EXPECT_EQ(r.image_features.size(), static_cast<size_t>(3 * n * kF));

  // Bad images, each named by the second JSONL line; and a placeholder count against the images.
  const std::string png = png_rgb(13, 9, 1, 9);
  const std::map<std::string, std::string> bad = {{"empty", ""},
                                                  {"text", "not an image\n"},
                                                  {"truncated", png.substr(0, png.size() / 2)},
                                                  {"zero", png_rgb(13, 9, 1, 0)}};
  const auto err_with = [&](const std::string& image, const std::string& text) {
    write(dir / "bad.jsonl",
          "{\"text\": \"the ring\"}\n{\"text\": \"" + text + "\", \"images\": [\"" + image + "\"]}\n");
    TrainConfig b = c;
    b.data.path = (dir / "bad.jsonl").string();
    return error_of([&] { make_data_source(b, {kVocab, 0, kF, ""}, im); });
  };
  for (const auto& [what, bytes] : bad) {
    std::ofstream(dir / "img" / (what + ".png"), std::ios::binary) << bytes;
    const std::string e = err_with("img/" + what + ".png", "keys <img>");
    EXPECT_NE(e.find("bad.jsonl:2: "), std::string::npos) << what << ": " << e;
    EXPECT_NE(e.find((dir / "img" / (what + ".png")).string()), std::string::npos) << what << ": " << e;
  }
  const std::string missing = err_with("img/none.png", "keys <img>");
  EXPECT_NE(missing.find("bad.jsonl:2: "), std::string::npos) << missing;
  EXPECT_NE(missing.find("none.png"), std::string::npos) << missing;
  EXPECT_NE(err_with("img/a.png", "keys <img> <img>").find("bad.jsonl:2: has 1 images and 2 image placeholder"),
            std::string::npos);
}

TEST(PackedBatch, StacksRowsAndCountsLabels) {
  const auto src = make_data_source(config_with({"train.seq_len=64"}), {kVocab, 0, kF, ""});
  const std::vector<Row> rows = {src->train_row(0), src->train_row(1)};
  const PackedBatch b = stack_rows(rows, kF);
  EXPECT_EQ(b.B, 2);
  EXPECT_EQ(b.S, 64);
  int64_t labels = 0;
  for (const Row& r : rows) labels += std::count_if(r.labels.begin(), r.labels.end(), [](int32_t l) { return l >= 0; });
  EXPECT_EQ(b.label_tokens(), labels);
  EXPECT_EQ(b.n_image_features * kF,
            static_cast<int64_t>(rows[0].image_features.size() + rows[1].image_features.size()));
}

}  // namespace
}  // namespace rf::trainer
