// ringflex report: what a sharding scheme and its communication plan mean per rank, as `ringflex plan` shows them: work
// and its imbalance, tokens, bytes received and ring steps skipped per layer type; as a side-by-side text table, JSON,
// and an SVG picture of the block mask coloured by query owner with per-rank work bars.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/mask.h"
#include "cp/cp_attention.h"
#include "cp/plan.h"
#include "cp/shard.h"
#include "cp/work.h"

namespace rf::report {

// What one K/V token costs on the wire, by layer type. Gemma 4 31B: sliding layers 16 kv heads x 256, full
// (global) layers 4 kv heads x 512, bfloat16.
struct ReportOptions {
  int block = cp::kPlanBlock;
  cp::KvFormat windowed{16, 256, 2};  // layers with a window
  cp::KvFormat global{4, 512, 2};     // layers without one
};

struct LayerTypeReport {
  LayerMask mask;
  int layers = 0;
  std::vector<int64_t> tokens_received;  // [P]: K/V tokens per row one layer's forward pulls in
  std::vector<int64_t> bytes_received;   // [P]: their K and V bytes over the B rows, one layer, forward
  std::vector<int> skipped_steps;        // [P]: ring steps with nothing to receive
  int64_t full_ring_bytes = 0;           // what every rank receives per layer in a ring without a plan
};

struct SchemeReport {
  std::string scheme;
  int L = 0;
  std::vector<int64_t> tokens;               // [P]: valid (non-padding) tokens held, over the B rows
  std::vector<int64_t> work;                 // [P]: mask area of its queries summed over the mix and the rows
  double imbalance = 1.0;                    // max / mean of work
  std::vector<LayerTypeReport> layer_types;  // in mix order
};

// rows: [B, map.S]. `name` labels the scheme in every output.
SchemeReport report_scheme(const std::string& name, const TokenMeta* rows, int B, const cp::ShardMap& map,
                           const cp::LayerMix& mix, const ReportOptions& opt);

// Ranks down, schemes across, one section per quantity.
std::string report_text(const std::vector<SchemeReport>& reports);

// {"P": P, "layer_types": {"<layer type>": {"layers": n}},
//  "schemes": {"<name>": {"L": n, "tokens": [P], "work": [P], "imbalance": x,
//                         "bytes_received": {"<layer type>": [P]}, "skipped_steps": {"<layer type>": [P]},
//                         "full_ring_bytes_received": {"<layer type>": x}}}}
// Bytes are per layer of that type, forward K and V; a full ring (no plan) receives the same on every rank.
std::string report_json(const std::vector<SchemeReport>& reports);

// The block mask of row 0 (rows: [>= 1, S]) in row order, one panel per scheme: a cell is a (query block,
// key block) pair, coloured by the rank that owns the query block, opaque in proportion to the share of the mix's
// layers that compute it; a strip above shows which rank holds each block, bars below each rank's work.
// maps[i] belongs to reports[i].
std::string report_svg(const TokenMeta* rows, int S, const std::vector<cp::ShardMap>& maps,
                       const std::vector<SchemeReport>& reports, const cp::LayerMix& mix, int block);

// `ringflex attn --stats FILE.json`: every rank's figures of one CP forward (+ backward) call, gathered (a
// collective; every rank gets the text):
// {"scheme": s, "algo": a, "ranks": [{"rank", "tokens", "work", "peak_attention_bytes", "bytes_sent",
//                                     "bytes_received", "compute_s", "wall_s"}, ...]}
// tokens: valid tokens this rank holds; work: allowed pairs of the forward (the backward recomputes the same
// ones); peak: the larger pass's; bytes and seconds: both passes summed. bwd may be null (forward only).
std::string cp_stats_json(comm::Communicator& comm, const cp::CpStats& fwd, const cp::CpStats* bwd, int64_t tokens,
                          const std::string& scheme, const std::string& algo);

}  // namespace rf::report
