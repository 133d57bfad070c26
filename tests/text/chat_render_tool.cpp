// Test tool: conversations through text::ChatRenderer, one JSON line out per JSONL line in, for the Python oracles
// (tests/text/chat_labels.py).
//
//     chat_render_tool TEMPLATE CONVERSATIONS.jsonl TRAIN_ON THOUGHT_PREFIX(0|1) [TOKENIZER] [--thinking 0|1]
//
// Out: {"text", "segments": [[text, trained], ...], "ids", "trained"} or {"error": message}. Without TOKENIZER the
// ids are a byte tokenizer's (every UTF-8 byte one token, the Gemma 4 markup written in the text one token each), so
// the labels can be compared character by character whatever tokenizer.json reader exists.
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "core/error.h"
#include "text/conversation.h"

namespace {

using rf::text::Tokenizer;

class ByteTokenizer final : public Tokenizer {
 public:
  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int32_t> ids;
    for (size_t i = 0; i < text.size();) {
      bool special = false;
      for (size_t s = 0; s < kSpecial.size(); ++s)
        if (text.compare(i, kSpecial[s].size(), kSpecial[s]) == 0) {
          ids.push_back(256 + static_cast<int32_t>(s));
          i += kSpecial[s].size();
          special = true;
          break;
        }
      if (!special) ids.push_back(static_cast<unsigned char>(text[i++]));
    }
    return ids;
  }
  std::string decode(std::span<const int32_t> ids, bool) const override {
    std::string out;
    for (int32_t id : ids) out += id < 256 ? std::string(1, static_cast<char>(id)) : kSpecial[id - 256];
    return out;
  }
  std::optional<int32_t> token_to_id(std::string_view token) const override {
    for (size_t s = 0; s < kSpecial.size(); ++s)
      if (kSpecial[s] == token) return 256 + static_cast<int32_t>(s);
    return std::nullopt;
  }
  std::optional<std::string> id_to_token(int32_t id) const override { return decode(std::span(&id, 1), false); }
  int64_t vocab_size() const override { return 256 + static_cast<int64_t>(kSpecial.size()); }
  std::optional<int32_t> bos_id() const override { return std::nullopt; }
  std::optional<int32_t> eos_id() const override { return std::nullopt; }

 private:
  const std::vector<std::string> kSpecial = {"<bos>",      "<|turn>",          "<turn|>",          "<|channel>",
                                             "<channel|>", "<|tool_call>",     "<tool_call|>",     "<|tool>",
                                             "<tool|>",    "<|tool_response>", "<tool_response|>", "<|\"|>",
                                             "<|image|>",  "<|think|>"};
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::cerr << "usage: chat_render_tool TEMPLATE CONVERSATIONS.jsonl TRAIN_ON THOUGHT_PREFIX [TOKENIZER] "
                 "[--thinking 0|1]\n";
    return 2;
  }
  try {
    rf::text::ChatOptions options;
    const std::string train_on = argv[3];
    options.train_on = train_on == "all"              ? rf::text::TrainOn::All
                       : train_on == "last_assistant" ? rf::text::TrainOn::LastAssistant
                                                      : rf::text::TrainOn::Assistant;
    options.thought_prefix = std::string(argv[4]) == "1";
    std::string tokenizer_path;
    for (int a = 5; a < argc; ++a) {
      const std::string arg = argv[a];
      if (arg == "--thinking" && a + 1 < argc)
        options.enable_thinking = std::string(argv[++a]) == "1";
      else
        tokenizer_path = arg;
    }
    std::unique_ptr<Tokenizer> tok =
        tokenizer_path.empty() ? std::make_unique<ByteTokenizer>() : rf::text::load_tokenizer(tokenizer_path);
    rf::text::ChatTemplate tmpl = rf::text::load_chat_template("", argv[1], "");
    tmpl.special["bos_token"] = "<bos>";
    tmpl.special["eos_token"] = "<eos>";
    const rf::text::ChatRenderer renderer(std::move(tmpl), *tok, options);
    std::ifstream in(argv[2]);
    std::string line;
    int number = 0;
    while (std::getline(in, line)) {
      ++number;
      nlohmann::json out;
      try {
        const auto c = nlohmann::ordered_json::parse(line);
        const std::string where = std::string(argv[2]) + ":" + std::to_string(number);
        rf::text::check_conversation(c, where, std::filesystem::path(argv[2]).parent_path());
        const rf::text::ChatSample s = renderer.render(c, where);
        out["text"] = s.text;
        out["segments"] = nlohmann::json::array();
        for (const auto& seg : s.segments) out["segments"].push_back({seg.text, seg.trained});
        out["ids"] = s.ids;
        out["trained"] = s.trained;
        out["images"] = s.images;
      } catch (const rf::Error& e) {
        out["error"] = e.what();
      }
      std::cout << out.dump() << "\n";
    }
  } catch (const rf::Error& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
  return 0;
}
