// ringflex text: the template lexer. It cuts a template into text and tag tokens exactly as jinja2's lexer does
// with trim_blocks and lstrip_blocks on: newlines normalised to \n and one trailing newline dropped, `-` stripping
// all whitespace beside a tag, `+` keeping it, a block or comment tag's following newline removed, and the spaces
// and tabs before a block or comment tag that starts its line removed. Internal to the template engine.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace rf::text::detail {

enum class Tok {
  Data,        // text outside tags
  VarBegin,    // {{
  VarEnd,      // }}
  BlockBegin,  // {%
  BlockEnd,    // %}
  Name,
  String,
  Int,
  Float,
  Op,  // an operator or punctuation, in `text`
  End,
};

struct Token {
  Tok type = Tok::End;
  std::string text;  // Data's text, a name, a string literal's value, an operator
  int64_t int_value = 0;
  double float_value = 0.0;
  int line = 1;
  int col = 1;
};

// Throws rf::Error "ORIGIN:LINE:COL: why" (an unterminated tag, comment or string, a character no token starts with).
std::vector<Token> lex_template(const std::string& source, const std::string& origin);

}  // namespace rf::text::detail
