// ringflex trainer: the training state of experts held apart (see expert_state.h).
#include "trainer/state/expert_state.h"

#include <algorithm>
#include <span>
#include <vector>

#include "core/error.h"
#include "model/lora_store.h"
#include "trainer/optimizer.h"

namespace rf::trainer {

namespace {

// The trainable parameters' gradients, split into the held-apart expert tensors' and the others', each in
// registration order.
struct GradientParts {
  std::vector<std::span<float>> experts, rest;
};

GradientParts gradient_parts(const model::ParamStore& store) {
  GradientParts parts;
  for (size_t i = 0; i < store.size(); ++i) {
    const model::ParamInfo& p = store.info(i);
    const float* g = store.grad(i);
    if (g == nullptr || p.numel == 0) continue;
    // The store's gradients are read-only here but the collectives take writable spans.
    const std::span<float> span(const_cast<float*>(g), static_cast<size_t>(p.numel));
    (p.holds_part() ? parts.experts : parts.rest).push_back(span);
  }
  return parts;
}

}  // namespace

void reduce_held_expert_gradients(model::ParamStore& store, const ExpertGroups& g) {
  const GradientParts parts = gradient_parts(store);
  if (g.world.size() > 1 && !parts.rest.empty()) g.world.allreduce(parts.rest, comm::ReduceOp::Sum, g.timeout);
  if (g.edp.size() > 1 && !parts.experts.empty()) g.edp.allreduce(parts.experts, comm::ReduceOp::Sum, g.timeout);
}

std::vector<double> held_expert_norm_partials(const model::ParamStore& store, const ExpertGroups& g) {
  // The whole layout's trainable elements as pieces in order: a parameter held whole (every rank has it), or one EP
  // rank's rows of a held-apart expert tensor (only that rank has them).
  struct Piece {
    const float* values = nullptr;  // null: another EP rank's rows
    int64_t n = 0;
    int holder = -1;  // EP rank holding it; -1: every rank
  };
  const int ep = g.ep.size(), me = g.ep.rank();
  std::vector<Piece> pieces;
  size_t whole = 0;
  for (size_t i = 0; i < store.size(); ++i) {
    const model::ParamInfo& p = store.info(i);
    const float* grad = store.grad(i);
    if (grad == nullptr || p.numel == 0) continue;
    if (!p.holds_part()) {
      pieces.push_back({grad, p.numel, -1});
    } else {
      for (int r = 0; r < ep; ++r) pieces.push_back({r == me ? grad : nullptr, p.numel, r});
    }
    whole += static_cast<size_t>(p.holds_part() ? p.numel * ep : p.numel);
  }
  // Each world slice's running sum in element order (sum_of_squares'), a piece's holder continuing it and handing it
  // to the EP group.
  const int P = g.world.size();
  std::vector<double> partial(static_cast<size_t>(P), 0.0);
  int q = 0;
  size_t at = 0;  // whole-layout index of the next element
  double sum = 0.0;
  const auto close_slices = [&] {
    while (q < P && at == comm::slice_of(whole, P, q).end) {
      partial[static_cast<size_t>(q++)] = sum;
      sum = 0.0;
    }
  };
  close_slices();
  for (const Piece& piece : pieces) {
    for (int64_t off = 0; off < piece.n;) {
      const int64_t k = std::min<int64_t>(piece.n - off, static_cast<int64_t>(comm::slice_of(whole, P, q).end - at));
      if (piece.holder < 0 || piece.holder == me)
        for (int64_t j = off; j < off + k; ++j) sum += static_cast<double>(piece.values[j]) * piece.values[j];
      if (piece.holder >= 0) g.ep.broadcast(&sum, sizeof(double), piece.holder, g.timeout);
      off += k;
      at += static_cast<size_t>(k);
      close_slices();
    }
  }
  return partial;
}

namespace {

// Fills `whole` (the writer's whole-layout store, holding this rank's rows already; null on the other ranks) with
// every EP rank's rows of each held-apart tensor, gathered over g.ep tensor by tensor.
void gather_rows_into(const model::ParamStore& part, model::ParamStore* whole, const ExpertGroups& g) {
  const int P = g.ep.size();
  std::vector<float> all;  // [P, the slot's held elements]: one tensor's rows of every EP rank, in EP rank order
  for (size_t i = 0; i < part.size(); ++i) {
    const model::ParamInfo& p = part.info(i);
    if (!p.holds_part()) continue;
    RF_CHECK(p.rows_total == p.shape.at(0) * P && p.rows_begin == p.shape.at(0) * g.ep.rank(), "save: ", p.name,
             " holds experts [", p.rows_begin, ", ", p.rows_begin + p.shape.at(0), ") of ", p.rows_total,
             ", not EP rank ", g.ep.rank(), " of ", P, "'s");
    for (model::Role role : {model::Role::Weights, model::Role::ExpAvg, model::Role::ExpAvgSq}) {
      const float* mine = role == model::Role::Weights ? part.weight(i) : part.moment(role, i);
      if (mine == nullptr) continue;  // frozen, or no moments: the same on every rank
      all.resize(static_cast<size_t>(p.numel * P));
      g.ep.allgather(mine, all.data(), static_cast<size_t>(p.numel) * sizeof(float), g.timeout);
      if (whole == nullptr) continue;
      float* dst = role == model::Role::Weights ? whole->mutable_weight(i) : whole->moment(role, i);
      std::copy(all.begin(), all.end(), dst);
    }
  }
}

}  // namespace

std::unique_ptr<model::LoraStore> gather_held_adapters(const model::LoraStore& part, const ExpertGroups& g) {
  std::unique_ptr<model::LoraStore> whole = g.world.rank() == 0 ? part.whole_adapters() : nullptr;
  gather_rows_into(part, whole.get(), g);
  return whole;
}

WholeAdapterMoments::WholeAdapterMoments(model::ParamStore& store, comm::Communicator* edp, comm::Timeout timeout) {
  if (edp == nullptr) return;
  const int64_t n = store.trainable_elements();
  const model::Shard mine = store.moment_range();
  const model::Shard slice = model::shard_of(n, edp->rank(), edp->size());
  RF_CHECK(mine.begin == slice.begin && mine.end == slice.end, "save: the adapters' moments hold [", mine.begin, ", ",
           mine.end, "), not EDP rank ", edp->rank(), " of ", edp->size(), "'s slice of ", n);
  store.set_moment_range(0, n);  // keeps this rank's slice in place, the others zero until gathered
  store_ = &store;
  mine_ = mine;
  for (model::Role role : {model::Role::ExpAvg, model::Role::ExpAvgSq}) {
    const std::span<float> all = store.mutable_flat(role);
    if (edp->size() > 1) edp->allgather_slices(all.data(), all.size(), sizeof(float), timeout);
  }
}

WholeAdapterMoments::~WholeAdapterMoments() {
  if (store_ != nullptr) store_->set_moment_range(mine_.begin, mine_.end);
}

}  // namespace rf::trainer
