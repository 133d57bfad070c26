// Expert parallelism under a real `mpirun -n P` (CTest runs it at P = 2 and 4): the MoE model with its experts
// divided over EP groups of 2 and P consecutive ranks, each rank routing its own tokens (data-parallel rows, or
// context-parallel shards of CP groups of 2), against the same ranks with every expert local (EP = 1, the
// LocalExperts dispatch; tests/model/test_model_grad.cpp checks that path against finite differences).
//
// What must be the same bits: a routed row meets the same sgemm shapes on its expert's rank (moe.cpp cuts tasks per
// source block), the rows travel by the counts alone (alltoallv), and each token combines its experts' outputs and
// input gradients in ascending expert index on its own rank. So the loss, every logit and token loss, and every
// gradient outside the experts' weights are compared bit for bit. The experts' weight gradients regroup: at EP = 1
// each rank's rows give one sgemm per expert and the all-reduce adds the ranks' sums in rank order; at EP > 1 the
// expert's rank accumulates its sources' sgemms in source order and the all-reduce adds zeros elsewhere. That is a
// reassociation of at most P = 4 float32 partial sums (each rounding 2^-24 ~ 6e-8 relative to its running sum), so
// the bound is 1e-5 in relative norm, room for a cancellation of 40x; a lost or doubled row moves it by 1e-1.
// bf16 matmuls keep the same promise (the same shapes per row). Routings: the random router (experts with no tokens on
// some ranks), and a zeroed router (every probability tied: every token of every rank to experts 0 and 1, top-k's ties
// to the lower index, the other experts idle).
//
// Held experts (model/expert_store.h): the same runs with each rank's store holding only its EP rank's experts'
// rows. Their gradients are summed over the ranks holding the same experts (the expert-data-parallel group) and
// gathered over the EP group; every other gradient over the world. Each element is combined in rank order in double
// and rounded once (Communicator::allreduce), and the ranks a whole-tensor store adds beyond the holders contribute
// exact zeros, so the held run gives the whole-tensor EP run's bits for every gradient, the loss and the logits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "common/mpi_world.h"
#include "common/row_arrays.h"
#include "cp/parallel_context.h"
#include "model/expert_store.h"
#include "model/gemma4.h"
#include "model/run_grads.h"

namespace rf::model {
namespace {

comm::Communicator& world() { return testing::mpi_world(); }

constexpr int kVocab = 40;
Gemma4Model make_model(int top_k = 2) {
  const std::string json = R"({"vocab_size": 40, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 3,
    "layer_types": ["sliding_attention", "full_attention"], "final_logit_softcapping": 4.0,
    "hidden_size_per_layer_input": 0, "rms_norm_eps": 1e-6, "attention_k_eq_v": true, "enable_moe_block": true,
    "num_experts": 8, "top_k_experts": )" +
                           std::to_string(top_k) + R"(, "moe_intermediate_size": 8, "tie_word_embeddings": false})";
  Gemma4Model m(Gemma4Config::from_json(json));
  constexpr float kInitStd = 0.3f;  // every path (norms, router, experts) carries an O(1) signal
  m.init_random(42, kInitStd);
  return m;
}

using testing::RowArrays;

// Two rows of S tokens, two documents each, labels -100 on every third token; ids from `seed`.
RowArrays make_rows(int S, uint64_t seed) {
  RowArrays r;
  r.S = S;
  std::mt19937 rng(static_cast<uint32_t>(seed));
  for (int i = 0; i < r.B * S; ++i) {
    const int s = i % S;
    r.doc.push_back(s < S / 3 ? 1 : 2);
    r.pos.push_back(s < S / 3 ? s : s - S / 3);
    r.mm.push_back(0);
    r.ids.push_back(1 + static_cast<int32_t>(rng() % (kVocab - 1)));
    r.labels.push_back(i % 3 == 2 ? -100 : static_cast<int32_t>(rng() % kVocab));
  }
  return r;
}

struct Outcome {
  Result result;
  TensorSet grads;
  int64_t rows_moved = 0;  // routed rows sent to other ranks' experts, summed over the world
};

// cp: ranks per CP group (consecutive world ranks, sharing their rows); ep: ranks per EP group (consecutive).
// hold: a copy of `m` whose store holds this rank's experts only runs instead (the gradients gathered whole).
Outcome run(Gemma4Model& whole, int cp, int ep, ComputeDtype dtype, bool hold = false) {
  const int rank = world().rank();
  auto cp_group = world().split(rank / cp, rank % cp);
  auto ep_group = world().split(rank / ep, rank % ep);
  auto edp_group = world().split(rank % ep, rank / ep);
  Gemma4Model held(whole.config(), TensorSet::Storage::Deferred);
  if (hold) held.replace_params(hold_expert_rows(whole.params(), rank % ep, ep));
  Gemma4Model& m = hold ? held : whole;
  cp::JobContext ctx = cp::make_parallel_context(*cp_group, {}, ep_group.get());
  EXPECT_EQ(ctx.model->experts().ranks(), ep);
  const RowArrays rows = make_rows(23, 100 + static_cast<uint64_t>(rank / cp));  // each CP group its own rows
  RunOptions opt;
  opt.want_grad = true;
  opt.want_logits = true;
  opt.compute_dtype = dtype;
  Outcome out;
  out.result = run_with_grads(m, rows.view(), opt, out.grads, *ctx.model);
  out.rows_moved = ctx.model->experts().traffic().rows_sent;
  world().allreduce(&out.rows_moved, 1, comm::ReduceOp::Sum);
  for (size_t s = 0; s < out.grads.size(); ++s) {
    Tensor& g = out.grads[s];
    if (g.data.empty()) continue;
    if (!m.params().info(s).holds_part()) {
      world().allreduce(g.data.data(), g.data.size(), comm::ReduceOp::Sum);
      continue;
    }
    edp_group->allreduce(g.data.data(), g.data.size(), comm::ReduceOp::Sum);
    std::vector<float> all(g.data.size() * static_cast<size_t>(ep));  // the EP ranks' rows in order: the tensor
    ep_group->allgather(g.data.data(), all.data(), g.data.size() * sizeof(float), comm::default_timeout());
    g.data = std::move(all);
  }
  return out;
}

double relative_error(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double{a[i]} - b[i]) * (double{a[i]} - b[i]);
    den += double{b[i]} * b[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

constexpr double kExpertGradTol = 1e-5;  // see the file's comment: reassociation of <= 4 float32 partial sums

void check_same_as_local(Gemma4Model& m, int cp, int ep, const std::string& what,
                         ComputeDtype dtype = ComputeDtype::Float32) {
  SCOPED_TRACE(what + ": cp " + std::to_string(cp) + ", ep " + std::to_string(ep) + ", P " +
               std::to_string(world().size()));
  const Outcome ref = run(m, cp, 1, dtype);
  const Outcome got = run(m, cp, ep, dtype);
  {
    SCOPED_TRACE("held experts");
    const Outcome held = run(m, cp, ep, dtype, true);
    EXPECT_EQ(held.result.loss, got.result.loss);
    EXPECT_EQ(held.result.logits, got.result.logits);
    EXPECT_EQ(held.rows_moved, got.rows_moved);
    ASSERT_EQ(held.grads.size(), got.grads.size());
    for (size_t s = 0; s < got.grads.size(); ++s) EXPECT_EQ(held.grads[s].data, got.grads[s].data) << got.grads[s].name;
  }
  EXPECT_EQ(got.result.loss, ref.result.loss);
  EXPECT_EQ(got.result.label_tokens, ref.result.label_tokens);
  EXPECT_EQ(got.result.token_loss, ref.result.token_loss);
  EXPECT_EQ(got.result.logits, ref.result.logits);
  EXPECT_EQ(ref.rows_moved, 0);
  EXPECT_GT(got.rows_moved, 0) << "the routed rows must really travel";
  ASSERT_EQ(got.grads.size(), ref.grads.size());
  double worst = 0;
  for (size_t s = 0; s < ref.grads.size(); ++s) {
    const std::string& name = ref.grads[s].name;
    if (name.find(".experts.") != std::string::npos) {
      const double err = relative_error(got.grads[s].data, ref.grads[s].data);
      EXPECT_LE(err, kExpertGradTol) << name;
      worst = std::max(worst, err);
    } else {
      EXPECT_EQ(got.grads[s].data, ref.grads[s].data) << name;
    }
  }
  if (world().rank() == 0)
    std::printf("  %s, cp %d, ep %d: %lld rows moved, worst expert gradient error %.2e\n", what.c_str(), cp, ep,
                static_cast<long long>(got.rows_moved), worst);
}

TEST(ModelEp, RandomRouterSameAsEveryExpertLocal) {
  Gemma4Model m = make_model();
  const int P = world().size();
  for (int ep : {2, P})
    if (ep <= P && P % ep == 0) check_same_as_local(m, 1, ep, "data-parallel rows");
  if (P % 2 == 0)
    for (int ep : {2, P}) check_same_as_local(m, 2, ep, "cp 2 groups");
}

// bf16 matmuls (oneDNN on the bf16 copies of the whole weights): the same shapes per row, so the same promise.
TEST(ModelEp, Bfloat16SameAsEveryExpertLocal) {
  Gemma4Model m = make_model();
  const int P = world().size();
  check_same_as_local(m, 1, P, "bf16", ComputeDtype::Bfloat16);
  if (P % 2 == 0) check_same_as_local(m, 2, P, "bf16, cp 2 groups", ComputeDtype::Bfloat16);
}

void tie_router(Gemma4Model& m) {
  for (size_t slot = 0; slot < m.params().size(); ++slot)
    if (m.params().info(slot).name.ends_with("router.proj.weight")) {
      float* w = m.params().mutable_weight(slot);
      std::fill_n(w, m.params().info(slot).numel, 0.f);
    }
}

TEST(ModelEp, TiedRouterSendsEveryTokenToTheFirstExperts) {
  Gemma4Model m = make_model();
  tie_router(m);
  const int P = world().size();
  check_same_as_local(m, 1, P, "tied router");
  if (P % 2 == 0) check_same_as_local(m, 2, P, "tied router, cp 2 groups");
}

// Top 1 with every probability tied: every token of every rank to expert 0 alone, the other 7 experts (and at
// EP = P every rank but the first) idle, their gradients zero.
TEST(ModelEp, TiedRouterTopOneSendsEveryTokenToOneExpert) {
  Gemma4Model m = make_model(1);
  tie_router(m);
  const int P = world().size();
  check_same_as_local(m, 1, P, "top 1, tied router");
  if (P % 2 == 0) check_same_as_local(m, 2, 2, "top 1, tied router, cp 2 groups");
}

// The held store's parameters: the experts' rows of this EP rank only (weights as the whole model's rows), the rest
// whole; the arenas shrink by the other ranks' experts.
TEST(ModelEp, HeldStoreKeepsTheRanksExpertRows) {
  Gemma4Model m = make_model();
  const int P = world().size(), rank = world().rank();
  const std::unique_ptr<ParamStore> held = hold_expert_rows(m.params(), rank, P);
  const ParamStore& whole = m.params();
  int64_t expert_elements = 0;
  for (size_t s = 0; s < whole.size(); ++s) {
    const ParamInfo& w = whole.info(s);
    const ParamInfo& h = held->info(s);
    ASSERT_EQ(h.name, w.name);
    EXPECT_EQ(h.whole_shape(), w.shape);
    if (!is_expert_tensor(w)) {
      EXPECT_FALSE(h.holds_part()) << w.name;
      EXPECT_EQ(std::vector<float>(held->weight(s), held->weight(s) + h.numel),
                std::vector<float>(whole.weight(s), whole.weight(s) + w.numel));
      continue;
    }
    expert_elements += w.numel;
    const int64_t E = w.shape[0], rows = E / P, row = w.numel / E;  // 8 experts over 2 or 4 ranks
    EXPECT_EQ(h.shape[0], rows) << w.name;
    EXPECT_EQ(h.rows_begin, rank * rows) << w.name;
    EXPECT_EQ(h.rows_total, E) << w.name;
    EXPECT_EQ(std::vector<float>(held->weight(s), held->weight(s) + h.numel),
              std::vector<float>(whole.weight(s) + rank * rows * row, whole.weight(s) + (rank + 1) * rows * row));
  }
  EXPECT_GT(expert_elements, 0);
  EXPECT_EQ(held->total_elements(), whole.total_elements() - expert_elements + expert_elements / P);
  // Back to the whole layout: the registry of every expert's rows.
  const std::unique_ptr<ParamStore> again = whole_registry(*held);
  EXPECT_EQ(again->total_elements(), whole.total_elements());
}

// A layer whose experts do not divide over the EP ranks: the same line on every rank, before any row moves.
TEST(ModelEp, ExpertsNotDividingOverTheRanksFailOnEveryRank) {
  const int P = world().size();
  ExpertRouting r;
  r.experts = 2 * P + 1;  // odd, P even
  r.sent.assign(static_cast<size_t>(r.experts), 0);
  cp::JobContext ctx = cp::make_parallel_context(world(), {}, &world());
  try {
    ctx.model->experts().route(r);
    ADD_FAILURE() << "experts not dividing must fail";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "expert parallelism: " + std::to_string(r.experts) +
                                         " experts do not divide over " + std::to_string(P) + " EP ranks");
  }
  world().barrier();  // every rank got here: nobody is stuck in a collective
}

}  // namespace
}  // namespace rf::model

int main(int argc, char** argv) { return rf::testing::run_mpi_tests(argc, argv); }
