// ringflex trainer: the sharded store's private parts, shared by its two files: sharded_store.cpp (the layers' gathers
// and reductions, the head, the bytes) and sharded_rows.cpp (the token tables' rows). Included by those alone.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "trainer/state/sharded_store.h"

namespace rf::trainer {

// fetch_rows' rounds in flight for a table whose rows differ by rank: round s + 1's transfers travel while round s's
// complete, each with its send buffer.
inline constexpr int64_t kRowRoundsInFlight = 2;

// The head, the one streamed parameter a run reads whole (around the loss): lm_head.weight, or the token table it is
// tied to (SIZE_MAX: neither). The other tables are read by row only (E2B's and E4B's per-layer table is 6x their
// head).
size_t head_slot(const model::ParamStore& registry);

// One hook group (a decoder layer, or the global group): its slots and where each lies in the group's buffers.
struct ShardedStore::Group {
  int layer = model::kGlobalGroup;
  std::vector<size_t> slots;     // registration order
  std::vector<int64_t> at;       // [slots]: first element in the gathered weights buffer
  std::vector<int64_t> grad_at;  // [slots]: first element in the gradient buffer; -1 when frozen
  int64_t elements = 0, grad_elements = 0;
};

// A group's weights gathered (or on their way): every rank's pieces land in `staging` in rank order, then are put
// in place in `w` [elements] (and their bf16 copies in `b16`). With param_dtype bfloat16 the working weights travel
// instead: the pieces rounded to bf16 land in `staging16`, are put in place in `b16` (the working copy itself) and
// widened into `w`.
struct ShardedStore::Gathered {
  const Group* group = nullptr;
  bool working16 = false;  // the pieces travel as bf16 working weights
  std::vector<float> staging;
  std::vector<bf16> staging16;
  bool staged() const { return !staging.empty() || !staging16.empty(); }
  std::vector<size_t> part_bytes;  // [P]
  comm::PostedPtr posted;          // null once finished
  std::vector<float> w;
  std::vector<bf16> b16;
};

// Gradients on their way to their owners (Communicator::post_reduce_parts, in rounds of bounded chunks): `send`
// the group's gradient buffer that post_reduce packed in place, every owner's pieces in rank order (empty where the
// caller keeps the packed buffer: reduce_spans, reduce_rows),
// `into` where this rank's part lands in its gradient slice (`at` in the part, `elem` the index in grads_), `part`
// its elements. The sums arrive chunk by chunk, from progress() or the wait, and are added there.
struct ShardedStore::Reduction {
  std::vector<float> send;
  std::vector<Span> into;
  size_t part = 0;
  comm::PostedPtr posted;  // last: destroyed (abandoned) before the buffers it reads and writes
};

// A token table's rows for one run (rows()): `ids` the rows this rank holds, sorted and distinct (the distinct tokens
// of its own micro-batch; every rank's together for the table tied to a trained head), `w` [ids, W] their values
// (`w16` instead with param_dtype bfloat16: the working rows), `g` [ids, W] this rank's gradient of them; of_rank [P]
// every rank's `ids` (whose gradient rows reach each owner); `shared`: every rank holds the same rows (the table tied
// to a trained head), which fetch_rows all-gathers.
struct ShardedStore::Table {
  size_t slot = 0;
  int64_t width = 0;
  std::vector<int32_t> ids;
  std::vector<std::vector<int32_t>> of_rank;
  std::vector<float> w, g;
  std::vector<bf16> w16;
  bool grads = false;
  bool shared = false;
};

}  // namespace rf::trainer
