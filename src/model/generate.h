// ringflex model: generation with a KV cache: a prompt's prefill, then one decode step per new token, through a
// DecodeContext (core/decode_context.h; cp::make_decode_context builds the one a job uses, at any CP size).
//
// The prefill runs the prompt's first S - 1 tokens through the model's ordinary forward (CP-sharded under mpirun,
// images and all) with no head and no KV-shared tail (RunOptions::run_layers; of the last layer it runs, only its K/V
// projections), so the cache holds their K/V; the last prompt token is then the first decode step, whose logits
// choose the first new token. Every decode step is a Gemma4Model::run of one token (B = 1, S = 1, its RoPE position
// given), so the layers, PLE, MoE, bf16 compute and LoRA are the training forward's own code. docs/generate.md.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "core/decode_context.h"
#include "core/memory.h"
#include "model/gemma4.h"
#include "model/sampling.h"

namespace rf::model {

// One prompt: token ids [S], and for a multimodal one its token types [S] (0 text, 1 image, 2 video) and the
// features of its image slots [N, F] in order (gemma4.h Batch). The last token must be text.
struct Prompt {
  std::vector<int32_t> ids;
  std::vector<int32_t> mm_token_type;  // empty: all text
  std::vector<float> image_features;   // [N, F]
  int64_t n_image_features = 0;
};

struct GenerateOptions {
  int max_new_tokens = 0;
  std::vector<int32_t> stop_ids;  // generation ends after producing one of these (it is kept in the tokens)
  SamplingOptions sampling;
  ComputeDtype compute_dtype = ComputeDtype::Float32;
  // The prefill runs every layer and the head (its logits unused), as a forward-only training run does, instead of
  // stopping after the last layer with K/V of its own. A training store's layer hooks (sharded gathers, held experts,
  // prefetches of the next layer and the head) then see the same sequence as in validation (train.samples).
  bool prefill_whole_model = false;
};

struct Generated {
  std::vector<int32_t> tokens;    // the new tokens, the stop token included
  std::string stop_reason;        // "eos": a stop id; "length": max_new_tokens reached
  double prefill_seconds = 0;     // its prompt's prefill and the (batched) decode step that chose its first token
  double decode_seconds = 0;      // the (batched) steps that chose its later tokens
  int64_t cache_bytes = 0;        // this rank's cache of the sequence when it finished (DecodeContext::allocated_bytes)
  int max_sliding_positions = 0;  // the most positions a sliding layer of it held on this rank
};

// The model's layers as the cache sees them.
std::vector<CacheLayer> cache_layers(const Gemma4Model& m);

// Throws rf::Error (naming `source`) for a prompt generation cannot run: empty, its last token an image slot, more
// than max_position_embeddings with the new tokens, images in a prompt of fewer than `ranks` + 1 tokens (its
// prefill must split over the ranks; a text prompt that short is fed through decode steps instead), or what
// Gemma4Model::check_batch rejects.
void check_prompt(const Gemma4Model& m, const Prompt& p, int max_new_tokens, int ranks, const std::string& source);

// What one rank needs beside the weights, at least, to decode prompts of `prompt_tokens` [n] tokens together with
// `max_new_tokens` each over P ranks: every sequence's KV cache in `cache_dtype` (this rank's share: ceil of the prompt
// over P, its decoded positions round robin; exact at P = 1, what DecodeContext::allocated_bytes then reports), and
// the larger of the longest prefill run's buffers and a decode step's of n tokens.
MemoryBreakdown generate_memory_at_least(const Gemma4Model& m, std::span<const int64_t> prompt_tokens,
                                         int max_new_tokens, int P, int rank, DType cache_dtype);

// Called with each new token of prompt `sequence` and its step's logits [V] as soon as it is chosen (`last`: the
// sequence stops with it); every rank calls it.
using OnToken = std::function<void(int sequence, int32_t token, std::span<const float> logits, bool last)>;

// Generates from every prompt (check_prompt's conditions hold), one Generated each. The prompts are prefilled one
// after the other, then decoded together: each step is one model run of one token of every unfinished sequence
// (B of them, S = 1, each at its own position, each reading its own cache), so the weights are read once a step for
// the batch; a sequence leaves the batch when it stops. Each sequence has its own Sampler, seeded alike, so its tokens
// are those of a run with it alone. Collective over the context's ranks: every rank passes the same prompts and
// options and gets the same tokens.
std::vector<Generated> generate(const Gemma4Model& m, DecodeContext& ctx, std::span<const Prompt> prompts,
                                const GenerateOptions& o, const OnToken& on_token = {});

}  // namespace rf::model
