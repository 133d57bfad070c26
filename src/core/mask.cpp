// ringflex core: mask names, block summaries and the block classifier (see mask.h).
#include "core/mask.h"

#include <algorithm>

namespace rf {

std::string LayerMask::name() const {
  std::string s = causal ? "causal" : "bidirectional";
  if (window > 0) s += ",W=" + std::to_string(window);
  if (bidirectional_groups) s += ",groups";
  return s;
}

BlockSummary summarize(const TokenMeta* t, int n) {
  BlockSummary s;
  s.n_tokens = n;
  for (int i = 0; i < n; ++i) {
    if (t[i].doc == kPaddingDoc) continue;
    const bool first_valid = s.n_valid++ == 0;
    s.idx_min = first_valid ? t[i].idx : std::min(s.idx_min, t[i].idx);
    s.idx_max = first_valid ? t[i].idx : std::max(s.idx_max, t[i].idx);
    s.doc_min = first_valid ? t[i].doc : std::min(s.doc_min, t[i].doc);
    s.doc_max = first_valid ? t[i].doc : std::max(s.doc_max, t[i].doc);
    if (t[i].group < 0) continue;
    const bool first_grouped = s.n_grouped++ == 0;
    s.group_min = first_grouped ? t[i].group : std::min(s.group_min, t[i].group);
    s.group_max = first_grouped ? t[i].group : std::max(s.group_max, t[i].group);
  }
  return s;
}

std::vector<BlockSummary> summarize_blocks(const TokenMeta* meta, int B, int L, int block) {
  const int nb = block > 0 ? (L + block - 1) / block : 0;
  std::vector<BlockSummary> out(static_cast<size_t>(B) * nb);
  for (int b = 0; b < B; ++b)
    for (int j = 0; j < nb; ++j)
      out[static_cast<size_t>(b) * nb + j] =
          summarize(meta + int64_t{b} * L + j * block, std::min(block, L - j * block));
  return out;
}

namespace {

bool ranges_overlap(int32_t a_min, int32_t a_max, int32_t b_min, int32_t b_max) {
  return a_min <= b_max && b_min <= a_max;
}

// Could some (q, k) pair pass ordered && in_window? Index ranges are treated as intervals, which can only
// over-approximate the set of differences, so a "no" here is certain.
bool maybe_ordered_in_window(const LayerMask& m, const BlockSummary& q, const BlockSummary& k) {
  const int64_t q_lo = q.idx_min, q_hi = q.idx_max, k_lo = k.idx_min, k_hi = k.idx_max;
  if (m.causal) {
    if (k_lo > q_hi) return false;                   // every key after every query
    return m.window == 0 || q_lo - k_hi < m.window;  // smallest q - k over pairs with k <= q
  }
  if (m.window == 0) return true;
  const int64_t gap = std::max(q_lo - k_hi, k_lo - q_hi);  // smallest |q - k|, or <= 0 if the ranges touch
  return gap < m.window;
}

// Does every (q, k) pair pass ordered && in_window?
bool surely_ordered_in_window(const LayerMask& m, const BlockSummary& q, const BlockSummary& k) {
  const int64_t q_lo = q.idx_min, q_hi = q.idx_max, k_lo = k.idx_min, k_hi = k.idx_max;
  if (m.causal) {
    if (k_hi > q_lo) return false;
    return m.window == 0 || q_hi - k_lo < m.window;
  }
  return m.window == 0 || std::max(q_hi - k_lo, k_hi - q_lo) < m.window;
}

}  // namespace

BlockClass classify(const LayerMask& m, const BlockSummary& q, const BlockSummary& k) {
  if (!q.has_valid() || !k.has_valid()) return BlockClass::Empty;
  if (!ranges_overlap(q.doc_min, q.doc_max, k.doc_min, k.doc_max)) return BlockClass::Empty;

  const bool maybe_grouped = m.bidirectional_groups && q.n_grouped > 0 && k.n_grouped > 0 &&
                             ranges_overlap(q.group_min, q.group_max, k.group_min, k.group_max);
  if (!maybe_grouped && !maybe_ordered_in_window(m, q, k)) return BlockClass::Empty;

  // Full needs every token valid and one document shared by both blocks.
  const bool one_doc = q.all_valid() && k.all_valid() && q.single_doc() && k.single_doc() && q.doc_min == k.doc_min;
  if (!one_doc) return BlockClass::Partial;
  if (surely_ordered_in_window(m, q, k)) return BlockClass::Full;
  // Both blocks lie entirely inside one bidirectional group (an image block on the causal diagonal).
  const bool one_group = m.bidirectional_groups && q.n_grouped == q.n_tokens && k.n_grouped == k.n_tokens &&
                         q.group_min == q.group_max && k.group_min == k.group_max && q.group_min == k.group_min;
  return one_group ? BlockClass::Full : BlockClass::Partial;
}

}  // namespace rf
