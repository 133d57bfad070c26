// ringflex text: conversations through the chat template, with their labels (see conversation.h and docs/text.md).
#include "text/conversation.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace rf::text {
namespace {

using json = nlohmann::ordered_json;

// The markup Gemma 4 templates write around turns, tool responses and images (docs/text.md).
constexpr std::string_view kTurnOpen = "<|turn>", kModelHeader = "<|turn>model\n", kTurnClose = "<turn|>";
constexpr std::string_view kResponseOpen = "<|tool_response>", kResponseClose = "<tool_response|>";
constexpr std::string_view kToolCallOpen = "<|tool_call>";
constexpr std::string_view kImage = "<|image|>", kChannelOpen = "<|channel>", kChannelClose = "<channel|>";
constexpr std::string_view kThoughtPrefix = "<|channel>thought\n<channel|>";
// Sentinels are private-use code points around a number: no template filter a Gemma 4 revision applies to content
// (trim, upper, the thought stripping) changes them, and the tokenizer never sees them.
constexpr std::string_view kSentinelOpen = "\xEE\x80\x80", kSentinelClose = "\xEE\x80\x81";  // U+E000, U+E001

const std::vector<std::string_view> kRoles = {"system", "developer", "user", "assistant", "tool"};

std::string read_file(const std::filesystem::path& p, const char* what) {
  std::error_code ec;
  RF_CHECK(std::filesystem::is_regular_file(p, ec), p.string(), ": not a readable file (", what, ")");
  std::ifstream in(p, std::ios::binary);
  RF_CHECK(in.good(), p.string(), ": cannot open (", what, ")");
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// Python's str.isspace() for the code point at s[i] (its UTF-8 length in `len`), as jinja2's `trim` strips.
bool python_space_at(std::string_view s, size_t i, size_t& len) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  if (i >= s.size()) return false;
  len = 1;
  const unsigned char c = b(i);
  if (c == ' ' || (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x1F)) return true;
  if (c == 0xC2 && i + 1 < s.size() && (b(i + 1) == 0x85 || b(i + 1) == 0xA0)) return len = 2, true;
  if (i + 2 >= s.size()) return false;
  len = 3;
  const uint32_t cp = ((c & 0x0Fu) << 12) | ((b(i + 1) & 0x3Fu) << 6) | (b(i + 2) & 0x3Fu);
  if ((c & 0xF0) != 0xE0) return false;
  return cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

std::string python_trim(std::string_view s) {
  size_t begin = 0, len = 0;
  while (python_space_at(s, begin, len)) begin += len;
  // From the end: step back over one UTF-8 code point at a time while it is a space.
  size_t end = s.size();
  while (end > begin) {
    size_t start = end - 1;
    while (start > begin && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
    if (!python_space_at(s, start, len) || start + len != end) break;
    end = start;
  }
  return std::string(s.substr(begin, end - begin));
}

// The Gemma 4 templates' strip_thinking: text outside <|channel>...<channel|> blocks, trimmed.
std::string strip_thinking(std::string_view s) {
  std::string out;
  size_t at = 0;
  while (true) {
    const size_t close = s.find(kChannelClose, at);
    const std::string_view part = s.substr(at, close == std::string_view::npos ? std::string_view::npos : close - at);
    const size_t open = part.find(kChannelOpen);
    out += part.substr(0, open);
    if (close == std::string_view::npos) break;
    at = close + kChannelClose.size();
  }
  return python_trim(out);
}

std::string sentinel(size_t i) { return std::string(kSentinelOpen) + std::to_string(i) + std::string(kSentinelClose); }

// A conversation with its user-written strings replaced by sentinels, and those strings in sentinel order. Strings
// that trim or strip_thinking empties stay (a template tests them for emptiness, which a sentinel would change).
struct Skeleton {
  json conversation;
  std::vector<std::string> originals;

  void hide(json& v) {
    if (!v.is_string()) return;
    const std::string& s = v.get_ref<const std::string&>();
    if (python_trim(s).empty() || strip_thinking(s).empty()) return;
    originals.push_back(s);
    v = sentinel(originals.size() - 1);
  }
  void hide_all(json& v) {  // every string value below v (tool call arguments)
    if (v.is_string()) return hide(v);
    if (v.is_structured())
      for (auto& item : v) hide_all(item);
  }
  void hide_descriptions(json& v) {  // tool declarations: only their prose, never names or types the template tests
    if (v.is_object()) {
      for (auto& [key, item] : v.items()) key == "description" ? hide(item) : hide_descriptions(item);
    } else if (v.is_array()) {
      for (auto& item : v) hide_descriptions(item);
    }
  }

  explicit Skeleton(const json& c) : conversation(c) {
    for (json& m : conversation["messages"]) {
      if (m.contains("content")) {
        json& content = m["content"];
        if (content.is_string()) hide(content);
        if (content.is_array())
          for (json& part : content)
            if (part.is_object() && part.contains("text")) hide(part["text"]);
      }
      for (const char* key : {"reasoning", "reasoning_content", "thinking"})
        if (m.contains(key)) hide(m[key]);
      if (m.contains("tool_calls") && m["tool_calls"].is_array())
        for (json& call : m["tool_calls"])
          if (call.is_object() && call.contains("function") && call["function"].is_object() &&
              call["function"].contains("arguments"))
            hide_all(call["function"]["arguments"]);
    }
    if (conversation.contains("tools")) hide_descriptions(conversation["tools"]);
  }
};

// The messages as transformers hands them to the template: keys whose value is null dropped, and a message with a
// reasoning field ("reasoning_content", "thinking" or "reasoning", the first set) carrying it as `thinking` (first)
// and `reasoning_content` (last) too, so templates that read either name see it.
json as_transformers_passes(const json& messages) {
  json out = json::array();
  for (const json& m : messages) {
    json n = json::object();
    json reasoning;
    for (const char* key : {"reasoning_content", "thinking", "reasoning"})
      if (reasoning.is_null() && m.contains(key) && !m[key].is_null()) reasoning = m[key];
    if (!reasoning.is_null()) n["thinking"] = reasoning;
    for (const auto& [key, value] : m.items())
      if (!value.is_null()) n[key] = value;
    if (!reasoning.is_null()) n["reasoning_content"] = reasoning;
    out.push_back(std::move(n));
  }
  return out;
}

bool starts_at(std::string_view s, size_t at, std::string_view what) { return s.compare(at, what.size(), what) == 0; }

// What each byte of the skeleton's rendering is, read from the template's own markup (sentinels are opaque).
enum class Kind : uint8_t { Masked, Model, Image };
struct Structure {
  std::vector<Kind> kind;        // [bytes]
  std::vector<int> turn;         // [bytes] the model turn a Model byte belongs to, 0, 1, ...
  std::vector<size_t> headers;   // offsets just after each model turn's header, in turn order
  std::vector<bool> has_prefix;  // per model turn: the template already opened a channel after the header
  int turns = 0;
};

Structure read_structure(std::string_view k) {
  Structure s;
  s.kind.assign(k.size(), Kind::Masked);
  s.turn.assign(k.size(), -1);
  bool in_model = false;
  // Just after a model turn's `<turn|>` (or its closing `<|tool_response>`): revisions that join consecutive
  // assistant messages into one turn may write the next message there without a header (the first revision does);
  // it is still the model's.
  bool after_close = false;
  const auto mark = [&](size_t from, size_t n, Kind kind) {
    for (size_t b = from; b < from + n; ++b) {
      s.kind[b] = kind;
      s.turn[b] = kind == Kind::Model ? s.turns - 1 : -1;
    }
  };
  size_t i = 0;
  while (i < k.size()) {
    if (after_close && k[i] != '\n' && !starts_at(k, i, kTurnOpen)) in_model = true;
    if (k[i] != '\n') after_close = false;
    if (starts_at(k, i, kModelHeader)) {  // the header itself is never a target
      i += kModelHeader.size();
      in_model = true;
      ++s.turns;
      s.headers.push_back(i);
      s.has_prefix.push_back(starts_at(k, i, kChannelOpen));
    } else if (starts_at(k, i, kTurnOpen)) {
      in_model = false;
      i += kTurnOpen.size();
    } else if (starts_at(k, i, kImage)) {
      mark(i, kImage.size(), Kind::Image);
      i += kImage.size();
    } else if (!in_model) {
      ++i;
    } else if (starts_at(k, i, kTurnClose)) {  // the turn's end is a target: the model must learn to stop
      mark(i, kTurnClose.size(), Kind::Model);
      i += kTurnClose.size();
      in_model = false;
      after_close = true;
    } else if (starts_at(k, i, kResponseOpen)) {
      // A tool's response is input, masked whole; an opener with no response after it in this turn ends a turn that
      // closes on its tool calls, and is its stop token (a target, as `<turn|>`).
      // A block holds neither a turn's markup nor a tool call nor another response: a close found after one of
      // those belongs to a later block, and this opener stands alone.
      const size_t close = k.find(kResponseClose, i);
      const size_t next = i + kResponseOpen.size();
      const size_t block_end = std::min(
          {k.find(kTurnClose, i), k.find(kTurnOpen, i), k.find(kToolCallOpen, i), k.find(kResponseOpen, next)});
      if (close != std::string_view::npos && close < block_end) {
        i = close + kResponseClose.size();
      } else {
        mark(i, kResponseOpen.size(), Kind::Model);
        i += kResponseOpen.size();
        in_model = false;
        after_close = true;
      }
    } else {
      mark(i, 1, Kind::Model);
      ++i;
    }
  }
  return s;
}

void check_no_sentinel(const std::string& s, const std::string& where, const std::string& field) {
  RF_CHECK(s.find(kSentinelOpen) == std::string::npos && s.find(kSentinelClose) == std::string::npos, where, ": ",
           field, ": contains U+E000 or U+E001, which ringflex reserves to derive labels");
}

void check_strings(const json& v, const std::string& where, const std::string& field) {
  if (v.is_string()) return check_no_sentinel(v.get_ref<const std::string&>(), where, field);
  if (v.is_object())
    for (const auto& [key, item] : v.items()) check_strings(item, where, field + "." + key);
  if (v.is_array())
    for (size_t i = 0; i < v.size(); ++i) check_strings(v[i], where, field + "[" + std::to_string(i) + "]");
}

std::string special_token_text(const json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return {};
}

}  // namespace

std::string_view name_of(TrainOn t) {
  switch (t) {
    case TrainOn::Assistant:
      return "assistant";
    case TrainOn::LastAssistant:
      return "last_assistant";
    case TrainOn::All:
      return "all";
  }
  return "?";
}

int64_t ChatSample::trained_tokens() const { return std::count(trained.begin(), trained.end(), uint8_t{1}); }

ChatTemplate load_chat_template(const std::filesystem::path& model_dir, const std::filesystem::path& template_file,
                                const std::filesystem::path& config_path) {
  json config;
  std::error_code ec;
  const bool has_config = !config_path.empty() && std::filesystem::is_regular_file(config_path, ec);
  if (has_config) {
    try {
      config = json::parse(read_file(config_path, "the tokenizer's config"));
    } catch (const json::exception& e) {
      rf::fail(config_path.string(), ": not valid JSON: ", e.what());
    }
    RF_CHECK(config.is_object(), config_path.string(), ": must be a JSON object");
  }
  std::string source, origin;
  const std::filesystem::path beside = model_dir / "chat_template.jinja";
  if (!template_file.empty()) {
    origin = template_file.string();
    source = read_file(template_file, "data.chat_template");
  } else if (!model_dir.empty() && std::filesystem::is_regular_file(beside, ec)) {
    origin = beside.string();
    source = read_file(beside, "the checkpoint's chat template");
  } else {
    RF_CHECK(has_config && config.contains("chat_template") && config["chat_template"].is_string(),
             model_dir.empty() ? config_path.string() : model_dir.string(),
             ": no chat template (neither chat_template.jinja nor tokenizer_config.json's ",
             "`chat_template` string; a base checkpoint has none): name one with data.chat_template");
    origin = config_path.string() + ": chat_template";
    source = config["chat_template"].get<std::string>();
  }
  ChatTemplate t{Template::parse(std::move(source), origin), origin, json::object()};
  if (has_config)
    for (const auto& [key, value] : config.items())
      if (key.size() > 6 && key.ends_with("_token") && !special_token_text(value).empty())
        t.special[key] = special_token_text(value);
  return t;
}

void check_conversation(const json& c, const std::string& where, const std::filesystem::path& folder) {
  RF_CHECK(c.is_object(), where, ": each line must be a JSON object with `messages`");
  RF_CHECK(c.contains("messages"), where, ": no `messages`");
  const json& messages = c["messages"];
  RF_CHECK(messages.is_array(), where, ": `messages` must be a list");
  RF_CHECK(!messages.empty(), where, ": `messages` is empty (an empty conversation)");
  if (c.contains("tools")) RF_CHECK(c["tools"].is_array() || c["tools"].is_null(), where, ": `tools` must be a list");
  check_strings(c, where, "conversation");
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string field = "messages[" + std::to_string(i) + "]";
    const json& m = messages[i];
    RF_CHECK(m.is_object(), where, ": ", field, " must be an object with `role` and `content`");
    RF_CHECK(m.contains("role"), where, ": ", field, ": no `role`");
    RF_CHECK(m["role"].is_string(), where, ": ", field, ".role must be a string");
    const std::string role = m["role"].get<std::string>();
    RF_CHECK(std::find(kRoles.begin(), kRoles.end(), role) != kRoles.end(), where, ": ", field, ".role = '", role,
             "' is not system, developer, user, assistant or tool");
    const bool calls = m.contains("tool_calls") && !m["tool_calls"].is_null();
    if (calls)
      RF_CHECK(role == "assistant" && m["tool_calls"].is_array(), where, ": ", field,
               ".tool_calls must be a list, on an assistant message");
    const bool has_content = m.contains("content") && !m["content"].is_null();
    RF_CHECK(has_content || calls, where, ": ", field, ": no `content`");
    if (!has_content) continue;
    const json& content = m["content"];
    if (content.is_string()) continue;
    RF_CHECK(content.is_array(), where, ": ", field, ".content must be a string or a list of parts");
    for (size_t j = 0; j < content.size(); ++j) {
      const std::string pf = field + ".content[" + std::to_string(j) + "]";
      const json& part = content[j];
      RF_CHECK(part.is_object() && part.contains("type") && part["type"].is_string(), where, ": ", pf,
               " must be an object with a `type`");
      const std::string type = part["type"].get<std::string>();
      if (type == "text") {
        RF_CHECK(part.contains("text") && part["text"].is_string(), where, ": ", pf, ".text must be a string");
      } else if (type == "image") {
        RF_CHECK(role != "assistant", where, ": ", pf, ": an image in an assistant message (images are input: put ",
                 "them in user, system or tool messages)");
        RF_CHECK(part.contains("path") && part["path"].is_string() && !part["path"].get<std::string>().empty(), where,
                 ": ", pf, ".path must be an image file name (relative to the JSONL file)");
        const std::filesystem::path given(part["path"].get<std::string>());
        const std::filesystem::path path = given.is_absolute() ? given : folder / given;
        std::error_code ec;
        RF_CHECK(std::filesystem::is_regular_file(path, ec), where, ": ", pf, ".path: ", path.string(),
                 ": no such image file");
      } else if (type == "audio" || type == "input_audio" || type == "video") {
        rf::fail(where, ": ", pf, ": ", type, " parts are not supported (ringflex has no ",
                 type == "video" ? "video" : "audio", " tower yet)");
      } else {
        rf::fail(where, ": ", pf, ".type = '", type, "' is not text or image");
      }
    }
  }
}

ChatRenderer::ChatRenderer(ChatTemplate tmpl, const Tokenizer& tok, ChatOptions options)
    : tmpl_(std::move(tmpl)), tok_(tok), options_(options) {}

json ChatRenderer::variables(const json& messages, const json& tools, bool generation) const {
  json v = tmpl_.special;
  v["messages"] = messages;
  v["tools"] = tools;
  v["add_generation_prompt"] = generation;
  if (options_.enable_thinking) v["enable_thinking"] = *options_.enable_thinking;
  return v;
}

std::string ChatRenderer::render_prompt(const json& messages, const json& tools) const {
  return tmpl_.engine.render(variables(as_transformers_passes(messages), tools, true));
}

std::vector<size_t> ChatRenderer::turn_ends(const json& c) {
  const json& m = c["messages"];
  std::vector<size_t> ends;
  for (size_t k = 1; k <= m.size(); ++k) {
    if (m[k - 1]["role"] != "assistant") continue;
    if (k < m.size() && (m[k]["role"] == "assistant" || m[k]["role"] == "tool")) continue;
    ends.push_back(k);
  }
  return ends;
}

ChatSample ChatRenderer::render_prefix(const json& c, size_t messages_kept, const std::string& where) const {
  json cut = c;
  cut["messages"].erase(cut["messages"].begin() + static_cast<std::ptrdiff_t>(messages_kept), cut["messages"].end());
  return render(cut, where);
}

ChatSample ChatRenderer::render(const json& given, const std::string& where) const {
  json c = given;
  c["messages"] = as_transformers_passes(given["messages"]);
  const json tools = c.contains("tools") ? c["tools"] : json();
  const auto run = [&](const json& messages, const json& tool_list) {
    try {
      return tmpl_.engine.render(variables(messages, tool_list, false));
    } catch (const rf::Error& e) {
      rf::fail(where, ": ", tmpl_.origin, ": ", e.what());
    }
  };
  const std::string real = run(c["messages"], tools);
  Skeleton skeleton(c);
  const std::string k = run(skeleton.conversation["messages"],
                            skeleton.conversation.contains("tools") ? skeleton.conversation["tools"] : json());
  const Structure s = read_structure(k);
  int trained_turn = -1;  // TrainOn::LastAssistant: the only model turn trained
  if (options_.train_on == TrainOn::LastAssistant) trained_turn = s.turns - 1;
  const auto trained = [&](size_t b) {
    if (s.kind[b] == Kind::Image) return false;
    if (options_.train_on == TrainOn::All) return true;
    return s.kind[b] == Kind::Model && (trained_turn < 0 || s.turn[b] == trained_turn);
  };
  // The thought prefix goes after the header of each model turn that has targets, unless the template opened a
  // channel there itself.
  std::vector<size_t> inserts;
  for (int t = 0; t < s.turns; ++t)
    if (options_.thought_prefix && !s.has_prefix[t] && (trained_turn < 0 || t == trained_turn))
      inserts.push_back(s.headers[t]);

  ChatSample out;
  const auto emit = [&](std::string_view text, bool target) {
    if (text.empty()) return;
    if (out.segments.empty() || out.segments.back().trained != target) out.segments.push_back({"", target});
    out.segments.back().text += text;
  };
  // Walk the skeleton's rendering: template text is copied from the real rendering (checked equal), each sentinel
  // becomes the original string as the template transformed it (as written, trimmed, or with thinking stripped: the
  // transforms Gemma 4 revisions apply), chosen so that the template text after it follows in the real rendering.
  const auto fail_align = [&](size_t at) {
    rf::fail(where, ": cannot map ", tmpl_.origin, "'s output back to the messages (byte ", at,
             " of the rendered text): the template changes content in a way ringflex does not model");
  };
  size_t r = 0, next_insert = 0, b = 0;
  while (b < k.size()) {
    const size_t open = k.find(kSentinelOpen, b);
    const size_t text_end = open == std::string::npos ? k.size() : open;
    for (; b < text_end; ++b) {  // template text, byte by byte (its class can change anywhere)
      if (next_insert < inserts.size() && inserts[next_insert] == b) emit(kThoughtPrefix, false), ++next_insert;
      if (r >= real.size() || real[r] != k[b]) fail_align(r);
      emit(std::string_view(&k[b], 1), trained(b));
      ++r;
    }
    if (next_insert < inserts.size() && inserts[next_insert] == b) emit(kThoughtPrefix, false), ++next_insert;
    if (open == std::string::npos) break;
    const size_t close = k.find(kSentinelClose, open);
    RF_ASSERT(close != std::string::npos);
    const size_t id = std::stoul(k.substr(open + kSentinelOpen.size(), close - open - kSentinelOpen.size()));
    RF_ASSERT(id < skeleton.originals.size());
    b = close + kSentinelClose.size();
    const size_t after_end = std::min(k.find(kSentinelOpen, b), k.size());
    const std::string_view after = std::string_view(k).substr(b, after_end - b);
    const std::string& original = skeleton.originals[id];
    bool matched = false;
    for (const std::string& candidate : {original, python_trim(original), strip_thinking(original)}) {
      if (!starts_at(real, r, candidate) || !starts_at(real, r + candidate.size(), after)) continue;
      emit(candidate, trained(open));
      r += candidate.size();
      matched = true;
      break;
    }
    if (!matched) fail_align(r);
  }
  if (r != real.size()) fail_align(r);

  for (const auto& seg : out.segments) {
    out.text += seg.text;
    const std::vector<int32_t> ids = tok_.encode(seg.text);
    out.ids.insert(out.ids.end(), ids.begin(), ids.end());
    out.trained.insert(out.trained.end(), ids.size(), seg.trained ? 1 : 0);
  }
  // Segments tokenized apart must give the whole text's tokens, or a label boundary would fall inside a token.
  RF_CHECK(tok_.encode(out.text) == out.ids, where, ": a boundary between trained and masked text falls inside a ",
           "token (", tmpl_.origin, " and this tokenizer do not separate turns at token boundaries)");
  for (const json& m : c["messages"])
    if (m.contains("content") && m["content"].is_array())
      for (const json& part : m["content"])
        if (part["type"] == "image") out.images.push_back(part["path"].get<std::string>());
  return out;
}

}  // namespace rf::text
