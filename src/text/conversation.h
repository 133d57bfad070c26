// ringflex text: one conversation (messages + tools) rendered through the checkpoint's chat template, tokenized,
// with the tokens the loss trains on and the images in slot order (docs/text.md, "Conversations").
//
// Labels are derived from the template's own output, not from a copy of its logic: the conversation is rendered a
// second time with every user-written string replaced by an opaque sentinel, so the turn structure is read from text
// the template wrote (a `<|turn>` typed inside a message cannot open a turn), then each sentinel is matched back to
// the real rendering. This holds for every Gemma 4 template revision that writes turns as `<|turn>ROLE\n ...
// <turn|>` and tool responses as `<|tool_response> ... <tool_response|>`.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "text/template.h"
#include "text/tokenizer.h"

namespace rf::text {

// data.chat.train_on: which tokens are targets. Assistant: every model turn's content, tool calls and closing
// `<turn|>` (not the newline after it), never its `<|turn>model\n` header, tool responses or images; LastAssistant:
// those of the last model turn only; All: every token but images.
enum class TrainOn { Assistant, LastAssistant, All };
std::string_view name_of(TrainOn t);  // assistant | last_assistant | all

struct ChatOptions {
  TrainOn train_on = TrainOn::Assistant;
  // `<|channel>thought\n<channel|>` (an empty thought block, masked) after the header of each trained model turn that
  // does not already open with `<|channel>`, as Gemma 4 -it models saw their answers in training.
  bool thought_prefix = true;
  std::optional<bool> enable_thinking;  // passed to the template only when set (data.chat.enable_thinking)
};

// The template and the variables transformers' apply_chat_template gives it besides the conversation: the
// tokenizer's special tokens (bos_token, eos_token, pad_token, unk_token, ...) from tokenizer_config.json.
struct ChatTemplate {
  Template engine;
  std::string origin;              // the file it came from (for messages)
  nlohmann::ordered_json special;  // {"bos_token": "<bos>", ...}
};

// `template_file` when given; else <model_dir>/chat_template.jinja; else the `chat_template` string of
// `tokenizer_config` (a tokenizer_config.json). Special tokens from `tokenizer_config` when that file exists. Throws
// rf::Error naming the file that is missing, unreadable or does not parse.
ChatTemplate load_chat_template(const std::filesystem::path& model_dir, const std::filesystem::path& template_file,
                                const std::filesystem::path& tokenizer_config);

// One rendered conversation. `segments` partition `text` into runs that are all trained or all masked, each a whole
// number of tokens (checked: their token ids put together equal the whole text's).
struct ChatSample {
  struct Segment {
    std::string text;
    bool trained = false;
  };
  std::string text;                 // the rendered text, thought prefixes included
  std::vector<Segment> segments;    // concatenated: `text`
  std::vector<int32_t> ids;         // [n] tokens of `text`
  std::vector<uint8_t> trained;     // [n] 1: a target of the loss (before the shift to next-token labels)
  std::vector<std::string> images;  // image paths as written in the parts, in the order of their placeholders
  int64_t trained_tokens() const;
};

class ChatRenderer {
 public:
  // `tok` must outlive the renderer.
  ChatRenderer(ChatTemplate tmpl, const Tokenizer& tok, ChatOptions options);

  // Checks `conversation` ({"messages": [...], "tools": [...]?}) and renders it. Throws rf::Error "WHERE: FIELD:
  // why" for a conversation it refuses (no messages, a message without role or content, an unknown role, a part of
  // unknown type, an audio or video part, an image in an assistant message), for the template's own errors, and
  // when the labels cannot be derived (WHERE is e.g. "data.jsonl:12").
  ChatSample render(const nlohmann::ordered_json& conversation, const std::string& where) const;

  // The same with only the first `messages_kept` messages (data.chat.overlength = truncate cuts at turn_ends).
  ChatSample render_prefix(const nlohmann::ordered_json& conversation, size_t messages_kept,
                           const std::string& where) const;

  // Where a conversation may be cut with whole model turns kept: the message counts k such that messages[:k] ends
  // with an assistant message and messages[k] (if any) is not an assistant or tool message, ascending.
  static std::vector<size_t> turn_ends(const nlohmann::ordered_json& conversation);

  // The text of `messages` (+ `tools`, may be null) with the generation prompt, for generation.
  std::string render_prompt(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools) const;

 private:
  nlohmann::ordered_json variables(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                                   bool generation) const;
  ChatTemplate tmpl_;
  const Tokenizer& tok_;
  ChatOptions options_;
};

// Checks one conversation's shape (the rules of ChatRenderer::render) without rendering it; `folder`: what image
// paths are relative to (their files must exist). Throws rf::Error "WHERE: FIELD: why".
void check_conversation(const nlohmann::ordered_json& conversation, const std::string& where,
                        const std::filesystem::path& folder);

}  // namespace rf::text
