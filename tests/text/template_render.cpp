// The oracle tests' way into the template engine: renders TEMPLATE once per line of CASES (a JSON object of
// variables a line) and writes one JSON line per case to stdout, {"text": ...} or {"error": ...}, so a Python test
// compares many renders with jinja2's in one process. With no CASES, only parses TEMPLATE (exit 1 and the error
// on stderr when it does not parse).
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "text/template.h"

int main(int argc, char** argv) {
  if (argc < 2 || argc > 3) {
    std::cerr << "usage: template_render TEMPLATE [CASES.jsonl]\n";
    return 2;
  }
  std::ifstream in(argv[1], std::ios::binary);
  if (!in) {
    std::cerr << argv[1] << ": cannot read\n";
    return 2;
  }
  std::stringstream source;
  source << in.rdbuf();
  try {
    const rf::text::Template tmpl = rf::text::Template::parse(source.str(), argv[1]);
    if (argc == 2) return 0;
    std::ifstream cases(argv[2], std::ios::binary);
    std::string line;
    while (std::getline(cases, line)) {
      if (line.empty()) continue;
      nlohmann::ordered_json result;
      try {
        result["text"] = tmpl.render(nlohmann::ordered_json::parse(line));
      } catch (const rf::Error& e) {
        result["error"] = e.what();
      }
      std::cout << result.dump() << "\n";
    }
  } catch (const rf::Error& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
  return 0;
}
