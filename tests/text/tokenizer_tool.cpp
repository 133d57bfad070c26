// The oracle tests' view of rf::text::Tokenizer (tokenizer_oracle.py): one process answers many cases.
//   tokenizer_tool TOKENIZER CASES.jsonl OUT.jsonl
// Each case line is {"text": s} (encode, then decode the ids with and without special tokens) or {"ids": [...]}
// (decode only); each answer line is {"ids": [...], "decode": s, "decode_skip": s} or {"error": message}.
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/tokenizer.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::cerr << "usage: tokenizer_tool TOKENIZER CASES.jsonl OUT.jsonl\n";
    return 2;
  }
  using nlohmann::json;
  std::unique_ptr<rf::text::Tokenizer> tok;
  std::ofstream out(argv[3]);
  try {
    tok = rf::text::load_tokenizer(argv[1]);
  } catch (const rf::Error& e) {
    out << json{{"error", e.what()}}.dump() << "\n";
    return 0;
  }
  std::ifstream in(argv[2]);
  for (std::string line; std::getline(in, line);) {
    const json c = json::parse(line);
    json answer;
    try {
      std::vector<int32_t> ids;
      if (c.contains("text")) {
        ids = tok->encode(c["text"].get<std::string>());
        answer["ids"] = ids;
      } else {
        ids = c["ids"].get<std::vector<int32_t>>();
      }
      answer["decode"] = tok->decode(ids, false);
      answer["decode_skip"] = tok->decode(ids, true);
    } catch (const rf::Error& e) {
      answer = json{{"error", e.what()}};
    }
    out << answer.dump(-1, ' ', false, json::error_handler_t::replace) << "\n";
  }
  return 0;
}
