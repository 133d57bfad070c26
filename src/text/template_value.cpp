#include "text/template_value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <nlohmann/json.hpp>

#include "text/utf8.h"

namespace rf::text::detail {

const Value* Mapping::find(const Value& key) const {
  for (const auto& [k, v] : items)
    if (equal(k, key)) return &v;
  return nullptr;
}

void Mapping::set(Value key, Value value) {
  for (auto& [k, v] : items)
    if (equal(k, key)) {
      v = std::move(value);
      return;
    }
  items.emplace_back(std::move(key), std::move(value));
}

std::string type_name(const Value& v) {
  switch (v.kind) {
    case Kind::Undefined:
      return "Undefined";
    case Kind::None:
      return "NoneType";
    case Kind::Bool:
      return "bool";
    case Kind::Int:
      return "int";
    case Kind::Float:
      return "float";
    case Kind::String:
      return "str";
    case Kind::List:
      return "list";
    case Kind::Tuple:
      return "tuple";
    case Kind::Dict:
      return "dict";
    case Kind::Namespace:
      return "Namespace";
    case Kind::Loop:
      return "LoopContext";
    case Kind::Macro:
      return "Macro";
    case Kind::Function:
      return "builtin_function_or_method";
  }
  return "object";
}

void fail_undefined(const Value& v) { throw RenderFailure(v.str.empty() ? "undefined value" : v.str); }

bool truthy(const Value& v) {
  switch (v.kind) {
    case Kind::Undefined:
    case Kind::None:
      return false;
    case Kind::Bool:
      return v.b;
    case Kind::Int:
      return v.i != 0;
    case Kind::Float:
      return v.f != 0.0;
    case Kind::String:
      return !v.str.empty();
    case Kind::List:
    case Kind::Tuple:
      return !v.list->empty();
    case Kind::Dict:
      return !v.dict->items.empty();
    default:
      return true;
  }
}

static double as_double(const Value& v) {
  if (v.kind == Kind::Float) return v.f;
  if (v.kind == Kind::Bool) return v.b ? 1.0 : 0.0;
  return static_cast<double>(v.i);
}

static int64_t as_int(const Value& v) { return v.kind == Kind::Bool ? (v.b ? 1 : 0) : v.i; }

bool equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.kind == Kind::Float || b.kind == Kind::Float) return as_double(a) == as_double(b);
    return as_int(a) == as_int(b);
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Kind::Undefined:
    case Kind::None:
      return true;
    case Kind::String:
      return a.str == b.str;
    case Kind::List:
    case Kind::Tuple: {
      if (a.list->size() != b.list->size()) return false;
      for (size_t k = 0; k < a.list->size(); ++k)
        if (!equal((*a.list)[k], (*b.list)[k])) return false;
      return true;
    }
    case Kind::Dict: {
      if (a.dict->items.size() != b.dict->items.size()) return false;
      for (const auto& [k, v] : a.dict->items) {
        const Value* other = b.dict->find(k);
        if (!other || !equal(v, *other)) return false;
      }
      return true;
    }
    case Kind::Namespace:
    case Kind::Loop:
      return a.dict == b.dict;
    case Kind::Macro:
      return a.macro == b.macro;
    default:
      return false;
  }
}

bool less(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.kind == Kind::Float || b.kind == Kind::Float) return as_double(a) < as_double(b);
    return as_int(a) < as_int(b);
  }
  if (a.kind == Kind::String && b.kind == Kind::String) return a.str < b.str;  // UTF-8 order is code point order
  if (a.kind == b.kind && a.is_sequence_like()) {
    const Items& x = *a.list;
    const Items& y = *b.list;
    for (size_t k = 0; k < std::min(x.size(), y.size()); ++k)
      if (!equal(x[k], y[k])) return less(x[k], y[k]);
    return x.size() < y.size();
  }
  if (a.is_undefined()) fail_undefined(a);
  if (b.is_undefined()) fail_undefined(b);
  throw RenderFailure("'<' not supported between instances of '" + type_name(a) + "' and '" + type_name(b) + "'");
}

std::string float_repr(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  if (x == 0.0) return std::signbit(x) ? "-0.0" : "0.0";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, x, std::chars_format::scientific);  // shortest round trip
  std::string sci(buf, res.ptr);
  std::string out;
  if (sci[0] == '-') {
    out = "-";
    sci.erase(0, 1);
  }
  size_t e = sci.find('e');
  std::string digits = sci.substr(0, e);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  int exponent = std::stoi(sci.substr(e + 1));
  int decpt = exponent + 1;  // digits d1 d2 ... with the point after decpt of them (Python's dtoa convention)
  const int n = static_cast<int>(digits.size());
  if (decpt > -4 && decpt <= 16) {  // Python's repr switches to exponent form outside this range
    if (decpt <= 0) {
      out += "0." + std::string(-decpt, '0') + digits;
    } else if (decpt >= n) {
      out += digits + std::string(decpt - n, '0') + ".0";
    } else {
      out += digits.substr(0, decpt) + "." + digits.substr(decpt);
    }
    return out;
  }
  out += digits.substr(0, 1);
  if (n > 1) out += "." + digits.substr(1);
  char exp[16];
  std::snprintf(exp, sizeof exp, "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
  return out + exp;
}

std::vector<char32_t> decode_utf8(std::string_view s) {
  std::vector<char32_t> out;
  out.reserve(s.size());
  for (size_t k = 0; k < s.size();) {
    const size_t len = utf8_length_at(s, k);
    if (len == 0) throw RenderFailure("text is not valid UTF-8 (byte " + std::to_string(k) + ")");
    out.push_back(utf8_decode(s, k, len));
    k += len;
  }
  return out;
}

std::string encode_utf8(const std::vector<char32_t>& cps) {
  std::string out;
  for (char32_t cp : cps) utf8_append(out, cp);
  return out;
}

bool is_py_space(char32_t cp) {
  // Python's _PyUnicode_IsWhitespace: bidirectional types WS, B, S or category Zs, which is Unicode's White_Space
  // and the four separators U+001C..U+001F.
  return is_unicode_whitespace(cp) || (cp >= 0x1c && cp <= 0x1f);
}

std::string py_strip(std::string_view s, bool left, bool right) {
  std::vector<char32_t> cps = decode_utf8(s);
  size_t b = 0, e = cps.size();
  if (left)
    while (b < e && is_py_space(cps[b])) ++b;
  if (right)
    while (e > b && is_py_space(cps[e - 1])) --e;
  return encode_utf8(std::vector<char32_t>(cps.begin() + b, cps.begin() + e));
}

// Python's str.isprintable() is false for categories Cc, Cf, Cs, Co, Cn, Zl, Zp and Zs but the space: repr
// escapes those. The table holds the assigned ones a chat text can plausibly hold.
static bool py_unprintable(char32_t cp) {
  if (cp < 0x20 || (cp >= 0x7f && cp <= 0xa0) || cp == 0xad) return true;
  if (cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200f) || (cp >= 0x2028 && cp <= 0x202f)) return true;
  if ((cp >= 0x205f && cp <= 0x2064) || (cp >= 0x2066 && cp <= 0x206f) || cp == 0x3000 || cp == 0xfeff) return true;
  if ((cp >= 0x0600 && cp <= 0x0605) || cp == 0x061c || cp == 0x06dd || cp == 0x070f || cp == 0x180e) return true;
  if ((cp >= 0xfff9 && cp <= 0xfffb) || (cp >= 0xe000 && cp <= 0xf8ff) || cp >= 0xf0000) return true;
  if (cp == 0xe0001 || (cp >= 0xe0020 && cp <= 0xe007f)) return true;
  return false;
}

static std::string string_repr(const std::string& s) {
  const bool has_single = s.find('\'') != std::string::npos;
  const bool has_double = s.find('"') != std::string::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (char32_t cp : decode_utf8(s)) {
    if (cp == '\\') {
      out += "\\\\";
    } else if (cp == static_cast<char32_t>(quote)) {
      out += '\\';
      out += quote;
    } else if (cp == '\t') {
      out += "\\t";
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (py_unprintable(cp)) {
      char buf[16];
      if (cp < 0x100)
        std::snprintf(buf, sizeof buf, "\\x%02x", static_cast<unsigned>(cp));
      else if (cp < 0x10000)
        std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(cp));
      else
        std::snprintf(buf, sizeof buf, "\\U%08x", static_cast<unsigned>(cp));
      out += buf;
    } else {
      utf8_append(out, cp);
    }
  }
  out += quote;
  return out;
}

std::string repr(const Value& v) {
  switch (v.kind) {
    case Kind::Undefined:
      return "Undefined";
    case Kind::String:
      return string_repr(v.str);
    case Kind::List:
    case Kind::Tuple: {
      const bool tuple = v.kind == Kind::Tuple;
      std::string out = tuple ? "(" : "[";
      for (size_t k = 0; k < v.list->size(); ++k) {
        if (k) out += ", ";
        out += repr((*v.list)[k]);
      }
      if (tuple && v.list->size() == 1) out += ",";
      return out + (tuple ? ")" : "]");
    }
    case Kind::Dict: {
      std::string out = "{";
      bool first = true;
      for (const auto& [k, val] : v.dict->items) {
        if (!first) out += ", ";
        first = false;
        out += repr(k) + ": " + repr(val);
      }
      return out + "}";
    }
    default:
      return to_str(v);
  }
}

std::string to_str(const Value& v) {
  switch (v.kind) {
    case Kind::Undefined:
      return "";
    case Kind::None:
      return "None";
    case Kind::Bool:
      return v.b ? "True" : "False";
    case Kind::Int:
      return std::to_string(v.i);
    case Kind::Float:
      return float_repr(v.f);
    case Kind::String:
      return v.str;
    case Kind::List:
    case Kind::Tuple:
    case Kind::Dict:
      return repr(v);
    case Kind::Namespace:
      return "<Namespace " + repr(Value::dict_of(*v.dict)) + ">";
    case Kind::Loop:
      return "<LoopContext>";
    case Kind::Macro:
      return "<Macro>";
    case Kind::Function:
      return "<built-in method " + v.str + ">";
  }
  return "";
}

static void json_string(std::string& out, const std::string& s) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);  // ensure_ascii=False: everything else as it is
        }
    }
  }
  out += '"';
}

static std::string json_key(const Value& k) {
  switch (k.kind) {
    case Kind::String:
      return k.str;
    case Kind::Int:
      return std::to_string(k.i);
    case Kind::Float:
      return float_repr(k.f);
    case Kind::Bool:
      return k.b ? "true" : "false";
    case Kind::None:
      return "null";
    default:
      throw RenderFailure("keys must be str, int, float, bool or None, not " + type_name(k));
  }
}

static void json_dump(std::string& out, const Value& v, const JsonStyle& st, int level) {
  const std::string item_sep = st.explicit_separators ? st.item_separator : (st.indent >= 0 ? "," : ", ");
  auto newline = [&](int lvl) {
    if (st.indent >= 0) out += "\n" + std::string(static_cast<size_t>(st.indent) * lvl, ' ');
  };
  switch (v.kind) {
    case Kind::None:
      out += "null";
      return;
    case Kind::Bool:
      out += v.b ? "true" : "false";
      return;
    case Kind::Int:
      out += std::to_string(v.i);
      return;
    case Kind::Float:
      if (std::isnan(v.f))
        out += "NaN";
      else if (std::isinf(v.f))
        out += v.f > 0 ? "Infinity" : "-Infinity";
      else
        out += float_repr(v.f);
      return;
    case Kind::String:
      json_string(out, v.str);
      return;
    case Kind::List:
    case Kind::Tuple: {
      if (v.list->empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t k = 0; k < v.list->size(); ++k) {
        if (k) out += item_sep;
        newline(level + 1);
        json_dump(out, (*v.list)[k], st, level + 1);
      }
      newline(level);
      out += ']';
      return;
    }
    case Kind::Dict: {
      if (v.dict->items.empty()) {
        out += "{}";
        return;
      }
      std::vector<std::pair<std::string, const Value*>> items;
      for (const auto& [k, val] : v.dict->items) items.emplace_back(json_key(k), &val);
      if (st.sort_keys)
        std::stable_sort(items.begin(), items.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
      out += '{';
      for (size_t k = 0; k < items.size(); ++k) {
        if (k) out += item_sep;
        newline(level + 1);
        json_string(out, items[k].first);
        out += st.key_separator;
        json_dump(out, *items[k].second, st, level + 1);
      }
      newline(level);
      out += '}';
      return;
    }
    default:
      throw RenderFailure("Object of type " + type_name(v) + " is not JSON serializable");
  }
}

std::string to_json(const Value& v, const JsonStyle& style) {
  std::string out;
  json_dump(out, v, style, 0);
  return out;
}

Value from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
      return Value::none();
    case nlohmann::ordered_json::value_t::boolean:
      return Value::boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return Value::integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      uint64_t u = j.get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX))
        throw RenderFailure("an integer above 2^63-1 in the template's variables is not supported");
      return Value::integer(static_cast<int64_t>(u));
    }
    case nlohmann::ordered_json::value_t::number_float:
      return Value::real(j.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return Value::string(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      Items items;
      items.reserve(j.size());
      for (const auto& e : j) items.push_back(from_json(e));
      return Value::list_of(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      Mapping d;
      d.items.reserve(j.size());
      for (const auto& [k, e] : j.items()) d.items.emplace_back(Value::string(k), from_json(e));
      return Value::dict_of(std::move(d));
    }
    default:
      throw RenderFailure("binary JSON values are not template variables");
  }
}

}  // namespace rf::text::detail
