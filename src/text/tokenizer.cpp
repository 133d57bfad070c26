// ringflex text: choosing a checkpoint's tokenizer file (see tokenizer.h).
#include "text/tokenizer.h"

#include "core/error.h"
#include "text/sentencepiece_tokenizer.h"
#include "text/tokenizer_json.h"

namespace rf::text {

std::unique_ptr<Tokenizer> load_tokenizer(const std::filesystem::path& dir_or_file) {
  std::error_code ec;
  if (std::filesystem::is_directory(dir_or_file, ec)) {
    const auto json_file = dir_or_file / "tokenizer.json";
    if (std::filesystem::exists(json_file, ec)) return load_tokenizer(json_file);
    const auto model_file = dir_or_file / "tokenizer.model";
    RF_CHECK(std::filesystem::exists(model_file, ec), dir_or_file.string(),
             ": has neither tokenizer.json nor tokenizer.model");
    return load_sentencepiece(model_file);
  }
  if (dir_or_file.extension() == ".json") return load_tokenizer_json(dir_or_file);
  return load_sentencepiece(dir_or_file);
}

}  // namespace rf::text
