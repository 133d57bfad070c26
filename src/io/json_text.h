// ringflex io: what every JSON text the project reads (safetensors headers, config.json, index files, trainer
// state, JSONL data) must be before nlohmann parses it.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>

namespace rf::io {

// Open brackets allowed at once: serde_json's default, the parser behind Python's safetensors. No file ringflex
// reads nests deeper than 5.
constexpr int kMaxJsonDepth = 128;

// Throws rf::Error (`where` first, then the problem) unless `text`:
//  - holds no NUL byte: nlohmann stops at the first one, so what follows it would never be read or checked;
//  - does not start with a UTF-8 byte-order mark: nlohmann skips one, Python's json and safetensors reject it;
//  - nests at most kMaxJsonDepth brackets deep: nlohmann builds a node per open bracket, so a 100 MB header of
//    `[` would cost gigabytes before failing.
// Brackets inside strings do not count. The scan is linear and allocates nothing.
void check_json_text(std::string_view text, const std::string& where);

// nlohmann's exception text without its "[json.exception.parse_error.101] " prefix, for one-line messages:
// "parse error at line 2, column 5: syntax error ...".
std::string json_error_text(const char* what);

// nlohmann's parse of `text` (throwing its parse_error as parse does), recording in *duplicate the first key that
// appears twice in one object, "" when none: nlohmann itself keeps the last of them silently, so two readers of a
// file naming one tensor twice would disagree on which entry it is.
nlohmann::json parse_tracking_duplicates(std::string_view text, std::string* duplicate);

// check_json_text(text, where + ": "), then nlohmann's parse; invalid JSON throws rf::Error
// "WHERE: not valid JSON: parse error at line 2, column 5: ...".
nlohmann::json parse_json(std::string_view text, const std::string& where);

// The largest small JSON file read whole (a checkpoint's config.json, a PEFT adapter_config.json): real ones are a few
// KiB; anything larger is not one of them.
constexpr std::uintmax_t kMaxConfigFileBytes = 16u << 20;

// The text of a small config file (config.json, adapter_config.json, a training YAML, a checkpoint index), read only
// if it is a regular file of at most kMaxConfigFileBytes: a FIFO would block the read forever and a device such as
// /dev/zero would never end. Throws rf::Error naming `path` otherwise ("..., not <kind> (at most ... bytes are
// read)").
std::string read_config_file(const std::string& path, std::string_view kind = "a JSON config");

}  // namespace rf::io
