// Benchmark of the float all-reduce (the gradients' reduction): the allgather-then-sum it replaced against the
// reduce-scatter + all-gather of src/comm/collectives.cpp, run as
//   OMP_NUM_THREADS=1 mpirun --oversubscribe -n P BUILD/bench/comm/bench_collectives --mib 1 16 64 256
// at P = 2, 4, 8. For each buffer size (MiB of float32 per rank) both algorithms run on the same inputs, repeats
// interleaved so a burst of load on a shared machine hits both alike. Rank 0 prints the most bytes any rank sent and
// received (measured by the backend, Communicator::traffic) beside the bandwidth-optimal 2 (P - 1)/P of the buffer,
// and the median wall time of the slowest rank. The two results are checked to be the same bits before anything is
// printed.
#include <mpi.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "comm/mpi_comm.h"
#include "core/error.h"

namespace {

using namespace rf;

constexpr double kMiB = 1024.0 * 1024.0;

// The all-reduce before the rebuild, kept here as the baseline: every rank allgathers every rank's whole buffer, in
// slices whose gathered copies take at most kReduceSliceBytes, and sums each element in rank order in double.
void allgather_then_sum(comm::Communicator& c, float* data, size_t n) {
  const size_t P = static_cast<size_t>(c.size());
  const size_t slice = std::max<size_t>(1, comm::Communicator::kReduceSliceBytes / (P * sizeof(float)));
  std::vector<float> all(P * std::min(slice, n));  // [P, slice]
  for (size_t begin = 0; begin < n; begin += slice) {
    const size_t len = std::min(slice, n - begin);
    c.allgather(data + begin, all.data(), len * sizeof(float), comm::default_timeout());
    for (size_t i = 0; i < len; ++i) {
      double acc = all[i];
      for (size_t r = 1; r < P; ++r) acc += all[r * len + i];
      data[begin + i] = static_cast<float>(acc);
    }
  }
}

// Rank r's element i: varied, so the sums depend on their order (rank 0 in [1, 2), the others a few ulps of 1).
float input(int r, size_t i) {
  constexpr float kStep = 0x1p-10f, kUlp = 0x1p-23f;
  return r == 0 ? 1.0f + static_cast<float>(i % 1024) * kStep
                : static_cast<float>(1 + (i + static_cast<size_t>(r)) % 3) * kUlp;
}

struct Variant {
  const char* name;
  void (*run)(comm::Communicator&, float*, size_t);
};
const Variant kVariants[] = {
    {"allgather + sum (before)", allgather_then_sum},
    {"reduce-scatter + all-gather",
     [](comm::Communicator& c, float* d, size_t n) { c.allreduce(d, n, comm::ReduceOp::Sum); }},
};

struct Figures {
  std::vector<double> times;  // slowest rank's wall time, per repeat
  double max_sent = 0, max_received = 0;
  std::vector<float> result;
};

double max_over_ranks(comm::Communicator& c, double x) {
  c.allreduce(&x, 1, comm::ReduceOp::Max);
  return x;
}

void run_once(comm::Communicator& c, const Variant& v, size_t n, Figures& f) {
  std::vector<float> data(n);
  for (size_t i = 0; i < n; ++i) data[i] = input(c.rank(), i);
  c.barrier();
  const comm::Communicator::Traffic before = c.traffic();
  const auto start = std::chrono::steady_clock::now();
  v.run(c, data.data(), n);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const comm::Communicator::Traffic after = c.traffic();
  f.times.push_back(max_over_ranks(c, seconds));
  f.max_sent = max_over_ranks(c, static_cast<double>(after.bytes_sent - before.bytes_sent));
  f.max_received = max_over_ranks(c, static_cast<double>(after.bytes_received - before.bytes_received));
  f.result = std::move(data);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"The float all-reduce: allgather + sum against reduce-scatter + all-gather; run under mpirun"};
  int repeats = 5;
  std::vector<double> mibs = {1, 16, 64, 256};
  app.add_option("--repeats", repeats, "timed repeats per algorithm (median reported)")->capture_default_str();
  app.add_option("--mib", mibs, "buffer sizes per rank, MiB of float32")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  MPI_Init(&argc, &argv);
  int code = 0;
  try {
    RF_CHECK(repeats >= 1, "--repeats must be at least 1");
    const std::unique_ptr<comm::Communicator> world = comm::make_mpi_world();
    comm::Communicator& c = *world;
    const int P = c.size();
    if (c.rank() == 0) {
      std::printf(
          "| MiB per rank | P | algorithm | sent, max rank (MiB) | received, max rank (MiB) | 2(P-1)/P bound (MiB) | "
          "time (s, median of %d) | vs before |\n",
          repeats);
      std::printf("|---|---|---|---|---|---|---|---|\n");
    }
    for (const double mib : mibs) {
      RF_CHECK(mib > 0, "--mib ", mib, " must be positive");
      const size_t n = static_cast<size_t>(mib * kMiB / sizeof(float));
      std::vector<Figures> figures(std::size(kVariants));
      for (int rep = 0; rep < repeats; ++rep)
        for (size_t v = 0; v < figures.size(); ++v) run_once(c, kVariants[v], n, figures[v]);
      RF_CHECK(figures[0].result == figures[1].result, "the two all-reduces differ at ", mib, " MiB over ", P,
               " ranks: the rank-order bits are lost");
      if (c.rank() != 0) continue;
      const double bound = 2.0 * (P - 1) / P * static_cast<double>(n * sizeof(float)) / kMiB;
      const double before = median(figures[0].times);
      for (size_t v = 0; v < figures.size(); ++v) {
        const Figures& f = figures[v];
        std::printf("| %g | %d | %s | %.2f | %.2f | %.2f | %.4f | %.2fx |\n", mib, P, kVariants[v].name,
                    f.max_sent / kMiB, f.max_received / kMiB, bound, median(f.times), before / median(f.times));
      }
      std::fflush(stdout);
    }
  } catch (const rf::Error& e) {
    std::fprintf(stderr, "bench_collectives: %s\n", e.what());
    code = 1;
  }
  MPI_Finalize();
  return code;
}
