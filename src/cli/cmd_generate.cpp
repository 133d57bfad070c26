// ringflex generate: text from a Gemma 4 checkpoint (with a LoRA adapter over it) with a KV cache, context-parallel
// over the ranks of mpirun.
//
//     [mpirun -n P] ringflex generate --model DIR [--lora ADAPTER]
//                   (--prompt TEXT... | --messages FILE.jsonl | --in PROMPTS.safetensors)
//                   [--max-new-tokens N]
//                   [--greedy | --temperature T --top-k K --top-p P --min-p M --seed S] [--out FILE.jsonl]
//                   [--logits-out FILE.safetensors] [--compute-dtype float32|bfloat16]
//                   [--cache-dtype float32|bfloat16] [--ep E] [--threads N]
//
// Prompts: --prompt TEXT (once or more), tokenized with the checkpoint's tokenizer (src/text; tokenizer.json, else
// tokenizer.model) after its BOS token, as transformers' tokenizer(text) gives it; the new tokens stream to stdout as
// text, a trailing run of byte-fallback tokens held back until a text token ends it (its text may still change).
// --messages: conversations, one a line, rendered through the checkpoint's chat template with the generation prompt
// (text/conversation.h), images as message parts through the checkpoint's processor and tower, streamed as text. Or
// the batch file of `ringflex forward` (cli/batch_file.h); each row of input_ids [B, S] is one prompt, images as
// image_features or pixel_values with mm_token_type_ids. Sampling and stopping default to the checkpoint's
// generation_config.json (do_sample, temperature, top_k, top_p, min_p, eos_token_id; transformers' defaults where it
// has none); --greedy or any sampling option overrides it. The prompts are decoded together, each giving its tokens
// alone (model/generate.h). Each prompt's prefill is split over the ranks and its KV cache stays sharded
// (cp/kv_cache.h, docs/generate.md): the tokens do not depend on P. With --ep E each group of E consecutive ranks
// divides every MoE layer's experts as training's parallelism.ep does: a rank loads and holds its experts only
// (model/expert_store.h), the prefill's rows travel to them and a decode step runs each expert on its holder alone
// (cp/decode_experts.h); the tokens and logits do not depend on E. Rank 0 streams each prompt's new tokens to
// stdout as they come, in prompt order (BatchStream), writes --out (one JSON object a prompt: token_ids, stop_reason,
// prompt_tokens, prefill and decode tokens/s) and --logits-out (the first prompt's logits, one [V] row a step: logits
// [N, V]). Every input and the memory the job needs (weights, every prompt's cache with --max-new-tokens) is checked on
// every rank before any work: a bad one is one line on every rank and a non-zero exit.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/batch_file.h"
#include "cli/command.h"
#include "comm/agree.h"
#include "comm/mpi_comm.h"
#include "core/error.h"
#include "core/memory.h"
#include "cp/kv_cache.h"
#include "io/atomic_file.h"
#include "io/jsonl.h"
#include "io/safetensors.h"
#include "model/checkpoint.h"
#include "model/expert_store.h"
#include "model/generate.h"
#include "model/generate_memory.h"
#include "model/generation_config.h"
#include "model/lora_store.h"
#include "model/peft_files.h"
#include "model/vision.h"
#include "model/vision_encoder.h"
#include "text/conversation.h"
#include "text/tokenizer.h"
#include "trainer/config.h"
#include "trainer/conversation_prompt.h"

namespace rf::cli {

namespace {

constexpr int kMaxThreads = 1024;
constexpr int kDefaultMaxNewTokens = 256;

struct GenerateCliOptions {
  std::string model, lora, in, messages, out, logits_out;
  std::vector<std::string> prompt;  // --prompt, once or more
  std::optional<int> max_new_tokens;
  bool greedy = false;
  std::optional<float> temperature, top_p, min_p;
  std::optional<int> top_k;
  std::optional<uint64_t> seed;
  int threads = 0;
  int ep = 1;  // --ep: ranks dividing the experts (1: every expert on every rank)
  std::string compute_dtype = "float32";
  std::string cache_dtype;  // empty: the attention storage's (model::attention_dtype)
};

// Sampling and stop ids from the checkpoint's generation_config.json (model/generation_config.h, the reader
// train.samples stops with; transformers' defaults without it), then the command line's.
struct Decoding {
  model::SamplingOptions sampling;
  std::vector<int32_t> stop_ids;
  int max_new_tokens = kDefaultMaxNewTokens;
};

Decoding decoding_of(const GenerateCliOptions& opt) {
  const model::GenerationDefaults file = model::read_generation_config(opt.model);
  Decoding d;
  d.sampling = file.sampling;
  d.stop_ids = file.stop_ids;
  d.max_new_tokens = file.max_new_tokens.value_or(kDefaultMaxNewTokens);
  const bool sampling_given = opt.temperature || opt.top_k || opt.top_p || opt.min_p || opt.seed;
  RF_CHECK(!(opt.greedy && sampling_given),
           "--greedy and sampling options (--temperature, --top-k, --top-p, "
           "--min-p, --seed) exclude each other");
  if (opt.greedy) d.sampling.greedy = true;
  if (sampling_given) d.sampling.greedy = false;
  if (opt.temperature) d.sampling.temperature = *opt.temperature;
  if (opt.top_k) d.sampling.top_k = *opt.top_k;
  if (opt.top_p) d.sampling.top_p = *opt.top_p;
  if (opt.min_p) d.sampling.min_p = *opt.min_p;
  if (opt.seed) d.sampling.seed = *opt.seed;
  if (opt.max_new_tokens) d.max_new_tokens = *opt.max_new_tokens;
  model::check_sampling(d.sampling);
  return d;
}

// --cache-dtype: empty keeps the attention storage's dtype; bfloat16 is allowed under either, float32 only where
// attention reads float32 (a float32 cache would only be rounded again when read by bf16 attention).
DType cache_dtype_of(const std::string& given, DType attention) {
  if (given.empty()) return attention;
  const DType d = given == "bfloat16" || given == "bf16" ? DType::BF16 : DType::F32;
  RF_CHECK(d == DType::BF16 || attention == DType::F32,
           "--cache-dtype float32: attention reads bf16 here (--compute-dtype bfloat16 on bf16 units); the cache "
           "keeps bf16 or nothing finer");
  return d;
}

// The prompts of the batch file: one a row (images with B = 1, where the slots are unambiguous).
std::vector<model::Prompt> prompts_of(const BatchData& d, const std::string& path) {
  RF_CHECK(!d.has_features || d.B == 1, path, ": a prompt batch with images must have one row (B = 1), not ", d.B);
  std::vector<model::Prompt> prompts(static_cast<size_t>(d.B));
  for (int b = 0; b < d.B; ++b) {
    model::Prompt& p = prompts[static_cast<size_t>(b)];
    const auto row = [&](const std::vector<int32_t>& v) {
      return std::vector<int32_t>(v.begin() + int64_t{b} * d.S, v.begin() + int64_t{b + 1} * d.S);
    };
    p.ids = row(d.ids);
    if (!d.mm.empty()) p.mm_token_type = row(d.mm);
    if (d.has_features) {
      p.image_features = d.features;
      p.n_image_features = d.n_features;
    }
  }
  return prompts;
}

// New tokens as text, as they come: the decoded text of the tokens so far up to the last one that is not a
// byte-fallback token (`<0xNN>`), printed from where the last print ended. tokenizers' decode joins a run of byte
// tokens before reading it as UTF-8 and turns every byte of an invalid run into U+FFFD (a valid `=` byte included), so
// the text of a run can change while it grows; a text token ends the run, and the text before it is final.
class TextStream {
 public:
  explicit TextStream(const text::Tokenizer& tok) : tok_(tok) {}
  // The text of `ids` so far that is new since the last call and final.
  std::string next(const std::vector<int32_t>& ids) {
    size_t settled = ids.size();
    while (settled > 0 && is_byte_token(ids[settled - 1])) --settled;
    return fresh(tok_.decode(std::span<const int32_t>(ids.data(), settled), true));
  }
  // Whatever is left at the end (a trailing run of byte tokens included).
  std::string finish(const std::vector<int32_t>& ids) { return fresh(tok_.decode(ids, true)); }

 private:
  bool is_byte_token(int32_t id) const {
    const std::optional<std::string> piece = tok_.id_to_token(id);
    return piece && piece->size() == 6 && piece->starts_with("<0x") && piece->back() == '>';
  }
  std::string fresh(const std::string& text) {
    if (text.size() <= printed_) return {};
    std::string out = text.substr(printed_);
    printed_ = text.size();
    return out;
  }
  const text::Tokenizer& tok_;
  size_t printed_ = 0;
};

// Rank 0's stdout for prompts decoded together, in prompt order and byte for byte what they would print one after
// another: the first unfinished prompt's tokens print as they come; a later prompt's are held until every prompt
// before it has finished. Each prompt's line: its text (TextStream) with a tokenizer, else `[i]` and its ids.
class BatchStream {
 public:
  BatchStream(size_t prompts, const text::Tokenizer* tok) : prompts_(prompts) {
    for (size_t i = 0; i < prompts; ++i) {
      if (tok)
        prompts_[i].text.emplace(*tok);
      else
        prompts_[i].pending = concat("[", i, "]");
    }
  }
  void token(int prompt, int32_t id, bool last) {
    Pending& p = prompts_[static_cast<size_t>(prompt)];
    p.ids.push_back(id);
    p.pending += p.text ? p.text->next(p.ids) : concat(" ", id);
    if (last) {
      if (p.text) p.pending += p.text->finish(p.ids);
      p.pending += "\n";
      p.done = true;
    }
    while (first_ < prompts_.size()) {
      Pending& q = prompts_[first_];
      std::fputs(q.pending.c_str(), stdout);
      q.pending.clear();
      if (!q.done) break;
      ++first_;
    }
    std::fflush(stdout);
  }

 private:
  struct Pending {
    std::optional<TextStream> text;
    std::vector<int32_t> ids;
    std::string pending;  // not printed yet
    bool done = false;
  };
  std::vector<Pending> prompts_;
  size_t first_ = 0;  // the first unfinished prompt
};

// --messages FILE.jsonl: one conversation a line ({"messages": [...], "tools": [...]?}, docs/text.md), rendered
// through the checkpoint's chat template with the generation prompt and tokenized as transformers'
// apply_chat_template(..., add_generation_prompt=True) gives it (the template writes <bos>), each image laid out as
// slots (trainer/conversation_prompt.h, the reader train.samples' prompts share). Image paths are relative to the
// file's folder; images are resized for the checkpoint's processor budget (processor_config.json's max_soft_tokens,
// else 280). Throws rf::Error "FILE:LINE: ..." for a line that does not parse or that the renderer refuses, a missing
// or unreadable image, or images for a checkpoint without a vision tower.
std::vector<trainer::ConversationPrompt> read_conversations(const std::string& path, const std::string& model_dir,
                                                            const text::Tokenizer& tok) {
  const std::filesystem::path dir(model_dir);
  const text::ChatRenderer renderer(text::load_chat_template(dir, {}, dir / "tokenizer_config.json"), tok,
                                    text::ChatOptions{});
  trainer::PromptImages images;
  images.config_path = (dir / "config.json").string();
  const std::string config_text = io::read_config_file(images.config_path);
  images.tokens = model::MultimodalTokens::from_config_json(config_text, images.config_path);
  if (const std::optional<model::VisionConfig> vision =
          model::VisionConfig::from_config_json(config_text, images.config_path)) {
    images.processor.emplace();
    images.processor->patch_size = vision->patch_size;
    images.processor->pooling_kernel_size = vision->pooling_kernel_size;
    images.processor->max_soft_tokens = trainer::processor_soft_tokens(model_dir);
  }
  const std::filesystem::path folder = std::filesystem::path(path).parent_path();
  std::vector<trainer::ConversationPrompt> out;
  io::for_each_line<nlohmann::ordered_json>(path, [&](const nlohmann::ordered_json& j, const std::string& where) {
    out.push_back(trainer::conversation_prompt(j, where, folder, renderer, tok, images));
  });
  return out;
}

// The soft tokens of each conversation's images through the checkpoint's vision tower (in its vision compute dtype),
// as the prompts' image features [N, F]; the tower's float32 copy is freed when they are made.
void fill_image_features(std::vector<trainer::ConversationPrompt>& conversations, model::Gemma4Multimodal& m) {
  bool any = false;
  for (trainer::ConversationPrompt& c : conversations) {
    if (c.images.empty()) continue;
    any = true;
    RF_CHECK(m.vision_feature_dim() > 0, c.image_paths[0], ": the checkpoint has no vision projection ",
             "(model.embed_vision.embedding_projection.weight) to take the tower's soft tokens");
    trainer::encode_prompt_images(c.prompt, c.images, c.image_paths, *m.vision_tower());
    c.images.clear();
  }
  if (any) m.drop_vision_tower();
}

// input_ids' [B, S] from the file's header, before the checkpoint is loaded.
std::pair<int64_t, int64_t> prompt_shape(const std::string& path) {
  const io::SafetensorsFile in = io::SafetensorsFile::open(path);
  io::DimSizes dims;
  (void)io::require(in, {"input_ids", {io::StDType::I32, io::StDType::I64}, {"B", "S"}, ""}, dims);
  RF_CHECK(dims["B"] >= 1, path, ": no prompts (input_ids has no rows)");
  RF_CHECK(dims["S"] >= 1, path, ": the prompt is empty (input_ids has rows of 0 tokens)");
  return {dims["B"], dims["S"]};
}

int run_generate(const GenerateCliOptions& opt) {
  if (opt.threads > 0) omp_set_num_threads(opt.threads);
  const std::unique_ptr<comm::Communicator> world = comm::make_mpi_world();
  const int P = world->size(), rank = world->rank();
  // EP groups: ep consecutive ranks, as training's (trainer/set_up.cpp), each a slice of the one CP group.
  const int ep = opt.ep;
  agree(*world, [&] { RF_CHECK(P % ep == 0, "--ep ", ep, " does not divide the ", P, " rank(s) of this job"); });
  const std::unique_ptr<comm::Communicator> ep_group = world->split(rank / ep, rank % ep);
  const model::ComputeDtype dtype = model::parse_compute_dtype(opt.compute_dtype);
  const DType cache_dtype = cache_dtype_of(opt.cache_dtype, model::attention_dtype(dtype));
  model::Checkpoint ck;
  std::unique_ptr<text::Tokenizer> tokenizer;  // with --prompt and --messages
  std::vector<model::Prompt> prompts;
  std::vector<trainer::ConversationPrompt> conversations;  // with --messages
  Decoding dec;
  agree(*world, [&] {
    if (rank == 0) {
      if (!opt.out.empty()) io::check_writable(opt.out);
      if (!opt.logits_out.empty()) io::check_writable(opt.logits_out);
    }
    RF_CHECK(int{!opt.prompt.empty()} + int{!opt.in.empty()} + int{!opt.messages.empty()} == 1,
             "give one of --prompt TEXT, --messages FILE.jsonl or --in PROMPTS.safetensors");
    if (!opt.messages.empty()) {
      tokenizer = text::load_tokenizer(opt.model);
      conversations = read_conversations(opt.messages, opt.model, *tokenizer);
    }
    if (!opt.prompt.empty()) tokenizer = text::load_tokenizer(opt.model);
    for (const std::string& text : opt.prompt) {
      RF_CHECK(!text.empty(), "--prompt: the prompt is empty (no text to start from)");
      model::Prompt p;
      if (const std::optional<int32_t> bos = tokenizer->bos_id()) p.ids.push_back(*bos);
      const std::vector<int32_t> ids = tokenizer->encode(text);
      p.ids.insert(p.ids.end(), ids.begin(), ids.end());
      prompts.push_back(std::move(p));
    }
    std::vector<int64_t> lengths;  // every prompt's tokens: they are decoded together, their caches all held
    for (const model::Prompt& p : prompts) lengths.push_back(static_cast<int64_t>(p.ids.size()));
    for (const trainer::ConversationPrompt& c : conversations)
      lengths.push_back(static_cast<int64_t>(c.prompt.ids.size()));
    if (!opt.in.empty()) {
      const auto [B, S] = prompt_shape(opt.in);
      lengths.assign(static_cast<size_t>(B), S);
    }
    const int64_t S = *std::max_element(lengths.begin(), lengths.end());
    const std::string source = !opt.prompt.empty()     ? std::string("--prompt")
                               : !opt.messages.empty() ? opt.messages
                                                       : opt.in;
    // --ep: a rank holds its EP rank's experts only, placed before any weight is allocated so that the loader reads
    // those rows of the files alone (a checkpoint written at any EP holds whole tensors). Under --lora the frozen base
    // stays whole (mapped from the files, a rank touching its experts' pages only) and the experts' adapters are
    // placed as training's (LoraStore::place_experts).
    std::unique_ptr<model::LoraStore> lora;
    model::LoraStore* adapters = nullptr;  // owned by ck.model from the load on
    if (!opt.lora.empty()) {
      lora = std::make_unique<model::LoraStore>(model::read_peft_config(opt.lora));
      if (ep > 1) lora->place_experts(rank % ep, ep);
      adapters = lora.get();
    }
    const bool hold_experts = ep > 1 && !lora;
    model::PlaceParams place;
    if (hold_experts)
      place = [&](const model::Gemma4Multimodal& shapes) {
        return model::hold_expert_rows(shapes.params(), rank % ep, ep);
      };
    ck = model::load_checkpoint(
        opt.model,
        [&](const model::Gemma4Multimodal& shapes) {
          model::check_expert_parallelism(shapes.config(), ep, concat("--ep ", ep));
          const Decoding d = decoding_of(opt);
          // The other EP ranks' experts (their float32 weights and bf16 copies) are not in this rank's memory.
          const MemoryBreakdown need = model::generate_job_memory_at_least(shapes, lengths, d.max_new_tokens, P, rank,
                                                                           dtype, cache_dtype, hold_experts ? ep : 1);
          check_memory(need, source + ": generate",
                       concat(" for ", lengths.size() > 1 ? concat(lengths.size(), " prompts of at most ") : "", S,
                              " prompt tokens and ", d.max_new_tokens, " new over ", P, " rank(s)",
                              ep > 1 ? concat(", the experts over --ep ", ep) : ""));
        },
        std::move(lora), false, place);
    if (adapters) model::load_peft_adapter(*adapters, opt.lora);
    ck.model->set_vision_compute_dtype(dtype);
    dec = decoding_of(opt);
    if (!opt.in.empty()) prompts = prompts_of(read_batch(opt.in, *ck.model, true), opt.in);
    if (!opt.messages.empty()) {
      fill_image_features(conversations, *ck.model);
      for (trainer::ConversationPrompt& c : conversations) prompts.push_back(std::move(c.prompt));
    }
    for (size_t i = 0; i < prompts.size(); ++i)
      model::check_prompt(ck.model->decoder(), prompts[i], dec.max_new_tokens, P,
                          opt.messages.empty() ? concat(source, ": prompt ", i) : concat(source, ": conversation ", i));
  });
  const model::Gemma4Model& m = ck.model->decoder();
  const std::unique_ptr<DecodeContext> ctx =
      cp::make_decode_context(*world, model::cache_layers(m), model::attention_dtype(dtype), cache_dtype, {},
                              ep_group.get());
  model::GenerateOptions go;
  go.max_new_tokens = dec.max_new_tokens;
  go.stop_ids = dec.stop_ids;
  go.sampling = dec.sampling;
  go.compute_dtype = dtype;

  std::vector<float> first_logits;
  int64_t steps = 0;
  const int64_t V = m.config().vocab_size;
  BatchStream stream(prompts.size(), tokenizer.get());
  const std::vector<model::Generated> generated =
      model::generate(m, *ctx, prompts, go, [&](int i, int32_t token, std::span<const float> z, bool last) {
        if (rank != 0) return;
        stream.token(i, token, last);
        if (i == 0 && !opt.logits_out.empty()) {
          first_logits.insert(first_logits.end(), z.begin(), z.end());
          ++steps;
        }
      });
  std::string records;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const model::Generated& g = generated[i];
    const double prompt_tokens = static_cast<double>(prompts[i].ids.size());
    const double decoded = static_cast<double>(g.tokens.size()) - 1;
    nlohmann::ordered_json r;
    if (tokenizer) r["text"] = tokenizer->decode(g.tokens, true);
    r["token_ids"] = g.tokens;
    r["stop_reason"] = g.stop_reason;
    r["prompt_tokens"] = prompts[i].ids.size();
    r["prefill_tokens_per_s"] = g.prefill_seconds > 0 ? prompt_tokens / g.prefill_seconds : 0.0;
    r["decode_tokens_per_s"] = g.decode_seconds > 0 && decoded > 0 ? decoded / g.decode_seconds : 0.0;
    r["batch"] = prompts.size();
    r["ranks"] = P;
    r["cache_bytes"] = g.cache_bytes;
    r["max_sliding_positions"] = g.max_sliding_positions;
    records += r.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  }
  agree(*world, [&] {
    if (rank != 0) return;
    std::optional<io::AtomicFile> out_file, logits_file;
    std::vector<io::AtomicFile*> all;
    if (!opt.out.empty()) {
      out_file.emplace(opt.out);
      out_file->write(records);
      all.push_back(&*out_file);
    }
    if (!opt.logits_out.empty()) {
      io::SafetensorsWriter w;
      w.add("logits", io::StDType::F32, {steps, V}, std::span<const float>(first_logits));
      logits_file.emplace(opt.logits_out);
      w.write(*logits_file);
      all.push_back(&*logits_file);
    }
    io::commit_all(all);
  });
  return 0;
}

}  // namespace

void add_generate_command(CLI::App& app, Runner& run) {
  auto opt = std::make_shared<GenerateCliOptions>();
  CLI::App* cmd = app.add_subcommand("generate", "Generate tokens from a Gemma 4 checkpoint with a KV cache");
  cmd->add_option("--model", opt->model, "Checkpoint directory: config.json, *.safetensors, generation_config.json")
      ->required();
  cmd->add_option("--lora", opt->lora, "A PEFT LoRA adapter directory over --model");
  cmd->add_option("--prompt", opt->prompt,
                  "A prompt as text, tokenized with the checkpoint's tokenizer after BOS (repeat it: decoded together)")
      ->expected(1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  cmd->add_option("--messages", opt->messages,
                  "Conversations, one a line ({\"messages\": [...], \"tools\": [...]?}), rendered through the "
                  "checkpoint's chat template with the generation prompt");
  cmd->add_option("--in", opt->in, "Prompts: input_ids [B, S], one prompt a row (the batch file of `forward`)");
  cmd->add_option("--max-new-tokens", opt->max_new_tokens,
                  "New tokens at most (default: generation_config.json's, "
                  "else 256)")
      ->check(CLI::Range(1, std::numeric_limits<int>::max()));
  cmd->add_flag("--greedy", opt->greedy, "Greedy decoding (argmax), whatever generation_config.json says");
  cmd->add_option("--temperature", opt->temperature, "Sampling temperature");
  cmd->add_option("--top-k", opt->top_k, "Keep the k most likely tokens (0: off)");
  cmd->add_option("--top-p", opt->top_p, "Keep the smallest set of tokens whose probability reaches p");
  cmd->add_option("--min-p", opt->min_p, "Drop tokens less likely than min-p times the most likely");
  cmd->add_option("--seed", opt->seed, "The sampler's seed (the same tokens at every rank count)");
  cmd->add_option("--out", opt->out, "One JSON object a prompt: token_ids, stop_reason, tokens/s");
  cmd->add_option("--logits-out", opt->logits_out, "The first prompt's logits of every step, logits [N, V]");
  cmd->add_option("--ep", opt->ep,
                  "Expert parallelism: groups of E consecutive ranks divide every MoE layer's experts (E divides the "
                  "ranks and the experts; default 1: every expert on every rank)")
      ->check(CLI::Range(1, std::numeric_limits<int>::max()));
  cmd->add_option("--threads", opt->threads, "Threads per rank (default: every core)")
      ->check(CLI::Range(1, kMaxThreads));
  cmd->add_option("--compute-dtype", opt->compute_dtype, "float32 (default) or bfloat16, as `forward`")
      ->check(CLI::IsMember({"float32", "bfloat16", "f32", "bf16"}));
  cmd->add_option("--cache-dtype", opt->cache_dtype,
                  "The KV cache's storage: bfloat16 halves it under float32 compute (widened when read); default: "
                  "what attention reads")
      ->check(CLI::IsMember({"float32", "bfloat16", "f32", "bf16"}));
  cmd->callback([&run, opt] { run = [opt] { return run_generate(*opt); }; });
}

}  // namespace rf::cli
