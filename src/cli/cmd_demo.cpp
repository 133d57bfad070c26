// ringflex demo: the main job's attention on built-in data.
//
// Generates one Gemma 4-like packed VLM row (documents of ~2048 tokens with 256-token image groups at their
// start and trailing padding), runs a sliding-window layer and a full layer through the same path as
// `ringflex attn` at P > 1 (forward and backward through src/cp: sharding, the planned ring, gathering back),
// even on one rank, checks the result, and prints what the mask saved and how fast the kernels ran. Exits
// non-zero if any check fails.
//
// Checks, all against quantities the kernels did not compute:
//   - out, lse and dQ of sampled query rows against rf::reference_forward/backward of those rows (a query's
//     output and gradient depend only on its own row, so a row sample is exact);
//   - dK and dV of sampled keys, per key, recomputed in double from q, k, v, dOut and the forward's LSE and out:
//       dV_j = sum_i P_ij dOut_i,   dK_j = scale * sum_i P_ij (dOut_i . v_j - dOut_i . O_i) q_i,
//       P_ij = exp(scale q_i . k_j - LSE_i),
//     over every query head of k_j's kv head and every query i allowed to read j. A gradient added to the wrong
//     key, head or rank's chunk shows as an O(1) error there (column sums would not see it). The forward
//     statistics LSE_i and O_i are the run's own (a reference forward of every query reading a key would cost
//     a full S x S pass per key); the row sample above checks them here, and tests/cp/attn_torch_oracle.py
//     checks every row this path produces against PyTorch in float64.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>

#include "cli/attn_job.h"
#include "cli/command.h"
#include "comm/agree.h"
#include "comm/mpi_comm.h"
#include "core/memory.h"
#include "core/row_meta.h"
#include "cpu/isa.h"
#include "reference/attention_ref.h"

namespace rf::cli {

namespace {

// Gemma 4 26B-A4B / 31B shapes (docs/gemma4.md): sliding layers have head dim 256 and a
// 1024-token window, full layers head dim 512; image groups are bidirectional on both (current transformers).
constexpr int kGemmaSlidingHeadDim = 256;
constexpr int kGemmaFullHeadDim = 512;
constexpr int kGemmaSlidingWindow = 1024;

// Allowed error of a checked value, as a fraction of the scale of what it is compared with (see verify()).
// float32 accumulation over thousands of keys leaves errors around 1e-6 of that scale; one wrongly masked key
// moves an output row by about |v - o| / (keys the row sees) >= 1e-4 for rows that see <= 2048 keys.
constexpr double kRowTolerance = 5e-5;
// Per-key dK/dV, as a fraction of the sum of magnitudes of the key's terms (its largest over d): ringflex
// accumulates up to (Hq / Hkv) x (queries reading the key) float32 terms, about 2^14 in the default demo, whose
// random-walk rounding stays below sqrt(2^14) * 2^-24 ~ 1e-5 of that sum; a term sent to the wrong key is O(1).
constexpr double kKeyTolerance = 1e-4;
// bf16 inputs on the vdpbf16ps path (src/cpu/isa.h) round the weights P and dS to bf16: an output moves by up to
// 2^-8 of the sum of its terms' magnitudes, once in out and twice in dQ, dK (docs/numerics.md; the derivation is
// tests/cpu/attention_check.h's). The keys' check is relative to that sum already; the rows' is relative to
// max(1, max |ref|), which bounds out's sum (Σ_j p_j·|v_j| <= max |v| <= 1 for these uniform [-1, 1] inputs).
// Both tolerances get 2 · 2^-8 more on that path: its bf16 checks catch gross errors (a term at the wrong key, a
// lost gradient), the float32 demo the fine ones.
constexpr double kBf16WeightRounding = 2.0 / 256;

struct DemoOptions {
  int S = 4096;
  int Hq = 8, Hkv = 1;
  int D = kGemmaSlidingHeadDim, D_full = kGemmaFullHeadDim;
  int window = kGemmaSlidingWindow;
  std::string dtype = "bf16";
  int check_rows = 6;
  int threads = 0;
  uint64_t seed = 1;
  CpOptions cp;  // how the row is split under mpirun (run_demo sends it through src/cp at P = 1 too)
};

struct DemoLayer {
  const char* name;
  LayerMask mask;
  int D;
};

// Uniform in [-1, 1) from a counter: splitmix64 of (seed, i), so generation is deterministic, parallel and
// independent of the thread count.
float uniform(uint64_t seed, uint64_t i) {
  constexpr int kMantissaBits = 24;
  uint64_t z = seed * 0x9e3779b97f4a7c15ull + i;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<float>(z >> (64 - kMantissaBits)) / static_cast<float>(1 << (kMantissaBits - 1)) - 1.f;
}

std::vector<std::byte> random_tensor(int64_t n, DType t, uint64_t seed) {
  std::vector<float> f(static_cast<size_t>(n));
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) f[i] = uniform(seed, static_cast<uint64_t>(i));
  std::vector<std::byte> bytes(static_cast<size_t>(n) * dtype_size(t));
  from_float(bytes.data(), f.data(), f.size(), t);
  return bytes;
}

// Seeds of the demo's tensors: make_job draws q, k, v, dout from seed + 1 .. seed + 4, so layers step the seed by
// kSeedsPerLayer and each --seed value owns kSeedsPerRun of them (room for ten layers).
constexpr uint64_t kSeedsPerLayer = 10;
constexpr uint64_t kSeedsPerRun = 100;

AttnJob make_job(const DemoOptions& o, const DemoLayer& layer, const std::vector<TokenMeta>& meta, uint64_t seed) {
  AttnJob job;
  job.shape = {1, o.Hq, o.Hkv, o.S, o.S, layer.D};
  job.dtype = o.dtype == "bf16" ? DType::BF16 : DType::F32;
  job.mask = layer.mask;
  job.scale = default_scale(layer.D);
  job.has_dout = true;
  job.q = random_tensor(job.shape.q_elems(), job.dtype, seed + 1);
  job.k = random_tensor(job.shape.kv_elems(), job.dtype, seed + 2);
  job.v = random_tensor(job.shape.kv_elems(), job.dtype, seed + 3);
  job.dout = random_tensor(job.shape.q_elems(), job.dtype, seed + 4);
  job.meta = meta;
  return job;
}

// A: the number of allowed (q, k) pairs, by the predicate itself (docs/spec.md §9's mask area).
int64_t mask_area(const LayerMask& m, const std::vector<TokenMeta>& meta) {
  const int S = static_cast<int>(meta.size());
  int64_t area = 0;
#pragma omp parallel for schedule(static) reduction(+ : area)
  for (int q = 0; q < S; ++q)
    for (int k = 0; k < S; ++k) area += allowed(m, meta[q], meta[k]);
  return area;
}

struct CheckResult {
  double out = 0, lse = 0, dq = 0;  // max |got - ref| / max(1, max |ref|) over the sampled rows
  double dk = 0, dv = 0;            // max |got - ref| / max(1, sum of |terms|) over the sampled keys
  double rounding = 0;              // kBf16WeightRounding where the kernels round bf16 weights, else 0
  bool ok() const {
    return std::max(out, dq) <= kRowTolerance + rounding && lse <= kRowTolerance &&
           std::max(dk, dv) <= kKeyTolerance + rounding;
  }
};

// Whether the kernels round P and dS to bf16 for this dtype (src/cpu/isa.h: rounds_bf16_weights).
bool rounds_weights(DType dtype) { return dtype == DType::BF16 && cpu::rounds_bf16_weights(cpu::kernel_path().bf16); }

// Rows (query or key positions) spread evenly over the row, first and last included (the last is padding in a
// Gemma 4-like row, so its key must get exactly no gradient).
std::vector<int> sample_rows(int S, int n) {
  std::vector<int> rows;
  for (int r = 0; r < n; ++r) rows.push_back(n == 1 ? 0 : static_cast<int>(int64_t{r} * (S - 1) / (n - 1)));
  rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  return rows;
}

// max |got - ref| / max(1, max |ref|); -inf matching -inf counts as exact.
double scaled_error(const std::vector<float>& got, const std::vector<double>& ref) {
  double err = 0, scale = 1;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isinf(ref[i]) && got[i] == static_cast<float>(ref[i])) continue;
    err = std::max(err, std::fabs(got[i] - ref[i]));
    scale = std::max(scale, std::fabs(ref[i]));
  }
  return err / scale;
}

// Each sampled row as its own one-query chunk against the whole row, run through the reference.
void check_rows(const AttnJob& job, const AttnResult& r, const std::vector<int>& rows, CheckResult& c) {
  const AttnShape& s = job.shape;
  const size_t esize = dtype_size(job.dtype);
  std::vector<double> out_err(rows.size()), lse_err(rows.size()), dq_err(rows.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (size_t n = 0; n < rows.size(); ++n) {
    const int i = rows[n];
    // q_row, dout_row: [1, Hq, 1, D] gathered from [1, Hq, S, D].
    std::vector<std::byte> q_row(static_cast<size_t>(s.Hq) * s.D * esize), dout_row(q_row.size());
    std::vector<float> out, lse, dq;
    for (int h = 0; h < s.Hq; ++h) {
      const size_t at = (static_cast<size_t>(h) * s.Lq + i) * s.D;
      std::copy_n(job.q.data() + at * esize, s.D * esize, q_row.data() + h * s.D * esize);
      std::copy_n(job.dout.data() + at * esize, s.D * esize, dout_row.data() + h * s.D * esize);
      out.insert(out.end(), r.out.begin() + at, r.out.begin() + at + s.D);
      dq.insert(dq.end(), r.dq.begin() + at, r.dq.begin() + at + s.D);
      lse.push_back(r.lse[static_cast<size_t>(h) * s.Lq + i]);
    }
    AttnChunk c1 = job.whole_chunk();
    c1.shape.Lq = 1;
    c1.q = q_row.data();
    c1.q_meta = job.meta.data() + i;
    const RefForward f = reference_forward(c1);
    const RefBackward g = reference_backward(c1, dout_row.data());
    out_err[n] = scaled_error(out, f.o);
    lse_err[n] = scaled_error(lse, f.lse);
    dq_err[n] = scaled_error(dq, g.dq);
  }
  c.out = *std::max_element(out_err.begin(), out_err.end());
  c.lse = *std::max_element(lse_err.begin(), lse_err.end());
  c.dq = *std::max_element(dq_err.begin(), dq_err.end());
}

// dK and dV of each sampled key j, per kv head, recomputed in double (see the file comment for the formulas).
void check_keys(const AttnJob& job, const AttnResult& r, const std::vector<int>& keys, CheckResult& c) {
  const AttnShape& s = job.shape;  // B = 1, Lq = Lk = S
  const int D = s.D, S = s.Lq;
  // Widened inputs: q, dout [1, Hq, S, D]; k, v [1, Hkv, S, D].
  std::vector<float> q(static_cast<size_t>(s.q_elems())), dout(q.size()), k(static_cast<size_t>(s.kv_elems())),
      v(k.size());
  to_float(q.data(), job.q.data(), q.size(), job.dtype);
  to_float(dout.data(), job.dout.data(), dout.size(), job.dtype);
  to_float(k.data(), job.k.data(), k.size(), job.dtype);
  to_float(v.data(), job.v.data(), v.size(), job.dtype);
  auto dot = [D](const float* a, const float* b) {
    double sum = 0;
    for (int d = 0; d < D; ++d) sum += double{a[d]} * b[d];
    return sum;
  };
  const int items = static_cast<int>(keys.size()) * s.Hkv;
  std::vector<double> dk_err(static_cast<size_t>(items)), dv_err(dk_err.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (int item = 0; item < items; ++item) {
    const int j = keys[static_cast<size_t>(item / s.Hkv)], g = item % s.Hkv;
    const size_t kv_at = (static_cast<size_t>(g) * S + j) * D;
    const float* kj = k.data() + kv_at;
    const float* vj = v.data() + kv_at;
    // dk, dv: [D] the key's gradients; dk_mass, dv_mass: [D] sums of the magnitudes of their terms.
    std::vector<double> dk(D, 0.0), dv(D, 0.0), dk_mass(D, 0.0), dv_mass(D, 0.0);
    for (int h = g * s.group_size(); h < (g + 1) * s.group_size(); ++h) {
      for (int i = 0; i < S; ++i) {
        if (!allowed(job.mask, job.meta[i], job.meta[j])) continue;
        const size_t row = static_cast<size_t>(h) * S + i;
        const float* qi = q.data() + row * D;
        const float* doi = dout.data() + row * D;
        const double p = std::exp(job.scale * dot(qi, kj) - r.lse[row]);
        const double ds = p * (dot(doi, vj) - dot(doi, r.out.data() + row * D)) * job.scale;
        for (int d = 0; d < D; ++d) {
          dv[d] += p * doi[d];
          dv_mass[d] += std::fabs(p * doi[d]);
          dk[d] += ds * qi[d];
          dk_mass[d] += std::fabs(ds * qi[d]);
        }
      }
    }
    double dk_e = 0, dv_e = 0, dk_scale = 1, dv_scale = 1;
    for (int d = 0; d < D; ++d) {
      dk_e = std::max(dk_e, std::fabs(r.dk[kv_at + d] - dk[d]));
      dv_e = std::max(dv_e, std::fabs(r.dv[kv_at + d] - dv[d]));
      dk_scale = std::max(dk_scale, dk_mass[d]);
      dv_scale = std::max(dv_scale, dv_mass[d]);
    }
    dk_err[static_cast<size_t>(item)] = dk_e / dk_scale;
    dv_err[static_cast<size_t>(item)] = dv_e / dv_scale;
  }
  c.dk = *std::max_element(dk_err.begin(), dk_err.end());
  c.dv = *std::max_element(dv_err.begin(), dv_err.end());
}

// What the demo holds at once, checked on every rank before any tensor is drawn: the larger of its layers' attention
// jobs (the inputs, the attention's buffers: attn_memory_at_least, as `attn` counts them; the layers run one after
// the other). A row too large for the machine stops here with the figure instead of std::bad_alloc part-way.
void check_demo_memory(const DemoOptions& o, const std::vector<DemoLayer>& layers, const std::vector<TokenMeta>& meta,
                       const CpOptions& cp, comm::Communicator& world) {
  MemoryBreakdown largest;
  for (const DemoLayer& layer : layers) {
    AttnJob header;  // the job's shape and row, without its tensors
    header.shape = {1, o.Hq, o.Hkv, o.S, o.S, layer.D};
    header.dtype = o.dtype == "bf16" ? DType::BF16 : DType::F32;
    header.mask = layer.mask;
    header.has_dout = true;
    header.meta = meta;
    const MemoryBreakdown need = attn_memory_at_least(header, cp, world.size(), world.rank(), false);
    if (need.total() < 0 || (largest.total() >= 0 && need.total() > largest.total())) largest = need;
  }
  check_memory(largest, "demo", concat(" at S = ", o.S, " over ", world.size(), " rank(s)"));
}

int run_demo(const DemoOptions& o, comm::Communicator& world) {
  if (o.threads > 0) omp_set_num_threads(o.threads);
  const std::vector<TokenMeta> meta = gemma4_vlm_row(o.S, o.seed);
  const std::vector<DemoLayer> layers = {{"sliding", {true, o.window, true}, o.D}, {"full", {true, 0, true}, o.D_full}};
  CpOptions cp = o.cp;
  cp.cp_path_on_one_rank = true;  // the demo shows the path P > 1 takes (sharding, the planned ring) even on one rank
  agree(world, [&] { check_demo_memory(o, layers, meta, cp, world); });

  int docs = 0, padding = 0, group_max = -1;
  for (size_t i = 0; i < meta.size(); ++i) {
    padding += meta[i].doc == kPaddingDoc;
    docs = std::max(docs, meta[i].doc);
    group_max = std::max(group_max, meta[i].group);
  }
  const bool rank0 = world.rank() == 0;
  if (rank0) {
    std::printf(
        "ringflex demo: one Gemma 4-like packed VLM row: S = %d tokens, %d documents, %d image groups of "
        "<= %d tokens, %d padding; Hq = %d, Hkv = %d, %s, %d rank(s) x %d thread(s)\n",
        o.S, docs, group_max + 1, kGemma4ImageSoftTokens, padding, o.Hq, o.Hkv, o.dtype.c_str(), world.size(),
        omp_get_max_threads());
    std::printf("%-8s %-22s %4s %8s %9s %11s %9s %11s\n", "layer", "mask", "D", "A/S^2", "forward", "GFLOP/s",
                "backward", "GFLOP/s");
  }
  std::vector<CheckResult> checks;
  for (const DemoLayer& layer : layers) {
    const AttnJob job = make_job(o, layer, meta, o.seed * kSeedsPerRun + checks.size() * kSeedsPerLayer);
    const AttnResult r = run_attention(job, cp, world);
    CheckResult c;
    c.rounding = rounds_weights(job.dtype) ? kBf16WeightRounding : 0;
    agree(world, [&] {
      if (!rank0) return;
      check_rows(job, r, sample_rows(o.S, o.check_rows), c);
      check_keys(job, r, sample_rows(o.S, o.check_rows), c);
    });
    checks.push_back(c);
    if (!rank0) continue;
    // docs/spec.md §9: forward FLOPs = 4 B Hq D A, backward = 2.5x that; the rate is of the mask area, so skipping
    // masked-out work shows up as speed.
    const double area = static_cast<double>(mask_area(layer.mask, meta));
    const double fwd_flops = 4.0 * job.shape.B * job.shape.Hq * job.shape.D * area, bwd_flops = 2.5 * fwd_flops;
    std::printf("%-8s %-22s %4d %8.4f %8.3fs %11.1f %8.3fs %11.1f\n", layer.name, layer.mask.name().c_str(), layer.D,
                area / (static_cast<double>(o.S) * o.S), r.forward_seconds, fwd_flops / r.forward_seconds * 1e-9,
                r.backward_seconds, bwd_flops / r.backward_seconds * 1e-9);
  }

  bool ok = true;
  if (rank0) {
    const int sampled = static_cast<int>(sample_rows(o.S, o.check_rows).size());
    char rounding_note[96] = "";
    if (!checks.empty() && checks[0].rounding > 0)
      std::snprintf(rounding_note, sizeof(rounding_note), "; out, dQ, dK, dV +%.1e for bf16 weights on vdpbf16ps",
                    checks[0].rounding);
    std::printf(
        "checks (out/lse/dQ of %d sampled query rows against the scalar reference, tolerance %.0e; "
        "dK/dV of %d sampled keys recomputed per key in double, tolerance %.0e%s):\n",
        sampled, kRowTolerance, sampled, kKeyTolerance, rounding_note);
    for (size_t l = 0; l < layers.size(); ++l) {
      const CheckResult& c = checks[l];
      std::printf("%-8s out %.1e  lse %.1e  dQ %.1e  dK %.1e  dV %.1e  %s\n", layers[l].name, c.out, c.lse, c.dq, c.dk,
                  c.dv, c.ok() ? "ok" : "FAILED");
      ok = ok && c.ok();
    }
  }
  agree(world, [&] { RF_CHECK(ok, "demo: the attention results differ from their checks beyond tolerance"); });
  return 0;
}

}  // namespace

void add_demo_command(CLI::App& app, Runner& run) {
  auto o = std::make_shared<DemoOptions>();
  CLI::App* cmd = app.add_subcommand("demo", "Gemma 4-like built-in case: sliding and full layers, checked and timed");
  cmd->add_option("--seq", o->S, "Tokens in the row")->check(CLI::Range(2, 1 << 20));
  cmd->add_option("--heads", o->Hq, "Query heads Hq")->check(CLI::Range(1, 128));
  cmd->add_option("--kv-heads", o->Hkv, "Key/value heads Hkv (divides Hq)")->check(CLI::Range(1, 128));
  cmd->add_option("--head-dim", o->D, "Head dimension of the sliding layer")->check(CLI::Range(1, kMaxHeadDim));
  cmd->add_option("--full-head-dim", o->D_full, "Head dimension of the full layer")->check(CLI::Range(1, kMaxHeadDim));
  cmd->add_option("--window", o->window, "Sliding window W")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--dtype", o->dtype, "Input and output dtype")->check(CLI::IsMember({"bf16", "f32"}));
  cmd->add_option("--check-rows", o->check_rows, "Query rows and keys checked")->check(CLI::Range(1, 4096));
  cmd->add_option("--threads", o->threads, "Threads per rank (default: every core)")->check(CLI::Range(1, 1024));
  cmd->add_option("--seed", o->seed, "Seed of the row and the tensors");
  cmd->add_option("--shard", o->cp.shard, "Sharding scheme under mpirun (default: the best one)")
      ->check(CLI::IsMember({"contiguous", "zigzag", "balanced"}));
  cmd->add_option("--algo", o->cp.algo, "CP algorithm under mpirun")->check(CLI::IsMember({"ring", "allgather"}));
  cmd->callback([&run, o] {
    run = [o] {
      const std::unique_ptr<comm::Communicator> world = comm::make_mpi_world();
      agree(*world,
            [&] { RF_CHECK(o->Hq % o->Hkv == 0, "--heads ", o->Hq, " is not a multiple of --kv-heads ", o->Hkv); });
      return run_demo(*o, *world);
    };
  });
}

}  // namespace rf::cli
