// ringflex text: SentencePiece's processor behind the Tokenizer interface (see sentencepiece_tokenizer.h).
#include "text/sentencepiece_tokenizer.h"

#include <sentencepiece_processor.h>

#include "core/error.h"

namespace rf::text {
namespace {

class SentencePieceTokenizer final : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(const std::filesystem::path& file) : file_(file.string()) {
    // A FIFO would block Load forever, a directory fails with a less helpful message: refused by kind first.
    std::error_code ec;
    RF_CHECK(std::filesystem::is_regular_file(file, ec), file_, ": not a regular file (a SentencePiece model)");
    const auto status = sp_.Load(file_);
    RF_CHECK(status.ok(), file_, ": cannot load the SentencePiece model: ", status.ToString());
  }
  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int> pieces;
    const auto status = sp_.Encode(text, &pieces);
    RF_CHECK(status.ok(), file_, ": cannot tokenize: ", status.ToString());
    return {pieces.begin(), pieces.end()};
  }
  std::string decode(std::span<const int32_t> ids, bool skip_special) const override {
    std::vector<int> kept;
    kept.reserve(ids.size());
    for (int32_t id : ids) {
      RF_CHECK(id >= 0 && id < sp_.GetPieceSize(), file_, ": cannot decode id ", id, " (the model has ",
               sp_.GetPieceSize(), " pieces)");
      if (!(skip_special && sp_.IsControl(id))) kept.push_back(id);
    }
    std::string text;
    const auto status = sp_.Decode(kept, &text);
    RF_CHECK(status.ok(), file_, ": cannot decode: ", status.ToString());
    return text;
  }
  std::optional<int32_t> token_to_id(std::string_view token) const override {
    const int id = sp_.PieceToId(token);
    // PieceToId answers unk's id for a piece it does not know; only unk's own piece may have that id.
    if (id == sp_.unk_id() && sp_.IdToPiece(id) != token) return std::nullopt;
    return id;
  }
  std::optional<std::string> id_to_token(int32_t id) const override {
    if (id < 0 || id >= sp_.GetPieceSize()) return std::nullopt;
    return sp_.IdToPiece(id);
  }
  int64_t vocab_size() const override { return sp_.GetPieceSize(); }
  std::optional<int32_t> bos_id() const override { return optional_id(sp_.bos_id()); }
  std::optional<int32_t> eos_id() const override { return optional_id(sp_.eos_id()); }

 private:
  static std::optional<int32_t> optional_id(int id) { return id >= 0 ? std::optional<int32_t>(id) : std::nullopt; }
  std::string file_;
  sentencepiece::SentencePieceProcessor sp_;
};

}  // namespace

std::unique_ptr<Tokenizer> load_sentencepiece(const std::filesystem::path& file) {
  return std::make_unique<SentencePieceTokenizer>(file);
}

}  // namespace rf::text
