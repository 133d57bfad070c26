// Non-finite inputs through the cpu kernels (docs/numerics.md):
//   - a NaN or infinity in a token no query reads (padding, keys outside every query's mask, rows that read
//     nothing) changes no output bit: the kernels skip forbidden pairs instead of multiplying them by 0;
//   - one read by some query makes non-finite exactly the outputs the scalar reference makes non-finite (the
//     rows and columns the math puts it in, never a row that looks masked), and leaves every other output bit as
//     it was on clean inputs.
// Both are exact comparisons, no tolerance: each output element is computed by the same operations in the same
// order whether or not a pair it does not read holds a non-finite value.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "attention_check.h"
#include "common/nonfinite.h"
#include "common/random_case.h"
#include "kernel_path_test.h"

namespace rf::testing {
namespace {

class CpuNonFinite : public KernelPathTest {};

constexpr int kTile = cpu::kTileQ;

struct Shape {
  int B, Hkv, group, S, D;
  DType dtype;
};

// Tile-straddling rows, GQA up to 16:1, generic and fast head dims, both dtypes.
const Shape kShapes[] = {
    {2, 1, 1, 1, 8, DType::F32},
    {1, 2, 2, 3, 72, DType::BF16},
    {1, 1, 16, kTile + 1, 64, DType::F32},
    {2, 1, 2, 2 * kTile + 5, 72, DType::F32},
    {1, 2, 1, 3 * kTile - 1, 128, DType::BF16},
    {1, 1, 2, kTile + 7, 512, DType::F32},
};

std::vector<LayerMask> masks() {
  return {{true, 0, false}, {true, 0, true}, {true, 7, true}, {false, 0, true}, {false, 5, false}, {true, 1, false}};
}

const MetaKind kKinds[] = {MetaKind::Padded, MetaKind::PackedImages, MetaKind::Packed, MetaKind::AllPadding};

Case make_case(const Shape& sh, const LayerMask& mask, MetaKind kind, uint64_t seed) {
  Case cs;
  cs.B = sh.B, cs.Hkv = sh.Hkv, cs.Hq = sh.Hkv * sh.group, cs.Lq = cs.Lk = sh.S, cs.D = sh.D, cs.dtype = sh.dtype;
  cs.mask = mask;
  cs.q_meta = random_meta(sh.B, sh.S, kind, seed);
  cs.k_meta = cs.q_meta;
  cs.seed = seed;
  return cs;
}

void expect_bits(const char* what, const std::vector<float>& got, const std::vector<float>& want,
                 const std::string& name) {
  const int64_t i = first_difference(got, want);
  EXPECT_EQ(i, -1) << what << "[" << i << "] = " << (i >= 0 ? got[i] : 0.f) << ", clean run "
                   << (i >= 0 ? want[i] : 0.f) << " in " << name;
}

void expect_same_result(const KernelResult& got, const KernelResult& want, const std::string& name) {
  expect_bits("o", got.o, want.o, name);
  expect_bits("lse", got.lse, want.lse, name);
  expect_bits("dq", got.dq, want.dq, name);
  expect_bits("dk", got.dk, want.dk, name);
  expect_bits("dv", got.dv, want.dv, name);
}

// The property: random masks and metadata, NaN/±inf in every element of every token no result may depend on.
TEST_F(CpuNonFinite, UnreadTokensChangeNoOutputBit) {
  uint64_t seed = 7000;
  int poisoned_cases = 0;
  for (const Shape& sh : kShapes)
    for (const LayerMask& mask : masks())
      for (MetaKind kind : kKinds) {
        if (sh.D >= 128 && kind != MetaKind::Padded) continue;  // the big head dims: one kind, to bound the cost
        const Case cs = make_case(sh, mask, kind, ++seed);
        Tensors clean = make_tensors(cs);
        const KernelResult want = run_kernels(clean.chunk, clean.dout.data());
        Tensors bad = make_tensors(cs);
        const int64_t written = poison_unread(cs.mask, cs.q_meta.data(), cs.k_meta.data(), cs.B, cs.Hq, cs.Hkv, cs.Lq,
                                              cs.Lk, cs.D, cs.dtype, {&bad.q, &bad.k, &bad.v, &bad.dout}, seed);
        poisoned_cases += written > 0;
        expect_same_result(run_kernels(bad.chunk, bad.dout.data()), want, cs.name() + " " + kind_name(kind));
      }
  EXPECT_GT(poisoned_cases, 40) << "the sweep should put non-finite values somewhere in most cases";
}

// A ring step's chunk: queries from one part of the row, keys from another, so whole key tiles are unread.
TEST_F(CpuNonFinite, UnreadTokensOfARingChunk) {
  for (DType t : {DType::F32, DType::BF16}) {
    const int S = 4 * kTile + 9;
    const std::vector<TokenMeta> row = random_meta(1, S, MetaKind::Padded, 77);
    Case cs;
    cs.Hq = 4, cs.Hkv = 2, cs.D = 64, cs.dtype = t, cs.mask = {true, 3 * kTile, true}, cs.seed = 78;
    cs.q_meta.assign(row.begin() + 2 * kTile, row.end());        // the later part's queries
    cs.k_meta.assign(row.begin(), row.begin() + 2 * kTile + 3);  // against the earlier keys
    cs.Lq = static_cast<int>(cs.q_meta.size()), cs.Lk = static_cast<int>(cs.k_meta.size());
    Tensors clean = make_tensors(cs);
    const KernelResult want = run_kernels(clean.chunk, clean.dout.data());
    Tensors bad = make_tensors(cs);
    ASSERT_GT(poison_unread(cs.mask, cs.q_meta.data(), cs.k_meta.data(), 1, cs.Hq, cs.Hkv, cs.Lq, cs.Lk, cs.D, t,
                            {&bad.q, &bad.k, &bad.v, &bad.dout}, 79),
              0);
    expect_same_result(run_kernels(bad.chunk, bad.dout.data()), want, cs.name());
  }
}

// The outputs one bad input element can reach: rows (h, i) that read it, and the keys those rows read.
// row: [B·Hq·Lq] (o, lse, dq rows); key: [B·Hkv·Lk] (dk, dv rows). Row b = 0 only, as the tests poison there.
struct Affected {
  std::vector<char> row, key;
};

Affected affected_by(const Case& cs, bool on_key, int head, int token) {
  Affected a{std::vector<char>(static_cast<size_t>(cs.B) * cs.Hq * cs.Lq, 0),
             std::vector<char>(static_cast<size_t>(cs.B) * cs.Hkv * cs.Lk, 0)};
  const int group = cs.Hq / cs.Hkv;
  for (int h = 0; h < cs.Hq; ++h)
    for (int i = 0; i < cs.Lq; ++i) {
      const bool reads =
          on_key ? h / group == head && allowed(cs.mask, cs.q_meta[i], cs.k_meta[token]) : h == head && i == token;
      if (!reads) continue;
      bool reads_any = false;
      for (int j = 0; j < cs.Lk; ++j)
        if (allowed(cs.mask, cs.q_meta[i], cs.k_meta[j])) a.key[int64_t{h / group} * cs.Lk + j] = reads_any = true;
      a.row[int64_t{h} * cs.Lq + i] = reads_any;
    }
  return a;
}

// Outside the affected rows every output keeps the clean run's bits; inside, an output is non-finite exactly
// where the reference's is (their finite values differ by rounding, which the other kernel tests bound).
// got, clean: [rows, width]; ref: the reference's.
void expect_propagation(const char* what, const std::vector<float>& got, const std::vector<double>& ref,
                        const std::vector<float>& clean, const std::vector<char>& affected, int width,
                        const std::string& name) {
  ASSERT_EQ(got.size(), ref.size());
  ASSERT_EQ(got.size(), affected.size() * width);
  for (size_t i = 0; i < got.size(); ++i) {
    if (affected[i / width]) {
      ASSERT_EQ(std::isfinite(got[i]), std::isfinite(ref[i]))
          << what << "[" << i << "] = " << got[i] << ", reference " << ref[i] << " in " << name;
    } else {
      ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(clean[i]))
          << what << "[" << i << "] = " << got[i] << " changed from " << clean[i] << " though it does not read the "
          << "bad element, in " << name;
    }
  }
}

// One NaN or infinity in one element of q, k, v or dout of a token that is read: compare against the reference.
TEST_F(CpuNonFinite, ReadValuesPropagateWhereTheMathPutsThem) {
  std::mt19937_64 rng(4242);
  int propagated = 0;
  uint64_t seed = 9000;
  for (const Shape& sh : kShapes)
    for (const LayerMask& mask : masks()) {
      const Case cs = make_case(sh, mask, MetaKind::Padded, ++seed);
      Tensors clean = make_tensors(cs);
      const KernelResult base = run_kernels(clean.chunk, clean.dout.data());
      const Reach r = reach(cs.mask, cs.q_meta.data(), cs.Lq, cs.k_meta.data(), cs.Lk);  // row 0
      std::vector<int> read_keys, reading_rows;
      for (int j = 0; j < cs.Lk; ++j)
        if (r.key_read[j]) read_keys.push_back(j);
      for (int i = 0; i < cs.Lq; ++i)
        if (r.row_reads[i]) reading_rows.push_back(i);
      if (read_keys.empty()) continue;
      for (int tensor = 0; tensor < 4; ++tensor) {
        Tensors bad = make_tensors(cs);
        const bool on_key = tensor == 1 || tensor == 2;
        const std::vector<int>& tokens = on_key ? read_keys : reading_rows;
        const int token = tokens[rng() % tokens.size()], d = static_cast<int>(rng() % cs.D);
        const int heads = on_key ? cs.Hkv : cs.Hq, h = static_cast<int>(rng() % heads);
        const int64_t e = (int64_t{h} * (on_key ? cs.Lk : cs.Lq) + token) * cs.D + d;  // in row b = 0
        std::vector<uint8_t>* target[] = {&bad.q, &bad.k, &bad.v, &bad.dout};
        const float value = nonfinite_value(static_cast<int>(rng()));
        set_element(*target[tensor], e, cs.dtype, value);
        const KernelResult got = run_kernels(bad.chunk, bad.dout.data());
        const RefForward ref = reference_forward(bad.chunk);
        const RefBackward gref = reference_backward(bad.chunk, bad.dout.data());
        const Affected a = affected_by(cs, on_key, h, token);
        const std::string name = cs.name() + ": " + std::to_string(value) + " in " + "qkvd"[tensor] + " head " +
                                 std::to_string(h) + " token " + std::to_string(token) + " d " + std::to_string(d);
        expect_propagation("o", got.o, ref.o, base.o, a.row, cs.D, name);
        expect_propagation("lse", got.lse, ref.lse, base.lse, a.row, 1, name);
        expect_propagation("dq", got.dq, gref.dq, base.dq, a.row, cs.D, name);
        expect_propagation("dk", got.dk, gref.dk, base.dk, a.key, cs.D, name);
        expect_propagation("dv", got.dv, gref.dv, base.dv, a.key, cs.D, name);
        if (HasFatalFailure()) return;
        bool any = false;
        for (float x : got.dq) any |= !std::isfinite(x);
        propagated += any;
      }
    }
  EXPECT_GT(propagated, 20) << "most single non-finite inputs that are read reach some gradient";
}

// The reported failure: a NaN in one k element of a causal row used to give valid rows O = 0, LSE = -inf. The
// rows that read the key (itself and every later query of its document) are NaN; the earlier ones are untouched.
TEST_F(CpuNonFinite, NaNKeyIsNeverReportedAsAMaskedRow) {
  Case cs = make_case({1, 1, 1, 2 * kTile + 3, 64, DType::F32}, {true, 0, false}, MetaKind::OneDoc, 31);
  Tensors t = make_tensors(cs);
  const int bad_key = kTile + 2;
  set_element(t.k, int64_t{bad_key} * cs.D + 5, cs.dtype, std::numeric_limits<float>::quiet_NaN());
  const KernelResult got = run_kernels(t.chunk, t.dout.data());
  for (int i = 0; i < cs.Lq; ++i) {
    if (i < bad_key) {
      EXPECT_TRUE(std::isfinite(got.lse[i])) << "row " << i << " does not read the key";
    } else {
      EXPECT_TRUE(std::isnan(got.lse[i])) << "row " << i << " reads the NaN key: lse " << got.lse[i];
      EXPECT_TRUE(std::isnan(got.o[int64_t{i} * cs.D])) << "row " << i;
    }
  }
}

}  // namespace
}  // namespace rf::testing
