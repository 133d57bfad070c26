// ringflex text: what a chat template can call: jinja2's filters and tests that chat templates use, the globals
// transformers adds (raise_exception, strftime_now, namespace, dict, range), the str/dict methods jinja2's
// sandbox lets through, and jinja2's attribute and subscript lookup. Internal to the template engine.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "text/template_value.h"

namespace rf::text::detail {

struct CallArgs {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
};

// Supported here / defined by jinja2 at all (the parser names the difference in its refusal).
bool has_filter(const std::string& name);
bool has_test(const std::string& name);
bool is_jinja_filter(const std::string& name);
bool is_jinja_test(const std::string& name);

Value apply_filter(const std::string& name, const Value& operand, const CallArgs& args);
bool apply_test(const std::string& name, const Value& operand, const CallArgs& args);

// jinja2's environment.getattr / getitem under ImmutableSandboxedEnvironment: a method where the object has one
// (a mutating one is refused when called), else the key; Undefined (with jinja2's hint) when neither exists.
Value get_attribute(const Value& obj, const std::string& attr);
Value get_item(const Value& obj, const Value& key);

// A global function or a bound method (Kind::Function). Throws RenderFailure as Python would fail.
Value call_function(const Value& fn, const CallArgs& args);
// The template's globals before its variables: range, namespace, dict, raise_exception, strftime_now.
bool is_global_function(const std::string& name);

// Iterating a value as Python's iter() does: list items, a string's characters, a dict's keys; Undefined is empty.
Items iterate(const Value& v);

}  // namespace rf::text::detail
