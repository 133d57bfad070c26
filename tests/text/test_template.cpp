// The chat template engine on hand-written templates. Every expected output was worked out from jinja2's
// documented semantics (trim_blocks and lstrip_blocks on, Python's str() and repr() of values, Python's
// arithmetic) and checked against jinja2 3.1.6 configured as transformers configures it; the real templates are
// checked against jinja2 itself in template_oracle.py.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "core/error.h"
#include "text/template.h"

namespace {

using rf::text::Template;
using json = nlohmann::ordered_json;

std::string render(const std::string& src, const json& vars = json::object()) {
  return Template::parse(src, "t.jinja").render(vars);
}

// The rf::Error text of parsing (and, when it parses, rendering) `src`; "" when neither fails.
std::string error_of(const std::string& src, const json& vars = json::object(),
                     const rf::text::RenderLimits& limits = {}) {
  try {
    Template::parse(src, "t.jinja").render(vars, limits);
  } catch (const rf::Error& e) {
    return e.what();
  }
  return "";
}

struct Case {
  const char* name;
  const char* source;
  const char* variables;
  const char* expected;
};

const Case kCases[] = {
    {"ws_trim_lstrip", "<ul>\n  {% for x in xs %}\n  <li>{{ x }}</li>\n  {% endfor %}\n</ul>\n",
     R"json({"xs": [1, 2]})json", "<ul>\n  <li>1</li>\n  <li>2</li>\n</ul>"},
    {"ws_minus", "a  \n  {{- 'b' -}}  \n  c {#- c -#}  d", R"json({})json", "abcd"},
    {"ws_plus", "a\n  {%+ if true %}x{% endif +%}\ny", R"json({})json", "a\n  x\ny"},
    {"ws_comment_line", "a\n  {# note #}\nb", R"json({})json", "a\nb"},
    {"ws_var_not_lstripped", "a\n  {{ 'v' }}\nb", R"json({})json", "a\n  v\nb"},
    {"ws_raw", "{% raw %}{{ x }}{% endraw %}|", R"json({})json", "{{ x }}|"},
    {"ws_crlf_trailing", "a\r\nb\rc\n", R"json({})json", "a\nb\nc"},
    {"ws_block_midline", "x {% if true %}y{% endif %}\nz", R"json({})json", "x yz"},
    {"loop_vars",
     "{% for x in 'abc' %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.first }}{{ loop.last }}{{ "
     "loop.length }};{% endfor %}",
     R"json({})json", "103TrueFalse3;212FalseFalse3;321FalseTrue3;"},
    {"loop_else_filter", "{% for x in xs if x > 5 %}{{ x }}{% else %}none{% endfor %}", R"json({"xs": [1, 2]})json",
     "none"},
    {"loop_dict",
     "{% for k in d %}{{ k }}{% endfor %}|{% for k, v in d.items() %}{{ k }}={{ v }},{% endfor %}|{% for k, v in "
     "d|dictsort %}{{ k }}{% endfor %}",
     R"json({"d": {"b": 1, "a": 2}})json", "ba|b=1,a=2,|ab"},
    {"loop_break_continue",
     "{% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}{% if x > 4 %}{% break %}{% endif %}{{ x }}{% "
     "endfor %}",
     R"json({})json", "0134"},
    {"loop_scope",
     "{% set y = 0 %}{% for x in [1, 2] %}{% set y = x %}{% endfor %}{{ y }}|{% if true %}{% set z = 3 %}{% endif %}{{ "
     "z }}",
     R"json({})json", "0|3"},
    {"loop_prev_next_cycle",
     "{% for x in [1, 2, 3] %}{{ loop.previtem is defined }}{{ loop.nextitem }}{{ loop.cycle('a', 'b') }} {% endfor %}",
     R"json({})json", "False2a True3b Truea "},
    {"set_block", "{% set x %}  A{{ 1 }} {% endset %}[{{ x }}]{% set y | upper %}b{% endset %}{{ y }}", R"json({})json",
     "[  A1 ]B"},
    {"namespace",
     "{% set ns = namespace(n=0, s='') %}{% for x in [1, 2, 3] %}{% set ns.n = ns.n + x %}{% set ns.s = ns.s ~ x %}{% "
     "endfor %}{{ ns.n }} {{ ns.s }}",
     R"json({})json", "6 123"},
    {"tuple_set", "{% set a, b = [1, 'two'] %}{{ b }}{{ a }}", R"json({})json", "two1"},
    {"macro_args",
     "{% macro m(a, b=2, c=a) %}{{ a }}{{ b }}{{ c }}{% endmacro %}{{ m(1) }} {{ m(1, c=5) }} {{ m(a=7, b=8) }}",
     R"json({})json", "121 125 787"},
    {"macro_recursive", "{% macro f(n) %}{% if n > 0 %}{{ n }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(3) }}",
     R"json({})json", "321"},
    {"macro_late_binding", "{% set x = 1 %}{% macro m() %}{{ x }}{% endmacro %}{% set x = 2 %}{{ m() }}",
     R"json({})json", "2"},
    {"macro_missing_param", "{% macro m(a, b) %}[{{ b }}]{{ b is defined }}{% endmacro %}{{ m(1) }}", R"json({})json",
     "[]False"},
    {"arith",
     "{{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ 1 + 2 * 3 }} {{ 'ab' * 2 }} {{ [1] + [2] }} "
     "{{ true + 1 }} {{ 7.5 // 2 }} {{ -7.5 % 2 }}",
     R"json({})json", "3 -4 2 3.5 1024 7 abab [1, 2] 2 3.0 0.5"},
    {"compare_logic",
     "{{ 1 < 2 < 3 }} {{ 1 == 1.0 }} {{ 'a' in 'cat' }} {{ 2 not in [1] }} {{ 0 or 'x' }} {{ '' and 1 }} {{ not none "
     "}} {{ 'k' in {'k': 1} }} {{ [1, 2] < [1, 3] }}",
     R"json({})json", "True True True True x  True True True"},
    {"cond_expr", "{{ 'y' if 1 else 'n' }}[{{ 'y' if 0 }}]{{ none if false else 'e' }}", R"json({})json", "y[]e"},
    {"strings",
     "{{ 'a\\tb\\n' }}|{{ \"it's\" }}|{{ 'x' 'y' }}|{{ '\\u00e9\\x41' }}|{{ 'abc'[1] }}{{ 'abcdef'[1:4] }}{{ "
     "'abc'[::-1] }}{{ 'héllo'[-1] }}",
     R"json({})json", "a\tb\n|it's|xy|éA|bbcdcbao"},
    {"methods",
     "{{ ' a b '.split() }}{{ 'a,b,,c'.split(',') }}{{ 'a,b,c'.split(',', 1) }}{{ 'a,b,c'.rsplit(',', 1) }}{{ '  x  "
     "'.strip() }}|{{ 'xxaxx'.lstrip('x') }}|{{ 'ab'.startswith(('x', 'a')) }}{{ 'ab'.endswith('b') }}{{ "
     "'aXa'.replace('a', 'b') }}{{ d.get('k') }}{{ d.get('z', 0) }}{{ d.keys()|list }}{{ d.values()|list }}",
     R"json({"d": {"k": "v"}})json",
     "['a', 'b']['a', 'b', '', 'c']['a', 'b,c']['a,b', 'c']x|axx|TrueTruebXbv0['k']['v']"},
    {"slices", "{{ xs[1:] }}{{ xs[:-1] }}{{ xs[::2] }}{{ xs[-2] }}{{ xs[10] is defined }}",
     R"json({"xs": [1, 2, 3, 4]})json", "[2, 3, 4][1, 2, 3][1, 3]3False"},
    {"filters_text",
     "{{ '  hi  '|trim }}|{{ 'xhix'|trim('x') }}|{{ 'hÉllo wörld'|upper }}|{{ 'ÀB'|lower }}|{{ 'hello "
     "WORLD'|capitalize }}|{{ 'hello-world foo(bar'|title }}|{{ 'aaa'|replace('a', 'b', 2) }}|{{ 'ΟΔΟΣ'|lower }}",
     R"json({})json", "hi|hi|HÉLLO WÖRLD|àb|Hello world|Hello-World Foo(Bar|bba|οδος"},
    {"filters_default",
     "{{ u|default('d') }}|{{ ''|default('d') }}|{{ ''|default('d', true) }}|{{ none|d('x') }}|{{ none|default('x', "
     "true) }}|{{ u|length }}",
     R"json({})json", "d||d|None|x|0"},
    {"filters_seq",
     "{{ 'héllo'|length }} {{ xs|count }} {{ xs|first }} {{ xs|last }} {{ xs|join('-') }} {{ 'ab'|list }} {{ "
     "xs|reverse|list }} {{ [3, 1, 2]|sort }} {{ ['b', 'A', 'a']|unique|list }} {{ xs|sum }} {{ xs|min }} {{ xs|max }}",
     R"json({"xs": [1, 2, 3]})json", "5 3 1 3 1-2-3 ['a', 'b'] [3, 2, 1] [1, 2, 3] ['b', 'A'] 6 1 3"},
    {"filters_map_select",
     "{{ ms|map(attribute='r')|join(',') }} {{ ['a', 'b']|map('upper')|list }} {{ ms|selectattr('r', 'equalto', "
     "'u')|list|length }} {{ ms|rejectattr('c')|map(attribute='r')|list }} {{ [0, 1, none, 2]|select|list }} {{ [1, 2, "
     "3]|reject('odd')|list }}",
     R"json({"ms": [{"r": "u", "c": "x"}, {"r": "a"}]})json", "u,a ['A', 'B'] 1 ['a'] [1, 2] [2]"},
    {"filters_convert",
     "{{ '42'|int }} {{ '4.7'|int }} {{ 'x'|int }} {{ 'x'|int(7) }} {{ 3.9|int }} {{ '2.5'|float }} {{ 2|float }} {{ "
     "5|string ~ '!' }} {{ 3|safe }} {{ -3|abs }}",
     R"json({})json", "42 4 0 7 3 2.5 2.0 5! 3 3"},
    {"filters_dict",
     "{{ d|dictsort }} {{ d|dictsort(reverse=true) }} {{ d|dictsort(by='value') }} {{ d|dictsort(true) }} {{ "
     "d|items|list }}",
     R"json({"d": {"b": 2, "A": 3, "a": 1}})json",
     "[('A', 3), ('a', 1), ('b', 2)] [('b', 2), ('A', 3), ('a', 1)] [('a', 1), ('b', 2), ('A', 3)] [('A', 3), ('a', "
     "1), ('b', 2)] [('b', 2), ('A', 3), ('a', 1)]"},
    {"tojson",
     "{{ v|tojson }}|{{ v|tojson(indent=2) }}|{{ v|tojson(sort_keys=true) }}|{{ v|tojson(separators=(',', ':')) }}|{{ "
     "'é<>&\\u0001\"'|tojson }}|{{ []|tojson(indent=2) }}",
     R"json({"v": {"z": [1, 2.5, true, null], "a": {"n": "ü"}}})json",
     "{\"z\": [1, 2.5, true, null], \"a\": {\"n\": \"ü\"}}|{\n  \"z\": [\n    1,\n    2.5,\n    true,\n    null\n  "
     "],\n  \"a\": {\n    \"n\": \"ü\"\n  }\n}|{\"a\": {\"n\": \"ü\"}, \"z\": [1, 2.5, true, "
     "null]}|{\"z\":[1,2.5,true,null],\"a\":{\"n\":\"ü\"}}|\"é<>&\\u0001\\\"\"|[]"},
    {"tests",
     "{{ 1 is number }}{{ true is number }}{{ true is integer }}{{ 1.0 is float }}{{ 's' is string }}{{ d is mapping "
     "}}{{ d is sequence }}{{ 's' is iterable }}{{ none is none }}{{ u is undefined }}{{ false is false }}{{ 3 is odd "
     "}}{{ 4 is divisibleby 2 }}{{ 2 is eq 2 }}{{ 'a' is in 'cat' }}{{ 1 is boolean }}{{ x is not defined }}",
     R"json({"d": {}})json", "TrueTrueFalseTrueTrueTrueTrueTrueTrueTrueTrueTrueTrueTrueTrueFalseTrue"},
    {"printing",
     "{{ 1.0 }} {{ 1e16 }} {{ 1e15 }} {{ 0.0001 }} {{ 0.00001 }} {{ 0.1 + 0.2 }} {{ -0.0 }} {{ 1/3 }} {{ "
     "123456789012345678 }} {{ true }} {{ none }} {{ u }}|{{ [1, 'a', \"it's\", none, 2.5, [true]] }} {{ {'k': 'v', 1: "
     "(1,)} }} {{ (1, 2) }} {{ ['a\\nb', '\\u00e9'] }}",
     R"json({})json",
     "1.0 1e+16 1000000000000000.0 0.0001 1e-05 0.30000000000000004 -0.0 0.3333333333333333 123456789012345678 True "
     "None |[1, 'a', \"it's\", None, 2.5, [True]] {'k': 'v', 1: (1,)} (1, 2) ['a\\nb', 'é']"},
    {"json_numbers", "{{ i }} {{ f }} {{ g }} {{ b }} {{ n }} {{ big }} {{ tiny }}",
     R"json({"i": 3, "f": 3.0, "g": 2.5e-07, "b": false, "n": null, "big": 1e+22, "tiny": -1.5})json",
     "3 3.0 2.5e-07 False None 1e+22 -1.5"},
    {"undefined_chain",
     "{{ d.missing }}|{{ d['missing'] is defined }}|{{ d.k.missing is defined }}|{{ none.x }}|{{ xs[9] }}|{{ u ~ 'q' "
     "}}",
     R"json({"d": {"k": {}}, "xs": []})json", "|False|False|||q"},
    {"generation", "a{% generation %}B{{ 1 }}{% endgeneration %}c", R"json({})json", "aB1c"},
};

}  // namespace

TEST(Template, HandWrittenCases) {
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.name);
    EXPECT_EQ(render(c.source, json::parse(c.variables)), c.expected);
  }
}

TEST(Template, KeyOrderOfTheVariablesIsKept) {
  // Python dicts keep insertion order; a loop over one and tojson show it.
  json vars = json::parse(R"({"d": {"z": 1, "a": 2}})");
  EXPECT_EQ(render("{% for k in d %}{{ k }}{% endfor %} {{ d|tojson }}", vars), "za {\"z\": 1, \"a\": 2}");
}

TEST(Template, GenerationSpansCoverTheBlockBodies) {
  const Template t =
      Template::parse("<s>{% for m in ms %}[{% generation %}{{ m }}{% endgeneration %}]{% endfor %}", "t.jinja");
  const rf::text::Rendered r = t.render_with_spans(json::parse(R"({"ms": ["ab", "é"]})"));
  EXPECT_EQ(r.text, "<s>[ab][é]");
  ASSERT_EQ(r.generation.size(), 2u);
  EXPECT_EQ(r.text.substr(r.generation[0].begin, r.generation[0].end - r.generation[0].begin), "ab");
  EXPECT_EQ(r.text.substr(r.generation[1].begin, r.generation[1].end - r.generation[1].begin), "é");
}

TEST(Template, RaiseExceptionCarriesTheTemplatesMessage) {
  EXPECT_EQ(error_of("line one\n  {{ raise_exception('Only user and assistant roles') }}"),
            "t.jinja:2:6: the template raised an error: Only user and assistant roles");
}

TEST(Template, SyntaxErrorsNameLineAndColumn) {
  EXPECT_EQ(error_of("a\n{% if x %}b"),
            "t.jinja:2:1: unexpected end of template: the block opened here is never closed (expected 'elif' or "
            "'else' or 'endif')");
  EXPECT_EQ(error_of("{{ x | nosuch }}"), "t.jinja:1:8: no filter named 'nosuch'");
  EXPECT_EQ(error_of("{{ x | wordwrap }}"),
            "t.jinja:1:8: the filter 'wordwrap' is not supported by ringflex's template engine (docs/text.md)");
  EXPECT_EQ(error_of("{{ x is nosuch }}"), "t.jinja:1:9: no test named 'nosuch'");
  EXPECT_EQ(error_of("x\n {% include 'a' %}"),
            "t.jinja:2:2: the '{% include %}' tag is not supported by ringflex's template engine (docs/text.md)");
  EXPECT_EQ(error_of("{% frobnicate %}"), "t.jinja:1:1: unknown tag 'frobnicate'");
  EXPECT_EQ(error_of("{{ 'abc }}"), "t.jinja:1:4: unterminated string literal");
  EXPECT_EQ(error_of("{# never closed"), "t.jinja:1:1: missing end of comment tag");
  EXPECT_EQ(error_of("{{ x "), "t.jinja:1:1: missing '}}'");
  EXPECT_EQ(error_of("{{ (1 }}"), "t.jinja:1:7: unexpected '}', expected ')'");
  EXPECT_EQ(error_of("{% break %}"), "t.jinja:1:1: 'break' outside of a loop");
  EXPECT_EQ(error_of("{{ 1 + }}"), "t.jinja:1:8: unexpected end of print statement");
}

TEST(Template, RuntimeErrorsAreJinja2s) {
  EXPECT_EQ(error_of("{{ u.x }}"), "t.jinja:1:4: 'u' is undefined");
  EXPECT_EQ(error_of("{{ d.x.y }}", json::parse(R"({"d": {}})")), "t.jinja:1:4: 'dict object' has no attribute 'x'");
  EXPECT_EQ(error_of("{{ 'a' + 1 }}"), "t.jinja:1:4: can only concatenate str (not \"int\") to str");
  EXPECT_EQ(error_of("{{ xs.append(1) }}", json::parse(R"({"xs": []})")),
            "t.jinja:1:4: access to attribute 'append' of 'list' object is unsafe.");
  EXPECT_EQ(error_of("{{ 1 // 0 }}"), "t.jinja:1:4: integer division or modulo by zero");
  EXPECT_EQ(error_of("{{ u|tojson }}"), "t.jinja:1:4: Object of type Undefined is not JSON serializable");
  EXPECT_EQ(error_of("{% set ns = namespace(_x=1) %}"),
            "t.jinja:1:13: Chat templates cannot store underscore-prefixed attributes on a namespace, but got '_x'. "
            "Please rename the attribute.");
  EXPECT_EQ(error_of("{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}"),
            "t.jinja:1:34: macro 'm' takes not more than 1 argument(s)");
  EXPECT_EQ(error_of("{{ range(200000)|length }}"),
            "t.jinja:1:4: Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
}

TEST(Template, HostileTemplatesAreBounded) {
  // A macro calling itself forever: refused at the depth limit instead of overflowing the stack.
  EXPECT_EQ(error_of("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}"),
            "t.jinja:1:19: macro calls nest deeper than 200 (RenderLimits)");
  // Output doubling through nested loops: refused at the byte limit.
  rf::text::RenderLimits small;
  small.max_output_bytes = 1000;
  EXPECT_EQ(error_of("{% for i in range(100) %}{% for j in range(100) %}xx{% endfor %}{% endfor %}", {}, small),
            "t.jinja:1:51: the render exceeds 1000 bytes (RenderLimits)");
  small.max_loop_iterations = 50;
  EXPECT_EQ(error_of("{% for i in range(100) %}{% endfor %}", {}, small),
            "t.jinja:1:1: the render runs more than 50 loop iterations (RenderLimits)");
  // Nesting deep enough to exhaust a recursive parser's stack.
  const std::string parens = std::string(100000, '(') + "1" + std::string(100000, ')');
  EXPECT_EQ(error_of("{{ " + parens + " }}"),
            "t.jinja:1:104: the template nests expressions or blocks more than 200 deep");
  std::string ifs;
  for (int k = 0; k < 100000; ++k) ifs += "{% if x %}";
  EXPECT_EQ(error_of(ifs), "t.jinja:1:1987: the template nests expressions or blocks more than 200 deep");
}

TEST(Template, UnsupportedCaseMappingIsRefusedNotGuessed) {
  // Georgian and others have case rules outside the scripts the engine maps: refused rather than left as they are.
  EXPECT_NE(error_of("{{ s|upper }}", json::parse(R"({"s": "ა"})")).find("upper() of U+10D0 is not supported"),
            std::string::npos);
  EXPECT_EQ(render("{{ s|upper }}", json::parse(R"({"s": "日本 🎉"})")), "日本 🎉");  // no case: unchanged
}
