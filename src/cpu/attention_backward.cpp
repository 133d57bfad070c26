// ringflex cpu: the masked flash-attention backward for one query set against one K/V chunk, compiled once per
// ISA (isa_target.h; src/cpu/CMakeLists.txt).
//
// Scores are recomputed from the saved (merged) LSE: P = exp(scale·q.k - lse), dP = dO V^T,
// dS = P ⊙ (dP - delta) with delta = rowsum(dO ⊙ O) from attention_delta; then dV = P^T dO, dK = scale·dS^T Q,
// dQ = scale·dS K. Results are *added* to the caller's float32 gradients.
//
// One pass, parallel over items (b, kv head g, key tile kt): an item visits every query tile that reads its key
// tile (classify != Empty), in increasing order, and every query head of the kv group; per (query tile, head) it
// forms S and dP (two score products), P and dS, then dV += P^T dO, dK += dS^T Q and dQ_kt = dS K (three
// accumulating products): the 5 tile products of the math, against the forward's 2.
// Determinism. dK and dV of a key tile are owned by its item and summed over query tiles and heads in a fixed
// order. dQ is summed across items: each item forms its contribution dS K in a per-thread tile and adds it to dq
// in increasing kt — before adding to query tile qt, an item waits until the previous key tile that reads qt
// (the same classification, so a fixed list) has added its own (DqOrder below). Every output element is therefore
// summed in an order fixed by the data, never by the schedule: the bits are identical run to run and for any
// thread count, with no per-thread partial buffers (memory stays O(tile) per thread beyond the packed K/V tiles),
// and a key range's contribution does not depend on how the ring cut it into chunks, only on its tiles. The
// waits form a pipeline along the key tiles of one kv head: an item waits only when it catches up with the one
// before it (one thread never waits).
// (The previous scheme ran a second pass per query tile for dQ, recomputing S and dP: 7 products, at best 5/7 of
// the forward's rate; fixed key partitions with dQ partials would cost a [partitions, Lq, D] buffer.)
// GQA: an item reads its K/V tile once for all query heads of its group (dK/dV sum over those heads).
// bf16 inputs (dispatch.h kProd): all five products run on vdpbf16ps (Dpbf16) or AMX tiles (Amx); P and dS are
// formed in float32 exactly as on the other paths and rounded to bf16 (relative error <= 2^-8 per weight) only as
// the weights of dV, dK and dQ, whose sums stay float32.
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "core/error.h"
#include "cpu/attention.h"
#include "cpu/dispatch.h"
#include "cpu/fp_mode.h"
#include "cpu/isa_target.h"
#include "cpu/tiles.h"

RF_ISA_BEGIN
namespace rf::cpu::RF_ISA_NS {

namespace {

using namespace detail;

// Per-row constants of the recompute: bias = lse·log2(e) (+inf for an empty row so every p is 0), delta. A NaN
// lse (a row that read a non-finite score) gives NaN p on every pair the row reads, as the math does.
// lse, delta: [rows] starting at `row0`.
inline void row_terms(const float* lse, const float* delta, int64_t row0, int n, float* bias, float* dl) {
  for (int i = 0; i < n; ++i) {
    const float x = lse[row0 + i];
    bias[i] = x == -kInf ? kInf : x * kLog2e;
    dl[i] = delta[row0 + i];
  }
}

// The order in which the key tiles of one (row b, kv head g) add their dQ contributions to a query tile qt: every
// key tile that reads qt (classify != Empty) adds after the previous such tile, so dq[qt's rows] is summed in
// increasing kt whatever thread runs which key tile. done[item] counts the query tiles item (b, g, kt) has
// finished adding (they are visited in increasing qt, so "has added qt" is done > qt). Items are claimed in
// increasing order and wait only on earlier items of their own chain, which some thread is already running or has
// finished, so the waits always end.
class DqOrder {
 public:
  explicit DqOrder(int64_t items) : done_(new std::atomic<int>[static_cast<size_t>(items)]) {
    for (int64_t i = 0; i < items; ++i) done_[i].store(0, std::memory_order_relaxed);
  }

  // Waits until item `prev` has added its dQ of query tile qt; its writes to dq are then visible here.
  void wait(int64_t prev, int qt) const {
    while (done_[prev].load(std::memory_order_acquire) <= qt) std::this_thread::yield();
  }

  // Item `item` has added its dQ of query tile qt (its writes to dq are published with this store).
  void added(int64_t item, int qt) { done_[item].store(qt + 1, std::memory_order_release); }

 private:
  std::unique_ptr<std::atomic<int>[]> done_;
};

// The nearest key tile before kt that reads the query tile of summary qs, or -1. ksum: the row's [nkt] summaries.
inline int previous_reader(const LayerMask& mask, const BlockSummary& qs, const BlockSummary* ksum, int kt) {
  for (int j = kt - 1; j >= 0; --j)
    if (classify(mask, qs, ksum[j]) != BlockClass::Empty) return j;
  return -1;
}

// kProd: the units bf16 inputs multiply on (isa.h); Widen for float32 inputs.
template <int kDp, DType kT, Bf16Product kProd>
void backward_impl(const AttnChunk& c, const void* dout, const float* lse, const float* delta, float* dq, float* dk,
                   float* dv) {
  static_assert(kT == DType::BF16 || kProd == Bf16Product::Widen, "float32 inputs run on float32 FMAs");
  constexpr bool kAmx = kProd == Bf16Product::Amx, kPairGrad = kBf16Pairs<kT, kProd>;
  const AttnShape& s = c.shape;
  using QK = ScoreOperand<kT, kProd>;  // element type of the packed abt operands
  static_assert(kPairGrad || std::is_same_v<QK, float>, "without pairs the dot operands are float32 rows");
  const int D = s.D, Dp = kDp > 0 ? kDp : path_padded_dim<kT, kProd>(D), dr = pair_row<QK>(Dp);
  const int ld = row_stride(Dp), ds = pair_row<QK>(ld);  // strides of packed rows
  const int nqt = ceil_div(s.Lq, kTileQ), nkt = ceil_div(s.Lk, kTileK), group = s.group_size();
  const std::vector<BlockSummary> qsum = tile_summaries(c.q_meta, s.B, s.Lq, kTileQ);
  const std::vector<BlockSummary> ksum = tile_summaries(c.k_meta, s.B, s.Lk, kTileK);
  const float c2 = c.scale * kLog2e;
  const size_t esz = dtype_size(kT);
  const char* q = static_cast<const char*>(c.q);
  const char* go = static_cast<const char*>(dout);

  // Needed key tiles packed once: K^T and V^T as abt operands, K as acc's X for dQ += dS K (float32 rows, or on
  // kPairGrad pairs of keys).
  const std::vector<uint8_t> needed = needed_key_tiles(c.mask, qsum, ksum, s.B, nqt, nkt);
  const size_t kv_tiles = static_cast<size_t>(s.B) * s.Hkv * nkt;
  const auto k_cols = uninitialized<QK>(kv_tiles * dr * kTileK);                     // [B, Hkv, nkt, dr, kTileK]
  const auto v_cols = uninitialized<QK>(kv_tiles * dr * kTileK);                     // [B, Hkv, nkt, dr, kTileK]
  const auto k_rows = uninitialized<float>(kPairGrad ? 0 : kv_tiles * kTileK * ld);  // [.., kTileK, ld]
  const auto k_pairs = uninitialized<uint32_t>(kPairGrad ? kv_tiles * (kTileK / 2) * ld : 0);  // [.., kTileK/2, ld]
  pack_key_tiles<kT, QK>(c.k, c.v, s, Dp, needed,
                         {.k_cols = k_cols.get(),
                          .k_rows = kPairGrad ? nullptr : k_rows.get(),
                          .k_pairs = kPairGrad ? k_pairs.get() : nullptr,
                          .v_cols = v_cols.get()});

  // One pass over items (b, kv head g, key tile kt), item = (b·Hkv + g)·nkt + kt, claimed in increasing order.
  const int64_t items = static_cast<int64_t>(kv_tiles);
  std::atomic<int64_t> next_item{0};
  DqOrder order(items);
#pragma omp parallel
  {
    const AmxTileScope amx_tiles(kAmx);
    const FlushDenormalsScope flush_denormals;  // fp_mode.h: no microcode assists on Intel cores
    std::vector<QK> qd(static_cast<size_t>(kTileQ) * ds), god(qd.size());
    std::vector<float> dk_acc(static_cast<size_t>(kTileK) * Dp), dv_acc(dk_acc.size());
    std::vector<float> dq_tile(static_cast<size_t>(kTileQ) * Dp);  // one head's dS K for this key tile
    std::vector<float> sbuf(static_cast<size_t>(kTileQ) * kTileK), dpbuf(sbuf.size());
    std::vector<float> bias(kTileQ), dl(kTileQ);
    std::vector<RowBits> bits(kTileQ), live(kTileQ);  // live: bits of one head, less its rows with lse = -inf
    // kPairGrad: Q and dO as pairs of query rows [kTileQ / 2, ld] words (acc's X for dK and dV); P and dS rounded
    // to bf16 as pairs of queries, [kTileQ / 2, kTileK] words (vdpbf16ps reads them transposed in place) or on Amx
    // [kTileK, kTileQ / 2] (a tile's rows must run along the sum; pair_cols is the transpose's source); dS as pairs
    // of keys [kTileQ, kTileK / 2] words for dQ; acc_masked_pairs' scratch (kTileQ == kTileK: one size serves
    // both sums).
    static_assert(kTileQ == kTileK, "one scratch serves the sums over queries and over keys");
    const size_t pair_words = kPairGrad ? static_cast<size_t>(kTileQ / 2) * ld : 0;
    std::vector<uint32_t> qx(pair_words), gox(pair_words), scratch(pair_words);
    std::vector<uint32_t> p_pairs(kPairGrad ? kTileQ / 2 * kTileK : 0), ds_pairs(p_pairs.size());
    std::vector<uint32_t> ds_rows(p_pairs.size()), pair_cols(kAmx ? p_pairs.size() : 0);

    for (int64_t item = next_item.fetch_add(1, std::memory_order_relaxed); item < items;
         item = next_item.fetch_add(1, std::memory_order_relaxed)) {
      const int kt = static_cast<int>(item % nkt);
      const int g = static_cast<int>(item / nkt % s.Hkv);
      const int b = static_cast<int>(item / nkt / s.Hkv);
      if (!needed[static_cast<size_t>(b) * nkt + kt]) continue;  // no query reads this key tile
      const int k0 = kt * kTileK, nk = std::min(kTileK, s.Lk - k0);
      const BlockSummary* ksum_b = ksum.data() + static_cast<size_t>(b) * nkt;
      const int64_t kv_row0 = (int64_t{b} * s.Hkv + g) * s.Lk + k0;  // dk, dv: [B, Hkv, Lk, D]
      const QK* kt_buf = k_cols.get() + static_cast<size_t>(item) * dr * kTileK;
      const QK* vt_buf = v_cols.get() + static_cast<size_t>(item) * dr * kTileK;
      std::fill(dk_acc.begin(), dk_acc.end(), 0.f);
      std::fill(dv_acc.begin(), dv_acc.end(), 0.f);

      for (int qt = 0; qt < nqt; ++qt) {
        const BlockSummary& qs = qsum[static_cast<size_t>(b) * nqt + qt];
        const BlockClass cls = classify(c.mask, qs, ksum_b[kt]);
        if (cls == BlockClass::Empty) continue;
        const int q0 = qt * kTileQ, nq = std::min(kTileQ, s.Lq - q0);
        tile_bits(cls, c.mask, c.q_meta + int64_t{b} * s.Lq + q0, nq, c.k_meta + int64_t{b} * s.Lk + k0, nk,
                  bits.data());
        bool in_order = false;  // whether the previous reader of qt has added its dQ
        for (int hh = 0; hh < group; ++hh) {
          const int64_t row0 = (int64_t{b} * s.Hq + g * group + hh) * s.Lq + q0;  // q, dout, dq: [B, Hq, Lq, D]
          pack_rows_dot<kT, QK>(q + row0 * D * esz, nq, D, Dp, ds, qd.data());
          pack_rows_dot<kT, QK>(go + row0 * D * esz, nq, D, Dp, ds, god.data());
          row_terms(lse, delta, row0, nq, bias.data(), dl.data());
          score_tile<kDp, kProd>(qd.data(), ds, kt_buf, Dp, nq, sbuf.data());
          score_tile<kDp, kProd>(god.data(), ds, vt_buf, Dp, nq, dpbuf.data());
          const bool dropped =
              grad_step(sbuf.data(), dpbuf.data(), nq, bits.data(), c2, bias.data(), dl.data(), c.scale, live.data());
          const BlockClass acc_cls = dropped ? BlockClass::Partial : cls;
          std::fill(dq_tile.begin(), dq_tile.begin() + static_cast<ptrdiff_t>(nq) * Dp, 0.f);
#if RF_ISA_AVX512
          if constexpr (kPairGrad) {
            // dV += P^T dO and dK += dS^T Q with the weights as pairs of queries: a key's weights along a row on
            // Amx (ars kTileQ / 2, ams 1), transposed in place for vdpbf16ps (ars 1, ams kTileK); dQ = dS K with
            // them as pairs of keys.
            pack_pair_rows(q + row0 * D * esz, nq, D, Dp, ld, kTileQ / 2, qx.data());
            pack_pair_rows(go + row0 * D * esz, nq, D, Dp, ld, kTileQ / 2, gox.data());
            if constexpr (kAmx) {
              weights_to_key_rows(sbuf.data(), nq, pair_cols.data(), p_pairs.data());
              weights_to_key_rows(dpbuf.data(), nq, pair_cols.data(), ds_pairs.data());
            } else {
              weights_to_pair_cols(sbuf.data(), nq, p_pairs.data());
              weights_to_pair_cols(dpbuf.data(), nq, ds_pairs.data());
            }
            weights_to_pair_rows(dpbuf.data(), nq, ds_rows.data());
            const int ars = kAmx ? kTileQ / 2 : 1, ams = kAmx ? 1 : kTileK;
            acc_masked_pairs<kDp, false, kAmx>(acc_cls, p_pairs.data(), ars, ams, nq, gox.data(), ld, Dp, nk,
                                               live.data(), scratch.data(), dv_acc.data());
            acc_masked_pairs<kDp, false, kAmx>(acc_cls, ds_pairs.data(), ars, ams, nq, qx.data(), ld, Dp, nk,
                                               live.data(), scratch.data(), dk_acc.data());
            acc_masked_pairs<kDp, true, kAmx>(acc_cls, ds_rows.data(), kTileK / 2, 1, nk,
                                              k_pairs.get() + static_cast<size_t>(item) * (kTileK / 2) * ld, ld, Dp, nq,
                                              live.data(), scratch.data(), dq_tile.data());
          }
#endif
          if constexpr (!kPairGrad) {
            // dV += P^T dO and dK += dS^T Q read P and dS transposed in place (row stride 1, sum stride kTileK);
            // the packed Q and dO rows are acc's X.
            acc_masked<kDp, false>(acc_cls, sbuf.data(), 1, kTileK, nq, god.data(), ld, Dp, nk, live.data(),
                                   dv_acc.data());
            acc_masked<kDp, false>(acc_cls, dpbuf.data(), 1, kTileK, nq, qd.data(), ld, Dp, nk, live.data(),
                                   dk_acc.data());
            acc_masked<kDp, true>(acc_cls, dpbuf.data(), kTileK, 1, nk,
                                  k_rows.get() + static_cast<size_t>(item) * kTileK * ld, ld, Dp, nq, live.data(),
                                  dq_tile.data());
          }
          if (!in_order) {
            const int prev = previous_reader(c.mask, qs, ksum_b, kt);
            if (prev >= 0) order.wait(item - (kt - prev), qt);
            in_order = true;
          }
          for (int i = 0; i < nq; ++i) {
            float* dst = dq + (row0 + i) * D;
            const float* src = dq_tile.data() + static_cast<size_t>(i) * Dp;
            for (int d = 0; d < D; ++d) dst[d] += src[d];
          }
        }
        order.added(item, qt);
      }
      for (int j = 0; j < nk; ++j)
        for (int d = 0; d < D; ++d) {
          dk[(kv_row0 + j) * D + d] += dk_acc[static_cast<size_t>(j) * Dp + d];
          dv[(kv_row0 + j) * D + d] += dv_acc[static_cast<size_t>(j) * Dp + d];
        }
    }
  }
}

}  // namespace

void backward(const AttnChunk& c, Bf16Product bf16, const void* dout, const float* lse, const float* delta, float* dq,
              float* dk, float* dv) {
  dispatch(c.shape.D, c.dtype, bf16, [&]<int kDp, DType kT, Bf16Product kProd>() {
    backward_impl<kDp, kT, kProd>(c, dout, lse, delta, dq, dk, dv);
  });
}

}  // namespace rf::cpu::RF_ISA_NS
RF_ISA_END
