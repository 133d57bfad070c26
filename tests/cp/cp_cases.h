// The CP attention sweep, written once against the communicator interface and run by the loopback test
// (ranks as threads) and the MPI test (ranks as processes under mpirun).
//
// A case is a full row problem (Q, K, V, dout, metadata) generated identically on every rank from a seed. It runs
// through the library's one whole-row pipeline (cp_attention_rows: shard, CP forward and backward, gather to rank
// 0), and rank 0 (the only one that asserts) compares against the scalar reference (double) on the unsharded row.
//
// Tolerance. The reference is exact up to double rounding; a CP result differs from it by the kernels' float32
// rounding (err1: the same kernels run as one rank, P = 1, measured on the same inputs) plus what the ring adds:
// one LSE merge per step for O and LSE, one float32 addition per contributing rank for dK/dV. Each adds at most a
// few float32 ulps of the largest magnitude involved, so
//     |cp - ref| <= 2 * err1 + kUlpsPerRank * P * eps_f32 * max|ref|.
// The P = 1 run is held the same way (P = 1) to the kernels called directly on the whole row, whose own error
// tests/cpu bounds: err1 is then the kernels' rounding, not a CP-layer mistake that every P shares.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "comm/loopback_comm.h"
#include "common/random_case.h"
#include "cp/cp_attention.h"
#include "cp/rows.h"
#include "cp/shard.h"
#include "cpu/attention_check.h"
#include "cpu/isa.h"
#include "reference/attention_ref.h"

namespace rf::cp::cases {

constexpr comm::Timeout kCaseTimeout{60000};  // a rank may wait while rank 0 runs the reference
constexpr double kUlpsPerRank = 8;            // merge rescale (2 roundings) + add, with slack for exp/log
constexpr double kEpsF32 = std::numeric_limits<float>::epsilon();

struct Case {
  std::string name;
  int B = 1, Hq = 2, Hkv = 1, S = 64, D = 16;
  DType dtype = DType::F32;
  LayerMask mask;
  testing::MetaKind kind = testing::MetaKind::OneDoc;
  uint64_t seed = 1;
  std::optional<float> scale;  // unset: 1/sqrt(D)
};

// The whole row problem. q, dout: [B, Hq, S, D]; k, v: [B, Hkv, S, D] in dtype; meta: [B, S].
struct Inputs {
  std::vector<uint8_t> q, k, v, dout;
  std::vector<TokenMeta> meta;
};

inline Inputs make_inputs(const Case& c) {
  const int64_t nq = int64_t{c.B} * c.Hq * c.S * c.D, nkv = int64_t{c.B} * c.Hkv * c.S * c.D;
  return {testing::random_tensor(nq, c.dtype, c.seed * 11 + 1), testing::random_tensor(nkv, c.dtype, c.seed * 11 + 2),
          testing::random_tensor(nkv, c.dtype, c.seed * 11 + 3), testing::random_tensor(nq, c.dtype, c.seed * 11 + 4),
          testing::random_meta(c.B, c.S, c.kind, c.seed)};
}

// Results in row order. o, dq: [B, Hq, S, D]; lse: [B, Hq, S]; dk, dv: [B, Hkv, S, D].
struct Result {
  std::vector<float> o, lse, dq, dk, dv;
};

// The case's whole rows as cp_attention_rows reads them (every rank passes the same full tensors).
inline RowsInput rows_input(const Case& c, const Inputs& in) {
  return RowsInput{AttnShape{c.B, c.Hq, c.Hkv, c.S, c.S, c.D},
                   c.dtype,
                   in.q.data(),
                   in.k.data(),
                   in.v.data(),
                   in.dout.data(),
                   in.meta.data()};
}

// CP forward and backward of the case on this communicator through cp_attention_rows, under shard map `map` when
// given, else the map shard_map_for(scheme) picks; with p's algorithm, traffic and plan. p.stats receives the
// forward's figures, bwd_stats the backward's. Rank 0 returns the full result, the other ranks empty vectors.
inline Result run_rows(comm::Communicator& comm, const Case& c, const Inputs& in, const ShardMap* map, Scheme scheme,
                       const CpParams& p, CpStats* bwd_stats) {
  const RowsInput rows = rows_input(c, in);
  RowsOptions opt;
  opt.scheme = scheme_name(scheme);
  opt.map = map;
  opt.params = p;
  opt.gather_root = 0;
  opt.collect_stats = p.stats != nullptr || bwd_stats != nullptr;
  RowsResult ran = cp_attention_rows(comm, rows, opt);
  if (p.stats) *p.stats = ran.forward_stats;
  if (bwd_stats) *bwd_stats = ran.backward_stats;
  return {std::move(ran.out), std::move(ran.lse), std::move(ran.dq), std::move(ran.dk), std::move(ran.dv)};
}

// Under an explicit shard map `m`.
inline Result run_sharded(comm::Communicator& comm, const Case& c, const Inputs& in, const ShardMap& m,
                          const CpParams& p, CpStats* bwd_stats = nullptr) {
  return run_rows(comm, c, in, &m, m.scheme, p, bwd_stats);
}

// Sharded by `scheme` over this communicator's ranks.
inline Result run_cp(comm::Communicator& comm, const Case& c, const Inputs& in, Scheme scheme, Algo algo,
                     RingTraffic traffic = RingTraffic::Planned, CpStats* fwd_stats = nullptr,
                     CpStats* bwd_stats = nullptr) {
  const CpParams p{c.mask, c.scale, algo, scheme, kCaseTimeout, fwd_stats, traffic};
  return run_rows(comm, c, in, nullptr, scheme, p, bwd_stats);
}

// The same problem on one rank (P = 1 through the same code: no sharding padding, one chunk).
inline Result run_single(const Case& c, const Inputs& in) {
  Result res;
  comm::run_ranks(1, [&](comm::Communicator& one) {
    res = run_cp(one, c, in, Scheme::Contiguous, Algo::Ring, RingTraffic::Chunks);
  });
  return res;
}

struct Reference {
  RefForward fwd;
  RefBackward bwd;
};

// The case's whole rows as one chunk, with the scale resolved here, independently of the CP layer.
inline AttnChunk whole_chunk(const Case& c, const Inputs& in) {
  return AttnChunk{AttnShape{c.B, c.Hq, c.Hkv, c.S, c.S, c.D},
                   c.dtype,
                   in.q.data(),
                   in.k.data(),
                   in.v.data(),
                   in.meta.data(),
                   in.meta.data(),
                   c.mask,
                   c.scale.value_or(default_scale(c.D))};
}

inline Reference run_reference(const Case& c, const Inputs& in) {
  const AttnChunk chunk = whole_chunk(c, in);
  return {reference_forward(chunk), reference_backward(chunk, in.dout.data())};
}

// The cpu kernels called directly on the whole rows, as tests/cpu runs them (attention_check.h, which bounds their
// rounding against the reference): the baseline the P = 1 CP run is held to, so a mistake in the CP layer that
// P = 1 shares (a scale or mask passed on wrongly) cannot hide in the P = 1 error that the P > 1 tolerance is
// built on.
inline Result run_kernels_directly(const Case& c, const Inputs& in) {
  testing::KernelResult k = testing::run_kernels(whole_chunk(c, in), in.dout.data());
  return {std::move(k.o), std::move(k.lse), std::move(k.dq), std::move(k.dk), std::move(k.dv)};
}

inline double max_abs(const std::vector<double>& a) {
  double m = 0;
  for (double x : a)
    if (std::isfinite(x)) m = std::max(m, std::fabs(x));
  return m;
}

// Largest |got - ref| over finite reference entries; infinite entries (LSE of a query that sees nothing) must
// match exactly, as must NaN-freedom.
inline double max_err(const std::vector<float>& got, const std::vector<double>& ref, const std::string& what) {
  EXPECT_EQ(got.size(), ref.size()) << what;
  double e = 0;
  for (size_t i = 0; i < std::min(got.size(), ref.size()); ++i) {
    if (!std::isfinite(ref[i])) {
      EXPECT_EQ(static_cast<double>(got[i]), ref[i]) << what << " at " << i;
      continue;
    }
    EXPECT_TRUE(std::isfinite(got[i])) << what << " at " << i << " is " << got[i];
    e = std::max(e, std::fabs(got[i] - ref[i]));
  }
  return e;
}

// Asserts got is as close to the reference as the tolerance above allows, given the single-rank result.
inline void expect_close(const std::vector<float>& got, const std::vector<float>& single,
                         const std::vector<double>& ref, int P, const std::string& what) {
  const double err1 = max_err(single, ref, what + " (P = 1)");
  const double err = max_err(got, ref, what);
  const double tol = 2 * err1 + kUlpsPerRank * P * kEpsF32 * std::max(1.0, max_abs(ref));
  EXPECT_LE(err, tol) << what << ": P = 1 error " << err1;
}

inline void expect_same_bits(const Result& a, const Result& b, const std::string& what) {
  EXPECT_TRUE(a.o == b.o) << what << ": out";
  EXPECT_TRUE(a.lse == b.lse) << what << ": lse";
  EXPECT_TRUE(a.dq == b.dq) << what << ": dq";
  EXPECT_TRUE(a.dk == b.dk) << what << ": dk";
  EXPECT_TRUE(a.dv == b.dv) << what << ": dv";
}

// What check_case runs for each shard scheme: the ring with both traffics and the all-gather baseline.
struct Variant {
  Algo algo;
  RingTraffic traffic;
  const char* name;
};
constexpr Variant kVariants[] = {{Algo::Ring, RingTraffic::Chunks, "chunk ring"},
                                 {Algo::Ring, RingTraffic::Planned, "planned ring"},
                                 {Algo::AllGather, RingTraffic::Planned, "allgather"}};

// The full check of one case on this communicator: both schemes, every variant, against the reference and
// P = 1; both rings twice (identical bits); and, when `compare_loopback`, both rings (the default planned ring on
// both schemes, the chunk ring on contiguous shards) on P loopback threads inside rank 0, which must give this
// backend's bits.
inline void check_case(comm::Communicator& comm, const Case& c, bool compare_loopback) {
  SCOPED_TRACE(c.name + " at P = " + std::to_string(comm.size()));
  const int P = comm.size();
  const Inputs in = make_inputs(c);
  std::vector<Result> runs;
  std::vector<std::string> names;
  for (Scheme s : {Scheme::Contiguous, Scheme::Zigzag})
    for (const Variant& v : kVariants) {
      runs.push_back(run_cp(comm, c, in, s, v.algo, v.traffic));
      names.push_back(scheme_name(s) + " " + v.name);
    }
  const Result chunks_again = run_cp(comm, c, in, Scheme::Contiguous, Algo::Ring, RingTraffic::Chunks);
  const Result planned_again = run_cp(comm, c, in, Scheme::Contiguous, Algo::Ring, RingTraffic::Planned);
  if (comm.rank() != 0) return;

  expect_same_bits(runs[0], chunks_again, "second chunk ring run");
  expect_same_bits(runs[1], planned_again, "second planned ring run");
  if (compare_loopback) {
    // runs[] index of (scheme, variant): kVariants per scheme, contiguous first.
    const auto run_index = [](Scheme s, int variant) {
      return (s == Scheme::Contiguous ? 0 : std::size(kVariants)) + static_cast<size_t>(variant);
    };
    constexpr int kChunkRing = 0, kPlannedRing = 1;
    for (const auto& [scheme, variant] :
         {std::pair{Scheme::Contiguous, kChunkRing}, std::pair{Scheme::Contiguous, kPlannedRing},
          std::pair{Scheme::Zigzag, kPlannedRing}}) {
      Result loop;
      comm::run_ranks(P, [&](comm::Communicator& lc) {
        Result mine = run_cp(lc, c, in, scheme, Algo::Ring, kVariants[variant].traffic);
        if (lc.rank() == 0) loop = std::move(mine);
      });
      expect_same_bits(runs[run_index(scheme, variant)], loop,
                       "loopback vs " + comm.backend() + ", " + names[run_index(scheme, variant)]);
    }
  }
  const Result single = run_single(c, in);
  const Reference ref = run_reference(c, in);
  const Result direct = run_kernels_directly(c, in);
  expect_close(single.o, direct.o, ref.fwd.o, 1, "P = 1 out");
  expect_close(single.lse, direct.lse, ref.fwd.lse, 1, "P = 1 lse");
  expect_close(single.dq, direct.dq, ref.bwd.dq, 1, "P = 1 dq");
  expect_close(single.dk, direct.dk, ref.bwd.dk, 1, "P = 1 dk");
  expect_close(single.dv, direct.dv, ref.bwd.dv, 1, "P = 1 dv");
  for (size_t i = 0; i < runs.size(); ++i) {
    const std::string& n = names[i];
    expect_close(runs[i].o, single.o, ref.fwd.o, P, n + " out");
    expect_close(runs[i].lse, single.lse, ref.fwd.lse, P, n + " lse");
    expect_close(runs[i].dq, single.dq, ref.bwd.dq, P, n + " dq");
    expect_close(runs[i].dk, single.dk, ref.bwd.dk, P, n + " dk");
    expect_close(runs[i].dv, single.dv, ref.bwd.dv, P, n + " dv");
  }
}

// The foundation sweep's masks and metadata, in small shapes with awkward S.
inline std::vector<Case> sweep_cases() {
  using testing::MetaKind;
  const LayerMask non_causal{false, 0, false}, causal{true, 0, false};
  const LayerMask w1{true, 1, false}, w7{true, 7, false}, w512{true, 512, false};
  const LayerMask bidir_w7{false, 7, false}, vision_w7{true, 7, true}, vision_full{true, 0, true};
  std::vector<Case> v;
  const auto add = [&](std::string name, LayerMask m, MetaKind kind, int S) {
    Case c;
    c.name = std::move(name);
    c.mask = m;
    c.kind = kind;
    c.S = S;
    c.seed = v.size() + 1;
    v.push_back(c);
  };
  add("non_causal one_doc", non_causal, MetaKind::OneDoc, 61);
  add("causal one_doc", causal, MetaKind::OneDoc, 64);
  add("causal W=1 packed", w1, MetaKind::Packed, 37);
  add("causal W=7 packed", w7, MetaKind::Packed, 90);
  add("causal W=512 (longer than the row) padded", w512, MetaKind::Padded, 77);
  add("bidirectional W=7 one_doc", bidir_w7, MetaKind::OneDoc, 50);
  add("vision W=7 images crossing ranks", vision_w7, MetaKind::PackedImages, 101);
  add("vision full padded", vision_full, MetaKind::Padded, 83);
  add("causal all_padding", causal, MetaKind::AllPadding, 19);
  add("causal S=3 (fewer tokens than ranks)", causal, MetaKind::OneDoc, 3);
  add("non_causal S=1", non_causal, MetaKind::OneDoc, 1);
  {
    Case c;
    c.name = "GQA 16:1 causal packed";
    c.Hq = 16, c.Hkv = 1, c.S = 40, c.D = 8, c.kind = MetaKind::Packed, c.seed = 101;
    v.push_back(c);
  }
  {
    Case c;
    c.name = "D=512 vision W=7";
    c.Hq = 2, c.Hkv = 1, c.S = 30, c.D = 512, c.mask = vision_w7, c.kind = MetaKind::PackedImages, c.seed = 102;
    v.push_back(c);
  }
  {
    Case c;
    c.name = "bf16 B=2 causal W=7 padded, scale 1";
    c.B = 2, c.Hq = 4, c.Hkv = 2, c.S = 70, c.D = 32, c.dtype = DType::BF16, c.mask = w7, c.scale = 1.f;
    c.kind = MetaKind::Padded, c.seed = 103;
    v.push_back(c);
  }
  {
    // Scale 0 is a scale like any other (every allowed score 0: O is the mean of the allowed values), not "unset".
    Case c;
    c.name = "scale 0 causal packed";
    c.Hq = 2, c.Hkv = 1, c.S = 45, c.D = 16, c.mask = {true, 0, false}, c.kind = MetaKind::Packed, c.scale = 0.f;
    c.seed = 104;
    v.push_back(c);
  }
  return v;
}

// Rows longer than one key tile on every rank at any P: S = 257 P + 19 gives each rank L = 259..276 tokens (five
// 64-key tiles, the last one short) and an S that is not a multiple of 64, so ring steps carry several tiles,
// halos span tiles, and tiles straddle shard and document boundaries. Small heads keep the scalar reference quick.
inline std::vector<Case> long_row_cases(int P) {
  using testing::MetaKind;
  constexpr int kTokensPerRank = 257, kExtraTokens = 19;
  const int S = kTokensPerRank * P + kExtraTokens;
  std::vector<Case> v;
  const auto add = [&](std::string name, LayerMask m, MetaKind kind) {
    Case c;
    c.name = std::move(name) + " S=" + std::to_string(S);
    c.mask = m;
    c.kind = kind;
    c.S = S;
    c.D = 16;
    c.seed = 300 + v.size();
    v.push_back(c);
  };
  add("long causal one_doc", LayerMask{true, 0, false}, MetaKind::OneDoc);
  add("long vision W=100 images crossing ranks", LayerMask{true, 100, true}, MetaKind::PackedImages);
  add("long bidirectional W=90 packed", LayerMask{false, 90, false}, MetaKind::Packed);
  {
    Case c;
    c.name = "long bf16 B=2 GQA 4:1 causal W=130 padded S=" + std::to_string(S);
    c.B = 2, c.Hq = 4, c.Hkv = 1, c.S = S, c.D = 24, c.dtype = DType::BF16, c.mask = LayerMask{true, 130, false};
    c.kind = MetaKind::Padded, c.seed = 310;
    v.push_back(c);
  }
  return v;
}

// Packed parity (the seed's stated target): CP forward and backward of the packed row [A, B] equal those of A
// alone and of B alone, slice by slice (contiguous shards with the chunk ring, zigzag with the planned ring). Both
// sides are float32 CP runs at the same P that differ only in how keys fall into chunks, so they agree to the merge
// rounding of both: 2 * kUlpsPerRank * P ulps of the magnitude.
// Except where bf16 inputs run on vdpbf16ps or AMX (src/cpu/isa.h: rounds_bf16_weights): those paths round the float32
// weights P and dS to bf16, P relative to the running softmax max of its key tile, and A alone and A inside [A, B]
// fall into different key tiles (B starts at token a.S), so the same weight rounds differently on the two sides,
// by up to 2^-8 of it (docs/numerics.md), far above the merge rounding. There each side is held to the file's own
// rule against the scalar reference instead: |packed - part| <= |packed - ref| + |part - ref| <= 3 * err_part,
// with err_part the part's measured error (2 * err_part for the packed side, the 2 * err1 rule above).
inline void check_packed_parity(comm::Communicator& comm, const LayerMask& mask, DType dtype) {
  using testing::MetaKind;
  const int P = comm.size();
  Case a, b, ab;
  a.name = "A", a.S = 45, a.kind = MetaKind::PackedImages, a.seed = 201;
  b.name = "B", b.S = 38, b.kind = MetaKind::PackedImages, b.seed = 202;
  for (Case* c : {&a, &b}) c->mask = mask, c->dtype = dtype, c->Hq = 4, c->Hkv = 2, c->D = 16;
  Inputs ia = make_inputs(a), ib = make_inputs(b);
  // Each alone is one document; images keep their groups.
  for (TokenMeta& t : ia.meta) t.doc = 1;
  for (TokenMeta& t : ib.meta) t.doc = 1;
  ab = a;
  ab.name = "[A, B]", ab.S = a.S + b.S;
  Inputs iab;
  const size_t es = dtype_size(dtype);
  // Concatenate [H, S, D] tensors along S, head by head (B = 1).
  const auto concat_rows = [&](const std::vector<uint8_t>& x, const std::vector<uint8_t>& y, int H) {
    std::vector<uint8_t> out;
    const size_t xa = static_cast<size_t>(a.S) * a.D * es, yb = static_cast<size_t>(b.S) * b.D * es;
    for (int h = 0; h < H; ++h) {
      out.insert(out.end(), x.begin() + h * xa, x.begin() + (h + 1) * xa);
      out.insert(out.end(), y.begin() + h * yb, y.begin() + (h + 1) * yb);
    }
    return out;
  };
  iab.q = concat_rows(ia.q, ib.q, a.Hq);
  iab.dout = concat_rows(ia.dout, ib.dout, a.Hq);
  iab.k = concat_rows(ia.k, ib.k, a.Hkv);
  iab.v = concat_rows(ia.v, ib.v, a.Hkv);
  int32_t groups_in_a = 0;
  for (const TokenMeta& t : ia.meta) groups_in_a = std::max(groups_in_a, t.group + 1);
  iab.meta = ia.meta;
  for (TokenMeta t : ib.meta) {
    t.idx += a.S;
    t.doc = 2;
    if (t.group >= 0) t.group += groups_in_a;
    iab.meta.push_back(t);
  }

  const bool rounds_weights = dtype == DType::BF16 && cpu::rounds_bf16_weights(cpu::kernel_path().bf16);
  const Reference ref_a = rounds_weights && comm.rank() == 0 ? run_reference(a, ia) : Reference{};
  const Reference ref_b = rounds_weights && comm.rank() == 0 ? run_reference(b, ib) : Reference{};
  for (Scheme scheme : {Scheme::Contiguous, Scheme::Zigzag}) {
    const RingTraffic traffic = scheme == Scheme::Contiguous ? RingTraffic::Chunks : RingTraffic::Planned;
    const Result ra = run_cp(comm, a, ia, scheme, Algo::Ring, traffic);
    const Result rb = run_cp(comm, b, ib, scheme, Algo::Ring, traffic);
    const Result rab = run_cp(comm, ab, iab, scheme, Algo::Ring, traffic);
    if (comm.rank() != 0) continue;
    // Compare one [H, S_part, D] slice of the packed result (starting at token `first`) with a part's result.
    // part_ref: the part's reference where weights are rounded, else null.
    const auto expect_slice = [&](const std::vector<float>& packed, const std::vector<float>& part,
                                  const std::vector<double>* part_ref, int H, int S_part, int W, int first,
                                  const std::string& what) {
      double mag = 1;
      for (float x : part)
        if (std::isfinite(x)) mag = std::max(mag, static_cast<double>(std::fabs(x)));
      const double rounding = part_ref ? 3 * max_err(part, *part_ref, what + " (part)") : 0;
      const double tol = 2 * kUlpsPerRank * P * kEpsF32 * mag + rounding;
      for (int h = 0; h < H; ++h)
        for (int t = 0; t < S_part; ++t)
          for (int d = 0; d < W; ++d) {
            const float got = packed[(static_cast<size_t>(h) * ab.S + first + t) * W + d];
            const float want = part[(static_cast<size_t>(h) * S_part + t) * W + d];
            if (std::isinf(want)) {
              ASSERT_EQ(got, want) << what;
            } else {
              ASSERT_LE(std::fabs(got - want), tol) << what << " head " << h << " token " << t << " dim " << d;
            }
          }
    };
    const std::string tag = scheme_name(scheme) + " P=" + std::to_string(P) + " ";
    for (const auto& [part, ref, first, S_part] :
         {std::tuple{&ra, &ref_a, 0, a.S}, std::tuple{&rb, &ref_b, a.S, b.S}}) {
      // The reference exists (was computed) only where weights are rounded.
      const auto refd = [&](const std::vector<double>& r) { return rounds_weights ? &r : nullptr; };
      expect_slice(rab.o, part->o, refd(ref->fwd.o), a.Hq, S_part, a.D, first, tag + "out");
      expect_slice(rab.lse, part->lse, refd(ref->fwd.lse), a.Hq, S_part, 1, first, tag + "lse");
      expect_slice(rab.dq, part->dq, refd(ref->bwd.dq), a.Hq, S_part, a.D, first, tag + "dq");
      expect_slice(rab.dk, part->dk, refd(ref->bwd.dk), a.Hkv, S_part, a.D, first, tag + "dk");
      expect_slice(rab.dv, part->dv, refd(ref->bwd.dv), a.Hkv, S_part, a.D, first, tag + "dv");
    }
  }
}

}  // namespace rf::cp::cases
