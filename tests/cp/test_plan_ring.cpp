// The planned ring against the chunk ring (which tests/cp/test_cp_loopback.cpp checks against the scalar
// reference): out, lse, dq, dk and dv over random metadata of every kind, several masks, contiguous, zigzag and
// balanced shards, P in {2, 3, 4, 8}, on loopback ranks. The planned ring's compacted chunks keep the kernels' key
// tiles (ranges start on 64-token plan blocks = key tiles) and the merge order, so the results must be the same
// bits; and it must never receive more than the chunk ring.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <random>

#include "comm/loopback_comm.h"
#include "cp/balance.h"
#include "cp/cp_cases.h"
#include "cp/plan.h"
#include "report/plan_report.h"

namespace rf::cp {
namespace {

using cases::Case;
using cases::Inputs;
using cases::Result;

struct RingRun {
  Result result;
  std::vector<CpStats> fwd, bwd;  // [P]
};

// CP forward and backward of `c` under `map` with the given ring traffic, on P loopback ranks.
RingRun run(const Case& c, const Inputs& in, const ShardMap& map, RingTraffic traffic, const CommPlan* plan = nullptr) {
  RingRun out;
  out.fwd.resize(static_cast<size_t>(map.P));
  out.bwd.resize(static_cast<size_t>(map.P));
  comm::run_ranks(map.P, [&](comm::Communicator& comm) {
    const int r = comm.rank();
    const CpParams p{c.mask, c.scale, Algo::Ring, map.scheme, cases::kCaseTimeout, &out.fwd[r], traffic, plan};
    Result res = cases::run_sharded(comm, c, in, map, p, &out.bwd[r]);
    if (r == 0) out.result = std::move(res);
  });
  return out;
}

void expect_planned_matches_chunks(const Case& c, const ShardMap& map) {
  SCOPED_TRACE(c.name + " " + scheme_name(map.scheme) + " P = " + std::to_string(map.P) +
               " L = " + std::to_string(map.L));
  const Inputs in = cases::make_inputs(c);
  const RingRun planned = run(c, in, map, RingTraffic::Planned);
  const RingRun chunks = run(c, in, map, RingTraffic::Chunks);
  cases::expect_same_bits(planned.result, chunks.result, "planned vs chunk ring");
  for (int r = 0; r < map.P; ++r) {
    EXPECT_LE(planned.fwd[r].bytes_received, chunks.fwd[r].bytes_received) << "rank " << r;
    EXPECT_EQ(planned.fwd[r].work, chunks.fwd[r].work) << "rank " << r;  // the same allowed pairs are computed
  }
}

TEST(PlannedRing, SameBitsAsChunkRing) {
  std::mt19937_64 rng(31);
  const LayerMask masks[] = {{true, 0, false}, {true, 0, true}, {true, 70, true}, {true, 5, false}, {false, 40, true}};
  const testing::MetaKind kinds[] = {testing::MetaKind::OneDoc, testing::MetaKind::Packed,
                                     testing::MetaKind::PackedImages, testing::MetaKind::Padded,
                                     testing::MetaKind::AllPadding};
  int k = 0;
  for (const int P : {2, 3, 4, 8}) {
    for (const LayerMask& m : masks) {
      Case c;
      c.B = 2;
      c.Hq = 4;
      c.Hkv = 2;  // GQA: two query heads per kv head
      c.D = 16;
      c.S = std::uniform_int_distribution<int>(40 * P, 200 * P)(rng);
      c.mask = m;
      c.kind = kinds[k++ % 5];
      c.seed = rng();
      c.dtype = k % 2 ? DType::F32 : DType::BF16;
      c.name = m.name() + " " + testing::kind_name(c.kind);
      const Inputs in = cases::make_inputs(c);
      const LayerMix mix = {{m, 1}};
      for (const ShardMap& map :
           {make_shard_map(Scheme::Contiguous, c.S, P), make_shard_map(Scheme::Zigzag, c.S, P, 32),
            balanced_shard_map(in.meta.data(), c.B, c.S, P, mix, 16)}) {
        expect_planned_matches_chunks(c, map);
      }
    }
  }
}

// A sliding layer on one document, contiguous shards: each rank receives only the halo, (W - 1) rounded out to a
// 64-token block, and later ranks' keys never move. A plan built once for the batch gives the same result.
TEST(PlannedRing, SlidingLayerMovesOnlyTheHalo) {
  Case c;
  c.name = "sliding halo";
  c.Hq = 2;
  c.Hkv = 1;
  c.D = 16;
  c.S = 4 * 256;
  c.mask = LayerMask{true, 100, false};
  const int P = 4, L = 256;
  const Inputs in = cases::make_inputs(c);
  const ShardMap map = make_shard_map(Scheme::Contiguous, c.S, P);
  const RingRun planned = run(c, in, map, RingTraffic::Planned);
  const int64_t halo = 128;  // idx r*256 - 99 lies in the block starting at r*256 - 128
  const int64_t per_token = int64_t{c.Hkv} * c.D * 2 * 4 + static_cast<int64_t>(sizeof(TokenMeta));  // K, V f32
  for (int r = 0; r < P; ++r) {
    EXPECT_EQ(planned.fwd[r].bytes_received, r == 0 ? 0 : halo * per_token) << "rank " << r;
  }
  // The same call with a plan built once for a two-layer mix.
  const LayerMix mix = {{c.mask, 5}, {LayerMask{}, 1}};
  const std::vector<BlockSummary> sums = summarize_all_shards(in.meta.data(), c.B, map, kPlanBlock);
  const CommPlan plan = plan_from_summaries(PlanGeometry{P, c.B, L, kPlanBlock}, sums.data(), mix);
  cases::expect_same_bits(run(c, in, map, RingTraffic::Planned, &plan).result, planned.result, "prebuilt plan");
}

// `--stats` JSON: every rank's record, in rank order, with the numbers the calls reported on each rank.
TEST(PlannedRing, StatsJsonGathersEveryRank) {
  constexpr int kP = 3;
  Case c;
  c.S = 300;
  c.mask = LayerMask{true, 50, false};
  const Inputs in = cases::make_inputs(c);
  const ShardMap map = shard_map_for("auto", in.meta.data(), c.B, c.S, kP, {{c.mask, 1}});
  EXPECT_EQ(map.scheme, Scheme::Balanced);
  const RingRun ran = run(c, in, map, RingTraffic::Planned);
  std::string text;
  comm::run_ranks(kP, [&](comm::Communicator& comm) {
    const int r = comm.rank();
    const std::string mine = report::cp_stats_json(comm, ran.fwd[r], &ran.bwd[r], 100 + r, "balanced", "ring");
    if (r == 0) text = mine;
  });
  const nlohmann::json j = nlohmann::json::parse(text);
  EXPECT_EQ(j["scheme"], "balanced");
  EXPECT_EQ(j["algo"], "ring");
  ASSERT_EQ(j["ranks"].size(), static_cast<size_t>(kP));
  for (int r = 0; r < kP; ++r) {
    const nlohmann::json& x = j["ranks"][r];
    EXPECT_EQ(x["rank"], r);
    EXPECT_EQ(x["tokens"], 100 + r);
    EXPECT_EQ(x["work"], ran.fwd[r].work);
    EXPECT_EQ(x["peak_attention_bytes"], std::max(ran.fwd[r].peak_attention_bytes, ran.bwd[r].peak_attention_bytes));
    EXPECT_EQ(x["bytes_sent"], ran.fwd[r].bytes_sent + ran.bwd[r].bytes_sent);
    EXPECT_EQ(x["bytes_received"], ran.fwd[r].bytes_received + ran.bwd[r].bytes_received);
    EXPECT_DOUBLE_EQ(x["compute_s"].get<double>(), ran.fwd[r].compute_seconds + ran.bwd[r].compute_seconds);
    EXPECT_DOUBLE_EQ(x["wall_s"].get<double>(), ran.fwd[r].wall_seconds + ran.bwd[r].wall_seconds);
  }
}

}  // namespace
}  // namespace rf::cp
