// ringflex cpu: the masked flash-attention forward for one query set against one K/V chunk, compiled once per ISA
// (isa_target.h; src/cpu/CMakeLists.txt).
//
// Loop structure. A work item is (row b, kv head g, query tile qt, a chunk of the query heads of group g); the
// items are independent and run under OpenMP (dynamic schedule: causal and windowed items differ in work).
// Inside an item, for each key tile the pair (qt, kt) is classified from block summaries: Empty is skipped with
// no work at all, Full runs without the predicate, Partial evaluates rf::allowed once per pair into 64-bit row
// masks shared by all heads of the item. K tiles are packed transposed (and V as float32) once per call, then every
// query head of the chunk runs S = Q K^T, the online-softmax step and O += P V against it while it is in cache —
// GQA without copying K/V per query head. Scores, the running max/sum and O accumulate in float32; the
// softmax runs in log2 units (scale·log2 e folded into one multiply) with the vector exp2 of microkernels.h.
// bf16 inputs (dispatch.h kProd, isa.h Bf16Product): widened to float32 while packing (Widen); or Q and K^T packed
// as bf16 pairs with S = Q K^T on vdpbf16ps (Dpbf16) or AMX tiles (Amx), exact products summed in float32, and
// O += P V on the same units: P, computed in float32, is rounded to bf16 (relative error <= 2^-8 per weight; the
// row sum l and the LSE use the float32 P), V packed as pairs of keys; O accumulates in float32.
// Memory: the packed K/V tiles (O(Lk · Dp), like the inputs) plus O(kTileQ · Dp · heads) per thread — never an
// [Lq, Lk] score or mask matrix.
#include <algorithm>
#include <cmath>
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

// kProd: the units bf16 inputs multiply on (isa.h); Widen for float32 inputs. The online softmax, l, m and the O
// accumulator are float32 on every path.
template <int kDp, DType kT, Bf16Product kProd>
void forward_impl(const AttnChunk& c, float* o, float* lse) {
  static_assert(kT == DType::BF16 || kProd == Bf16Product::Widen, "float32 inputs run on float32 FMAs");
  constexpr bool kAmx = kProd == Bf16Product::Amx, kPairPV = kBf16Pairs<kT, kProd>;
  using QK = ScoreOperand<kT, kProd>;  // element type of the packed Q and K^T operands
  const AttnShape& s = c.shape;
  const int D = s.D, Dp = kDp > 0 ? kDp : path_padded_dim<kT, kProd>(D), dr = pair_row<QK>(Dp);
  const int ld = row_stride(Dp), ds = pair_row<QK>(ld);  // strides of packed rows
  RF_ASSERT((Dp == path_padded_dim<kT, kProd>(D)));
  const int nqt = ceil_div(s.Lq, kTileQ), nkt = ceil_div(s.Lk, kTileK);
  const QueryItems query_items(s, Dp);
  const int hpi = query_items.heads_per_item;
  const std::vector<BlockSummary> qsum = tile_summaries(c.q_meta, s.B, s.Lq, kTileQ);
  const std::vector<BlockSummary> ksum = tile_summaries(c.k_meta, s.B, s.Lk, kTileK);
  const float c2 = c.scale * kLog2e;
  const size_t esz = dtype_size(kT);
  const int64_t items = query_items.count(s.B);
  const std::vector<uint8_t> needed = needed_key_tiles(c.mask, qsum, ksum, s.B, nqt, nkt);
  const size_t kv_tiles = static_cast<size_t>(s.B) * s.Hkv * nkt;
  const auto k_cols = uninitialized<QK>(kv_tiles * dr * kTileK);  // K^T tiles: [B, Hkv, nkt, dr, kTileK]
  // V tiles, float32 rows [B, Hkv, nkt, kTileK, ld] or (kPairPV) pairs of keys [B, Hkv, nkt, kTileK / 2, ld].
  const auto v_rows = uninitialized<float>(kPairPV ? 0 : kv_tiles * kTileK * ld);
  const auto v_pairs = uninitialized<uint32_t>(kPairPV ? kv_tiles * (kTileK / 2) * ld : 0);
  pack_key_tiles<kT, QK>(c.k, c.v, s, Dp, needed,
                         {.k_cols = k_cols.get(),
                          .v_rows = kPairPV ? nullptr : v_rows.get(),
                          .v_pairs = kPairPV ? v_pairs.get() : nullptr});

#pragma omp parallel
  {
    const AmxTileScope amx_tiles(kAmx);
    const FlushDenormalsScope flush_denormals;  // fp_mode.h: no microcode assists on Intel cores
    // Per-thread tile buffers, reused by every item the thread runs. qbuf holds whole kTileQ-row tiles per head,
    // so amx_abt may read rows past nq (rows of an earlier item; their scores are never used).
    std::vector<QK> qbuf(static_cast<size_t>(hpi) * kTileQ * ds);
    std::vector<float> obuf(static_cast<size_t>(hpi) * kTileQ * Dp);
    std::vector<float> sbuf(static_cast<size_t>(kTileQ) * kTileK), m(static_cast<size_t>(hpi) * kTileQ);
    std::vector<float> l(m.size());
    std::vector<RowBits> bits(kTileQ);
    // kPairPV: P rounded to bf16 as pairs of keys, [kTileQ, kTileK / 2] words, and acc_masked_pairs' scratch.
    std::vector<uint32_t> pbuf(kPairPV ? kTileQ * kTileK / 2 : 0), scratch(kPairPV ? (kTileK / 2) * ld : 0);

#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const auto [b, g, qt, h0, nh, q0, nq] = query_items[item];
      const BlockSummary& qs = qsum[static_cast<size_t>(b) * nqt + qt];

      // Query rows of head h0 + hh live at qbuf[hh · kTileQ · ds]; q: [B, Hq, Lq, D].
      for (int hh = 0; hh < nh; ++hh) {
        const int64_t row0 = (int64_t{b} * s.Hq + h0 + hh) * s.Lq + q0;
        pack_rows_dot<kT, QK>(static_cast<const char*>(c.q) + row0 * D * esz, nq, D, Dp, ds,
                              qbuf.data() + static_cast<size_t>(hh) * kTileQ * ds);
      }
      std::fill(obuf.begin(), obuf.end(), 0.f);
      std::fill(m.begin(), m.end(), -kInf);
      std::fill(l.begin(), l.end(), 0.f);

      const int64_t kv_head = int64_t{b} * s.Hkv + g;
      for (int kt = 0; kt < nkt; ++kt) {
        const BlockClass cls = classify(c.mask, qs, ksum[static_cast<size_t>(b) * nkt + kt]);
        if (cls == BlockClass::Empty) continue;
        const int k0 = kt * kTileK, nk = std::min(kTileK, s.Lk - k0);
        tile_bits(cls, c.mask, c.q_meta + int64_t{b} * s.Lq + q0, nq, c.k_meta + int64_t{b} * s.Lk + k0, nk,
                  bits.data());
        const size_t tile = static_cast<size_t>(kv_head) * nkt + kt;
        const QK* kt_buf = k_cols.get() + tile * dr * kTileK;
        for (int hh = 0; hh < nh; ++hh) {
          const size_t r0 = static_cast<size_t>(hh) * kTileQ;
          float* orow = obuf.data() + r0 * Dp;
          score_tile<kDp, kProd>(qbuf.data() + r0 * ds, ds, kt_buf, Dp, nq, sbuf.data());
          softmax_step(sbuf.data(), nq, bits.data(), c2, m.data() + r0, l.data() + r0, orow, Dp);
#if RF_ISA_AVX512
          if constexpr (kPairPV) {
            weights_to_pair_rows(sbuf.data(), nq, pbuf.data());
            acc_masked_pairs<kDp, true, kAmx>(cls, pbuf.data(), kTileK / 2, 1, nk,
                                              v_pairs.get() + tile * (kTileK / 2) * ld, ld, Dp, nq, bits.data(),
                                              scratch.data(), orow);
            continue;
          }
#endif
          acc_masked<kDp, true>(cls, sbuf.data(), kTileK, 1, nk, v_rows.get() + tile * kTileK * ld, ld, Dp, nq,
                                bits.data(), orow);
        }
      }

      // o: [B, Hq, Lq, D]; lse: [B, Hq, Lq]. A row that saw no allowed key has l = 0: O = 0, LSE = -inf. A row
      // that read a non-finite score has l = NaN (its p is NaN, and NaN survives every later rescale), so it falls
      // in the first branch and comes out NaN, as the math puts it (docs/numerics.md) — never as a masked row.
      for (int hh = 0; hh < nh; ++hh)
        for (int i = 0; i < nq; ++i) {
          const size_t r = static_cast<size_t>(hh) * kTileQ + i;
          const int64_t row = (int64_t{b} * s.Hq + h0 + hh) * s.Lq + q0 + i;
          float* out = o + row * D;
          if (l[r] != 0.f) {
            const float inv = 1.f / l[r];
            for (int d = 0; d < D; ++d) out[d] = obuf[r * Dp + d] * inv;
            lse[row] = (m[r] + std::log2(l[r])) * kLn2;
          } else {
            std::fill(out, out + D, 0.f);
            lse[row] = -kInf;
          }
        }
    }
  }
}

}  // namespace

void forward(const AttnChunk& c, Bf16Product bf16, float* o, float* lse) {
  dispatch(c.shape.D, c.dtype, bf16,
           [&]<int kDp, DType kT, Bf16Product kProd>() { forward_impl<kDp, kT, kProd>(c, o, lse); });
}

}  // namespace rf::cpu::RF_ISA_NS
RF_ISA_END
