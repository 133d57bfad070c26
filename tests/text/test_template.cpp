#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/template.h"

namespace {
using rf::text::Template;
using json = nlohmann::ordered_json;

std::string render(const std::string& src, const json& vars = json::object()) {
  return Template::parse(src, "t.jinja").render(vars);
}
}  // namespace

TEST(Template, Smoke) { EXPECT_EQ(render("a{{ 1 + 2 }}b"), "a3b"); }
