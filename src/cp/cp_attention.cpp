// ringflex cp: the public entry points (header agreement, planning, dispatch) and the plan/work helpers.
#include "cp/cp_attention.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>

#include "core/error.h"
#include "cp/cp_internal.h"

namespace rf::cp {

std::string algo_name(Algo a) { return a == Algo::Ring ? "ring" : "allgather"; }

Algo parse_algo(const std::string& name) {
  if (name == "ring") return Algo::Ring;
  if (name == "allgather") return Algo::AllGather;
  fail("unknown CP algorithm '", name, "' (expected ring or allgather)");
}

namespace detail {
namespace {

constexpr size_t kErrorChars = 240;  // one error line travels in the header; longer ones are cut

// Plain data only: it is allgathered as bytes.
struct Header {
  int32_t fields[14];
  char error[kErrorChars];
};

constexpr std::array<const char*, 14> kFieldNames = {
    "B", "Hq", "Hkv", "L", "D", "dtype", "causal", "window", "bidirectional_groups", "scale (bits)", "scheme",
    "algo", "pass", "ring traffic"};

// Per-block summaries for planning: blocks of at least kNeedBlock tokens, and at most kMaxPlanBlocks blocks a
// rank so the P^2 * blocks^2 classification stays negligible next to one chunk's attention.
constexpr int kNeedBlock = 64;
constexpr int kMaxPlanBlocks = 64;
// Block size for counting allowed pairs (the same classifier the kernels use).
constexpr int kCountBlock = 64;

}  // namespace

float agree_header(comm::Communicator& comm, const CpShard& x, const CpParams& p, Pass pass, bool outputs_ok) {
  Header h{};
  const float scale = p.scale != 0.f ? p.scale : default_scale(x.shape.D);
  try {
    RF_CHECK(outputs_ok, "CP attention ", pass == Pass::Forward ? "forward" : "backward",
             " is missing an input or output buffer");
    RF_CHECK(x.shape.Lq == x.shape.Lk, "a CP shard has one length L for queries and keys, got Lq = ", x.shape.Lq,
             " and Lk = ", x.shape.Lk);
    RF_CHECK(x.shape.Lq >= 1, "a CP shard needs L >= 1 tokens, got ", x.shape.Lq);
    RF_CHECK(x.meta != nullptr, "the shard's token metadata is missing");
    AttnChunk c{x.shape, x.dtype, x.q, x.k, x.v, x.meta, x.meta, p.mask, scale};
    validate(c);
  } catch (const Error& e) {
    std::strncpy(h.error, e.what(), kErrorChars - 1);
  }
  const std::array<int32_t, 14> f = {x.shape.B,
                                     x.shape.Hq,
                                     x.shape.Hkv,
                                     x.shape.Lq,
                                     x.shape.D,
                                     static_cast<int32_t>(x.dtype),
                                     p.mask.causal,
                                     p.mask.window,
                                     p.mask.bidirectional_groups,
                                     std::bit_cast<int32_t>(scale),
                                     static_cast<int32_t>(p.scheme),
                                     static_cast<int32_t>(p.algo),
                                     static_cast<int32_t>(pass),
                                     static_cast<int32_t>(p.traffic)};
  std::copy(f.begin(), f.end(), h.fields);

  const int P = comm.size();
  std::vector<Header> all(static_cast<size_t>(P));
  comm.allgather(&h, all.data(), sizeof(Header), p.timeout);
  for (int r = 0; r < P; ++r)
    RF_CHECK(all[r].error[0] == 0, "rank ", r, ": ", std::string(all[r].error));
  for (int r = 1; r < P; ++r)
    for (size_t i = 0; i < kFieldNames.size(); ++i)
      RF_CHECK(all[r].fields[i] == all[0].fields[i], "ranks disagree on ", kFieldNames[i], ": rank 0 has ",
               all[0].fields[i], ", rank ", r, " has ", all[r].fields[i]);
  return scale;
}

RingPlan plan_ring(comm::Communicator& comm, const CpShard& x, const LayerMask& mask, comm::Timeout timeout) {
  const int P = comm.size(), B = x.shape.B, L = x.shape.Lq;
  const int block = std::max(kNeedBlock, (L + kMaxPlanBlocks - 1) / kMaxPlanBlocks);
  const int nblk = (L + block - 1) / block;
  // mine: [B, nblk]; all: [P, B, nblk]
  std::vector<BlockSummary> mine(static_cast<size_t>(B) * nblk), all(static_cast<size_t>(P) * B * nblk);
  for (int b = 0; b < B; ++b)
    for (int i = 0; i < nblk; ++i)
      mine[static_cast<size_t>(b) * nblk + i] =
          summarize(x.meta + static_cast<int64_t>(b) * L + i * block, std::min(block, L - i * block));
  comm.allgather(mine.data(), all.data(), mine.size() * sizeof(BlockSummary), timeout);

  RingPlan plan;
  plan.P = P;
  plan.need.assign(static_cast<size_t>(P) * P, 0);
  plan.hops.assign(static_cast<size_t>(P), 0);
  const auto summary = [&](int rank, int b, int i) { return all[(static_cast<size_t>(rank) * B + b) * nblk + i]; };
  for (int reader = 0; reader < P; ++reader)
    for (int owner = 0; owner < P; ++owner) {
      bool need = false;
      for (int b = 0; b < B && !need; ++b)
        for (int qi = 0; qi < nblk && !need; ++qi)
          for (int ki = 0; ki < nblk && !need; ++ki)
            need = classify(mask, summary(reader, b, qi), summary(owner, b, ki)) != BlockClass::Empty;
      plan.need[static_cast<size_t>(reader) * P + owner] = need;
    }
  for (int owner = 0; owner < P; ++owner)
    for (int d = 1; d < P; ++d)
      if (plan.needs((owner + d) % P, owner)) plan.hops[owner] = d;
  return plan;
}

int64_t count_allowed(const LayerMask& mask, const TokenMeta* q_meta, const TokenMeta* k_meta, int B, int Lq,
                      int Lk) {
  int64_t pairs = 0;
  for (int b = 0; b < B; ++b) {
    const TokenMeta* qm = q_meta + static_cast<int64_t>(b) * Lq;
    const TokenMeta* km = k_meta + static_cast<int64_t>(b) * Lk;
    for (int q0 = 0; q0 < Lq; q0 += kCountBlock) {
      const int nq = std::min(kCountBlock, Lq - q0);
      const BlockSummary sq = summarize(qm + q0, nq);
      for (int k0 = 0; k0 < Lk; k0 += kCountBlock) {
        const int nk = std::min(kCountBlock, Lk - k0);
        const BlockClass cls = classify(mask, sq, summarize(km + k0, nk));
        if (cls == BlockClass::Empty) continue;
        if (cls == BlockClass::Full) {
          pairs += int64_t{nq} * nk;
          continue;
        }
        for (int i = 0; i < nq; ++i)
          for (int j = 0; j < nk; ++j) pairs += allowed(mask, qm[q0 + i], km[k0 + j]);
      }
    }
  }
  return pairs;
}

}  // namespace detail

void cp_attention_forward(comm::Communicator& comm, const CpShard& x, const CpParams& p, float* o, float* lse) {
  if (p.stats) *p.stats = CpStats{};
  detail::Ledger ledger(p.stats);
  const float scale = detail::agree_header(comm, x, p, detail::Pass::Forward, o && lse);
  if (p.algo == Algo::Ring && p.traffic == RingTraffic::Planned)
    detail::planned_ring_forward(comm, x, p, scale, o, lse, ledger);
  else if (p.algo == Algo::Ring)
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
  if (p.algo == Algo::Ring && p.traffic == RingTraffic::Planned)
    detail::planned_ring_backward(comm, x, p, scale, o, lse, dout, dq, dk, dv, ledger);
  else if (p.algo == Algo::Ring)
    detail::ring_backward(comm, x, p, scale, o, lse, dout, dq, dk, dv, ledger);
  else
    detail::allgather_backward(comm, x, p, scale, o, lse, dout, dq, dk, dv, ledger);
  ledger.finish();
}

}  // namespace rf::cp
