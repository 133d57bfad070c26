// CP attention on the loopback backend (ranks as threads): a slice of the mask sweep at several P, packed
// parity, and the per-rank figures the ring promises (memory independent of P, traffic that follows the mask,
// work that adds up to the mask area). Oracles: the scalar reference, and counts computed from the definitions.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "core/error.h"
#include "cp/cp_internal.h"
#include "cp/parallel_context.h"
#include "cp/plan.h"
#include "cp/rows.h"
#include "cp_cases.h"

namespace rf::cp {
namespace {

TEST(CpLoopback, MaskSweep) {
  const std::vector<cases::Case> all = cases::sweep_cases();
  for (int P : {2, 3, 8})
    for (const cases::Case& c : all) comm::run_ranks(P, [&](comm::Communicator& w) { cases::check_case(w, c, false); });
}

TEST(CpLoopback, PackedParity) {
  for (int P : {1, 3})
    comm::run_ranks(P, [](comm::Communicator& w) {
      cases::check_packed_parity(w, LayerMask{true, 7, true}, DType::F32);
    });
}

// Runs forward and backward of a one-document row at P with the given scheme/algorithm (the ring moving whole
// chunks, whose promises these tests check); returns each rank's forward and backward stats.
std::vector<std::pair<CpStats, CpStats>> stats_of(int P, Scheme s, Algo a, int S, LayerMask mask) {
  cases::Case c;
  c.S = S, c.mask = mask, c.Hq = 2, c.Hkv = 1, c.D = 8;
  const cases::Inputs in = cases::make_inputs(c);
  std::vector<std::pair<CpStats, CpStats>> out(static_cast<size_t>(P));
  comm::run_ranks(P, [&](comm::Communicator& w) {
    CpStats f, b;
    cases::run_cp(w, c, in, s, a, RingTraffic::Chunks, &f, &b);
    out[w.rank()] = {f, b};
  });
  return out;
}

// rows_memory_at_least against a run: the shard and the gathered results are exactly the buffers the run holds, and
// the ring's buffers are at most the forward's measured peak (the ledger counts them with the own chunk and the
// accumulators). Sliding, causal and image-group masks, the planned ring and the all-gather, S not divisible by P.
TEST(CpLoopback, MemoryEstimateIsALowerBoundOfTheRun) {
  struct Setup {
    LayerMask mask;
    testing::MetaKind kind;
    Algo algo;
  };
  const Setup setups[] = {{LayerMask{true, 9, false}, testing::MetaKind::Packed, Algo::Ring},
                          {LayerMask{true, 0, true}, testing::MetaKind::PackedImages, Algo::Ring},
                          {LayerMask{false, 0, false}, testing::MetaKind::OneDoc, Algo::AllGather}};
  for (int P : {2, 3})
    for (const Setup& setup : setups) {
      cases::Case c;
      c.B = 2, c.S = 301, c.Hq = 4, c.Hkv = 2, c.D = 8, c.mask = setup.mask, c.kind = setup.kind;
      const cases::Inputs in = cases::make_inputs(c);
      const RowsInput rows = cases::rows_input(c, in);
      RowsOptions opt;
      opt.params.mask = c.mask;
      opt.params.algo = setup.algo;
      opt.collect_stats = true;
      std::vector<int64_t> ring_buffers(static_cast<size_t>(P));
      comm::run_ranks(P, [&](comm::Communicator& w) {
        const RowsMemory need = rows_memory_at_least(rows, true, opt, P, w.rank());
        ring_buffers[w.rank()] = need.ring_buffers;
        const RowsResult ran = cp_attention_rows(w, rows, opt);
        const std::string where =
            concat("P = ", P, ", rank ", w.rank(), ", mask ", c.mask.name(), ": ", need.peak().describe(9));
        const int64_t L = ran.map.L, f32 = sizeof(float);
        EXPECT_EQ(need.shard, int64_t{c.B} * L * ((2 * c.Hq + 2 * c.Hkv) * c.D * f32 + int64_t{sizeof(TokenMeta)}))
            << where;
        if (setup.algo == Algo::AllGather) {
          EXPECT_GT(need.ring_buffers, 0) << where;
        }
        EXPECT_LE(need.ring_buffers, ran.forward_stats.peak_attention_bytes) << where;
        const int64_t gathered =
            static_cast<int64_t>(ran.out.size() + ran.lse.size() + ran.dq.size() + ran.dk.size() + ran.dv.size()) * f32;
        EXPECT_EQ(need.gathered, gathered) << where;
        // dq, dk, dv and o, lse: exactly this rank's float32 results.
        EXPECT_EQ(need.results, int64_t{c.B} * L * ((2 * c.Hq + 2 * c.Hkv) * c.D + c.Hq) * f32) << where;
      });
      // Some rank reads another's keys in every setup, so the plan has it receive something.
      EXPECT_GT(*std::max_element(ring_buffers.begin(), ring_buffers.end()), 0) << "P = " << P << ", " << c.mask.name();
    }
}

TEST(CpLoopback, RingMemoryIsAtMostThreeChunksWhateverP) {
  const int S = 96, D = 8, Hq = 2, Hkv = 1;
  for (int P : {2, 4, 8}) {
    const int L = S / P;
    const int64_t chunk = 2 * int64_t{Hkv} * L * D * sizeof(float) + int64_t{L} * sizeof(TokenMeta);  // K, V, meta
    const int64_t q_acc = (int64_t{Hq} * L * D + int64_t{Hq} * L) * sizeof(float);  // o or dq, and lse or delta
    const int64_t kv_grad = 2 * int64_t{Hkv} * L * D * sizeof(float);               // dK and dV
    for (const auto& [f, b] : stats_of(P, Scheme::Zigzag, Algo::Ring, S, LayerMask{false, 0, false})) {
      // forward: three chunks, the merged o/lse and one step's partial.
      EXPECT_LE(f.peak_attention_bytes, 3 * chunk + 2 * q_acc) << "P = " << P;
      // backward: three chunks, dq + delta, own dK/dV, two outgoing and two incoming contributions.
      EXPECT_LE(b.peak_attention_bytes, 3 * chunk + q_acc + 5 * kv_grad) << "P = " << P;
    }
    for (const auto& [f, b] : stats_of(P, Scheme::Zigzag, Algo::AllGather, S, LayerMask{false, 0, false}))
      EXPECT_GE(f.peak_attention_bytes, P * chunk) << "all-gather holds every chunk";
  }
}

// Causal contiguous shards never need later ranks' keys: the last rank sends nothing forward, the first rank
// receives nothing, and in total only P-1 + P-2 + ... hops happen; work adds up to the causal triangle.
TEST(CpLoopback, TrafficAndWorkFollowTheMask) {
  const int S = 64, P = 4, L = S / P;
  const std::vector<std::pair<CpStats, CpStats>> st =
      stats_of(P, Scheme::Contiguous, Algo::Ring, S, LayerMask{true, 0, false});
  const int64_t chunk_bytes = 2 * int64_t{1} * L * 8 * sizeof(float) + int64_t{L} * sizeof(TokenMeta);
  EXPECT_EQ(st[P - 1].first.bytes_sent, 0);
  EXPECT_EQ(st[0].first.bytes_received, 0);
  int64_t hops = 0, work = 0;
  for (const auto& [f, b] : st) {
    hops += f.bytes_sent / chunk_bytes;
    work += f.work;
    EXPECT_EQ(f.work, b.work);
  }
  EXPECT_EQ(hops, int64_t{P} * (P - 1) / 2);
  EXPECT_EQ(work, int64_t{S} * (S + 1) / 2);

  // A window of 7 over shards of 16 only needs the neighbour's halo: one hop per rank, none from the last.
  const std::vector<std::pair<CpStats, CpStats>> sw =
      stats_of(P, Scheme::Contiguous, Algo::Ring, S, LayerMask{true, 7, false});
  int64_t window_hops = 0;
  for (const auto& [f, b] : sw) window_hops += f.bytes_sent / chunk_bytes;
  EXPECT_EQ(window_hops, P - 1);
}

// A peer that agrees on the header and the plan but then never sends its chunk: the waiting rank fails by its
// deadline with a line naming itself, the peer, the chunk's owner and the ring step.
TEST(CpLoopback, MissingChunkTimesOutNamingPeerAndStep) {
  const int L = 4, D = 8;
  try {
    comm::run_ranks(2, [&](comm::Communicator& w) {
      std::vector<float> q(L * D, 0.1f), kv(L * D, 0.1f), o(q.size()), lse(L);
      std::vector<TokenMeta> meta;
      for (int i = 0; i < L; ++i) meta.push_back({w.rank() * L + i, 1, -1});
      const CpShard x{AttnShape{1, 1, 1, L, L, D}, DType::F32, q.data(), kv.data(), kv.data(), meta.data()};
      CpParams p;
      p.mask = LayerMask{false, 0, false};  // every rank needs every chunk
      p.traffic = RingTraffic::Chunks;
      p.timeout = comm::Timeout{100};
      if (w.rank() == 0) {
        cp_attention_forward(w, x, p, o.data(), lse.data());
      } else {
        detail::agree_header(w, x, p, detail::Pass::Forward, true);
        make_comm_plan(w, x.meta, PlanGeometry{2, 1, L, kPlanBlock}, {{p.mask, 1}}, p.timeout);
        // ... and stops here, never sending its K/V.
      }
    });
    FAIL() << "rank 0 must time out";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "rank 0: timed out after 100 ms waiting to receive K/V of rank 1 for ring step 1 from rank 1 (tag 3)");
  }
}

// One factory chooses the model's parallel context: the local kernels for a group of one rank, the CP engine (with
// its figures) for more; either way the context knows the group and sums over it (oracle: sum of r + 1/2 over
// r < P is P^2 / 2, exact in double).
TEST(ParallelContext, LocalOnOneRankCpEngineOnMore) {
  for (int P : {1, 2, 3}) {
    comm::run_ranks(P, [&](comm::Communicator& w) {
      const JobContext context = make_parallel_context(w);
      ASSERT_TRUE(context.model);
      EXPECT_EQ(context.model->ranks(), P);
      EXPECT_EQ(context.model->rank(), w.rank());
      ASSERT_EQ(context.cp != nullptr, P > 1);
      if (context.cp) {
        EXPECT_EQ(static_cast<const ParallelContext*>(context.cp), context.model.get());
      }
      double x = w.rank() + 0.5;
      context.model->sum_over_ranks(&x, 1);
      EXPECT_EQ(x, P * P / 2.0);
    });
  }
}

}  // namespace
}  // namespace rf::cp
