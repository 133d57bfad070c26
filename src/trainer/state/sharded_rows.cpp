// ringflex trainer: the sharded store's token-table rows (see sharded_store.h, docs/parallel-state.md): a run reads a
// streamed table by row, each rank the rows of its own tokens fetched from their owners, and sends the rows'
// gradients back to their owners, each summing every rank's contribution in rank order.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <utility>

#include "core/error.h"
#include "model/ops.h"
#include "trainer/state/sharded_store_parts.h"

namespace rf::trainer {

using model::ParamInfo;

size_t head_slot(const model::ParamStore& registry) {
  for (const char* name : {"lm_head.weight", "model.embed_tokens.weight"})
    if (registry.contains(name)) return registry.slot(name);
  return SIZE_MAX;
}

std::vector<ShardedStore::Span> ShardedStore::row_spans(size_t slot, const std::vector<int32_t>& ids,
                                                        const Piece& pc) const {
  std::vector<Span> out;
  if (pc.n == 0) return out;
  const int64_t W = info(slot).shape[1], end = pc.first + pc.n;
  // The first row that reaches into the piece, then every row until one starts past it.
  for (auto it = std::lower_bound(ids.begin(), ids.end(), pc.first / W); it != ids.end(); ++it) {
    const int64_t row = int64_t{*it} * W;
    if (row >= end) break;
    const int64_t lo = std::max(row, pc.first), hi = std::min(row + W, end);
    if (lo < hi) out.push_back(Span{(it - ids.begin()) * W + (lo - row), lo, hi - lo});
  }
  return out;
}

std::vector<ShardedStore::Span> ShardedStore::spans_outside(size_t slot, const std::vector<int32_t>& ids,
                                                            const Piece& pc) const {
  std::vector<Span> out;
  int64_t at = pc.first;  // the first element of the piece not yet covered
  for (const Span& r : row_spans(slot, ids, pc)) {
    if (r.elem > at) out.push_back(Span{at, at, r.elem - at});
    at = r.elem + r.n;
  }
  if (pc.first + pc.n > at) out.push_back(Span{at, at, pc.first + pc.n - at});
  return out;
}

std::vector<std::vector<int32_t>> ShardedStore::every_ranks_ids(std::span<const int32_t> ids) {
  std::vector<int32_t> mine(ids.begin(), ids.end());
  std::sort(mine.begin(), mine.end());
  mine.erase(std::unique(mine.begin(), mine.end()), mine.end());
  if (P_ == 1) return {std::move(mine)};
  const auto start = std::chrono::steady_clock::now();
  std::vector<int64_t> counts(static_cast<size_t>(P_));
  const int64_t count = static_cast<int64_t>(mine.size());
  comm_->allgather(&count, counts.data(), sizeof(count), timeout_);
  std::vector<size_t> part_bytes(static_cast<size_t>(P_));
  size_t total = 0, at_mine = 0;
  for (int q = 0; q < P_; ++q) {
    if (q == me_) at_mine = total;
    total += static_cast<size_t>(counts[static_cast<size_t>(q)]);
    part_bytes[static_cast<size_t>(q)] = static_cast<size_t>(counts[static_cast<size_t>(q)]) * sizeof(int32_t);
  }
  std::vector<int32_t> all(total);  // every rank's sorted ids, in rank order
  std::copy(mine.begin(), mine.end(), all.begin() + static_cast<std::ptrdiff_t>(at_mine));
  comm_->allgatherv(all.data(), part_bytes, timeout_);
  exposed_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::vector<std::vector<int32_t>> out(static_cast<size_t>(P_));
  auto from = all.begin();
  for (int q = 0; q < P_; ++q) {
    const auto to = from + static_cast<std::ptrdiff_t>(counts[static_cast<size_t>(q)]);
    out[static_cast<size_t>(q)].assign(from, to);
    from = to;
  }
  return out;
}

bool ShardedStore::is_trained_head_table(size_t slot) const {
  return grads_allocated_ && info(slot).trainable && slot == head_slot(*this);
}

// The table's rows of this rank's ids: each owner sends every rank the parts of that rank's rows inside its piece
// (full), or this rank copies them from the whole weights (gradients). The table tied to a trained head holds every
// rank's ids instead: release_head seeds the gradient rows of those ids with the head's (so that a row's float32
// sum is shard none's, the head's part first), and each rank has the head's part of every row.
model::ParamStore::TableRows ShardedStore::rows(size_t slot, std::span<const int32_t> ids, bool want_grads) {
  const ParamInfo& p = info(slot);
  const bool grads = want_grads && grads_allocated_ && p.trainable;
  if (!adopted_ || (!sharded() && !grads)) return ReplicatedStore::rows(slot, ids, want_grads);
  RF_CHECK(p.streamed && p.shape.size() == 2, "sharded store: rows of ", p.name, ", which is no streamed table");
  auto t = std::make_unique<Table>();
  t->slot = slot;
  t->width = p.shape[1];
  t->of_rank = every_ranks_ids(ids);
  if (grads && is_trained_head_table(slot)) {
    std::vector<int32_t> all;
    for (const std::vector<int32_t>& r : t->of_rank) all.insert(all.end(), r.begin(), r.end());
    std::sort(all.begin(), all.end());
    all.erase(std::unique(all.begin(), all.end()), all.end());
    t->of_rank.assign(static_cast<size_t>(P_), all);
    t->shared = true;
  }
  t->ids = t->of_rank[static_cast<size_t>(me_)];
  const int64_t W = t->width, n = static_cast<int64_t>(t->ids.size());
  // param_dtype bfloat16: the rows travel and stay as the bf16 working weights.
  const bool working16 = param_dtype() == model::ParamDtype::Bfloat16;
  if (working16)
    t->w16.resize(static_cast<size_t>(n * W));
  else
    t->w.resize(static_cast<size_t>(n * W));
  if (sharded() && working16) {
    fetch_rows(slot, *t, t->w16.data(),
               [](const float* src, bf16* dst, int64_t k) { model::round_to_bf16(src, dst, k); });
  } else if (sharded()) {
    fetch_rows(slot, *t, t->w.data(), [](const float* src, float* dst, int64_t k) { std::copy_n(src, k, dst); });
  } else if (working16) {
    const bf16* values = working(slot);
    for (int64_t u = 0; u < n; ++u)
      std::copy_n(values + int64_t{t->ids[static_cast<size_t>(u)]} * W, W, t->w16.data() + u * W);
  } else {
    for (int64_t u = 0; u < n; ++u)
      std::copy_n(ReplicatedStore::weight(slot) + int64_t{t->ids[static_cast<size_t>(u)]} * W, W, t->w.data() + u * W);
  }
  t->grads = grads;
  if (grads) t->g.assign(static_cast<size_t>(n * W), 0.f);
  TableRows out;
  out.values = working16 ? model::HeldWeight{model::HeldDType::BF16, t->w16.data()}
                         : model::HeldWeight{model::HeldDType::F32, t->w.data()};
  out.grads = grads ? t->g.data() : nullptr;
  out.row.resize(ids.size());
  for (size_t i = 0; i < ids.size(); ++i)
    out.row[i] = std::lower_bound(t->ids.begin(), t->ids.end(), ids[i]) - t->ids.begin();
  tables_.push_back(std::move(t));
  return out;
}

// The parts of this rank's rows t.ids inside every owner's piece, packed by `pack` (float32 masters -> T). Rank q's
// rows [its ids, W] are the parts inside piece 0, then piece 1, ... (pieces ascend with the rank, rows with their
// ids): each owner's part is one range of them, at the `at` of its first span, and lands there in place
// (collective).
// Every rank holding the same rows (t.shared: the table tied to a trained head, every rank's ids) is an all-gather:
// each owner packs its part straight into its place in `rows` and it travels from there to every rank, with no send
// buffer (packed once for each of the N ranks it would take N x min(the step's rows, its piece): about the whole table
// at N = 64, where a piece is 1/64 of the model and the step's rows most of the table). Otherwise each owner sends each
// rank q the parts of q's rows inside its piece, in rounds: in round s it sends to rank me + s and receives from rank
// me - s, two rounds in flight, so its send buffers are two ranks' parts, min(a rank's rows, its piece) each, not N of
// them at once (their sum is only bounded by N x that, the whole table at large N, when the ranks' tokens meet in one
// owner's piece).
template <class T, class Pack>
void ShardedStore::fetch_rows(size_t slot, const Table& t, T* rows, Pack pack) {
  const Piece mine = piece(slot, me_);
  // This rank's own part: packed where it belongs.
  for (const Span& sp : row_spans(slot, t.ids, mine))
    pack(own(slot, mine) + (sp.elem - mine.first), rows + sp.at, sp.n);
  if (P_ == 1) return;
  // [P]: where each owner's part of this rank's rows starts in `rows`, and its bytes.
  std::vector<size_t> part_at(static_cast<size_t>(P_), 0), part_bytes(static_cast<size_t>(P_), 0);
  for (int q = 0; q < P_; ++q) {
    const std::vector<Span> spans = row_spans(slot, t.ids, piece(slot, q));
    if (spans.empty()) continue;
    part_at[static_cast<size_t>(q)] = static_cast<size_t>(spans.front().at);
    for (const Span& sp : spans) part_bytes[static_cast<size_t>(q)] += static_cast<size_t>(sp.n) * sizeof(T);
  }
  if (t.shared) {
    comm::PostedPtr c = comm_->post_allgatherv(rows, part_bytes);
    wait(*c);
    return;
  }
  struct Round {
    std::vector<T> send;
    comm::PostedPtr posted;  // last: abandoned before its buffer goes
  };
  std::vector<Round> rounds(static_cast<size_t>(kRowRoundsInFlight));
  std::vector<size_t> send_bytes(static_cast<size_t>(P_)), recv_bytes(static_cast<size_t>(P_));
  for (int s = 1; s < P_; ++s) {
    Round& r = rounds[static_cast<size_t>(s % kRowRoundsInFlight)];
    if (r.posted) wait(*r.posted);
    r.posted.reset();
    const int to = (me_ + s) % P_, from = (me_ - s + P_) % P_;
    const std::vector<Span> spans = row_spans(slot, t.of_rank[static_cast<size_t>(to)], mine);
    size_t n = 0;
    for (const Span& sp : spans) n += static_cast<size_t>(sp.n);
    r.send.resize(n);
    T* out = r.send.data();
    for (const Span& sp : spans) {
      pack(own(slot, mine) + (sp.elem - mine.first), out, sp.n);
      out += sp.n;
    }
    std::fill(send_bytes.begin(), send_bytes.end(), 0);
    std::fill(recv_bytes.begin(), recv_bytes.end(), 0);
    send_bytes[static_cast<size_t>(to)] = r.send.size() * sizeof(T);
    recv_bytes[static_cast<size_t>(from)] = part_bytes[static_cast<size_t>(from)];
    r.posted = comm_->post_alltoallv(r.send.data(), send_bytes, rows + part_at[static_cast<size_t>(from)], recv_bytes);
  }
  for (Round& r : rounds)
    if (r.posted) wait(*r.posted);
}

// Every rank's gradient rows to their owners. Rank r sends owner q the parts of r's rows inside q's piece; the owner
// sums, for each element of its piece that some rank's rows reach, every rank's contribution in rank order in double
// (+0 from a rank whose rows miss it: the untouched rows of shard none's gradient), rounded once, into its slice:
// the terms and order of Communicator::reduce_scatter over shard none's whole gradients.
void ShardedStore::reduce_rows(Table& t) {
  const size_t slot = t.slot;
  // Owner q's part: the rows of every rank's ids inside its piece, in element order. Each rank's spans there are
  // some of those (the same part of the same row): its runs of the part, found with one cursor.
  std::vector<int32_t> all;
  for (const std::vector<int32_t>& r : t.of_rank) all.insert(all.end(), r.begin(), r.end());
  std::sort(all.begin(), all.end());
  all.erase(std::unique(all.begin(), all.end()), all.end());
  const auto runs_in = [](const std::vector<Span>& some, const std::vector<Span>& part) {
    std::vector<comm::Slice> runs;
    size_t u = 0, at = 0;
    for (const Span& sp : some) {
      for (; part[u].elem != sp.elem; ++u) at += static_cast<size_t>(part[u].n);
      if (!runs.empty() && runs.back().end == at)
        runs.back().end += static_cast<size_t>(sp.n);
      else
        runs.push_back(comm::Slice{at, at + static_cast<size_t>(sp.n)});
      at += static_cast<size_t>(part[u++].n);
    }
    return runs;
  };
  // The send buffer is `g` packed in place: rank q's spans follow those of q - 1 (pieces ascend with the rank, rows
  // with their ids), so an element moves down, never over one not yet read.
  std::vector<size_t> parts(static_cast<size_t>(P_));
  std::vector<std::vector<comm::Slice>> to(static_cast<size_t>(P_)), from(static_cast<size_t>(P_));
  std::vector<Span> own_part;
  size_t packed = 0;
  for (int q = 0; q < P_; ++q) {
    const std::vector<Span> part = row_spans(slot, all, piece(slot, q));
    for (const Span& sp : part) parts[static_cast<size_t>(q)] += static_cast<size_t>(sp.n);
    const std::vector<Span> mine = row_spans(slot, t.ids, piece(slot, q));
    for (const Span& sp : mine) {
      if (packed != static_cast<size_t>(sp.at))
        std::memmove(t.g.data() + packed, t.g.data() + sp.at, static_cast<size_t>(sp.n) * sizeof(float));
      packed += static_cast<size_t>(sp.n);
    }
    to[static_cast<size_t>(q)] = runs_in(mine, part);
    if (q == me_) own_part = part;
  }
  const Piece pc = piece(slot, me_);
  for (int r = 0; r < P_; ++r)
    from[static_cast<size_t>(r)] = runs_in(row_spans(slot, t.of_rank[static_cast<size_t>(r)], pc), own_part);
  Reduction red;
  int64_t at = 0;
  for (const Span& u : own_part) {
    red.into.push_back(Span{at, pc.local - pc.first + u.elem, u.n});
    at += u.n;
  }
  post_parts(red, t.g.data(), parts, std::move(to), std::move(from));
  finish_reduce(red);
}

}  // namespace rf::trainer
