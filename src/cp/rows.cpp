// ringflex cp: CP attention of whole rows (see rows.h).
#include "cp/rows.h"

#include <algorithm>
#include <array>
#include <chrono>

#include "core/error.h"
#include "cp/balance.h"
#include "cp/plan.h"

namespace rf::cp {

namespace {

// gather_rows' point-to-point messages. One tag above every ring tag (3 per step, P steps), so a shard sent to the
// root can never be taken for a ring transfer of the same pair of ranks.
constexpr int kGatherTag = comm::Communicator::kMaxTag - 1;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

ShardMap rows_shard_map(const RowsInput& in, const RowsOptions& opt, int P) {
  if (opt.map) {
    RF_CHECK(opt.map->P == P && opt.map->S == in.S(), "the given shard map is for P = ", opt.map->P,
             ", S = ", opt.map->S, ", these rows have P = ", P, ", S = ", in.S());
    return *opt.map;
  }
  return shard_map_for(opt.scheme, in.meta, in.shape.B, in.S(), P, LayerMix{{opt.params.mask, 1}});
}

// Fields (bytes of buffers cp_attention_rows and the CP calls allocate):
//   shard         shard_rows: q, k, v (and dout) [B, H, L, D] in the input dtype and meta [B, L]; alive throughout;
//   results       o [B, Hq, L, D] and lse [B, Hq, L] float32, with the backward dq [B, Hq, L, D] and dk, dv
//                 [B, Hkv, L, D] float32, all allocated before the backward's ring runs and alive through the gather;
//   ring_buffers  P > 1, while a ring call runs. Planned ring: one receive slot (planned_ring.cpp sizes each slot for
//                 the most tokens any step brings, K and V [B, Hkv, n, D] in the dtype and meta [B, n]); the ring
//                 double-buffers, but a second slot is used only when two steps receive, so one is counted.
//                 Allgather: every rank's K and V [B, Hkv, P * L, D] and meta [B, P * L] (allgather.cpp). The chunk
//                 ring's slots are not counted (whole chunks travel only as far as their last reader, maybe nowhere);
//   plan          the planned ring's plan (plan_bytes), built by each ring call that is not given one;
//   gathered      on the gathering rank, the row-order out [B, Hq, S, D], lse [B, Hq, S] (and dq, dk, dv) float32,
//                 all alive when the last gather ends (gather_rows).
// Not counted: the kernels' partial accumulators, delta [B, Hq, L], the gradient return slots and the gather's
// one-shard receive buffer, so the figure stays a lower bound.
RowsMemory rows_memory_at_least(const RowsInput& in, bool backward, const RowsOptions& opt, int P, int rank) {
  const AttnShape& s = in.shape;
  const ShardMap map = rows_shard_map(in, opt, P);
  const int64_t B = s.B, Hq = s.Hq, Hkv = s.Hkv, L = map.L, S = in.S(), D = s.D;
  const int64_t es = static_cast<int64_t>(dtype_size(in.dtype)), f32 = sizeof(float), meta = sizeof(TokenMeta);
  const int64_t q_tensors = backward ? 2 : 1;  // q, dout
  constexpr int64_t kKv = 2;                   // k and v
  RowsMemory m;
  m.shard = checked_sum({checked_bytes({B, Hq, L, D, es, q_tensors}), checked_bytes({B, Hkv, L, D, es, kKv}),
                         checked_bytes({B, L, meta})});
  m.results = checked_sum({checked_bytes({B, Hq, L, D + 1, f32}),                     // o, lse
                           backward ? checked_bytes({B, Hq, L, D, f32}) : 0,          // dq
                           backward ? checked_bytes({B, Hkv, L, D, f32, kKv}) : 0});  // dk, dv
  if (P > 1 && opt.params.algo == Algo::AllGather) {
    m.ring_buffers = checked_sum({checked_bytes({B, Hkv, P, L, D, es, kKv}), checked_bytes({B, P, L, meta})});
  } else if (P > 1) {
    const PlanGeometry g{P, s.B, map.L, kPlanBlock};
    m.plan = plan_bytes(g, 1);
    // The plan itself is built only when its tables fit: otherwise the check fails on them first.
    if (opt.params.traffic == RingTraffic::Planned && m.plan >= 0 && m.plan <= available_memory_bytes()) {
      const std::vector<BlockSummary> summaries = summarize_all_shards(in.meta, s.B, map, kPlanBlock);
      const CommPlan comm_plan = plan_from_summaries(g, summaries.data(), {{opt.params.mask, 1}});
      const MaskCommPlan& mp = comm_plan.masks.front();
      int64_t most_in = 0;
      for (int t = 1; t < P; ++t) most_in = std::max(most_in, mp.recv_tokens(rank, ring_source(rank, t, P)));
      m.ring_buffers = checked_sum({checked_bytes({B, Hkv, most_in, D, es, kKv}), checked_bytes({B, most_in, meta})});
    }
  }
  if (opt.gather_root == rank || opt.gather_root == kEveryRank)
    m.gathered = checked_sum({checked_bytes({B, Hq, S, D + 1, f32}),                     // out, lse
                              backward ? checked_bytes({B, Hq, S, D, f32}) : 0,          // dq
                              backward ? checked_bytes({B, Hkv, S, D, f32, kKv}) : 0});  // dk, dv
  return m;
}

MemoryBreakdown RowsMemory::peak() const {
  MemoryBreakdown ring, gather;
  for (MemoryBreakdown* b : {&ring, &gather}) {
    b->add("shard", shard);
    b->add("results", results);
  }
  ring.add("ring buffers", ring_buffers);
  ring.add("communication plan", plan);
  gather.add("gathered results", gathered);
  if (ring.total() < 0) return ring;
  if (gather.total() < 0) return gather;
  return ring.total() >= gather.total() ? ring : gather;
}

int64_t RowsShard::valid_tokens() const {
  int64_t n = 0;
  for (const TokenMeta& t : meta) n += t.doc != kPaddingDoc ? 1 : 0;
  return n;
}

RowsShard shard_rows(const RowsInput& in, const ShardMap& map, int rank) {
  const AttnShape& s = in.shape;
  const int L = map.L;
  const size_t es = dtype_size(in.dtype);
  RowsShard out;
  out.shape = AttnShape{s.B, s.Hq, s.Hkv, L, L, s.D};
  out.dtype = in.dtype;
  out.q.resize(static_cast<size_t>(out.shape.q_elems()) * es);
  out.k.resize(static_cast<size_t>(out.shape.kv_elems()) * es);
  out.v.resize(out.k.size());
  shard_tensor(map, rank, in.q, out.q.data(), s.B, s.Hq, s.D, es);
  shard_tensor(map, rank, in.k, out.k.data(), s.B, s.Hkv, s.D, es);
  shard_tensor(map, rank, in.v, out.v.data(), s.B, s.Hkv, s.D, es);
  if (in.dout) {
    out.dout.resize(out.q.size());
    shard_tensor(map, rank, in.dout, out.dout.data(), s.B, s.Hq, s.D, es);
  }
  out.meta = shard_meta(map, rank, in.meta, s.B);
  return out;
}

std::vector<float> gather_rows(comm::Communicator& comm, const ShardMap& map, const std::vector<float>& shard, int B,
                               int H, int D, int root, comm::Timeout timeout) {
  const comm::Step step("gathering the results in row order");  // names this step in a timeout's message
  const int P = comm.size(), r = comm.rank();
  RF_CHECK(root == kEveryRank || (root >= 0 && root < P), "gather_rows: root ", root, " is not a rank of ", P);
  const size_t bytes = shard.size() * sizeof(float);
  if (root == kEveryRank) {
    std::vector<float> all(shard.size() * P), full(static_cast<size_t>(B) * H * map.S * D);
    comm.allgather(shard.data(), all.data(), bytes, timeout);
    for (int j = 0; j < P; ++j)
      unshard_tensor(map, j, all.data() + j * shard.size(), full.data(), B, H, D, sizeof(float));
    return full;
  }
  if (r != root) {
    const std::array<comm::SendBuffer, 1> buf{{{shard.data(), bytes}}};
    comm.isend(root, kGatherTag, buf, concat("result shard of rank ", r))->wait(timeout);
    return {};
  }
  // The root takes the shards one rank at a time into one buffer: it holds the row and one shard, never P shards.
  std::vector<float> full(static_cast<size_t>(B) * H * map.S * D), theirs(shard.size());
  unshard_tensor(map, r, shard.data(), full.data(), B, H, D, sizeof(float));
  for (int j = 0; j < P; ++j) {
    if (j == r) continue;
    const std::array<comm::RecvBuffer, 1> buf{{{theirs.data(), bytes}}};
    comm.irecv(j, kGatherTag, buf, concat("result shard of rank ", j))->wait(timeout);
    unshard_tensor(map, j, theirs.data(), full.data(), B, H, D, sizeof(float));
  }
  return full;
}

RowsResult cp_attention_rows(comm::Communicator& comm, const RowsInput& in, const RowsOptions& opt) {
  const AttnShape& s = in.shape;
  RowsResult res;
  res.map = rows_shard_map(in, opt, comm.size());
  const RowsShard mine = shard_rows(in, res.map, comm.rank());
  const CpShard x = mine.view();
  res.valid_tokens = mine.valid_tokens();

  CpParams p = opt.params;
  p.scheme = res.map.scheme;
  p.stats = opt.collect_stats ? &res.forward_stats : nullptr;
  // o: [B, Hq, L, D], lse: [B, Hq, L] float32 on this rank.
  std::vector<float> o(static_cast<size_t>(x.shape.q_elems())), lse(static_cast<size_t>(x.shape.lse_elems()));
  auto t0 = std::chrono::steady_clock::now();
  cp_attention_forward(comm, x, p, o.data(), lse.data());
  res.forward_seconds = seconds_since(t0);
  const auto gather = [&](const std::vector<float>& shard, int H, int D) {
    return gather_rows(comm, res.map, shard, s.B, H, D, opt.gather_root, p.timeout);
  };
  if (in.dout) {
    // dq: [B, Hq, L, D]; dk, dv: [B, Hkv, L, D] float32 on this rank.
    std::vector<float> dq(o.size()), dk(static_cast<size_t>(x.shape.kv_elems())), dv(dk.size());
    p.stats = opt.collect_stats ? &res.backward_stats : nullptr;
    t0 = std::chrono::steady_clock::now();
    cp_attention_backward(comm, x, p, o.data(), lse.data(), mine.dout.data(), dq.data(), dk.data(), dv.data());
    res.backward_seconds = seconds_since(t0);
    res.dq = gather(dq, s.Hq, s.D);
    res.dk = gather(dk, s.Hkv, s.D);
    res.dv = gather(dv, s.Hkv, s.D);
  }
  res.out = gather(o, s.Hq, s.D);
  res.lse = gather(lse, s.Hq, 1);
  return res;
}

}  // namespace rf::cp
