// ringflex bench: per-rank figures of CP attention (docs/spec.md §9) under `mpirun -n P`: peak attention bytes (ring,
// all-gather, and the seed's collect-all-then-compute from its formula), bytes sent, work (mask area) and its
// max/mean imbalance across ranks, and exposed communication = ring wall time minus time inside the kernels.
//
// Collect-all-then-compute (the seed's ring) held every chunk before computing: P chunks of K, V and metadata
// plus the merged o/lse and one partial; it moves the same bytes as an unpruned ring, so only its memory is
// reported, from that formula. Before timing, the same configuration is run at a small S and checked against the
// scalar reference. Rank 0 prints one markdown row per (scheme, algorithm).
#include <mpi.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "bench_inputs.h"
#include "comm/mpi_comm.h"
#include "core/error.h"
#include "core/row_meta.h"
#include "cp/cp_attention.h"
#include "cp/rows.h"
#include "cp/shard.h"
#include "reference/attention_ref.h"

namespace {

constexpr uint64_t kSeed = 2026;
constexpr int kValidateS = 192;        // small enough for the scalar reference, spans several 64-token tiles
constexpr double kValidateTol = 2e-3;  // sanity bound (float32 kernels vs double); tests hold the exact bound
constexpr double kMiB = 1024.0 * 1024.0;

struct Config {
  int S = 16384, D = 256, Hq = 8, Hkv = 1, window = 0, repeats = 3;
  bool causal = true, groups = false, backward = false, time = true;
  std::string row = "onedoc", dtype = "f32", schemes = "contiguous,zigzag", algos = "ring-chunks,ring,allgather";
};

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) out.push_back(item);
  return out;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

using rf::bench::uniform;

rf::LayerMask mask_of(const Config& c) { return rf::LayerMask{c.causal, c.window, c.groups}; }

// --algos names: "ring" (planned traffic, the default), "ring-chunks" (whole chunks hop rank to rank), "allgather".
struct AlgoChoice {
  rf::cp::Algo algo;
  rf::cp::RingTraffic traffic;
};
AlgoChoice parse_choice(const std::string& name) {
  if (name == "ring-chunks") return {rf::cp::Algo::Ring, rf::cp::RingTraffic::Chunks};
  return {rf::cp::parse_algo(name), rf::cp::RingTraffic::Planned};
}

// The generated rows of one configuration, identical on every rank (B = 1): q, dout [Hq, S, D] and k, v [Hkv, S, D]
// in dtype, meta [S]; `input` points at them.
struct Rows {
  std::vector<rf::TokenMeta> meta;
  std::vector<uint8_t> q, k, v, dout;
  rf::cp::RowsInput input;
};

Rows make_rows(const Config& c, int S) {
  Rows rows;
  rows.meta = c.row == "vlm" ? rf::gemma4_vlm_row(S, kSeed) : rf::make_row_meta(S, nullptr, nullptr);
  const rf::DType dt = c.dtype == "bf16" ? rf::DType::BF16 : rf::DType::F32;
  const auto make = [&](int H, uint64_t seed) {
    const std::vector<float> full = uniform(int64_t{H} * S * c.D, seed);
    std::vector<uint8_t> typed(full.size() * rf::dtype_size(dt));
    rf::from_float(typed.data(), full.data(), full.size(), dt);
    return typed;
  };
  rows.q = make(c.Hq, kSeed + 1);
  rows.k = make(c.Hkv, kSeed + 2);
  rows.v = make(c.Hkv, kSeed + 3);
  rows.dout = make(c.Hq, kSeed + 4);
  rows.input = {rf::AttnShape{1, c.Hq, c.Hkv, S, S, c.D},
                dt,
                rows.q.data(),
                rows.k.data(),
                rows.v.data(),
                rows.dout.data(),
                rows.meta.data()};
  return rows;
}

// The library's whole-row options for one (scheme, algorithm): the shard map is chosen where the CLI chooses it.
rf::cp::RowsOptions options_of(const Config& c, rf::cp::Scheme scheme, AlgoChoice choice) {
  rf::cp::RowsOptions o;
  o.scheme = rf::cp::scheme_name(scheme);
  o.params.mask = mask_of(c);
  o.params.algo = choice.algo;
  o.params.traffic = choice.traffic;
  return o;
}

// Runs the configuration's forward at kValidateS through cp_attention_rows and checks the out/lse gathered on
// rank 0 against the reference.
void validate(rf::comm::Communicator& comm, const Config& c, rf::cp::Scheme scheme, AlgoChoice choice) {
  const int S = kValidateS;
  Rows rows = make_rows(c, S);
  rows.input.dout = nullptr;  // forward only
  const rf::cp::RowsResult ran = rf::cp::cp_attention_rows(comm, rows.input, options_of(c, scheme, choice));
  if (comm.rank() != 0) return;
  const rf::AttnChunk chunk{rows.input.shape, rows.input.dtype, rows.q.data(), rows.k.data(),         rows.v.data(),
                            rows.meta.data(), rows.meta.data(), mask_of(c),    rf::default_scale(c.D)};
  const rf::RefForward ref = rf::reference_forward(chunk);
  double err = 0;
  for (size_t i = 0; i < ran.out.size(); ++i) err = std::max(err, std::fabs(ran.out[i] - ref.o[i]));
  for (size_t i = 0; i < ran.lse.size(); ++i)
    if (std::isfinite(ref.lse[i])) err = std::max(err, std::fabs(ran.lse[i] - ref.lse[i]));
  RF_CHECK(err <= kValidateTol, "validation failed for ", rf::cp::scheme_name(scheme), "/",
           rf::cp::algo_name(choice.algo), ": max error ", err);
}

struct Figures {
  double peak_mib = 0, sent_mib = 0, sent_mean_mib = 0, work_imbalance = 0, work_max = 0, wall = 0, compute = 0,
         exposed = 0;
};

// Timed runs; per repeat the figures are maxima over ranks, then medians over repeats.
Figures measure(rf::comm::Communicator& comm, const Config& c, rf::cp::Scheme scheme, AlgoChoice choice) {
  const int P = comm.size();
  const rf::cp::RowsOptions opt = options_of(c, scheme, choice);
  // This rank's shard, cut by the library's whole-row pipeline; the timed loop below repeats only its CP calls.
  rf::cp::Scheme map_scheme = scheme;
  const rf::cp::RowsShard shard = [&] {
    const Rows rows = make_rows(c, c.S);  // the full rows live only while this rank cuts its shard
    const rf::cp::ShardMap map = rf::cp::rows_shard_map(rows.input, opt, P);
    map_scheme = map.scheme;
    return rf::cp::shard_rows(rows.input, map, comm.rank());
  }();
  const rf::cp::CpShard x = shard.view();
  rf::cp::CpStats st;
  rf::cp::CpParams p = opt.params;
  p.scheme = map_scheme;
  std::vector<float> o(static_cast<size_t>(x.shape.q_elems())), lse(static_cast<size_t>(x.shape.lse_elems()));
  std::vector<float> dq(o.size()), dk(static_cast<size_t>(x.shape.kv_elems())), dv(dk.size());
  std::vector<double> walls, computes, exposeds;
  Figures f;
  for (int rep = 0; rep < std::max(1, c.time ? c.repeats : 1); ++rep) {
    // With --backward the figures are the backward's; its forward runs first, unmeasured.
    p.stats = c.backward ? nullptr : &st;
    rf::cp::cp_attention_forward(comm, x, p, o.data(), lse.data());
    if (c.backward) {
      p.stats = &st;
      rf::cp::cp_attention_backward(comm, x, p, o.data(), lse.data(), shard.dout.data(), dq.data(), dk.data(),
                                    dv.data());
    }
    // mine: peak, sent, work, wall, compute; gathered over ranks.
    const double mine[5] = {static_cast<double>(st.peak_attention_bytes), static_cast<double>(st.bytes_sent),
                            static_cast<double>(st.work), st.wall_seconds, st.compute_seconds};
    std::vector<double> all(5 * static_cast<size_t>(P));
    comm.allgather(mine, all.data(), sizeof mine, rf::comm::kDefaultTimeout);
    double peak = 0, sent = 0, sent_sum = 0, wmax = 0, wsum = 0, wall = 0, comp = 0, exposed = 0;
    for (int j = 0; j < P; ++j) {
      const double* a = all.data() + 5 * j;
      peak = std::max(peak, a[0]);
      sent = std::max(sent, a[1]);
      sent_sum += a[1];
      wmax = std::max(wmax, a[2]);
      wsum += a[2];
      wall = std::max(wall, a[3]);
      comp = std::max(comp, a[4]);
      exposed = std::max(exposed, a[3] - a[4]);
    }
    f.peak_mib = peak / kMiB;
    f.sent_mib = sent / kMiB;
    f.sent_mean_mib = sent_sum / P / kMiB;
    f.work_max = wmax;
    f.work_imbalance = wsum > 0 ? wmax / (wsum / P) : 1.0;
    walls.push_back(wall);
    computes.push_back(comp);
    exposeds.push_back(exposed);
  }
  f.wall = median(walls);
  f.compute = median(computes);
  f.exposed = median(exposeds);
  return f;
}

// Per-rank sizes from the shapes: one K/V chunk (K, V, metadata) and the forward's float32 o + lse.
struct Sizes {
  double chunk = 0, out = 0, group_partial = 0;
};
Sizes sizes_of(const Config& c, int P) {
  const rf::cp::ShardMap m = rf::cp::make_shard_map(rf::cp::Scheme::Contiguous, c.S, P);
  const double es = c.dtype == "bf16" ? 2 : 4, f = sizeof(float);
  const double G = static_cast<double>(c.Hq) / c.Hkv;
  return {2.0 * c.Hkv * m.L * c.D * es + m.L * sizeof(rf::TokenMeta), (double{1} * c.Hq * m.L * c.D + c.Hq * m.L) * f,
          (G * m.L * c.D + G * m.L) * f};
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  CLI::App app{"bench_cp: per-rank figures of CP attention; run under mpirun -n P"};
  app.add_option("--S", c.S, "tokens in the row");
  app.add_option("--D", c.D, "head dimension");
  app.add_option("--Hq", c.Hq, "query heads");
  app.add_option("--Hkv", c.Hkv, "key/value heads");
  app.add_option("--window", c.window, "sliding window (0 = none)");
  app.add_flag(
      "--no-causal", [&](int64_t) { c.causal = false; }, "bidirectional mask");
  app.add_flag("--groups", c.groups, "bidirectional image groups");
  app.add_option("--row", c.row, "onedoc | vlm (Gemma 4 VLM-like packed row)");
  app.add_option("--dtype", c.dtype, "f32 | bf16");
  app.add_option("--schemes", c.schemes, "comma-separated shard schemes (contiguous, zigzag, balanced)");
  app.add_option("--algos", c.algos, "comma-separated: ring (planned traffic), ring-chunks, allgather");
  app.add_option("--repeats", c.repeats, "timed repeats (median reported)");
  app.add_flag("--backward", c.backward, "measure the backward (after an unmeasured forward)");
  app.add_flag(
      "--no-time", [&](int64_t) { c.time = false; }, "one run: bytes and work only");
  CLI11_PARSE(app, argc, argv);

  MPI_Init(&argc, &argv);
  int code = 0;
  {
    std::unique_ptr<rf::comm::Communicator> comm = rf::comm::make_mpi_world();
    const int P = comm->size();
    try {
      if (comm->rank() == 0) {
        // The seed's collect-all-then-compute held all P chunks, the merged o/lse and a full partial; the ring's
        // bound is three chunks, o/lse and one kv-head group's partial.
        const Sizes z = sizes_of(c, P);
        std::printf(
            "%s: P=%d S=%d D=%d Hq=%d Hkv=%d %s causal=%d W=%d groups=%d row=%s\n"
            "per rank: K/V chunk %.2f MiB, o+lse %.2f MiB; forward peak bounds: ring (3 chunks + o/lse + "
            "group partial) %.2f MiB, collect-all-then-compute (P chunks + o/lse + partial) %.2f MiB\n\n",
            c.backward ? "backward" : "forward", P, c.S, c.D, c.Hq, c.Hkv, c.dtype.c_str(), c.causal, c.window,
            c.groups, c.row.c_str(), z.chunk / kMiB, z.out / kMiB, (3 * z.chunk + z.out + z.group_partial) / kMiB,
            (P * z.chunk + 2 * z.out) / kMiB);
        std::printf(
            "| P | scheme | algo | peak attn MiB/rank | sent MiB/rank max / mean | work max (pairs) | imbalance "
            "max/mean | wall s | compute s | exposed s | exposed/compute |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|\n");
      }
      for (const std::string& sn : split(c.schemes))
        for (const std::string& an : split(c.algos)) {
          const rf::cp::Scheme scheme = rf::cp::parse_scheme(sn);
          const AlgoChoice algo = parse_choice(an);
          validate(*comm, c, scheme, algo);
          const Figures f = measure(*comm, c, scheme, algo);
          if (comm->rank() != 0) continue;
          if (c.time)
            std::printf("| %d | %s | %s | %.2f | %.2f / %.2f | %.0f | %.3f | %.3f | %.3f | %.3f | %.1f%% |\n", P,
                        sn.c_str(), an.c_str(), f.peak_mib, f.sent_mib, f.sent_mean_mib, f.work_max, f.work_imbalance,
                        f.wall, f.compute, f.exposed, 100 * f.exposed / f.compute);
          else
            std::printf("| %d | %s | %s | %.2f | %.2f / %.2f | %.0f | %.3f | - | - | - | - |\n", P, sn.c_str(),
                        an.c_str(), f.peak_mib, f.sent_mib, f.sent_mean_mib, f.work_max, f.work_imbalance);
          std::fflush(stdout);
        }
    } catch (const rf::Error& e) {
      std::fprintf(stderr, "bench_cp: rank %d: %s\n", comm->rank(), e.what());
      code = 1;
    }
  }
  MPI_Finalize();
  return code;
}
