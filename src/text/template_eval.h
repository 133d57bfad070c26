// ringflex text: the evaluator that walks a parsed template with jinja2's runtime semantics (scopes: a for loop,
// a macro and a `{% set %}` block capture have their own, an if does not; macros are closures over the scope
// they were defined in; Undefined as jinja2's default Undefined). Internal to the template engine.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include "text/template.h"
#include "text/template_parser.h"

namespace rf::text::detail {

Rendered evaluate(const Program& program, const nlohmann::ordered_json& variables, const RenderLimits& limits);

}  // namespace rf::text::detail
