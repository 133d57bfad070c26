// ringflex forward: one forward (and optionally backward) pass of a Hugging Face Gemma 4 checkpoint on a batch,
// context-parallel over the ranks of mpirun.
//
//     [mpirun -n P] ringflex forward --model DIR --in BATCH.safetensors --out OUT.safetensors [--grad]
//                   [--no-logits] [--router] [--shard balanced|contiguous|zigzag|auto] [--algo ring|allgather]
//                   [--threads N] [--stats FILE.json] [--no-check-finite] [--timeout SECONDS]
//
// Input tensors: input_ids [B, S] (I32 or I64), and optionally labels [B, S] (-100 = ignored; the target of each
// position, already shifted), position_ids [B, S], doc [B, S] (packed documents, 0 = padding),
// mm_token_type_ids [B, S] (0 text, 1 image, 2 video), image_features [N, F] (one row per image/video slot in
// row-major order; F = hidden size, or the width of the checkpoint's vision projection). Or, in place of
// image_features, images as Gemma 4's image processor lays them out: pixel_values [n, P, 3 * patch^2] and
// image_position_ids [n, P, 2] ((-1, -1) for padding patches); the checkpoint's own vision tower (frozen: no
// gradient) turns them into the features, on every rank before the row is split (model/vision_encoder.h).
// Output: loss (scalar, mean over label tokens), token_loss [B, S], logits [B, S, V] unless --no-logits, with
// --router each MoE layer's router_logits.<layer> [B, S, E] (the scores before the softmax) and router_experts.<layer>
// [B, S, K] (I32, the chosen experts, most probable first), and with --grad every parameter gradient as
// grad.<HF name> (plus grad.image_features when features are given).
//
// Every rank reads the checkpoint and the whole batch and validates them; the ranks agree that all succeeded
// (bad input, or more ranks than tokens in a row: one line on every rank, non-zero exit, no output). With P > 1
// the model's attention runs through the CP engine (cp::CpAttention) and each rank computes only the tokens it
// holds; P = 1 runs the same model code with the local kernels. Gradients are summed over the ranks in rank order,
// token losses and logits are sent to rank 0 and put back in row order, and rank 0 alone writes --out and --stats
// (all or nothing, io/atomic_file.h). --stats writes every rank's figures as {"ranks": [...]}, the shape of
// `ringflex attn --stats`. Every wait for a peer uses --timeout (raise it for long rows at large P on few cores:
// ranks meet once per layer, and an oversubscribed rank may reach a layer long after another).
#include <omp.h>
#include <sys/resource.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstdio>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/batch_file.h"
#include "cli/command.h"
#include "cli/finite.h"
#include "comm/agree.h"
#include "comm/mpi_comm.h"
#include "core/error.h"
#include "core/memory.h"
#include "core/mix.h"
#include "cp/parallel_context.h"
#include "io/atomic_file.h"
#include "io/safetensors.h"
#include "io/tensor_access.h"
#include "model/checkpoint.h"
#include "model/lora_store.h"
#include "model/matmul_bf16.h"
#include "model/memory.h"
#include "model/peft_files.h"
#include "model/vision_encoder.h"

namespace rf::cli {

namespace {

constexpr int kMaxThreads = 1024;  // a sanity bound for --threads, far above any machine this runs on
// Tags of the per-token outputs each rank sends to rank 0.
constexpr int kTokenLossTag = 1;
constexpr int kLogitsTag = 2;
constexpr int kRouterTag = 3;

struct ForwardOptions {
  std::string model, in, out;
  std::string lora;  // a PEFT LoRA adapter directory over --model (model/lora_store.h)
  bool grad = false;
  bool no_logits = false;
  bool router = false;  // write each MoE layer's router scores and choices
  std::string shard = "balanced";
  std::string algo = "ring";
  int threads = 0;           // 0: OpenMP's default (every core)
  int64_t loss_chunk = 0;    // tokens per chunk of the fused LM head and loss (RunOptions::loss_chunk_tokens)
  bool check_finite = true;  // reject NaN/inf in the checkpoint's parameters and image_features up front
  bool recompute = true;     // the backward recomputes each layer's activations (RunOptions::recompute_layers)
  bool keep_mlp = false;     // ... except the MLP projections (RunOptions::keep_mlp_projections)
  std::string stats;         // --stats: per-rank figures as JSON
  // What the linear layers multiply in (RunOptions::compute_dtype): float32, bfloat16 (or f32, bf16).
  std::string compute_dtype = "float32";
};

// FNV-1a over the batch's arrays (image features by their bits): ranks that read different batches must not start the
// ring.
int64_t fingerprint(const BatchData& d) {
  Fnv1a h;
  for (const std::vector<int32_t>* v : {&d.ids, &d.labels, &d.pos, &d.doc, &d.mm}) h.add(*v);
  for (float x : d.features) h.add(std::bit_cast<uint32_t>(x));
  return static_cast<int64_t>(h.h);
}

// Every rank's [B, L, width] shard of a per-token output, sent to rank 0 and placed at its row positions there:
// [B, S, width] on rank 0, empty elsewhere. A collective call.
std::vector<float> gather_to_rank0(comm::Communicator& comm, const RowShard& shard, const std::vector<float>& mine,
                                   int B, int64_t width, int tag, comm::Timeout timeout) {
  const size_t bytes = mine.size() * sizeof(float);
  if (comm.rank() != 0) {
    const comm::SendBuffer buf{mine.data(), bytes};
    comm.isend(0, tag, std::span(&buf, 1), "per-token outputs to rank 0")->wait(timeout);
    return {};
  }
  std::vector<float> full(static_cast<size_t>(int64_t{B} * shard.S * width), 0.f);
  std::vector<float> part(mine.size());
  for (int r = 0; r < comm.size(); ++r) {
    const std::vector<float>* src = &mine;
    if (r != 0) {
      const comm::RecvBuffer buf{part.data(), bytes};
      comm.irecv(r, tag, std::span(&buf, 1), "per-token outputs from rank " + std::to_string(r))->wait(timeout);
      src = &part;
    }
    const std::vector<int32_t>& pos = shard.positions[static_cast<size_t>(r)];
    for (int b = 0; b < B; ++b)
      for (int j = 0; j < shard.L; ++j) {
        if (shard.is_pad(pos[j])) continue;
        std::copy_n(src->data() + (int64_t{b} * shard.L + j) * width, width,
                    full.data() + (int64_t{b} * shard.S + pos[j]) * width);
      }
  }
  return full;
}

// One rank's figures, plain numbers so they travel as bytes in one allgather.
struct RankFigures {
  int64_t tokens, kept_activation_bytes, layer_recompute_bytes, peak_attention_bytes, bytes_sent, bytes_received,
      peak_rss_bytes;
  double compute_s, wall_s;
};

std::string stats_json(comm::Communicator& comm, const RankFigures& mine, const std::string& scheme,
                       const std::string& algo) {
  std::vector<RankFigures> all(static_cast<size_t>(comm.size()));
  comm.allgather(&mine, all.data(), sizeof(RankFigures), comm::default_timeout());
  nlohmann::ordered_json root;
  root["scheme"] = scheme;
  root["algo"] = algo;
  root["ranks"] = nlohmann::ordered_json::array();
  for (int r = 0; r < comm.size(); ++r) {
    const RankFigures& x = all[r];
    root["ranks"].push_back({{"rank", r},
                             {"tokens", x.tokens},
                             {"kept_activation_bytes", x.kept_activation_bytes},
                             {"layer_recompute_bytes", x.layer_recompute_bytes},
                             {"peak_attention_bytes", x.peak_attention_bytes},
                             {"bytes_sent", x.bytes_sent},
                             {"bytes_received", x.bytes_received},
                             {"peak_rss_bytes", x.peak_rss_bytes},
                             {"compute_s", x.compute_s},
                             {"wall_s", x.wall_s}});
  }
  return root.dump(2) + "\n";
}

// Every output, checked before any work (on rank 0, the writer; `agree` makes every rank fail with its message):
// writable, and no two options naming one file.
void check_outputs(const ForwardOptions& opt) {
  RF_CHECK(opt.stats.empty() || !io::same_destination(opt.out, opt.stats), "--stats ", opt.stats, " and --out ",
           opt.out, " name the same file");
  io::check_writable(opt.out);
  if (!opt.stats.empty()) io::check_writable(opt.stats);
}

// The batch's claimed sizes, from its header alone.
struct BatchShape {
  int64_t B = 0, S = 0;
  int64_t N = 0, F = 0;  // image_features [N, F] (0 when absent)
};

// The batch's claimed shape, checked before the checkpoint is loaded or any row is read: an empty batch (or one
// claiming 2^31 - 1 empty rows in a 152-byte file) fails at once, saying so.
BatchShape check_batch_shape(const std::string& path) {
  const io::SafetensorsFile in = io::SafetensorsFile::open(path);
  io::DimSizes dims;
  const io::TensorView& ids =
      io::require(in, {"input_ids", {io::StDType::I32, io::StDType::I64}, {"B", "S"}, ""}, dims);
  RF_CHECK(dims["B"] >= 1 && dims["S"] >= 1, path, ": the batch is empty (input_ids has shape ",
           io::shape_string(ids.shape), "); forward needs B >= 1 rows of S >= 1 tokens");
  RF_CHECK(dims["B"] <= std::numeric_limits<int>::max() && dims["S"] <= std::numeric_limits<int>::max(), path,
           ": input_ids has shape ", io::shape_string(ids.shape), ", B and S must fit in 32 bits");
  BatchShape shape{dims["B"], dims["S"]};
  if (io::optional(in, {"image_features", {io::StDType::F32, io::StDType::BF16}, {"N", "F"}, ""}, dims) != nullptr) {
    shape.N = dims["N"];
    shape.F = dims["F"];
  }
  return shape;
}

// Everything this rank holds through the job, known from the checkpoint's and the batch's headers before either is
// loaded (`m` may be shapes only), and compared with the machine as one total: the weights (and buffers) as float32,
// the gradient set with --grad, the weights' bf16 copies in bf16 compute, the batch as read (five int32 [B, S]
// arrays, image_features as float32 and with --grad their gradient), then the larger of the run's own buffers
// (model::run_memory_at_least, for this rank's B x ceil(S / P) tokens: its activations, loss chunk and [B, L, V]
// logits) and, on rank 0 under CP, the gather after it: the rank's [B, L, V] logits and the gathered [B, S, V]. A
// job too large for the machine stops here with the figure, before the load, instead of std::bad_alloc or the OOM
// killer part-way.
void check_job_memory(const model::Gemma4Multimodal& m, const BatchShape& b, const ForwardOptions& opt, int P,
                      int rank) {
  const int64_t V = m.config().vocab_size, f32 = sizeof(float), i32 = sizeof(int32_t);
  const int64_t L = (b.S + P - 1) / P;  // tokens per rank, before the plan's padding
  model::RunMemoryArgs run;
  run.tokens = b.B * L;
  run.training = opt.grad;
  run.recompute_layers = opt.recompute;
  run.keep_mlp_projections = opt.keep_mlp;
  run.logits = !opt.no_logits;
  run.loss_chunk_tokens = opt.loss_chunk;
  const MemoryBreakdown running = model::run_memory_at_least(m.decoder(), run);
  MemoryBreakdown gathering;
  if (rank == 0 && P > 1 && !opt.no_logits) {
    gathering.add("logits", checked_bytes({b.B, L, V, f32}));
    gathering.add("gathered logits", checked_bytes({b.B, b.S, V, f32}));
  }
  constexpr int64_t kRowArrays = 5;  // input_ids, labels, position_ids, doc, mm_token_type_ids
  MemoryBreakdown need;
  need.add("weights", checked_sum({m.params().weight_bytes(), m.buffers().total_bytes()}));
  need.add("gradients", opt.grad ? m.params().trainable_bytes() : 0);
  const bool bf16 = model::parse_compute_dtype(opt.compute_dtype) == model::ComputeDtype::Bfloat16;
  need.add("bf16 weight copies", bf16 ? m.bf16_weight_bytes() : 0);
  need.add("the batch",
           checked_sum({checked_bytes({b.B, b.S, i32, kRowArrays}), checked_bytes({b.N, b.F, f32, opt.grad ? 2 : 1})}));
  const bool gathering_larger = gathering.total() < 0 || (running.total() >= 0 && gathering.total() > running.total());
  need.add(gathering_larger ? gathering : running);
  check_memory(need, opt.in + ": forward", concat(" at S = ", b.S, " over ", P, " rank(s)"));
}

int run_forward(const ForwardOptions& opt) {
  if (opt.threads > 0) omp_set_num_threads(opt.threads);
  const std::unique_ptr<comm::Communicator> world = comm::make_mpi_world();
  const int P = world->size();
  model::Checkpoint ck;
  const model::LoraStore* lora = nullptr;  // --lora's adapters over the base (ck.model's store), else null
  BatchData data;
  agree(*world, [&] {
    if (world->rank() == 0) check_outputs(opt);  // before loading anything: an unwritable output is found at once
    const BatchShape shape = check_batch_shape(opt.in);
    model::AdaptedCheckpoint adapted =
        model::load_adapted_checkpoint(opt.model, opt.lora, [&](const model::Gemma4Multimodal& shapes) {
          check_job_memory(shapes, shape, opt, P, world->rank());
        });
    ck = std::move(adapted.checkpoint);
    lora = adapted.adapters;
    if (opt.check_finite) {
      const model::ParamStore& params = ck.model->params();
      for (size_t i = 0; i < params.size(); ++i) {
        const model::ParamInfo& p = params.info(i);
        check_finite(opt.model, p.name, std::span<const float>(params.weight(i), static_cast<size_t>(p.numel)),
                     p.shape);
      }
    }
    // Pixel inputs: the tower multiplies as the decoder does (as the trainer hands it model.compute_dtype).
    ck.model->set_vision_compute_dtype(model::parse_compute_dtype(opt.compute_dtype));
    data = read_batch(opt.in, *ck.model, opt.check_finite);
    ck.model->check_batch(data.view(), P, opt.in);
    RF_CHECK(!opt.grad || !data.labels.empty(), opt.in, ": --grad needs a `labels` tensor");
    // A fixed scheme that cannot split this row fails here, where every rank can still say so.
    if (P > 1 && opt.shard != "balanced" && opt.shard != "auto")
      (void)cp::make_shard_map(cp::parse_scheme(opt.shard), data.S, P);
  });
  const int64_t print[] = {data.B, data.S, data.n_features, data.F, fingerprint(data)};
  agree_equal(*world, print, "the batch (ranks read different --in files?)");
  const model::Gemma4Multimodal& m = *ck.model;
  const model::Batch b = data.view();
  if (world->rank() == 0)
    for (const std::string& warning : m.config().warnings)
      std::fprintf(stderr, "ringflex: warning: %s\n", warning.c_str());

  model::RunOptions ro;
  ro.want_grad = opt.grad;
  ro.want_logits = !opt.no_logits;
  ro.want_router = opt.router;
  ro.recompute_layers = opt.recompute;
  ro.keep_mlp_projections = opt.keep_mlp;
  ro.loss_chunk_tokens = opt.loss_chunk;
  ro.compute_dtype = model::parse_compute_dtype(opt.compute_dtype);
  if (world->rank() == 0 && ro.compute_dtype == model::ComputeDtype::Bfloat16) {
    const model::Bf16MatmulPath path = model::bf16_matmul_path();
    std::fprintf(stderr, "ringflex forward: bf16 matmuls: %s\n", path.description.c_str());
  }
  cp::CpAttentionOptions cpo;
  cpo.scheme = opt.shard;
  cpo.algo = cp::parse_algo(opt.algo);
  const comm::Timeout timeout = comm::default_timeout();  // --timeout
  cpo.timeout = timeout;
  const cp::JobContext context = cp::make_parallel_context(*world, cpo);

  const auto start = std::chrono::steady_clock::now();
  model::Result r = m.run(b, ro, *context.model);
  const double run_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (opt.grad) {
    // The store's gradient arena and the image features' gradient as one collective (no flat copy of the model).
    const std::vector<std::span<float>> sums = {ck.model->params().mutable_flat(model::Role::Grads),
                                                std::span<float>(r.d_image_features)};
    world->allreduce(sums, comm::ReduceOp::Sum, timeout);
  }
  const int64_t B = b.B, S = b.S, V = m.config().vocab_size;
  const std::vector<float> token_loss = gather_to_rank0(*world, r.shard, r.token_loss, b.B, 1, kTokenLossTag, timeout);
  std::vector<float> logits;
  if (ro.want_logits) logits = gather_to_rank0(*world, r.shard, r.logits, b.B, V, kLogitsTag, timeout);
  r.logits = {};
  // Per MoE layer, rows in order on rank 0: the scores [B, S, E], and the choices [B, S, K], which travel as float
  // (expert indices < 2^24 are exact) through the same gather and are written back as I32.
  const int64_t E = m.config().num_experts, K = m.config().top_k_experts;
  std::vector<std::vector<float>> router_logits(r.router_logits.size()), router_experts(r.router_experts.size());
  for (size_t l = 0; l < r.router_logits.size(); ++l) {
    if (r.router_logits[l].empty()) continue;
    router_logits[l] = gather_to_rank0(*world, r.shard, r.router_logits[l], b.B, E, kRouterTag, timeout);
    const std::vector<float> chosen(r.router_experts[l].begin(), r.router_experts[l].end());
    router_experts[l] = gather_to_rank0(*world, r.shard, chosen, b.B, K, kRouterTag, timeout);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  std::string stats;
  if (!opt.stats.empty()) {
    // tokens: the valid tokens (doc > 0) this rank held over the B rows, as `attn --stats` counts them.
    int64_t tokens = 0;
    for (int32_t p : r.shard.mine()) {
      if (r.shard.is_pad(p)) continue;
      for (int64_t row = 0; row < B; ++row) tokens += !b.doc || b.doc[row * S + p] > 0;
    }
    const cp::CpTotals t = context.cp ? context.cp->totals() : cp::CpTotals{};
    // compute_s: the model's time less what the attention calls spent outside their kernels (waiting for keys,
    // agreeing on headers, planning).
    const double waiting = t.wall_seconds - t.compute_seconds;
    // The process's peak resident set so far (weights, gradients, activations, the runtime): Linux reports KiB.
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);
    constexpr int64_t kBytesPerKiB = 1024;
    const int64_t peak_rss = static_cast<int64_t>(usage.ru_maxrss) * kBytesPerKiB;
    stats = stats_json(*world,
                       RankFigures{tokens, r.kept_activation_bytes, r.layer_recompute_bytes, t.peak_attention_bytes,
                                   t.bytes_sent, t.bytes_received, peak_rss, run_seconds - waiting, seconds},
                       context.cp ? cp::scheme_name(context.cp->shard_map().scheme) : "local",
                       context.cp ? opt.algo : "local");
  }

  agree(*world, [&] {
    if (world->rank() != 0) return;
    io::SafetensorsWriter w;
    const float loss = static_cast<float>(r.loss);
    w.add("loss", io::StDType::F32, {}, std::span<const float>(&loss, 1));
    w.add("token_loss", io::StDType::F32, {B, S}, std::span<const float>(token_loss));
    if (ro.want_logits) w.add("logits", io::StDType::F32, {B, S, V}, std::span<const float>(logits));
    for (size_t l = 0; l < router_logits.size(); ++l) {
      if (router_logits[l].empty()) continue;
      const std::string layer = std::to_string(l);
      w.add("router_logits." + layer, io::StDType::F32, {B, S, E}, std::span<const float>(router_logits[l]));
      w.add_fill("router_experts." + layer, io::StDType::I32, {B, S, K},
                 [&chosen = router_experts[l]](std::span<std::byte> out) {
                   auto* dst = reinterpret_cast<int32_t*>(out.data());
                   for (size_t i = 0; i < chosen.size(); ++i) dst[i] = static_cast<int32_t>(chosen[i]);
                 });
    }
    if (opt.grad) {
      const model::ParamStore& params = ck.model->params();
      for (size_t i = 0; i < params.size(); ++i) {
        const model::ParamInfo& p = params.info(i);
        if (params.grad(i) == nullptr) continue;  // frozen (a LoRA base): no gradient
        const std::span<const float> g(params.grad(i), static_cast<size_t>(p.numel));
        if (!lora) {
          w.add("grad." + model::file_name_of(p.name, ck.text_prefix), io::StDType::F32, p.shape, g);
          continue;
        }
        // An adapter's gradient in PEFT's layout, as its weight is in the adapter's files.
        w.add_fill("grad." + model::file_name_of(p.name, ck.text_prefix), io::StDType::F32, lora->file_shape(i),
                   [lora, i, g](std::span<std::byte> out) {
                     lora->to_file_layout(i, g, std::span<float>(reinterpret_cast<float*>(out.data()), g.size()));
                   });
      }
      if (data.has_features)
        w.add("grad.image_features", io::StDType::F32, {data.n_features, data.F},
              std::span<const float>(r.d_image_features));
    }
    // All or nothing: the output and --stats are written and synced first, then both renamed.
    io::AtomicFile out(opt.out);
    w.write(out);
    std::vector<io::AtomicFile*> files = {&out};
    std::optional<io::AtomicFile> stats_file;
    if (!opt.stats.empty()) {
      stats_file.emplace(opt.stats);
      stats_file->write(stats);
      files.push_back(&*stats_file);
    }
    io::commit_all(files);
  });
  if (world->rank() != 0) return 0;
  if (opt.grad) {
    constexpr double kMiB = 1 << 20;
    std::printf(
        "ringflex forward: rank 0 kept %.1f MiB of activations for the backward, one layer's recomputed "
        "%.1f MiB\n",
        static_cast<double>(r.kept_activation_bytes) / kMiB, static_cast<double>(r.layer_recompute_bytes) / kMiB);
  }
  std::printf("ringflex forward: wrote %s (B=%lld S=%lld, P=%d, %lld label tokens, loss %.6f, %s %.3f s)\n",
              opt.out.c_str(), static_cast<long long>(B), static_cast<long long>(S), P,
              static_cast<long long>(r.label_tokens), r.loss, opt.grad ? "forward+backward" : "forward", seconds);
  return 0;
}

}  // namespace

void add_forward_command(CLI::App& app, Runner& run) {
  auto opt = std::make_shared<ForwardOptions>();
  CLI::App* cmd =
      app.add_subcommand("forward", "Forward (and backward) of a Hugging Face Gemma 4 checkpoint on a batch");
  cmd->add_option("--model", opt->model, "Checkpoint directory: config.json and *.safetensors")->required();
  cmd->add_option("--in", opt->in, "Batch: input_ids [, labels, position_ids, doc, mm_token_type_ids, image_features]")
      ->required();
  cmd->add_option("--out", opt->out, "Output: loss, token_loss [, logits] [, grad.<name>]")->required();
  cmd->add_flag("--grad", opt->grad, "Also write every trainable parameter's gradient as grad.<name>");
  cmd->add_option("--lora", opt->lora,
                  "A PEFT LoRA adapter directory (adapter_config.json, adapter_model.safetensors) over --model: the "
                  "base frozen, --grad writes the adapters' gradients");
  cmd->add_flag("--no-logits", opt->no_logits, "Do not write the [B, S, V] logits");
  cmd->add_flag("--router", opt->router,
                "Also write each MoE layer's router scores router_logits.<layer> [B, S, E] and chosen experts "
                "router_experts.<layer> [B, S, K]");
  cmd->add_option("--shard", opt->shard, "Which tokens each rank holds (default: balanced for the model's layers)")
      ->check(CLI::IsMember({"contiguous", "zigzag", "balanced", "auto"}));
  cmd->add_option("--algo", opt->algo, "CP algorithm")->check(CLI::IsMember({"ring", "allgather"}));
  cmd->add_option("--stats", opt->stats, "Write per-rank figures (tokens, activation bytes, traffic, times) as JSON");
  cmd->add_option("--loss-chunk", opt->loss_chunk,
                  "Tokens per chunk of the fused LM head, softcap and cross-entropy, its one [chunk, V] float32 "
                  "buffer (default: as many as fit 64 MiB, at least 256); any size gives the same loss and "
                  "gradients to float32 rounding")
      ->check(CLI::Range(int64_t{1}, int64_t{std::numeric_limits<int32_t>::max()}));
  cmd->add_option("--threads", opt->threads, "Threads per rank (default: every core)")
      ->check(CLI::Range(1, kMaxThreads));
  cmd->add_flag("--check-finite,!--no-check-finite", opt->check_finite,
                "Reject a NaN or infinity in the parameters or image_features before computing (default)");
  cmd->add_flag("--recompute,!--no-recompute", opt->recompute,
                "With --grad: keep only each layer's input, attention output and LSE and its o_proj and down_proj "
                "outputs, and recompute the rest in the backward (default); --no-recompute keeps every activation "
                "(one layer forward less per layer, about num_layers times more activation memory; the same bits)");
  cmd->add_flag("--keep-mlp", opt->keep_mlp,
                "With --grad and recompute: keep each MLP's gate/up projections too, so the recompute skips their "
                "sgemms (1/2 of a dense layer's FLOPs) for [S, 2I] floats a layer; the same bits");
  cmd->add_option("--compute-dtype", opt->compute_dtype,
                  "What the linear layers multiply in: float32 (default) or bfloat16 (bf16): operands rounded to bf16, "
                  "products accumulated in float32, weights and everything else float32; the vision tower's too, "
                  "for pixel inputs")
      ->check(CLI::IsMember({"float32", "bfloat16", "f32", "bf16"}));
  cmd->callback([&run, opt] { run = [opt] { return run_forward(*opt); }; });
}

}  // namespace rf::cli
