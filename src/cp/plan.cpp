// ringflex cp: building the communication plan from block summaries, and its queries (see plan.h).
#include "cp/plan.h"

#include <algorithm>
#include <type_traits>

#include "core/error.h"

namespace rf::cp {

// The allgather moves summaries as raw bytes.
static_assert(std::is_trivially_copyable_v<BlockSummary> && std::is_standard_layout_v<BlockSummary>);

namespace {

void check_geometry(const PlanGeometry& g) {
  RF_CHECK(g.P >= 1 && g.B >= 1 && g.L >= 1 && g.block >= 1, "plan geometry: P = ", g.P, ", B = ", g.B, ", L = ", g.L,
           ", block = ", g.block, " (all must be positive)");
}

}  // namespace

std::vector<BlockSummary> summarize_shard(const TokenMeta* meta, const PlanGeometry& g) {
  check_geometry(g);
  return summarize_blocks(meta, g.B, g.L, g.block);
}

std::vector<BlockSummary> summarize_all_shards(const TokenMeta* rows, int B, const ShardMap& map, int block) {
  const PlanGeometry g{map.P, B, map.L, block};
  std::vector<BlockSummary> all;
  for (int r = 0; r < map.P; ++r) {
    const std::vector<TokenMeta> local = shard_meta(map, r, rows, B);
    const std::vector<BlockSummary> sums = summarize_shard(local.data(), g);
    all.insert(all.end(), sums.begin(), sums.end());
  }
  return all;
}

BlockClass MaskCommPlan::pair_class(int r, int s, int b, int i, int j) const {
  const int64_t nb = geometry.blocks();
  return classes[(((int64_t{r} * geometry.P + s) * geometry.B + b) * nb + i) * nb + j];
}

bool MaskCommPlan::needs_block(int r, int s, int j) const {
  return needed[(int64_t{r} * geometry.P + s) * geometry.blocks() + j] != 0;
}

const std::vector<TokenRange>& MaskCommPlan::recv_ranges(int r, int s) const {
  return ranges[static_cast<size_t>(r) * geometry.P + s];
}

int64_t MaskCommPlan::recv_tokens(int r, int s) const {
  int64_t n = 0;
  for (const TokenRange& range : recv_ranges(r, s)) n += range.size();
  return n;
}

int64_t MaskCommPlan::recv_tokens(int r) const {
  int64_t n = 0;
  for (int s = 0; s < geometry.P; ++s) n += recv_tokens(r, s);
  return n;
}

int MaskCommPlan::skipped_steps(int r) const {
  int skipped = 0;
  for (int t = 1; t < geometry.P; ++t) skipped += receives_at(r, t) ? 0 : 1;
  return skipped;
}

const MaskCommPlan& CommPlan::for_mask(const LayerMask& m) const {
  for (const MaskCommPlan& mp : masks) {
    if (mp.mask == m) return mp;
  }
  fail("the plan has no layer with mask ", m.name());
}

namespace {

MaskCommPlan plan_mask(const PlanGeometry& g, const BlockSummary* summaries, const LayerKind& kind) {
  const int P = g.P, B = g.B, nb = g.blocks();
  MaskCommPlan mp;
  mp.mask = kind.mask;
  mp.layers = kind.count;
  mp.geometry = g;
  mp.classes.resize(static_cast<size_t>(P) * P * B * nb * nb);
  mp.needed.assign(static_cast<size_t>(P) * P * nb, 0);
  mp.ranges.resize(static_cast<size_t>(P) * P);
  // summaries: [P, B, nb]
  auto summary = [&](int rank, int b, int j) -> const BlockSummary& {
    return summaries[(static_cast<size_t>(rank) * B + b) * nb + j];
  };
  for (int r = 0; r < P; ++r) {
    for (int s = 0; s < P; ++s) {
      uint8_t* need = &mp.needed[(static_cast<size_t>(r) * P + s) * nb];
      BlockClass* cls = &mp.classes[(static_cast<size_t>(r) * P + s) * B * nb * nb];
      for (int b = 0; b < B; ++b) {
        for (int i = 0; i < nb; ++i) {
          for (int j = 0; j < nb; ++j) {
            const BlockClass c = classify(kind.mask, summary(r, b, i), summary(s, b, j));
            cls[(static_cast<size_t>(b) * nb + i) * nb + j] = c;
            if (c != BlockClass::Empty) need[j] = 1;
          }
        }
      }
      if (s == r) continue;  // the local chunk is already there
      std::vector<TokenRange>& out = mp.ranges[static_cast<size_t>(r) * P + s];
      for (int j = 0; j < nb; ++j) {
        if (!need[j]) continue;
        const int32_t begin = j * g.block, end = std::min(g.L, begin + g.block);
        if (!out.empty() && out.back().end == begin) {
          out.back().end = end;
        } else {
          out.push_back({begin, end});
        }
      }
    }
  }
  return mp;
}

}  // namespace

CommPlan plan_from_summaries(const PlanGeometry& g, const BlockSummary* summaries, const LayerMix& mix) {
  check_geometry(g);
  RF_CHECK(summaries != nullptr, "plan_from_summaries: no block summaries");
  CommPlan plan;
  plan.geometry = g;
  for (const LayerKind& kind : mix) {
    RF_CHECK(kind.count > 0, "layer mix: mask ", kind.mask.name(), " has ", kind.count, " layers");
    RF_CHECK(kind.mask.window >= 0, "layer mix: negative window ", kind.mask.window);
    auto same = std::find_if(plan.masks.begin(), plan.masks.end(),
                             [&](const MaskCommPlan& mp) { return mp.mask == kind.mask; });
    if (same != plan.masks.end()) {
      same->layers += kind.count;  // layers with the same mask reuse one plan
      continue;
    }
    plan.masks.push_back(plan_mask(g, summaries, kind));
  }
  return plan;
}

CommPlan make_comm_plan(comm::Communicator& comm, const TokenMeta* meta, const PlanGeometry& g, const LayerMix& mix,
                        comm::Timeout timeout) {
  RF_CHECK(g.P == comm.size(), "plan geometry has P = ", g.P, " for a communicator of ", comm.size(), " ranks");
  const std::vector<BlockSummary> mine = summarize_shard(meta, g);
  std::vector<BlockSummary> all(mine.size() * static_cast<size_t>(g.P));
  comm.allgather(mine.data(), all.data(), mine.size() * sizeof(BlockSummary), timeout);
  return plan_from_summaries(g, all.data(), mix);
}

}  // namespace rf::cp
