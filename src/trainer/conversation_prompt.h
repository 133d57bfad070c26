// ringflex trainer: a conversation as a generation prompt, its images laid out as slots and encoded by a vision
// tower: what `ringflex generate --messages` and train.samples' conversation prompts both read (docs/generate.md,
// docs/train-samples.md), so that the two give the same prompt for the same line.
//
// The conversation ({"messages": [...], "tools": [...]?}, docs/text.md) is rendered through the chat template with
// the generation prompt and tokenized; each image placeholder the template writes becomes <boi>, the processor's
// soft-token count of slots (the placeholder id, token type 1) and <eoi>, as Gemma4Processor lays images out and the
// jsonl_chat data source does. The slots' features are the tower's soft tokens of each preprocessed image, made once
// the tower's weights are there (encode_prompt_images).
#pragma once

#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/generate.h"
#include "model/image_processor.h"
#include "model/vision.h"
#include "model/vision_encoder.h"
#include "text/conversation.h"
#include "text/tokenizer.h"

namespace rf::trainer {

// How a conversation's images become slots: the model's image token ids and, with a vision tower, its processor.
struct PromptImages {
  model::MultimodalTokens tokens;
  std::optional<model::ImageProcessorConfig> processor;  // none: the model has no vision tower (images refused)
  std::string config_path;                               // the config.json named when images are refused
};

struct ConversationPrompt {
  model::Prompt prompt;                       // ids and token types with the slots; no image features yet
  std::vector<model::ProcessedImage> images;  // [images] in slot order, as the tower takes them
  std::vector<std::string> image_paths;       // [images], named in errors
};

// One line of a conversations file, `where` ("FILE:LINE") naming it in errors; image paths are relative to `folder`.
// Throws rf::Error "FILE:LINE: ..." for a conversation the renderer refuses, placeholders that do not match the image
// parts, images without a tower, and a missing or unreadable image (its path named).
ConversationPrompt conversation_prompt(const nlohmann::ordered_json& conversation, const std::string& where,
                                       const std::filesystem::path& folder, const text::ChatRenderer& renderer,
                                       const text::Tokenizer& tok, const PromptImages& images);

// The prompt's image features [N, F]: `images` [n] (those of `paths` [n]) through `tower`, one image a forward as
// `ringflex generate` runs them, replacing any features the prompt had. Throws rf::Error naming the image when the
// tower's soft tokens do not fill its slots.
void encode_prompt_images(model::Prompt& prompt, std::span<const model::ProcessedImage> images,
                          std::span<const std::string> paths, const model::VisionEncoder& tower);

}  // namespace rf::trainer
