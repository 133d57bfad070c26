// ringflex model: expert parallelism's placement of the experts' weights (see expert_store.h).
#include "model/expert_store.h"

#include <algorithm>
#include <string>
#include <utility>

#include "core/error.h"
#include "model/gemma4.h"

namespace rf::model {

namespace {

// The leading rows a parameter holds: [rows_begin, rows_begin + held_rows) (a 0-d tensor is one row).
int64_t held_rows(const ParamInfo& p) { return p.shape.empty() ? 1 : p.shape[0]; }

std::vector<bool> trainable_flags(const ParamStore& s) {
  std::vector<bool> flags(s.size());
  for (size_t i = 0; i < s.size(); ++i) flags[i] = s.info(i).trainable;
  return flags;
}

bool moments_whole(const ParamStore& s) { return s.has_moments() && s.moment_range().size() == s.trainable_elements(); }

}  // namespace

void ParamStore::hold_rows(size_t slot, int64_t begin, int64_t total) {
  ParamInfo& p = infos_.at(slot);
  RF_CHECK(!p.shape.empty() && begin >= 0 && begin + p.shape[0] <= total, "parameter '", p.name, "': rows [", begin,
           ", ", begin + (p.shape.empty() ? 0 : p.shape[0]), ") do not lie inside its ", total, " rows");
  p.rows_begin = begin;
  p.rows_total = total;
}

bool is_expert_tensor(const ParamInfo& p) {
  return p.name.ends_with(".experts.gate_up_proj") || p.name.ends_with(".experts.down_proj");
}

int64_t row_elements(const ParamInfo& p) {
  const int64_t rows = held_rows(p);
  return rows == 0 ? 0 : p.numel / rows;
}

void check_expert_parallelism(const Gemma4Config& config, int ep, const std::string& what) {
  if (ep == 1) return;
  RF_CHECK(config.enable_moe, what, " needs a model with MoE layers (enable_moe_block)");
  RF_CHECK(config.num_experts % ep == 0, what, " does not divide the model's ", config.num_experts, " experts");
}

int64_t expert_elements_elsewhere(const ParamStore& whole, int ep, bool matmul_only) {
  int64_t n = 0;
  for (size_t i = 0; i < whole.size(); ++i) {
    const ParamInfo& p = whole.info(i);
    if (is_expert_tensor(p) && (p.matmul || !matmul_only)) n += p.numel / ep * (ep - 1);
  }
  return n;
}

std::unique_ptr<ParamStore> hold_expert_rows(const ParamStore& whole, int rank, int ranks) {
  RF_CHECK(ranks >= 1 && rank >= 0 && rank < ranks, "hold_expert_rows: rank ", rank, " of ", ranks);
  auto part = std::make_unique<ReplicatedStore>();
  for (size_t i = 0; i < whole.size(); ++i) {
    const ParamInfo& p = whole.info(i);
    std::vector<int64_t> shape = p.whole_shape();
    if (!is_expert_tensor(p)) {
      part->add(p.name, std::move(shape), p.layer, p.matmul);
      continue;
    }
    const int64_t E = shape.at(0);
    RF_CHECK(E % ranks == 0, "expert parallelism: ", p.name, "'s ", E, " experts do not divide over ", ranks,
             " EP ranks");
    shape[0] = E / ranks;
    const size_t slot = part->add(p.name, std::move(shape), p.layer, p.matmul);
    part->hold_rows(slot, rank * (E / ranks), E);
  }
  part->set_trainable(trainable_flags(whole));
  if (whole.weights_allocated()) part->allocate_weights();
  if (moments_whole(whole)) part->allocate_moments();
  copy_held_rows(whole, *part);
  return part;
}

std::unique_ptr<ParamStore> whole_registry(const ParamStore& part) {
  auto whole = std::make_unique<ReplicatedStore>();
  for (size_t i = 0; i < part.size(); ++i) {
    const ParamInfo& p = part.info(i);
    whole->add(p.name, p.whole_shape(), p.layer, p.matmul);
  }
  whole->set_trainable(trainable_flags(part));
  return whole;
}

void copy_held_rows(const ParamStore& from, ParamStore& to) {
  RF_CHECK(from.size() == to.size(), "copy_held_rows: ", from.size(), " parameters into ", to.size());
  for (size_t i = 0; i < from.size(); ++i) {
    const ParamInfo& a = from.info(i);
    const ParamInfo& b = to.info(i);
    RF_CHECK(a.name == b.name && a.whole_shape() == b.whole_shape(), "copy_held_rows: parameter ", i, " is '", a.name,
             "' in one store and '", b.name, "' (or another shape) in the other");
    const int64_t row = row_elements(a);
    const int64_t lo = std::max(a.rows_begin, b.rows_begin);
    const int64_t hi = std::min(a.rows_begin + held_rows(a), b.rows_begin + held_rows(b));
    if (lo >= hi || row == 0) continue;
    const int64_t n = (hi - lo) * row, src_at = (lo - a.rows_begin) * row, dst_at = (lo - b.rows_begin) * row;
    if (from.weights_allocated() && to.weights_allocated())
      std::copy_n(from.weight(i) + src_at, n, to.mutable_weight(i) + dst_at);
    for (Role role : {Role::ExpAvg, Role::ExpAvgSq}) {
      const float* src = from.moment(role, i);
      float* dst = to.moment(role, i);
      if (src && dst) std::copy_n(src + src_at, n, dst + dst_at);
    }
  }
}

std::unique_ptr<ParamStore> Gemma4Model::replace_params(std::unique_ptr<ParamStore> store) {
  RF_CHECK(store && store->size() == store_->size(), "replace_params: the new store registers ",
           store ? store->size() : 0, " parameters, the model ", store_->size());
  for (size_t i = 0; i < store_->size(); ++i) {
    const ParamInfo& a = store_->info(i);
    const ParamInfo& b = store->info(i);
    RF_CHECK(a.name == b.name && a.whole_shape() == b.whole_shape(), "replace_params: parameter ", i, " is '", a.name,
             "' in the model and '", b.name, "' (or another shape) in the new store");
  }
  std::swap(store, store_);
  return store;
}

}  // namespace rf::model
