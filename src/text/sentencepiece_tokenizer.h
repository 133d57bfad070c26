// ringflex text: a SentencePiece model file (tokenizer.model) behind the Tokenizer interface.
#pragma once

#include <filesystem>
#include <memory>

#include "text/tokenizer.h"

namespace rf::text {

// Throws rf::Error naming `file` when it is not a regular file or not a SentencePiece model.
std::unique_ptr<Tokenizer> load_sentencepiece(const std::filesystem::path& file);

}  // namespace rf::text
