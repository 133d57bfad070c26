// ringflex cp: CP attention of whole rows — the one pipeline from rows that every rank holds to results in row
// order, used by `ringflex attn` and `demo`, the CP tests and the CP benchmark:
//
//     choose the shard map (shard_map_for)  ->  shard_rows  ->  cp_attention_forward / _backward  ->  gather_rows
//
// cp_attention_rows runs all of it; the pieces are public for callers that time or repeat the middle (the
// benchmark) or keep the shards (a model layer holds its activations sharded and never gathers them). Results are
// gathered only to the ranks that need them (one root, by default rank 0): the other ranks send their shard and
// hold nothing of the row, so no rank needs memory for P shards unless asked.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/attention_args.h"
#include "core/memory.h"
#include "cp/cp_attention.h"
#include "cp/shard.h"

namespace rf::cp {

// Whole rows, identical on every rank. shape.Lq == shape.Lk == S.
struct RowsInput {
  AttnShape shape;
  DType dtype = DType::F32;
  const void* q = nullptr;          // [B, Hq, S, D]
  const void* k = nullptr;          // [B, Hkv, S, D]
  const void* v = nullptr;          // [B, Hkv, S, D]
  const void* dout = nullptr;       // [B, Hq, S, D], or null: forward only
  const TokenMeta* meta = nullptr;  // [B, S]; idx = position in the row

  int S() const { return shape.Lq; }
};

// gather_rows' root meaning "every rank" (an allgather) rather than one rank.
constexpr int kEveryRank = -1;

struct RowsOptions {
  // The shard map: `map` when given (a caller sweeping maps of its own), else shard_map_for(scheme) for the mask.
  std::string scheme = "auto";  // contiguous | zigzag | balanced | auto
  const ShardMap* map = nullptr;
  // mask, scale, algo, traffic, timeout, plan. params.scheme is set from the map; params.stats is ignored (below).
  CpParams params;
  int gather_root = 0;         // the rank that receives the results in row order, or kEveryRank
  bool collect_stats = false;  // fill RowsResult's CpStats (counting work costs a pass over the block classes)
};

struct RowsResult {
  ShardMap map;
  // Row order, float32, on the gathering rank(s) only (empty elsewhere). out, dq: [B, Hq, S, D]; lse: [B, Hq, S]
  // (-inf where a query sees nothing); dk, dv: [B, Hkv, S, D]. The gradients stay empty without dout.
  std::vector<float> out, lse, dq, dk, dv;
  CpStats forward_stats, backward_stats;             // this rank's, with RowsOptions::collect_stats
  int64_t valid_tokens = 0;                          // non-padding tokens this rank held, over the B rows
  double forward_seconds = 0, backward_seconds = 0;  // the CP calls alone, on this rank
};

// The whole pipeline; a collective over `comm`: every rank passes the same rows and options. Throws rf::Error on
// every rank (via the CP header agreement) when an input is invalid.
RowsResult cp_attention_rows(comm::Communicator& comm, const RowsInput& in, const RowsOptions& opt);

// The map RowsOptions selects, for P ranks.
ShardMap rows_shard_map(const RowsInput& in, const RowsOptions& opt, int P);

// What cp_attention_rows holds on `rank` of P at least, known before any of it is allocated: only `in`'s shape,
// dtype and meta are read (its tensors may be null); `backward` says whether dout will be given. Each field is
// derived in rows.cpp from the buffers it counts. Building the shard map and, for the planned ring, the plan from
// every rank's metadata costs what the run's own planning costs; the plan's bytes are checked first.
struct RowsMemory {
  int64_t shard = 0;         // this rank's q, k, v (dout) and meta
  int64_t results = 0;       // this rank's float32 o, lse (dq, dk, dv)
  int64_t ring_buffers = 0;  // what the communication plan says this rank receives, or the allgather's K/V
  int64_t plan = 0;          // the communication plan's tables
  int64_t gathered = 0;      // the results in row order, on the gathering rank(s)

  // The larger of the two moments that hold the most: the ring running (shard, results, ring buffers, plan) and
  // the gather (shard, results, gathered results), as named terms (-1 where a size overflows).
  MemoryBreakdown peak() const;
};
RowsMemory rows_memory_at_least(const RowsInput& in, bool backward, const RowsOptions& opt, int P, int rank);

// One rank's shard of the rows under `map`, owning its buffers: q, dout [B, Hq, L, D]; k, v [B, Hkv, L, D] in the
// input dtype (sharding padding is zero); meta [B, L] (sharding padding is docs/spec.md §5's pad token).
struct RowsShard {
  AttnShape shape;  // Lq = Lk = L
  DType dtype = DType::F32;
  std::vector<std::byte> q, k, v, dout;  // dout empty when the rows have none
  std::vector<TokenMeta> meta;

  CpShard view() const { return {shape, dtype, q.data(), k.data(), v.data(), meta.data()}; }
  int64_t valid_tokens() const;
};
RowsShard shard_rows(const RowsInput& in, const ShardMap& map, int rank);

// Every rank's shard of a float32 [B, H, L, D] array back in row order [B, H, S, D] (padding dropped), on `root`
// or on every rank (kEveryRank); other ranks send theirs and get an empty vector. A collective over `comm`.
std::vector<float> gather_rows(comm::Communicator& comm, const ShardMap& map, const std::vector<float>& shard, int B,
                               int H, int D, int root, comm::Timeout timeout);

}  // namespace rf::cp
