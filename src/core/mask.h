// ringflex core: token metadata, the mask predicate (docs/spec.md §2-3) and the block classifier.
//
// A mask is never stored. Each token carries {idx, doc, group}; a layer's mask is three fields; whether query q
// may read key k is a pure function of the two tokens. Kernels and the CP planner work on *blocks* of tokens:
// `summarize` reduces a block to a few ranges, and `classify` tells from two summaries whether the block pair
// is certainly empty, certainly full, or must be checked element by element. Both are conservative: a pair is
// only called empty (or full) when no element can say otherwise.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

namespace rf {

// One token's attention metadata. Rows of tokens are stored as TokenMeta[B, L] (array of structs, 12 bytes a
// token) so a chunk's metadata travels as one buffer beside its K/V.
struct TokenMeta {
  int32_t idx;    // index in the unsharded (padded) row; causality and windows use it, never local positions
  int32_t doc;    // 1-based document id within the packed row; 0 = padding
  int32_t group;  // bidirectional group id (an image block), -1 = none; numbered on the whole row
};

constexpr int32_t kPaddingDoc = 0;
constexpr int32_t kNoGroup = -1;

struct LayerMask {
  bool causal = true;
  int window = 0;  // 0 = no window; else a query sees itself and the window-1 tokens before it
  bool bidirectional_groups = false;

  bool operator==(const LayerMask&) const = default;
  std::string name() const;  // e.g. "causal,W=512,groups"
};

// docs/spec.md §3, exactly.
inline bool allowed(const LayerMask& m, const TokenMeta& q, const TokenMeta& k) {
  if (q.doc == kPaddingDoc || k.doc == kPaddingDoc || q.doc != k.doc) return false;
  const bool grouped = m.bidirectional_groups && q.group >= 0 && q.group == k.group;
  if (grouped) return true;
  const bool ordered = !m.causal || k.idx <= q.idx;
  if (!ordered) return false;
  if (m.window == 0) return true;
  const int64_t distance = m.causal ? int64_t{q.idx} - k.idx : std::llabs(int64_t{q.idx} - k.idx);
  return distance < m.window;
}

// What a block of tokens looks like from far away. Ranges are over valid (non-padding) tokens only.
struct BlockSummary {
  int32_t n_tokens = 0;
  int32_t n_valid = 0;    // tokens with doc > 0
  int32_t n_grouped = 0;  // valid tokens with group >= 0
  int32_t idx_min = 0, idx_max = -1;
  int32_t doc_min = 0, doc_max = -1;
  int32_t group_min = 0, group_max = -1;  // over grouped tokens; empty range when n_grouped == 0

  bool has_valid() const { return n_valid > 0; }
  bool all_valid() const { return n_valid == n_tokens; }
  bool single_doc() const { return doc_min == doc_max; }
};

// Summary of tokens t[0 .. n).
BlockSummary summarize(const TokenMeta* t, int n);

// Summaries of consecutive blocks of `block` tokens of each of B rows of L tokens: meta [B, L] -> [B, nb],
// nb = ceil(L / block); the last block of a row is short when block does not divide L. The one place block
// summaries are built for planning, work counting and reports (the kernels tile on their own).
std::vector<BlockSummary> summarize_blocks(const TokenMeta* meta, int B, int L, int block);

enum class BlockClass : uint8_t {
  Empty,    // no (q, k) pair in the blocks is allowed: skip the pair entirely
  Full,     // every pair is allowed: compute without evaluating the predicate
  Partial,  // some may be allowed: evaluate the predicate per element
};

BlockClass classify(const LayerMask& m, const BlockSummary& q, const BlockSummary& k);

}  // namespace rf
