// ringflex cp: the public entry points. Only dispatch lives here: agree on the header (agree_header.cpp), run one
// algorithm body (ring.cpp or allgather.cpp), record the wall time.
#include "cp/cp_attention.h"

#include "core/error.h"
#include "cp/cp_internal.h"

namespace rf::cp {

std::string algo_name(Algo a) { return a == Algo::Ring ? "ring" : "allgather"; }

Algo parse_algo(const std::string& name) {
  if (name == "ring") return Algo::Ring;
  if (name == "allgather") return Algo::AllGather;
  fail("unknown CP algorithm '", name, "' (expected ring or allgather)");
}

void cp_attention_forward(comm::Communicator& comm, const CpShard& x, const CpParams& p, float* o, float* lse) {
  if (p.stats) *p.stats = CpStats{};
  detail::Ledger ledger(p.stats);
  const float scale = detail::agree_header(comm, x, p, detail::Pass::Forward, o && lse);
  if (p.algo == Algo::Ring)
    detail::ring_forward(comm, x, p, scale, o, lse, ledger);
  else
    detail::allgather_forward(comm, x, p, scale, o, lse, ledger);
  ledger.finish();
}

void cp_attention_backward(comm::Communicator& comm, const CpShard& x, const CpParams& p, const float* o,
                           const float* lse, const void* dout, float* dq, float* dk, float* dv) {
  if (p.stats) *p.stats = CpStats{};
  detail::Ledger ledger(p.stats);
  const float scale = detail::agree_header(comm, x, p, detail::Pass::Backward, o && lse && dout && dq && dk && dv);
  if (p.algo == Algo::Ring)
    detail::ring_backward(comm, x, p, scale, o, lse, dout, dq, dk, dv, ledger);
  else
    detail::allgather_backward(comm, x, p, scale, o, lse, dout, dq, dk, dv, ledger);
  ledger.finish();
}

}  // namespace rf::cp
