// ringflex trainer: setting up a run (its groups, the model in its parameter store, the data, the optimizer state).
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "core/error.h"
#include "core/memory.h"
#include "io/atomic_file.h"
#include "io/safetensors.h"
#include "io/tensor_access.h"
#include "model/builtin_configs.h"
#include "model/expert_store.h"
#include "model/lora_store.h"
#include "model/peft_files.h"
#include "model/vision.h"
#include "model/vision_encoder.h"
#include "trainer/checkpoint.h"
#include "trainer/data.h"
#include "trainer/optimizer.h"
#include "trainer/run.h"
#include "trainer/state/expert_state.h"
#include "trainer/state/held_checkpoint.h"
#include "trainer/state/held_expert_store.h"
#include "trainer/state/sharded_store.h"

namespace rf::trainer::detail {

namespace fs = std::filesystem;

// A resumed run must continue the same stream of rows with the same batches.
void check_resume_compatible(const TrainConfig& now, const std::string& saved_yaml, const std::string& dir) {
  const TrainConfig then = parse_config(saved_yaml, dir + "/trainer_state.json config");
  const auto same = [&](bool equal, const char* field) {
    RF_CHECK(equal, "--resume ", dir, ": ", field, " differs from the run that wrote the checkpoint");
  };
  // The weights come from the checkpoint, so another model in the config would train the checkpoint's model while
  // the new checkpoints recorded the config's.
  same(now.model.path == then.model.path && (!now.model.path.empty() || now.model.builtin == then.model.builtin),
       now.model.path.empty() && then.model.path.empty() ? "model.builtin" : "model.path");
  same(now.train.seq_len == then.train.seq_len, "train.seq_len");
  same(now.train.global_batch == then.train.global_batch, "train.global_batch");
  same(now.train.seed == then.train.seed, "train.seed");
  same(now.data.source == then.data.source, "data.source");
  same(now.data.path == then.data.path, "data.path");
  same(now.data.image_soft_tokens == then.data.image_soft_tokens, "data.image_soft_tokens");
  same(now.model.freeze == then.model.freeze, "model.freeze");
  // The tower's parameters are in the optimizer state (and written in float32) only when it trains.
  same(now.model.train_vision == then.model.train_vision, "model.train_vision");
  same(now.model.lora_rank == then.model.lora_rank && now.model.lora_alpha == then.model.lora_alpha &&
           now.model.lora_target == then.model.lora_target &&
           now.model.lora_target_regex == then.model.lora_target_regex &&
           now.model.lora_target_parameters == then.model.lora_target_parameters &&
           now.model.lora_use_rslora == then.model.lora_use_rslora,
       "model.lora");
}

namespace {

// Loaded weights must be finite before step 1: a NaN would only show as a non-finite loss after the first step's
// work. Names the single-file checkpoint, or the directory of a sharded one.
void check_loaded_weights(const model::Checkpoint& ck, const std::string& dir, const ShardedStore* sharded) {
  const fs::path single = fs::path(dir) / "model.safetensors";
  std::error_code ec;
  const std::string where = fs::exists(single, ec) ? single.string() : dir;
  const model::ParamStore& store = ck.model->params();
  for (size_t i = 0; i < store.size(); ++i) {  // named as in the files, where the user can look it up
    const model::ParamInfo& p = store.info(i);
    if (p.holds_part()) {  // expert rows: indexed in the whole tensor, as in the files
      const int64_t first = p.rows_begin * model::row_elements(p);
      const float* values = store.weight(i);
      for (int64_t k = 0; k < p.numel; ++k)
        if (!std::isfinite(values[k]))
          rf::fail(where, ": tensor `", model::file_name_of(p.name, ck.text_prefix), "` has ", values[k], " at ",
                   io::index_string(first + k, p.whole_shape()));
      continue;
    }
    if (sharded != nullptr && sharded->masters_sharded()) {  // each rank checks the piece it keeps
      int64_t first = 0;
      const std::span<const float> piece = sharded->own_piece(i, &first);
      for (size_t k = 0; k < piece.size(); ++k)
        if (!std::isfinite(piece[k]))
          rf::fail(where, ": tensor `", model::file_name_of(p.name, ck.text_prefix), "` has ", piece[k], " at ",
                   io::index_string(first + static_cast<int64_t>(k), p.shape));
      continue;
    }
    const std::string name = model::file_name_of(p.name, ck.text_prefix);
    const model::HeldWeight held = store.held_weight(i);
    if (held.dtype == model::HeldDType::F32) {
      check_loaded_tensor(where, name, std::span<const float>(store.weight(i), static_cast<size_t>(p.numel)), p.shape);
      continue;
    }
    // A base held in the files' dtype (a LoRA store): widened a block of rows at a time, not the whole tensor.
    constexpr int64_t kBlockElements = int64_t{1} << 22;
    const int64_t row = p.shape.size() >= 2 ? p.numel / p.shape[0] : p.numel;
    const int64_t rows_per_block = std::max<int64_t>(1, kBlockElements / std::max<int64_t>(row, 1));
    std::vector<float> block;
    for (int64_t r0 = 0; r0 * row < p.numel; r0 += rows_per_block) {
      const int64_t n = std::min(p.numel - r0 * row, rows_per_block * row);
      block.resize(static_cast<size_t>(n));
      model::widen(held, r0 * row, n, block.data());
      check_loaded_tensor(where, rf::concat(name, " (rows from ", r0, ")"), block,
                          {n / std::max<int64_t>(row, 1), row});
    }
  }
}

// checkpoint.dir need not exist (the first save creates it and its parents), but its nearest existing ancestor
// must be a directory this process can write.
void check_creatable_directory(const std::string& dir, const char* field) {
  std::error_code ec;
  fs::path at = fs::absolute(dir, ec);
  while (!fs::exists(at, ec) && at.has_parent_path() && at != at.parent_path()) at = at.parent_path();
  RF_CHECK(fs::is_directory(at, ec), field, " = '", dir, "': ", at.string(), " is not a directory");
  RF_CHECK(::access(at.c_str(), W_OK | X_OK) == 0, field, " = '", dir, "': cannot write in ", at.string(), ": ",
           std::strerror(errno));
}

// The run's outputs, checked before any step: a metrics file, loss picture or checkpoint directory that cannot be
// written would otherwise fail only at its first write, after the steps before it. The default loss picture lives
// in checkpoint.dir, which the checkpoint check covers.
void check_outputs(const TrainConfig& c, const TrainOptions& o) {
  if (!o.metrics_path.empty()) io::check_writable(o.metrics_path);
  if (!o.svg_path.empty()) io::check_writable(o.svg_path);
  if (!o.stats_path.empty()) io::check_writable(o.stats_path);
  if (!c.train.samples_prompts.empty() && !o.metrics_path.empty()) io::check_writable(samples_path(o.metrics_path));
  if (!c.checkpoint.dir.empty()) check_creatable_directory(c.checkpoint.dir, "checkpoint.dir");
}

}  // namespace

// The run's groups and the model's parallel context (collectives: every rank, in the same order).
void join_groups(Run& r) {
  r.cp_group = r.world.split(r.dp_index, r.cp_index, r.timeout);
  r.dp_group = r.world.split(r.cp_index, r.dp_index, r.timeout);
  const int ep = r.cfg.parallelism.ep;  // EP groups: ep consecutive world ranks
  r.ep_group = r.world.split(r.world.rank() / ep, r.world.rank() % ep, r.timeout);
  r.edp_group = r.world.split(r.world.rank() % ep, r.world.rank() / ep, r.timeout);
  cp::CpAttentionOptions co;
  co.scheme = cp::scheme_name(r.cfg.parallelism.sharding);  // cp's options also take `auto`, a spelling
  co.timeout = r.timeout;
  r.context = cp::make_parallel_context(*r.cp_group, co, r.ep_group.get(), r.cfg.parallelism.split_vision);
  r.mode->join(r);
}

// parallelism.ep against the model: its MoE layers' experts must divide over the EP ranks.
void check_expert_parallelism(const TrainConfig& cfg, const model::Gemma4Config& mc) {
  model::check_expert_parallelism(mc, cfg.parallelism.ep, rf::concat("config: parallelism.ep = ", cfg.parallelism.ep));
}

// What the run needs, checked on every rank before the weights, gradients and moments are allocated. The
// train.samples prompts are read here, from the model's shapes, as their KV cache is part of it.
void check_fits(Run& r, const model::Gemma4Multimodal& shapes) {
  if (!r.cfg.train.samples_prompts.empty() && r.samples.prompts.empty())
    r.samples = read_sample_prompts(r.cfg, shapes, r.cfg.parallelism.cp);
  const std::vector<int64_t> prompts = prompt_lengths(r.samples);
  r.cfg = choose_recompute(r.cfg, shapes, r.world.size(), local_ranks(), prompts, available_memory_bytes());
  r.checked = train_memory_at_least(r.cfg, shapes, r.world.size(), local_ranks(), prompts);
  check_memory(r.checked, "train", rf::concat(" at seq_len ", r.cfg.train.seq_len, " over cp ", r.cfg.parallelism.cp));
  if (!r.cfg.train.spill_dir.empty())
    check_disk(train_spill_bytes(r.cfg, shapes), r.cfg.train.spill_dir,
               rf::concat("train's spill file (train.spill_dir) at seq_len ", r.cfg.train.seq_len, " over cp ",
                          r.cfg.parallelism.cp));
}

std::unique_ptr<model::Gemma4Multimodal> builtin_shapes(const TrainConfig& cfg,
                                                        std::unique_ptr<model::ParamStore> store) {
  const std::string text = model::builtin_config_json(cfg.model.builtin);
  const std::string source = "model.builtin " + cfg.model.builtin;
  const model::VisionConfig tower = model::VisionConfig::from_config_json(text, source).value();
  // With model.train_vision the tower's parameters are registered after the decoder's, before the store allocates.
  model::MultimodalParts parts(model::kBuiltinFeatureDim, tower, cfg.model.train_vision);
  return std::make_unique<model::Gemma4Multimodal>(model::Gemma4Config::from_json(text, source), std::move(parts),
                                                   model::TensorSet::Storage::Deferred, std::move(store));
}

std::unique_ptr<model::Gemma4Multimodal> model_shapes(const TrainConfig& cfg) {
  return cfg.model.path.empty() ? builtin_shapes(cfg, nullptr)
                                : model::checkpoint_shapes(cfg.model.path, cfg.model.train_vision);
}

// The base: from model.path, or the built-in model from train.seed (a LoRA resume builds it again: it never trains).
void load_base(Run& r) {
  const TrainConfig& cfg = r.cfg;
  if (!cfg.model.path.empty()) {
    r.ck = model::load_checkpoint(
        cfg.model.path, [&](const model::Gemma4Multimodal& shapes) { check_fits(r, shapes); }, r.mode->make_store(r),
        cfg.model.train_vision, r.mode->place(r));
    return;
  }
  const std::string text = model::builtin_config_json(cfg.model.builtin);
  const std::string source = "model.builtin " + cfg.model.builtin;
  const model::VisionConfig tower = model::VisionConfig::from_config_json(text, source).value();
  check_fits(r, *builtin_shapes(cfg, nullptr));
  r.ck.model = builtin_shapes(cfg, r.mode->make_store(r));
  r.ck.model->params().allocate_weights();
  // Every slot, the tower's last (so the decoder draws the same values with and without model.train_vision).
  r.ck.model->init_random(cfg.train.seed, static_cast<float>(cfg.model.init_std));
  r.mode->drawn(r);  // init_random filled every slot: the mode's own start (LoRA's initial adapters)
  r.ck.text_prefix = model::kMultimodalTextPrefix;
  // transformers sizes the projection's input by the tower's width: the two must agree.
  RF_CHECK(tower.hidden_size == model::kBuiltinFeatureDim, source, ": vision_config.hidden_size = ", tower.hidden_size,
           ", the projection takes ", model::kBuiltinFeatureDim);
  r.ck.model->kept() = model::init_vision_tower(tower, cfg.train.seed);
  if (cfg.model.train_vision) r.ck.model->adopt_tower_parameters();
}

namespace {

// The model, fresh (load_base) or resumed with where the run stands (r.state), its loaded weights checked finite.
void load_model(Run& r) {
  const TrainConfig& cfg = r.cfg;
  if (!r.options.resume.empty()) {
    r.resume_dir = resolve_checkpoint(r.options.resume);
    r.mode->resume(r);
    RF_CHECK(r.state.step < cfg.train.steps, "--resume ", r.resume_dir, ": the checkpoint is at step ", r.state.step,
             " and train.steps = ", cfg.train.steps, " leaves nothing to do");
  } else {
    load_base(r);
  }
  const std::string loaded_from = r.mode->weights_source(r);
  // Held experts: the rest in the inner store (its pieces under shard full), this rank's experts' rows.
  if (!loaded_from.empty()) check_loaded_weights(r.ck, loaded_from, r.mode->sharded_masters());
}

// The tokenizer (with the tokenizer_config.json beside it) and the chat template the data was read with go into
// every checkpoint the run writes, as model.path's own do: `ringflex generate` and AutoTokenizer then read the
// checkpoint as the data saw it. A tokenizer of the other kind from model.path is dropped (tokenizer.json wins).
void carry_data_text_files(const TrainConfig& cfg, model::Checkpoint& ck) {
  if (!cfg.data.tokenizer.empty()) {
    const fs::path tokenizer(cfg.data.tokenizer);
    const bool json = tokenizer.extension() == ".json";
    ck.side_files.erase(json ? "tokenizer.model" : "tokenizer.json");
    ck.side_files[json ? "tokenizer.json" : "tokenizer.model"] = model::read_side_file(tokenizer.string());
    const fs::path tokenizer_config = tokenizer.parent_path() / "tokenizer_config.json";
    if (fs::is_regular_file(tokenizer_config))
      ck.side_files["tokenizer_config.json"] = model::read_side_file(tokenizer_config.string());
  }
  if (!cfg.data.chat_template.empty())
    ck.side_files["chat_template.jinja"] = model::read_side_file(cfg.data.chat_template);
}

// The data, its rows checked against the model; a frozen vision tower encodes its images here and is dropped.
void set_up_data(Run& r) {
  const TrainConfig& cfg = r.cfg;
  const model::Gemma4Multimodal& m = *r.ck.model;
  check_expert_parallelism(cfg, m.config());
  const int width = m.vision_feature_dim() > 0 ? m.vision_feature_dim() : m.config().hidden_size;
  // Unfilled row positions are doc 0 with ignored labels (masked everywhere), so a config without a pad id
  // (pad_token_id null) fills them with token 0: any in-vocabulary id would do.
  const DataContract contract{m.config().vocab_size, m.config().pad_token_id.value_or(0), width, cfg.model.path};
  const std::string& config_json = m.config().source_json;
  ImageContract images;
  images.tokens = model::MultimodalTokens::from_config_json(config_json, "the model's config.json");
  images.rank = cfg.parallelism.split_vision ? r.world.rank() : 0;  // without the split each rank encodes them all
  images.ranks = cfg.parallelism.split_vision ? r.world.size() : 1;
  images.train_vision = cfg.model.train_vision;
  // A frozen tower encodes the data's images once, here; its float32 copy of the weights goes with it. A trained one
  // (model.train_vision) is kept and encodes every micro-batch's images.
  images.vision = [&]() -> const model::VisionEncoder* { return r.ck.model->vision_tower(); };
  r.ck.model->set_vision_compute_dtype(cfg.model.compute_dtype);  // the tower multiplies as the decoder does
  r.data = make_data_source(cfg, contract, images);
  if (!cfg.train.samples_prompts.empty()) {  // the prompts were read by the memory check (check_fits)
    r.samples.stop_ids = sample_stop_ids(r.ck.side_files, (fs::path(r.ck.source) / "generation_config.json").string());
  }
  carry_data_text_files(cfg, r.ck);
  // train.samples' images: a frozen tower's soft tokens are the same at every step, made here before it goes; a
  // trained one encodes them at each sample step (generate_samples).
  if (has_sample_images(r.samples) && !cfg.model.train_vision) {
    RF_CHECK(images.vision() != nullptr, cfg.train.samples_prompts, ": has images, but the model has no vision tower");
    encode_sample_images(r.samples, *images.vision(), false);
  }
  if (cfg.model.train_vision)
    RF_CHECK(images.vision() != nullptr, "config: model.train_vision, but the model has no vision tower");
  else
    r.ck.model->drop_vision_tower();
  r.feature_dim = r.data->feature_dim() > 0 ? width : 0;
}

// The parameters' final layout (frozen, the experts held, the moments' range of a sharded optimizer), the optimizer
// and its state, and the gradients.
void set_up_optimizer(Run& r) {
  const TrainConfig& cfg = r.cfg;
  // A store placed by the loader has the flags of model.freeze already (then this changes nothing).
  r.ck.model->params().freeze(cfg.model.freeze);
  r.mode->before_optimizer(r);
  r.adam = std::make_unique<AdamW>(r.ck.model->params(), cfg.optimizer);
  r.mode->after_optimizer(r);
  model::ParamStore& store = r.ck.model->params();
  store.allocate_grads();  // the trainable parameters' gradients, accumulated over a step's micro-batches
  store.set_param_dtype(cfg.model.param_dtype);
}

}  // namespace

// Setup: the model (fresh, from model.path or resumed), the data, the optimizer state and where the run stands.
// Everything here can fail on bad input and runs no collective, so train() runs it inside comm::agree.
void set_up(Run& r) {
  const TrainConfig& cfg = r.cfg;
  if (r.lead) {
    check_outputs(cfg, r.options);
    std::error_code ec;
    if (!cfg.checkpoint.dir.empty() && fs::is_directory(cfg.checkpoint.dir, ec)) remove_leftovers(cfg.checkpoint.dir);
  }
  load_model(r);
  set_up_data(r);
  set_up_optimizer(r);
  if (cfg.model.train_vision) r.tower = r.ck.model->vision_tower();  // the final model's tower, once the store is built
  r.state.seed = cfg.train.seed;
  r.state.config_yaml = to_yaml(cfg);
  r.training.want_grad = true;
  r.training.recompute_layers = cfg.train.recompute;
  r.training.keep_mlp_projections = cfg.train.keep_mlp;
  r.training.keep_o_proj_output = cfg.train.keep_o_proj;
  r.training.keep_down_proj_output = cfg.train.keep_down_proj;
  r.training.spill_dir = cfg.train.spill_dir;
  r.training.mlp_tile_tokens = cfg.train.mlp_tile_tokens;
  r.training.tile_mlp = cfg.train.tile_mlp;
  r.training.compute_dtype = cfg.model.compute_dtype;
}

}  // namespace rf::trainer::detail
