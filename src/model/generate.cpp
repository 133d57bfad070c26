// ringflex model: prefill and decode steps over a DecodeContext (see generate.h, docs/generate.md).
#include "model/generate.h"

#include <algorithm>
#include <chrono>

#include "core/error.h"
#include "model/expert_store.h"
#include "model/generate_memory.h"
#include "model/memory.h"
#include "model/stream_rows.h"

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

MemoryBreakdown generate_memory_at_least(const Gemma4Model& m, std::span<const int64_t> prompt_tokens,
                                         int max_new_tokens, int P, int rank, DType cache_dtype) {
  const int decoded = max_new_tokens / P + (rank < max_new_tokens % P ? 1 : 0);
  int64_t cache = 0;
  int longest_held = 0;
  for (const int64_t tokens : prompt_tokens) {
    const int64_t prefilled = tokens - 1;
    const int held = static_cast<int>((prefilled + P - 1) / P);
    longest_held = std::max(longest_held, held);
    for (const CacheLayer& l : cache_layers(m)) {
      // Of the prompt's positions a window can still see, this rank's even share.
      const int in_window =
          l.mask.window == 0 ? held : static_cast<int>((std::min<int64_t>(prefilled, l.mask.window - 1) + P - 1) / P);
      cache = checked_sum({cache, layer_cache_bytes(l, cache_capacity(l, held, in_window, decoded), cache_dtype)});
    }
  }
  MemoryBreakdown need;
  need.add("KV cache", cache);
  RunMemoryArgs prefill;
  prefill.tokens = std::max(longest_held, 1);
  RunMemoryArgs step;
  step.tokens = std::max<int64_t>(static_cast<int64_t>(prompt_tokens.size()), 1);
  step.logits = true;
  const MemoryBreakdown a = run_memory_at_least(m, prefill), b = run_memory_at_least(m, step);
  need.add(a.total() >= b.total() ? a : b);
  return need;
}

MemoryBreakdown generate_job_memory_at_least(const Gemma4Multimodal& shapes, std::span<const int64_t> prompt_tokens,
                                             int max_new_tokens, int P, int rank, ComputeDtype dtype, DType cache_dtype,
                                             int ep) {
  const int64_t elsewhere = expert_elements_elsewhere(shapes.params(), ep);
  const int64_t elsewhere_bf16 = expert_elements_elsewhere(shapes.params(), ep, true);
  MemoryBreakdown need;
  need.add("weights", checked_sum({shapes.params().weight_bytes() - elsewhere * static_cast<int64_t>(sizeof(float)),
                                   shapes.buffers().total_bytes()}));
  need.add("bf16 weight copies", dtype == ComputeDtype::Bfloat16
                                     ? shapes.bf16_weight_bytes() - elsewhere_bf16 * static_cast<int64_t>(sizeof(bf16))
                                     : 0);
  need.add(generate_memory_at_least(shapes.decoder(), prompt_tokens, max_new_tokens, P, rank, cache_dtype));
  return need;
}

std::vector<Generated> generate(const Gemma4Model& m, DecodeContext& ctx, std::span<const Prompt> prompts,
                                const GenerateOptions& o, const OnToken& on_token) {
  RF_CHECK(o.max_new_tokens > 0, "generate: no new tokens");
  const int n = static_cast<int>(prompts.size());
  std::vector<Generated> out(static_cast<size_t>(n));
  std::vector<Sampler> samplers(static_cast<size_t>(n), Sampler(o.sampling));
  std::vector<DecodeRow> rows;       // the unfinished sequences, in prompt order
  std::vector<int32_t> next_tokens;  // [rows]: the token each feeds next
  std::vector<double> prefill_seconds(static_cast<size_t>(n));
  ctx.start_sequences(n);
  RunOptions step;
  step.want_logits = true;
  step.compute_dtype = o.compute_dtype;
  const auto decode_step = [&](std::span<const DecodeRow> run_rows, const int32_t* tokens) {
    ctx.start_decode(run_rows);
    std::vector<int32_t> positions(run_rows.size());
    for (size_t b = 0; b < run_rows.size(); ++b) positions[b] = run_rows[b].position;
    Batch b;
    b.B = static_cast<int>(run_rows.size());
    b.S = 1;
    b.input_ids = tokens;
    b.position_ids = positions.data();
    const StreamRowsScope streamed;  // a decode step's few-row products stream the weights (model/stream_rows.h)
    return m.run(b, step, ctx);
  };
  for (int i = 0; i < n; ++i) {
    const Prompt& p = prompts[static_cast<size_t>(i)];
    const int S = static_cast<int>(p.ids.size());
    RF_CHECK(S > 0, "generate: prompt ", i, " is empty");
    const auto start = std::chrono::steady_clock::now();
    // A text prompt shorter than the ranks (S - 1 < P: the CP split needs a token a rank) is fed through decode
    // steps instead, one token each, whose logits are not used: the same cache, the same tokens.
    const int prefilled = S - 1 >= ctx.cache_ranks() || has_images(p) ? S - 1 : 0;
    ctx.start_prefill(i, prefilled, S - 1 - prefilled + o.max_new_tokens);
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
    for (int32_t position = prefilled; position < S - 1; ++position) {
      const DecodeRow one{i, position};
      (void)decode_step(std::span<const DecodeRow>(&one, 1), &p.ids[static_cast<size_t>(position)]);
    }
    prefill_seconds[static_cast<size_t>(i)] = seconds_since(start);
    rows.push_back(DecodeRow{i, S - 1});
    next_tokens.push_back(p.ids.back());
  }
  const int64_t V = m.config().vocab_size;
  while (!rows.empty()) {
    const auto start = std::chrono::steady_clock::now();
    const Result r = decode_step(rows, next_tokens.data());
    const auto logits_of = [&](size_t b) {
      return std::span<const float>(r.logits.data() + static_cast<int64_t>(b) * V, static_cast<size_t>(V));
    };
    // The step's time is the run and the choice of its tokens (what a caller waits for before the next step).
    std::vector<int32_t> chosen(rows.size());
    for (size_t b = 0; b < rows.size(); ++b)
      chosen[b] = samplers[static_cast<size_t>(rows[b].sequence)].next(logits_of(b));
    const double seconds = seconds_since(start);
    std::vector<DecodeRow> still;
    std::vector<int32_t> still_tokens;
    for (size_t b = 0; b < rows.size(); ++b) {
      const int i = rows[b].sequence;
      Generated& g = out[static_cast<size_t>(i)];
      const std::span<const float> logits = logits_of(b);
      const int32_t token = chosen[b];
      if (g.tokens.empty())
        g.prefill_seconds = prefill_seconds[static_cast<size_t>(i)] + seconds;
      else
        g.decode_seconds += seconds;
      g.tokens.push_back(token);
      if (std::find(o.stop_ids.begin(), o.stop_ids.end(), token) != o.stop_ids.end())
        g.stop_reason = "eos";
      else if (static_cast<int>(g.tokens.size()) == o.max_new_tokens)
        g.stop_reason = "length";
      if (on_token) on_token(i, token, logits, !g.stop_reason.empty());
      if (g.stop_reason.empty()) {
        still.push_back(DecodeRow{i, rows[b].position + 1});
        still_tokens.push_back(token);
        continue;
      }
      g.cache_bytes = ctx.allocated_bytes(i);
      g.max_sliding_positions = ctx.max_held_positions(i, true);
      ctx.release(i);
    }
    rows = std::move(still);
    next_tokens = std::move(still_tokens);
  }
  return out;
}

}  // namespace rf::model
