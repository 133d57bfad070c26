// The cpu attention kernels against the scalar reference (tests/cpu/attention_check.h has the error bound and
// its derivation), over a covering design of the sweep axes:
//   S ∈ {1, 3, tile-1, tile, tile+1, 1000}, D ∈ {8, 64, 72, 128, 256, 512}, Hq:Hkv ∈ {1, 2, 8, 16},
//   masks {bidirectional, causal, sliding W ∈ {1, 7, 512}, each with and without bidirectional groups},
//   metadata kinds {one doc, packed (one-token docs), packed + images, padded, all padding}, f32 and bf16,
// plus ring-step chunks (Lq != Lk, keys from another part of the row). The full product is ~50k cases of a
// double-precision O(S²·D) oracle; instead every value of every axis appears, and the risky pairs are crossed:
// mask × metadata, D × dtype × head ratio, S × mask. S = 1000 runs only with small heads and D.
// CTest runs this file once per kernel path (tests/cpu/CMakeLists.txt: RINGFLEX_ISA=amx, avx512-dpbf16,
// avx512-widen, avx2, scalar, and unset) and once on the AMX kernels with the software tile unit (`.amx-model`,
// kernel_path_test.h); a path this CPU cannot run skips every test and says why.
#include <gtest/gtest.h>

#include <omp.h>
#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <string_view>
#include <vector>

#include "attention_check.h"
#include "core/error.h"
#include "core/merge.h"
#include "cpu/amx.h"
#include "cpu/attention.h"
#include "cpu/dispatch.h"
#include "cpu/isa.h"
#include "cpu/kernels.h"
#include "kernel_path_test.h"

namespace rf::testing {
namespace {

class CpuAttention : public KernelPathTest {};

constexpr int kTile = cpu::kTileQ;
static_assert(cpu::kTileQ == cpu::kTileK, "the S sweep straddles one tile size");

const int kSeqs[] = {1, 3, kTile - 1, kTile, kTile + 1};  // S = 1000 has its own test (LongRows)
const int kDims[] = {8, 64, 72, 128, 256, 512};
const int kGroups[] = {1, 2, 8, 16};  // Hq / Hkv
const MetaKind kKinds[] = {MetaKind::OneDoc, MetaKind::Packed, MetaKind::PackedImages, MetaKind::Padded,
                           MetaKind::AllPadding};

std::vector<LayerMask> all_masks() {
  std::vector<LayerMask> m;
  for (bool groups : {false, true}) {
    m.push_back({false, 0, groups});
    m.push_back({true, 0, groups});
    for (int w : {1, 7, 512}) m.push_back({true, w, groups});
  }
  m.push_back({false, 7, true});  // a bidirectional window
  return m;
}

Case square_case(int B, int Hkv, int group, int S, int D, DType t, LayerMask mask, MetaKind kind, uint64_t seed) {
  Case cs;
  cs.B = B, cs.Hkv = Hkv, cs.Hq = Hkv * group, cs.Lq = cs.Lk = S, cs.D = D, cs.dtype = t, cs.mask = mask;
  cs.q_meta = random_meta(B, S, kind, seed);
  cs.k_meta = cs.q_meta;
  cs.seed = seed;
  return cs;
}

// Every mask against every metadata kind; S, D, heads and dtype cycle through their values.
TEST_F(CpuAttention, MaskByMetadata) {
  const std::vector<LayerMask> masks = all_masks();
  int i = 0;
  for (const LayerMask& mask : masks)
    for (MetaKind kind : kKinds) {
      const int S = kSeqs[i % 5] + (i % 3 == 0 ? kTile : 0);  // also two-tile rows (tile+1 .. 2·tile+1)
      const int D = i % 2 ? 8 : 72;
      const DType t = i % 4 < 2 ? DType::F32 : DType::BF16;
      check_case(square_case(2, 1 + i % 2, kGroups[i % 3], S, D, t, mask, kind, 100 + i));
      ++i;
    }
}

// Every head dim against both dtypes and every head ratio, on a tile-straddling row with images and padding.
TEST_F(CpuAttention, DimByDtypeByGroups) {
  int i = 0;
  for (int D : kDims)
    for (DType t : {DType::F32, DType::BF16})
      for (int group : kGroups) {
        const LayerMask mask = i % 2 ? LayerMask{true, 7, true} : LayerMask{true, 0, true};
        const MetaKind kind = i % 3 == 0 ? MetaKind::Padded : MetaKind::PackedImages;
        const int S = D >= 256 && group >= 8 ? kTile + 1 : kSeqs[i % 5] + kTile;  // bound the oracle's cost
        check_case(square_case(1, 1, group, S, D, t, mask, kind, 300 + i));
        ++i;
      }
}

// S = 1000 (16 tiles, a partial last one) with every mask, small heads and D.
TEST_F(CpuAttention, LongRows) {
  int i = 0;
  for (const LayerMask& mask : all_masks()) {
    const MetaKind kind = kKinds[i % 4];  // all-padding is covered above
    check_case(
        square_case(1, 1, 1 + i % 2, 1000, i % 2 ? 8 : 64, i % 3 ? DType::F32 : DType::BF16, mask, kind, 500 + i));
    ++i;
  }
}

// A ring step: queries are one part of a row, keys another (earlier, later, overlapping), with their own idx.
TEST_F(CpuAttention, RingStepChunks) {
  const int S = 400;
  struct Split {
    int q0, lq, k0, lk;
  };
  const Split splits[] = {{200, 130, 0, 200},     // keys strictly before the queries (a causal ring step)
                          {260, 70, 100, 129},    // a window's halo: only the last keys can be in reach
                          {0, 65, 300, 100},      // keys after the queries: causal masks make it empty
                          {130, 140, 100, 300}};  // overlapping ranges
  const LayerMask masks[] = {{true, 0, false}, {true, 64, true}, {false, 0, true}, {true, 7, false}};
  int i = 0;
  for (const Split& sp : splits)
    for (const LayerMask& mask : masks) {
      Case cs;
      cs.B = 2, cs.Hkv = 2, cs.Hq = 2 * (1 + i % 2), cs.Lq = sp.lq, cs.Lk = sp.lk, cs.D = i % 2 ? 64 : 8;
      cs.dtype = i % 3 ? DType::F32 : DType::BF16, cs.mask = mask, cs.seed = 700 + i;
      const std::vector<TokenMeta> rows = random_meta(2, S, MetaKind::PackedImages, cs.seed);
      for (int b = 0; b < 2; ++b) {
        const TokenMeta* row = rows.data() + int64_t{b} * S;
        cs.q_meta.insert(cs.q_meta.end(), row + sp.q0, row + sp.q0 + sp.lq);
        cs.k_meta.insert(cs.k_meta.end(), row + sp.k0, row + sp.k0 + sp.lk);
      }
      check_case(cs);
      ++i;
    }
}

// Keys [0, Lk) of a head as two chunks [0, split) and [split, Lk): kv: [B, Hkv, Lk, D] bytes -> [B, Hkv, n, D].
std::vector<uint8_t> key_slice(const std::vector<uint8_t>& kv, const AttnShape& s, DType t, int k0, int n) {
  const size_t row = static_cast<size_t>(s.D) * dtype_size(t);
  std::vector<uint8_t> out(static_cast<size_t>(s.B) * s.Hkv * n * row);
  for (int64_t head = 0; head < int64_t{s.B} * s.Hkv; ++head)
    std::memcpy(out.data() + head * n * row, kv.data() + (head * s.Lk + k0) * row, n * row);
  return out;
}

// How the ring uses the API: partial forwards over two key chunks merged with rf::merge_partial, delta from the
// merged O, then each chunk's backward with the merged LSE and delta, accumulating into one dQ. Must match the
// reference over all keys. Bounds: the whole-row κ of attention_check.h; the merge's weights add a few roundings
// per element, one more κ for o and lse (factor 2), and the backward is unchanged (it sees merged lse/delta).
TEST_F(CpuAttention, TwoChunksMergeToTheWhole) {
  for (DType t : {DType::F32, DType::BF16}) {
    Case cs = square_case(2, 2, 2, 3 * kTile + 7, 72, t, {true, 90, true}, MetaKind::Padded, 970);
    Tensors whole = make_tensors(cs);
    const AttnShape& s = whole.chunk.shape;
    const int split = kTile + 20;  // not on a tile boundary
    std::vector<float> o(static_cast<size_t>(s.q_elems())), lse(static_cast<size_t>(s.lse_elems()));
    std::vector<float> o_b(o.size()), lse_b(lse.size()), delta(lse.size()), dq(o.size(), 0.f);
    std::vector<float> dk(static_cast<size_t>(s.kv_elems())), dv(dk.size());
    struct Part {
      int k0, n;
      std::vector<uint8_t> k, v;
      std::vector<TokenMeta> meta;
      AttnChunk c;
    };
    Part parts[2] = {{0, split, {}, {}, {}, {}}, {split, s.Lk - split, {}, {}, {}, {}}};
    for (Part& p : parts) {
      p.k = key_slice(whole.k, s, t, p.k0, p.n), p.v = key_slice(whole.v, s, t, p.k0, p.n);
      for (int b = 0; b < s.B; ++b)
        p.meta.insert(p.meta.end(), cs.k_meta.begin() + int64_t{b} * s.Lk + p.k0,
                      cs.k_meta.begin() + int64_t{b} * s.Lk + p.k0 + p.n);
      p.c = whole.chunk;
      p.c.shape.Lk = p.n, p.c.k = p.k.data(), p.c.v = p.v.data(), p.c.k_meta = p.meta.data();
    }
    cpu::attention_forward(parts[0].c, o.data(), lse.data());
    cpu::attention_forward(parts[1].c, o_b.data(), lse_b.data());
    merge_partial(o.data(), lse.data(), o_b.data(), lse_b.data(), s.lse_elems(), s.D);
    cpu::attention_delta(s, t, whole.dout.data(), o.data(), delta.data());
    std::vector<float> dk_part[2], dv_part[2];
    for (int i = 0; i < 2; ++i) {
      const Part& p = parts[i];
      dk_part[i].assign(static_cast<size_t>(p.c.shape.kv_elems()), 0.f), dv_part[i].assign(dk_part[i].size(), 0.f);
      cpu::attention_backward(p.c, whole.dout.data(), lse.data(), delta.data(), dq.data(), dk_part[i].data(),
                              dv_part[i].data());
      for (int64_t head = 0; head < int64_t{s.B} * s.Hkv; ++head)
        for (int j = 0; j < p.n; ++j)
          for (int d = 0; d < s.D; ++d) {
            dk[((head * s.Lk) + p.k0 + j) * s.D + d] = dk_part[i][(head * p.n + j) * s.D + d];
            dv[((head * s.Lk) + p.k0 + j) * s.D + d] = dv_part[i][(head * p.n + j) * s.D + d];
          }
    }
    const RefForward ref = reference_forward(whole.chunk);
    const RefBackward gref = reference_backward(whole.chunk, whole.dout.data());
    const Bounds bd = error_bounds(whole.chunk, whole.dout.data(), ref);
    const std::string name = cs.name() + " (two chunks)";
    expect_close("o", o, ref.o, bd.o, 2, bd.products(), name);
    expect_close("lse", lse, ref.lse, bd.lse, 2, bd.kappa, name);
    expect_close("dq", dq, gref.dq, bd.dq, 2, bd.products(), name);
    expect_close("dk", dk, gref.dk, bd.dk, 2, bd.products(), name);
    expect_close("dv", dv, gref.dv, bd.dv, 2, bd.products(), name);
  }
}

// A scale other than 1/sqrt(D) (Gemma 4 uses 1.0) and a non-trivial one.
TEST_F(CpuAttention, ExplicitScale) {
  for (float scale : {1.0f, 0.3f}) {
    Case cs = square_case(1, 2, 2, 2 * kTile + 5, 64, DType::F32, {true, 0, true}, MetaKind::PackedImages, 900);
    cs.scale = scale;
    check_case(cs);
  }
}

// Rows with no allowed key: exactly O = 0, LSE = -inf, zero gradients (never NaN), and keys nobody reads get
// exactly zero dK/dV.
TEST_F(CpuAttention, EmptyRowsAreExactlyZero) {
  for (DType t : {DType::F32, DType::BF16}) {
    for (MetaKind kind : {MetaKind::AllPadding, MetaKind::Padded}) {
      Case cs = square_case(1, 1, 2, 3 * kTile, 72, t, {true, 0, false}, kind, 950);
      Tensors tn = make_tensors(cs);
      const KernelResult r = run_kernels(tn.chunk, tn.dout.data());
      const AttnShape& s = tn.chunk.shape;
      for (int h = 0; h < s.Hq; ++h)
        for (int i = 0; i < s.Lq; ++i) {
          if (cs.q_meta[i].doc != kPaddingDoc) continue;
          const int64_t row = int64_t{h} * s.Lq + i;
          EXPECT_EQ(r.lse[row], -std::numeric_limits<float>::infinity());
          for (int d = 0; d < s.D; ++d) {
            EXPECT_EQ(r.o[row * s.D + d], 0.f);
            EXPECT_EQ(r.dq[row * s.D + d], 0.f);
          }
        }
      for (int j = 0; j < s.Lk; ++j) {
        if (cs.k_meta[j].doc != kPaddingDoc) continue;
        for (int d = 0; d < s.D; ++d) {
          EXPECT_EQ(r.dk[int64_t{j} * s.D + d], 0.f);
          EXPECT_EQ(r.dv[int64_t{j} * s.D + d], 0.f);
        }
      }
    }
  }
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

void expect_same_bits(const KernelResult& a, const KernelResult& b, const char* what) {
  EXPECT_TRUE(same_bits(a.o, b.o)) << "o " << what;
  EXPECT_TRUE(same_bits(a.lse, b.lse)) << "lse " << what;
  EXPECT_TRUE(same_bits(a.dq, b.dq)) << "dq " << what;
  EXPECT_TRUE(same_bits(a.dk, b.dk)) << "dk " << what;
  EXPECT_TRUE(same_bits(a.dv, b.dv)) << "dv " << what;
}

// The same inputs give the same bits, run to run and for 1, 2 or 3 OpenMP threads (3 is more threads than this
// machine's cores: the backward's ordered dQ adds must not depend on which threads run at all).
TEST_F(CpuAttention, DeterministicAcrossRunsAndThreads) {
  for (DType t : {DType::F32, DType::BF16}) {
    Case cs = square_case(2, 2, 2, 5 * kTile + 3, 64, t, {true, 100, true}, MetaKind::PackedImages, 990);
    Tensors tn = make_tensors(cs);
    const int saved = omp_get_max_threads();
    omp_set_num_threads(2);
    const KernelResult a = run_kernels(tn.chunk, tn.dout.data());
    const KernelResult b = run_kernels(tn.chunk, tn.dout.data());
    omp_set_num_threads(1);
    const KernelResult c = run_kernels(tn.chunk, tn.dout.data());
    omp_set_num_threads(3);
    const KernelResult d = run_kernels(tn.chunk, tn.dout.data());
    omp_set_num_threads(saved);
    expect_same_bits(a, b, "differs between two runs");
    expect_same_bits(a, c, "differs between 1 and 2 threads");
    expect_same_bits(a, d, "differs between 2 and 3 threads");
  }
}

// Denormals are flushed inside the kernels (cpu/fp_mode.h): a key whose weight is 2^-130 (a denormal) next to a
// key of weight 1 contributes exactly nothing, forward and backward, on every path; and the caller's MXCSR is
// what it was. Keys: k0 = 0 (score 0, the row maximum), k1 with score -130 ln 2 (weight 2^-130 at scale 1);
// values v0 = 0, v1 = 1, dO = 1. Without the flush o, delta, dS1 and so dq, dk1, dv1 would be denormal, not zero.
TEST_F(CpuAttention, DenormalWeightsAreFlushed) {
  constexpr int kD = 8;
  constexpr float kDenormalLog2Weight = -130.f;  // 2^-130 is below float32's smallest normal, 2^-126
  Case cs = square_case(1, 1, 1, 2, kD, DType::F32, {false, 0, false}, MetaKind::OneDoc, 7);
  cs.scale = 1.f;
  Tensors tn = make_tensors(cs);
  std::vector<float> q(2 * kD, 0.f), k(2 * kD, 0.f), v(2 * kD, 0.f), dout(2 * kD, 1.f);
  q[0] = q[kD] = 1.f;
  k[kD] = kDenormalLog2Weight * std::log(2.f);
  for (int d = 0; d < kD; ++d) v[kD + d] = 1.f;
  std::memcpy(tn.q.data(), q.data(), q.size() * sizeof(float));
  std::memcpy(tn.k.data(), k.data(), k.size() * sizeof(float));
  std::memcpy(tn.v.data(), v.data(), v.size() * sizeof(float));
  std::memcpy(tn.dout.data(), dout.data(), dout.size() * sizeof(float));
#if defined(__x86_64__)
  const unsigned mxcsr = _mm_getcsr();
#endif
  const KernelResult r = run_kernels(tn.chunk, tn.dout.data());
#if defined(__x86_64__)
  EXPECT_EQ(_mm_getcsr(), mxcsr) << "the kernels left the caller's floating-point mode changed";
#endif
  for (float x : r.o) EXPECT_EQ(x, 0.f);
  for (float x : r.dq) EXPECT_EQ(x, 0.f);
  for (float x : r.dk) EXPECT_EQ(x, 0.f);
  for (int d = 0; d < kD; ++d) EXPECT_EQ(r.dv[kD + d], 0.f) << d;  // v1's gradient: 2 · 2^-130, flushed
  for (float x : r.lse) EXPECT_EQ(x, 0.f);                         // ln(1 + 2^-130) = 0 in float32 either way
}

// Backward adds into the caller's gradients. dK and dV: each key tile's sum is formed apart and added once, so a
// second call into the same buffers doubles them exactly (x + x is exact in float32). dQ: each key tile's dS K is
// added on its own, in increasing key-tile order (src/cpu/attention_backward.cpp), so after the second call dq is,
// bit for bit, the first call's dq plus each one-tile chunk's dq (that tile's dS K, added to zero) in tile order.
TEST_F(CpuAttention, BackwardAccumulates) {
  Case cs = square_case(1, 1, 2, 2 * kTile + 1, 64, DType::F32, {true, 0, false}, MetaKind::Packed, 995);
  Tensors tn = make_tensors(cs);
  const AttnShape& s = tn.chunk.shape;
  KernelResult r = run_kernels(tn.chunk, tn.dout.data());
  const std::vector<float> dk = r.dk, dv = r.dv;
  std::vector<float> want_dq = r.dq;
  cpu::attention_backward(tn.chunk, tn.dout.data(), r.lse.data(), r.delta.data(), r.dq.data(), r.dk.data(),
                          r.dv.data());
  for (size_t i = 0; i < dk.size(); ++i) ASSERT_EQ(r.dk[i], 2 * dk[i]);
  for (size_t i = 0; i < dv.size(); ++i) ASSERT_EQ(r.dv[i], 2 * dv[i]);
  for (int k0 = 0; k0 < s.Lk; k0 += kTile) {
    const int n = std::min(kTile, s.Lk - k0);
    const std::vector<uint8_t> k = key_slice(tn.k, s, cs.dtype, k0, n), v = key_slice(tn.v, s, cs.dtype, k0, n);
    const std::vector<TokenMeta> meta(cs.k_meta.begin() + k0, cs.k_meta.begin() + k0 + n);  // B = 1
    AttnChunk tile = tn.chunk;
    tile.shape.Lk = n, tile.k = k.data(), tile.v = v.data(), tile.k_meta = meta.data();
    std::vector<float> dq_tile(want_dq.size(), 0.f), dk_tile(static_cast<size_t>(tile.shape.kv_elems()), 0.f);
    std::vector<float> dv_tile(dk_tile.size(), 0.f);
    cpu::attention_backward(tile, tn.dout.data(), r.lse.data(), r.delta.data(), dq_tile.data(), dk_tile.data(),
                            dv_tile.data());
    for (size_t i = 0; i < want_dq.size(); ++i) want_dq[i] += dq_tile[i];
  }
  for (size_t i = 0; i < want_dq.size(); ++i) ASSERT_EQ(r.dq[i], want_dq[i]) << i;
}

TEST_F(CpuAttention, RejectsBadChunks) {
  Case cs = square_case(1, 2, 1, 4, 8, DType::F32, {}, MetaKind::OneDoc, 1);
  cs.Hq = 3;  // not a multiple of Hkv = 2
  Tensors tn = make_tensors(cs);
  std::vector<float> o(64), lse(8);
  EXPECT_THROW(cpu::attention_forward(tn.chunk, o.data(), lse.data()), Error);
}

// The path's exp2 (kernels.h) against std::exp2 over the softmax's range, and its edge cases: documents the accuracy
// the error bound in attention_check.h assumes (< 3e-7 relative). The scalar path calls std::exp2 itself.
TEST_F(CpuAttention, VectorExp2Accuracy) {
  constexpr double kMaxRelErr = 3e-7;
  constexpr int kSteps = 4096;  // points per unit of x
  constexpr int kRange = 126;   // [-126, 0]: normal float32 results
  const cpu::KernelSet& kernels = cpu::kernels_for(cpu::kernel_path().isa);
  std::vector<float> x(kRange * kSteps + 1), y(x.size());
  for (size_t i = 0; i < x.size(); ++i) x[i] = -static_cast<float>(i) / kSteps;
  kernels.exp2(x.data(), y.data(), static_cast<int>(x.size()));
  double worst = 0;
  for (size_t i = 0; i < x.size(); ++i)
    worst = std::max(worst, std::fabs(y[i] - std::exp2(double{x[i]})) / std::exp2(double{x[i]}));
  EXPECT_LT(worst, kMaxRelErr);
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const float edge[] = {-inf, 0.f, -1000.f, nan, -1.f};  // 5 values: also the odd tail past whole vectors
  float out[std::size(edge)];
  kernels.exp2(edge, out, static_cast<int>(std::size(edge)));
  EXPECT_EQ(out[0], 0.f);  // -inf -> exactly 0, not NaN
  EXPECT_EQ(out[1], 1.f);  // 2^0 exactly: the polynomial's constant term is 1
  EXPECT_EQ(out[2], 0.f);
  EXPECT_TRUE(std::isnan(out[3]));
  EXPECT_EQ(out[4], 0.5f);  // f = 0: exactly 2^-1
}

// The path in use is the one RINGFLEX_ISA forces (CTest runs this binary under each value), or without it the best
// one this CPU supports; with the tile model installed (the `.amx-model` runs), the AMX path.
TEST_F(CpuAttention, ForcedPathIsTaken) {
  const char* forced = std::getenv("RINGFLEX_ISA");
  const cpu::KernelPath& path = cpu::kernel_path();
  if (amx_tile_model_requested()) {
    EXPECT_EQ(path.isa, cpu::Isa::Avx512) << cpu::describe(path);
    EXPECT_EQ(path.bf16, cpu::Bf16Product::Amx) << cpu::describe(path);
    return;
  }
  if (!forced || !*forced) {
    // Not forced: the process runs the best path this CPU supports, as the selection computes it afresh. Where
    // CPUID cannot tell (an Intel CPU with AVX512_BF16 and no AMX) the process's tile race decided, and a race is
    // timing, not a fact to recompute (an AddressSanitizer build slows the float32 tile more than the bf16 one and
    // can reverse it): its outcome is replayed.
    const auto replay_race = [&] { return path.bf16 == cpu::Bf16Product::Dpbf16 ? cpu::kDpbf16MinSpeedup : 0.0; };
    const cpu::KernelPath best = cpu::select_path(cpu::detect_cpu(), nullptr, replay_race);
    EXPECT_EQ(path.isa, best.isa) << cpu::describe(path);
    EXPECT_EQ(path.bf16, best.bf16) << cpu::describe(path);
    EXPECT_EQ(path.reason.rfind("tile race", 0) == 0, best.reason.rfind("tile race", 0) == 0) << cpu::describe(path);
    EXPECT_EQ(cpu::kernels_for(path.isa).isa, path.isa);
    return;
  }
  const std::string_view name = forced;
  EXPECT_EQ(path.bf16 == cpu::Bf16Product::Amx, name == "amx");
  EXPECT_EQ(path.bf16 == cpu::Bf16Product::Dpbf16, name == "avx512-dpbf16");
  const bool avx512 = name == "amx" || name.starts_with("avx512");
  EXPECT_EQ(std::string_view(cpu::isa_name(path.isa)), avx512 ? "avx512" : name);
  EXPECT_EQ(cpu::kernels_for(path.isa).isa, path.isa);
}

// The AMX score product on its own, against exact integer dot products: small integers are exact in bf16, their
// products and sums (|c| < 2^24) exact in float32, so any layout mistake (the VNNI pairs of bt, the 16-row blocks
// of a, the four 16-key blocks of c) shows as an exact mismatch. The sweep above runs the whole bf16 kernel on
// this path whenever it is active. This test calls the tile product directly, so it runs wherever the hardware
// has AMX, whichever path RINGFLEX_ISA forces, and on the software tile unit in the `.amx-model` runs; it is skipped
// (and says so) only on a CPU without AMX-TILE/AMX-BF16 or when Linux refused the tile state, with no unit installed.
TEST_F(CpuAttention, AmxScoreTileIsExact) {
  if (!cpu::detect_cpu().amx && cpu::detail::amx_tile_model() == nullptr)
    GTEST_SKIP() << "this CPU lacks AMX (AMX-TILE/AMX-BF16), or Linux refused the tile state; bf16 ran on "
                 << cpu::describe(cpu::kernel_path());
  constexpr int kRows = 20, kDp = 64, kKeys = cpu::kTileK, kPadRows = 32;  // two 16-row blocks, the last partial
  auto a_val = [](int r, int d) { return static_cast<float>((r * 3 + d) % 11 - 5); };
  auto b_val = [](int d, int j) { return static_cast<float>((d * 5 + j * 7) % 13 - 6); };
  auto bits = [](float x) { return uint32_t{float_to_bf16(x).bits}; };
  std::vector<uint32_t> a(kPadRows * kDp / 2, 0), bt(kDp / 2 * kKeys);  // a: [32, Dp] pairs; bt: [Dp/2, 64] VNNI
  for (int r = 0; r < kRows; ++r)
    for (int p = 0; p < kDp / 2; ++p) a[r * kDp / 2 + p] = bits(a_val(r, 2 * p)) | bits(a_val(r, 2 * p + 1)) << 16;
  for (int p = 0; p < kDp / 2; ++p)
    for (int j = 0; j < kKeys; ++j) bt[p * kKeys + j] = bits(b_val(2 * p, j)) | bits(b_val(2 * p + 1, j)) << 16;
  std::vector<float> c(kPadRows * kKeys);
  {
    const cpu::detail::AmxTileScope tiles(true);
    cpu::detail::amx_abt(a.data(), kDp / 2, bt.data(), kDp, kRows, c.data());
  }
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < kKeys; ++j) {
      int64_t want = 0;
      for (int d = 0; d < kDp; ++d) want += static_cast<int64_t>(a_val(r, d)) * static_cast<int64_t>(b_val(d, j));
      ASSERT_EQ(c[r * kKeys + j], static_cast<float>(want)) << "row " << r << " key " << j;
    }
}

}  // namespace
}  // namespace rf::testing
