#include "text/template_builtins.h"

#include <algorithm>
#include <cmath>
#include <ctime>
#include <functional>
#include <set>

#include "text/utf8.h"

namespace rf::text::detail {
namespace {

[[noreturn]] void fail(const std::string& why) { throw RenderFailure(why); }

const std::set<std::string>& supported_filters() {
  static const std::set<std::string> names = {"abs",        "capitalize", "count",   "d",       "default", "dictsort",
                                              "first",      "float",      "int",     "items",   "join",    "last",
                                              "length",     "list",       "lower",   "map",     "max",     "min",
                                              "reject",     "rejectattr", "replace", "reverse", "safe",    "select",
                                              "selectattr", "sort",       "string",  "sum",     "title",   "tojson",
                                              "trim",       "unique",     "upper",   "e",       "escape"};
  return names;
}

const std::set<std::string>& supported_tests() {
  static const std::set<std::string> names = {"boolean",  "callable",    "defined", "divisibleby", "eq",
                                              "equalto",  "==",          "!=",      "ne",          "<",
                                              "lt",       "lessthan",    "<=",      "le",          ">",
                                              "gt",       "greaterthan", ">=",      "ge",          "even",
                                              "odd",      "false",       "true",    "float",       "integer",
                                              "in",       "iterable",    "lower",   "upper",       "mapping",
                                              "none",     "number",      "sameas",  "sequence",    "string",
                                              "undefined"};
  return names;
}

// --- Unicode case, as Python's str.upper()/lower() give it ----------------------------------------------------
// Covered: ASCII, Latin-1, Latin Extended-A, Greek, Cyrillic. A code point of another cased script is refused,
// never left as it is: a silent difference from jinja2 would change what the model is trained on.
bool in_other_cased_block(char32_t c) {
  static const std::pair<char32_t, char32_t> blocks[] = {
      {0x180, 0x24f},     {0x250, 0x2af},     {0x345, 0x345},     {0x370, 0x385},     {0x3cf, 0x3ff},
      {0x531, 0x587},     {0x10a0, 0x10ff},   {0x13a0, 0x13ff},   {0x1c80, 0x1cbf},   {0x1d00, 0x1dbf},
      {0x1e00, 0x1fff},   {0x2126, 0x2132},   {0x214e, 0x214e},   {0x2160, 0x2184},   {0x24b6, 0x24e9},
      {0x2c00, 0x2d2f},   {0xa640, 0xa7ff},   {0xab30, 0xabbf},   {0xfb00, 0xfb17},   {0xff21, 0xff5a},
      {0x10400, 0x104ff}, {0x10c80, 0x10cff}, {0x118a0, 0x118ff}, {0x16e40, 0x16e9f}, {0x1e900, 0x1e94f}};
  for (auto [lo, hi] : blocks)
    if (c >= lo && c <= hi) return true;
  return false;
}

void case_map(std::u32string& out, char32_t c, bool upper) {
  auto paired = [&](char32_t lo, char32_t hi, bool upper_even) -> bool {  // alternating pairs in [lo, hi]
    if (c < lo || c > hi) return false;
    const bool is_upper = ((c - lo) % 2 == 0) == upper_even;
    if (upper && !is_upper)
      out += c - 1;
    else if (!upper && is_upper)
      out += c + 1;
    else
      out += c;
    return true;
  };
  if (c < 0x80) {
    out += upper ? static_cast<char32_t>(std::toupper(static_cast<int>(c)))
                 : static_cast<char32_t>(std::tolower(static_cast<int>(c)));
    return;
  }
  if (upper) {
    if (c == 0xdf) return out.append(U"SS"), void();
    if (c == 0xb5) return out.push_back(0x39c), void();
    if (c == 0xff) return out.push_back(0x178), void();
    if (c >= 0xe0 && c <= 0xfe && c != 0xf7) return out.push_back(c - 0x20), void();
    if (c == 0x131) return out.push_back('I'), void();
    if (c == 0x149) return out.append(U"\u02bcN"), void();
    if (c == 0x17f) return out.push_back('S'), void();
    if (c == 0x3c2) return out.push_back(0x3a3), void();
    if (c >= 0x3b1 && c <= 0x3cb) return out.push_back(c - 0x20), void();
    if (c == 0x3ac) return out.push_back(0x386), void();
    if (c >= 0x3ad && c <= 0x3af) return out.push_back(c - 0x25), void();
    if (c == 0x3cc) return out.push_back(0x38c), void();
    if (c == 0x3cd || c == 0x3ce) return out.push_back(c - 0x3f), void();
    if (c == 0x390 || c == 0x3b0) fail("upper() of U+0390/U+03B0 (three code points in Python) is not supported");
    if (c >= 0x430 && c <= 0x44f) return out.push_back(c - 0x20), void();
    if (c >= 0x450 && c <= 0x45f) return out.push_back(c - 0x50), void();
    if (c == 0x4cf) return out.push_back(0x4c0), void();
  } else {
    if (c >= 0xc0 && c <= 0xde && c != 0xd7) return out.push_back(c + 0x20), void();
    if (c == 0x130) return out.append(U"i\u0307"), void();
    if (c == 0x178) return out.push_back(0xff), void();
    if (c >= 0x391 && c <= 0x3ab) return out.push_back(c + 0x20), void();
    if (c == 0x386) return out.push_back(0x3ac), void();
    if (c >= 0x388 && c <= 0x38a) return out.push_back(c + 0x25), void();
    if (c == 0x38c) return out.push_back(0x3cc), void();
    if (c == 0x38e || c == 0x38f) return out.push_back(c + 0x3f), void();
    if (c >= 0x410 && c <= 0x42f) return out.push_back(c + 0x20), void();
    if (c >= 0x400 && c <= 0x40f) return out.push_back(c + 0x50), void();
    if (c == 0x4c0) return out.push_back(0x4cf), void();
  }
  if (c >= 0x100 && c <= 0x17f && c != 0x130 && c != 0x131 && c != 0x138 && c != 0x149 && c != 0x178 && c != 0x17f) {
    const bool odd_upper = (c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17e);
    if (paired(odd_upper ? (c >= 0x179 ? 0x179 : 0x139) : 0x100, odd_upper ? (c >= 0x179 ? 0x17e : 0x148) : 0x177,
               true))
      return;
  }
  if (paired(0x460, 0x481, true) || paired(0x48a, 0x4bf, true) || paired(0x4c1, 0x4ce, true) ||
      paired(0x4d0, 0x52f, true))
    return;
  if (in_other_cased_block(c)) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%s() of U+%04X is not supported (docs/text.md)", upper ? "upper" : "lower",
                  static_cast<unsigned>(c));
    fail(buf);
  }
  out += c;
}

// Unicode's Case_Ignorable (the part chat text reaches): apostrophes, periods, colons, middle dots, modifier
// letters and combining marks; and Cased for the scripts case_map covers.
bool case_ignorable(char32_t c) {
  return c == 0x27 || c == 0x2e || c == 0x3a || c == 0x5e || c == 0x60 || c == 0xa8 || c == 0xad || c == 0xaf ||
         c == 0xb4 || c == 0xb7 || c == 0xb8 || (c >= 0x2b0 && c <= 0x36f) || c == 0x2018 || c == 0x2019 ||
         c == 0x2024 || c == 0x2027;
}

bool cased(char32_t c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || c == 0xaa || c == 0xb5 || c == 0xba ||
         (c >= 0xc0 && c <= 0x24f && c != 0xd7 && c != 0xf7) ||
         (c >= 0x370 && c <= 0x3ff && c != 0x37e && c != 0x384 && c != 0x385 && c != 0x387) ||
         (c >= 0x400 && c <= 0x52f && !(c >= 0x482 && c <= 0x489)) || in_other_cased_block(c);
}

// Python's final_sigma(): a cased letter before position k (skipping case-ignorables) and none after it.
bool final_sigma(const std::vector<char32_t>& cps, size_t k) {
  size_t j = k;
  while (j > 0 && case_ignorable(cps[j - 1])) --j;
  if (j == 0 || !cased(cps[j - 1])) return false;
  j = k + 1;
  while (j < cps.size() && case_ignorable(cps[j])) ++j;
  return j == cps.size() || !cased(cps[j]);
}

std::string change_case(const std::string& s, bool upper) {
  bool ascii = std::all_of(s.begin(), s.end(), [](char ch) { return static_cast<unsigned char>(ch) < 0x80; });
  if (ascii) {
    std::string out = s;
    for (char& ch : out) ch = static_cast<char>(upper ? std::toupper(ch) : std::tolower(ch));
    return out;
  }
  std::u32string mapped;
  std::vector<char32_t> cps = decode_utf8(s);
  for (size_t k = 0; k < cps.size(); ++k) {
    if (!upper && cps[k] == 0x3a3) {  // Python's Final_Sigma: a capital sigma ending a word lowers to U+03C2
      mapped += final_sigma(cps, k) ? 0x3c2 : 0x3c3;
      continue;
    }
    case_map(mapped, cps[k], upper);
  }
  return encode_utf8(std::vector<char32_t>(mapped.begin(), mapped.end()));
}

std::string first_upper_rest_lower(const std::string& s) {
  std::vector<char32_t> cps = decode_utf8(s);
  if (cps.empty()) return s;
  std::string first = encode_utf8({cps[0]});
  std::string rest = encode_utf8(std::vector<char32_t>(cps.begin() + 1, cps.end()));
  return change_case(first, true) + change_case(rest, false);
}

// --- argument helpers --------------------------------------------------------------------------------------
// Python's binding of positional and keyword arguments to a signature (names in order, with their defaults).
std::vector<Value> bind(const std::string& fn, const CallArgs& args, const std::vector<std::string>& names,
                        std::vector<Value> defaults) {
  if (args.pos.size() > names.size())
    fail(fn + "() takes at most " + std::to_string(names.size()) + " arguments (" + std::to_string(args.pos.size()) +
         " given)");
  for (size_t k = 0; k < args.pos.size(); ++k) defaults[k] = args.pos[k];
  for (const auto& [key, v] : args.kw) {
    auto it = std::find(names.begin(), names.end(), key);
    if (it == names.end()) fail(fn + "() got an unexpected keyword argument '" + key + "'");
    defaults[static_cast<size_t>(it - names.begin())] = v;
  }
  return defaults;
}

const std::string& need_string(const Value& v, const std::string& what) {
  if (v.kind != Kind::String) {
    if (v.is_undefined()) fail_undefined(v);
    fail(what + " must be str, not " + type_name(v));
  }
  return v.str;
}

int64_t need_int(const Value& v, const std::string& what) {
  if (v.kind == Kind::Int) return v.i;
  if (v.kind == Kind::Bool) return v.b;
  if (v.is_undefined()) fail_undefined(v);
  fail(what + " must be an integer, not " + type_name(v));
}

size_t py_len(const Value& v) {
  switch (v.kind) {
    case Kind::Undefined:
      return 0;
    case Kind::String:
      return decode_utf8(v.str).size();
    case Kind::List:
    case Kind::Tuple:
      return v.list->size();
    case Kind::Dict:
    case Kind::Loop:
      return v.dict->items.size();
    default:
      fail("object of type '" + type_name(v) + "' has no len()");
  }
}

// jinja2's make_attrgetter: "a.b" looks up a then b (integers as indices), each through getitem.
Value attr_path(const Value& item, const Value& attribute) {
  if (attribute.kind != Kind::String) return get_item(item, attribute);
  Value v = item;
  size_t start = 0;
  while (true) {
    size_t dot = attribute.str.find('.', start);
    std::string part = attribute.str.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    const bool digits = !part.empty() && std::all_of(part.begin(), part.end(), ::isdigit);
    v = get_item(v, digits ? Value::integer(std::stoll(part)) : Value::string(part));
    if (dot == std::string::npos) return v;
    start = dot + 1;
  }
}

Value lower_if_string(const Value& v) { return v.kind == Kind::String ? Value::string(change_case(v.str, false)) : v; }

Items sorted_copy(Items items, const std::function<Value(const Value&)>& key, bool reverse) {
  std::stable_sort(items.begin(), items.end(), [&](const Value& a, const Value& b) {
    return reverse ? less(key(b), key(a)) : less(key(a), key(b));
  });
  return items;
}

std::string py_replace(const std::string& s, const std::string& old, const std::string& repl, int64_t count) {
  if (old.empty()) {  // Python inserts the replacement between every code point and at both ends
    std::vector<char32_t> cps = decode_utf8(s);
    std::string out;
    int64_t done = 0;
    for (size_t k = 0; k <= cps.size(); ++k) {
      if (count < 0 || done < count) {
        out += repl;
        ++done;
      }
      if (k < cps.size()) utf8_append(out, cps[k]);
    }
    return out;
  }
  std::string out;
  size_t pos = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    size_t hit = s.find(old, pos);
    if (hit == std::string::npos) break;
    out.append(s, pos, hit - pos);
    out += repl;
    pos = hit + old.size();
    ++done;
  }
  out.append(s, pos, std::string::npos);
  return out;
}

// Python's str.split(sep, maxsplit) and rsplit.
Items py_split(const std::string& s, const Value& sep, int64_t maxsplit, bool from_right) {
  Items parts;
  if (sep.kind == Kind::None || sep.is_undefined()) {
    std::vector<char32_t> cps = decode_utf8(s);
    std::vector<std::pair<size_t, size_t>> words;
    size_t k = 0;
    while (k < cps.size()) {
      while (k < cps.size() && is_py_space(cps[k])) ++k;
      if (k == cps.size()) break;
      size_t b = k;
      while (k < cps.size() && !is_py_space(cps[k])) ++k;
      words.emplace_back(b, k);
    }
    if (maxsplit >= 0 && static_cast<int64_t>(words.size()) > maxsplit + 1) {
      // The unsplit remainder keeps its inner whitespace (and loses only the outer side's).
      if (!from_right) {
        auto rest_begin = words[static_cast<size_t>(maxsplit)].first;
        size_t end = cps.size();
        while (end > rest_begin && is_py_space(cps[end - 1])) --end;
        words.resize(static_cast<size_t>(maxsplit));
        words.emplace_back(rest_begin, end);
      } else {
        size_t keep_from = words.size() - static_cast<size_t>(maxsplit);
        auto rest_end = words[keep_from - 1].second;
        size_t begin = 0;
        while (begin < rest_end && is_py_space(cps[begin])) ++begin;
        std::vector<std::pair<size_t, size_t>> w2 = {{begin, rest_end}};
        w2.insert(w2.end(), words.begin() + static_cast<long>(keep_from), words.end());
        words = w2;
      }
    }
    for (auto [b, e] : words)
      parts.push_back(Value::string(encode_utf8(std::vector<char32_t>(cps.begin() + b, cps.begin() + e))));
    return parts;
  }
  const std::string& d = need_string(sep, "the separator");
  if (d.empty()) fail("empty separator");
  std::vector<std::string> pieces;
  if (!from_right) {
    size_t pos = 0;
    while (maxsplit < 0 || static_cast<int64_t>(pieces.size()) < maxsplit) {
      size_t hit = s.find(d, pos);
      if (hit == std::string::npos) break;
      pieces.push_back(s.substr(pos, hit - pos));
      pos = hit + d.size();
    }
    pieces.push_back(s.substr(pos));
  } else {
    size_t end = s.size();
    std::vector<std::string> rev;
    while (maxsplit < 0 || static_cast<int64_t>(rev.size()) < maxsplit) {
      if (end < d.size()) break;
      size_t hit = s.rfind(d, end - d.size());
      if (hit == std::string::npos) break;
      rev.push_back(s.substr(hit + d.size(), end - hit - d.size()));
      end = hit;
    }
    rev.push_back(s.substr(0, end));
    pieces.assign(rev.rbegin(), rev.rend());
  }
  for (auto& p : pieces) parts.push_back(Value::string(std::move(p)));
  return parts;
}

std::string strip_chars(const std::string& s, const Value& chars, bool left, bool right) {
  if (chars.kind == Kind::None || chars.is_undefined()) return py_strip(s, left, right);
  std::vector<char32_t> set = decode_utf8(need_string(chars, "strip's argument"));
  std::vector<char32_t> cps = decode_utf8(s);
  auto in = [&](char32_t c) { return std::find(set.begin(), set.end(), c) != set.end(); };
  size_t b = 0, e = cps.size();
  if (left)
    while (b < e && in(cps[b])) ++b;
  if (right)
    while (e > b && in(cps[e - 1])) --e;
  return encode_utf8(std::vector<char32_t>(cps.begin() + b, cps.begin() + e));
}

bool affix_test(const std::string& s, const Value& affix, bool prefix) {
  auto one = [&](const Value& a) {
    const std::string& x = need_string(a, prefix ? "startswith's argument" : "endswith's argument");
    if (x.size() > s.size()) return false;
    return prefix ? s.compare(0, x.size(), x) == 0 : s.compare(s.size() - x.size(), x.size(), x) == 0;
  };
  if (affix.kind == Kind::Tuple) {
    for (const Value& a : *affix.list)
      if (one(a)) return true;
    return false;
  }
  return one(affix);
}

std::string title_case(const std::string& s) {
  // jinja2's do_title: words begin after runs of [-\s({[<]; each word's first character upper, the rest lower.
  std::vector<char32_t> cps = decode_utf8(s);
  std::string out;
  size_t k = 0;
  auto sep = [](char32_t c) { return c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || is_py_space(c); };
  while (k < cps.size()) {
    size_t b = k;
    const bool is_sep = sep(cps[k]);
    while (k < cps.size() && sep(cps[k]) == is_sep) ++k;
    std::string piece = encode_utf8(std::vector<char32_t>(cps.begin() + b, cps.begin() + k));
    out += is_sep ? piece : first_upper_rest_lower(piece);
  }
  return out;
}

Value py_int(const Value& v, const Value& fallback) {
  switch (v.kind) {
    case Kind::Int:
      return v;
    case Kind::Bool:
      return Value::integer(v.b);
    case Kind::Float:
      if (!std::isfinite(v.f)) return fallback;
      if (std::fabs(v.f) >= 9.2e18) fail("int() of a float beyond 64 bits is not supported");
      return Value::integer(static_cast<int64_t>(v.f));
    case Kind::String: {
      std::string t = py_strip(v.str, true, true);
      std::string digits = t;
      digits.erase(std::remove(digits.begin(), digits.end(), '_'), digits.end());
      size_t used = 0;
      try {
        int64_t x = std::stoll(digits, &used, 10);
        if (used == digits.size() && !digits.empty()) return Value::integer(x);
      } catch (const std::exception&) {
      }
      try {
        double d = std::stod(t, &used);
        if (used == t.size() && std::isfinite(d)) return Value::integer(static_cast<int64_t>(d));
      } catch (const std::exception&) {
      }
      return fallback;
    }
    case Kind::Undefined:
      fail_undefined(v);
    default:
      return fallback;
  }
}

Value py_float(const Value& v, const Value& fallback) {
  switch (v.kind) {
    case Kind::Int:
      return Value::real(static_cast<double>(v.i));
    case Kind::Bool:
      return Value::real(v.b ? 1.0 : 0.0);
    case Kind::Float:
      return v;
    case Kind::String: {
      std::string t = py_strip(v.str, true, true);
      size_t used = 0;
      try {
        double d = std::stod(t, &used);
        if (used == t.size()) return Value::real(d);
      } catch (const std::exception&) {
      }
      return fallback;
    }
    case Kind::Undefined:
      fail_undefined(v);
    default:
      return fallback;
  }
}

Value sum_of(const Items& items, Value start) {
  Value acc = std::move(start);
  for (const Value& x : items) {
    if (!acc.is_number() || !x.is_number()) fail("sum() of non-numbers is not supported");
    if (acc.kind == Kind::Float || x.kind == Kind::Float) {
      double a = acc.kind == Kind::Float ? acc.f : static_cast<double>(acc.kind == Kind::Bool ? acc.b : acc.i);
      double b = x.kind == Kind::Float ? x.f : static_cast<double>(x.kind == Kind::Bool ? x.b : x.i);
      acc = Value::real(a + b);
    } else {
      int64_t r = 0;
      if (__builtin_add_overflow(acc.kind == Kind::Bool ? acc.b : acc.i, x.kind == Kind::Bool ? x.b : x.i, &r))
        fail("integer overflow beyond 64 bits");
      acc = Value::integer(r);
    }
  }
  return acc;
}

Value tojson_filter(const Value& v, const CallArgs& args) {
  // transformers: json.dumps(x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
  auto a = bind("tojson", args, {"ensure_ascii", "indent", "separators", "sort_keys"},
                {Value::boolean(false), Value::none(), Value::none(), Value::boolean(false)});
  if (truthy(a[0])) fail("tojson(ensure_ascii=True) is not supported");
  JsonStyle st;
  if (a[1].kind != Kind::None) {
    if (a[1].kind == Kind::String) fail("tojson's indent as a string is not supported");
    st.indent = static_cast<int>(std::max<int64_t>(0, need_int(a[1], "tojson's indent")));
  }
  if (a[2].kind != Kind::None) {
    if (!a[2].is_sequence_like() || a[2].list->size() != 2) fail("tojson's separators must be a pair of strings");
    st.explicit_separators = true;
    st.item_separator = need_string((*a[2].list)[0], "a separator");
    st.key_separator = need_string((*a[2].list)[1], "a separator");
  }
  st.sort_keys = truthy(a[3]);
  return Value::string(to_json(v, st));
}

std::string unsafe_method(const Value& obj, const std::string& attr) {
  static const std::set<std::string> list_mutators = {"append", "extend",  "insert", "pop",
                                                      "remove", "reverse", "sort",   "clear"};
  static const std::set<std::string> dict_mutators = {"pop", "popitem", "setdefault", "update", "clear"};
  if ((obj.is_sequence_like() && obj.kind == Kind::List && list_mutators.count(attr)) ||
      (obj.kind == Kind::Dict && dict_mutators.count(attr)))
    return "access to attribute '" + attr + "' of '" + type_name(obj) + "' object is unsafe.";
  return "";
}

std::string object_type_repr(const Value& v) {
  if (v.kind == Kind::None) return "None";
  return type_name(v) + " object";
}

Value missing_attribute(const Value& obj, const Value& name) {
  // Built with append: GCC 12's -Wrestrict misfires on a chain of `"'" + std::string + ...` here.
  std::string hint = "'";
  hint.append(object_type_repr(obj));
  if (name.kind == Kind::String) {
    hint.append("' has no attribute '").append(name.str).append("'");
  } else {
    hint.append("' has no element ").append(repr(name));
  }
  return Value::undefined(std::move(hint));
}

// Python's slice.indices(n) and the positions it selects.
std::vector<size_t> slice_positions(const Value& slice, size_t n) {
  auto get = [&](size_t k) -> const Value& { return (*slice.list)[k]; };
  auto opt = [&](const Value& v, bool* present) -> int64_t {
    *present = v.kind != Kind::None;
    return *present ? need_int(v, "a slice index") : 0;
  };
  bool has_start = false, has_stop = false, has_step = false;
  int64_t start = opt(get(0), &has_start), stop = opt(get(1), &has_stop), step = opt(get(2), &has_step);
  if (!has_step) step = 1;
  if (step == 0) fail("slice step cannot be zero");
  const int64_t len = static_cast<int64_t>(n);
  auto clamp = [&](int64_t x, bool present, int64_t dflt) {
    if (!present) return dflt;
    if (x < 0) x += len;
    if (step > 0) return std::clamp<int64_t>(x, 0, len);
    return std::clamp<int64_t>(x, -1, len - 1);
  };
  start = clamp(start, has_start, step > 0 ? 0 : len - 1);
  stop = clamp(stop, has_stop, step > 0 ? len : -1);
  std::vector<size_t> out;
  for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step) out.push_back(static_cast<size_t>(k));
  return out;
}

}  // namespace

bool has_filter(const std::string& name) { return supported_filters().count(name) > 0; }
bool has_test(const std::string& name) { return supported_tests().count(name) > 0; }

bool is_jinja_filter(const std::string& name) {
  static const std::set<std::string> names = {
      "abs",    "attr",       "batch",       "capitalize", "center",   "count",
      "d",      "default",    "dictsort",    "e",          "escape",   "filesizeformat",
      "first",  "float",      "forceescape", "format",     "groupby",  "indent",
      "int",    "items",      "join",        "last",       "length",   "list",
      "lower",  "map",        "max",         "min",        "pprint",   "random",
      "reject", "rejectattr", "replace",     "reverse",    "round",    "safe",
      "select", "selectattr", "slice",       "sort",       "string",   "striptags",
      "sum",    "title",      "tojson",      "trim",       "truncate", "unique",
      "upper",  "urlencode",  "urlize",      "wordcount",  "wordwrap", "xmlattr"};
  return names.count(name) > 0;
}

bool is_jinja_test(const std::string& name) {
  return name == "escaped" || name == "filter" || name == "test" || has_test(name);
}

Items iterate(const Value& v) {
  switch (v.kind) {
    case Kind::Undefined:
      return {};
    case Kind::List:
    case Kind::Tuple:
      return *v.list;
    case Kind::String: {
      Items out;
      for (char32_t c : decode_utf8(v.str)) out.push_back(Value::string(encode_utf8({c})));
      return out;
    }
    case Kind::Dict: {
      Items out;
      for (const auto& kv : v.dict->items) out.push_back(kv.first);
      return out;
    }
    default:
      fail("'" + type_name(v) + "' object is not iterable");
  }
}

Value get_item(const Value& obj, const Value& key) {
  switch (obj.kind) {
    case Kind::Undefined:
      fail_undefined(obj);
    case Kind::Dict:
    case Kind::Loop:
    case Kind::Namespace: {
      if (obj.kind != Kind::Namespace)
        if (const Value* v = obj.dict->find(key)) return *v;
      if (key.kind == Kind::String) return get_attribute(obj, key.str);
      return missing_attribute(obj, key);
    }
    case Kind::List:
    case Kind::Tuple:
    case Kind::String: {
      const bool is_str = obj.kind == Kind::String;
      if (key.kind == Kind::Tuple && key.list->size() == 3 && key.str == "slice") {
        if (is_str) {
          std::vector<char32_t> cps = decode_utf8(obj.str), out;
          for (size_t k : slice_positions(key, cps.size())) out.push_back(cps[k]);
          return Value::string(encode_utf8(out));
        }
        Items out;
        for (size_t k : slice_positions(key, obj.list->size())) out.push_back((*obj.list)[k]);
        return Value::list_of(std::move(out), obj.kind);
      }
      if (key.kind == Kind::Int || key.kind == Kind::Bool) {
        int64_t idx = key.kind == Kind::Bool ? key.b : key.i;
        if (is_str) {
          std::vector<char32_t> cps = decode_utf8(obj.str);
          const int64_t n = static_cast<int64_t>(cps.size());
          if (idx < 0) idx += n;
          if (idx < 0 || idx >= n) return missing_attribute(obj, key);
          return Value::string(encode_utf8({cps[static_cast<size_t>(idx)]}));
        }
        const int64_t n = static_cast<int64_t>(obj.list->size());
        if (idx < 0) idx += n;
        if (idx < 0 || idx >= n) return missing_attribute(obj, key);
        return (*obj.list)[static_cast<size_t>(idx)];
      }
      if (key.kind == Kind::String) return get_attribute(obj, key.str);
      return missing_attribute(obj, key);
    }
    default:
      if (key.kind == Kind::String) return get_attribute(obj, key.str);
      return missing_attribute(obj, key);
  }
}

Value get_attribute(const Value& obj, const std::string& attr) {
  static const std::set<std::string> str_methods = {"split",      "rsplit",     "strip", "lstrip", "rstrip",
                                                    "startswith", "endswith",   "upper", "lower",  "replace",
                                                    "title",      "capitalize", "find",  "count",  "join"};
  static const std::set<std::string> dict_methods = {"get", "items", "keys", "values"};
  auto bound = [&](const std::string& name) { return Value::function(name, std::make_shared<const Value>(obj)); };
  switch (obj.kind) {
    case Kind::Undefined:
      fail_undefined(obj);
    case Kind::String:
      if (str_methods.count(attr)) return bound("str." + attr);
      break;
    case Kind::Dict:
      if (dict_methods.count(attr)) return bound("dict." + attr);
      if (!unsafe_method(obj, attr).empty()) return bound("unsafe." + attr);
      if (const Value* v = obj.dict->find(Value::string(attr))) return *v;
      break;
    case Kind::List:
    case Kind::Tuple:
      if (!unsafe_method(obj, attr).empty()) return bound("unsafe." + attr);
      break;
    case Kind::Namespace:
      if (const Value* v = obj.dict->find(Value::string(attr))) return *v;
      break;
    case Kind::Loop:
      if (attr == "cycle") return bound("loop.cycle");
      if (const Value* v = obj.dict->find(Value::string(attr))) return *v;
      break;
    default:
      break;
  }
  return missing_attribute(obj, Value::string(attr));
}

bool is_global_function(const std::string& name) {
  return name == "range" || name == "namespace" || name == "dict" || name == "raise_exception" ||
         name == "strftime_now";
}

Value call_function(const Value& fn, const CallArgs& args) {
  const std::string& name = fn.str;
  const Value self = fn.self ? *fn.self : Value();
  if (name == "range") {
    if (!args.kw.empty()) fail("range() takes no keyword arguments");
    if (args.pos.empty() || args.pos.size() > 3) fail("range expected 1 to 3 arguments");
    int64_t start = 0, stop = 0, step = 1;
    if (args.pos.size() == 1) {
      stop = need_int(args.pos[0], "range()'s argument");
    } else {
      start = need_int(args.pos[0], "range()'s argument");
      stop = need_int(args.pos[1], "range()'s argument");
      if (args.pos.size() == 3) step = need_int(args.pos[2], "range()'s argument");
    }
    if (step == 0) fail("range() arg 3 must not be zero");
    const int64_t count = step > 0 ? (stop > start ? (stop - start + step - 1) / step : 0)
                                   : (start > stop ? (start - stop - step - 1) / -step : 0);
    constexpr int64_t kMaxRange = 100000;  // jinja2's sandbox refuses larger ranges (MAX_RANGE)
    if (count > kMaxRange) fail("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
    Items out;
    for (int64_t k = 0; k < count; ++k) out.push_back(Value::integer(start + k * step));
    return Value::list_of(std::move(out));
  }
  if (name == "namespace" || name == "dict") {
    Mapping d;
    if (args.pos.size() > 1) fail(name + "() expected at most 1 positional argument");
    if (!args.pos.empty()) {
      const Value& init = args.pos[0];
      if (init.kind == Kind::Dict) {
        d = *init.dict;
      } else {
        for (const Value& pair : iterate(init)) {
          if (!pair.is_sequence_like() || pair.list->size() != 2) fail(name + "(): each item must be a pair");
          d.set((*pair.list)[0], (*pair.list)[1]);
        }
      }
    }
    for (const auto& [k, v] : args.kw) d.set(Value::string(k), v);
    if (name == "namespace")
      for (const auto& kv : d.items)
        if (kv.first.kind == Kind::String && !kv.first.str.empty() && kv.first.str[0] == '_')
          fail("Chat templates cannot store underscore-prefixed attributes on a namespace, but got " + repr(kv.first) +
               ". Please rename the attribute.");
    return Value::dict_of(std::move(d), name == "namespace" ? Kind::Namespace : Kind::Dict);
  }
  if (name == "raise_exception") {
    if (args.pos.size() != 1 || !args.kw.empty()) fail("raise_exception() takes one argument");
    fail("the template raised an error: " + to_str(args.pos[0]));
  }
  if (name == "strftime_now") {
    if (args.pos.size() != 1 || !args.kw.empty()) fail("strftime_now() takes one argument");
    std::time_t now = std::time(nullptr);
    std::tm local{};
    localtime_r(&now, &local);
    char buf[512];
    size_t n = std::strftime(buf, sizeof buf, need_string(args.pos[0], "strftime_now's format").c_str(), &local);
    return Value::string(std::string(buf, n));
  }
  if (name.rfind("unsafe.", 0) == 0) fail(unsafe_method(self, name.substr(7)));
  if (name == "loop.cycle") {
    if (args.pos.empty()) fail("no items for cycling given");
    int64_t index0 = self.dict->find(Value::string("index0"))->i;
    return args.pos[static_cast<size_t>(index0) % args.pos.size()];
  }
  if (name == "dict.get") {
    auto a = bind("get", args, {"key", "default"}, {Value(), Value::none()});
    if (args.pos.empty()) fail("get expected at least 1 argument");
    if (const Value* v = self.dict->find(a[0])) return *v;
    return a[1];
  }
  if (name == "dict.items" || name == "dict.keys" || name == "dict.values") {
    if (!args.pos.empty() || !args.kw.empty()) fail(name.substr(5) + "() takes no arguments");
    Items out;
    for (const auto& [k, v] : self.dict->items) {
      if (name == "dict.items")
        out.push_back(Value::list_of({k, v}, Kind::Tuple));
      else
        out.push_back(name == "dict.keys" ? k : v);
    }
    return Value::list_of(std::move(out));
  }
  const std::string& s = self.str;
  if (name == "str.split" || name == "str.rsplit") {
    auto a = bind(name.substr(4), args, {"sep", "maxsplit"}, {Value::none(), Value::integer(-1)});
    return Value::list_of(py_split(s, a[0], need_int(a[1], "maxsplit"), name == "str.rsplit"));
  }
  if (name == "str.strip" || name == "str.lstrip" || name == "str.rstrip") {
    auto a = bind(name.substr(4), args, {"chars"}, {Value::none()});
    return Value::string(strip_chars(s, a[0], name != "str.rstrip", name != "str.lstrip"));
  }
  if (name == "str.startswith" || name == "str.endswith") {
    if (args.pos.size() != 1 || !args.kw.empty()) fail(name.substr(4) + "() with start/end positions is not supported");
    return Value::boolean(affix_test(s, args.pos[0], name == "str.startswith"));
  }
  if (name == "str.upper" || name == "str.lower") return Value::string(change_case(s, name == "str.upper"));
  if (name == "str.title") return Value::string(title_case(s));
  if (name == "str.capitalize") return Value::string(first_upper_rest_lower(s));
  if (name == "str.replace") {
    auto a = bind("replace", args, {"old", "new", "count"}, {Value(), Value(), Value::integer(-1)});
    return Value::string(py_replace(s, need_string(a[0], "replace's old"), need_string(a[1], "replace's new"),
                                    need_int(a[2], "replace's count")));
  }
  if (name == "str.find" || name == "str.count") {
    if (args.pos.size() != 1 || !args.kw.empty()) fail(name.substr(4) + "() with start/end positions is not supported");
    const std::string& sub = need_string(args.pos[0], "the substring");
    if (name == "str.find") {
      size_t hit = s.find(sub);
      if (hit == std::string::npos) return Value::integer(-1);
      return Value::integer(static_cast<int64_t>(decode_utf8(s.substr(0, hit)).size()));
    }
    if (sub.empty()) return Value::integer(static_cast<int64_t>(decode_utf8(s).size()) + 1);
    int64_t n = 0;
    for (size_t p = s.find(sub); p != std::string::npos; p = s.find(sub, p + sub.size())) ++n;
    return Value::integer(n);
  }
  if (name == "str.join") {
    if (args.pos.size() != 1 || !args.kw.empty()) fail("join() takes one argument");
    std::string out;
    bool first = true;
    for (const Value& item : iterate(args.pos[0])) {
      if (!first) out += s;
      first = false;
      out += need_string(item, "a joined item");
    }
    return Value::string(out);
  }
  fail("'" + name + "' is not callable");
}

Value apply_filter(const std::string& name, const Value& v, const CallArgs& args) {
  auto no_args = [&] {
    if (!args.pos.empty() || !args.kw.empty()) fail("the filter '" + name + "' takes no arguments");
  };
  if (name == "default" || name == "d") {
    auto a = bind(name, args, {"default_value", "boolean"}, {Value::string(""), Value::boolean(false)});
    if (v.is_undefined() || (truthy(a[1]) && !truthy(v))) return a[0];
    return v;
  }
  if (name == "length" || name == "count") {
    no_args();
    return Value::integer(static_cast<int64_t>(py_len(v)));
  }
  if (name == "trim") {
    auto a = bind(name, args, {"chars"}, {Value::none()});
    return Value::string(strip_chars(to_str(v), a[0], true, true));
  }
  if (name == "upper" || name == "lower") {
    no_args();
    return Value::string(change_case(to_str(v), name == "upper"));
  }
  if (name == "capitalize") {
    no_args();
    return Value::string(first_upper_rest_lower(to_str(v)));
  }
  if (name == "title") {
    no_args();
    return Value::string(title_case(to_str(v)));
  }
  if (name == "string" || name == "safe" || name == "e" || name == "escape") {
    no_args();
    if (name == "e" || name == "escape") fail("the filter '" + name + "' (HTML escaping) is not supported");
    return v.kind == Kind::String ? v : Value::string(to_str(v));
  }
  if (name == "list") {
    no_args();
    return Value::list_of(iterate(v));
  }
  if (name == "items") {
    no_args();
    if (v.is_undefined()) return Value::list_of({});
    if (!v.is_mapping()) fail("the filter 'items' needs a mapping, not " + type_name(v));
    return call_function(Value::function("dict.items", std::make_shared<const Value>(v)), {});
  }
  if (name == "dictsort") {
    auto a = bind(name, args, {"case_sensitive", "by", "reverse"},
                  {Value::boolean(false), Value::string("key"), Value::boolean(false)});
    if (!v.is_mapping()) {
      if (v.is_undefined()) fail_undefined(v);
      fail("'" + type_name(v) + "' object has no attribute 'items'");
    }
    const std::string by = need_string(a[1], "dictsort's by");
    if (by != "key" && by != "value") fail("You can only sort by either \"key\" or \"value\"");
    const size_t pos = by == "key" ? 0 : 1;
    const bool case_sensitive = truthy(a[0]);
    Items items = iterate(call_function(Value::function("dict.items", std::make_shared<const Value>(v)), {}));
    return Value::list_of(sorted_copy(
        std::move(items),
        [&](const Value& item) {
          const Value& x = (*item.list)[pos];
          return case_sensitive ? x : lower_if_string(x);
        },
        truthy(a[2])));
  }
  if (name == "sort") {
    auto a = bind(name, args, {"reverse", "case_sensitive", "attribute"},
                  {Value::boolean(false), Value::boolean(false), Value::none()});
    const bool cs = truthy(a[1]);
    const Value attribute = a[2];
    return Value::list_of(sorted_copy(
        iterate(v),
        [&](const Value& item) {
          Value x = attribute.kind == Kind::None ? item : attr_path(item, attribute);
          return cs ? x : lower_if_string(x);
        },
        truthy(a[0])));
  }
  if (name == "unique") {
    auto a = bind(name, args, {"case_sensitive", "attribute"}, {Value::boolean(false), Value::none()});
    Items seen, out;
    for (const Value& item : iterate(v)) {
      Value key = a[1].kind == Kind::None ? item : attr_path(item, a[1]);
      if (!truthy(a[0])) key = lower_if_string(key);
      if (std::none_of(seen.begin(), seen.end(), [&](const Value& s) { return equal(s, key); })) {
        seen.push_back(key);
        out.push_back(item);
      }
    }
    return Value::list_of(std::move(out));
  }
  if (name == "reverse") {
    no_args();
    if (v.kind == Kind::String) {
      std::vector<char32_t> cps = decode_utf8(v.str);
      std::reverse(cps.begin(), cps.end());
      return Value::string(encode_utf8(cps));
    }
    Items items = iterate(v);
    std::reverse(items.begin(), items.end());
    return Value::list_of(std::move(items));
  }
  if (name == "first" || name == "last") {
    no_args();
    Items items = iterate(v);
    if (items.empty())
      return Value::undefined(name == "first" ? "No first item, sequence was empty."
                                              : "No last item, sequence was empty.");
    return name == "first" ? items.front() : items.back();
  }
  if (name == "join") {
    auto a = bind(name, args, {"d", "attribute"}, {Value::string(""), Value::none()});
    const std::string sep = to_str(a[0]);
    std::string out;
    bool first = true;
    for (const Value& item : iterate(v)) {
      if (!first) out += sep;
      first = false;
      out += to_str(a[1].kind == Kind::None ? item : attr_path(item, a[1]));
    }
    return Value::string(out);
  }
  if (name == "replace") {
    auto a = bind(name, args, {"old", "new", "count"}, {Value(), Value(), Value::none()});
    const int64_t count = a[2].kind == Kind::None ? -1 : need_int(a[2], "replace's count");
    return Value::string(py_replace(to_str(v), to_str(a[0]), to_str(a[1]), count));
  }
  if (name == "int") {
    auto a = bind(name, args, {"default", "base"}, {Value::integer(0), Value::integer(10)});
    if (need_int(a[1], "int's base") != 10) fail("the filter 'int' with a base other than 10 is not supported");
    return py_int(v, a[0]);
  }
  if (name == "float") {
    auto a = bind(name, args, {"default"}, {Value::real(0.0)});
    return py_float(v, a[0]);
  }
  if (name == "abs") {
    no_args();
    if (v.kind == Kind::Float) return Value::real(std::fabs(v.f));
    if (v.kind == Kind::Int || v.kind == Kind::Bool) {
      int64_t x = v.kind == Kind::Bool ? v.b : v.i;
      if (x == INT64_MIN) fail("integer overflow beyond 64 bits");
      return Value::integer(x < 0 ? -x : x);
    }
    fail("bad operand type for abs(): '" + type_name(v) + "'");
  }
  if (name == "sum") {
    auto a = bind(name, args, {"attribute", "start"}, {Value::none(), Value::integer(0)});
    Items items;
    for (const Value& item : iterate(v)) items.push_back(a[0].kind == Kind::None ? item : attr_path(item, a[0]));
    return sum_of(items, a[1]);
  }
  if (name == "min" || name == "max") {
    auto a = bind(name, args, {"case_sensitive", "attribute"}, {Value::boolean(false), Value::none()});
    Items items = iterate(v);
    if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
    const Value* best = &items[0];
    auto key = [&](const Value& item) {
      Value x = a[1].kind == Kind::None ? item : attr_path(item, a[1]);
      return truthy(a[0]) ? x : lower_if_string(x);
    };
    for (const Value& item : items)
      if (name == "min" ? less(key(item), key(*best)) : less(key(*best), key(item))) best = &item;
    return *best;
  }
  if (name == "tojson") return tojson_filter(v, args);
  if (name == "map") {
    Items out;
    if (args.pos.empty()) {
      Value attribute, dflt = Value::none();
      bool has_attribute = false;
      for (const auto& [k, x] : args.kw) {
        if (k == "attribute") {
          attribute = x;
          has_attribute = true;
        } else if (k == "default") {
          dflt = x;
        } else {
          fail("Unexpected keyword argument '" + k + "'");
        }
      }
      if (!has_attribute) fail("map requires a filter argument");
      for (const Value& item : iterate(v)) {
        Value x = attr_path(item, attribute);
        out.push_back(x.is_undefined() && dflt.kind != Kind::None ? dflt : x);
      }
    } else {
      const std::string& filter = need_string(args.pos[0], "map's filter name");
      if (!has_filter(filter)) fail("no filter named '" + filter + "' (or not supported) in map()");
      CallArgs rest{std::vector<Value>(args.pos.begin() + 1, args.pos.end()), args.kw};
      for (const Value& item : iterate(v)) out.push_back(apply_filter(filter, item, rest));
    }
    return Value::list_of(std::move(out));
  }
  if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
    const bool attr = name.size() > 6;
    const bool keep_if = name[0] == 's';
    size_t off = attr ? 1 : 0;
    if (attr && args.pos.empty()) fail("Missing parameter for attribute name");
    std::string test;
    if (args.pos.size() > off) {
      test = need_string(args.pos[off], name + "'s test name");
      if (!has_test(test)) fail("no test named '" + test + "' (or not supported) in " + name + "()");
    }
    CallArgs rest{std::vector<Value>(args.pos.begin() + static_cast<long>(std::min(args.pos.size(), off + 1)),
                                     args.pos.end()),
                  args.kw};
    Items out;
    for (const Value& item : iterate(v)) {
      Value x = attr ? attr_path(item, args.pos[0]) : item;
      bool pass = test.empty() ? truthy(x) : apply_test(test, x, rest);
      if (pass == keep_if) out.push_back(item);
    }
    return Value::list_of(std::move(out));
  }
  fail("the filter '" + name + "' is not supported by ringflex's template engine (docs/text.md)");
}

bool apply_test(const std::string& name, const Value& v, const CallArgs& args) {
  auto arg = [&]() -> const Value& {
    if (args.pos.size() != 1 || !args.kw.empty()) fail("the test '" + name + "' takes one argument");
    return args.pos[0];
  };
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return v.kind == Kind::None;
  if (name == "boolean") return v.kind == Kind::Bool;
  if (name == "false") return v.kind == Kind::Bool && !v.b;
  if (name == "true") return v.kind == Kind::Bool && v.b;
  if (name == "integer") return v.kind == Kind::Int;
  if (name == "float") return v.kind == Kind::Float;
  if (name == "number") return v.is_number();
  if (name == "string") return v.kind == Kind::String;
  if (name == "mapping") return v.kind == Kind::Dict;
  if (name == "callable") return v.kind == Kind::Macro || v.kind == Kind::Function;
  // Python: len() and __getitem__ (str, list, tuple, dict; Undefined has both); iter() (those and Undefined).
  if (name == "sequence" || name == "iterable")
    return v.is_undefined() || v.is_string() || v.is_sequence_like() || v.kind == Kind::Dict;
  if (name == "lower" || name == "upper") {
    if (v.kind != Kind::String) fail("the test '" + name + "' needs a string");
    return change_case(v.str, name == "upper") == v.str;
  }
  if (name == "odd" || name == "even" || name == "divisibleby") {
    const int64_t x = need_int(v, "the tested value");
    if (name == "divisibleby") {
      const int64_t d = need_int(arg(), "divisibleby's argument");
      if (d == 0) fail("integer division or modulo by zero");
      return x % d == 0;
    }
    return (((x % 2) + 2) % 2 == 1) == (name == "odd");
  }
  if (name == "eq" || name == "equalto" || name == "==") return equal(v, arg());
  if (name == "ne" || name == "!=") return !equal(v, arg());
  if (name == "lt" || name == "lessthan" || name == "<") return less(v, arg());
  if (name == "gt" || name == "greaterthan" || name == ">") return less(arg(), v);
  if (name == "le" || name == "<=") return !less(arg(), v);
  if (name == "ge" || name == ">=") return !less(v, arg());
  if (name == "sameas") {
    const Value& o = arg();
    if (v.kind != o.kind) return false;
    switch (v.kind) {
      case Kind::None:
      case Kind::Undefined:
        return true;
      case Kind::Bool:
        return v.b == o.b;
      case Kind::List:
      case Kind::Tuple:
        return v.list == o.list;
      case Kind::Dict:
      case Kind::Namespace:
        return v.dict == o.dict;
      default:
        fail("the test 'sameas' on " + type_name(v) + " (Python object identity) is not supported");
    }
  }
  if (name == "in") {
    const Value& container = arg();
    if (container.kind == Kind::String)
      return container.str.find(need_string(v, "the left operand of 'in'")) != std::string::npos;
    for (const Value& item : iterate(container))
      if (equal(item, v)) return true;
    return false;
  }
  fail("the test '" + name + "' is not supported by ringflex's template engine (docs/text.md)");
}

}  // namespace rf::text::detail
