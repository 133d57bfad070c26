// ringflex trainer: a conversation as a generation prompt (see conversation_prompt.h).
#include "trainer/conversation_prompt.h"

#include <algorithm>

#include "core/error.h"
#include "io/image.h"

namespace rf::trainer {

namespace {

// The image paths of a checked conversation's messages, in the order the template writes their placeholders.
std::vector<std::string> image_paths_of(const nlohmann::ordered_json& conversation,
                                        const std::filesystem::path& folder) {
  std::vector<std::string> paths;
  for (const auto& message : conversation["messages"]) {
    if (!message.contains("content") || !message["content"].is_array()) continue;
    for (const auto& part : message["content"]) {
      if (part.value("type", "") != "image") continue;
      const std::filesystem::path given(part["path"].get<std::string>());
      paths.push_back((given.is_absolute() ? given : folder / given).string());
    }
  }
  return paths;
}

}  // namespace

ConversationPrompt conversation_prompt(const nlohmann::ordered_json& conversation, const std::string& where,
                                       const std::filesystem::path& folder, const text::ChatRenderer& renderer,
                                       const text::Tokenizer& tok, const PromptImages& images) {
  text::check_conversation(conversation, where, folder);
  const std::string rendered =
      renderer.render_prompt(conversation["messages"],
                             conversation.contains("tools") ? conversation["tools"] : nlohmann::ordered_json());
  const std::vector<int32_t> ids = tok.encode(rendered);
  const model::MultimodalTokens& t = images.tokens;
  ConversationPrompt c;
  c.image_paths = image_paths_of(conversation, folder);
  const auto placeholders = std::count(ids.begin(), ids.end(), t.image);
  RF_CHECK(placeholders == static_cast<int64_t>(c.image_paths.size()), where, ": has ", c.image_paths.size(),
           " images and the chat template wrote ", placeholders, " image placeholder tokens (id ", t.image,
           ", the config's image_token_id): one each");
  RF_CHECK(c.image_paths.empty() || images.processor.has_value(), where, ": has images, but ", images.config_path,
           " has no vision_config (the checkpoint has no vision tower)");
  size_t next = 0;
  for (const int32_t id : ids) {
    if (id != t.image) {
      c.prompt.ids.push_back(id);
      c.prompt.mm_token_type.push_back(0);
      continue;
    }
    const std::string& image = c.image_paths[next++];
    try {
      c.images.push_back(model::preprocess_image(io::read_image(image), *images.processor, image));
    } catch (const rf::Error& e) {
      rf::fail(where, ": ", e.what());
    }
    const size_t slots = static_cast<size_t>(c.images.back().soft_tokens);
    c.prompt.ids.push_back(t.boi);
    c.prompt.mm_token_type.push_back(0);
    c.prompt.ids.insert(c.prompt.ids.end(), slots, t.image);
    c.prompt.mm_token_type.insert(c.prompt.mm_token_type.end(), slots, 1);
    c.prompt.ids.push_back(t.eoi);
    c.prompt.mm_token_type.push_back(0);
  }
  if (c.images.empty()) c.prompt.mm_token_type.clear();
  return c;
}

void encode_prompt_images(model::Prompt& prompt, std::span<const model::ProcessedImage> images,
                          std::span<const std::string> paths, const model::VisionEncoder& tower) {
  RF_CHECK(images.size() == paths.size(), "encode_prompt_images: ", images.size(), " images and ", paths.size(),
           " paths");
  prompt.image_features.clear();
  prompt.n_image_features = 0;
  for (size_t i = 0; i < images.size(); ++i) {
    const model::ProcessedImage& p = images[i];
    model::VisionBatch b;
    b.n = 1;
    b.P = static_cast<int64_t>(p.positions.size()) / 2;
    b.pixels = p.pixels.data();
    b.positions = p.positions.data();
    tower.check(b, paths[i]);
    const model::VisionOutput soft = tower.forward(b, paths[i]);
    RF_CHECK(soft.counts[0] == p.soft_tokens, paths[i], ": the tower made ", soft.counts[0], " soft tokens, the ",
             "processor ", p.soft_tokens);
    prompt.image_features.insert(prompt.image_features.end(), soft.soft_tokens.begin(), soft.soft_tokens.end());
    prompt.n_image_features += p.soft_tokens;
  }
}

}  // namespace rf::trainer
