// Benchmark of expert parallelism (cp/ep_experts.h): a Gemma 4 26B-A4B-shaped MoE block (128 experts, top 8,
// H 2816, moe_intermediate_size 704; a small attention and dense MLP beside it), run as
//   OMP_NUM_THREADS=1 mpirun --oversubscribe -n 4 BUILD/bench/model/bench_moe_ep --ep 1 2 4 --tokens 256
// Every rank holds its own rows (data parallel; T tokens each), the experts divided over EP groups of ep
// consecutive ranks. For each ep, one forward + backward first checks the loss is the bits of ep 1 (the dispatch's
// promise), then `--repeats` steps are timed. Rank 0 prints per ep: the experts each rank runs and their float32
// bytes, the routed rows each rank sent to other ranks' experts per step, the bytes it sent per token against the
// uniform-routing formula, and the median step time of the slowest rank. At ep > 1 a rank's store holds its own
// experts only (model/expert_store.h: weights and gradients, E / ep experts' worth), as training under shard none
// does; the whole model (for ep 1 and to cut the others from) stays too, so memory is ~2 x 3.0 GB per layer per rank
// at the full shape plus the held copy: shrink --experts on a small machine.
#include <mpi.h>
#include <omp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/mpi_comm.h"
#include "core/error.h"
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

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
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
    CLI::App app{"expert parallelism on a 26B-A4B-shaped MoE block"};
    app.add_option("--ep", eps, "EP sizes (each divides the ranks and the experts)");
    app.add_option("--tokens", s.tokens, "tokens per rank");
    app.add_option("--experts", s.experts, "experts per MoE layer");
    app.add_option("--top-k", s.top_k, "experts per token");
    app.add_option("--hidden", s.hidden, "hidden size H");
    app.add_option("--moe-intermediate", s.moe_intermediate, "expert intermediate size");
    app.add_option("--layers", s.layers, "decoder layers, each with its MoE block");
    app.add_option("--repeats", repeats, "timed steps per EP size");
    try {
      app.parse(argc, argv);
      const int P = world->size(), rank = world->rank();
      for (int ep : eps)
        RF_CHECK(ep >= 1 && P % ep == 0 && s.experts % ep == 0, "--ep ", ep, " must divide the ", P, " ranks and the ",
                 s.experts, " experts");
      model::Gemma4Model m(model::Gemma4Config::from_json(config_json(s)), 0);
      constexpr float kInitStd = 0.02f;  // the checkpoint's scale: routing spread over the experts
      m.init_random(1, kInitStd);
      Rows rows;
      std::mt19937 rng(static_cast<uint32_t>(100 + rank));  // each rank its own tokens
      for (int t = 0; t < s.tokens; ++t) {
        rows.ids.push_back(static_cast<int32_t>(rng() % 256));
        rows.labels.push_back(static_cast<int32_t>(rng() % 256));
      }
      const model::Batch batch = rows.view(s.tokens);
      model::RunOptions opt;
      opt.want_grad = true;
      m.params().allocate_grads();
      auto self = world->split(rank, 0);  // attention on this rank's rows alone
      double reference_loss = 0;
      if (rank == 0)
        std::printf("E %d, top %d, H %d, I %d, %d layer(s), %d tokens per rank, %d ranks, %d threads\n", s.experts,
                    s.top_k, s.hidden, s.moe_intermediate, s.layers, s.tokens, P, omp_get_max_threads());
      for (int ep : eps) {
        auto group = world->split(rank / ep, rank % ep);
        cp::JobContext ctx = cp::make_parallel_context(*self, {}, group.get());
        // ep > 1: this rank's experts only, cut from the whole model.
        model::Gemma4Model held(m.config(), 0, model::TensorSet::Storage::Deferred);
        if (ep > 1) {
          held.replace_params(model::hold_expert_rows(m.params(), rank % ep, ep));
          held.params().allocate_grads();
        }
        model::Gemma4Model& run = ep > 1 ? held : m;
        run.params().zero_grads();
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
              "%.1f KiB sent per token (uniform routing: %.1f), step %.3f s (median of %d)\n",
              ep, s.experts / ep, expert_bytes / 1e9, static_cast<long long>(moved[0]),
              static_cast<double>(moved[1]) / s.tokens / 1024.0, formula / 1024.0, times[times.size() / 2], repeats);
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
