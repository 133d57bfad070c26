// ringflex cp: which tokens of a row each rank holds (docs/spec.md §5), and moving sequence arrays in and out of
// shards.
//
// Every scheme pads the row to S_padded = P * L tokens and gives every rank exactly L of them, so ring chunks
// have one size. A ShardMap lists, per rank, the padded-row positions it holds in the order it holds them;
// contiguous, zigzag and the mask-aware balanced scheme (cp/balance.h) differ only in that list.
// All rows of a batch share one map.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/mask.h"

namespace rf::cp {

enum class Scheme { Contiguous, Zigzag, Balanced };
std::string scheme_name(Scheme s);
Scheme parse_scheme(const std::string& name);  // throws rf::Error naming the bad value

struct ShardMap {
  int S = 0;         // tokens per row before padding
  int S_padded = 0;  // P * L
  int P = 1;
  int L = 0;  // tokens per rank
  Scheme scheme = Scheme::Contiguous;
  std::vector<std::vector<int32_t>> positions;  // [P][L]: padded-row position of each local token

  // Positions >= S are padding added by sharding.
  bool is_pad(int32_t position) const { return position >= S; }
};

// contiguous: rank r holds [r*L, (r+1)*L). zigzag: 2P chunks, rank r holds chunks r and 2P-1-r.
// `multiple` rounds L up so that it is divisible by it (kernels and the planner like whole blocks).
// Balanced needs the row's metadata: use cp::balanced_shard_map (cp/balance.h); asking for it here throws.
ShardMap make_shard_map(Scheme scheme, int S, int P, int multiple = 1);

// Moving arrays between row order and a rank's shard. `full` arrays have S positions, shards L; padding that
// sharding adds takes docs/spec.md §5's pad values, and unsharding writes only real positions (padding is dropped), so
// unshard(shard(x)) over all ranks is x exactly.

// full: [B, H, S, D], shard: [B, H, L, D], elements of `elem_bytes`; padding positions get zero bytes
// (0.0 in float32 and bfloat16). Use H = 1 for [B, S, D] and D = 1 for [B, H, S] (e.g. LSE).
void shard_tensor(const ShardMap& m, int rank, const void* full, void* shard, int B, int H, int D, size_t elem_bytes);
// shard: [B, H, L, D] -> full: [B, H, S, D]; only this rank's real positions are written.
void unshard_tensor(const ShardMap& m, int rank, const void* shard, void* full, int B, int H, int D, size_t elem_bytes);

// full: [B, S] int32 -> shard: [B, L]; padding gets `pad_value` (token id: pad id, labels: -100, loss mask: 0).
void shard_row_array(const ShardMap& m, int rank, const int32_t* full, int32_t* shard, int B, int32_t pad_value);

// Metadata full: [B, S] -> [B, L]; padding gets idx = its padded position, doc = 0, group = -1.
std::vector<TokenMeta> shard_meta(const ShardMap& m, int rank, const TokenMeta* full, int B);

}  // namespace rf::cp
