// ringflex cp: the model's layer mix and the attention work (mask area, docs/spec.md §9) it implies, counted exactly.
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

// Block size for counting allowed pairs when the caller has no other reason to pick one: the kernels' key tile,
// so a count costs one classification per tile pair the kernels visit.
constexpr int kCountBlock = 64;

// The one place allowed pairs are counted. Allowed keys of every query q_meta[0 .. nq) among the keys
// k_meta[0 .. nk) under mask m: [nq]. Exact: block pairs are classified from summaries of `block` tokens; Full pairs
// add the key block's size, Partial pairs evaluate the predicate per element, Empty pairs cost one classification.
std::vector<int64_t> allowed_keys_per_query(const TokenMeta* q_meta, int nq, const TokenMeta* k_meta, int nk,
                                            const LayerMask& m, int block);

// The same for every query of one row against all keys of that row (the work model). row: [n] -> [n].
inline std::vector<int64_t> allowed_keys_per_query(const TokenMeta* row, int n, const LayerMask& m, int block) {
  return allowed_keys_per_query(row, n, row, n, m, block);
}

// Allowed (query, key) pairs between q_meta [B, Lq] and k_meta [B, Lk], row b's queries against row b's keys,
// summed over the B rows: the work a CP call reports (CpStats::work).
int64_t count_allowed_pairs(const LayerMask& m, const TokenMeta* q_meta, const TokenMeta* k_meta, int B, int Lq, int Lk,
                            int block = kCountBlock);

// Work of every position of the padded row, summed over the B rows and the mix (weighted by layer count):
// [S_padded]; positions >= S (sharding padding) have none. rows: [B, S].
std::vector<int64_t> token_work(const TokenMeta* rows, int B, int S, int S_padded, const LayerMix& mix, int block);

// Work of each rank under `map`: [P]. token_work: [map.S_padded] (from token_work()).
std::vector<int64_t> rank_work(const std::vector<int64_t>& token_work, const ShardMap& map);

// max / mean of per-rank work; 1 when there is no work at all.
double imbalance(const std::vector<int64_t>& per_rank);

}  // namespace rf::cp
