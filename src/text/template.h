// ringflex text: chat templates. A Jinja template rendered byte-identically to Python jinja2 as transformers'
// apply_chat_template sets it up (ImmutableSandboxedEnvironment, trim_blocks and lstrip_blocks on, loopcontrols,
// the `{% generation %}` block, raise_exception, strftime_now, transformers' tojson). One interpreter for the
// Jinja subset Hugging Face chat templates use, not a renderer per template revision: docs/text.md says why, what
// the subset is and how it is tested against jinja2.
#pragma once

#include <cstddef>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

namespace rf::text {

namespace detail {
struct Program;
}

// A `{% generation %}...{% endgeneration %}` body's bytes in a render, [begin, end): what transformers reports as
// the assistant's generation indices (it counts characters; these are UTF-8 byte offsets into Rendered::text).
struct GenerationSpan {
  size_t begin = 0;
  size_t end = 0;
};

struct Rendered {
  std::string text;
  std::vector<GenerationSpan> generation;  // in output order; a nested block gives its own span too
};

// What one render may cost before it is refused (a hostile or broken template must not exhaust the machine).
struct RenderLimits {
  size_t max_output_bytes = size_t{256} << 20;  // real chat renders are KiBs; 256 MiB is far past any context
  int max_call_depth = 200;  // macro calls in flight; jinja2 itself fails near Python's recursion limit (1000)
  long long max_loop_iterations = 50'000'000;  // all loops of one render together
};

class Template {
 public:
  // Throws rf::Error "ORIGIN:LINE:COL: why" for syntax it does not parse or a feature it does not support (an
  // unknown filter, test or tag is named there, before anything renders).
  static Template parse(std::string source, std::string origin);

  // Variables are JSON (messages, tools, add_generation_prompt, bos_token, enable_thinking, ...). Objects keep
  // their key order (ordered_json: Python dicts keep insertion order, and `tojson` or a loop over a dict shows
  // it; a plain nlohmann::json converts implicitly, its keys sorted). Integers stay ints and floats stay floats, as
  // Python's json gives them to jinja2. Throws rf::Error "ORIGIN:LINE:COL: why" for raise_exception() (with the
  // template's message) and for anything jinja2 would fail on (an undefined value used, a type error, a sandbox
  // refusal such as list.append) or that exceeds `limits`.
  std::string render(const nlohmann::ordered_json& variables, const RenderLimits& limits = {}) const;
  Rendered render_with_spans(const nlohmann::ordered_json& variables, const RenderLimits& limits = {}) const;

  const std::string& origin() const;

 private:
  explicit Template(std::shared_ptr<const detail::Program> program);
  std::shared_ptr<const detail::Program> program_;
};

}  // namespace rf::text
