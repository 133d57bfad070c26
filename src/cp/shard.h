// ringflex cp: which tokens of a row each rank holds (SPEC §5), and moving sequence arrays in and out of shards.
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
  int L = 0;         // tokens per rank
  Scheme scheme = Scheme::Contiguous;
  std::vector<std::vector<int32_t>> positions;  // [P][L]: padded-row position of each local token

  // Positions >= S are padding added by sharding.
  bool is_pad(int32_t position) const { return position >= S; }
};

// contiguous: rank r holds [r*L, (r+1)*L). zigzag: 2P chunks, rank r holds chunks r and 2P-1-r.
// `multiple` rounds L up so that it is divisible by it (kernels and the planner like whole blocks).
ShardMap make_shard_map(Scheme scheme, int S, int P, int multiple = 1);

}  // namespace rf::cp
