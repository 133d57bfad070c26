// Benchmark of expert parallelism (cp/ep_experts.h): a Gemma 4 26B-A4B-shaped MoE block (128 experts, top 8,
// H 2816, moe_intermediate_size 704; a small attention and dense MLP beside it), run as
//   OMP_NUM_THREADS=1 mpirun --oversubscribe -n 4 BUILD/bench/model/bench_moe_ep --ep 1 2 4 --tokens 256
// Every rank holds its own rows (data parallel; T tokens each), the experts divided over EP groups of ep
// consecutive ranks. For each ep, one forward + backward first checks the loss is the bits of ep 1 (the dispatch's
// promise), then `--repeats` steps are timed. Rank 0 prints per ep: the experts each rank runs and their float32
// bytes, the routed rows each rank sent to other ranks' experts per step, the bytes it sent per token against the
// uniform-routing formula, the median step time of the slowest rank and the exposed communication (the seconds in
// dispatch and combine a step, the most of any rank: they block, so all of it is exposed). A rank's store holds
// its own experts only (model/expert_store.h: weights and gradients, E / ep experts' worth), as training does, made
// for one ep at a time: each weight element is drawn from a counter-based hash of (tensor, element), so every ep's
// rows hold ep 1's values without a whole copy. Memory per rank is about layers x 6.1 GB / ep at the full shape
// (float32 weights and gradients of 128 x 3 x 704 x 2816 expert elements a layer), so four ranks at ep 1 need
// 24 GB a layer: on a small machine run the larger eps, or shrink --experts.
//
// --exchange compares the two ways to move one MoE layer's forward rows, the exchanges alone (no model, random top-k
// routing of distinct experts, uniform over E), at each ep:
//   alltoall   the dispatch this repo runs (cp::EpExperts): the counts exchanged, each routed row to its expert's
//              rank, the expert outputs back (two alltoallv of k x T rows, the (ep - 1)/ep of them that leave)
//   allgather  all-gather of every rank's T tokens and their k expert indices over the EP group, then a
//              reduce-scatter of the [ep x T, H] partial sums (each rank's experts' weighted outputs for every
//              token): (ep - 1) x T x H each way, no counts, but the combine's sum over ranks reassociates the
//              token's expert sum (not the bits of ep 1), so the model does not use it
// Rank 0 prints bytes sent per token (the most of any rank) and the median seconds of each (slowest rank).
//   OMP_NUM_THREADS=1 mpirun --oversubscribe -n 4 BUILD/bench/model/bench_moe_ep --exchange --ep 2 4 --tokens 256
#include <mpi.h>
#include <omp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/mpi_comm.h"
#include "core/error.h"
#include "core/mix.h"
#include "cp/ep_experts.h"
#include "cp/parallel_context.h"
#include "model/expert_store.h"
#include "model/gemma4.h"

namespace {

using namespace rf;

struct Shape {
  int experts = 128, top_k = 8, hidden = 2816, moe_intermediate = 704, layers = 1, tokens = 256;
};

std::string config_json(const Shape& s) {
  std::string types;
  for (int l = 0; l < s.layers; ++l) types += std::string(l ? ", " : "") + "\"sliding_attention\"";
  return concat(R"({"vocab_size": 256, "hidden_size": )", s.hidden, R"(, "intermediate_size": 256,
    "num_hidden_layers": )",
                s.layers, R"(, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
    "sliding_window": 128, "layer_types": [)",
                types, R"(], "hidden_size_per_layer_input": 0, "rms_norm_eps": 1e-6,
    "enable_moe_block": true, "num_experts": )",
                s.experts, R"(, "top_k_experts": )", s.top_k, R"(, "moe_intermediate_size": )", s.moe_intermediate,
                R"(, "tie_word_embeddings": true})");
}

struct Rows {
  std::vector<int32_t> ids, labels;
  model::Batch view(int S) const {
    model::Batch b;
    b.B = 1;
    b.S = S;
    b.input_ids = ids.data();
    b.labels = labels.data();
    return b;
  }
};

// The weights of `store` (allocated; its expert tensors possibly held in part), each element a function of its
// tensor's slot and its index in the whole tensor alone: 1-D scales 1 + noise, the rest noise of `stddev` (uniform,
// so that no rank's draw depends on another's). Any EP's held rows get the values of the whole tensor's.
void fill_by_hash(model::ParamStore& store, uint64_t seed, float stddev) {
  const float half_width = stddev * std::sqrt(3.f);  // a uniform on [-w, w) has standard deviation w / sqrt(3)
  constexpr double kTwoTo53 = 9007199254740992.0;    // 53 bits of the hash: a double in [0, 1)
  for (size_t slot = 0; slot < store.size(); ++slot) {
    const model::ParamInfo& p = store.info(slot);
    const bool scale = p.shape.size() == 1;
    const uint64_t key = splitmix64(seed ^ splitmix64(slot));
    const int64_t first = p.rows_begin * model::row_elements(p);
    float* w = store.mutable_weight(slot);
    for (int64_t j = 0; j < p.numel; ++j) {
      const double u = static_cast<double>(splitmix64(key ^ static_cast<uint64_t>(first + j)) >> 11) / kTwoTo53;
      w[j] = (scale ? 1.f : 0.f) + half_width * static_cast<float>(2.0 * u - 1.0);
    }
  }
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The median over `repeats` of the slowest rank's seconds for `exchange`, and the most bytes any rank of `group`
// sent per call.
struct Measured {
  double seconds = 0;
  int64_t bytes = 0;
};
template <class F>
Measured measure(comm::Communicator& world, comm::Communicator& group, int repeats, F exchange) {
  std::vector<double> times;
  const uint64_t before = group.traffic().bytes_sent;
  for (int i = 0; i < repeats; ++i) {
    world.barrier();
    const auto t0 = std::chrono::steady_clock::now();
    exchange();
    double t = seconds_since(t0);
    world.allreduce(&t, 1, comm::ReduceOp::Max);
    times.push_back(t);
  }
  std::sort(times.begin(), times.end());
  int64_t bytes = static_cast<int64_t>(group.traffic().bytes_sent - before) / std::max(repeats, 1);
  world.allreduce(&bytes, 1, comm::ReduceOp::Max);
  return {times[times.size() / 2], bytes};
}

// --exchange: one MoE layer's forward exchanges, all-to-all against all-gather + reduce-scatter (see the top).
void compare_exchanges(comm::Communicator& world, const Shape& s, const std::vector<int>& eps, int repeats) {
  const int rank = world.rank();
  const int64_t T = s.tokens, K = s.top_k, H = s.hidden, E = s.experts;
  std::mt19937 rng(static_cast<uint32_t>(200 + rank));
  std::vector<int32_t> top(static_cast<size_t>(T * K));  // [T, K] distinct experts per token
  std::vector<int32_t> order(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    std::copy_n(order.begin(), K, top.begin() + t * K);
  }
  std::vector<float> tokens(static_cast<size_t>(T * H), 1.f);  // [T, H]
  for (int ep : eps) {
    auto group = world.split(rank / ep, rank % ep);
    // alltoall: rows by expert, as moe.cpp lays them out.
    cp::EpExperts experts(*group);
    ExpertRouting routing;
    routing.experts = E;
    routing.sent.assign(static_cast<size_t>(E), 0);
    for (int32_t e : top) ++routing.sent[static_cast<size_t>(e)];
    std::vector<float> sent(static_cast<size_t>(T * K * H), 1.f), received, back(sent.size());
    const Measured a2a = measure(world, *group, repeats, [&] {
      experts.route(routing);
      received.resize(static_cast<size_t>(routing.received_rows() * H));
      experts.dispatch(routing, sent.data(), received.data(), H);
      experts.combine(routing, received.data(), back.data(), H);
    });
    // allgather: every rank's tokens and their experts, then the partial sums reduce-scattered back.
    const size_t token_bytes = static_cast<size_t>(T * H) * sizeof(float), index_bytes = top.size() * sizeof(int32_t);
    std::vector<float> all_tokens(static_cast<size_t>(ep) * T * H);  // [ep, T, H]
    std::vector<int32_t> all_top(static_cast<size_t>(ep) * T * K);   // [ep, T, K]
    std::vector<float> partial(all_tokens.size());                   // [ep, T, H]
    const std::vector<size_t> token_parts(static_cast<size_t>(ep), token_bytes);
    const std::vector<size_t> index_parts(static_cast<size_t>(ep), index_bytes);
    const Measured agrs = measure(world, *group, repeats, [&] {
      std::copy(tokens.begin(), tokens.end(), all_tokens.begin() + static_cast<int64_t>(group->rank()) * T * H);
      std::copy(top.begin(), top.end(), all_top.begin() + static_cast<int64_t>(group->rank()) * T * K);
      group->allgatherv(all_tokens.data(), token_parts);
      group->allgatherv(all_top.data(), index_parts);
      std::copy(all_tokens.begin(), all_tokens.end(), partial.begin());  // stands for the experts' weighted sums
      group->reduce_scatter(partial.data(), partial.size(), comm::ReduceOp::Sum);
    });
    const double formula_a2a = 2.0 * K * H * sizeof(float) * (ep - 1.0) / ep;
    const double formula_agrs = 2.0 * (ep - 1.0) * H * sizeof(float);
    if (rank == 0)
      std::printf(
          "ep %d exchanges of one forward layer: alltoall %.1f KiB/token (uniform: %.1f) %.4f s, "
          "allgather + reduce-scatter %.1f KiB/token (formula: %.1f) %.4f s (medians of %d)\n",
          ep, static_cast<double>(a2a.bytes) / T / 1024.0, formula_a2a / 1024.0, a2a.seconds,
          static_cast<double>(agrs.bytes) / T / 1024.0, formula_agrs / 1024.0, agrs.seconds, repeats);
  }
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rc = 0;
  {
    auto world = comm::make_mpi_world();
    Shape s;
    std::vector<int> eps{1, 2, 4};
    int repeats = 3;
    bool exchange = false;
    CLI::App app{"expert parallelism on a 26B-A4B-shaped MoE block"};
    app.add_option("--ep", eps, "EP sizes (each divides the ranks and the experts)");
    app.add_option("--tokens", s.tokens, "tokens per rank");
    app.add_option("--experts", s.experts, "experts per MoE layer");
    app.add_option("--top-k", s.top_k, "experts per token");
    app.add_option("--hidden", s.hidden, "hidden size H");
    app.add_option("--moe-intermediate", s.moe_intermediate, "expert intermediate size");
    app.add_option("--layers", s.layers, "decoder layers, each with its MoE block");
    app.add_option("--repeats", repeats, "timed steps per EP size");
    app.add_flag("--exchange", exchange, "compare all-to-all with all-gather + reduce-scatter, the exchanges alone");
    try {
      app.parse(argc, argv);
      const int P = world->size(), rank = world->rank();
      for (int ep : eps)
        RF_CHECK(ep >= 1 && P % ep == 0 && s.experts % ep == 0, "--ep ", ep, " must divide the ", P, " ranks and the ",
                 s.experts, " experts");
      RF_CHECK(s.top_k >= 1 && s.top_k <= s.experts, "--top-k ", s.top_k, " must be in [1, ", s.experts, "]");
      if (exchange) {
        compare_exchanges(*world, s, eps, repeats);
      } else {
        const model::Gemma4Config config = model::Gemma4Config::from_json(config_json(s));
        constexpr float kInitStd = 0.02f;  // the checkpoint's scale: routing spread over the experts
        constexpr uint64_t kSeed = 1;
        Rows rows;
        std::mt19937 rng(static_cast<uint32_t>(100 + rank));  // each rank its own tokens
        for (int t = 0; t < s.tokens; ++t) {
          rows.ids.push_back(static_cast<int32_t>(rng() % 256));
          rows.labels.push_back(static_cast<int32_t>(rng() % 256));
        }
        const model::Batch batch = rows.view(s.tokens);
        model::RunOptions opt;
        opt.want_grad = true;
        auto self = world->split(rank, 0);  // attention on this rank's rows alone
        double reference_loss = 0;
        if (rank == 0)
          std::printf("E %d, top %d, H %d, I %d, %d layer(s), %d tokens per rank, %d ranks, %d threads\n", s.experts,
                      s.top_k, s.hidden, s.moe_intermediate, s.layers, s.tokens, P, omp_get_max_threads());
        for (int ep : eps) {
          auto group = world->split(rank / ep, rank % ep);
          cp::JobContext ctx = cp::make_parallel_context(*self, {}, group.get());
          // This rank's experts only (all of them at ep 1), their values ep 1's.
          model::Gemma4Model run(config, model::TensorSet::Storage::Deferred);
          if (ep > 1) run.replace_params(model::hold_expert_rows(run.params(), rank % ep, ep));
          run.params().allocate_weights();
          fill_by_hash(run.params(), kSeed, kInitStd);
          run.params().allocate_grads();
          const double loss = run.run(batch, opt, *ctx.model).loss;
          if (ep == eps.front()) reference_loss = loss;
          int64_t same = loss == reference_loss;
          world->allreduce(&same, 1, comm::ReduceOp::Min);
          RF_CHECK(same == 1, "ep ", ep, ": the loss is not the bits of ep ", eps.front());
          const ExpertTraffic before = ctx.model->experts().traffic();
          std::vector<double> times;
          for (int i = 0; i < repeats; ++i) {
            world->barrier();
            const auto t0 = std::chrono::steady_clock::now();
            run.params().zero_grads();
            run.run(batch, opt, *ctx.model);
            double t = seconds_since(t0);
            world->allreduce(&t, 1, comm::ReduceOp::Max);
            times.push_back(t);
          }
          std::sort(times.begin(), times.end());
          const ExpertTraffic after = ctx.model->experts().traffic();
          int64_t moved[2] = {(after.rows_sent - before.rows_sent) / std::max(repeats, 1),
                              (after.bytes_sent - before.bytes_sent) / std::max(repeats, 1)};
          world->allreduce(moved, 2, comm::ReduceOp::Max);
          double exposed = (after.seconds - before.seconds) / std::max(repeats, 1);  // a step's, the most of any rank
          world->allreduce(&exposed, 1, comm::ReduceOp::Max);
          double expert_bytes = 0;  // float32 weights of the experts this rank's store holds
          for (const model::ParamInfo& p : run.params().infos())
            if (model::is_expert_tensor(p)) expert_bytes += static_cast<double>(p.numel) * sizeof(float);
          // Uniform routing: (ep - 1)/ep of a token's k rows leave its rank, H float32 each, in every one of the
          // forward's dispatch and combine, their recompute's, and the backward's dispatch and combine.
          constexpr int kMovesPerStep = 6;
          const double formula = kMovesPerStep * s.layers * s.top_k * s.hidden * sizeof(float) * (ep - 1.0) / ep;
          if (rank == 0)
            std::printf(
                "ep %d: %d experts a layer here (%.2f GB float32), %lld rows sent a step (most of any rank), "
                "%.1f KiB sent per token (uniform routing: %.1f), step %.3f s (median of %d), exposed "
                "communication %.3f s a step\n",
                ep, s.experts / ep, expert_bytes / 1e9, static_cast<long long>(moved[0]),
                static_cast<double>(moved[1]) / s.tokens / 1024.0, formula / 1024.0, times[times.size() / 2], repeats,
                exposed);
        }
      }
    } catch (const CLI::ParseError& e) {
      rc = app.exit(e);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "bench_moe_ep: %s\n", e.what());
      rc = 1;
    }
  }
  MPI_Finalize();
  return rc;
}
