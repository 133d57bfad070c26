// ringflex trainer: the loop over a cp x dp grid (see trainer.h).
#include "trainer/trainer.h"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <optional>

#include "comm/agree.h"
#include "core/error.h"
#include "core/memory.h"
#include "cp/cp_backend.h"
#include "cpu/local_attention.h"
#include "io/atomic_file.h"
#include "model/matmul_bf16.h"
#include "model/memory.h"
#include "model/vision.h"
#include "model/vision_encoder.h"
#include "trainer/checkpoint.h"
#include "trainer/data.h"
#include "trainer/optimizer.h"

namespace rf::trainer {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// The built-in models: Gemma 4 shapes shrunk to train a few hundred steps in minutes on 2 cores. Five sliding
// layers of window 64 and one full layer (Gemma 4's 5:1 mix), GQA 4:2 on sliding and 4:1 with K = V on the full
// layer (as the 26B/31B), head dims 16 and 32 (sliding and global differ as in Gemma 4), vision-bidirectional
// image groups. The MoE variant adds Gemma 4's parallel MoE block (4 experts, top 2).
//
// Both are multimodal Gemma4ForConditionalGeneration models: their image features (kBuiltinFeatureDim wide) go
// through the trainable projection model.embed_vision.embedding_projection, which transformers only builds beside a
// vision tower. So the config holds a vision_config (a one-layer tower of width kBuiltinFeatureDim) and every
// checkpoint holds that tower, freshly initialised from train.seed and never trained (the built-in data brings
// features, not pixels): transformers loads the checkpoint with no missing and no unexpected weights.
constexpr const char* kTinyDense = R"({
  "architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "tie_word_embeddings": true,
  "text_config": {
    "model_type": "gemma4_text", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 6,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32,
    "num_global_key_value_heads": 1, "attention_k_eq_v": true, "sliding_window": 64,
    "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "sliding_attention",
                    "sliding_attention", "full_attention"],
    "final_logit_softcapping": 30.0, "hidden_size_per_layer_input": 0, "use_bidirectional_attention": "vision",
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1, "tie_word_embeddings": true,
    "intermediate_size": 128
  },
  "vision_config": {
    "model_type": "gemma4_vision", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "patch_size": 4, "pooling_kernel_size": 2,
    "position_embedding_size": 16
  }
})";
constexpr const char* kTinyMoeVlm = R"({
  "architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "tie_word_embeddings": true,
  "text_config": {
    "model_type": "gemma4_text", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 6,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32,
    "num_global_key_value_heads": 1, "attention_k_eq_v": true, "sliding_window": 64,
    "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "sliding_attention",
                    "sliding_attention", "full_attention"],
    "final_logit_softcapping": 30.0, "hidden_size_per_layer_input": 0, "use_bidirectional_attention": "vision",
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1, "tie_word_embeddings": true,
    "intermediate_size": 96, "enable_moe_block": true, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 48
  },
  "vision_config": {
    "model_type": "gemma4_vision", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "patch_size": 4, "pooling_kernel_size": 2,
    "position_embedding_size": 16
  }
})";

model::Batch as_batch(const PackedBatch& p) {
  model::Batch b;
  b.B = p.B;
  b.S = p.S;
  b.input_ids = p.input_ids.data();
  b.labels = p.labels.data();
  b.position_ids = p.position_ids.data();
  b.doc = p.doc.data();
  b.mm_token_type = p.mm_token_type.data();
  b.image_features = p.image_features.empty() ? nullptr : p.image_features.data();
  b.n_image_features = p.n_image_features;
  return b;
}

// Sums the trainable gradients over every rank of `c`, in rank order (Communicator::allreduce: the same bits on
// every rank and backend). One flat buffer, so the whole model is one collective rather than one per tensor.
void allreduce_gradients(comm::Communicator& c, model::TensorSet& grads, const std::vector<bool>& trainable,
                         comm::Timeout timeout) {
  if (c.size() == 1) return;
  std::vector<float> flat;
  for (size_t i = 0; i < grads.size(); ++i)
    if (trainable[i]) flat.insert(flat.end(), grads[i].data.begin(), grads[i].data.end());
  c.allreduce(flat.data(), flat.size(), comm::ReduceOp::Sum, timeout);
  size_t at = 0;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!trainable[i]) continue;
    std::copy(flat.begin() + static_cast<std::ptrdiff_t>(at),
              flat.begin() + static_cast<std::ptrdiff_t>(at + grads[i].data.size()), grads[i].data.begin());
    at += grads[i].data.size();
  }
}

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
}

// Loaded weights must be finite before step 1: a NaN would only show as a non-finite loss after the first step's
// work. Names the single-file checkpoint, or the directory of a sharded one.
void check_loaded_weights(const model::Checkpoint& ck, const std::string& dir) {
  const fs::path single = fs::path(dir) / "model.safetensors";
  const std::string where = fs::exists(single) ? single.string() : dir;
  for (const model::Tensor& p : ck.model->params())  // named as in the files, where the user can look it up
    check_loaded_tensor(where, model::file_name_of(p.name, ck.text_prefix), p.data, p.shape);
}

std::string default_svg_path(const TrainConfig& c, const TrainOptions& o) {
  if (!o.svg_path.empty()) return o.svg_path;
  if (!c.checkpoint.dir.empty()) return (fs::path(c.checkpoint.dir) / "loss.svg").string();
  if (!o.metrics_path.empty()) return fs::path(o.metrics_path).replace_extension(".svg").string();
  return "";
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
  if (!c.checkpoint.dir.empty()) check_creatable_directory(c.checkpoint.dir, "checkpoint.dir");
}

}  // namespace

// Terms, each counting buffers train() surely holds through a step (float32 unless said):
//   weights          the parameters (and buffers), Gemma4Model::params()/buffers();
//   bf16 copies      with model.compute_dtype = bfloat16, the matrices' bf16 copies (Gemma4Model::bf16_weight_bytes);
//   gradients        `grads`, params().zeros_like(trainable): the trainable parameters only;
//   AdamW moments    exp_avg and exp_avg_sq, two more such sets;
//   the step's rows  this replica's global_batch / dp rows of seq_len tokens, five int32 arrays each (their image
//                    features not counted), built before the step's micro-batches run;
//   validation rows  this replica's share of data.val_rows (every dp-th row), the same arrays, which validate_now
//                    builds all at once while the step's rows are still held;
//   then the larger of what one micro-batch's run holds (model::run_memory_at_least: train.micro_batch rows of
//   ceil(seq_len / cp) tokens, a shard is never shorter, with train.recompute: "activations", "one layer" or
//   "loss chunk") and, on more than one rank, the "gradient reduction": the flat buffer of the trainable gradients
//   allreduce_gradients builds after the micro-batches ran, when their activations are gone.
// Left out, so the figure stays a lower bound: the ring's receive buffers (what a rank receives depends on each
// batch's documents; packed short documents need almost none), the data set's packed rows, the plan, the
// checkpoint writer's copies, and validation's forward (smaller than the training step's).
MemoryBreakdown train_memory_at_least(const TrainConfig& c, const model::Gemma4Model& m, int world_size) {
  const int64_t params = m.params().total_bytes();
  const std::vector<bool> trainable = trainable_mask(m.params(), c.model.freeze);
  int64_t trainable_bytes = 0;
  for (size_t i = 0; i < trainable.size(); ++i)
    if (trainable[i]) trainable_bytes += m.params()[i].numel() * static_cast<int64_t>(sizeof(float));
  constexpr int kMoments = 2;  // exp_avg, exp_avg_sq
  MemoryBreakdown need;
  need.add("weights", params + m.buffers().total_bytes());
  need.add("gradients", trainable_bytes);
  need.add("AdamW moments", checked_bytes({kMoments, trainable_bytes}));
  if (c.model.compute_dtype == "bfloat16") need.add("bf16 weight copies", m.bf16_weight_bytes());
  // A step builds all of this replica's rows before its micro-batches run: five int32 arrays a token (ids, labels,
  // positions, documents, image slots); image features not counted.
  constexpr int64_t kRowArrays = 5;
  need.add("the step's rows", checked_bytes({c.global_batch_per_replica(), c.train.seq_len,
                                             kRowArrays * static_cast<int64_t>(sizeof(int32_t))}));
  const int64_t val_rows_here = (int64_t{c.data.val_rows} + c.parallelism.dp - 1) / c.parallelism.dp;
  need.add("validation rows (data.val_rows)",
           checked_bytes({val_rows_here, c.train.seq_len, kRowArrays * static_cast<int64_t>(sizeof(int32_t))}));
  const int64_t L = (int64_t{c.train.seq_len} + c.parallelism.cp - 1) / c.parallelism.cp;
  model::RunMemoryArgs run;
  run.tokens = int64_t{c.train.micro_batch} * L;
  run.training = true;
  run.recompute_layers = c.train.recompute;
  run.keep_mlp_projections = c.train.keep_mlp;
  const MemoryBreakdown step = model::run_memory_at_least(m, run);
  const int64_t reduced = world_size > 1 ? trainable_bytes : 0;
  if (step.total() >= 0 && reduced > step.total())
    need.add("gradient reduction", reduced);
  else
    need.add(step);
  return need;
}

std::string builtin_config_json(const std::string& name) {
  if (name == "tiny_dense") return kTinyDense;
  if (name == "tiny_moe_vlm") return kTinyMoeVlm;
  rf::fail("model.builtin = '", name, "' is not one of tiny_dense, tiny_moe_vlm");
}

TrainResult train(const TrainConfig& cfg, comm::Communicator& world, const TrainOptions& options) {
  const int cp = cfg.parallelism.cp, dp = cfg.parallelism.dp;
  RF_CHECK(world.size() == cp * dp, "parallelism.cp * parallelism.dp = ", cp * dp, " but the job has ", world.size(),
           " rank(s)");
  const comm::Timeout timeout = comm::default_timeout();  // `ringflex ... --timeout SECONDS`
  const int cp_index = world.rank() % cp, dp_index = world.rank() / cp;
  std::unique_ptr<comm::Communicator> cp_group = world.split(dp_index, cp_index, timeout);
  std::unique_ptr<comm::Communicator> dp_group = world.split(cp_index, dp_index, timeout);
  const bool lead = world.rank() == 0;
  if (cfg.train.threads > 0) omp_set_num_threads(cfg.train.threads);
  // The model's attention: the local kernels, or the ring over this rank's CP group.
  std::unique_ptr<AttentionBackend> attention;
  if (cp == 1) {
    attention = std::make_unique<cpu::LocalAttention>();
  } else {
    cp::CpAttentionOptions co;
    co.scheme = cfg.parallelism.sharding;
    co.timeout = timeout;
    attention = std::make_unique<cp::CpAttention>(*cp_group, co);
  }

  // The model, the optimizer state and where the run stands; everything here can fail on bad input.
  model::Checkpoint ck;
  TrainState state;
  std::string resume_dir;
  std::unique_ptr<DataSource> data;
  std::unique_ptr<AdamW> adam_ptr;
  // What the run needs, checked on every rank before the weights, gradients and moments are allocated.
  const auto check_fits = [&](const model::Gemma4Model& shapes) {
    check_memory(train_memory_at_least(cfg, shapes, world.size()), "train",
                 rf::concat(" at seq_len ", cfg.train.seq_len, " over cp ", cp));
  };
  const auto setup = [&] {
    if (lead) check_outputs(cfg, options);
    if (!options.resume.empty()) {
      resume_dir = resolve_checkpoint(options.resume);
      LoadedCheckpoint loaded = load_train_checkpoint(resume_dir, check_fits);
      check_resume_compatible(cfg, loaded.state.config_yaml, resume_dir);
      ck = std::move(loaded.weights);
      state = std::move(loaded.state);
      RF_CHECK(state.step < cfg.train.steps, "--resume ", resume_dir, ": the checkpoint is at step ", state.step,
               " and train.steps = ", cfg.train.steps, " leaves nothing to do");
    } else if (!cfg.model.path.empty()) {
      ck = model::load_checkpoint(cfg.model.path, check_fits);
    } else {
      const std::string text = builtin_config_json(cfg.model.builtin);
      const std::string source = "model.builtin " + cfg.model.builtin;
      const model::Gemma4Config builtin = model::Gemma4Config::from_json(text, source);
      check_fits(model::Gemma4Model(builtin, kBuiltinFeatureDim, model::TensorSet::Storage::Deferred));
      ck.model = std::make_unique<model::Gemma4Model>(builtin, kBuiltinFeatureDim);
      ck.model->init_random(cfg.train.seed, static_cast<float>(cfg.model.init_std));
      ck.text_prefix = model::kMultimodalTextPrefix;
      const model::VisionConfig tower = model::VisionConfig::from_config_json(text, source).value();
      // transformers sizes the projection's input by the tower's width: the two must agree.
      RF_CHECK(tower.hidden_size == kBuiltinFeatureDim, source, ": vision_config.hidden_size = ", tower.hidden_size,
               ", the projection takes ", kBuiltinFeatureDim);
      ck.passthrough = model::init_vision_tower(tower, cfg.train.seed);
    }
    if (!resume_dir.empty() || !cfg.model.path.empty())
      check_loaded_weights(ck, resume_dir.empty() ? cfg.model.path : resume_dir);
    const model::Gemma4Model& mm = *ck.model;
    const int width = mm.vision_feature_dim() > 0 ? mm.vision_feature_dim() : mm.config().hidden_size;
    // Unfilled row positions are doc 0 with ignored labels (masked everywhere), so a config without a pad id
    // (pad_token_id null) fills them with token 0: any in-vocabulary id would do.
    const DataContract contract{mm.config().vocab_size, mm.config().pad_token_id.value_or(0), width, cfg.model.path};
    const std::string& config_json = mm.config().source_json;
    ImageContract images;
    images.tokens = model::MultimodalTokens::from_config_json(config_json, "the model's config.json");
    images.rank = world.rank();
    images.ranks = world.size();
    // The tower encodes the data's images once, here; its float32 copy of the weights goes with it.
    std::unique_ptr<model::VisionEncoder> tower;
    images.vision = [&]() -> const model::VisionEncoder* {
      if (!tower) {
        const std::optional<model::VisionConfig> vc =
            model::VisionConfig::from_config_json(config_json, "the model's config.json");
        if (!vc) return nullptr;
        tower = std::make_unique<model::VisionEncoder>(*vc, ck.passthrough);
      }
      return tower.get();
    };
    data = make_data_source(cfg, contract, images);
    adam_ptr = std::make_unique<AdamW>(mm.params(), trainable_mask(mm.params(), cfg.model.freeze), cfg.optimizer);
    if (!resume_dir.empty()) load_optimizer_state(resume_dir, *adam_ptr);
  };
  if (options.setup_guard)
    options.setup_guard(setup);
  else
    setup();
  // Each rank encoded its share of the data's images (ImageContract): now that every rank has read the data, all
  // of them get every image's soft tokens. A collective, so outside the setup, where a rank may have failed alone.
  if (world.size() > 1)
    data->sum_image_features(
        [&](std::vector<float>& v) { world.allreduce(v.data(), v.size(), comm::ReduceOp::Sum, timeout); });
  state.seed = cfg.train.seed;
  state.config_yaml = to_yaml(cfg);
  model::Gemma4Model& m = *ck.model;
  AdamW& adam = *adam_ptr;
  const int F = m.vision_feature_dim() > 0 ? m.vision_feature_dim() : m.config().hidden_size;

  TrainResult result;
  result.svg_path = default_svg_path(cfg, options);
  std::FILE* metrics = nullptr;
  if (lead && !options.metrics_path.empty()) {
    metrics = std::fopen(options.metrics_path.c_str(), resume_dir.empty() ? "w" : "a");
    RF_CHECK(metrics != nullptr, options.metrics_path, ": cannot open for writing");
  }
  Progress progress(lead ? options.progress : nullptr, cfg.train.steps, cfg.train.log_every);
  if (lead) {
    progress.note(
        rf::concat("ringflex train: ", cfg.model.path.empty() ? "built-in " + cfg.model.builtin : cfg.model.path, ", ",
                   m.params().total_elements(), " parameters, data ", cfg.data.source, ", S = ", cfg.train.seq_len,
                   ", global batch ", cfg.train.global_batch, " rows (dp ", dp, " x ", cfg.accumulation_steps(),
                   " micro-batches of ", cfg.train.micro_batch, "), cp ", cp,
                   resume_dir.empty() ? "" : ", resumed from " + resume_dir));
    if (cfg.model.compute_dtype == "bfloat16")
      progress.note(rf::concat("ringflex train: bf16 matmuls: ", model::bf16_matmul_path().description));
  }

  const int rows_per_replica = cfg.global_batch_per_replica(), micro = cfg.train.micro_batch;
  model::TensorSet grads = m.params().zeros_like(adam.trainable());
  const auto run_rows = [&](const std::vector<Row>& rows, double normalizer, bool grad) {
    const PackedBatch p = stack_rows(rows, data->feature_dim() > 0 ? F : 0);
    model::RunOptions ro;
    ro.want_grad = grad;
    ro.recompute_layers = cfg.train.recompute;
    ro.keep_mlp_projections = cfg.train.keep_mlp;
    ro.compute_dtype = model::parse_compute_dtype(cfg.model.compute_dtype);
    ro.loss_normalizer = std::max(1.0, normalizer);  // a batch without label tokens has loss 0, not 0 / 0
    return m.run(as_batch(p), ro, grad ? &grads : nullptr, *attention).loss;
  };

  const auto validate_now = [&] {
    std::vector<Row> mine;
    int64_t labels = 0;
    for (int j = 0; j < data->val_rows(); ++j) {
      Row r = data->val_row(j);
      labels += std::count_if(r.labels.begin(), r.labels.end(), [](int32_t l) { return l >= 0; });
      if (j % dp == dp_index) mine.push_back(std::move(r));
    }
    double loss = 0.0;
    for (size_t at = 0; at < mine.size(); at += static_cast<size_t>(micro)) {
      const std::vector<Row> part(mine.begin() + static_cast<std::ptrdiff_t>(at),
                                  mine.begin() + static_cast<std::ptrdiff_t>(std::min(mine.size(), at + micro)));
      loss += run_rows(part, static_cast<double>(labels), false);
    }
    dp_group->allreduce(&loss, 1, comm::ReduceOp::Sum, timeout);
    return loss;
  };

  const auto run_start = Clock::now();
  const int64_t first_step = state.step + 1;
  for (int64_t step = first_step; step <= cfg.train.steps; ++step) {
    const auto step_start = Clock::now();
    // 1. this replica's rows, as micro-batches
    std::vector<std::vector<Row>> micro_batches(static_cast<size_t>(cfg.accumulation_steps()));
    int64_t counts[2] = {0, 0};  // label tokens, non-padding tokens
    for (int a = 0; a < cfg.accumulation_steps(); ++a) {
      for (int j = 0; j < micro; ++j) {
        Row r = data->train_row(state.data_position + int64_t{dp_index} * rows_per_replica + int64_t{a} * micro + j);
        counts[0] += std::count_if(r.labels.begin(), r.labels.end(), [](int32_t l) { return l >= 0; });
        counts[1] += std::count_if(r.doc.begin(), r.doc.end(), [](int32_t d) { return d != 0; });
        micro_batches[a].push_back(std::move(r));
      }
    }
    // 2. the global batch's label tokens, counted once (over DP only)
    dp_group->allreduce(counts, 2, comm::ReduceOp::Sum, timeout);
    // 3. forward + backward of each micro-batch, gradients accumulating
    for (model::Tensor& g : grads) std::fill(g.data.begin(), g.data.end(), 0.0f);
    double loss = 0.0;
    for (const std::vector<Row>& mb : micro_batches) loss += run_rows(mb, static_cast<double>(counts[0]), true);
    dp_group->allreduce(&loss, 1, comm::ReduceOp::Sum, timeout);
    // 4. one deterministic reduction, clipping, the update
    allreduce_gradients(world, grads, adam.trainable(), timeout);
    const double norm = global_grad_norm(grads, adam.trainable());
    // A non-finite loss or gradient (a diverging run, or NaN weights resumed from a damaged checkpoint) stops the
    // run before the update, so neither the weights nor a checkpoint take it. Both figures are already the same
    // bits on every rank (the loss summed over the CP group in the model and over DP above, the norm taken from the
    // reduced gradients), so every rank stops at the same step with the same line without another collective.
    if (!std::isfinite(loss) || !std::isfinite(norm))
      throw comm::AgreedError(
          rf::concat("step ", step, ": the loss or the gradient is not finite (gradient norm ", norm,
                     "): the run diverged (try a lower optimizer.lr) or its weights are not finite; stopped "
                     "before the update",
                     result.last_checkpoint.empty() ? "" : ", last checkpoint " + result.last_checkpoint));
    clip_gradients(grads, adam.trainable(), norm, cfg.optimizer.grad_clip);
    const double lr = learning_rate(cfg.optimizer, cfg.schedule, static_cast<int>(step), cfg.train.steps);
    adam.step(m.params(), grads, lr, step);
    state.step = step;
    state.data_position += cfg.train.global_batch;

    StepMetrics sm;
    sm.step = step;
    sm.loss = loss;
    sm.lr = lr;
    sm.grad_norm = norm;
    sm.tokens = counts[0];
    // Training throughput: the step's non-padding tokens over its wall time, the validation after it excluded.
    const double seconds = std::chrono::duration<double>(Clock::now() - step_start).count();
    sm.tokens_per_s = static_cast<double>(counts[1]) / seconds;
    const bool last = step == cfg.train.steps;
    const bool validation_step = (cfg.train.val_every > 0 && step % cfg.train.val_every == 0) || last;
    if (data->val_rows() > 0 && validation_step) sm.val_loss = validate_now();
    sm.peak_rss_bytes = peak_rss_bytes();
    world.allreduce(&sm.peak_rss_bytes, 1, comm::ReduceOp::Max, timeout);
    state.history.steps.push_back(static_cast<int>(step));
    state.history.loss.push_back(loss);
    if (sm.val_loss) {
      state.history.val_steps.push_back(static_cast<int>(step));
      state.history.val_loss.push_back(*sm.val_loss);
    }
    result.steps.push_back(sm);
    if (metrics) {
      const std::string line = metrics_json_line(sm);
      std::fwrite(line.data(), 1, line.size(), metrics);
      std::fflush(metrics);
    }
    const double elapsed = std::chrono::duration<double>(Clock::now() - run_start).count();
    progress.step(sm,
                  elapsed / static_cast<double>(step - first_step + 1) * static_cast<double>(cfg.train.steps - step),
                  last || sm.val_loss.has_value());
    if (sm.val_loss) progress.note(rf::concat("step ", step, ": validation loss ", *sm.val_loss));

    const bool save =
        !cfg.checkpoint.dir.empty() && ((cfg.checkpoint.every > 0 && step % cfg.checkpoint.every == 0) || last);
    if (save) {
      // Rank 0 writes; the others learn whether it succeeded, so a failed save ends every rank together.
      int64_t failed = 0;
      std::string error;
      if (lead) {
        try {
          result.last_checkpoint = save_train_checkpoint(cfg.checkpoint.dir, ck, adam, state, cfg.checkpoint.keep,
                                                         options.before_checkpoint_rename);
          if (!result.svg_path.empty())
            write_file_atomically(result.svg_path, loss_svg(state.history, "ringflex train"));
        } catch (const rf::Error& e) {
          failed = 1;
          error = e.what();
        }
      }
      world.allreduce(&failed, 1, comm::ReduceOp::Max, timeout);
      RF_CHECK(!failed, lead ? error : "saving the checkpoint failed on rank 0");
      if (lead) progress.note("step " + std::to_string(step) + ": checkpoint " + result.last_checkpoint);
    }
  }
  if (metrics) std::fclose(metrics);
  if (lead && !result.svg_path.empty()) {
    write_file_atomically(result.svg_path, loss_svg(state.history, "ringflex train"));
    progress.note("loss picture: " + result.svg_path);
  }
  if (lead && !result.last_checkpoint.empty()) progress.note("checkpoint: " + result.last_checkpoint);
  result.model = std::move(ck.model);
  return result;
}

}  // namespace rf::trainer
