// Unit tests of the sharded and held stores (trainer/state/shard_layout.h, sharded_store.h, held_expert_store.h,
// held_checkpoint.h) on small hand-made registries, ranks as loopback threads: which rank holds which elements, the
// gathers and reductions around a layer, the token tables' rows, and which experts a rank holds with their state and
// checkpoint parts, each against values computed by hand or by index arithmetic written here (never by the store's
// own code). The whole training runs over these stores are test_state_conformance.cpp's and test_train.cpp's.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "comm/loopback_comm.h"
#include "core/error.h"
#include "model/expert_store.h"
#include "trainer/checkpoint.h"
#include "trainer/state/held_checkpoint.h"
#include "trainer/state/held_expert_store.h"
#include "trainer/state/shard_layout.h"
#include "trainer/state/sharded_store.h"

namespace rf::trainer {
namespace {

namespace fs = std::filesystem;
using model::kGlobalGroup;
using model::Role;

// A registry of awkward sizes: nothing divides by the rank counts below, the trainable and the frozen layouts
// interleave in registration order, and a streamed table [7, 3] that is no head (its rows are fetched by rank).
struct Param {
  std::string name;
  std::vector<int64_t> shape;
  int layer;
  bool streamed = false;
};
const std::vector<Param>& awkward() {
  static const std::vector<Param> params = {
      {"model.embed_tokens_per_layer.weight", {7, 3}, kGlobalGroup, true},
      {"model.norm.weight", {5}, kGlobalGroup},
      {"model.frozen_global", {3}, kGlobalGroup},
      {"model.layers.0.a", {3, 3}, 0},
      {"model.layers.0.b", {2}, 0},
      {"model.layers.1.a", {3, 3}, 1},
      {"model.layers.1.frozen", {4}, 1},
  };
  return params;
}
const std::vector<std::string> kFrozen = {"model.frozen_global", "model.layers.1.frozen"};

template <class Store>
void register_awkward(Store& s) {
  for (const Param& p : awkward()) {
    const size_t slot = s.add(p.name, p.shape, p.layer, p.shape.size() == 2);
    if (p.streamed) s.mark_streamed(slot);
  }
}

// The value of element e of slot `slot` in the tests' weights: distinct, exact in float32.
float weight_value(size_t slot, int64_t e) { return static_cast<float>(100 * slot + e); }
std::vector<float> whole_weight(const model::ParamStore& s, size_t slot) {
  std::vector<float> w(static_cast<size_t>(s.info(slot).numel));
  for (size_t e = 0; e < w.size(); ++e) w[e] = weight_value(slot, static_cast<int64_t>(e));
  return w;
}

// Rank r's gradient contribution to element e of `slot`: small integers, so every sum is exact in any order and the
// expected sum is the plain sum over the ranks.
float grad_value(int r, size_t slot, int64_t e) { return static_cast<float>((r + 1) * (e + 1) + slot); }

// Parameters {5, 7} trainable and {3} frozen over 3 and 4 ranks, worked by hand: the trainable layout [0, 12) is
// sliced [0, 4) [4, 8) [8, 12), the frozen one [0, 3) into one element a rank (and none for rank 3 of 4).
TEST(ShardLayout, PiecesByHand) {
  model::ReplicatedStore r;
  r.add("a", {5});
  r.add("frozen", {3});
  r.add("b", {7});
  const std::vector<bool> trainable = {true, false, true};
  const ShardLayout three(r, trainable, 3);
  using P = ShardLayout::Piece;
  const auto same = [](const P& got, const P& want) {
    return got.first == want.first && got.n == want.n && (want.n == 0 || got.local == want.local);
  };
  // a: elements [0, 4) on rank 0, [4, 5) on rank 1 at its slice's start, none on rank 2.
  EXPECT_TRUE(same(three.piece(0, 0), P{0, 4, 0}));
  EXPECT_TRUE(same(three.piece(0, 1), P{4, 1, 0}));
  EXPECT_TRUE(same(three.piece(0, 2), P{0, 0, 0}));
  // b (trainable elements [5, 12)): none on rank 0, [0, 3) on rank 1 after a's element, [3, 7) on rank 2.
  EXPECT_TRUE(same(three.piece(2, 0), P{0, 0, 0}));
  EXPECT_TRUE(same(three.piece(2, 1), P{0, 3, 1}));
  EXPECT_TRUE(same(three.piece(2, 2), P{3, 4, 0}));
  for (int q = 0; q < 3; ++q) EXPECT_TRUE(same(three.piece(1, q), P{q, 1, 0})) << "rank " << q;
  EXPECT_EQ(three.trainable_elements(), 12);
  EXPECT_EQ(three.frozen_elements(), 3);
  EXPECT_EQ(three.largest_masters(), 4 + 1);
  const ShardLayout four(r, trainable, 4);  // frozen: [0, 1) [1, 2) [2, 3) and nothing for rank 3
  EXPECT_EQ(four.piece(1, 3).n, 0);
  EXPECT_EQ(four.frozen_slice(3).size(), 0u);
  EXPECT_EQ(four.largest_masters(), 3 + 1);
  // More ranks than elements: each of the first 12 ranks one trainable element, the rest none.
  const ShardLayout many(r, trainable, 20);
  EXPECT_TRUE(same(many.piece(2, 11), P{6, 1, 0}));
  EXPECT_EQ(many.piece(2, 12).n, 0);
  EXPECT_EQ(many.largest_masters(), 1 + 1);
}

// Every element of every parameter lies in exactly one rank's piece, a rank's pieces tile its slices of the two
// layouts in registration order, and the store's bytes (master_bytes_for) are the largest rank's, over rank counts
// that divide nothing, exceed the elements, or leave ranks empty.
TEST(ShardLayout, EveryElementOnceOverAwkwardRankCounts) {
  model::ReplicatedStore r;
  register_awkward(r);
  r.freeze(kFrozen);
  const std::vector<bool> trainable = r.trainable_after({});
  for (int ranks : {1, 2, 3, 4, 5, 7, 9, 16, 64}) {
    const ShardLayout layout(r, trainable, ranks);
    std::vector<int64_t> tiled(static_cast<size_t>(ranks) * 2, 0);  // [rank, layout]: elements of its pieces
    for (size_t slot = 0; slot < r.size(); ++slot) {
      const int64_t numel = r.info(slot).numel;
      std::vector<int> owners(static_cast<size_t>(numel), 0);
      int64_t next = 0;  // pieces ascend with the rank: each starts where the previous one ended
      for (int q = 0; q < ranks; ++q) {
        const ShardLayout::Piece pc = layout.piece(slot, q);
        if (pc.n == 0) continue;
        EXPECT_EQ(pc.first, next) << r.info(slot).name << ", rank " << q << " of " << ranks;
        next = pc.first + pc.n;
        for (int64_t e = pc.first; e < pc.first + pc.n; ++e) ++owners[static_cast<size_t>(e)];
        const comm::Slice s = trainable[slot] ? layout.trainable_slice(q) : layout.frozen_slice(q);
        EXPECT_LE(pc.local + pc.n, static_cast<int64_t>(s.size())) << r.info(slot).name << ", rank " << q;
        tiled[static_cast<size_t>(q) * 2 + (trainable[slot] ? 0 : 1)] += pc.n;
      }
      for (int64_t e = 0; e < numel; ++e)
        EXPECT_EQ(owners[static_cast<size_t>(e)], 1) << r.info(slot).name << "[" << e << "] over " << ranks;
    }
    int64_t most = 0;
    for (int q = 0; q < ranks; ++q) {
      EXPECT_EQ(tiled[static_cast<size_t>(q) * 2], static_cast<int64_t>(layout.trainable_slice(q).size()));
      EXPECT_EQ(tiled[static_cast<size_t>(q) * 2 + 1], static_cast<int64_t>(layout.frozen_slice(q).size()));
      most = std::max(most, tiled[static_cast<size_t>(q) * 2] + tiled[static_cast<size_t>(q) * 2 + 1]);
    }
    EXPECT_GE(layout.largest_masters(), most) << ranks << " ranks";
    EXPECT_EQ(ShardedStore::master_bytes_for(r, trainable, ranks),
              layout.largest_masters() * static_cast<int64_t>(sizeof(float)));
  }
}

struct ShardCase {
  ShardedStore::Mode mode;
  int ranks;
};
std::string name_of(const ShardCase& c) {
  return std::string(c.mode == ShardedStore::Mode::Full ? "full" : "gradients") + " over " + std::to_string(c.ranks);
}

// A ShardedStore of the awkward registry on each loopback rank, its weights written whole (as a loader does).
std::unique_ptr<ShardedStore> awkward_store(comm::Communicator& world, ShardedStore::Mode mode) {
  auto s = std::make_unique<ShardedStore>(world.split(0, world.rank()), mode, comm::default_timeout(), kFrozen);
  register_awkward(*s);
  s->allocate_weights();
  for (size_t slot = 0; slot < s->size(); ++slot) s->write_weight(slot, whole_weight(*s, slot));
  return s;
}

const std::vector<ShardCase> kShardCases = {
    {ShardedStore::Mode::Full, 1},      {ShardedStore::Mode::Full, 2},      {ShardedStore::Mode::Full, 3},
    {ShardedStore::Mode::Full, 5},      {ShardedStore::Mode::Full, 8},      {ShardedStore::Mode::Gradients, 2},
    {ShardedStore::Mode::Gradients, 3}, {ShardedStore::Mode::Gradients, 5},
};

// Written whole, read back whole (read_weight: a collective under full), each rank keeping only the layout's piece
// (own_piece) and holding its slices' bytes; a layer's gathered weights between its hooks are the whole tensors.
TEST(ShardedStore, WeightsRoundTripThroughThePieces) {
  for (const ShardCase& c : kShardCases) {
    comm::run_ranks(c.ranks, [&](comm::Communicator& world) {
      const std::string at = name_of(c) + ", rank " + std::to_string(world.rank());
      const std::unique_ptr<ShardedStore> s = awkward_store(world, c.mode);
      const std::vector<bool> trainable = s->trainable_after({});
      const ShardLayout layout(*s, trainable, c.ranks);
      const bool full = c.mode == ShardedStore::Mode::Full;
      EXPECT_EQ(s->masters_sharded(), full) << at;
      for (size_t slot = 0; slot < s->size(); ++slot) {
        const std::vector<float> want = whole_weight(*s, slot);
        if (full) {
          int64_t first = -1;
          const std::span<const float> own = s->own_piece(slot, &first);
          const ShardLayout::Piece pc = layout.piece(slot, world.rank());
          ASSERT_EQ(static_cast<int64_t>(own.size()), pc.n) << at << ", " << s->info(slot).name;
          if (pc.n > 0) {
            EXPECT_EQ(first, pc.first) << at;
          }
          for (size_t e = 0; e < own.size(); ++e)
            EXPECT_EQ(own[e], want[static_cast<size_t>(pc.first) + e]) << at << ", " << s->info(slot).name;
        }
        std::vector<float> got(want.size(), -1.f);
        s->read_weight(slot, got);  // every rank, the same slots in the same order
        EXPECT_EQ(got, want) << at << ", " << s->info(slot).name;
      }
      const int64_t mine =
          static_cast<int64_t>(layout.trainable_slice(world.rank()).size() + layout.frozen_slice(world.rank()).size());
      const int64_t all = layout.trainable_elements() + layout.frozen_elements();
      EXPECT_EQ(s->held().weight_shard, (full ? mine : all) * static_cast<int64_t>(sizeof(float))) << at;
      EXPECT_LE(s->held().weight_shard, ShardedStore::bytes_for(*s, trainable, c.mode, c.ranks, 0).weight_shard) << at;
      // A forward's gathers: the global group's small parameters for the run, each layer between its hooks.
      s->before_forward(kGlobalGroup);
      for (int layer = 0; layer < 2; ++layer) {
        s->before_forward(layer);
        for (size_t slot = 0; slot < s->size(); ++slot) {
          const model::ParamInfo& p = s->info(slot);
          if (p.streamed || (p.layer != layer && p.layer != kGlobalGroup)) continue;
          const std::vector<float> want = whole_weight(*s, slot);
          EXPECT_EQ(std::vector<float>(s->weight(slot), s->weight(slot) + p.numel), want) << at << ", " << p.name;
        }
        s->after_forward(layer);
      }
      s->after_forward(kGlobalGroup);
    });
  }
}

// One step's backward on every rank, each contributing grad_value to every trainable element (and to the token
// table's rows of its own ids through rows()): each rank's gradient slice holds, for every element of its slice of
// the trainable layout, the sum of the contributions of the ranks that made one (every rank for a layer's and the
// global group's; for a table row, the ranks whose ids hold it), computed here from the layout alone.
TEST(ShardedStore, GradientsReachTheirOwnersSummed) {
  for (const ShardCase& c : kShardCases) {
    comm::run_ranks(c.ranks, [&](comm::Communicator& world) {
      const int me = world.rank();
      const std::string at = name_of(c) + ", rank " + std::to_string(me);
      const std::unique_ptr<ShardedStore> s = awkward_store(world, c.mode);
      s->allocate_grads();
      const size_t table = s->slot("model.embed_tokens_per_layer.weight");
      const int64_t V = 7, W = 3;
      const auto ids_of = [&](int r) { return std::vector<int32_t>{static_cast<int32_t>(r % V), 6, 2}; };
      s->before_forward(kGlobalGroup);
      const std::vector<int32_t> ids = ids_of(me);
      const model::ParamStore::TableRows rows = s->rows(table, ids, true);
      ASSERT_NE(rows.grads, nullptr) << at;
      for (int layer = 0; layer < 2; ++layer) {
        s->before_forward(layer);
        s->after_forward(layer);
      }
      const auto contribute = [&](size_t slot) {
        float* g = s->grad(slot);
        ASSERT_NE(g, nullptr) << at << ", " << s->info(slot).name;
        for (int64_t e = 0; e < s->info(slot).numel; ++e) g[e] += grad_value(me, slot, e);
      };
      for (int layer = 1; layer >= 0; --layer) {
        s->before_backward(layer);
        for (size_t slot = 0; slot < s->size(); ++slot)
          if (s->info(slot).layer == layer && s->info(slot).trainable) contribute(slot);
        s->after_backward(layer);
      }
      for (size_t slot = 0; slot < s->size(); ++slot)
        if (s->info(slot).layer == kGlobalGroup && s->info(slot).trainable && !s->info(slot).streamed) contribute(slot);
      for (size_t i = 0; i < ids.size(); ++i)  // a repeated id adds into its one row
        for (int64_t col = 0; col < W; ++col)
          rows.grads[rows.row[i] * W + col] += grad_value(me, table, int64_t{ids[i]} * W + col);
      s->after_backward(kGlobalGroup);

      // The expected sums over this rank's slice of the trainable layout (registration order).
      std::vector<float> want;
      for (size_t slot = 0; slot < s->size(); ++slot) {
        if (!s->info(slot).trainable) continue;
        for (int64_t e = 0; e < s->info(slot).numel; ++e) {
          float sum = 0.f;
          for (int r = 0; r < c.ranks; ++r) {
            if (slot != table) {
              sum += grad_value(r, slot, e);
              continue;
            }
            for (int32_t id : ids_of(r))
              if (id == e / W) sum += grad_value(r, slot, e);
          }
          want.push_back(sum);
        }
      }
      const comm::Slice mine = comm::slice_of(want.size(), c.ranks, me);
      const std::span<const float> got = s->flat(Role::Grads);
      EXPECT_EQ(std::vector<float>(got.begin(), got.end()),
                std::vector<float>(want.begin() + static_cast<std::ptrdiff_t>(mine.begin),
                                   want.begin() + static_cast<std::ptrdiff_t>(mine.end)))
          << at;
      EXPECT_EQ(s->grads_begin(), static_cast<int64_t>(mine.begin)) << at;
    });
  }
}

// A token table read by row under full: each rank's ids (repeated, unsorted, the same row on several ranks) give
// that row of the whole table, fetched from the ranks whose pieces hold it (a row may span two), in rounds.
TEST(ShardedStore, TokenRowsAreTheTablesRows) {
  for (int ranks : {1, 2, 3, 4, 6}) {
    comm::run_ranks(ranks, [&](comm::Communicator& world) {
      const int me = world.rank();
      const std::string at = "over " + std::to_string(ranks) + ", rank " + std::to_string(me);
      const std::unique_ptr<ShardedStore> s = awkward_store(world, ShardedStore::Mode::Full);
      const size_t table = s->slot("model.embed_tokens_per_layer.weight");
      const int64_t W = 3;
      const std::vector<int32_t> ids = {5, 0, 5, static_cast<int32_t>((me * 3) % 7), 6};
      const std::vector<float> whole = whole_weight(*s, table);
      s->before_forward(kGlobalGroup);
      const model::ParamStore::TableRows rows = s->rows(table, ids, false);
      ASSERT_EQ(rows.row.size(), ids.size()) << at;
      EXPECT_EQ(rows.grads, nullptr) << at;
      for (size_t i = 0; i < ids.size(); ++i) {
        std::vector<float> got(static_cast<size_t>(W));
        model::widen(rows.values, rows.row[i] * W, W, got.data());
        const auto from = whole.begin() + int64_t{ids[i]} * W;
        EXPECT_EQ(got, std::vector<float>(from, from + W)) << at << ", id " << ids[i];
      }
      s->after_forward(kGlobalGroup);
    });
  }
}

// --- held experts ---------------------------------------------------------------------------------------------

// Two MoE layers of E = 4 experts beside non-expert parameters, and moments of distinct values.
std::unique_ptr<model::ReplicatedStore> whole_with_experts() {
  auto held = std::make_unique<model::ReplicatedStore>();
  model::ReplicatedStore& w = *held;
  w.add("model.norm.weight", {3});
  w.add("model.layers.0.experts.gate_up_proj", {4, 2, 3}, 0, true);
  w.add("model.layers.0.mlp.w", {5}, 0);
  w.add("model.layers.0.experts.down_proj", {4, 3, 2}, 0, true);
  w.add("model.layers.1.experts.gate_up_proj", {4, 2, 3}, 1, true);
  w.allocate_weights();
  for (size_t slot = 0; slot < w.size(); ++slot) w.write_weight(slot, whole_weight(w, slot));
  w.allocate_moments();
  for (Role role : {Role::ExpAvg, Role::ExpAvgSq}) {
    const std::span<float> m = w.mutable_flat(role);
    for (size_t i = 0; i < m.size(); ++i) m[i] = static_cast<float>(i + 1) * (role == Role::ExpAvg ? -1.f : 1.f);
  }
  return held;
}

// The vision tower's group 0 (its patch embedder, model::tower_group(0) = kGlobalGroup - 1) has a gradient between its
// backward's hooks only, like any layer: before its backward, and after it, asking for it is an error, not a pointer
// into another layer's buffer (the store's "no layer in backward" must be no group's number).
TEST(ShardedStore, TowerGroupZeroGradientOnlyInItsBackward) {
  for (const ShardedStore::Mode mode : {ShardedStore::Mode::Gradients, ShardedStore::Mode::Full}) {
    comm::run_ranks(2, [&](comm::Communicator& world) {
      ShardedStore s(world.split(0, world.rank()), mode, comm::default_timeout(), {});
      s.add("model.norm.weight", {5}, kGlobalGroup);
      s.add("model.layers.0.a", {3, 3}, 0, true);
      const size_t patch =
          s.add("model.vision_tower.patch_embedder.input_proj.weight", {4, 3}, model::tower_group(0), true);
      s.allocate_weights();
      for (size_t slot = 0; slot < s.size(); ++slot) s.write_weight(slot, whole_weight(s, slot));
      s.allocate_grads();
      EXPECT_THROW(s.grad(patch), Error) << "before any backward";
      s.before_backward(0);
      EXPECT_THROW(s.grad(patch), Error) << "in layer 0's backward";
      s.after_backward(0);
      EXPECT_THROW(s.grad(patch), Error) << "after layer 0's backward";
      s.before_backward(model::tower_group(0));
      ASSERT_NE(s.grad(patch), nullptr);
      s.grad(patch)[0] += 1.f;
      s.after_backward(model::tower_group(0));
      EXPECT_THROW(s.grad(patch), Error) << "after its backward";
      s.after_backward(kGlobalGroup);
    });
  }
}

// ep = 2 over N = 2 and 4 world ranks (shard optimizer's replicated inner store, and full's sharded one): world rank w
// holds EP rank w % 2's experts, rows [2 (w % 2), 2 (w % 2) + 2) of each expert tensor, with their weights and (over
// its EDP group of N / 2 ranks) its slice of their moments; the non-expert parameters stay in the inner store; a
// HeldWriter gives the writer every tensor and moment whole; the moments written by it and read back by a freshly
// placed store come back where they were.
TEST(HeldExpertStore, ExpertsHeldTheirStateAndCheckpoint) {
  const std::unique_ptr<model::ReplicatedStore> made = whole_with_experts();
  const model::ReplicatedStore& whole = *made;
  constexpr int kEp = 2, kE = 4;
  const fs::path dir = fs::temp_directory_path() / ("rf_test_stores_" + std::to_string(getpid()));
  for (const bool sharded : {false, true}) {
    for (int P : {2, 4}) {
      const std::string mode = std::string(sharded ? "full" : "optimizer") + " over " + std::to_string(P);
      const fs::path files = dir / (std::string(sharded ? "full" : "optimizer") + std::to_string(P));
      comm::run_ranks(P, [&](comm::Communicator& world) {
        const int w = world.rank(), ep_rank = w % kEp, Q = P / kEp, edp_rank = w / kEp;
        const std::string at = mode + ", rank " + std::to_string(w);
        const auto inner = [&] {
          return sharded ? HeldInner::of(std::make_unique<ShardedStore>(world.split(0, w), ShardedStore::Mode::Full,
                                                                        comm::default_timeout()))
                         : HeldInner::replicated();
        };
        const auto slices = [&] {
          return std::make_unique<ExpertSlices>(world.split(ep_rank, edp_rank), sharded, comm::default_timeout());
        };
        const HeldPlacement place{ep_rank, kEp, w, P};
        const std::unique_ptr<HeldExpertStore> held = make_held_expert_store(whole, inner(), slices(), place);
        EXPECT_EQ(held->inner_sharded() != nullptr, sharded) << at;
        const ExpertSlices& ex = held->experts();
        int64_t expert_elements = 0;
        for (size_t i = 0; i < whole.size(); ++i) {
          const model::ParamInfo& p = whole.info(i);
          const int64_t e = held->expert_slot(i);
          ASSERT_EQ(e >= 0, model::is_expert_tensor(p)) << at << ", " << p.name;
          if (e < 0) continue;
          const model::ParamInfo& h = ex.info(static_cast<size_t>(e));
          EXPECT_EQ(h.rows_begin, ep_rank * (kE / kEp)) << at << ", " << p.name;
          EXPECT_EQ(h.rows_total, kE) << at;
          EXPECT_EQ(h.shape[0], kE / kEp) << at;
          const int64_t row = p.numel / kE;
          const std::vector<float> all = whole_weight(whole, i);
          const auto from = all.begin() + h.rows_begin * row;
          EXPECT_EQ(std::vector<float>(ex.weight(static_cast<size_t>(e)), ex.weight(static_cast<size_t>(e)) + h.numel),
                    std::vector<float>(from, from + h.numel))
              << at << ", " << p.name;
          EXPECT_EQ(held->inner().info(i).numel, 0) << at << ": the inner store holds no expert rows";
          expert_elements += h.numel;
        }
        // The experts' moments: this rank's EDP slice of its experts' trainable layout.
        const comm::Slice own = comm::slice_of(static_cast<size_t>(expert_elements), Q, edp_rank);
        EXPECT_EQ(ex.own().begin, own.begin) << at;
        EXPECT_EQ(ex.own().end, own.end) << at;
        EXPECT_EQ(ex.flat(Role::ExpAvg).size(), own.size()) << at;

        // Every tensor and moment whole on the writer (world rank 0), from the ranks holding their parts.
        const std::unique_ptr<comm::Communicator> ep = world.split(w / kEp, w % kEp);
        const std::unique_ptr<comm::Communicator> edp = world.split(ep_rank, edp_rank);
        const HeldGroups g{world, *ep, *edp, comm::default_timeout()};
        HeldWriter writer(*held, g);
        ASSERT_EQ(writer.size(), whole.size()) << at;
        for (size_t i = 0; i < whole.size(); ++i) {
          std::vector<float> got(static_cast<size_t>(whole.info(i).numel), -1.f);
          writer.read_weight(i, got);
          if (w == 0) {
            EXPECT_EQ(got, whole_weight(whole, i)) << at << ", " << whole.info(i).name;
          }
          for (Role role : {Role::ExpAvg, Role::ExpAvgSq}) {
            writer.read_moment(role, i, got);
            if (w == 0) {
              EXPECT_EQ(got, std::vector<float>(whole.moment(role, i), whole.moment(role, i) + whole.info(i).numel))
                  << at << ", " << model::role_name(role) << " of " << whole.info(i).name;
            }
          }
        }
        // Saved through the writer, loaded into a store placed afresh: the same slices of the same moments.
        if (w == 0) fs::create_directories(files);
        world.barrier(comm::default_timeout());
        write_moments_streamed(
            files.string(), writer,
            [&writer](Role role, size_t slot, std::span<float> out) { writer.read_moment(role, slot, out); }, w == 0);
        world.barrier(comm::default_timeout());
        const std::unique_ptr<HeldExpertStore> back =
            place_held_experts(whole, whole.trainable_after({}), inner(), slices(), place);
        back->allocate_weights();
        set_held_moment_ranges(*back, place);
        load_held_moments(files.string(), *back);
        for (Role role : {Role::ExpAvg, Role::ExpAvgSq}) {
          const std::span<const float> want = ex.flat(role), got = back->experts().flat(role);
          EXPECT_EQ(std::vector<float>(got.begin(), got.end()), std::vector<float>(want.begin(), want.end())) << at;
          const std::span<const float> rest_want = held->inner().flat(role), rest_got = back->inner().flat(role);
          EXPECT_EQ(std::vector<float>(rest_got.begin(), rest_got.end()),
                    std::vector<float>(rest_want.begin(), rest_want.end()))
              << at;
        }
      });
    }
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace rf::trainer
