// ringflex model: prefill and decode steps over a DecodeContext (see generate.h, docs/generate.md).
#include "model/generate.h"

#include <algorithm>
#include <chrono>

#include "core/error.h"
#include "model/memory.h"

namespace rf::model {

namespace {

// Layers the prefill runs: up to the last that stores K/V of its own (the KV-shared layers after it feed only the
// head, which the prefill skips).
int prefill_layers(const Gemma4Model& m) {
  int n = 0;
  for (int l = 0; l < m.config().num_layers; ++l)
    if (m.spec(l).kv_source < 0) n = l + 1;
  return n;
}

bool has_images(const Prompt& p) {
  return std::any_of(p.mm_token_type.begin(), p.mm_token_type.end(), [](int32_t t) { return t != 0; });
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

std::vector<CacheLayer> cache_layers(const Gemma4Model& m) {
  std::vector<CacheLayer> layers;
  for (int l = 0; l < m.config().num_layers; ++l) {
    const LayerSpec& s = m.spec(l);
    layers.push_back(CacheLayer{s.mask, s.kv_source, s.kv_heads, s.head_dim});
  }
  return layers;
}

void check_prompt(const Gemma4Model& m, const Prompt& p, int max_new_tokens, int ranks, const std::string& source) {
  const int64_t S = static_cast<int64_t>(p.ids.size());
  RF_CHECK(S > 0, source, ": the prompt is empty (no tokens to start from)");
  RF_CHECK(max_new_tokens >= 1, source, ": --max-new-tokens must be at least 1, not ", max_new_tokens);
  const int64_t limit = m.config().max_position_embeddings;
  RF_CHECK(limit <= 0 || S + max_new_tokens <= limit, source, ": the prompt's ", S, " tokens and --max-new-tokens ",
           max_new_tokens, " make ", S + max_new_tokens, " positions, over the model's max_position_embeddings ",
           limit);
  RF_CHECK(p.mm_token_type.empty() || p.mm_token_type.size() == p.ids.size(), source, ": ", p.mm_token_type.size(),
           " token types for ", S, " tokens");
  RF_CHECK(p.mm_token_type.empty() || p.mm_token_type.back() == 0, source,
           ": the prompt ends in an image slot; generation continues after text");
  Batch b;
  b.B = 1;
  b.S = static_cast<int>(S);
  b.input_ids = p.ids.data();
  b.mm_token_type = p.mm_token_type.empty() ? nullptr : p.mm_token_type.data();
  b.image_features = p.image_features.empty() ? nullptr : p.image_features.data();
  b.n_image_features = p.n_image_features;
  m.check_batch(b, 1, source);
  RF_CHECK(!has_images(p) || S - 1 >= ranks, source, ": the prompt's ", S - 1,
           " tokens before its last, images among them, cannot be split over ", ranks,
           " ranks (one token a rank at least); run with fewer ranks");
}

MemoryBreakdown generate_memory_at_least(const Gemma4Model& m, int64_t prompt_tokens, int max_new_tokens, int P,
                                         int rank, ComputeDtype compute_dtype) {
  const int64_t prefilled = prompt_tokens - 1;
  const int held = static_cast<int>((prefilled + P - 1) / P);
  const int decoded = max_new_tokens / P + (rank < max_new_tokens % P ? 1 : 0);
  const DType dtype = attention_dtype(compute_dtype);
  int64_t cache = 0;
  for (const CacheLayer& l : cache_layers(m)) {
    // Of the prompt's positions a window can still see, this rank's even share.
    const int in_window =
        l.mask.window == 0 ? held : static_cast<int>((std::min<int64_t>(prefilled, l.mask.window - 1) + P - 1) / P);
    cache = checked_sum({cache, layer_cache_bytes(l, cache_capacity(l, held, in_window, decoded), dtype)});
  }
  MemoryBreakdown need;
  need.add("KV cache", cache);
  RunMemoryArgs prefill;
  prefill.tokens = std::max(held, 1);
  RunMemoryArgs step;
  step.tokens = 1;
  step.logits = true;
  const MemoryBreakdown a = run_memory_at_least(m, prefill), b = run_memory_at_least(m, step);
  need.add(a.total() >= b.total() ? a : b);
  return need;
}

Generated generate(const Gemma4Model& m, DecodeContext& ctx, const Prompt& p, const GenerateOptions& o,
                   const OnToken& on_token) {
  const int S = static_cast<int>(p.ids.size());
  RF_CHECK(S > 0 && o.max_new_tokens > 0, "generate: an empty prompt or no new tokens");
  Generated out;
  Sampler sampler(o.sampling);
  const auto start = std::chrono::steady_clock::now();
  // A text prompt shorter than the ranks (S - 1 < P: the CP split needs a token a rank) is fed through decode steps
  // instead, one token each, whose logits are not used: the same cache, the same tokens.
  const int prefilled = S - 1 >= ctx.cache_ranks() || has_images(p) ? S - 1 : 0;
  ctx.start_prefill(prefilled, S - 1 - prefilled + o.max_new_tokens);
  if (prefilled > 0) {
    Batch b;
    b.B = 1;
    b.S = prefilled;
    b.input_ids = p.ids.data();
    b.mm_token_type = p.mm_token_type.empty() ? nullptr : p.mm_token_type.data();
    b.image_features = p.image_features.empty() ? nullptr : p.image_features.data();
    b.n_image_features = p.n_image_features;
    RunOptions ro;
    ro.run_layers = o.prefill_whole_model ? 0 : prefill_layers(m);
    ro.compute_dtype = o.compute_dtype;
    (void)m.run(b, ro, ctx);
  }
  RunOptions step;
  step.want_logits = true;
  step.compute_dtype = o.compute_dtype;
  const auto decode_step = [&](int32_t token, int32_t position) {
    ctx.start_decode(position);
    Batch b;
    b.B = 1;
    b.S = 1;
    b.input_ids = &token;
    b.position_ids = &position;
    return m.run(b, step, ctx);
  };
  for (int32_t position = prefilled; position < S - 1; ++position) (void)decode_step(p.ids[position], position);
  int32_t token = p.ids.back();
  auto decode_start = start;
  for (int n = 0; n < o.max_new_tokens; ++n) {
    const Result r = decode_step(token, S - 1 + n);
    token = sampler.next(r.logits);
    out.tokens.push_back(token);
    if (n == 0) {
      out.prefill_seconds = seconds_since(start);
      decode_start = std::chrono::steady_clock::now();
    }
    if (on_token) on_token(token, r.logits);
    if (std::find(o.stop_ids.begin(), o.stop_ids.end(), token) != o.stop_ids.end()) {
      out.stop_reason = "eos";
      break;
    }
  }
  if (out.stop_reason.empty()) out.stop_reason = "length";
  out.decode_seconds = seconds_since(decode_start);
  return out;
}

}  // namespace rf::model
