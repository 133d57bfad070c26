// Benchmark behind BENCHMARKS.md "Mask-aware CP": attention time and K/V bytes received of a sliding layer under
// the planned ring, the chunk ring and all-gather, run as `mpirun -n P bench_plan_ring` (the table uses P = 2).
//
// One document, causal sliding window W, contiguous shards, float32, Hq = 8 query heads on Hkv = 1 kv head of
// D = 256 (a Gemma 4 sliding layer's head size; the head counts keep a 2-core run short). For each (S, W) the
// three algorithms run forward + backward on the same shards, repeats interleaved; rank 0 prints the median wall
// time of the slowest rank, and the most K/V bytes (+ metadata) any rank received in the forward pass. The planned
// ring's out and dK are checked against the chunk ring's (they must be the same bits).
#include <mpi.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iterator>
#include <memory>
#include <vector>

#include "bench_inputs.h"
#include "comm/mpi_comm.h"
#include "core/error.h"
#include "core/row_meta.h"
#include "cp/cp_attention.h"
#include "cp/shard.h"

namespace {

using namespace rf;
using namespace rf::cp;

constexpr int kHq = 8, kHkv = 1, kD = 256;
constexpr double kMiB = 1024.0 * 1024.0;

struct Variant {
  const char* name;
  Algo algo;
  RingTraffic traffic;
};
constexpr Variant kVariants[] = {{"planned ring", Algo::Ring, RingTraffic::Planned},
                                 {"chunk ring", Algo::Ring, RingTraffic::Chunks},
                                 {"all-gather", Algo::AllGather, RingTraffic::Planned}};

using rf::bench::uniform;

// One variant's shards, buffers and results for one (S, W).
struct Run {
  CpShard x;
  CpParams p;
  CpStats stats;
  std::vector<TokenMeta> meta;
  std::vector<float> q, k, v, dout, o, lse, dq, dk, dv;
  std::vector<double> times;  // slowest rank's forward + backward wall time, per repeat
  int64_t max_received = 0;   // most forward bytes received by one rank
};

void setup(comm::Communicator& comm, int S, int W, const Variant& var, Run& run) {
  const int P = comm.size(), r = comm.rank();
  const ShardMap map = make_shard_map(Scheme::Contiguous, S, P);
  const int L = map.L;
  const std::vector<TokenMeta> row = make_row_meta(S, nullptr, nullptr);
  run.meta = shard_meta(map, r, row.data(), 1);
  run.q = uniform(int64_t{kHq} * L * kD, 1 + r);
  run.k = uniform(int64_t{kHkv} * L * kD, 11 + r);
  run.v = uniform(int64_t{kHkv} * L * kD, 21 + r);
  run.dout = uniform(int64_t{kHq} * L * kD, 31 + r);
  run.x =
      CpShard{AttnShape{1, kHq, kHkv, L, L, kD}, DType::F32, run.q.data(), run.k.data(), run.v.data(), run.meta.data()};
  run.p = CpParams{LayerMask{true, W, false}, 0.f,        var.algo,   Scheme::Contiguous,
                   comm::kDefaultTimeout,     &run.stats, var.traffic};
  run.o.resize(static_cast<size_t>(run.x.shape.q_elems()));
  run.dq.resize(run.o.size());
  run.lse.resize(static_cast<size_t>(run.x.shape.lse_elems()));
  run.dk.resize(static_cast<size_t>(run.x.shape.kv_elems()));
  run.dv.resize(run.dk.size());
}

void time_once(comm::Communicator& comm, Run& run) {
  comm.barrier();
  const auto t0 = std::chrono::steady_clock::now();
  cp_attention_forward(comm, run.x, run.p, run.o.data(), run.lse.data());
  int64_t received = run.stats.bytes_received;
  cp_attention_backward(comm, run.x, run.p, run.o.data(), run.lse.data(), run.dout.data(), run.dq.data(), run.dk.data(),
                        run.dv.data());
  double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  comm.allreduce(&t, 1, comm::ReduceOp::Max);
  comm.allreduce(&received, 1, comm::ReduceOp::Max);
  run.times.push_back(t);
  run.max_received = received;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Planned ring vs chunk ring vs all-gather on a sliding layer; run under mpirun"};
  int repeats = 3;
  std::vector<int> seqs = {8192, 32768};
  app.add_option("--repeats", repeats, "timed repeats per variant (median reported)")->capture_default_str();
  app.add_option("--seq", seqs, "row lengths S")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  MPI_Init(&argc, &argv);
  int code = 0;
  try {
    const std::unique_ptr<comm::Communicator> world = comm::make_mpi_world();
    comm::Communicator& comm = *world;
    if (comm.rank() == 0) {
      std::printf(
          "| S | W | P | algorithm | K/V received, max rank (MiB) | fwd+bwd (s, median of %d) | vs chunk ring |\n",
          repeats);
      std::printf("|---|---|---|---|---|---|---|\n");
    }
    for (const int S : seqs) {
      for (const int W : {512, 1024}) {
        // Repeats interleave the variants, so a burst of load on the shared machine hits all three alike.
        std::vector<Run> runs(std::size(kVariants));
        for (size_t i = 0; i < runs.size(); ++i) setup(comm, S, W, kVariants[i], runs[i]);
        for (int rep = 0; rep < repeats; ++rep)
          for (Run& run : runs) time_once(comm, run);
        RF_CHECK(runs[0].o == runs[1].o && runs[0].dk == runs[1].dk, "planned and chunk ring results differ at S = ", S,
                 ", W = ", W);
        if (comm.rank() != 0) continue;
        const double chunk_ring = median(runs[1].times);
        for (size_t i = 0; i < runs.size(); ++i) {
          std::printf("| %dK | %d | %d | %s | %.2f | %.3f | %.2fx |\n", S / 1024, W, comm.size(), kVariants[i].name,
                      runs[i].max_received / kMiB, median(runs[i].times), chunk_ring / median(runs[i].times));
        }
        std::fflush(stdout);
      }
    }
  } catch (const rf::Error& e) {
    std::fprintf(stderr, "bench_plan_ring: %s\n", e.what());
    code = 1;
  }
  MPI_Finalize();
  return code;
}
