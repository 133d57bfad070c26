// ringflex trainer: train.samples' prompts file and records (see samples.h, docs/train-samples.md).
#include "trainer/samples.h"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/jsonl.h"
#include "model/generation_config.h"
#include "text/conversation.h"
#include "trainer/conversation_prompt.h"

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

// The model's image tokens and processor as the training data lays images out (data.image_soft_tokens).
PromptImages prompt_images(const TrainConfig& c, const model::Gemma4Multimodal& m) {
  PromptImages images;
  images.config_path = c.model.path.empty() ? "model.builtin " + c.model.builtin
                                            : (std::filesystem::path(c.model.path) / "config.json").string();
  images.tokens = model::MultimodalTokens::from_config_json(m.config().source_json, images.config_path);
  if (const std::optional<model::VisionConfig>& vision = m.parts().vision) {
    images.processor.emplace();
    images.processor->patch_size = vision->patch_size;
    images.processor->pooling_kernel_size = vision->pooling_kernel_size;
    images.processor->max_soft_tokens = c.data.image_soft_tokens;
  }
  return images;
}

}  // namespace

SamplePrompts read_sample_prompts(const TrainConfig& c, const model::Gemma4Multimodal& m, int cp_ranks) {
  DataContract k;  // where jsonl_chat finds the tokenizer and template: model.path's folder
  k.model_path = c.model.path;
  const std::string& path = c.train.samples_prompts;
  const std::filesystem::path folder = std::filesystem::path(path).parent_path();
  SamplePrompts out;
  std::unique_ptr<text::ChatRenderer> renderer;  // made on the first conversation
  const PromptImages images = prompt_images(c, m);
  io::for_each_line<nlohmann::ordered_json>(path, [&](const nlohmann::ordered_json& j, const std::string& where) {
    RF_CHECK(j.is_object() && (j.contains("ids") != j.contains("messages")), where,
             ": a prompt is {\"ids\": [...]} or {\"messages\": [...]} (one of the two)");
    ConversationPrompt p;
    if (j.contains("ids")) {
      p.prompt.ids = ids_of(j["ids"], m.config().vocab_size, where);
    } else {
      if (!renderer) {
        const std::filesystem::path tokenizer_at = text_tokenizer_file(c, k);
        out.tok = text::load_tokenizer(tokenizer_at);
        renderer = std::make_unique<text::ChatRenderer>(text::load_chat_template(k.model_path, c.data.chat_template,
                                                                                 tokenizer_at.parent_path() /
                                                                                     "tokenizer_config.json"),
                                                        *out.tok, text::ChatOptions{});
      }
      p = conversation_prompt(j, where, folder, *renderer, *out.tok, images);
      RF_CHECK(p.images.empty() || m.vision_feature_dim() > 0, where, ": has images, but the model has no vision ",
               "projection (model.embed_vision.embedding_projection.weight) to take the tower's soft tokens");
    }
    model::check_prompt(m.decoder(), p.prompt, c.train.samples_max_new_tokens, cp_ranks, where);
    out.prompts.push_back(std::move(p.prompt));
    out.images.push_back(std::move(p.images));
    out.image_paths.push_back(std::move(p.image_paths));
    out.where.push_back(where);
  });
  RF_CHECK(!out.prompts.empty(), path, ": no prompts (train.samples.prompts needs one a line)");
  return out;
}

bool has_sample_images(const SamplePrompts& s) {
  return std::any_of(s.images.begin(), s.images.end(), [](const auto& images) { return !images.empty(); });
}

void encode_sample_images(SamplePrompts& s, const model::VisionEncoder& tower, bool keep_images) {
  for (size_t i = 0; i < s.prompts.size(); ++i) {
    if (s.images[i].empty()) continue;
    encode_prompt_images(s.prompts[i], s.images[i], s.image_paths[i], tower);
    if (!keep_images) s.images[i] = {};
  }
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
