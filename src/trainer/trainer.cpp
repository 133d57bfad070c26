// ringflex trainer: the loop over a cp x dp grid (see trainer.h): train(), the step's metrics and outputs (the
// metrics line, progress, the checkpoint save). The run's state and its other pieces: trainer/run.h.
#include "trainer/trainer.h"

#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <exception>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>

#include "comm/agree.h"
#include "comm/blocked_time.h"
#include "core/error.h"
#include "core/memory.h"
#include "core/mix.h"
#include "io/atomic_file.h"
#include "model/matmul_bf16.h"
#include "trainer/checkpoint.h"
#include "trainer/metrics.h"
#include "trainer/run.h"

namespace rf::trainer {
namespace detail {
namespace {

namespace fs = std::filesystem;

std::string default_svg_path(const TrainConfig& c, const TrainOptions& o) {
  if (!o.svg_path.empty()) return o.svg_path;
  if (!c.checkpoint.dir.empty()) return (fs::path(c.checkpoint.dir) / "loss.svg").string();
  if (!o.metrics_path.empty()) return fs::path(o.metrics_path).replace_extension(".svg").string();
  return "";
}

void announce(const Run& r, Progress& progress) {
  const TrainConfig& cfg = r.cfg;
  progress.note(
      rf::concat("ringflex train: ", cfg.model.path.empty() ? "built-in " + cfg.model.builtin : cfg.model.path, ", ",
                 r.ck.model->params().total_elements(), " parameters, data ", name_of(cfg.data.source),
                 ", S = ", cfg.train.seq_len, ", global batch ", cfg.train.global_batch, " rows (dp ",
                 cfg.parallelism.dp, " x ", cfg.accumulation_steps(), " micro-batches of ", cfg.train.micro_batch,
                 "), cp ", cfg.parallelism.cp, r.resume_dir.empty() ? "" : ", resumed from " + r.resume_dir));
  progress.note("ringflex train: " + describe_recompute(cfg));
  if (r.training.compute_dtype == model::ComputeDtype::Bfloat16)
    progress.note(rf::concat("ringflex train: bf16 matmuls: ", model::bf16_matmul_path().description));
}

bool is_last(const Run& r, int64_t step) { return step == r.cfg.train.steps; }

// The step's metrics, with validation on its steps, recorded in the loss history and the result. Throughput:
// the step's non-padding tokens over its wall time, validation excluded; comm_wait_s: the seconds this rank blocked on
// communication in the step (comm::blocked_seconds).
StepMetrics record_step(Run& r, int64_t step, double loss, double lr, double norm, const TokenCounts& tokens,
                        double step_seconds, double comm_wait_s, double data_seconds, const ExpertTraffic& ep_moved,
                        TrainResult& result) {
  // The step's waits on the sharded store's collectives, taken before validation runs (whose are dropped).
  const std::optional<double> comm_wait = r.mode->take_comm_wait();
  StepMetrics sm;
  sm.step = step;
  sm.loss = loss;
  sm.lr = lr;
  sm.grad_norm = norm;
  sm.tokens = tokens.labels;
  sm.tokens_per_s = static_cast<double>(tokens.real) / step_seconds;
  if (r.world.size() > 1) {  // before the reductions below, whose own waits are not the step's
    double most = comm_wait_s;
    r.world.allreduce(&most, 1, comm::ReduceOp::Max, r.timeout);
    sm.comm_wait_s = most;
  }
  sm.data_share = data_seconds / step_seconds;
  r.world.allreduce(&sm.data_share, 1, comm::ReduceOp::Max, r.timeout);
  if (r.tower) {  // before validation, whose forward runs the tower too
    double share = r.tower_seconds / step_seconds;
    r.world.allreduce(&share, 1, comm::ReduceOp::Max, r.timeout);
    sm.tower_share = share;
  }
  const bool validation_step = (r.cfg.train.val_every > 0 && step % r.cfg.train.val_every == 0) || is_last(r, step);
  if (r.data->val_rows() > 0 && validation_step) sm.val_loss = validation_loss(r);
  r.tower_seconds = 0.0;  // the next step's
  sm.peak_rss_bytes = peak_rss_bytes();
  r.world.allreduce(&sm.peak_rss_bytes, 1, comm::ReduceOp::Max, r.timeout);
  if (r.cfg.parallelism.ep > 1) {  // the step's routed rows (ep_moved: this rank's), the most of any rank
    const model::Gemma4Config& mc = r.ck.model->config();
    const int64_t moe_layers = mc.enable_moe ? mc.num_layers : 0;  // every decoder layer has the MoE block
    int64_t moved[3] = {ep_moved.rows_sent, ep_moved.rows_received,
                        ep_moved.bytes_sent / std::max<int64_t>(1, moe_layers)};
    r.world.allreduce(moved, 3, comm::ReduceOp::Max, r.timeout);
    double exposed = ep_moved.seconds;
    r.world.allreduce(&exposed, 1, comm::ReduceOp::Max, r.timeout);
    sm.ep_rows_sent = moved[0];
    sm.ep_rows_received = moved[1];
    sm.ep_bytes_per_layer = moved[2];
    sm.ep_exposed_s = exposed;
    sm.ep_experts_held = r.mode->experts_held(mc.num_experts, r.cfg.parallelism.ep);
  }
  if (comm_wait) {
    double most = *comm_wait;
    r.world.allreduce(&most, 1, comm::ReduceOp::Max, r.timeout);
    sm.shard_comm_wait_s = most;
    r.mode->take_comm_wait();  // validation's
  }
  r.state.history.steps.push_back(static_cast<int>(step));
  r.state.history.loss.push_back(loss);
  if (sm.val_loss) {
    r.state.history.val_steps.push_back(static_cast<int>(step));
    r.state.history.val_loss.push_back(*sm.val_loss);
  }
  result.steps.push_back(sm);
  return sm;
}

// The checkpoint of the current step, every rank writing its part, then the loss picture. Rank 0 made the
// temporary directory (`pending`, in the agreement before) and writes the weights, each tensor read from the store
// only while it is written (a collective read when the weights are sharded: the other ranks take part in each);
// every rank writes its own moments when they are sharded, rank 0 all of them otherwise; rank 0 then renames the
// directory into place. Each part ends in an agreement, so a failure on any rank (a full disk, a file-size limit)
// ends every rank with its one line, and rank 0's `pending` removes the temporary directory as the error unwinds.
void save(Run& r, std::optional<PendingCheckpoint>& pending, comm::Timeout wait, Progress& progress,
          TrainResult& result) {
  const CheckpointSection& cfg = r.cfg.checkpoint;
  const std::string tmp = checkpoint_temp_path(cfg.dir, r.state.step);
  // The training state writes the weights and moments (state/state.h), then rank 0 renames the directory into place.
  r.mode->save(r, tmp, wait, [&](const model::ParamStore& store, const PendingCheckpoint::MomentLayout& moments) {
    if (!r.lead) return;
    result.last_checkpoint = pending->finish(store, r.state, moments, cfg.keep, r.options.before_checkpoint_rename);
    pending.reset();
    if (!result.svg_path.empty())
      io::write_file_atomically(result.svg_path, loss_svg(r.state.history, "ringflex train"));
    progress.note(rf::concat("step ", r.state.step, ": checkpoint ", result.last_checkpoint));
  });
  result.last_checkpoint = checkpoint_path(cfg.dir, r.state.step);  // known to every rank
}

// The step's outputs: the metrics line and the progress, written by rank 0 in one agreement (a failed write ends
// every rank together, with its line), and on checkpoint steps (every checkpoint.every and the last) the checkpoint
// and the picture.
void publish_step(Run& r, const StepMetrics& sm, double eta_s, std::optional<MetricsFile>& metrics, Progress& progress,
                  TrainResult& result) {
  const CheckpointSection& ck = r.cfg.checkpoint;
  const bool save_now = !ck.dir.empty() && ((ck.every > 0 && sm.step % ck.every == 0) || is_last(r, sm.step));
  std::optional<PendingCheckpoint> pending;  // rank 0's, while the ranks write the checkpoint
  comm::agree(r.world, [&] {
    if (metrics) metrics->append(metrics_json_line(sm));
    progress.step(sm, eta_s, is_last(r, sm.step) || sm.val_loss.has_value());
    if (sm.val_loss) progress.note(rf::concat("step ", sm.step, ": validation loss ", *sm.val_loss));
    if (save_now && r.lead) pending.emplace(ck.dir, sm.step);
  });
  if (!save_now) return;
  // A save is waited for as long as its bytes take at the slowest write rate, beyond --timeout: only a rank that is
  // gone or silent ends the job the hard way.
  // The files' layout (held experts: every expert, where the store registers this rank's).
  const std::unique_ptr<model::ParamStore> files = r.mode->files_registry(r);
  const int64_t bytes = checkpoint_bytes(r.ck, files ? *files : r.ck.model->params());
  save(r, pending, save_wait(r.timeout, bytes, r.options.slowest_checkpoint_write), progress, result);
}

// train.samples at a sample step: every prompt generated on every rank (generate_samples), then rank 0 writes them to
// the samples file and prints the first prompt's continuation, in one agreement.
void publish_samples(Run& r, int64_t step, std::optional<MetricsFile>& file, Progress& progress) {
  const std::vector<model::Generated> made = generate_samples(r);
  comm::agree(r.world, [&] {
    if (!r.lead) return;
    const SamplePrompts& s = r.samples;
    for (size_t i = 0; i < made.size(); ++i)
      if (file) file->append(sample_json_line(step, i, s.where[i], s.prompts[i], made[i], s.tok.get()));
    const std::vector<int32_t>& first = made.front().tokens;
    const std::string shown = s.tok                                   ? s.tok->decode(first, true)
                              : r.cfg.data.source == SourceKind::Mock ? mock::token_names(first)
                                                                      : ids_text(first);
    progress.note(rf::concat("step ", step, ": sample (", s.where.front(), "): ", shown));
  });
}

// --stats: the memory check's terms for this run (per rank: every rank's figure is the same, shards being padded),
// as set_up checked them against the machine (the training state's figures over the model's shapes, those of
// `ringflex train --plan`), beside every rank's measured peak RSS (a collective), written by rank 0 in one agreement.
void write_stats(Run& r, const std::string& path) {
  const MemoryBreakdown& need = r.checked;
  const int64_t mine = peak_rss_bytes();
  std::vector<int64_t> peaks(static_cast<size_t>(r.world.size()));
  r.world.allgather(&mine, peaks.data(), sizeof mine, r.timeout);
  comm::agree(r.world, [&] {
    if (!r.lead) return;
    nlohmann::json terms = nlohmann::json::array();
    for (const MemoryBreakdown::Term& t : need.terms()) terms.push_back({{"kind", t.name}, {"bytes", t.bytes}});
    const nlohmann::json j = {{"shard", name_of(r.cfg.parallelism.shard)},
                              {"ranks", r.world.size()},
                              {"ep", r.cfg.parallelism.ep},
                              {"recompute",
                               {{"layers", r.cfg.train.recompute},
                                {"keep_mlp", r.cfg.train.keep_mlp},
                                {"keep_o_proj", r.cfg.train.keep_o_proj},
                                {"keep_down_proj", r.cfg.train.keep_down_proj},
                                {"auto", r.cfg.train.automatic.any()}}},
                              {"memory_per_rank", {{"terms", terms}, {"total_bytes", need.total()}}},
                              {"peak_rss_bytes", peaks}};
    io::write_file_atomically(path, j.dump(2) + "\n");
  });
}

// Every rank resolved --resume and read the data on its own file system: ranks that found different files (a relative
// path from different working directories, machines holding different copies) would run different steps, or train
// on different rows, which shows as a failed collective or not at all. Their step, data position and first rows are
// compared here (a collective), and a rank that differs from rank 0 is named on every rank.
void agree_on_inputs(comm::Communicator& world, const Run& r) {
  const Row row = r.data->train_row(r.state.data_position);  // the first row the run trains on
  Fnv1a h;
  for (const std::vector<int32_t>* v : {&row.input_ids, &row.labels, &row.doc}) h.add(*v);
  constexpr size_t kFields = 4;
  const std::array<int64_t, kFields> mine = {r.state.step, r.state.data_position, static_cast<int64_t>(h.h),
                                             r.data->val_rows()};
  std::vector<int64_t> all(kFields * static_cast<size_t>(world.size()));
  world.allgather(mine.data(), all.data(), sizeof mine, r.timeout);
  for (int q = 1; q < world.size(); ++q) {
    const int64_t* other = all.data() + kFields * static_cast<size_t>(q);
    if (other[0] != all[0] || other[1] != all[1])
      throw comm::AgreedError(concat("ranks resumed from different checkpoints: rank ", q, " at step ", other[0],
                                     " (data position ", other[1], "), rank 0 at step ", all[0], " (data position ",
                                     all[1], "); every rank must find the same checkpoint under --resume"));
    if (other[2] != all[2] || other[3] != all[3])
      throw comm::AgreedError(concat("rank ", q, " read other data than rank 0 (its first training row or its ",
                                     "validation rows differ): every rank must find the same data.path"));
  }
}

}  // namespace
}  // namespace detail

comm::Timeout save_wait(comm::Timeout timeout, int64_t bytes, double bytes_per_s) {
  RF_CHECK(bytes >= 0 && bytes_per_s > 0, "save_wait: ", bytes, " bytes at ", bytes_per_s, " bytes/s");
  constexpr double kMsPerS = 1000.0;
  // Capped far beyond any job (a year), so that the sum cannot overflow the milliseconds' integer.
  constexpr double kLongestMs = 365.0 * 24 * 3600 * kMsPerS;
  const double write_ms = std::min(static_cast<double>(bytes) / bytes_per_s * kMsPerS, kLongestMs);
  return timeout + comm::Timeout(static_cast<int64_t>(std::ceil(write_ms)));
}
TrainResult train(const TrainConfig& cfg, comm::Communicator& world, const TrainOptions& options) {
  using namespace detail;  // the run's pieces (trainer/run.h)
  RF_CHECK(world.size() == cfg.parallelism.cp * cfg.parallelism.dp,
           "parallelism.cp * parallelism.dp = ", cfg.parallelism.cp * cfg.parallelism.dp, " but the job has ",
           world.size(), " rank(s)");
  if (cfg.train.threads > 0) omp_set_num_threads(cfg.train.threads);
  Run r(cfg, world, options);
  join_groups(r);
  comm::agree(world, [&] { set_up(r); });
  // Every rank chose the auto recompute fields from its own memory (check_fits); ranks that chose differently would
  // run different collectives under expert parallelism (an MoE layer's recompute), so they must agree.
  if (world.size() > 1 && r.cfg.train.automatic.any()) {
    const TrainSection& t = r.cfg.train;
    const std::vector<int64_t> chosen = {t.recompute, t.keep_mlp, t.keep_o_proj, t.keep_down_proj};
    comm::agree_equal(
        world, chosen,
        "what the backward recomputes: train.recompute / keep_* left at auto, each chosen from its rank's "
        "memory (set them in the config)");
  }
  // Each rank encoded its share of the data's images (ImageContract): now that every rank has read the data, all
  // of them get every image's soft tokens. A collective, so outside the setup, where a rank may have failed alone.
  if (world.size() > 1)
    r.data->sum_image_features(
        [&](std::vector<float>& v) { world.allreduce(v.data(), v.size(), comm::ReduceOp::Sum, r.timeout); });
  if (world.size() > 1) agree_on_inputs(world, r);

  TrainResult result;
  result.svg_path = default_svg_path(cfg, options);
  // Rank 0's metrics file, closed on every path; opening it is part of the agreement. A resume keeps the lines of
  // the steps its checkpoint holds.
  std::optional<MetricsFile> metrics;
  comm::agree(world, [&] {
    if (r.lead && !options.metrics_path.empty()) metrics.emplace(options.metrics_path, r.state.step);
  });
  // Rank 0's samples file (train.samples), beside the metrics file, kept as the metrics file is on a resume.
  std::optional<MetricsFile> samples;
  const std::string samples_file = samples_path(options.metrics_path);
  comm::agree(world, [&] {
    if (r.lead && !cfg.train.samples_prompts.empty() && !samples_file.empty())
      samples.emplace(samples_file, r.state.step);
  });
  Progress progress(r.lead ? options.progress : nullptr, cfg.train.steps, cfg.train.log_every);
  if (r.lead) announce(r, progress);

  const auto run_start = Clock::now();
  const int64_t first_step = r.state.step + 1;
  for (int64_t step = first_step; step <= cfg.train.steps; ++step) {
    const auto step_start = Clock::now();
    const double blocked_at_start = comm::blocked_seconds();
    std::vector<PackedBatch> batches;
    double data_seconds = 0.0;
    comm::agree(world, [&] {
      const auto data_start = Clock::now();
      batches = replica_micro_batches(r);
      data_seconds = seconds_since(data_start);
    });
    const TokenCounts tokens = count_tokens(r, batches);
    const ExpertTraffic ep_before = r.context.model->experts().traffic();
    const double loss = forward_backward(r, batches, tokens.labels);
    const ExpertTraffic ep_after = r.context.model->experts().traffic();
    reduce_gradients(r);
    double clip = 1.0;
    const double norm = clip_global_norm(r, cfg.optimizer.grad_clip, clip);
    check_finite_step(step, loss, norm, result.last_checkpoint);
    const double lr = apply_update(r, step, clip);
    r.state.step = step;
    r.state.data_position += cfg.train.global_batch;

    const StepMetrics sm =
        record_step(r, step, loss, lr, norm, tokens, seconds_since(step_start),
                    comm::blocked_seconds() - blocked_at_start, data_seconds,
                    {ep_after.rows_sent - ep_before.rows_sent, ep_after.rows_received - ep_before.rows_received,
                     ep_after.bytes_sent - ep_before.bytes_sent, ep_after.seconds - ep_before.seconds},
                    result);
    const double eta = seconds_since(run_start) / static_cast<double>(step - first_step + 1) *
                       static_cast<double>(cfg.train.steps - step);
    publish_step(r, sm, eta, metrics, progress, result);
    if (is_sample_step(cfg, step)) publish_samples(r, step, samples, progress);
  }
  comm::agree(world, [&] {
    if (metrics) metrics->close();
    if (samples) samples->close();
    if (r.lead && !result.svg_path.empty()) {
      io::write_file_atomically(result.svg_path, loss_svg(r.state.history, "ringflex train"));
      progress.note("loss picture: " + result.svg_path);
    }
    if (r.lead && !result.last_checkpoint.empty()) progress.note("checkpoint: " + result.last_checkpoint);
  });
  if (!options.stats_path.empty()) write_stats(r, options.stats_path);
  if (options.whole_model) r.mode->unshard();  // whole weights for the caller (every rank)
  result.model = std::move(r.ck.model);
  return result;
}

}  // namespace rf::trainer
