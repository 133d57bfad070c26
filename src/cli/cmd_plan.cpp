// ringflex plan: what contiguous, zigzag and balanced sharding would do with a batch's masks, side by side — per
// rank tokens, attention work and its imbalance, K/V bytes received and ring steps skipped per layer type — as
// text, and optionally JSON (--json) and an SVG picture of the block mask by owner (--svg).
//
// Metadata comes from a safetensors file (doc and/or group, [B, S] I32, as `ringflex attn` reads them) or from the
// built-in generators: Gemma 4 VLM rows (packed documents with image groups) or plain causal rows. The command is
// a planner, not a distributed run: under mpirun only rank 0 reports.
#include <mpi.h>

#include <algorithm>
#include <iostream>
#include <limits>
#include <optional>
#include <vector>

#include "cli/command.h"
#include "core/error.h"
#include "core/memory.h"
#include "core/row_meta.h"
#include "cp/balance.h"
#include "cp/shard.h"
#include "io/atomic_file.h"
#include "io/safetensors.h"
#include "io/tensor_access.h"
#include "report/plan_report.h"

namespace rf::cli {

namespace {

struct PlanOptions {
  std::string in;
  std::string generate;
  int S = 32768;
  int B = 1;
  uint64_t seed = 0;
  int P = 8;
  std::string layers = "5xsliding:1024:groups,1xfull:groups";  // Gemma 4 26B/31B with vision
  int block = cp::kPlanBlock;
  report::ReportOptions kv;  // Gemma 4 31B heads by default
  std::string dtype = "bf16";
  std::string json;
  std::string svg;
};

// rows: [B, S] from the file's doc and group tensors; S and B come from whichever is present.
std::vector<TokenMeta> read_meta(const std::string& path, int& B, int& S) {
  const io::SafetensorsFile f = io::SafetensorsFile::open(path);
  io::DimSizes dims;
  const io::TensorView* doc = io::optional(f, {"doc", {io::StDType::I32}, {"B", "S"}, ""}, dims);
  const io::TensorView* group = io::optional(f, {"group", {io::StDType::I32}, {"B", "S"}, ""}, dims);
  RF_CHECK(doc || group, path, ": neither `doc` nor `group` [B, S] I32 is present; nothing to plan");
  const int64_t n_rows = dims["B"], n_tokens = dims["S"];
  RF_CHECK(n_rows >= 1 && n_tokens >= 1, path, ": empty metadata, B = ", n_rows, ", S = ", n_tokens);
  RF_CHECK(n_rows <= std::numeric_limits<int>::max() && n_tokens <= std::numeric_limits<int>::max(), path,
           ": metadata of B = ", n_rows, ", S = ", n_tokens, ": B and S must fit in 32 bits");
  B = static_cast<int>(n_rows);
  S = static_cast<int>(n_tokens);
  const std::vector<int32_t> docs = doc ? io::copy_as<int32_t>(*doc) : std::vector<int32_t>{};
  const std::vector<int32_t> groups = group ? io::copy_as<int32_t>(*group) : std::vector<int32_t>{};
  std::vector<TokenMeta> rows;
  for (int b = 0; b < B; ++b) {
    const std::vector<TokenMeta> row = make_row_meta(S, doc ? docs.data() + int64_t{b} * S : nullptr,
                                                     group ? groups.data() + int64_t{b} * S : nullptr);
    rows.insert(rows.end(), row.begin(), row.end());
  }
  return rows;
}

// rows: [B, S], each row its own seed so a batch is not B copies of one row.
std::vector<TokenMeta> generate_meta(const std::string& kind, int B, int S, uint64_t seed) {
  std::vector<TokenMeta> rows;
  rows.reserve(static_cast<size_t>(B) * S);
  for (int b = 0; b < B; ++b) {
    const std::vector<TokenMeta> row = kind == "vlm" ? gemma4_vlm_row(S, seed + b) : make_row_meta(S, nullptr, nullptr);
    rows.insert(rows.end(), row.begin(), row.end());
  }
  return rows;
}

int run_plan(const PlanOptions& o) {
  int world_rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  RF_CHECK(o.in.empty() != o.generate.empty(), "plan: give exactly one of --in FILE or --generate vlm|causal");
  // Outputs are checked before any work, by every rank alike (no rank communicates here, so each fails alone
  // with the same line).
  RF_CHECK(o.json.empty() || o.svg.empty() || !io::same_destination(o.json, o.svg), "plan: --json ", o.json,
           " and --svg ", o.svg, " name the same file");
  if (!o.json.empty()) io::check_writable(o.json);
  if (!o.svg.empty()) io::check_writable(o.svg);
  RF_CHECK(o.P >= 1, "plan: --ranks ", o.P, " must be at least 1");
  RF_CHECK(o.block >= 1, "plan: --block ", o.block, " must be at least 1");
  for (const cp::KvFormat& kv : {o.kv.windowed, o.kv.global}) {
    RF_CHECK(kv.Hkv >= 1 && kv.D >= 1, "plan: K/V heads and head dimensions must be positive, got ", kv.Hkv, " x ",
             kv.D);
  }
  const cp::LayerMix mix = cp::parse_layer_mix(o.layers);

  int B = o.B, S = o.S;
  std::vector<TokenMeta> rows;
  if (!o.in.empty())
    rows = read_meta(o.in, B, S);
  else
    RF_CHECK(S >= 1 && B >= 1, "plan: --seq ", S, " and --batch ", B, " must be positive");

  // The planner works in blocks; a rank holding less than one has nothing to plan, and the plan's per-rank-pair
  // tables grow with P^2, so a P beyond the block count only burns memory and time.
  const int64_t blocks = (int64_t{S} + o.block - 1) / o.block;
  RF_CHECK(o.P <= blocks, "plan: -P ", o.P, " exceeds the ", blocks, " planner blocks of S = ", S, " (block ", o.block,
           "); every rank must hold at least one block (lower -P or --block)");

  report::ReportOptions opt = o.kv;
  opt.block = o.block;
  const int elem_bytes = o.dtype == "bf16" ? 2 : 4;
  opt.windowed.elem_bytes = opt.global.elem_bytes = elem_bytes;

  // Before anything of size S is built: the three shard maps (padded-row positions, [S] int32 each) and, when
  // generated, the metadata (the generator holds one row besides the B rows).
  {
    constexpr int kShardMaps = 3;  // contiguous, zigzag, balanced
    int64_t meta = 0, maps_bytes = 0, both = 0;
    const bool overflow =
        __builtin_mul_overflow(o.in.empty() ? int64_t{B} + 1 : 0, int64_t{S} * int64_t{sizeof(TokenMeta)}, &meta) ||
        __builtin_mul_overflow(int64_t{kShardMaps} * (int64_t{S} + int64_t{o.P} * o.block), int64_t{sizeof(int32_t)},
                               &maps_bytes) ||
        __builtin_add_overflow(meta, maps_bytes, &both);
    check_memory(overflow ? -1 : both, "plan: the shard maps and the row metadata [B, S]");
  }
  std::vector<cp::ShardMap> maps = {
      cp::make_shard_map(cp::Scheme::Contiguous, S, o.P, o.block),
      cp::make_shard_map(cp::Scheme::Zigzag, S, o.P, o.block),
  };
  // The plan of one scheme holds per-rank-pair tables (P^2 of them): what they need is checked before they are
  // built, so a large -P stops with the figure rather than with std::bad_alloc minutes later.
  int64_t plan_bytes = 0;
  for (const cp::ShardMap& map : maps) {
    const int64_t b = cp::plan_bytes(cp::PlanGeometry{o.P, B, map.L, o.block}, static_cast<int>(mix.size()));
    plan_bytes = b < 0 || plan_bytes < 0 ? -1 : std::max(plan_bytes, b);
  }
  check_memory(plan_bytes, "plan: the CP plan of one scheme at P = " + std::to_string(o.P));
  // Generated only now, after the plan's figure: a --seq too long for the plan stops with it, not after minutes of
  // generating.
  if (o.in.empty()) rows = generate_meta(o.generate, B, S, o.seed);
  maps.push_back(cp::balanced_shard(rows.data(), B, S, o.P, mix, o.block).map);
  std::vector<report::SchemeReport> reports;
  for (const cp::ShardMap& map : maps) {
    reports.push_back(report::report_scheme(cp::scheme_name(map.scheme), rows.data(), B, map, mix, opt));
  }
  if (world_rank != 0) return 0;

  std::cout << "ringflex plan: B = " << B << ", S = " << S << ", P = " << o.P << ", block = " << o.block
            << ", layers = " << o.layers << "\n"
            << "K/V per token: windowed layers " << opt.windowed.Hkv << " x " << opt.windowed.D << ", global layers "
            << opt.global.Hkv << " x " << opt.global.D << ", " << o.dtype << "\n\n"
            << report::report_text(reports);
  // Both reports, all or nothing (io/atomic_file.h).
  std::optional<io::AtomicFile> json, svg;
  std::vector<io::AtomicFile*> files;
  if (!o.json.empty()) {
    json.emplace(o.json);
    json->write(report::report_json(reports));
    files.push_back(&*json);
  }
  if (!o.svg.empty()) {
    svg.emplace(o.svg);
    svg->write(report::report_svg(rows.data(), S, maps, reports, mix, o.block));
    files.push_back(&*svg);
  }
  io::commit_all(files);
  return 0;
}

}  // namespace

void add_plan_command(CLI::App& app, Runner& run) {
  auto opts = std::make_shared<PlanOptions>();
  CLI::App* cmd = app.add_subcommand(
      "plan", "Compare contiguous, zigzag and balanced sharding for a batch's masks: work, imbalance, traffic");
  CLI::Option* in = cmd->add_option("--in", opts->in, "safetensors file with `doc` and/or `group` [B, S] I32")
                        ->check(CLI::ExistingFile);
  CLI::Option* generate =
      cmd->add_option("--generate", opts->generate, "built-in rows instead of --in: vlm (Gemma 4 VLM) or causal")
          ->check(CLI::IsMember({"vlm", "causal"}));
  in->excludes(generate);
  cmd->add_option("--seq", opts->S, "tokens per generated row")->capture_default_str()->needs(generate);
  cmd->add_option("--batch", opts->B, "generated rows")->capture_default_str()->needs(generate);
  cmd->add_option("--seed", opts->seed, "seed of generated rows (row b uses seed + b)")
      ->capture_default_str()
      ->needs(generate);
  cmd->add_option("-P,--ranks", opts->P, "CP ranks to plan for")->capture_default_str();
  cmd->add_option("--layers", opts->layers,
                  "layer mix: comma-separated [COUNTx]TYPE[:W][:groups], TYPE = sliding:W | full | bidir[:W]")
      ->capture_default_str();
  cmd->add_option("--block", opts->block, "tokens per planner block")->capture_default_str();
  cmd->add_option("--kv-heads", opts->kv.windowed.Hkv, "K/V heads of windowed layers")->capture_default_str();
  cmd->add_option("--head-dim", opts->kv.windowed.D, "head dimension of windowed layers")->capture_default_str();
  cmd->add_option("--global-kv-heads", opts->kv.global.Hkv, "K/V heads of layers without a window")
      ->capture_default_str();
  cmd->add_option("--global-head-dim", opts->kv.global.D, "head dimension of layers without a window")
      ->capture_default_str();
  cmd->add_option("--dtype", opts->dtype, "K/V element type on the wire")
      ->check(CLI::IsMember({"bf16", "f32"}))
      ->capture_default_str();
  cmd->add_option("--json", opts->json, "write the per-scheme report as JSON");
  cmd->add_option("--svg", opts->svg, "draw the block mask by owner and per-rank work as SVG");
  cmd->callback([&run, opts] { run = [opts] { return run_plan(*opts); }; });
}

}  // namespace rf::cli
