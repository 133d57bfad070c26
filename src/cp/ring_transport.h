// ringflex cp: how the ring moves keys and values (not a public header).
//
// The ring (ring.cpp) is one loop for both traffics: at step t in [0, P) rank r computes its queries against the
// keys of owner ring_source(r, t, P) (its own at t = 0), merges by LSE in step order, and in backward returns the
// dK/dV of exactly those keys directly to their owner. What differs is only how keys reach r, which a KvTransport
// hides:
//   planned  (planned_ring.cpp, the default) each step is one direct transfer from the owner of exactly the token
//            ranges the communication plan (cp/plan.h) says r's queries may read, received compacted;
//   chunks   (chunk_ring.cpp, the baseline kept to compare against) whole chunks hop rank to rank, r-1 to r, as far
//            as their last reader.
// Both hold the own chunk plus two receive slots (the step computed and the step arriving), post step t+1's
// transfers before step t computes, and give the same keys in the same tiles, so the ring's results are the same
// bits with either.
#pragma once

#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "cp/cp_internal.h"
#include "cp/plan.h"

namespace rf::cp::detail {

// The keys a step computes against. k, v: [B, Hkv, n, D] in the shard's dtype; meta: [B, n]. n = 0: nothing to
// compute at that step (no message was moved for it).
struct StepKeys {
  const void* k = nullptr;
  const void* v = nullptr;
  const TokenMeta* meta = nullptr;
  int n = 0;
};

class KvTransport {
 public:
  virtual ~KvTransport() = default;
  // Posts the K/V transfers of step t (t in [1, P); other t post nothing): this rank's receive of step t's keys
  // and its sends to whoever computes against its keys (or, for chunks, passes them on) at step t.
  virtual void post(int t) = 0;
  // Waits for the transfers posted last; afterwards the keys of the step they brought can be read.
  virtual void complete() = 0;
  // Step t's keys: the own chunk at t = 0, else what post(t) brought (n = 0 when nothing).
  virtual StepKeys keys(int t) const = 0;
  // The ranges of this rank's own keys that rank ring_dest(r, t, P) computes against at step t (empty: none), in
  // the compacted order that rank holds them; its dK/dV for them come back in that order.
  virtual const std::vector<TokenRange>& lent_ranges(int t) const = 0;
  // The most tokens any step t in [1, P) receives or lends: what a gradient buffer must hold.
  virtual int most_tokens() const = 0;
};

// The mask's plan (its geometry is this shard's) is borrowed for the transport's lifetime, as are x and ledger.
std::unique_ptr<KvTransport> make_planned_transport(comm::Communicator& comm, const CpShard& x,
                                                    const MaskCommPlan& plan, comm::Timeout timeout, Ledger& ledger);
std::unique_ptr<KvTransport> make_chunk_transport(comm::Communicator& comm, const CpShard& x, const MaskCommPlan& plan,
                                                  comm::Timeout timeout, Ledger& ledger);

}  // namespace rf::cp::detail
