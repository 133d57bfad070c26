// ringflex cpu: what the forward and backward kernels share — the tile plan, packing of tiles into the padded
// layouts the micro-kernels read, the per-tile mask bits, and the softmax row steps.
//
// Internal to src/cpu, compiled once per ISA like microkernels.h. Template parameters come from dispatch.h: kDp
// (padded head dim, 0 = run time), kT (the input dtype) and kProd (isa.h: the units bf16 multiplies on), which
// decide whether an operand is packed as float32 or as bf16 pairs (kBf16Pairs below).
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "core/attention_args.h"
#include "core/error.h"
#include "core/math_constants.h"
#include "cpu/amx.h"
#include "cpu/attention.h"
#include "cpu/isa.h"
#include "cpu/isa_target.h"
#include "cpu/microkernels.h"

RF_ISA_BEGIN
namespace rf::cpu::RF_ISA_NS::detail {

using cpu::detail::amx_abt;
using cpu::detail::amx_acc;
using cpu::detail::AmxTileScope;
using cpu::detail::kAmxAccMaxPairs;
using cpu::detail::kAmxPairs;

static_assert(kTileK == kTileCols, "the micro-kernels are written for 64-key tiles");

constexpr float kInf = std::numeric_limits<float>::infinity();

// Whether a path packs bf16 inputs as bf16 pairs (uint32 words, two bf16 along the product's sum) for every
// product: the score products (S = Q K^T, dP = dO V^T) and the accumulating ones (O += P V and the gradients,
// whose float32 weights P and dS it rounds to bf16). Dpbf16 and Amx do; Widen runs everything on float32.
template <DType kT, Bf16Product kProd>
constexpr bool kBf16Pairs = kT == DType::BF16&& kProd != Bf16Product::Widen;

// Element type of the packed abt operands on a path: bf16 pairs or float32.
template <DType kT, Bf16Product kProd>
using ScoreOperand = std::conditional_t<kBf16Pairs<kT, kProd>, uint32_t, float>;

// Padded head dimension: a multiple of kPadFloats (whole vectors on every ISA), or with pairs of 32 = 2·kAmxPairs,
// so Dp/2 pairs fill whole zmm vectors of pairs and whole AMX A tiles along d. The padding is zero in every packed
// operand, so it adds exact zeros.
template <DType kT, Bf16Product kProd>
constexpr int path_padded_dim(int D) {
  static_assert(kPadFloats == kAmxPairs, "one padding unit serves vdpbf16ps and AMX");
  constexpr int kMultiple = kBf16Pairs<kT, kProd> ? 2 * kPadFloats : kPadFloats;
  return (D + kMultiple - 1) / kMultiple * kMultiple;
}

// Row stride, in floats, of packed row buffers: one vector more than Dp so that rows 2^k floats long do not alias
// in L1 (microkernels.h, acc). abt's A rows of bf16 pairs along d use pair_row<uint32_t>(row_stride(Dp)) words;
// acc_bf16's X rows of pairs (two rows along the sum, one word per d) use row_stride(Dp) words.
constexpr int row_stride(int Dp) { return Dp + kPadFloats; }

inline int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Per-block summaries of a [B, L] metadata array in tiles of `tile` tokens: [B, ceil(L / tile)].
inline std::vector<BlockSummary> tile_summaries(const TokenMeta* meta, int B, int L, int tile) {
  const int n = ceil_div(L, tile);
  std::vector<BlockSummary> s(static_cast<size_t>(B) * n);
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < n; ++t)
      s[static_cast<size_t>(b) * n + t] = summarize(meta + int64_t{b} * L + t * tile, std::min(tile, L - t * tile));
  return s;
}

// Bits of allowed keys in a tile row: bit j set = key j may be read. 64 keys = one word (kTileK == 64).
using RowBits = uint64_t;
inline RowBits first_bits(int nk) { return nk >= kTileK ? ~RowBits{0} : (RowBits{1} << nk) - 1; }

#if RF_ISA_AVX512
// docs/spec.md §3 for one query against 64 keys at once, 16 lanes per compare. Identical to rf::allowed lane by lane:
// valid(q) is tested once; doc[k] == doc[q] != 0 implies valid(k); the int32 differences idx[q] - idx[k] cannot
// overflow because the caller only takes this path when every valid token has idx >= 0 (a padding key's lanes
// are cleared by the doc compare whatever its idx). kdoc/kidx/kgrp: [kTileK], doc 0 past the tile's end.
inline RowBits allowed_bits(const LayerMask& m, const TokenMeta& q, const int32_t* kidx, const int32_t* kdoc,
                            const int32_t* kgrp) {
  if (q.doc == kPaddingDoc) return 0;
  const __m512i qd = _mm512_set1_epi32(q.doc), qi = _mm512_set1_epi32(q.idx), qg = _mm512_set1_epi32(q.group);
  const __m512i w = _mm512_set1_epi32(m.window);
  const bool grouped = m.bidirectional_groups && q.group >= 0;
  RowBits bits = 0;
  for (int v = 0; v < kTileK / kLanes; ++v) {
    const __m512i ki = _mm512_loadu_si512(kidx + v * kLanes);
    const __mmask16 same = _mm512_cmpeq_epi32_mask(_mm512_loadu_si512(kdoc + v * kLanes), qd);
    __mmask16 ordered = m.causal ? _mm512_cmple_epi32_mask(ki, qi) : kAll;
    if (m.window > 0) {
      const __m512i dist = m.causal ? _mm512_sub_epi32(qi, ki) : _mm512_maskz_abs_epi32(kAll, _mm512_sub_epi32(qi, ki));
      ordered &= _mm512_cmplt_epi32_mask(dist, w);
    }
    const __mmask16 group =
        grouped ? _mm512_cmpeq_epi32_mask(_mm512_loadu_si512(kgrp + v * kLanes), qg) : static_cast<__mmask16>(0);
    bits |= RowBits{static_cast<uint16_t>(same & (ordered | group))} << (v * kLanes);
  }
  return bits;
}
#elif RF_ISA_AVX2
// The same predicate 8 lanes at a time; compares give all-ones lanes, movemask turns them into bits.
inline RowBits allowed_bits(const LayerMask& m, const TokenMeta& q, const int32_t* kidx, const int32_t* kdoc,
                            const int32_t* kgrp) {
  if (q.doc == kPaddingDoc) return 0;
  const __m256i qd = _mm256_set1_epi32(q.doc), qi = _mm256_set1_epi32(q.idx), qg = _mm256_set1_epi32(q.group);
  const __m256i w = _mm256_set1_epi32(m.window), ones = _mm256_set1_epi32(-1);
  const bool grouped = m.bidirectional_groups && q.group >= 0;
  RowBits bits = 0;
  for (int v = 0; v < kTileK / kLanes; ++v) {
    const __m256i ki = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kidx + v * kLanes));
    const __m256i kd = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kdoc + v * kLanes));
    const __m256i same = _mm256_cmpeq_epi32(kd, qd);
    __m256i ordered = m.causal ? _mm256_andnot_si256(_mm256_cmpgt_epi32(ki, qi), ones) : ones;  // ki <= qi
    if (m.window > 0) {
      const __m256i diff = _mm256_sub_epi32(qi, ki);
      const __m256i dist = m.causal ? diff : _mm256_abs_epi32(diff);
      ordered = _mm256_and_si256(ordered, _mm256_cmpgt_epi32(w, dist));  // dist < w
    }
    const __m256i group =
        grouped ? _mm256_cmpeq_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(kgrp + v * kLanes)), qg)
                : _mm256_setzero_si256();
    const __m256i hit = _mm256_and_si256(same, _mm256_or_si256(ordered, group));
    bits |= RowBits{static_cast<uint8_t>(_mm256_movemask_ps(_mm256_castsi256_ps(hit)))} << (v * kLanes);
  }
  return bits;
}
#endif

// bits: [nq]. Full tiles skip the predicate; Partial ones evaluate docs/spec.md §3 per pair (vectorised on the vector
// ISAs when every valid idx is non-negative, else rf::allowed itself).
inline void tile_bits(BlockClass cls, const LayerMask& mask, const TokenMeta* qm, int nq, const TokenMeta* km, int nk,
                      RowBits* bits) {
  if (cls == BlockClass::Full) {
    std::fill(bits, bits + nq, first_bits(nk));
    return;
  }
#if RF_ISA_AVX512 || RF_ISA_AVX2
  const BlockSummary qs = summarize(qm, nq), ks = summarize(km, nk);
  if (qs.idx_min >= 0 && ks.idx_min >= 0) {
    alignas(64) int32_t kidx[kTileK], kdoc[kTileK], kgrp[kTileK];
    for (int j = 0; j < kTileK; ++j) {
      const bool in = j < nk;
      kidx[j] = in ? km[j].idx : 0, kdoc[j] = in ? km[j].doc : kPaddingDoc, kgrp[j] = in ? km[j].group : kNoGroup;
    }
    for (int i = 0; i < nq; ++i) bits[i] = allowed_bits(mask, qm[i], kidx, kdoc, kgrp);
    return;
  }
#endif
  for (int i = 0; i < nq; ++i) {
    RowBits w = 0;
    for (int j = 0; j < nk; ++j) w |= RowBits{allowed(mask, qm[i], km[j])} << j;
    bits[i] = w;
  }
}

template <DType kT>
inline float load_elem(const void* p, int64_t i) {
  if constexpr (kT == DType::F32)
    return static_cast<const float*>(p)[i];
  else
    return bf16_to_float(static_cast<const bf16*>(p)[i]);
}

inline uint32_t bf16_bits(const void* p, int64_t i) { return static_cast<const bf16*>(p)[i].bits; }

// Rows src[r, 0 .. D) (stride D, dtype kT) -> dst[r, 0 .. Dp) float32, zero padded. dst: [rows, ld].
template <DType kT>
inline void pack_rows_f32(const void* src, int rows, int D, int Dp, int ld, float* dst) {
  for (int r = 0; r < rows; ++r) {
    float* out = dst + int64_t{r} * ld;
    for (int d = 0; d < D; ++d) out[d] = load_elem<kT>(src, int64_t{r} * D + d);
    std::fill(out + D, out + Dp, 0.f);
  }
}

// Whether operands of element type C hold bf16 pairs (uint32 words) rather than float32; pair_row is the number of
// C elements in a packed row of Dp values.
template <typename C>
constexpr bool kPairs = std::is_same_v<C, uint32_t>;
template <typename C>
constexpr int pair_row(int Dp) {
  return kPairs<C> ? Dp / 2 : Dp;
}

// Rows as abt's A operand: dst [rows, ld] of C (ld in elements of C), zero padded to Dp.
template <DType kT, typename C>
inline void pack_rows_dot(const void* src, int rows, int D, int Dp, int ld, C* dst) {
  static_assert(!kPairs<C> || kT == DType::BF16, "bf16 pairs need bf16 inputs");
  if constexpr (kPairs<C>) {
    const int pairs = Dp / 2;
    static_assert(std::endian::native == std::endian::little, "bf16 pairs are packed for little-endian words");
    if (D % 2 == 0) {
      // The word of the pair (d, d + 1), low half first, is those two bf16 as they lie in memory (little-endian
      // x86): a row is a copy of D / 2 words, then zeros.
      for (int r = 0; r < rows; ++r) {
        std::memcpy(dst + int64_t{r} * ld, static_cast<const bf16*>(src) + int64_t{r} * D, D * sizeof(bf16));
        std::fill(dst + int64_t{r} * ld + D / 2, dst + int64_t{r} * ld + pairs, 0u);
      }
      return;
    }
    for (int r = 0; r < rows; ++r)
      for (int p = 0; p < pairs; ++p) {
        const int d = 2 * p;
        const uint32_t lo = d < D ? bf16_bits(src, int64_t{r} * D + d) : 0u;
        const uint32_t hi = d + 1 < D ? bf16_bits(src, int64_t{r} * D + d + 1) : 0u;
        dst[int64_t{r} * ld + p] = lo | hi << 16;
      }
  } else {
    pack_rows_f32<kT>(src, rows, D, Dp, ld, dst);
  }
}

// Rows src[n, 0 .. D), n < rows (stride D, bf16), as acc_bf16's X operand: pairs of rows along the sum index,
// dst [out_pairs, ld] words, word (m, d) = (src[2m, d], src[2m + 1, d]) (low half first), zero for rows >= `rows`,
// d >= D and up to Dp. out_pairs >= ceil(rows / 2).
inline void pack_pair_rows(const void* src, int rows, int D, int Dp, int ld, int out_pairs, uint32_t* dst) {
  for (int m = 0; m < out_pairs; ++m) {
    uint32_t* out = dst + int64_t{m} * ld;
    const int n = 2 * m;
    if (n + 1 < rows) {
      for (int d = 0; d < D; ++d)
        out[d] = bf16_bits(src, int64_t{n} * D + d) | bf16_bits(src, int64_t{n + 1} * D + d) << 16;
    } else if (n < rows) {
      for (int d = 0; d < D; ++d) out[d] = bf16_bits(src, int64_t{n} * D + d);
    } else {
      std::fill(out, out + D, 0u);
    }
    std::fill(out + D, out + Dp, 0u);
  }
}

// A key (or value) tile src[j, 0 .. D), j < nk, as abt's transposed B operand: dst [pair_row<C>(Dp), kTileK],
// zero for j >= nk and d >= D. For pairs this is the VNNI layout of amx.h: word (p, j) = (d = 2p, 2p + 1) of key j. The
// transpose is paid once per tile and reused by every query row and head.
template <DType kT, typename C>
inline void pack_cols_dot(const void* src, int nk, int D, int Dp, C* dst) {
  static_assert(!kPairs<C> || kT == DType::BF16, "bf16 pairs need bf16 inputs");
  std::fill(dst, dst + int64_t{pair_row<C>(Dp)} * kTileK, C{0});
  for (int j = 0; j < nk; ++j) {
    if constexpr (kPairs<C>) {
      for (int d = 0; d < D; ++d) dst[(d / 2) * kTileK + j] |= bf16_bits(src, int64_t{j} * D + d) << (16 * (d % 2));
    } else {
      for (int d = 0; d < D; ++d) dst[d * kTileK + j] = load_elem<kT>(src, int64_t{j} * D + d);
    }
  }
}

// The abt product (S = Q K^T, dP = dO V^T) on the path dispatch.h chose: AMX tiles (amx.h; needs an active
// AmxTileScope, and a and c with whole 16-row blocks) or the micro-kernel (float32 FMAs or vdpbf16ps, by C).
template <int kDp, Bf16Product kProd, typename C>
inline void score_tile(const C* a, int lda, const C* bt, int Dp, int rows, float* c) {
  if constexpr (kProd == Bf16Product::Amx && kPairs<C>)
    amx_abt(a, lda, bt, Dp, rows, c);
  else
    abt<kDp>(a, lda, bt, Dp, rows, c);
}

// Packed-tile storage, left uninitialised: only needed tiles are read and packing writes every element of those
// (zeros included), so value-initialising the O(Lk · Dp) buffers would be a wasted pass over memory.
template <typename T>
std::unique_ptr<T[]> uninitialized(size_t n) {
  return std::unique_ptr<T[]>(new T[n]);
}

// Which key tiles at least one query tile reads (classify != Empty): [B, nkt]. Tiles nobody reads are neither
// packed nor visited, so a ring step whose chunk is entirely masked costs only the classification.
inline std::vector<uint8_t> needed_key_tiles(const LayerMask& mask, const std::vector<BlockSummary>& qsum,
                                             const std::vector<BlockSummary>& ksum, int B, int nqt, int nkt) {
  std::vector<uint8_t> needed(static_cast<size_t>(B) * nkt, 0);
  for (int b = 0; b < B; ++b)
    for (int kt = 0; kt < nkt; ++kt)
      for (int qt = 0; qt < nqt && !needed[static_cast<size_t>(b) * nkt + kt]; ++qt)
        needed[static_cast<size_t>(b) * nkt + kt] =
            classify(mask, qsum[static_cast<size_t>(b) * nqt + qt], ksum[static_cast<size_t>(b) * nkt + kt]) !=
            BlockClass::Empty;
  return needed;
}

// Every needed tile of the K and V chunks, packed once before the tile loops (one parallel loop over tiles, so one
// fork/join) instead of once per work item: the transposes and bf16 widening then cost O(Lk·D) per call, not per
// query tile. k, v: [B, Hkv, Lk, D] in kT. Tile t = (b·Hkv + g)·nkt + kt. Each output may be null:
// *_cols: [tiles, pair_row<C>(Dp), kTileK] (abt's transposed operand); *_rows: acc's X operand,
// [tiles, kTileK, row_stride(Dp)] float32, and *_pairs: the same with pairs of keys, [tiles, kTileK / 2,
// row_stride(Dp)] words (pack_pair_rows).
template <DType kT, typename C>
struct KeyTiles {
  C* k_cols = nullptr;
  float* k_rows = nullptr;
  uint32_t* k_pairs = nullptr;
  C* v_cols = nullptr;
  float* v_rows = nullptr;
  uint32_t* v_pairs = nullptr;
};

template <DType kT, typename C>
void pack_key_tiles(const void* k, const void* v, const AttnShape& s, int Dp, const std::vector<uint8_t>& needed,
                    const KeyTiles<kT, C>& out) {
  const int nkt = ceil_div(s.Lk, kTileK), ld = row_stride(Dp);
  const int64_t tiles = int64_t{s.B} * s.Hkv * nkt;
  const size_t esz = dtype_size(kT);
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tiles; ++t) {
    const int kt = static_cast<int>(t % nkt), b = static_cast<int>(t / nkt / s.Hkv);
    if (!needed[static_cast<size_t>(b) * nkt + kt]) continue;
    const int k0 = kt * kTileK, nk = std::min(kTileK, s.Lk - k0);
    const int64_t offset = ((t / nkt) * s.Lk + k0) * s.D * esz;
    auto pack = [&](const void* src, C* cols, float* rows, uint32_t* pairs) {
      const char* tile = static_cast<const char*>(src) + offset;
      if (cols) pack_cols_dot<kT, C>(tile, nk, s.D, Dp, cols + t * pair_row<C>(Dp) * kTileK);
      if (rows) {
        float* r = rows + t * kTileK * ld;
        pack_rows_f32<kT>(tile, nk, s.D, Dp, ld, r);
        std::fill(r + int64_t{nk} * ld, r + int64_t{kTileK} * ld, 0.f);
      }
      if constexpr (kT == DType::BF16)
        if (pairs) pack_pair_rows(tile, nk, s.D, Dp, ld, kTileK / 2, pairs + t * (kTileK / 2) * ld);
    };
    pack(k, out.k_cols, out.k_rows, out.k_pairs);
    pack(v, out.v_cols, out.v_rows, out.v_pairs);
  }
}

// Forward online-softmax step on one tile for `rows` query rows.
// s: [rows, kTileK] raw scores q.k, overwritten with p = 2^(c2·s - m_new) (0 where not allowed);
// bits: [rows]; m, l: [rows] running max (log2 units) and sum; o: [rows, Dp] running numerator, rescaled here.
// c2 = scale·log2(e), so exp2 of log2-unit scores is exp of the natural ones.
inline void softmax_step(float* s, int rows, const RowBits* bits, float c2, float* m, float* l, float* o, int Dp) {
  for (int i = 0; i < rows; ++i) {
    float* row = s + i * kTileK;
    const RowBits w = bits[i];
#if RF_ISA_AVX512 || RF_ISA_AVX2
    constexpr int kVecs = kTileK / kLanes;
    const VecF neg_inf = vset1(-kInf), c = vset1(c2);
    VecF x[kVecs];
    VecF mx = neg_inf;
    for (int v = 0; v < kVecs; ++v) {
      x[v] = select(lane_mask(w, v), vmul(vload(row + v * kLanes), c), neg_inf);
      mx = vmax(mx, x[v]);
    }
    const float tile_max = reduce_max(mx);
#else
    float tile_max = -kInf;
    for (int j = 0; j < kTileK; ++j) {
      row[j] = (w >> j) & 1 ? row[j] * c2 : -kInf;
      tile_max = std::max(tile_max, row[j]);
    }
#endif
    const float m_new = std::max(m[i], tile_max);
    // A row with nothing allowed so far keeps m = -inf; subtracting 0 instead keeps every exponent -inf (p = 0)
    // rather than -inf - (-inf) = NaN.
    const float m_use = m_new == -kInf ? 0.f : m_new;
    const float alpha = exp2_scalar(m[i] - m_use);  // 0 when m[i] = -inf
    float sum = 0.f;
#if RF_ISA_AVX512 || RF_ISA_AVX2
    VecF acc = vzero();
    for (int v = 0; v < kVecs; ++v) {
      const VecF p = exp2_ps(vsub(x[v], vset1(m_use)));
      vstore(row + v * kLanes, p);
      acc = vadd(acc, p);
    }
    sum = reduce_add(acc);
#else
    for (int j = 0; j < kTileK; ++j) {
      row[j] = exp2_scalar(row[j] - m_use);
      sum += row[j];
    }
#endif
    l[i] = l[i] * alpha + sum;
    m[i] = m_new;
    if (alpha != 1.f) {
      float* orow = o + int64_t{i} * Dp;
      for (int d = 0; d < Dp; ++d) orow[d] *= alpha;
    }
  }
}

// Backward per-tile step for `rows` query rows. s: [rows, kTileK] raw scores -> p = exp2(c2·s - bias) where
// allowed, else 0; dp: [rows, kTileK] dO.v -> dS = p·(dp - delta)·scale where allowed, else 0. bias = lse·log2(e),
// or +inf for a row with lse = -inf (then every p is exp2(-inf) = 0 and the row contributes nothing). p is capped
// at 1, as it is in exact arithmetic (lse >= every score of the row): c2·s and bias each carry float32 rounding of
// about |score|·2^-24, which at scores of 1e7 and more would make a single-key row's p 2.5 instead of 1 and, further
// out, inf and NaN gradients. A NaN exponent (a non-finite score or lse) stays NaN through the cap.
//
// live: [rows], out: the pairs that take part in the gradient products — bits, minus every pair of a row with
// lse = -inf. Such a row contributes nothing (docs/spec.md §4), also when it has allowed keys whose scores are all
// -inf: its dS is 0, and acc must not form 0 · K where K is infinite. Returns whether a row with allowed pairs was
// dropped, so the caller treats the tile as Partial (acc_masked).
inline bool grad_step(float* s, float* dp, int rows, const RowBits* bits, float c2, const float* bias,
                      const float* delta, float scale, RowBits* live) {
  bool dropped = false;
  for (int i = 0; i < rows; ++i) {
    float* srow = s + i * kTileK;
    float* drow = dp + i * kTileK;
    const bool empty_row = bias[i] == kInf;
    dropped |= empty_row && bits[i] != 0;
    const RowBits w = live[i] = empty_row ? 0 : bits[i];
#if RF_ISA_AVX512 || RF_ISA_AVX2
    const VecF c = vset1(c2), b = vset1(bias[i]), dl = vset1(delta[i]), sc = vset1(scale);
    for (int v = 0; v < kTileK / kLanes; ++v) {
      // exp2 of every lane, then the forbidden ones zeroed: their scores may be anything, exp2 included.
      // Forbidden lanes get dS = 0 outright too: p is 0 there, but dP may be NaN (a non-finite dO or V the pair
      // never reads), and 0 · NaN would leak it.
      const LaneMask allowed = lane_mask(w, v);
      const VecF x = vmin(vzero(), vfmsub(vload(srow + v * kLanes), c, b));  // p <= 1 (see the function comment)
      const VecF p = zero_unless(allowed, exp2_ps(x));
      const VecF ds = zero_unless(allowed, vmul(vmul(p, vsub(vload(drow + v * kLanes), dl)), sc));
      vstore(srow + v * kLanes, p);
      vstore(drow + v * kLanes, ds);
    }
#else
    for (int j = 0; j < kTileK; ++j) {
      const bool allowed = (w >> j) & 1;
      const float x = srow[j] * c2 - bias[i];
      const float p = allowed ? exp2_scalar(x > 0.f ? 0.f : x) : 0.f;  // p <= 1, NaN kept (see the function comment)
      srow[j] = p;
      drow[j] = allowed ? p * (drow[j] - delta[i]) * scale : 0.f;  // not 0 · dP: dP may be NaN (see above)
    }
#endif
  }
  return dropped;
}

// ---------------------------------------------------------------------------------------------------------------
// Non-finite inputs (docs/numerics.md). A pair the mask forbids must not reach any result, but the tile products
// multiply every pair of a tile and rely on its weight being 0 — and 0 · NaN = NaN, 0 · inf = NaN. So a Partial
// tile whose accumulated operand (V, K, dO or Q rows) holds a non-finite value runs acc_allowed, which skips the
// forbidden pairs instead of multiplying them by 0. Finite operands (the normal case) keep the fast acc: the scan
// below is O(rows · Dp) against the tile products' O(rows · kTileK · Dp), and only Partial tiles pay it (Full
// tiles have no forbidden pair).
// ---------------------------------------------------------------------------------------------------------------

// Whether rows [0, rows) of x (row stride ld floats, Dp values a row) hold a NaN or an infinity.
inline bool any_nonfinite(const float* x, int rows, int ld, int Dp) {
  bool bad = false;
  for (int r = 0; r < rows; ++r)
    for (int d = 0; d < Dp; ++d) bad |= !std::isfinite(x[int64_t{r} * ld + d]);
  return bad;
}

// acc (microkernels.h) restricted to allowed pairs: out[r, d] += sum over allowed (r, n) of a[r, n] · x[n, d].
// The pair (r, n) is allowed when bits[r] has bit n (kRowsAreQueries: O += P V, dQ += dS K) or bits[n] has bit r
// (the transposed products dV += P^T dO, dK += dS^T Q, whose rows are keys). Each out element sums its terms in
// the order n = 0, 1, ... with fused multiply-adds, like acc's vector loop, so rows that read no non-finite value
// get the bits acc would give them (a skipped pair only ever added an exact 0 there).
template <bool kRowsAreQueries>
inline void acc_allowed(const float* a, int ars, int ans, int N, const float* x, int ldx, int Dp, int rows,
                        const RowBits* bits, float* out) {
  for (int r = 0; r < rows; ++r)
    for (int n = 0; n < N; ++n) {
      const bool allowed = kRowsAreQueries ? (bits[r] >> n) & 1 : (bits[n] >> r) & 1;
      if (!allowed) continue;
      const float w = a[r * ars + n * ans];
      float* o = out + int64_t{r} * Dp;
      const float* xn = x + int64_t{n} * ldx;
#if RF_ISA_AVX512 || RF_ISA_AVX2
      for (int d = 0; d < Dp; ++d) o[d] = std::fma(w, xn[d], o[d]);
#else
      for (int d = 0; d < Dp; ++d) o[d] += w * xn[d];
#endif
    }
}

// The accumulating product of one (query tile, key tile) pair: acc, or acc_allowed when the tile is Partial and
// x holds a non-finite value. x: [N, ldx] rows of the operand being summed; out: [rows, Dp].
template <int kDp, bool kRowsAreQueries>
inline void acc_masked(BlockClass cls, const float* a, int ars, int ans, int N, const float* x, int ldx, int Dp,
                       int rows, const RowBits* bits, float* out) {
  if (cls == BlockClass::Partial && any_nonfinite(x, N, ldx, Dp))
    acc_allowed<kRowsAreQueries>(a, ars, ans, N, x, ldx, Dp, rows, bits, out);
  else
    acc<kDp>(a, ars, ans, N, x, ldx, Dp, rows, out);
}

#if RF_ISA_AVX512
// acc_masked for the pair products (microkernels.h: acc_bf16). a(r, m) at a[r·ars + m·ams] holds the weights of
// the sum indices n = 2m, 2m + 1 < N; x: [ceil(N / 2), ldx] words of pairs. A pair word mixes two rows of x, so
// a forbidden row's non-finite value would reach the allowed row's product through the same vdpbf16ps (0 · inf =
// NaN). When the tile is Partial and x holds a non-finite value, each output row instead runs the same kernel
// over a copy of x whose forbidden halves (for that row) are zero: the lanes then take the same pair steps in the
// same order with +0 for -0/+0 products, so a row that reads no non-finite value gets acc_bf16's bits (its
// accumulators start at +0 or a non-zero value, and x + (±0) = x, +0 + (-0) = +0). scratch: [ceil(N / 2), ldx].
inline bool any_nonfinite_pairs(const uint32_t* x, int pairs, int ld, int Dp) {
  constexpr uint32_t kExp = 0x7f80u;  // a bf16 with every exponent bit set is an infinity or a NaN
  bool bad = false;
  for (int m = 0; m < pairs; ++m)
    for (int d = 0; d < Dp; ++d) {
      const uint32_t w = x[int64_t{m} * ld + d];
      bad |= (w & kExp) == kExp || (w >> 16 & kExp) == kExp;
    }
  return bad;
}

// With kAmx the products run on AMX tiles (amx.h: amx_acc), over whole 16-pair tiles along the sum (scratch then
// holds [that many pairs, ldx] words). That needs the weights in row layout (ams = 1), and a and x zero from pair
// ceil(N / 2) to the tile's end, which the kernels' operands are: forbidden and out-of-tile weights are 0
// (softmax_step, grad_step, weights_to_key_rows), and the packed x tiles are zero past their last row
// (pack_pair_rows). The per-row path runs the same tile sequence on one row at a time, so its rows keep the bits
// they have on the whole-tile path, as on vdpbf16ps.
template <int kDp, bool kRowsAreQueries, bool kAmx>
inline void acc_masked_pairs(BlockClass cls, const uint32_t* a, int ars, int ams, int N, const uint32_t* x, int ldx,
                             int Dp, int rows, const RowBits* bits, uint32_t* scratch, float* out) {
  const int pairs = kAmx ? ceil_div(N, 2 * kAmxPairs) * kAmxPairs : ceil_div(N, 2);
  RF_ASSERT(!kAmx || ams == 1);
  auto product = [&](const uint32_t* w, const uint32_t* xs, int n, float* o) {
    if constexpr (kAmx)
      amx_acc(w, ars, pairs, xs, ldx, Dp, n, o);
    else
      acc_bf16<kDp>(w, ars, ams, pairs, xs, ldx, Dp, n, o);
  };
  if (cls != BlockClass::Partial || !any_nonfinite_pairs(x, pairs, ldx, Dp)) {
    product(a, x, rows, out);
    return;
  }
  auto allowed = [&](int r, int n) { return n < N && (kRowsAreQueries ? (bits[r] >> n) & 1 : (bits[n] >> r) & 1); };
  for (int r = 0; r < rows; ++r) {
    for (int m = 0; m < pairs; ++m) {
      const uint32_t keep = (allowed(r, 2 * m) ? 0x0000ffffu : 0u) | (allowed(r, 2 * m + 1) ? 0xffff0000u : 0u);
      for (int d = 0; d < Dp; ++d) scratch[int64_t{m} * ldx + d] = x[int64_t{m} * ldx + d] & keep;
    }
    product(a + int64_t{r} * ars, scratch, 1, out + int64_t{r} * Dp);
  }
}

// The weights of dV += P^T dO and dK += dS^T Q for AMX, whose A operand wants the sum (queries) along each row:
// w: [rows, kTileK] float32 (rows = queries) -> dst [kTileK, kTileQ / 2] words, word (j, m) = (w[2m, j],
// w[2m + 1, j]) rounded as weights_to_pair_cols rounds them, zero for 2m >= rows. pair_cols: [kTileQ / 2, kTileK]
// scratch for weights_to_pair_cols' layout, transposed here.
inline void weights_to_key_rows(const float* w, int rows, uint32_t* pair_cols, uint32_t* dst) {
  static_assert(kTileQ == 2 * kAmxAccMaxPairs, "one key row of weights is two AMX A tiles");
  weights_to_pair_cols(w, rows, pair_cols);
  const int filled = ceil_div(rows, 2);
  for (int j = 0; j < kTileK; ++j) {
    uint32_t* out = dst + j * (kTileQ / 2);
    for (int m = 0; m < filled; ++m) out[m] = pair_cols[m * kTileK + j];
    std::fill(out + filled, out + kTileQ / 2, 0u);
  }
}
#endif

// Heads of one kv group processed together as one work item, so each K/V tile is packed once and read from
// cache by all of them. Bounded so the item's packed Q and float32 accumulators (2 · heads · kTileQ · Dp floats)
// stay within about half of a 1 MiB L2 (Zen 4; current Xeons have 2 MiB).
constexpr int64_t kItemFloats = 128 * 1024;
inline int heads_per_item(int group, int Dp) {
  const int64_t fit = kItemFloats / (2 * int64_t{kTileQ} * Dp);
  return static_cast<int>(std::clamp<int64_t>(fit, 1, group));
}

// The query-side work items of forward and backward's dQ pass: (row b, kv head g, query tile qt, chunk of the
// group's query heads), numbered with the head chunk fastest so neighbouring items share K/V tiles in cache.
struct QueryItems {
  int Lq, Hkv, group, nqt, heads_per_item, chunks;

  QueryItems(const AttnShape& s, int Dp)
      : Lq(s.Lq),
        Hkv(s.Hkv),
        group(s.group_size()),
        nqt(ceil_div(s.Lq, kTileQ)),
        heads_per_item(detail::heads_per_item(s.group_size(), Dp)),
        chunks(ceil_div(group, heads_per_item)) {}

  int64_t count(int B) const { return int64_t{B} * Hkv * nqt * chunks; }

  struct Item {
    int b, g, qt;
    int h0, nh;  // query heads h0 .. h0 + nh - 1, all reading kv head g
    int q0, nq;  // query rows q0 .. q0 + nq - 1 of tile qt
  };
  Item operator[](int64_t item) const {
    const int chunk = static_cast<int>(item % chunks);
    const int qt = static_cast<int>(item / chunks % nqt);
    const int g = static_cast<int>(item / chunks / nqt % Hkv);
    const int b = static_cast<int>(item / chunks / nqt / Hkv);
    const int h0 = g * group + chunk * heads_per_item, q0 = qt * kTileQ;
    return {b, g, qt, h0, std::min(heads_per_item, group - chunk * heads_per_item), q0, std::min(kTileQ, Lq - q0)};
  }
};

}  // namespace rf::cpu::RF_ISA_NS::detail
RF_ISA_END
