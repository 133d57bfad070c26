// ringflex text: tokenizer.json (see tokenizer_json.h). Each step follows what the `tokenizers` library does for
// encode(text, add_special_tokens=False) and decode(ids, skip_special_tokens): added tokens split out of the raw
// text, then out of the normalized text, the pre-tokenizer's splits, the model on each word; decoding through the
// decoder chain. docs/text.md lists what is supported.
#include "text/tokenizer_json.h"

#include <algorithm>
#include <array>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <tuple>

#include "core/error.h"
#include "text/bpe.h"
#include "text/utf8.h"

namespace rf::text {
namespace {

using nlohmann::json;

// The fields of one JSON object, read with the file and path in every error; fields never asked for are refused
// by done(), so an option this reader does not know is never silently ignored.
class Fields {
 public:
  Fields(const json& object, std::string path, const std::string& origin)
      : object_(object), path_(std::move(path)), origin_(origin) {
    RF_CHECK(object.is_object(), origin_, ": ", path_, " is not a JSON object");
  }
  const json* get(const std::string& key) {
    seen_.insert(key);
    const auto it = object_.find(key);
    return it == object_.end() ? nullptr : &*it;
  }
  const json& need(const std::string& key) {
    const json* v = get(key);
    if (!v) fail(origin_, ": ", path_, " has no \"", key, "\"");
    return *v;
  }
  std::string string(const std::string& key) {
    const json& v = need(key);
    if (!v.is_string()) fail(origin_, ": ", at(key), " is not a string");
    return v.get<std::string>();
  }
  bool boolean(const std::string& key, bool fallback) {
    const json* v = get(key);
    if (!v || v->is_null()) return fallback;
    if (!v->is_boolean()) fail(origin_, ": ", at(key), " is not true or false");
    return v->get<bool>();
  }
  int64_t integer(const std::string& key) {
    const json& v = need(key);
    if (!v.is_number_integer()) fail(origin_, ": ", at(key), " is not an integer");
    return v.is_number_unsigned() && v.get<uint64_t>() > uint64_t{INT64_MAX} ? INT64_MAX : v.get<int64_t>();
  }
  // A {"String": s} pattern; a {"Regex": r} one is refused (no regex engine here matches Oniguruma's).
  std::string literal_pattern(const std::string& key) {
    const json& p = need(key);
    if (p.is_object() && p.size() == 1 && p.contains("String") && p["String"].is_string()) {
      const std::string s = p["String"].get<std::string>();
      if (s.empty()) fail(origin_, ": ", at(key), " is an empty string (not supported)");
      return s;
    }
    if (p.is_object() && p.contains("Regex"))
      fail(origin_, ": ", at(key), " is a Regex (not supported: only {\"String\": ...} patterns are)");
    fail(origin_, ": ", at(key), " is not a {\"String\": ...} pattern");
  }
  void refuse_unless(bool ok, const std::string& key, const std::string& why) {
    if (!ok) fail(origin_, ": ", at(key), " ", why);
  }
  std::string at(const std::string& key) const { return path_ + "." + key; }
  void done() const {
    for (const auto& [key, value] : object_.items())
      if (!seen_.count(key)) fail(origin_, ": ", at(key), " is not supported");
  }

 private:
  const json& object_;
  std::string path_;
  const std::string& origin_;
  std::set<std::string> seen_;
};

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct NormalizerStep {
  bool prepend = false;  // Prepend (content at the start of a non-empty string), else Replace pattern -> content
  std::string pattern, content;
};

struct DecoderStep {
  enum Kind { kReplace, kByteFallback, kFuse, kStrip } kind;
  std::string pattern, content;  // Replace
  char32_t strip = 0;            // Strip: remove up to `start` leading and `stop` trailing copies of this character
  int64_t start = 0, stop = 0;
};

struct AddedToken {
  std::string content;
  int32_t id;
  bool lstrip, rstrip, special;
};

// The added tokens of one pass as a byte trie, matched leftmost-longest as tokenizers' aho-corasick matcher does.
class Trie {
 public:
  Trie() : nodes_(1) {}
  void add(const std::string& content, int32_t token) {
    size_t node = 0;
    for (unsigned char b : content) {
      auto& next = nodes_[node].next;
      auto it = std::find_if(next.begin(), next.end(), [&](const auto& e) { return e.first == b; });
      if (it == next.end()) {
        next.emplace_back(b, static_cast<int32_t>(nodes_.size()));
        nodes_.emplace_back();
        node = nodes_.size() - 1;
      } else {
        node = static_cast<size_t>(it->second);
      }
    }
    nodes_[node].token = token;
    root_first_[static_cast<unsigned char>(content[0])] = true;
  }
  bool empty() const { return nodes_.size() == 1; }
  // The longest token starting at s[at]: (its index, its end), or index -1.
  std::pair<int32_t, size_t> longest_at(std::string_view s, size_t at) const {
    std::pair<int32_t, size_t> best{-1, at};
    if (!root_first_[static_cast<unsigned char>(s[at])]) return best;
    size_t node = 0;
    for (size_t i = at; i < s.size(); ++i) {
      const auto& next = nodes_[node].next;
      const auto b = static_cast<unsigned char>(s[i]);
      auto it = std::find_if(next.begin(), next.end(), [&](const auto& e) { return e.first == b; });
      if (it == next.end()) break;
      node = static_cast<size_t>(it->second);
      if (nodes_[node].token >= 0) best = {nodes_[node].token, i + 1};
    }
    return best;
  }

 private:
  struct Node {
    int32_t token = -1;
    std::vector<std::pair<unsigned char, int32_t>> next;
  };
  std::vector<Node> nodes_;
  std::array<bool, 256> root_first_{};
};

void replace_all(std::string& s, const std::string& pattern, const std::string& content) {
  if (s.find(pattern) == std::string::npos) return;
  std::string out;
  size_t at = 0;
  for (size_t hit; (hit = s.find(pattern, at)) != std::string::npos; at = hit + pattern.size()) {
    out.append(s, at, hit - at);
    out += content;
  }
  out.append(s, at);
  s = std::move(out);
}

// model.vocab and model.merges as the file lists them, read without a DOM: Gemma 4's 262,144 tokens and 514,906
// merges as nlohmann::json values cost ~0.4 s of a ~0.9 s load and twice the memory (BENCHMARKS.md, "Tokenizer").
struct VocabEntry {
  std::string token;
  int64_t id;  // kNotInteger when the file's value is not an integer
};
constexpr int64_t kNotInteger = INT64_MIN;
struct MergeEntry {
  std::string left, right;  // left alone holds the older "left right" form (joined)
  bool joined = false, bad = false;
};
struct ParsedFile {
  json rest;  // everything else, as a DOM
  std::optional<std::vector<VocabEntry>> vocab;
  std::optional<std::vector<MergeEntry>> merges;
};

// nlohmann's SAX events: a DOM built for everything but the entries of model.vocab and model.merges, which go
// straight into vectors.
class Reader : public nlohmann::json_sax<json> {
 public:
  Reader(ParsedFile& out, const std::string& origin) : out_(out), origin_(origin) {}
  bool null() override { return value(json()); }
  bool boolean(bool b) override { return value(json(b)); }
  bool number_integer(number_integer_t n) override { return number(n, json(n)); }
  bool number_unsigned(number_unsigned_t n) override {
    return number(static_cast<int64_t>(std::min<uint64_t>(n, INT64_MAX)), json(n));
  }
  bool number_float(number_float_t x, const string_t&) override { return value(json(x)); }
  bool string(string_t& s) override {
    if (mode_ == kMerges && nested_ == 0) {
      out_.merges->push_back({std::move(s), "", true, false});
      return true;
    }
    if (mode_ == kMerges && nested_ == 1) {
      MergeEntry& m = out_.merges->back();
      ++pair_size_;
      (pair_size_ == 1 ? m.left : m.right) = std::move(s);
      if (pair_size_ > 2) m.bad = true;
      return true;
    }
    return value(json(std::move(s)));
  }
  bool binary(binary_t&) override { return value(json()); }
  bool start_object(std::size_t) override { return open(json::object()); }
  bool start_array(std::size_t) override { return open(json::array()); }
  bool key(string_t& k) override {
    if (mode_ == kVocab && nested_ == 0)
      key_ = std::move(k);
    else if (mode_ == kNone)
      frames_.back().key = std::move(k);
    return true;
  }
  bool end_object() override { return close(); }
  bool end_array() override { return close(); }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    fail(origin_, ": not JSON: ", e.what());
  }

 private:
  enum Mode { kNone, kVocab, kMerges };
  struct Frame {
    json* container;
    std::string key;  // the key the next value goes under, in an object
  };
  bool in_model() const { return frames_.size() == 2 && frames_[0].key == "model"; }
  json& place(json v) {
    if (frames_.empty()) return out_.rest = std::move(v);
    json& top = *frames_.back().container;
    if (top.is_object()) return top[frames_.back().key] = std::move(v);
    top.push_back(std::move(v));
    return top.back();
  }
  bool number(int64_t n, json v) {
    if (mode_ == kVocab && nested_ == 0) {
      out_.vocab->push_back({std::move(key_), n});
      return true;
    }
    return value(std::move(v));
  }
  bool value(json v) {
    if (mode_ == kVocab) {
      if (nested_ == 0) out_.vocab->push_back({std::move(key_), kNotInteger});
      return true;
    }
    if (mode_ == kMerges) {
      if (nested_ == 0) out_.merges->push_back({"", "", false, true});
      if (nested_ == 1) out_.merges->back().bad = true;
      return true;
    }
    place(std::move(v));
    return true;
  }
  bool open(json v) {
    if (mode_ != kNone) {
      if (mode_ == kVocab && nested_ == 0) out_.vocab->push_back({std::move(key_), kNotInteger});
      if (mode_ == kMerges && nested_ == 0) out_.merges->push_back({"", "", false, false}), pair_size_ = 0;
      if (mode_ == kMerges && nested_ >= 1) out_.merges->back().bad = true;
      ++nested_;
      return true;
    }
    if (in_model() && frames_.back().key == "vocab" && v.is_object() && !out_.vocab) {
      out_.vocab.emplace();
      mode_ = kVocab;
      return true;
    }
    if (in_model() && frames_.back().key == "merges" && v.is_array() && !out_.merges) {
      out_.merges.emplace();
      mode_ = kMerges;
      return true;
    }
    frames_.push_back({&place(std::move(v)), ""});
    return true;
  }
  bool close() {
    if (mode_ != kNone) {
      if (nested_ == 0) {
        mode_ = kNone;
      } else {
        if (mode_ == kMerges && nested_ == 1 && pair_size_ != 2) out_.merges->back().bad = true;
        --nested_;
      }
      return true;
    }
    frames_.pop_back();
    return true;
  }
  ParsedFile& out_;
  const std::string& origin_;
  std::vector<Frame> frames_;
  Mode mode_ = kNone;
  int nested_ = 0;  // containers open inside model.vocab or model.merges
  int pair_size_ = 0;
  std::string key_;
};

class TokenizerJson final : public Tokenizer {
 public:
  TokenizerJson(ParsedFile& file, const std::string& origin);
  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(std::span<const int32_t> ids, bool skip_special) const override;
  std::optional<int32_t> token_to_id(std::string_view token) const override {
    for (const AddedToken& t : added_)
      if (t.content == token) return t.id;
    return bpe_->token_to_id(token);
  }
  std::optional<std::string> id_to_token(int32_t id) const override {
    const std::string* t = token_of(id);
    return t ? std::optional<std::string>(*t) : std::nullopt;
  }
  int64_t vocab_size() const override { return size_; }
  std::optional<int32_t> bos_id() const override { return bos_; }
  std::optional<int32_t> eos_id() const override { return eos_; }
  void set_bos_eos(std::optional<int32_t> bos, std::optional<int32_t> eos) { bos_ = bos, eos_ = eos; }

 private:
  void read_normalizer(const json& n, const std::string& path);
  void read_pre_tokenizer(const json& p, const std::string& path);
  void read_decoder(const json& d, const std::string& path);
  void read_model(const json& model, ParsedFile& file);
  void read_added_tokens(const json& a);
  const std::string* token_of(int32_t id) const {
    const auto it = added_by_id_.find(id);
    return it != added_by_id_.end() ? &added_[it->second].content : bpe_->id_to_token(id);
  }
  // tokenizers' AddedVocabulary::find_matches: pieces of `s`, each an added token's index or -1 for text between.
  void split_added(std::string_view s, const Trie& trie, std::vector<std::pair<int32_t, std::string_view>>& out) const;
  void encode_normalized(std::string_view piece, std::vector<int32_t>& ids) const;
  void pre_tokenize(std::string_view s, size_t step, std::vector<int32_t>& ids) const;

  std::string origin_;
  std::vector<NormalizerStep> normalizer_;
  std::vector<std::pair<std::string, SplitBehavior>> pre_tokenizer_;
  bool has_decoder_ = false;
  std::vector<DecoderStep> decoder_;
  std::unique_ptr<Bpe> bpe_;
  std::vector<AddedToken> added_;
  std::unordered_map<int32_t, size_t> added_by_id_;
  std::set<std::string, std::less<>> special_contents_;
  Trie raw_trie_, normalized_trie_;  // tokens with normalized = false, true
  int64_t size_ = 0;
  std::optional<int32_t> bos_, eos_;
};

TokenizerJson::TokenizerJson(ParsedFile& file, const std::string& origin) : origin_(origin) {
  Fields top(file.rest, "tokenizer", origin_);
  if (const json* v = top.get("version")) top.refuse_unless(v->is_string(), "version", "is not a string");
  for (const char* k : {"truncation", "padding"})
    if (const json* v = top.get(k))
      top.refuse_unless(v->is_null(), k, "is set (not supported: encode must not change)");
  read_model(top.need("model"), file);
  if (const json* v = top.get("normalizer"); v && !v->is_null()) read_normalizer(*v, "normalizer");
  if (const json* v = top.get("pre_tokenizer"); v && !v->is_null()) read_pre_tokenizer(*v, "pre_tokenizer");
  if (const json* v = top.get("post_processor"); v && !v->is_null()) {
    // Applied only with add_special_tokens=True, which encode() never asks for (tokenizer.h).
    Fields p(*v, "post_processor", origin_);
    const std::string type = p.string("type");
    p.refuse_unless(type == "TemplateProcessing", "type", "= '" + type + "' is not supported");
  }
  if (const json* v = top.get("decoder"); v && !v->is_null()) {
    has_decoder_ = true;
    read_decoder(*v, "decoder");
  }
  if (const json* v = top.get("added_tokens"); v && !v->is_null()) read_added_tokens(*v);
  top.done();
}

void TokenizerJson::read_model(const json& model, ParsedFile& file) {
  Fields f(model, "model", origin_);
  const std::string type = f.string("type");
  f.refuse_unless(type == "BPE", "type", "= '" + type + "' is not supported (only BPE is)");
  if (const json* v = f.get("dropout"); v && !v->is_null())
    f.refuse_unless(v->is_number() && v->get<double>() == 0.0, "dropout", "is set (not supported)");
  for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (const json* v = f.get(k); v && !v->is_null())
      f.refuse_unless(v->is_string() && v->get<std::string>().empty(), k, "is set (not supported)");
  f.refuse_unless(!f.boolean("ignore_merges", false), "ignore_merges", "is true (not supported)");
  BpeOptions options;
  if (const json* v = f.get("unk_token"); v && !v->is_null()) {
    f.refuse_unless(v->is_string(), "unk_token", "is not a string");
    options.unk_token = v->get<std::string>();
  }
  options.fuse_unk = f.boolean("fuse_unk", false);
  options.byte_fallback = f.boolean("byte_fallback", false);
  bpe_ = std::make_unique<Bpe>(options);
  // vocab and merges were read into `file` (Reader); in the DOM they are only there when not an object / a list.
  f.get("vocab");
  f.get("merges");
  if (!file.vocab) f.refuse_unless(!model.contains("vocab"), "vocab", "is not a JSON object");
  if (!file.vocab) fail(origin_, ": model has no \"vocab\"");
  if (!file.merges && model.contains("merges")) f.refuse_unless(model["merges"].is_null(), "merges", "is not a list");
  bpe_->reserve(file.vocab->size(), file.merges ? file.merges->size() : 0);
  for (VocabEntry& e : *file.vocab) {
    if (e.id == kNotInteger) fail(origin_, ": model.vocab: '", e.token, "' has an id that is not an integer");
    try {
      bpe_->add_token(std::move(e.token), e.id);
    } catch (const Error& err) {
      fail(origin_, ": model.vocab: ", err.what());
    }
  }
  file.vocab.reset();
  for (size_t i = 0; file.merges && i < file.merges->size(); ++i) {
    const MergeEntry& m = (*file.merges)[i];
    std::string_view left = m.left, right = m.right;
    if (m.bad) fail(origin_, ": model.merges[", i, "] is neither [left, right] nor \"left right\"");
    if (m.joined) {  // the older form "left right"
      const size_t space = m.left.find(' ');
      if (space == std::string::npos || m.left.find(' ', space + 1) != std::string::npos)
        fail(origin_, ": model.merges[", i, "] = '", m.left, "' is not two tokens separated by one space");
      left = std::string_view(m.left).substr(0, space);
      right = std::string_view(m.left).substr(space + 1);
    }
    if (left.empty() || right.empty()) fail(origin_, ": model.merges[", i, "] has an empty token");
    try {
      bpe_->add_merge(left, right);
    } catch (const Error& e) {
      fail(origin_, ": model.merges[", i, "]: ", e.what());
    }
  }
  file.merges.reset();
  try {
    bpe_->finish();
  } catch (const Error& e) {
    fail(origin_, ": model: ", e.what());
  }
  size_ = bpe_->size();
  f.done();
}

void TokenizerJson::read_normalizer(const json& n, const std::string& path) {
  Fields f(n, path, origin_);
  const std::string type = f.string("type");
  if (type == "Sequence") {
    const json& list = f.need("normalizers");
    f.refuse_unless(list.is_array(), "normalizers", "is not a list");
    for (size_t i = 0; i < list.size(); ++i) read_normalizer(list[i], concat(path, ".normalizers[", i, "]"));
  } else if (type == "Replace") {
    normalizer_.push_back({false, f.literal_pattern("pattern"), f.string("content")});
  } else if (type == "Prepend") {
    normalizer_.push_back({true, "", f.string("prepend")});
  } else {
    f.refuse_unless(false, "type", "= '" + type + "' is not supported (Replace, Prepend and Sequence are)");
  }
  f.done();
}

void TokenizerJson::read_pre_tokenizer(const json& p, const std::string& path) {
  Fields f(p, path, origin_);
  const std::string type = f.string("type");
  if (type == "Sequence") {
    const json& list = f.need("pretokenizers");
    f.refuse_unless(list.is_array(), "pretokenizers", "is not a list");
    for (size_t i = 0; i < list.size(); ++i) read_pre_tokenizer(list[i], concat(path, ".pretokenizers[", i, "]"));
  } else if (type == "Split") {
    std::string pattern = f.literal_pattern("pattern");
    const std::string behavior = f.string("behavior");
    static const std::pair<const char*, SplitBehavior> kBehaviors[] = {{"Removed", SplitBehavior::kRemoved},
                                                                       {"Isolated", SplitBehavior::kIsolated},
                                                                       {"MergedWithPrevious",
                                                                        SplitBehavior::kMergedWithPrevious},
                                                                       {"MergedWithNext",
                                                                        SplitBehavior::kMergedWithNext},
                                                                       {"Contiguous", SplitBehavior::kContiguous}};
    const auto it =
        std::find_if(std::begin(kBehaviors), std::end(kBehaviors), [&](const auto& b) { return behavior == b.first; });
    f.refuse_unless(it != std::end(kBehaviors), "behavior", "= '" + behavior + "' is not a Split behaviour");
    f.refuse_unless(!f.boolean("invert", false), "invert", "is true (not supported)");
    pre_tokenizer_.emplace_back(std::move(pattern), it->second);
  } else {
    f.refuse_unless(false, "type", "= '" + type + "' is not supported (Split on a string and Sequence are)");
  }
  f.done();
}

void TokenizerJson::read_decoder(const json& d, const std::string& path) {
  Fields f(d, path, origin_);
  const std::string type = f.string("type");
  if (type == "Sequence") {
    const json& list = f.need("decoders");
    f.refuse_unless(list.is_array(), "decoders", "is not a list");
    for (size_t i = 0; i < list.size(); ++i) read_decoder(list[i], concat(path, ".decoders[", i, "]"));
  } else if (type == "Replace") {
    DecoderStep s{DecoderStep::kReplace, f.literal_pattern("pattern"), f.string("content")};
    decoder_.push_back(std::move(s));
  } else if (type == "ByteFallback") {
    decoder_.push_back({DecoderStep::kByteFallback, "", ""});
  } else if (type == "Fuse") {
    decoder_.push_back({DecoderStep::kFuse, "", ""});
  } else if (type == "Strip") {
    const std::string content = f.string("content");
    const size_t n = content.empty() ? 0 : utf8_length_at(content, 0);
    f.refuse_unless(n != 0 && n == content.size(), "content", "is not one character");
    DecoderStep s{DecoderStep::kStrip, "", ""};
    s.strip = utf8_decode(content, 0, n);
    s.start = f.integer("start");
    s.stop = f.integer("stop");
    f.refuse_unless(s.start >= 0 && s.stop >= 0, "start", "or stop is negative");
    decoder_.push_back(std::move(s));
  } else {
    f.refuse_unless(false, "type",
                    "= '" + type + "' is not supported (Replace, ByteFallback, Fuse, Strip and Sequence are)");
  }
  f.done();
}

void TokenizerJson::read_added_tokens(const json& a) {
  RF_CHECK(a.is_array(), origin_, ": added_tokens is not a list");
  for (size_t i = 0; i < a.size(); ++i) {
    Fields f(a[i], concat("added_tokens[", i, "]"), origin_);
    AddedToken t;
    const int64_t id = f.integer("id");
    f.refuse_unless(id >= 0 && id < Bpe::kMaxIds, "id", concat("= ", id, " is outside [0, ", Bpe::kMaxIds, ")"));
    t.id = static_cast<int32_t>(id);
    t.content = f.string("content");
    f.refuse_unless(!t.content.empty(), "content", "is empty");
    f.refuse_unless(!f.boolean("single_word", false), "single_word", "is true (not supported)");
    t.lstrip = f.boolean("lstrip", false);
    t.rstrip = f.boolean("rstrip", false);
    t.special = f.boolean("special", false);
    const bool normalized = f.boolean("normalized", !t.special);
    f.done();
    f.refuse_unless(!added_by_id_.count(t.id), "id", concat("= ", id, " is given to an earlier added token too"));
    if (normalized) {
      std::string content = t.content;
      for (const NormalizerStep& s : normalizer_)
        s.prepend ? void(content.insert(0, s.content)) : replace_all(content, s.pattern, s.content);
      normalized_trie_.add(content, static_cast<int32_t>(added_.size()));
    } else {
      raw_trie_.add(t.content, static_cast<int32_t>(added_.size()));
    }
    if (t.special) special_contents_.insert(t.content);
    added_by_id_[t.id] = added_.size();
    size_ = std::max<int64_t>(size_, int64_t{t.id} + 1);
    added_.push_back(std::move(t));
  }
}

void TokenizerJson::split_added(std::string_view s, const Trie& trie,
                                std::vector<std::pair<int32_t, std::string_view>>& out) const {
  if (trie.empty()) {
    out.emplace_back(-1, s);
    return;
  }
  // The matches come first, found in `s` as it is (non-overlapping, leftmost-longest); stripping then widens each
  // one without taking a later match away, as in tokenizers, where the aho-corasick iterator runs ahead of the strips.
  std::vector<std::tuple<int32_t, size_t, size_t>> matches;
  for (size_t at = 0; at < s.size();) {
    const auto [token, end] = trie.longest_at(s, at);
    if (token < 0) {
      ++at;
    } else {
      matches.emplace_back(token, at, end);
      at = end;
    }
  }
  size_t done = 0;  // tokenizers' start_offset: the end of the last piece
  for (auto [token, start, stop] : matches) {
    const AddedToken& t = added_[static_cast<size_t>(token)];
    if (t.lstrip) {  // the whitespace before it, but not before the previous piece's end
      size_t keep = start;
      for (size_t i = start; i > 0;) {
        size_t j = i - 1;
        while (j > 0 && (static_cast<unsigned char>(s[j]) & 0xC0) == 0x80) --j;
        if (!is_unicode_whitespace(utf8_decode(s, j, i - j))) break;
        keep = i = j;
      }
      start = std::max(keep, done);
    }
    if (t.rstrip) {
      while (stop < s.size()) {
        const size_t n = utf8_length_at(s, stop);
        if (!is_unicode_whitespace(utf8_decode(s, stop, n))) break;
        stop += n;
      }
    }
    if (done < start) out.emplace_back(-1, s.substr(done, start - done));
    out.emplace_back(token, s.substr(start, stop - start));
    done = stop;
  }
  if (done < s.size()) out.emplace_back(-1, s.substr(done));
}

std::vector<int32_t> TokenizerJson::encode(std::string_view text) const {
  const size_t bad = utf8_first_invalid(text);
  RF_CHECK(bad == std::string_view::npos, "text is not valid UTF-8 (byte ", bad, " of ", text.size(),
           "); tokenizer.json tokenizes Unicode text");
  std::vector<int32_t> ids;
  std::vector<std::pair<int32_t, std::string_view>> raw;
  split_added(text, raw_trie_, raw);
  for (const auto& [token, piece] : raw) {
    if (token >= 0) {
      ids.push_back(added_[static_cast<size_t>(token)].id);
    } else if (!piece.empty()) {
      if (normalizer_.empty()) {
        encode_normalized(piece, ids);
        continue;
      }
      std::string normalized(piece);
      for (const NormalizerStep& s : normalizer_)
        if (s.prepend) {
          if (!normalized.empty()) normalized.insert(0, s.content);
        } else {
          replace_all(normalized, s.pattern, s.content);
        }
      encode_normalized(normalized, ids);
    }
  }
  return ids;
}

void TokenizerJson::encode_normalized(std::string_view piece, std::vector<int32_t>& ids) const {
  std::vector<std::pair<int32_t, std::string_view>> parts;
  split_added(piece, normalized_trie_, parts);
  for (const auto& [token, part] : parts) {
    if (token >= 0)
      ids.push_back(added_[static_cast<size_t>(token)].id);
    else if (!part.empty())
      pre_tokenize(part, 0, ids);
  }
}

// tokenizers' NormalizedString::split on a literal pattern with each SplitDelimiterBehavior, then the next step.
void TokenizerJson::pre_tokenize(std::string_view s, size_t step, std::vector<int32_t>& ids) const {
  if (step == pre_tokenizer_.size()) {
    bpe_->encode_word(s, ids);
    return;
  }
  const auto& [pattern, behavior] = pre_tokenizer_[step];
  std::vector<std::pair<size_t, size_t>> pieces;                  // [begin, end) of the pieces kept, in order
  std::vector<std::pair<std::pair<size_t, size_t>, bool>> spans;  // matches and the text between, in order
  size_t at = 0;
  for (size_t hit; (hit = s.find(pattern, at)) != std::string_view::npos; at = hit + pattern.size()) {
    if (hit > at) spans.push_back({{at, hit}, false});
    spans.push_back({{hit, hit + pattern.size()}, true});
  }
  if (at < s.size()) spans.push_back({{at, s.size()}, false});
  bool previous_match = false;
  switch (behavior) {
    case SplitBehavior::kRemoved:
      for (const auto& [span, match] : spans)
        if (!match) pieces.push_back(span);
      break;
    case SplitBehavior::kIsolated:
      for (const auto& [span, match] : spans) pieces.push_back(span);
      break;
    case SplitBehavior::kMergedWithPrevious:
      for (const auto& [span, match] : spans) {
        if (match && !previous_match && !pieces.empty())
          pieces.back().second = span.second;
        else
          pieces.push_back(span);
        previous_match = match;
      }
      break;
    case SplitBehavior::kMergedWithNext:
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->second && !previous_match && !pieces.empty())
          pieces.back().first = it->first.first;
        else
          pieces.push_back(it->first);
        previous_match = it->second;
      }
      std::reverse(pieces.begin(), pieces.end());
      break;
    case SplitBehavior::kContiguous:
      for (const auto& [span, match] : spans) {
        if (match == previous_match && !pieces.empty())
          pieces.back().second = span.second;
        else
          pieces.push_back(span);
        previous_match = match;
      }
      break;
  }
  for (const auto& [begin, end] : pieces)
    if (end > begin) pre_tokenize(s.substr(begin, end - begin), step + 1, ids);
}

std::string TokenizerJson::decode(std::span<const int32_t> ids, bool skip_special) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    const std::string* t = token_of(id);  // tokenizers drops an id it does not know
    if (t && !(skip_special && special_contents_.count(*t))) tokens.push_back(*t);
  }
  if (!has_decoder_) {
    std::string out;
    for (size_t i = 0; i < tokens.size(); ++i) out += (i ? " " : "") + tokens[i];
    return out;
  }
  for (const DecoderStep& step : decoder_) {
    switch (step.kind) {
      case DecoderStep::kReplace:
        for (std::string& t : tokens) replace_all(t, step.pattern, step.content);
        break;
      case DecoderStep::kFuse: {
        std::string all;
        for (const std::string& t : tokens) all += t;
        tokens.assign(1, std::move(all));
        break;
      }
      case DecoderStep::kStrip:
        for (std::string& t : tokens) {
          size_t begin = 0, end = t.size();
          for (int64_t k = 0; k < step.start && begin < end; ++k) {
            const size_t n = utf8_length_at(t, begin);
            if (n == 0 || utf8_decode(t, begin, n) != step.strip) break;
            begin += n;
          }
          for (int64_t k = 0; k < step.stop && end > begin; ++k) {
            size_t j = end - 1;
            while (j > begin && (static_cast<unsigned char>(t[j]) & 0xC0) == 0x80) --j;
            if (utf8_decode(t, j, end - j) != step.strip) break;
            end = j;
          }
          t = t.substr(begin, end - begin);
        }
        break;
      case DecoderStep::kByteFallback: {
        // "<0xXX>" (Rust's u8::from_str_radix over the two characters, so "+X" counts too) gathers bytes; a run
        // that is not UTF-8 becomes one U+FFFD per byte.
        const auto byte_of = [](const std::string& t) -> int {
          if (t.size() != 6 || t.compare(0, 3, "<0x") != 0 || t[5] != '>') return -1;
          const auto hex = [](char c) {
            return c >= '0' && c <= '9'   ? c - '0'
                   : c >= 'a' && c <= 'f' ? c - 'a' + 10
                   : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                          : -1;
          };
          if (t[3] == '+') return hex(t[4]);
          const int hi = hex(t[3]), lo = hex(t[4]);
          return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
        };
        std::vector<std::string> out;
        std::string bytes;
        size_t count = 0;
        const auto flush = [&] {
          if (count == 0) return;
          if (utf8_first_invalid(bytes) == std::string::npos)
            out.push_back(bytes);
          else
            for (size_t k = 0; k < count; ++k) out.emplace_back("\xEF\xBF\xBD");
          bytes.clear();
          count = 0;
        };
        for (std::string& t : tokens) {
          const int b = byte_of(t);
          if (b >= 0) {
            bytes += static_cast<char>(b);
            ++count;
          } else {
            flush();
            out.push_back(std::move(t));
          }
        }
        flush();
        tokens = std::move(out);
        break;
      }
    }
  }
  std::string out;
  for (const std::string& t : tokens) out += t;
  return out;
}

std::string read_file(const std::filesystem::path& file) {
  std::error_code ec;
  RF_CHECK(std::filesystem::is_regular_file(file, ec), file.string(), ": not a regular file");
  const auto bytes = std::filesystem::file_size(file, ec);
  constexpr uintmax_t kMaxBytes = uintmax_t{1} << 30;  // 32x Gemma 4's 32 MB file
  RF_CHECK(!ec && bytes <= kMaxBytes, file.string(), ": ", bytes, " bytes, more than the ", kMaxBytes,
           " a tokenizer file is read with");
  std::ifstream in(file, std::ios::binary);
  RF_CHECK(in, file.string(), ": cannot open");
  std::string text(static_cast<size_t>(bytes), '\0');
  in.read(text.data(), static_cast<std::streamsize>(bytes));
  RF_CHECK(in.gcount() == static_cast<std::streamsize>(bytes), file.string(), ": cannot read");
  return text;
}

json parse_json(std::string_view text, const std::string& origin) {
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    fail(origin, ": not JSON: ", e.what());
  }
}

// tokenizer_config.json's bos_token or eos_token: a string, {"content": string}, or absent/null.
std::optional<int32_t> named_token(const json& config, const char* key, const Tokenizer& tok,
                                   const std::string& origin) {
  const auto it = config.find(key);
  if (it == config.end() || it->is_null()) return std::nullopt;
  std::string content;
  if (it->is_string())
    content = it->get<std::string>();
  else if (it->is_object() && it->contains("content") && (*it)["content"].is_string())
    content = (*it)["content"].get<std::string>();
  else
    fail(origin, ": ", key, " is neither a string nor {\"content\": string}");
  const auto id = tok.token_to_id(content);
  RF_CHECK(id.has_value(), origin, ": ", key, " = '", content, "' is not a token of the tokenizer.json beside it");
  return id;
}

ParsedFile read_tokenizer_file(std::string_view text, const std::string& origin) {
  ParsedFile file;
  Reader reader(file, origin);
  json::sax_parse(text, &reader);
  return file;
}

}  // namespace

std::unique_ptr<Tokenizer> parse_tokenizer_json(std::string_view json_text, const std::string& origin) {
  ParsedFile file = read_tokenizer_file(json_text, origin);
  return std::make_unique<TokenizerJson>(file, origin);
}

std::unique_ptr<Tokenizer> load_tokenizer_json(const std::filesystem::path& file) {
  ParsedFile parsed = read_tokenizer_file(read_file(file), file.string());
  auto tok = std::make_unique<TokenizerJson>(parsed, file.string());
  const auto config_file = file.parent_path() / "tokenizer_config.json";
  std::error_code ec;
  if (std::filesystem::exists(config_file, ec)) {
    const std::string origin = config_file.string();
    const json config = parse_json(read_file(config_file), origin);
    RF_CHECK(config.is_object(), origin, ": is not a JSON object");
    tok->set_bos_eos(named_token(config, "bos_token", *tok, origin), named_token(config, "eos_token", *tok, origin));
  }
  return tok;
}

}  // namespace rf::text
