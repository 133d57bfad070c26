// ringflex cli: one attention job as `ringflex attn` and `ringflex demo` run it (docs/spec.md §7).
//
// A job is whole, unsharded rows: Q/K/V (and dOut for the backward) with the token metadata, as every rank
// holds it after reading the input itself. The pipeline is
//     read + validate (every rank)  ->  agree across ranks  ->  run_attention  ->  rank 0 writes
// and run_attention is the one context-parallel boundary: it hands the rows to cp::cp_attention_rows (cp/rows.h),
// which shards them, runs the CP forward and backward, and gathers the results to rank 0. The demo builds a job in
// memory and goes through the same run_attention.
#pragma once

#include <cstddef>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/attention_args.h"
#include "core/mask.h"
#include "core/memory.h"
#include "io/atomic_file.h"

namespace rf::cli {

struct AttnJob {
  AttnShape shape;  // Lq = Lk = S: every query of a row against every key of the same row
  DType dtype = DType::F32;
  LayerMask mask;
  float scale = 0.f;
  bool has_dout = false;        // run the backward too
  std::vector<std::byte> q;     // [B, Hq, S, D] in dtype
  std::vector<std::byte> k, v;  // [B, Hkv, S, D] in dtype
  std::vector<std::byte> dout;  // [B, Hq, S, D] in dtype when has_dout
  std::vector<TokenMeta> meta;  // [B, S]; idx = position in the row

  int S() const { return shape.Lq; }
  AttnChunk whole_chunk() const;  // the job as one query set against one key chunk
};

// Runs when the job's shape, dtype, options and metadata are known and validated, before its tensors are read
// or copied (`header` has empty q, k, v, dout): where the caller checks what the job needs against the machine.
using BeforeCopying = std::function<void(const AttnJob& header)>;

// Reads and validates an attention input file: tensors q, k, v, optional dout, doc, group (docs/spec.md §7) with
// `mask` and `scale` (nullopt: 1/sqrt(D)). With `check_finite`, a NaN or infinity in q, k, v or dout is an error
// too (finite.h). Throws rf::Error naming the file and the first problem found.
AttnJob read_attn_job(const std::string& path, const LayerMask& mask, std::optional<float> scale,
                      bool check_finite = true, const BeforeCopying& before_copying = {});

// How the rows are split across ranks. With one rank every choice computes the same thing.
struct CpOptions {
  std::string shard = "auto";        // contiguous | zigzag | balanced | auto (the best one for the mask)
  std::string algo = "ring";         // ring | allgather
  bool collect_stats = false;        // fill AttnResult::stats_json (runs the CP path even on one rank)
  bool cp_path_on_one_rank = false;  // run src/cp even at P = 1 (the demo checks the path P > 1 takes)
};

struct AttnResult {
  std::vector<float> out;     // [B, Hq, S, D]
  std::vector<float> lse;     // [B, Hq, S], natural log; -inf for a query with no allowed key
  std::vector<float> dq;      // [B, Hq, S, D]; empty without dout
  std::vector<float> dk, dv;  // [B, Hkv, S, D]; empty without dout
  double forward_seconds = 0, backward_seconds = 0;
  std::string stats_json;  // with CpOptions::collect_stats: every rank's CP figures (report::cp_stats_json)
};

// What a job needs on `rank` of P at least, beyond its metadata: the job's own copy of q, k, v (and dout), which
// every rank holds; the attention's buffers (cp::rows_memory_at_least through CP, else the whole-row results);
// and on rank 0 the outputs' copies in the job's dtype that write_attn_result makes (unless `writes_outputs` is
// false: `demo` writes none). `header`: the job without its tensors (BeforeCopying's argument) or with them.
MemoryBreakdown attn_memory_at_least(const AttnJob& header, const CpOptions& cp, int P, int rank,
                                     bool writes_outputs = true);

// The CP boundary: every rank of `comm` passes the same job; rank 0 gets the whole result (the other ranks' results
// are empty under mpirun with P > 1). A collective call.
AttnResult run_attention(const AttnJob& job, const CpOptions& cp, comm::Communicator& comm);

// Writes out, lse (and dq, dk, dv) with the outputs in the job's dtype into `file`, which the caller commits
// (alone, or with the job's other outputs: io::commit_all). Throws rf::Error naming the file.
void write_attn_result(io::AtomicFile& file, const AttnJob& job, const AttnResult& result);

}  // namespace rf::cli
