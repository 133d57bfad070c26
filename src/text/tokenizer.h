// ringflex text: a checkpoint's tokenizer, as the `tokenizers` library (transformers' backend) or SentencePiece
// reads it. docs/text.md says what each file kind supports and what it refuses.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace rf::text {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Ids of `text` as the `tokenizers` library's encode(text, add_special_tokens=False) gives them: added and
  // special tokens written in the text are matched whole (Gemma 4's `<|turn>`, `<|image|>`, ...). Throws rf::Error
  // for text that is not valid UTF-8.
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // Text of `ids` as tokenizers' decode(ids, skip_special_tokens=skip_special) gives it.
  virtual std::string decode(std::span<const int32_t> ids, bool skip_special = false) const = 0;
  virtual std::optional<int32_t> token_to_id(std::string_view token) const = 0;  // a vocabulary or added token
  virtual std::optional<std::string> id_to_token(int32_t id) const = 0;          // the token's own text
  virtual int64_t vocab_size() const = 0;  // one past the largest id (added tokens included)
  // The ids a document starts and ends with, when the tokenizer names them: SentencePiece's bos and eos; for
  // tokenizer.json, the bos_token and eos_token of the tokenizer_config.json beside it.
  virtual std::optional<int32_t> bos_id() const = 0;
  virtual std::optional<int32_t> eos_id() const = 0;
};

// A checkpoint folder's tokenizer: tokenizer.json when present (the hub's Gemma 4 ships only that), else
// tokenizer.model (SentencePiece). A file given directly is read by its kind (a name ending in .json is
// tokenizer.json's format, anything else SentencePiece's). Throws rf::Error naming the file and field it cannot
// honour.
std::unique_ptr<Tokenizer> load_tokenizer(const std::filesystem::path& dir_or_file);

}  // namespace rf::text
