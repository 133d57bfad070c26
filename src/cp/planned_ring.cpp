// ringflex cp: the planned ring's transport, the default (RingTraffic::Planned; see ring_transport.h).
//
// At step t in [1, P) rank r receives from src = r - t exactly the token ranges of src's shard its queries may read
// (the communication plan, cp/plan.h), and sends dst = r + t the ranges dst needs from it: every transfer is one
// direct hop from the owner, a sliding layer moves only its halo, and a step with nothing to move costs no message
// and no compute. Received ranges land compacted, [B, Hkv, n, D], and the kernel runs on those n keys. The plan's
// block (64 tokens) is the kernels' key tile and ranges start on block boundaries, so the compacted chunk's tiles
// are the chunk ring's tiles minus tiles no query of this rank reads: the kernels skip those anyway, and the
// results are the chunk ring's bits.
//
// Sends are zero-copy: one buffer per (tensor, row, kv head, range), matched one to one by the receiver.
#include <algorithm>
#include <array>
#include <string>
#include <vector>

#include "core/error.h"
#include "cp/ring_transport.h"
#include "cpu/attention.h"

namespace rf::cp::detail {
namespace {

// Received ranges start on plan-block boundaries; matching the kernels' key tile keeps their tiles aligned.
static_assert(kPlanBlock == cpu::kTileK, "the planned ring's bit-for-bit agreement needs plan blocks = key tiles");

// A received chunk: the ranges of one sender, compacted. k, v: [B, Hkv, n, D] in the input dtype; meta: [B, n].
struct Slot {
  std::vector<uint8_t> k, v;
  std::vector<TokenMeta> meta;
  int n = 0;
};

class PlannedTransport final : public KvTransport {
 public:
  PlannedTransport(comm::Communicator& comm, const CpShard& x, const MaskCommPlan& plan, comm::Timeout timeout,
                   Ledger& ledger)
      : comm_(comm),
        x_(x),
        plan_(plan),
        timeout_(timeout),
        ledger_(ledger),
        P_(comm.size()),
        r_(comm.rank()),
        row_bytes_(static_cast<size_t>(x.shape.D) * dtype_size(x.dtype)) {
    ledger_.hold(static_cast<int64_t>(2 * kv_bytes(x.shape.Lk) + meta_bytes(x.shape.Lk)));  // the own chunk
    for (int t = 1; t < P_; ++t)
      most_ = std::max({most_, tokens_in(t), static_cast<int>(plan_.recv_tokens(dest(t), r_))});
  }

  void post(int t) override {
    if (t <= 0 || t >= P_) return;
    const std::vector<TokenRange>& in = plan_.recv_ranges(r_, source(t));
    if (!in.empty()) {
      Slot& s = slots_[t % 2];
      s.n = tokens_in(t);
      ensure(s);
      std::vector<comm::RecvBuffer> bufs;
      for_each_piece(
          in, s.n,
          [&](const Piece& pc) {
            bufs.push_back({s.k.data() + pc.dst_kv, pc.kv_bytes});
            bufs.push_back({s.v.data() + pc.dst_kv, pc.kv_bytes});
          },
          [&](int b, int offset, const TokenRange& range) {
            bufs.push_back({s.meta.data() + static_cast<size_t>(b) * s.n + offset, range.size() * sizeof(TokenMeta)});
          });
      recv_ = comm_.irecv(source(t), tag(t, MsgKind::KeyValue), bufs, label(t, source(t)));
      ledger_.received(static_cast<int64_t>(2 * kv_bytes(s.n) + meta_bytes(s.n)));
    }
    const std::vector<TokenRange>& out = lent_ranges(t);
    if (!out.empty()) {
      const int n = static_cast<int>(plan_.recv_tokens(dest(t), r_));
      std::vector<comm::SendBuffer> bufs;
      const auto* k = static_cast<const uint8_t*>(x_.k);
      const auto* v = static_cast<const uint8_t*>(x_.v);
      for_each_piece(
          out, n,
          [&](const Piece& pc) {
            bufs.push_back({k + pc.src_kv, pc.kv_bytes});
            bufs.push_back({v + pc.src_kv, pc.kv_bytes});
          },
          [&](int b, int, const TokenRange& range) {
            bufs.push_back(
                {x_.meta + static_cast<int64_t>(b) * x_.shape.Lk + range.begin, range.size() * sizeof(TokenMeta)});
          });
      send_ = comm_.isend(dest(t), tag(t, MsgKind::KeyValue), bufs, label(t, r_));
      ledger_.sent(static_cast<int64_t>(2 * kv_bytes(n) + meta_bytes(n)));
    }
  }

  void complete() override {
    std::array<comm::RequestPtr, 2> reqs{std::move(recv_), std::move(send_)};
    comm::wait_all(reqs, timeout_);
  }

  StepKeys keys(int t) const override {
    if (t == 0) return {x_.k, x_.v, x_.meta, x_.shape.Lk};
    const int n = tokens_in(t);
    if (n == 0) return {};
    const Slot& s = slots_[t % 2];
    return {s.k.data(), s.v.data(), s.meta.data(), n};
  }

  const std::vector<TokenRange>& lent_ranges(int t) const override { return plan_.recv_ranges(dest(t), r_); }

  int most_tokens() const override { return most_; }

 private:
  // One (row, kv head, range) piece of a transfer: byte offsets in the owner's [B, Hkv, L, D] and in the
  // compacted [B, Hkv, n, D] layouts.
  struct Piece {
    size_t src_kv, dst_kv, kv_bytes;
  };

  int source(int t) const { return ring_source(r_, t, P_); }
  int dest(int t) const { return ring_dest(r_, t, P_); }
  // Tokens this rank receives at step t in [1, P).
  int tokens_in(int t) const { return static_cast<int>(plan_.recv_tokens(r_, source(t))); }

  // Calls kv(piece) for every (b, h, range) in row-major order, then meta(b, offset in the compacted row, range)
  // for every (b, range): the order both sides of a transfer list their buffers in.
  template <typename KvFn, typename MetaFn>
  void for_each_piece(const std::vector<TokenRange>& ranges, int n, KvFn kv, MetaFn meta) const {
    const int L = x_.shape.Lk;
    for (int b = 0; b < x_.shape.B; ++b)
      for (int h = 0; h < x_.shape.Hkv; ++h) {
        const size_t bh = static_cast<size_t>(b) * x_.shape.Hkv + h;
        int offset = 0;
        for (const TokenRange& range : ranges) {
          kv(Piece{(bh * L + range.begin) * row_bytes_, (bh * n + offset) * row_bytes_, range.size() * row_bytes_});
          offset += range.size();
        }
      }
    for (int b = 0; b < x_.shape.B; ++b) {
      int offset = 0;
      for (const TokenRange& range : ranges) {
        meta(b, offset, range);
        offset += range.size();
      }
    }
  }

  size_t kv_bytes(int n) const { return static_cast<size_t>(x_.shape.B) * x_.shape.Hkv * n * row_bytes_; }
  size_t meta_bytes(int n) const { return static_cast<size_t>(x_.shape.B) * n * sizeof(TokenMeta); }

  // A slot is sized once for the most any step brings, so the ledger counts two receive slots at most.
  void ensure(Slot& s) {
    if (!s.k.empty()) return;
    int most_in = 0;
    for (int t = 1; t < P_; ++t) most_in = std::max(most_in, tokens_in(t));
    s.k.resize(kv_bytes(most_in));
    s.v.resize(kv_bytes(most_in));
    s.meta.resize(static_cast<size_t>(x_.shape.B) * most_in);
    ledger_.hold(static_cast<int64_t>(2 * kv_bytes(most_in) + meta_bytes(most_in)));
  }

  std::string label(int t, int owner) const { return concat("K/V ranges of rank ", owner, " for planned step ", t); }

  comm::Communicator& comm_;
  const CpShard& x_;
  const MaskCommPlan& plan_;
  comm::Timeout timeout_;
  Ledger& ledger_;
  int P_, r_;
  size_t row_bytes_;  // one token of one kv head: D elements
  int most_ = 0;      // most_tokens()
  std::array<Slot, 2> slots_;
  comm::RequestPtr recv_, send_;
};

}  // namespace

std::unique_ptr<KvTransport> make_planned_transport(comm::Communicator& comm, const CpShard& x,
                                                    const MaskCommPlan& plan, comm::Timeout timeout, Ledger& ledger) {
  return std::make_unique<PlannedTransport>(comm, x, plan, timeout, ledger);
}

}  // namespace rf::cp::detail
