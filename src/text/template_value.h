// ringflex text: the values a chat template computes with, with Python's semantics where jinja2 exposes them
// (truthiness, ==, <, str() and repr() of every type, json.dumps for tojson). Internal to the template engine.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace rf::text::detail {

// An evaluation failure without its template position; the evaluator adds "ORIGIN:LINE:COL: " where it catches it.
struct RenderFailure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Value;
struct MacroNode;
struct Scope;
using Items = std::vector<Value>;
// A Python dict: insertion order kept, keys compared with Python's == (1 and 1.0 and True are one key).
struct Mapping {
  std::vector<std::pair<Value, Value>> items;
  const Value* find(const Value& key) const;
  void set(Value key, Value value);
};
// A macro bound to the scope it was defined in (jinja2's macros are closures over the template's frame). Weak: that
// scope holds the macro, and the evaluator keeps every defining scope alive until the render ends.
struct MacroRef {
  const MacroNode* node = nullptr;
  std::weak_ptr<Scope> scope;
};

enum class Kind {
  Undefined,  // jinja2's Undefined: prints '', is falsy and empty; using it otherwise fails with `str`'s hint
  None,
  Bool,
  Int,
  Float,
  String,
  List,
  Tuple,
  Dict,
  Namespace,  // namespace(): the one mutable object, shared by reference
  Loop,       // a for loop's `loop` variable: a Mapping of its attributes
  Macro,
  Function,  // a global function or a bound method: `str` names it, `self` is the receiver
};

struct Value {
  Kind kind = Kind::Undefined;
  bool b = false;
  int64_t i = 0;
  double f = 0.0;
  std::string str;  // String's text (UTF-8); Undefined's hint; Function's name
  std::shared_ptr<const Items> list;
  std::shared_ptr<Mapping> dict;  // Mapping, Namespace, Loop
  std::shared_ptr<const MacroRef> macro;
  std::shared_ptr<const Value> self;  // a bound method's receiver

  static Value undefined(std::string hint) {
    Value v;
    v.str = std::move(hint);
    return v;
  }
  static Value none() { return make(Kind::None); }
  static Value boolean(bool x) {
    Value v = make(Kind::Bool);
    v.b = x;
    return v;
  }
  static Value integer(int64_t x) {
    Value v = make(Kind::Int);
    v.i = x;
    return v;
  }
  static Value real(double x) {
    Value v = make(Kind::Float);
    v.f = x;
    return v;
  }
  static Value string(std::string s) {
    Value v = make(Kind::String);
    v.str = std::move(s);
    return v;
  }
  static Value list_of(Items items, Kind kind = Kind::List) {
    Value v = make(kind);
    v.list = std::make_shared<const Items>(std::move(items));
    return v;
  }
  static Value dict_of(Mapping d, Kind kind = Kind::Dict) {
    Value v = make(kind);
    v.dict = std::make_shared<Mapping>(std::move(d));
    return v;
  }
  static Value function(std::string name, std::shared_ptr<const Value> self = nullptr) {
    Value v = make(Kind::Function);
    v.str = std::move(name);
    v.self = std::move(self);
    return v;
  }
  static Value make(Kind k) {
    Value v;
    v.kind = k;
    return v;
  }

  bool is_undefined() const { return kind == Kind::Undefined; }
  bool is_string() const { return kind == Kind::String; }
  bool is_sequence_like() const { return kind == Kind::List || kind == Kind::Tuple; }
  bool is_mapping() const { return kind == Kind::Dict || kind == Kind::Loop; }
  bool is_number() const { return kind == Kind::Int || kind == Kind::Float || kind == Kind::Bool; }
};

// Python's type name, for error messages as jinja2 words them ("'dict object' has no attribute 'x'").
std::string type_name(const Value& v);
// Throws jinja2's UndefinedError text for an Undefined used where a value is needed.
[[noreturn]] void fail_undefined(const Value& v);

bool truthy(const Value& v);
bool equal(const Value& a, const Value& b);
// Python's <; throws RenderFailure for types Python cannot order ("'<' not supported between ...").
bool less(const Value& a, const Value& b);

// Python's str() of the value as jinja2 prints it ({{ x }}, ~, |string): '' for Undefined, 'None', 'True', ints,
// floats as repr(float), containers as their repr.
std::string to_str(const Value& v);
// Python's repr(): strings quoted as Python quotes them, 'Undefined' for an undefined inside a container.
std::string repr(const Value& v);
// repr(float): the shortest string that reads back to the same double, in Python's layout (1.0, 1e+16, 1e-05).
std::string float_repr(double x);

// json.dumps(v, ensure_ascii=False, indent=indent, separators=..., sort_keys=sort_keys) as transformers' tojson
// calls it; indent < 0 means None. Throws for values JSON cannot hold (Undefined, macros), as json.dumps does.
struct JsonStyle {
  int indent = -1;
  std::string item_separator;  // "" means Python's default: ", " without indent, "," with it
  std::string key_separator = ": ";
  bool explicit_separators = false;
  bool sort_keys = false;
};
std::string to_json(const Value& v, const JsonStyle& style);

// The template's variables: JSON as Python's json module gives it to jinja2 (ints stay ints, floats floats).
Value from_json(const nlohmann::ordered_json& j);

// Python strings index code points: the text's code points (RenderFailure on invalid UTF-8) and back
// (text/utf8.h does the bytes).
std::vector<char32_t> decode_utf8(std::string_view s);
std::string encode_utf8(const std::vector<char32_t>& cps);
// Python's str.isspace() for one code point (what str.strip(), str.split() and re's \s treat as whitespace).
bool is_py_space(char32_t cp);
// Python's str.strip()/lstrip()/rstrip() without arguments.
std::string py_strip(std::string_view s, bool left, bool right);

}  // namespace rf::text::detail
