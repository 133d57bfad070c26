#include "text/template_lexer.h"

#include <algorithm>
#include <cctype>
#include <string_view>

#include "core/error.h"
#include "text/template_value.h"
#include "text/utf8.h"

namespace rf::text::detail {
namespace {

// Operators longest first, as jinja2's operator regex tries them.
constexpr std::string_view kOperators[] = {"//", "**", "==", "!=", ">=", "<=", "+", "-", "/", "*", "%", "~", "[",
                                           "]",  "(",  ")",  "{",  "}",  ">",  "<", "=", ".", ":", "|", ",", ";"};

class Lexer {
 public:
  Lexer(std::string src, const std::string& origin) : src_(std::move(src)), origin_(origin) {}

  std::vector<Token> run() {
    bool line_starting = true;  // jinja2: the previous match ended with a newline (or nothing came before)
    while (pos_ < src_.size()) {
      size_t tag = find_tag(pos_);
      if (tag == std::string::npos) {
        emit_data(src_.substr(pos_), pos_);
        break;
      }
      std::string text = src_.substr(pos_, tag - pos_);
      const char kind = src_[tag + 1];  // '{', '%' or '#'
      const char sign = tag + 2 < src_.size() && (src_[tag + 2] == '-' || src_[tag + 2] == '+') ? src_[tag + 2] : 0;
      if (sign == '-') {
        text = py_strip(text, false, true);
      } else if (sign != '+' && kind != '{') {
        // lstrip_blocks: the spaces and tabs between a line's start and a block or comment tag go.
        size_t l_pos = text.rfind('\n');
        l_pos = l_pos == std::string::npos ? 0 : l_pos + 1;
        if ((l_pos > 0 || line_starting) && text.find_first_not_of(" \t", l_pos) == std::string::npos)
          text.resize(l_pos);
      }
      emit_data(text, pos_);
      size_t after = tag + 2 + (sign ? 1 : 0);
      if (kind == '#') {
        line_starting = lex_comment(tag, after);
      } else if (kind == '%' && is_raw(after)) {
        line_starting = lex_raw(tag);
      } else {
        line_starting = lex_tag(tag, after, kind == '%');
      }
    }
    Token end;
    end.type = Tok::End;
    position(src_.size(), end);
    tokens_.push_back(end);
    return std::move(tokens_);
  }

 private:
  [[noreturn]] void fail_at(size_t at, const std::string& why) {
    Token t;
    line_pos_ = 0;  // position() only moves forward; an error may point back at its tag's start
    line_ = 1;
    col_ = 1;
    position(at, t);
    throw Error(origin_ + ":" + std::to_string(t.line) + ":" + std::to_string(t.col) + ": " + why);
  }

  void position(size_t at, Token& t) {
    // Lines and columns advance incrementally: tokens are produced in source order.
    for (; line_pos_ < at; ++line_pos_) {
      if (src_[line_pos_] == '\n') {
        ++line_;
        col_ = 1;
      } else if ((static_cast<unsigned char>(src_[line_pos_]) & 0xc0) != 0x80) {
        ++col_;
      }
    }
    t.line = line_;
    t.col = col_;
  }

  size_t find_tag(size_t from) const {
    for (size_t k = from; k + 1 < src_.size(); ++k)
      if (src_[k] == '{' && (src_[k + 1] == '{' || src_[k + 1] == '%' || src_[k + 1] == '#')) return k;
    return std::string::npos;
  }

  void emit_data(const std::string& text, size_t at) {
    if (text.empty()) return;
    Token t;
    t.type = Tok::Data;
    t.text = text;
    position(at, t);
    tokens_.push_back(std::move(t));
  }

  void push(Tok type, size_t at, std::string text = {}) {
    Token t;
    t.type = type;
    t.text = std::move(text);
    position(at, t);
    tokens_.push_back(std::move(t));
  }

  size_t skip_space(size_t k) const {
    while (k < src_.size()) {
      size_t n = 0;
      char32_t cp = peek_cp(k, &n);
      if (!is_py_space(cp)) break;
      k += n;
    }
    return k;
  }

  char32_t peek_cp(size_t k, size_t* n) const {
    unsigned char c = static_cast<unsigned char>(src_[k]);
    int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    if (k + len > src_.size()) len = 1;
    *n = len;
    if (len == 1) return c;
    char32_t cp = c & (0x7f >> len);
    for (int j = 1; j < len; ++j) cp = (cp << 6) | (static_cast<unsigned char>(src_[k + j]) & 0x3f);
    return cp;
  }

  // The end of a block or comment tag at k ("+%}", "-%}" and following whitespace, "%}" and one newline); returns
  // the position after it, or npos when none starts at k.
  size_t match_end(size_t k, char close) const {
    auto at = [&](size_t p, std::string_view s) { return src_.compare(p, s.size(), s) == 0; };
    const std::string end = std::string(1, close) + "}";
    if (close != '}' && at(k, "+" + end)) return k + 3;
    if (at(k, "-" + end)) return skip_space(k + 3);
    if (at(k, end)) {
      size_t p = k + 2;
      if (close != '}' && p < src_.size() && src_[p] == '\n') ++p;  // trim_blocks
      return p;
    }
    return std::string::npos;
  }

  bool lex_comment(size_t tag, size_t after) {
    for (size_t k = after; k < src_.size(); ++k) {
      size_t end = match_end(k, '#');
      if (end != std::string::npos) {
        pos_ = end;
        return src_[end - 1] == '\n';
      }
    }
    fail_at(tag, "missing end of comment tag");
  }

  // `{%[-+]? raw [-]?%}` at the tag whose body starts at `after`.
  bool is_raw(size_t after) const {
    size_t k = skip_space(after);
    if (src_.compare(k, 3, "raw") != 0) return false;
    k = skip_space(k + 3);
    return src_.compare(k, 2, "%}") == 0 || src_.compare(k, 3, "-%}") == 0;
  }

  bool lex_raw(size_t tag) {
    size_t k = skip_space(tag + 2 + ((src_[tag + 2] == '-' || src_[tag + 2] == '+') ? 1 : 0)) + 3;
    k = skip_space(k);
    size_t body = src_[k] == '-' ? skip_space(k + 3) : k + 2;  // `raw -%}` strips, `raw %}` does not trim
    for (size_t p = body; p < src_.size(); ++p) {
      if (src_.compare(p, 2, "{%") != 0) continue;
      size_t q = p + 2;
      const char sign = q < src_.size() && (src_[q] == '-' || src_[q] == '+') ? src_[q] : 0;
      if (sign) ++q;
      q = skip_space(q);
      if (src_.compare(q, 6, "endraw") != 0) continue;
      q = skip_space(q + 6);
      size_t end = match_end(q, '%');
      if (end == std::string::npos) continue;
      std::string text = src_.substr(body, p - body);
      if (sign == '-') {
        text = py_strip(text, false, true);
      } else if (sign != '+') {
        size_t l_pos = text.rfind('\n');
        l_pos = l_pos == std::string::npos ? 0 : l_pos + 1;
        if (text.find_first_not_of(" \t", l_pos) == std::string::npos) text.resize(l_pos);
      }
      emit_data(text, body);
      pos_ = end;
      return src_[end - 1] == '\n';
    }
    fail_at(tag, "missing end of raw directive");
  }

  bool lex_tag(size_t tag, size_t after, bool block) {
    push(block ? Tok::BlockBegin : Tok::VarBegin, tag);
    std::vector<char> balance;  // jinja2 matches the tag's end only outside brackets
    size_t k = after;
    while (true) {
      if (k >= src_.size()) fail_at(tag, block ? "unexpected end of template: missing '%}'" : "missing '}}'");
      if (balance.empty()) {
        size_t end = match_end(k, block ? '%' : '}');
        if (end != std::string::npos) {
          push(block ? Tok::BlockEnd : Tok::VarEnd, k);
          pos_ = end;
          return src_[end - 1] == '\n';
        }
      }
      size_t n = 0;
      char32_t cp = peek_cp(k, &n);
      if (is_py_space(cp)) {
        k += n;
        continue;
      }
      const char c = src_[k];
      if (std::isdigit(static_cast<unsigned char>(c))) {
        k = lex_number(k);
      } else if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t e = k;
        while (e < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) ++e;
        push(Tok::Name, k, src_.substr(k, e - k));
        k = e;
      } else if (c == '\'' || c == '"') {
        k = lex_string(k);
      } else {
        bool found = false;
        for (std::string_view op : kOperators) {
          if (src_.compare(k, op.size(), op) != 0) continue;
          if (op == "(" || op == "[" || op == "{") {
            balance.push_back(op[0]);
          } else if (op == ")" || op == "]" || op == "}") {
            const char open = op == ")" ? '(' : op == "]" ? '[' : '{';
            if (balance.empty()) fail_at(k, "unexpected '" + std::string(op) + "'");
            if (balance.back() != open)
              fail_at(k, "unexpected '" + std::string(op) + "', expected '" +
                             (balance.back() == '('   ? ")"
                              : balance.back() == '[' ? "]"
                                                      : "}") +
                             "'");
            balance.pop_back();
          }
          push(Tok::Op, k, std::string(op));
          k += op.size();
          found = true;
          break;
        }
        if (!found) fail_at(k, "unexpected char '" + src_.substr(k, n) + "'");
      }
    }
  }

  size_t lex_number(size_t k) {
    auto digits = [&](size_t p) {
      // (\d+_)*\d+
      size_t e = p;
      while (e < src_.size() &&
             (std::isdigit(static_cast<unsigned char>(src_[e])) ||
              (src_[e] == '_' && e + 1 < src_.size() && std::isdigit(static_cast<unsigned char>(src_[e + 1])))))
        ++e;
      return e;
    };
    auto strip = [](std::string s) {
      s.erase(std::remove(s.begin(), s.end(), '_'), s.end());
      return s;
    };
    size_t e = digits(k);
    size_t f = e;
    bool is_float = false;
    const bool after_dot = k > 0 && src_[k - 1] == '.';  // `(?<!\.)`: `x.0.1` indexes twice, no float
    if (!after_dot && f + 1 < src_.size() && src_[f] == '.' && std::isdigit(static_cast<unsigned char>(src_[f + 1]))) {
      f = digits(f + 1);
      is_float = true;
    }
    if (!after_dot && f < src_.size() && (src_[f] == 'e' || src_[f] == 'E')) {
      size_t g = f + 1;
      if (g < src_.size() && (src_[g] == '+' || src_[g] == '-')) ++g;
      if (g < src_.size() && std::isdigit(static_cast<unsigned char>(src_[g]))) {
        f = digits(g);
        is_float = true;
      }
    }
    Token t;
    position(k, t);
    if (is_float) {
      t.type = Tok::Float;
      t.float_value = std::stod(strip(src_.substr(k, f - k)));
      tokens_.push_back(t);
      return f;
    }
    t.type = Tok::Int;
    const std::string text = strip(src_.substr(k, e - k));
    try {
      t.int_value = std::stoll(text);
    } catch (const std::out_of_range&) {
      fail_at(k, "integer literal " + text + " does not fit 64 bits");
    }
    tokens_.push_back(t);
    return e;
  }

  // Python's unicode-escape decoding of the literal's body, as jinja2 applies it.
  size_t lex_string(size_t k) {
    const char quote = src_[k];
    std::string value;
    size_t p = k + 1;
    while (true) {
      if (p >= src_.size()) fail_at(k, "unterminated string literal");
      char c = src_[p];
      if (c == quote) break;
      if (c != '\\') {
        value += c;
        ++p;
        continue;
      }
      if (p + 1 >= src_.size()) fail_at(k, "unterminated string literal");
      char e = src_[p + 1];
      p += 2;
      auto hex = [&](int n) {
        if (p + n > src_.size()) fail_at(k, "truncated \\x, \\u or \\U escape in a string literal");
        char32_t cp = 0;
        for (int j = 0; j < n; ++j) {
          char h = src_[p + j];
          if (!std::isxdigit(static_cast<unsigned char>(h)))
            fail_at(k, "truncated \\x, \\u or \\U escape in a string literal");
          cp = cp * 16 + (std::isdigit(static_cast<unsigned char>(h)) ? h - '0' : (std::tolower(h) - 'a' + 10));
        }
        p += n;
        if (cp > 0x10ffff) fail_at(k, "illegal Unicode character in a string literal");
        utf8_append(value, cp);
      };
      switch (e) {
        case '\n':
          break;  // a backslash-newline continues the line
        case '\\':
          value += '\\';
          break;
        case '\'':
          value += '\'';
          break;
        case '"':
          value += '"';
          break;
        case 'a':
          value += '\a';
          break;
        case 'b':
          value += '\b';
          break;
        case 'f':
          value += '\f';
          break;
        case 'n':
          value += '\n';
          break;
        case 'r':
          value += '\r';
          break;
        case 't':
          value += '\t';
          break;
        case 'v':
          value += '\v';
          break;
        case 'x':
          hex(2);
          break;
        case 'u':
          hex(4);
          break;
        case 'U':
          hex(8);
          break;
        case 'N':
          fail_at(k, "\\N{...} escapes in string literals are not supported");
        default:
          if (e >= '0' && e <= '7') {
            char32_t cp = e - '0';
            for (int j = 0; j < 2 && p < src_.size() && src_[p] >= '0' && src_[p] <= '7'; ++j)
              cp = cp * 8 + (src_[p++] - '0');
            utf8_append(value, cp);
          } else {
            value += '\\';  // Python keeps an unknown escape as it is
            --p;
          }
      }
    }
    push(Tok::String, k, std::move(value));
    return p + 1;
  }

  std::string src_;
  const std::string& origin_;
  size_t pos_ = 0;
  std::vector<Token> tokens_;
  size_t line_pos_ = 0;
  int line_ = 1;
  int col_ = 1;
};

// jinja2 normalises \r\n and \r to \n, then drops one trailing newline (keep_trailing_newline=False).
std::string normalise_newlines(const std::string& source) {
  std::string out;
  out.reserve(source.size());
  for (size_t k = 0; k < source.size(); ++k) {
    if (source[k] == '\r') {
      out += '\n';
      if (k + 1 < source.size() && source[k + 1] == '\n') ++k;
    } else {
      out += source[k];
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

}  // namespace

std::vector<Token> lex_template(const std::string& source, const std::string& origin) {
  return Lexer(normalise_newlines(source), origin).run();
}

}  // namespace rf::text::detail
