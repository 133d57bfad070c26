// ringflex io: the pre-parse check of JSON text (json_text.h).
#include "io/json_text.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <vector>

#include "core/error.h"

namespace rf::io {

void check_json_text(std::string_view text, const std::string& where) {
  constexpr std::string_view kByteOrderMark = "\xEF\xBB\xBF";
  RF_CHECK(!text.starts_with(kByteOrderMark), where, "it starts with a UTF-8 byte-order mark, which JSON text may not");
  int depth = 0;
  bool in_string = false, escaped = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    RF_CHECK(c != '\0', where, "byte ", i, " is a NUL, which JSON text cannot hold");
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      RF_CHECK(++depth <= kMaxJsonDepth, where, "it nests more than ", kMaxJsonDepth, " brackets deep (at byte ", i,
               ")");
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
}

std::string json_error_text(const char* what) {
  const std::string_view text(what);
  const size_t cut = text.starts_with("[json.exception.") ? text.find("] ") : std::string_view::npos;
  return std::string(cut == std::string_view::npos ? text : text.substr(cut + 2));
}

nlohmann::json parse_tracking_duplicates(std::string_view text, std::string* duplicate) {
  duplicate->clear();
  std::vector<std::set<std::string>> open_objects;  // the keys seen in each object still open
  const nlohmann::json::parser_callback_t track_keys = [&](int, nlohmann::json::parse_event_t event,
                                                           nlohmann::json& parsed) {
    if (event == nlohmann::json::parse_event_t::object_start) open_objects.emplace_back();
    if (event == nlohmann::json::parse_event_t::object_end) open_objects.pop_back();
    if (event == nlohmann::json::parse_event_t::key && !open_objects.back().insert(parsed.get<std::string>()).second &&
        duplicate->empty())
      *duplicate = parsed.get<std::string>();
    return true;
  };
  return nlohmann::json::parse(text.begin(), text.end(), track_keys);
}

nlohmann::json parse_json(std::string_view text, const std::string& where) {
  check_json_text(text, where + ": ");
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    fail(where, ": not valid JSON: ", json_error_text(e.what()));
  }
}

std::string read_config_file(const std::string& path, std::string_view kind) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const bool exists = fs::exists(path, ec);  // ec only for a failed look-up (a symlink loop), not for "absent"
  RF_CHECK(!ec, path, ": ", ec.message());
  RF_CHECK(exists, path, ": no such file");
  RF_CHECK(fs::is_regular_file(path, ec), path, ": not a regular file");
  const std::uintmax_t size = fs::file_size(path, ec);
  RF_CHECK(!ec && size <= kMaxConfigFileBytes, path, ": ", ec ? ec.message() : std::to_string(size) + " bytes",
           ", not ", kind, " (at most ", kMaxConfigFileBytes, " bytes are read)");
  std::ifstream in(path);
  RF_CHECK(in.good(), path, ": cannot be read");
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace rf::io
