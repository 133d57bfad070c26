// ringflex text: UTF-8 code points, checked (tokenizer.json's pieces are strings of code points).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace rf::text {

// The length in bytes of the valid UTF-8 sequence starting at s[at], or 0 when none starts there (a stray
// continuation byte, an overlong form, a surrogate, a code point past U+10FFFF, or a sequence cut short).
size_t utf8_length_at(std::string_view s, size_t at);
// The code point of the valid sequence of `length` bytes at s[at] (utf8_length_at said so).
char32_t utf8_decode(std::string_view s, size_t at, size_t length);
// The byte offset of the first invalid sequence in `s`, or npos when all of `s` is valid UTF-8.
size_t utf8_first_invalid(std::string_view s);
void utf8_append(std::string& out, char32_t c);
// Rust's char::is_whitespace (Unicode White_Space), which tokenizers' lstrip and rstrip use.
bool is_unicode_whitespace(char32_t c);

}  // namespace rf::text
