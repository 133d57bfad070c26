// rf::text's tokenizer.json reader on files small enough to work out by hand: merges by rank, byte fallback, unk,
// added tokens inside text, decoding; hostile files refused with one line naming the field; load_tokenizer's choice
// of file. The `tokenizers` library itself is the oracle in tokenizer_oracle.py.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "common/error_of.h"
#include "core/error.h"
#include "text/tokenizer.h"
#include "text/tokenizer_json.h"

namespace {

using nlohmann::json;
namespace fs = std::filesystem;

// Gemma 4's layout in miniature. Merges: a+b (rank 0), b+c (1), ab+c (2), ▁+a (3).
json tiny() {
  return json::parse(R"({
    "version": "1.0", "truncation": null, "padding": null,
    "added_tokens": [
      {"id": 0, "content": "<unk>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
      {"id": 20, "content": "<t>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
      {"id": 21, "content": "<tt>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": false}
    ],
    "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
    "pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": false},
    "post_processor": null,
    "decoder": {"type": "Sequence", "decoders": [
      {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"}]},
    "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
              "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
              "vocab": {"<unk>": 0, "a": 1, "b": 2, "c": 3, "ab": 4, "bc": 5, "abc": 6, "\u2581": 7, "\u2581a": 8,
                        "<0xC3>": 9, "<0xA9>": 10, "<0xE2>": 11, "\n": 12},
              "merges": [["a", "b"], ["b", "c"], ["ab", "c"], ["\u2581", "a"]]}})");
}

std::vector<int32_t> ids(std::initializer_list<int32_t> v) { return v; }

TEST(TokenizerJson, MergesByRankByteFallbackAndUnk) {
  const auto tok = rf::text::parse_tokenizer_json(tiny().dump(), "tiny.json");
  EXPECT_EQ(tok->encode("abc"), ids({6}));           // a+b first (rank 0 beats b+c), then ab+c
  EXPECT_EQ(tok->encode("bca"), ids({5, 1}));        // b+c; bc+a is no merge
  EXPECT_EQ(tok->encode("aab"), ids({1, 4}));        // a+a is no merge: a, then ab
  EXPECT_EQ(tok->encode(" a b"), ids({8, 7, 2}));    // spaces become ▁, ▁+a merges, ▁ b stays apart
  EXPECT_EQ(tok->encode("\xC3\xA9"), ids({9, 10}));  // é has no token: its bytes' tokens
  // € (E2 82 AC): <0x82> and <0xAC> are missing, so unk; two in a row fuse into one unk (fuse_unk).
  EXPECT_EQ(tok->encode("\xE2\x82\xAC\xE2\x82\xAC"
                        "a"),
            ids({0, 1}));
  EXPECT_EQ(tok->encode(""), ids({}));
  EXPECT_EQ(tok->encode("a\nb"), ids({1, 12, 2}));
}

TEST(TokenizerJson, AddedTokensMatchedWholeInsideText) {
  const auto tok = rf::text::parse_tokenizer_json(tiny().dump(), "tiny.json");
  EXPECT_EQ(tok->encode("ab<t>c"), ids({4, 20, 3}));
  EXPECT_EQ(tok->encode("<tt><t>"), ids({21, 20}));  // the longest token at a place wins
  EXPECT_EQ(tok->encode("a<t"), ids({1, 0}));        // '<' and 't' have no token and no byte token: one fused unk
  EXPECT_EQ(tok->token_to_id("<t>"), 20);
  EXPECT_EQ(tok->token_to_id("ab"), 4);
  EXPECT_EQ(tok->token_to_id("zz"), std::nullopt);
  EXPECT_EQ(tok->id_to_token(21), "<tt>");
  EXPECT_EQ(tok->vocab_size(), 22);
}

TEST(TokenizerJson, DecodesThroughTheDecoderChain) {
  const auto tok = rf::text::parse_tokenizer_json(tiny().dump(), "tiny.json");
  EXPECT_EQ(tok->decode(ids({8, 7, 2})), " a b");
  EXPECT_EQ(tok->decode(ids({4, 20, 3})), "ab<t>c");
  EXPECT_EQ(tok->decode(ids({4, 20, 21, 3}), true), "ab<tt>c");  // only special tokens are skipped
  EXPECT_EQ(tok->decode(ids({9, 10})), "\xC3\xA9");
  EXPECT_EQ(tok->decode(ids({9, 1})),
            "\xEF\xBF\xBD"
            "a");                                  // a lone byte is not UTF-8: U+FFFD
  EXPECT_EQ(tok->decode(ids({1, 999, 2})), "ab");  // an unknown id is dropped, as tokenizers does
  for (const char* text : {"abc bca", " a\nb", "\xC3\xA9 ab<t>c"}) EXPECT_EQ(tok->decode(tok->encode(text)), text);
}

TEST(TokenizerJson, InvalidUtf8IsRefused) {
  const auto tok = rf::text::parse_tokenizer_json(tiny().dump(), "tiny.json");
  EXPECT_EQ(rf::testing::error_of([&] { tok->encode("ab\xFF"); }),
            "text is not valid UTF-8 (byte 2 of 3); tokenizer.json tokenizes Unicode text");
  EXPECT_NE(rf::testing::error_of([&] { tok->encode("\xED\xA0\x80"); }).find("not valid UTF-8 (byte 0"),
            std::string::npos);  // a surrogate
}

std::string error_for(const std::function<void(json&)>& edit) {
  json j = tiny();
  edit(j);
  return rf::testing::error_of([&] { rf::text::parse_tokenizer_json(j.dump(), "bad.json"); });
}

TEST(TokenizerJson, HostileFilesNameTheField) {
  EXPECT_EQ(rf::testing::error_of([] {
              rf::text::parse_tokenizer_json(tiny().dump().substr(0, 200), "cut.json");
            }).rfind("cut.json: not JSON: ", 0),
            0u);
  EXPECT_EQ(error_for([](json& j) {
              j["model"]["merges"].push_back({"a", "zz"});
            }),
            "bad.json: model.merges[4]: 'zz' is not in model.vocab");
  EXPECT_EQ(error_for([](json& j) {
              j["model"]["merges"].push_back({"c", "c"});
            }),
            "bad.json: model.merges[4]: the merged token 'cc' is not in model.vocab");
  EXPECT_EQ(error_for([](json& j) { j["model"]["vocab"]["d"] = 3; }),
            "bad.json: model.vocab: id 3 is given to both 'c' and 'd'");
  EXPECT_EQ(error_for([](json& j) { j["model"]["vocab"]["d"] = 4000000000; }),
            "bad.json: model.vocab: 'd' has id 4000000000, outside [0, 16777216)");
  EXPECT_EQ(error_for([](json& j) { j["added_tokens"][1]["id"] = -1; }),
            "bad.json: added_tokens[1].id = -1 is outside [0, 16777216)");
  EXPECT_EQ(error_for([](json& j) {
              j["normalizer"] = {{"type", "NFKC"}};
            }),
            "bad.json: normalizer.type = 'NFKC' is not supported (Replace, Prepend and Sequence are)");
  EXPECT_EQ(error_for([](json& j) {
              j["pre_tokenizer"]["pattern"] = {{"Regex", "\\s+"}};
            }),
            "bad.json: pre_tokenizer.pattern is a Regex (not supported: only {\"String\": ...} patterns are)");
  EXPECT_EQ(error_for([](json& j) {
              j["pre_tokenizer"] = {{"type", "Metaspace"}};
            }),
            "bad.json: pre_tokenizer.type = 'Metaspace' is not supported (Split on a string and Sequence are)");
  EXPECT_EQ(error_for([](json& j) { j["model"]["type"] = "WordPiece"; }),
            "bad.json: model.type = 'WordPiece' is not supported (only BPE is)");
  EXPECT_EQ(error_for([](json& j) { j["model"]["dropout"] = 0.1; }), "bad.json: model.dropout is set (not supported)");
  EXPECT_EQ(error_for([](json& j) { j["added_tokens"][1]["single_word"] = true; }),
            "bad.json: added_tokens[1].single_word is true (not supported)");
  EXPECT_EQ(error_for([](json& j) { j["decoder"]["decoders"][0]["type"] = "Metaspace"; }),
            "bad.json: decoder.decoders[0].type = 'Metaspace' is not supported (Replace, ByteFallback, Fuse, Strip "
            "and Sequence are)");
  EXPECT_EQ(error_for([](json& j) {
              j["truncation"] = {{"max_length", 8}};
            }),
            "bad.json: tokenizer.truncation is set (not supported: encode must not change)");
  EXPECT_EQ(error_for([](json& j) { j["model"]["new_option"] = true; }), "bad.json: model.new_option is not supported");
  // model.vocab and model.merges are read without a DOM: every shape they can take is still checked.
  EXPECT_EQ(error_for([](json& j) { j["model"]["vocab"] = json::array(); }),
            "bad.json: model.vocab is not a JSON object");
  EXPECT_EQ(error_for([](json& j) { j["model"].erase("vocab"); }), "bad.json: model has no \"vocab\"");
  EXPECT_EQ(error_for([](json& j) { j["model"]["vocab"]["d"] = "7"; }),
            "bad.json: model.vocab: 'd' has an id that is not an integer");
  EXPECT_EQ(error_for([](json& j) {
              j["model"]["vocab"]["d"] = {{"id", 7}};
            }),
            "bad.json: model.vocab: 'd' has an id that is not an integer");
  EXPECT_EQ(error_for([](json& j) {
              j["model"]["merges"] = {{"a", "b"}, {"b"}};
            }),
            "bad.json: model.merges[1] is neither [left, right] nor \"left right\"");
  EXPECT_EQ(error_for([](json& j) {
              j["model"]["merges"] = {{"a", "b", "c"}};
            }),
            "bad.json: model.merges[0] is neither [left, right] nor \"left right\"");
  EXPECT_EQ(error_for([](json& j) {
              j["model"]["merges"] = json::array({json::array({"a", json::array({"b"})})});
            }),
            "bad.json: model.merges[0] is neither [left, right] nor \"left right\"");
  EXPECT_EQ(error_for([](json& j) { j["model"]["merges"] = {7}; }),
            "bad.json: model.merges[0] is neither [left, right] nor \"left right\"");
  EXPECT_EQ(error_for([](json& j) { j["model"]["merges"] = {"a b c"}; }),
            "bad.json: model.merges[0] = 'a b c' is not two tokens separated by one space");
  EXPECT_EQ(error_for([](json& j) { j["model"]["merges"] = "a b"; }), "bad.json: model.merges is not a list");
  EXPECT_EQ(error_for([](json& j) { j["model"]["merges"] = {"a b", "b c", "ab c"}; }), "");  // the older form
  EXPECT_EQ(error_for([](json& j) { j["model"]["unk_token"] = "<nope>"; }),
            "bad.json: model: unk_token '<nope>' is not in model.vocab");
}

// A folder with both files reads tokenizer.json, with bos and eos from tokenizer_config.json.
TEST(LoadTokenizer, PrefersTokenizerJsonAndReadsBosEos) {
  const fs::path dir = fs::temp_directory_path() / "rf_text_load_tokenizer";
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream(dir / "tokenizer.json") << tiny().dump();
  std::ofstream(dir / "tokenizer.model") << "not a SentencePiece model";
  std::ofstream(dir / "tokenizer_config.json") << R"({"bos_token": "<t>", "eos_token": {"content": "<tt>"}})";
  const auto tok = rf::text::load_tokenizer(dir);
  EXPECT_EQ(tok->encode("abc"), ids({6}));
  EXPECT_EQ(tok->bos_id(), 20);
  EXPECT_EQ(tok->eos_id(), 21);
  std::ofstream(dir / "tokenizer_config.json") << R"({"bos_token": "<bos>"})";
  EXPECT_EQ(rf::testing::error_of([&] { rf::text::load_tokenizer(dir); }),
            (dir / "tokenizer_config.json").string() +
                ": bos_token = '<bos>' is not a token of the tokenizer.json beside it");
  fs::remove(dir / "tokenizer.json");
  EXPECT_NE(rf::testing::error_of([&] { rf::text::load_tokenizer(dir); }).find("cannot load the SentencePiece model"),
            std::string::npos);
  fs::remove(dir / "tokenizer.model");
  EXPECT_EQ(rf::testing::error_of([&] { rf::text::load_tokenizer(dir); }),
            dir.string() + ": has neither tokenizer.json nor tokenizer.model");
}

}  // namespace
