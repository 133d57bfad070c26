// ringflex core: row metadata from token types and documents, and the synthetic Gemma 4-like rows (see row_meta.h).
#include "core/row_meta.h"

#include <algorithm>
#include <random>

#include "core/error.h"

namespace rf {

std::vector<int32_t> group_ids_from_token_types(const int32_t* token_types, int S) {
  std::vector<int32_t> group(static_cast<size_t>(S), kNoGroup);
  int32_t next = 0;
  for (int t = 0; t < S; ++t) {
    const bool vision = token_types[t] == 1 || token_types[t] == 2;
    if (!vision) continue;
    const bool starts_run = t == 0 || group[t - 1] == kNoGroup;
    group[t] = starts_run ? next++ : group[t - 1];
  }
  return group;
}

std::vector<TokenMeta> make_row_meta(int S, const int32_t* doc, const int32_t* group) {
  std::vector<TokenMeta> m(static_cast<size_t>(S));
  for (int t = 0; t < S; ++t) {
    RF_CHECK(!doc || doc[t] >= 0, "doc[", t, "] = ", doc[t], " is negative (0 = padding, documents are 1-based)");
    RF_CHECK(!group || group[t] >= kNoGroup, "group[", t, "] = ", group[t], " is below -1");
    m[t] = {t, doc ? doc[t] : 1, group ? group[t] : kNoGroup};
  }
  return m;
}

std::vector<TokenMeta> synthetic_row(int S, const SyntheticRowOptions& opt, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int real = std::max(0, S - opt.padding_tokens);
  std::vector<int32_t> doc(static_cast<size_t>(S), kPaddingDoc), types(static_cast<size_t>(S), 0);
  int32_t d = 0;
  for (int t = 0; t < real;) {
    ++d;
    int len = real - t;
    if (opt.mean_doc_tokens > 0) {
      // Exponential spread: many short documents and a few long ones, one-token documents included.
      std::exponential_distribution<double> spread(1.0 / opt.mean_doc_tokens);
      len = std::clamp(static_cast<int>(spread(rng)) + 1, 1, real - t);
    }
    // Each image is <start_of_image>, image_tokens soft tokens, <end_of_image>: the two markers are text, so
    // neighbouring images stay separate groups, as in Gemma 4 prompts.
    const int span = opt.image_tokens + 2;
    const int images = opt.image_tokens > 0 ? static_cast<int>(opt.image_fraction * len) / span : 0;
    const int stride = images > 0 && !opt.images_first ? len / images : span;
    for (int i = 0; i < len; ++i) {
      doc[t + i] = d;
      const int offset = i % stride;
      types[t + i] = i / stride < images && offset >= 1 && offset <= opt.image_tokens ? 1 : 0;
    }
    t += len;
  }
  const std::vector<int32_t> group = group_ids_from_token_types(types.data(), S);
  return make_row_meta(S, doc.data(), group.data());
}

std::vector<TokenMeta> gemma4_vlm_row(int S, uint64_t seed) {
  constexpr int kMeanDocTokens = 2048;
  constexpr double kImageFraction = 0.25;
  constexpr int kPaddingPercent = 3;
  SyntheticRowOptions opt;
  opt.mean_doc_tokens = kMeanDocTokens;
  opt.image_tokens = kGemma4ImageSoftTokens;
  opt.image_fraction = kImageFraction;
  opt.padding_tokens = S * kPaddingPercent / 100;
  return synthetic_row(S, opt, seed);
}

}  // namespace rf
