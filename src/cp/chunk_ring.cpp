// ringflex cp: the chunk ring's transport, the baseline (RingTraffic::Chunks; see ring_transport.h).
//
// Whole K/V chunks with their metadata travel rank to rank, r sends to r+1 and receives from r-1: at step t rank r
// holds the chunk of owner r - t. From the communication plan it takes only which rank reads which chunk, so a
// chunk travels just as far as its last reader and a rank computes only chunks its queries may read (causal
// contiguous shards never send keys "backwards"), but unlike the planned transport every hop carries the whole
// chunk and a chunk reaches its reader through every rank in between. Kept to measure the planned ring against.
//
// post(t) brings step t's chunk from r-1 into the free slot and passes the step t-1 chunk (in hand) on to r+1. A
// slot is reused as a receive target two steps after it was computed, by which time its send has completed.
#include <array>
#include <string>
#include <vector>

#include "core/error.h"
#include "cp/ring_transport.h"

namespace rf::cp::detail {
namespace {

// One K/V chunk with its metadata as it travels: k, v: [B, Hkv, L, D] in the input dtype; meta: [B, L].
struct ChunkSlot {
  std::vector<uint8_t> k, v;
  std::vector<TokenMeta> meta;
};

class ChunkTransport final : public KvTransport {
 public:
  ChunkTransport(comm::Communicator& comm, const CpShard& x, const MaskCommPlan& plan, comm::Timeout timeout,
                 Ledger& ledger)
      : comm_(comm),
        x_(x),
        timeout_(timeout),
        ledger_(ledger),
        P_(comm.size()),
        r_(comm.rank()),
        kv_bytes_(static_cast<size_t>(x.shape.kv_elems()) * dtype_size(x.dtype)),
        meta_count_(static_cast<size_t>(x.shape.B) * x.shape.Lk),
        need_(static_cast<size_t>(P_) * P_, 0),
        hops_(static_cast<size_t>(P_), 0),
        whole_chunk_{TokenRange{0, x.shape.Lk}} {
    for (int reader = 0; reader < P_; ++reader)
      for (int owner = 0; owner < P_; ++owner)
        need_[static_cast<size_t>(reader) * P_ + owner] = reader == owner || plan.recv_tokens(reader, owner) > 0;
    for (int owner = 0; owner < P_; ++owner)
      for (int d = 1; d < P_; ++d)
        if (needs(ring_dest(owner, d, P_), owner)) hops_[owner] = d;
    ledger_.hold(chunk_bytes());  // the own chunk
  }

  void post(int t) override {
    if (t <= 0 || t >= P_) return;
    const int next = ring_dest(r_, 1, P_), prev = ring_source(r_, 1, P_);
    if (holds(t)) {
      ChunkSlot& c = slot(t);
      const std::array<comm::RecvBuffer, 3> bufs{
          {{c.k.data(), kv_bytes_}, {c.v.data(), kv_bytes_}, {c.meta.data(), meta_count_ * sizeof(TokenMeta)}}};
      recv_ = comm_.irecv(prev, tag(t, MsgKind::KeyValue), bufs, label(t));
      ledger_.received(chunk_bytes());
    }
    if (hops_[owner(t - 1)] >= t) {
      const StepKeys c = chunk(t - 1);
      const std::array<comm::SendBuffer, 3> bufs{
          {{c.k, kv_bytes_}, {c.v, kv_bytes_}, {c.meta, meta_count_ * sizeof(TokenMeta)}}};
      send_ = comm_.isend(next, tag(t, MsgKind::KeyValue), bufs, label(t));
      ledger_.sent(chunk_bytes());
    }
  }

  void complete() override {
    std::array<comm::RequestPtr, 2> reqs{std::move(recv_), std::move(send_)};
    comm::wait_all(reqs, timeout_);
  }

  // The step-t chunk is computed when it is here and this rank's queries may read it.
  StepKeys keys(int t) const override { return holds(t) && needs(r_, owner(t)) ? chunk(t) : StepKeys{}; }

  // Rank r + t computes against this rank's whole chunk at step t when the chunk travels that far and it reads it.
  const std::vector<TokenRange>& lent_ranges(int t) const override {
    const int helper = ring_dest(r_, t, P_);
    return t > 0 && hops_[r_] >= t && needs(helper, r_) ? whole_chunk_ : no_ranges_;
  }

  int most_tokens() const override { return x_.shape.Lk; }

 private:
  int owner(int t) const { return ring_source(r_, t, P_); }
  bool needs(int reader, int owner) const { return need_[static_cast<size_t>(reader) * P_ + owner] != 0; }
  // The step-t chunk is here when it is this rank's own or travels at least t steps.
  bool holds(int t) const { return t == 0 || hops_[owner(t)] >= t; }

  StepKeys chunk(int t) const {
    if (t == 0) return {x_.k, x_.v, x_.meta, x_.shape.Lk};
    const ChunkSlot& c = slots_[t % 2];
    return {c.k.data(), c.v.data(), c.meta.data(), x_.shape.Lk};
  }

  // One chunk's K, V and metadata: what each slot holds and each transfer moves.
  int64_t chunk_bytes() const { return static_cast<int64_t>(2 * kv_bytes_ + meta_count_ * sizeof(TokenMeta)); }

  std::string label(int t) const { return concat("K/V of rank ", owner(t), " for ring step ", t); }

  ChunkSlot& slot(int t) {
    ChunkSlot& c = slots_[t % 2];
    if (c.k.empty()) {
      c.k.resize(kv_bytes_);
      c.v.resize(kv_bytes_);
      c.meta.resize(meta_count_);
      ledger_.hold(chunk_bytes());
    }
    return c;
  }

  comm::Communicator& comm_;
  const CpShard& x_;
  comm::Timeout timeout_;
  Ledger& ledger_;
  int P_, r_;
  size_t kv_bytes_;            // one of k, v: [B, Hkv, L, D] in the input dtype
  size_t meta_count_;          // meta: [B, L]
  std::vector<uint8_t> need_;  // [P reader, P owner]: some query of the reader may attend a key of the owner
  std::vector<int> hops_;      // [P owner]: how many ring steps the owner's chunk travels (0: stays home)
  const std::vector<TokenRange> whole_chunk_, no_ranges_;
  std::array<ChunkSlot, 2> slots_;
  comm::RequestPtr recv_, send_;
};

}  // namespace

std::unique_ptr<KvTransport> make_chunk_transport(comm::Communicator& comm, const CpShard& x, const MaskCommPlan& plan,
                                                  comm::Timeout timeout, Ledger& ledger) {
  return std::make_unique<ChunkTransport>(comm, x, plan, timeout, ledger);
}

}  // namespace rf::cp::detail
