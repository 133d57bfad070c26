// ringflex cp: the model's layer mix and the attention work (mask area, SPEC §9) it implies, counted exactly.
//
// Work belongs to the query's owner: queries never move in the ring, so a rank computes every allowed (q, k) pair
// of the queries it holds, wherever the keys live. A query token's work is therefore a property of the row alone,
// independent of sharding; a rank's work is the sum over the tokens it holds. The balancer (cp/balance.h)
// minimises the largest such sum, `ringflex plan` reports it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/mask.h"
#include "cp/shard.h"

namespace rf::cp {

// `count` layers of the model share `mask`. A mix lists each distinct mask once.
struct LayerKind {
  LayerMask mask;
  int count = 1;
};
using LayerMix = std::vector<LayerKind>;

// Parses a comma-separated list of `[COUNTx]TYPE[:W][:groups]`:
//   sliding:W  causal with window W (W >= 1)       full  causal, no window
//   bidir[:W]  non-causal, optional symmetric window
// `groups` turns on bidirectional groups. Example (Gemma 4 31B with vision):
// "5xsliding:1024:groups,1xfull:groups". Kinds with equal masks are merged (counts added), first one's place kept.
// Throws rf::Error naming the offending item.
LayerMix parse_layer_mix(const std::string& spec);

// Allowed keys of every query of one row under mask m, over all keys of the row: [n]. Exact: block pairs are
// classified from summaries of `block` tokens; Full pairs add the key block's size, Partial pairs evaluate the
// predicate per element, Empty pairs cost one classification. row: [n].
std::vector<int64_t> allowed_keys_per_query(const TokenMeta* row, int n, const LayerMask& m, int block);

// Work of every position of the padded row, summed over the B rows and the mix (weighted by layer count):
// [S_padded]; positions >= S (sharding padding) have none. rows: [B, S].
std::vector<int64_t> token_work(const TokenMeta* rows, int B, int S, int S_padded, const LayerMix& mix, int block);

// Work of each rank under `map`: [P]. token_work: [map.S_padded] (from token_work()).
std::vector<int64_t> rank_work(const std::vector<int64_t>& token_work, const ShardMap& map);

// max / mean of per-rank work; 1 when there is no work at all.
double imbalance(const std::vector<int64_t>& per_rank);

}  // namespace rf::cp
