// ringflex text: a Hugging Face `tokenizers` file (tokenizer.json) with a BPE model, read as the library reads it
// for the parts Gemma 4's tokenizer uses; every other component or option is refused by name (docs/text.md).
#pragma once

#include <filesystem>
#include <memory>
#include <string_view>

#include "text/tokenizer.h"

namespace rf::text {

// `file`'s tokenizer; bos_id/eos_id from the tokenizer_config.json beside it when there is one. Throws rf::Error
// "FILE: FIELD: why" for what it cannot read or honour.
std::unique_ptr<Tokenizer> load_tokenizer_json(const std::filesystem::path& file);
// The same from the file's text (`origin` names it in errors), without a tokenizer_config.json.
std::unique_ptr<Tokenizer> parse_tokenizer_json(std::string_view json_text, const std::string& origin);

}  // namespace rf::text
