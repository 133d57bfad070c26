// ringflex model: generation_config.json's decoding defaults (see generation_config.h).
#include "model/generation_config.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "io/json_text.h"

namespace rf::model {

namespace {

std::vector<int32_t> id_list(const nlohmann::json& v, const std::string& where) {
  std::vector<int32_t> ids;
  if (v.is_number_integer())
    ids.push_back(v.get<int32_t>());
  else if (v.is_array())
    for (const auto& x : v) {
      RF_CHECK(x.is_number_integer(), where, ": eos_token_id must be an integer or a list of integers");
      ids.push_back(x.get<int32_t>());
    }
  else
    RF_CHECK(v.is_null(), where, ": eos_token_id must be an integer or a list of integers");
  return ids;
}

}  // namespace

GenerationDefaults parse_generation_config(const std::string& text, const std::string& where) {
  GenerationDefaults d;
  const nlohmann::json j = io::parse_json(text, where);
  try {
    d.sampling.greedy = !j.value("do_sample", false);
    d.sampling.temperature = j.value("temperature", 1.f);
    d.sampling.top_k = j.contains("top_k") && !j["top_k"].is_null() ? j["top_k"].get<int>() : kTransformersTopK;
    d.sampling.top_p = j.contains("top_p") && !j["top_p"].is_null() ? j["top_p"].get<float>() : 1.f;
    if (j.contains("min_p") && !j["min_p"].is_null()) d.sampling.min_p = j["min_p"].get<float>();
    if (j.contains("max_new_tokens") && !j["max_new_tokens"].is_null())
      d.max_new_tokens = j["max_new_tokens"].get<int>();
    if (j.contains("eos_token_id")) d.stop_ids = id_list(j["eos_token_id"], where);
  } catch (const nlohmann::json::exception& e) {
    RF_CHECK(false, where, ": ", e.what());
  }
  return d;
}

GenerationDefaults read_generation_config(const std::filesystem::path& dir) {
  const std::filesystem::path file = dir / "generation_config.json";
  if (!std::filesystem::exists(file)) return {};
  std::ifstream in(file);
  std::stringstream text;
  text << in.rdbuf();
  return parse_generation_config(text.str(), file.string());
}

}  // namespace rf::model
