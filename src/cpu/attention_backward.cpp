// ringflex cpu: the masked flash-attention backward for one query set against one K/V chunk, compiled once per
// ISA (isa_target.h; src/cpu/CMakeLists.txt).
//
// Scores are recomputed from the saved (merged) LSE: P = exp(scale·q.k - lse), dP = dO V^T,
// dS = P ⊙ (dP - delta) with delta = rowsum(dO ⊙ O) from attention_delta; then dV = P^T dO, dK = scale·dS^T Q,
// dQ = scale·dS K. Results are *added* to the caller's float32 gradients.
//
// Determinism. We run two passes, each writing disjoint outputs:
//   pass 1, parallel over (b, kv head, key tile): the item loops over every non-empty query tile and every query
//           head of the kv group in a fixed order and owns dK/dV of its key tile;
//   pass 2, parallel over (b, kv head, query tile, head chunk): the item loops over key tiles in order and owns
//           dQ of its rows.
// Every output element is therefore summed by one thread in an order fixed by the data, not by the schedule: the
// bits are identical run to run and for any thread count, with no atomics and no per-thread partial buffers.
// The price is recomputing S and dP in pass 2 (7 tile products instead of 5, so at best 5/7 of the forward's
// efficiency). The alternative — one pass over key tiles with dQ partials reduced in a fixed order — needs a
// partition of the key tiles fixed independently of the thread count (or it is not thread-count independent) and
// an [partitions, Lq, D] float32 buffer, which breaks the O(L) memory bound the ring relies on when partitions
// grow with the core count; the two-pass form keeps memory at O(tile) per thread and the argument trivial.
// GQA: both passes read each K/V tile once for all query heads of its group (dK/dV sum over those heads).
// bf16 inputs (dispatch.h kProd): all five products run on vdpbf16ps (Dpbf16) or AMX tiles (Amx); P and dS are
// formed in float32 exactly as on the other paths and rounded to bf16 (relative error <= 2^-8 per weight) only as
// the weights of dV, dK and dQ, whose sums stay float32.
#include <algorithm>
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

// kProd: the units bf16 inputs multiply on (isa.h); Widen for float32 inputs.
template <int kDp, DType kT, Bf16Product kProd>
void backward_impl(const AttnChunk& c, const void* dout, const float* lse, const float* delta, float* dq, float* dk,
                   float* dv) {
  static_assert(kT == DType::BF16 || kProd == Bf16Product::Widen, "float32 inputs run on float32 FMAs");
  constexpr bool kAmx = kProd == Bf16Product::Amx, kPairGrad = kBf16Pairs<kT, kProd>;
  const AttnShape& s = c.shape;
  using QK = ScoreOperand<kT, kProd>;  // element type of the packed abt operands
  const int D = s.D, Dp = kDp > 0 ? kDp : path_padded_dim<kT, kProd>(D), dr = pair_row<QK>(Dp);
  const int ld = row_stride(Dp), ds = pair_row<QK>(ld);  // strides of packed rows
  const int nqt = ceil_div(s.Lq, kTileQ), nkt = ceil_div(s.Lk, kTileK), group = s.group_size();
  const std::vector<BlockSummary> qsum = tile_summaries(c.q_meta, s.B, s.Lq, kTileQ);
  const std::vector<BlockSummary> ksum = tile_summaries(c.k_meta, s.B, s.Lk, kTileK);
  const float c2 = c.scale * kLog2e;
  const size_t esz = dtype_size(kT);
  const char* q = static_cast<const char*>(c.q);
  const char* go = static_cast<const char*>(dout);

  // Needed key tiles packed once for both passes: K^T and V^T as abt operands, K as acc's X for dQ += dS K
  // (float32 rows, or on kPairGrad pairs of keys).
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

  // ---- pass 1: dK, dV per key tile ----
  const int64_t items1 = int64_t{s.B} * s.Hkv * nkt;
#pragma omp parallel
  {
    const AmxTileScope amx_tiles(kAmx);
    const FlushDenormalsScope flush_denormals;  // fp_mode.h: no microcode assists on Intel cores
    std::vector<QK> qd(static_cast<size_t>(kTileQ) * ds), god(qd.size());
    std::vector<float> qf(kPairGrad ? 0 : static_cast<size_t>(kTileQ) * ld), gof(qf.size());
    std::vector<float> dk_acc(static_cast<size_t>(kTileK) * Dp), dv_acc(dk_acc.size());
    std::vector<float> sbuf(static_cast<size_t>(kTileQ) * kTileK), dpbuf(sbuf.size());
    std::vector<float> bias(kTileQ), dl(kTileQ);
    std::vector<RowBits> bits(kTileQ), live(kTileQ);  // live: bits of one head, less its rows with lse = -inf
    // kPairGrad: Q and dO as pairs of query rows [kTileQ / 2, ld] words (acc's X for dK and dV); P and dS rounded
    // to bf16 as pairs of queries, [kTileQ / 2, kTileK] words (vdpbf16ps reads them transposed in place) or on Amx
    // [kTileK, kTileQ / 2] (a tile's rows must run along the sum; pair_cols is the transpose's source);
    // acc_masked_pairs' scratch.
    const size_t pair_words = kPairGrad ? static_cast<size_t>(kTileQ / 2) * ld : 0;
    std::vector<uint32_t> qx(pair_words), gox(pair_words), scratch(pair_words);
    std::vector<uint32_t> p_pairs(kPairGrad ? kTileQ / 2 * kTileK : 0), ds_pairs(p_pairs.size());
    std::vector<uint32_t> pair_cols(kAmx ? p_pairs.size() : 0);

#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items1; ++item) {
      const int kt = static_cast<int>(item % nkt);
      const int g = static_cast<int>(item / nkt % s.Hkv);
      const int b = static_cast<int>(item / nkt / s.Hkv);
      const int k0 = kt * kTileK, nk = std::min(kTileK, s.Lk - k0);
      const BlockSummary& ks = ksum[static_cast<size_t>(b) * nkt + kt];
      const int64_t kv_row0 = (int64_t{b} * s.Hkv + g) * s.Lk + k0;  // dk, dv: [B, Hkv, Lk, D]
      if (!needed[static_cast<size_t>(b) * nkt + kt]) continue;      // no query reads this key tile
      const QK* kt_buf = k_cols.get() + static_cast<size_t>(item) * dr * kTileK;
      const QK* vt_buf = v_cols.get() + static_cast<size_t>(item) * dr * kTileK;
      std::fill(dk_acc.begin(), dk_acc.end(), 0.f);
      std::fill(dv_acc.begin(), dv_acc.end(), 0.f);

      for (int qt = 0; qt < nqt; ++qt) {
        const BlockClass cls = classify(c.mask, qsum[static_cast<size_t>(b) * nqt + qt], ks);
        if (cls == BlockClass::Empty) continue;
        const int q0 = qt * kTileQ, nq = std::min(kTileQ, s.Lq - q0);
        tile_bits(cls, c.mask, c.q_meta + int64_t{b} * s.Lq + q0, nq, c.k_meta + int64_t{b} * s.Lk + k0, nk,
                  bits.data());
        for (int hh = 0; hh < group; ++hh) {
          const int64_t row0 = (int64_t{b} * s.Hq + g * group + hh) * s.Lq + q0;  // q, dout: [B, Hq, Lq, D]
          pack_rows_dot<kT, QK>(q + row0 * D * esz, nq, D, Dp, ds, qd.data());
          pack_rows_dot<kT, QK>(go + row0 * D * esz, nq, D, Dp, ds, god.data());
          // The acc products read float32 rows (for float32 inputs the dot operands already are those rows), or on
          // kPairGrad pairs of rows.
          const float* qrows = qf.data();
          const float* gorows = gof.data();
          if constexpr (std::is_same_v<QK, float>) {
            qrows = qd.data();
            gorows = god.data();
          } else if constexpr (kPairGrad) {
            pack_pair_rows(q + row0 * D * esz, nq, D, Dp, ld, kTileQ / 2, qx.data());
            pack_pair_rows(go + row0 * D * esz, nq, D, Dp, ld, kTileQ / 2, gox.data());
          } else {
            pack_rows_f32<kT>(q + row0 * D * esz, nq, D, Dp, ld, qf.data());
            pack_rows_f32<kT>(go + row0 * D * esz, nq, D, Dp, ld, gof.data());
          }
          row_terms(lse, delta, row0, nq, bias.data(), dl.data());
          score_tile<kDp, kProd>(qd.data(), ds, kt_buf, Dp, nq, sbuf.data());
          score_tile<kDp, kProd>(god.data(), ds, vt_buf, Dp, nq, dpbuf.data());
          const bool dropped =
              grad_step(sbuf.data(), dpbuf.data(), nq, bits.data(), c2, bias.data(), dl.data(), c.scale, live.data());
          const BlockClass acc_cls = dropped ? BlockClass::Partial : cls;
#if RF_ISA_AVX512
          if constexpr (kPairGrad) {
            // dV += P^T dO and dK += dS^T Q with the weights as pairs of queries: a key's weights along a row on
            // Amx (ars kTileQ / 2, ams 1), transposed in place for vdpbf16ps (ars 1, ams kTileK).
            if constexpr (kAmx) {
              weights_to_key_rows(sbuf.data(), nq, pair_cols.data(), p_pairs.data());
              weights_to_key_rows(dpbuf.data(), nq, pair_cols.data(), ds_pairs.data());
            } else {
              weights_to_pair_cols(sbuf.data(), nq, p_pairs.data());
              weights_to_pair_cols(dpbuf.data(), nq, ds_pairs.data());
            }
            const int ars = kAmx ? kTileQ / 2 : 1, ams = kAmx ? 1 : kTileK;
            acc_masked_pairs<kDp, false, kAmx>(acc_cls, p_pairs.data(), ars, ams, nq, gox.data(), ld, Dp, nk,
                                               live.data(), scratch.data(), dv_acc.data());
            acc_masked_pairs<kDp, false, kAmx>(acc_cls, ds_pairs.data(), ars, ams, nq, qx.data(), ld, Dp, nk,
                                               live.data(), scratch.data(), dk_acc.data());
            continue;
          }
#endif
          // dV += P^T dO and dK += dS^T Q read P and dS transposed in place (row stride 1, sum stride kTileK).
          acc_masked<kDp, false>(acc_cls, sbuf.data(), 1, kTileK, nq, gorows, ld, Dp, nk, live.data(), dv_acc.data());
          acc_masked<kDp, false>(acc_cls, dpbuf.data(), 1, kTileK, nq, qrows, ld, Dp, nk, live.data(), dk_acc.data());
        }
      }
      for (int j = 0; j < nk; ++j)
        for (int d = 0; d < D; ++d) {
          dk[(kv_row0 + j) * D + d] += dk_acc[static_cast<size_t>(j) * Dp + d];
          dv[(kv_row0 + j) * D + d] += dv_acc[static_cast<size_t>(j) * Dp + d];
        }
    }
  }

  // ---- pass 2: dQ per query tile and head chunk ----
  const QueryItems query_items(s, Dp);
  const int hpi = query_items.heads_per_item;
  const int64_t items2 = query_items.count(s.B);
#pragma omp parallel
  {
    const AmxTileScope amx_tiles(kAmx);
    const FlushDenormalsScope flush_denormals;  // fp_mode.h: no microcode assists on Intel cores
    std::vector<QK> qd(static_cast<size_t>(hpi) * kTileQ * ds), god(qd.size());
    std::vector<float> dq_acc(static_cast<size_t>(hpi) * kTileQ * Dp);
    std::vector<float> sbuf(static_cast<size_t>(kTileQ) * kTileK), dpbuf(sbuf.size());
    std::vector<float> bias(static_cast<size_t>(hpi) * kTileQ), dl(bias.size());
    std::vector<RowBits> bits(kTileQ), live(kTileQ);  // live: bits of one head, less its rows with lse = -inf
    // kPairGrad: dS rounded to bf16 as pairs of keys [kTileQ, kTileK / 2] words, and acc_masked_pairs' scratch.
    std::vector<uint32_t> ds_pairs(kPairGrad ? kTileQ * kTileK / 2 : 0), scratch(kPairGrad ? (kTileK / 2) * ld : 0);

#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items2; ++item) {
      const auto [b, g, qt, h0, nh, q0, nq] = query_items[item];
      const BlockSummary& qs = qsum[static_cast<size_t>(b) * nqt + qt];
      for (int hh = 0; hh < nh; ++hh) {
        const int64_t row0 = (int64_t{b} * s.Hq + h0 + hh) * s.Lq + q0;
        const size_t r0 = static_cast<size_t>(hh) * kTileQ;
        pack_rows_dot<kT, QK>(q + row0 * D * esz, nq, D, Dp, ds, qd.data() + r0 * ds);
        pack_rows_dot<kT, QK>(go + row0 * D * esz, nq, D, Dp, ds, god.data() + r0 * ds);
        row_terms(lse, delta, row0, nq, bias.data() + r0, dl.data() + r0);
      }
      std::fill(dq_acc.begin(), dq_acc.end(), 0.f);
      bool touched = false;

      const int64_t kv_head = int64_t{b} * s.Hkv + g;
      for (int kt = 0; kt < nkt; ++kt) {
        const BlockClass cls = classify(c.mask, qs, ksum[static_cast<size_t>(b) * nkt + kt]);
        if (cls == BlockClass::Empty) continue;
        touched = true;
        const int k0 = kt * kTileK, nk = std::min(kTileK, s.Lk - k0);
        tile_bits(cls, c.mask, c.q_meta + int64_t{b} * s.Lq + q0, nq, c.k_meta + int64_t{b} * s.Lk + k0, nk,
                  bits.data());
        const size_t tile = static_cast<size_t>(kv_head) * nkt + kt;
        const QK* kt_buf = k_cols.get() + tile * dr * kTileK;
        const QK* vt_buf = v_cols.get() + tile * dr * kTileK;
        for (int hh = 0; hh < nh; ++hh) {
          const size_t r0 = static_cast<size_t>(hh) * kTileQ;
          score_tile<kDp, kProd>(qd.data() + r0 * ds, ds, kt_buf, Dp, nq, sbuf.data());
          score_tile<kDp, kProd>(god.data() + r0 * ds, ds, vt_buf, Dp, nq, dpbuf.data());
          const bool dropped = grad_step(sbuf.data(), dpbuf.data(), nq, bits.data(), c2, bias.data() + r0,
                                         dl.data() + r0, c.scale, live.data());
          const BlockClass acc_cls = dropped ? BlockClass::Partial : cls;
#if RF_ISA_AVX512
          if constexpr (kPairGrad) {
            weights_to_pair_rows(dpbuf.data(), nq, ds_pairs.data());
            acc_masked_pairs<kDp, true, kAmx>(acc_cls, ds_pairs.data(), kTileK / 2, 1, nk,
                                              k_pairs.get() + tile * (kTileK / 2) * ld, ld, Dp, nq, live.data(),
                                              scratch.data(), dq_acc.data() + r0 * Dp);
            continue;
          }
#endif
          acc_masked<kDp, true>(acc_cls, dpbuf.data(), kTileK, 1, nk, k_rows.get() + tile * kTileK * ld, ld, Dp, nq,
                                live.data(), dq_acc.data() + r0 * Dp);
        }
      }
      if (!touched) continue;
      for (int hh = 0; hh < nh; ++hh)
        for (int i = 0; i < nq; ++i) {
          const int64_t row = (int64_t{b} * s.Hq + h0 + hh) * s.Lq + q0 + i;  // dq: [B, Hq, Lq, D]
          const float* src = dq_acc.data() + (static_cast<size_t>(hh) * kTileQ + i) * Dp;
          for (int d = 0; d < D; ++d) dq[row * D + d] += src[d];
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
