// ringflex trainer: train.samples' prompts file and records (see samples.h, docs/train-samples.md).
#include "trainer/samples.h"

#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/jsonl.h"
#include "model/generation_config.h"
#include "text/conversation.h"

namespace rf::trainer {

namespace {

// The ids of an {"ids": [...]} line, each inside the model's vocabulary.
std::vector<int32_t> ids_of(const nlohmann::ordered_json& v, int64_t vocab, const std::string& where) {
  RF_CHECK(v.is_array(), where, ": `ids` must be a list of token ids");
  std::vector<int32_t> ids;
  for (const auto& x : v) {
    RF_CHECK(x.is_number_integer(), where, ": `ids` must be a list of integers, found ", x.dump());
    const int64_t id = x.get<int64_t>();
    RF_CHECK(id >= 0 && id < vocab, where, ": token id ", id, " is outside the model's vocabulary [0, ", vocab, ")");
    ids.push_back(static_cast<int32_t>(id));
  }
  return ids;
}

bool has_image_part(const nlohmann::ordered_json& conversation) {
  for (const auto& message : conversation["messages"]) {
    if (!message.contains("content") || !message["content"].is_array()) continue;
    for (const auto& part : message["content"])
      if (part.value("type", "") == "image") return true;
  }
  return false;
}

}  // namespace

SamplePrompts read_sample_prompts(const TrainConfig& c, const model::Gemma4Model& m, int cp_ranks) {
  DataContract k;  // where jsonl_chat finds the tokenizer and template: model.path's folder
  k.model_path = c.model.path;
  const std::string& path = c.train.samples_prompts;
  const std::filesystem::path folder = std::filesystem::path(path).parent_path();
  SamplePrompts out;
  std::unique_ptr<text::ChatRenderer> renderer;  // made on the first conversation
  io::for_each_line<nlohmann::ordered_json>(path, [&](const nlohmann::ordered_json& j, const std::string& where) {
    RF_CHECK(j.is_object() && (j.contains("ids") != j.contains("messages")), where,
             ": a prompt is {\"ids\": [...]} or {\"messages\": [...]} (one of the two)");
    model::Prompt p;
    if (j.contains("ids")) {
      p.ids = ids_of(j["ids"], m.config().vocab_size, where);
    } else {
      text::check_conversation(j, where, folder);
      RF_CHECK(!has_image_part(j), where, ": images in train.samples prompts are not supported (text only)");
      if (!renderer) {
        const std::filesystem::path tokenizer_at = text_tokenizer_file(c, k);
        out.tok = text::load_tokenizer(tokenizer_at);
        renderer = std::make_unique<text::ChatRenderer>(text::load_chat_template(k.model_path, c.data.chat_template,
                                                                                 tokenizer_at.parent_path() /
                                                                                     "tokenizer_config.json"),
                                                        *out.tok, text::ChatOptions{});
      }
      p.ids = out.tok->encode(
          renderer->render_prompt(j["messages"], j.contains("tools") ? j["tools"] : nlohmann::ordered_json()));
    }
    model::check_prompt(m, p, c.train.samples_max_new_tokens, cp_ranks, where);
    out.prompts.push_back(std::move(p));
    out.where.push_back(where);
  });
  RF_CHECK(!out.prompts.empty(), path, ": no prompts (train.samples.prompts needs one a line)");
  return out;
}

std::vector<int64_t> prompt_lengths(const SamplePrompts& s) {
  std::vector<int64_t> lengths;
  for (const model::Prompt& p : s.prompts) lengths.push_back(static_cast<int64_t>(p.ids.size()));
  return lengths;
}

std::vector<int32_t> sample_stop_ids(const std::map<std::string, std::string>& side_files, const std::string& where) {
  const auto file = side_files.find("generation_config.json");
  if (file == side_files.end()) return {};
  return model::parse_generation_config(file->second, where).stop_ids;
}

std::string ids_text(std::span<const int32_t> ids) {
  std::string out;
  for (const int32_t id : ids) {
    if (!out.empty()) out += ' ';
    out += std::to_string(id);
  }
  return out;
}

bool is_sample_step(const TrainConfig& c, int64_t step) {
  if (c.train.samples_prompts.empty()) return false;
  return step == c.train.steps || (c.train.samples_every > 0 && step % c.train.samples_every == 0);
}

std::string samples_path(const std::string& metrics_path) {
  if (metrics_path.empty()) return "";
  return std::filesystem::path(metrics_path).replace_extension(".samples.jsonl").string();
}

std::string sample_json_line(int64_t step, size_t index, const std::string& where, const model::Prompt& p,
                             const model::Generated& g, const text::Tokenizer* tok) {
  nlohmann::ordered_json j;
  j["step"] = step;
  j["prompt"] = index;
  j["where"] = where;
  j["prompt_ids"] = p.ids;
  j["token_ids"] = g.tokens;
  j["stop_reason"] = g.stop_reason;
  if (tok) j["text"] = tok->decode(g.tokens, true);
  // A decoded text with bytes that are not UTF-8 (a sample cut inside a character) is written with U+FFFD for them.
  return j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
}

}  // namespace rf::trainer
