#include "text/template.h"

#include <nlohmann/json.hpp>

#include "text/template_eval.h"
#include "text/template_parser.h"

namespace rf::text {

Template::Template(std::shared_ptr<const detail::Program> program) : program_(std::move(program)) {}

Template Template::parse(std::string source, std::string origin) {
  return Template(detail::parse_program(source, origin));
}

std::string Template::render(const nlohmann::ordered_json& variables, const RenderLimits& limits) const {
  return detail::evaluate(*program_, variables, limits).text;
}

Rendered Template::render_with_spans(const nlohmann::ordered_json& variables, const RenderLimits& limits) const {
  return detail::evaluate(*program_, variables, limits);
}

const std::string& Template::origin() const { return program_->origin; }

}  // namespace rf::text
