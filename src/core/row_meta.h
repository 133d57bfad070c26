// ringflex core: building a row's token metadata (docs/spec.md §2) from what datasets provide.
//
// Groups are numbered on the whole, unsharded row, so an image block that later spans ranks keeps one id.
// The synthetic generator makes Gemma 4 VLM-like rows (packed documents of varied length, image blocks of
// 256 tokens, trailing padding) for the CLI's built-in data, benchmarks and tests.
#pragma once

#include <cstdint>
#include <vector>

#include "core/mask.h"

namespace rf {

// Gemma 4 rule: a maximal run of image (1) or video (2) tokens is one group, numbered 0, 1, 2 ... in row order;
// text (0) is -1. token_types: [S]; returns [S].
std::vector<int32_t> group_ids_from_token_types(const int32_t* token_types, int S);

// Metadata of one row: idx = position in the row, doc and group as given (doc may be null: all document 1;
// group may be null: no groups). Returns [S].
std::vector<TokenMeta> make_row_meta(int S, const int32_t* doc, const int32_t* group);

struct SyntheticRowOptions {
  int mean_doc_tokens = 0;    // 0: one document spans the row; else document lengths vary around this mean
  int image_tokens = 0;       // tokens per image block (Gemma 4: 256 soft tokens per image); 0 = no images
  double image_fraction = 0;  // share of each document's tokens placed in image blocks
  int padding_tokens = 0;     // trailing padding (doc = 0)
  bool images_first = true;   // VLM data puts images at the start of a document, before its text
};

// One row of S tokens, deterministic in `seed`. Returns [S].
std::vector<TokenMeta> synthetic_row(int S, const SyntheticRowOptions& opt, uint64_t seed);

// Gemma 4's vision encoder emits this many soft tokens per image: one image group's size in a packed row.
constexpr int kGemma4ImageSoftTokens = 256;

// A Gemma 4 VLM row: packed documents (mean 2048 tokens, one-token ones included) with kGemma4ImageSoftTokens-token
// image blocks at their start, and 3% trailing padding.
std::vector<TokenMeta> gemma4_vlm_row(int S, uint64_t seed);

}  // namespace rf
