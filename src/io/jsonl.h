// ringflex io: JSONL files (one JSON object a line: the trainer's data sources, generate's --messages and the
// trainer's sample prompts).
#pragma once

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "core/error.h"
#include "io/json_text.h"

namespace rf::io {

// Reads the non-empty lines of a JSONL file; calls fn(object, "path:line") for each. Json = ordered_json keeps each
// object's key order (chat templates see it, as Python's dicts).
template <typename Json = nlohmann::json, typename Fn>
void for_each_line(const std::string& path, Fn fn) {
  std::ifstream in(path);
  RF_CHECK(in.good(), path, ": cannot open");
  std::string line;
  int number = 0, samples = 0;
  while (std::getline(in, line)) {
    ++number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(number);
    io::check_json_text(line, where + ": ");
    Json j;
    try {
      j = Json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      rf::fail(where, ": not valid JSON: ", io::json_error_text(e.what()));
    }
    RF_CHECK(j.is_object(), where, ": each line must be a JSON object");
    fn(j, where);
    ++samples;
  }
  RF_CHECK(samples > 0, path, ": the file has no samples");
}

}  // namespace rf::io
