// Tests of the bf16 compute mode (RunOptions::compute_dtype, ops.h ComputeDtype): the bf16 gemm against the products
// of the bf16-rounded operands summed in float64, its bits across thread counts and splits, the weights' bf16 copies
// against rounding per call, and the model's loss and gradients against the float32 mode within a bound derived from
// bf16's rounding, with attention on the kernel path CTest forces (RINGFLEX_ISA, or the software AMX tile unit;
// tests/model/CMakeLists.txt), so the bf16 attention kernels run in the training step on every path this CPU has.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "cpu/isa.h"
#include "cpu/kernel_path_test.h"
#include "model/gemma4.h"
#include "model/ops.h"
#include "model/run_grads.h"

namespace rf::model {
namespace {

float round_bf16(float x) { return bf16_to_float(float_to_bf16(x)); }

// float32's unit roundoff, and bf16's (8 significant bits, round to nearest: relative error at most 2^-9).
const double kF32Unit = std::ldexp(1.0, -24);
const double kBf16Unit = std::ldexp(1.0, -9);

class ThreadCount {
 public:
  explicit ThreadCount(int n) : saved_(omp_get_max_threads()) { omp_set_num_threads(n); }
  ~ThreadCount() { omp_set_num_threads(saved_); }
  ThreadCount(const ThreadCount&) = delete;
  ThreadCount& operator=(const ThreadCount&) = delete;

 private:
  int saved_;
};

struct GemmCase {
  bool trans_a, trans_b;
  int64_t M, N, K;
  float alpha, beta;
};

// Operands as stored: A [M, K] or [K, M], B [K, N] or [N, K], each with a leading dimension wider than its rows so
// the strides are exercised; C [M, N] with ldc = N + 2.
struct GemmOperands {
  int64_t lda, ldb, ldc;
  std::vector<float> A, B, C;
};

GemmOperands make_operands(const GemmCase& g, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  GemmOperands o;
  const int64_t a_rows = g.trans_a ? g.K : g.M, a_cols = g.trans_a ? g.M : g.K;
  const int64_t b_rows = g.trans_b ? g.N : g.K, b_cols = g.trans_b ? g.K : g.N;
  o.lda = a_cols + 3;
  o.ldb = b_cols + 5;
  o.ldc = g.N + 2;
  o.A.resize(static_cast<size_t>(a_rows * o.lda));
  o.B.resize(static_cast<size_t>(b_rows * o.ldb));
  o.C.resize(static_cast<size_t>(g.M * o.ldc));
  for (std::vector<float>* v : {&o.A, &o.B, &o.C})
    for (float& x : *v) x = u(rng);
  return o;
}

float at_a(const GemmCase& g, const GemmOperands& o, int64_t i, int64_t k) {
  return g.trans_a ? o.A[static_cast<size_t>(k * o.lda + i)] : o.A[static_cast<size_t>(i * o.lda + k)];
}
float at_b(const GemmCase& g, const GemmOperands& o, int64_t k, int64_t j) {
  return g.trans_b ? o.B[static_cast<size_t>(j * o.ldb + k)] : o.B[static_cast<size_t>(k * o.ldb + j)];
}

std::vector<float> run_gemm(const GemmCase& g, const GemmOperands& o, const Matmul& mm) {
  std::vector<float> C = o.C;
  gemm(mm, g.trans_a, g.trans_b, g.M, g.N, g.K, g.alpha, o.A.data(), o.lda, o.B.data(), o.ldb, g.beta, C.data(), o.ldc);
  return C;
}

const Matmul kBf16{ComputeDtype::Bfloat16, nullptr};

// Shapes: one element; K = 1; odd M, N, K (no vector width divides them); a long K; every transpose; and one large
// enough (M N K >= 2^21) that gemm splits C over threads.
const GemmCase kCases[] = {
    {false, true, 1, 1, 1, 1.f, 0.f},     {false, false, 17, 33, 1, 1.f, 1.f},   {true, false, 40, 9, 300, 1.f, 1.f},
    {true, true, 5, 130, 65, 2.f, 0.5f},  {false, true, 200, 96, 160, 1.f, 0.f}, {false, false, 33, 1, 1000, 1.f, 0.f},
    {true, false, 64, 520, 96, 1.f, 1.f},
};

// Oracle: each product of the two bf16-rounded operands is exact in float32 (8 + 8 significant bits < 24) and in
// float64, so the float64 sum of them is the exact result up to 2^-53. The library sums K such terms in float32 in an
// order of its choosing: the error of any order is at most (K - 1) u sum_k |a b| to first order (u = 2^-24; FMA or
// vdpbf16ps only round less often). The alpha scale and the beta * C add each round once more: 2u (|alpha e| +
// |beta c|). Bound used: (K + 2) u (|alpha| sum_k |a b| + |beta c|).
TEST(Bf16Gemm, ProductsOfRoundedOperandsSummedInFloat32) {
  uint32_t seed = 1;
  for (const GemmCase& g : kCases) {
    const GemmOperands o = make_operands(g, seed++);
    const std::vector<float> got = run_gemm(g, o, kBf16);
    int64_t beyond_f32_bound = 0;  // elements whose distance to the unrounded product shows the rounding happened
    for (int64_t i = 0; i < g.M; ++i) {
      for (int64_t j = 0; j < g.N; ++j) {
        double exact = 0, magnitude = 0, unrounded = 0;
        for (int64_t k = 0; k < g.K; ++k) {
          const double a = round_bf16(at_a(g, o, i, k)), b = round_bf16(at_b(g, o, k, j));
          exact += a * b;
          magnitude += std::fabs(a * b);
          unrounded += double{at_a(g, o, i, k)} * at_b(g, o, k, j);
        }
        const double c0 = o.C[static_cast<size_t>(i * o.ldc + j)];
        const double expect = g.alpha * exact + g.beta * c0;
        const double bound =
            (static_cast<double>(g.K) + 2) * kF32Unit * (std::fabs(g.alpha) * magnitude + std::fabs(g.beta * c0));
        const double v = got[static_cast<size_t>(i * o.ldc + j)];
        ASSERT_LE(std::fabs(v - expect), bound) << "M " << g.M << " N " << g.N << " K " << g.K << " at " << i << ", "
                                                << j << (g.trans_a ? " A^T" : "") << (g.trans_b ? " B^T" : "");
        beyond_f32_bound += std::fabs(v - (g.alpha * unrounded + g.beta * c0)) > bound;
      }
      // Padding between rows of C (ldc > N) is never written.
      for (int64_t j = g.N; j < o.ldc; ++j)
        ASSERT_EQ(got[static_cast<size_t>(i * o.ldc + j)], o.C[static_cast<size_t>(i * o.ldc + j)]);
    }
    if (g.M * g.N > 1) {
      EXPECT_GT(beyond_f32_bound, 0) << "the operands were not rounded to bf16";
    }
  }
}

// The bits of every element do not depend on the thread count (1, 2, 3: C is cut into 1, 2 or 3 blocks of rows or
// columns, each one oneDNN call on its thread), since no split cuts K.
TEST(Bf16Gemm, SameBitsForAnyThreadCount) {
  uint32_t seed = 100;
  for (const GemmCase& g : kCases) {
    const GemmOperands o = make_operands(g, seed++);
    std::vector<float> one;
    {
      const ThreadCount t(1);
      one = run_gemm(g, o, kBf16);
    }
    for (int n : {2, 3}) {
      const ThreadCount t(n);
      EXPECT_EQ(run_gemm(g, o, kBf16), one) << n << " threads, M " << g.M << " N " << g.N << " K " << g.K;
    }
  }
}

// An operand found in the weights' bf16 copies (the model's case: a weight, or one head's rows of it, or a strided
// column slice as o_proj's per-head view) gives the bits of rounding it in the call.
TEST(Bf16Gemm, WeightCopiesGiveTheBitsOfRoundingPerCall) {
  uint32_t seed = 200;
  for (const GemmCase& g : kCases) {
    const GemmOperands o = make_operands(g, seed++);
    Bf16Copies copies;
    copies.add(o.B.data(), static_cast<int64_t>(o.B.size()));
    std::vector<float> unrelated(64, 1.f);  // a second tensor, so the lookup has to choose
    copies.add(unrelated.data(), static_cast<int64_t>(unrelated.size()));
    const Matmul with_copies{ComputeDtype::Bfloat16, &copies};
    EXPECT_EQ(run_gemm(g, o, with_copies), run_gemm(g, o, kBf16)) << "M " << g.M << " N " << g.N << " K " << g.K;
  }
  // find(): inside one copy only.
  std::vector<float> w(100, 0.5f);
  Bf16Copies copies;
  copies.add(w.data(), 100);
  EXPECT_EQ(copies.find(w.data() + 10, 90), copies.find(w.data(), 100) + 10);
  EXPECT_EQ(copies.find(w.data() + 10, 91), nullptr);
  EXPECT_EQ(copies.bytes(), 200);
}

TEST(ComputeDtype, ParsesNamesAndRejectsOthers) {
  EXPECT_EQ(parse_compute_dtype("float32"), ComputeDtype::Float32);
  EXPECT_EQ(parse_compute_dtype("bf16"), ComputeDtype::Bfloat16);
  EXPECT_EQ(parse_compute_dtype("bfloat16"), ComputeDtype::Bfloat16);
  try {
    parse_compute_dtype("float16");
    ADD_FAILURE() << "float16 accepted";
  } catch (const rf::Error& e) {
    EXPECT_STREQ(e.what(), "compute dtype 'float16' is not one of float32, bfloat16");
  }
}

// A small Gemma 4 with matmuls of realistic aspect (H = 64, I = 192, a 512-word head), two layers (sliding and full),
// GQA 2:1, and T = 2 x 96 tokens: the MLP and head sgemms are large enough that gemm splits them over threads.
std::string small_config(const std::string& extra) {
  return R"({"vocab_size": 512, "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 16, "sliding_window": 24,
    "layer_types": ["sliding_attention", "full_attention"], "final_logit_softcapping": 30.0,
    "hidden_size_per_layer_input": 0, "rms_norm_eps": 1e-6)" +
         extra + "}";
}

const char* const kMoe =
    R"(, "enable_moe_block": true, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32)";

struct TextBatch {
  int B = 2, S = 96;
  std::vector<int32_t> ids, labels;
  Batch view() const {
    Batch b;
    b.B = B;
    b.S = S;
    b.input_ids = ids.data();
    b.labels = labels.data();
    return b;
  }
};

TextBatch text_batch(int V) {
  TextBatch t;
  std::mt19937 rng(5);
  for (int i = 0; i < t.B * t.S; ++i) {
    t.ids.push_back(1 + static_cast<int32_t>(rng() % (V - 1)));
    t.labels.push_back(i % 5 == 4 ? -100 : static_cast<int32_t>(rng() % V));
  }
  return t;
}

Gemma4Model small_model(const std::string& extra, uint64_t seed) {
  Gemma4Model m(Gemma4Config::from_json(small_config(extra)));
  // std 0.4: logits and router scores with an O(1) spread, so MoE top-k choices have margins far wider than the
  // bf16 perturbation (a flipped choice is a jump, not a rounding difference).
  constexpr float kInitStd = 0.4f;
  m.init_random(seed, kInitStd);
  return m;
}

struct RunOut {
  Result result;
  TensorSet grads;
};

RunOut run_model(Gemma4Model& m, const Batch& b, ComputeDtype dtype) {
  RunOptions opt;
  opt.want_grad = true;
  opt.want_logits = true;
  opt.compute_dtype = dtype;
  RunOut out;
  out.result = run_with_grads(m, b, opt, out.grads);
  return out;
}

double norm_of(const std::vector<float>& v) {
  double s = 0;
  for (float x : v) s += double{x} * x;
  return std::sqrt(s);
}

// The bound. Each matmul's operands carry a relative rounding of at most 2^-9 each, so each product and therefore each
// matmul output element is off by at most 2^-8 sum_k |a b| (float32 accumulation adds ~K 2^-24, negligible). With
// random-sign operands sum_k |a b| is ~sqrt(K) times |sum_k a b|, but the RMSNorm before every projection and the
// residual stream keep activations O(1), so the relative perturbation a matmul adds to the hidden state is of order
// 2^-8 and those of successive matmuls add. Attention is two more such products: the scores q.k of bf16 q and k
// (2^-8), and P V with v rounded (2^-9) and, on bf16 units, P rounded to bf16 (2^-8 relative per weight,
// cpu::rounds_bf16_weights): 2^-8 with the q.k error counted above. The longest chain from the input to the loss
// crosses kChain of them: per layer q/k/v -> q.k -> P V -> o_proj and gate/up -> down (6), two layers, and the
// head: 13. The loss is a log-sum-exp of the logits, 1-Lipschitz in their max norm, so |d loss| <= kChain 2^-8
// max|logit|. Gradients cross the chain twice (forward to the loss, backward to the weight; dout is rounded as q, k, v
// are, dS as P is): relative L2 error per tensor <= 2 kChain 2^-8 (~10%). Both are worst cases of first order; typical
// differences are several times smaller, and a wrong product (an operand transposed, a stale weight copy, a missing
// beta, a bf16 tensor read as float32) gives O(1) differences.
constexpr int kChain = 13;
// Gradients reduced to fewer numbers than the hidden size (per-expert scales: 4; q/k norm scales: D = 16) are each a
// sum over every (routed) token of terms of both signs, so their cancellation raises the relative error beyond the
// bound above, which assumes none (measured: 0.076 for a per-expert scale against 0.05 or less for every other
// tensor). They get twice the bound.
constexpr double kFewSumsFactor = 2;

void expect_near_float32(const std::string& extra) {
  Gemma4Model m = small_model(extra, 3);
  const TextBatch t = text_batch(m.config().vocab_size);
  const RunOut f32 = run_model(m, t.view(), ComputeDtype::Float32);
  const RunOut bf = run_model(m, t.view(), ComputeDtype::Bfloat16);
  ASSERT_TRUE(std::isfinite(f32.result.loss));
  double max_logit = 0;
  for (float z : f32.result.logits) max_logit = std::max(max_logit, std::fabs(double{z}));
  const double loss_bound = kChain * 2 * kBf16Unit * max_logit;
  EXPECT_NEAR(bf.result.loss, f32.result.loss, loss_bound);
  EXPECT_NE(bf.result.loss, f32.result.loss) << "the bf16 mode computed in float32";
  const double grad_bound = 2 * kChain * 2 * kBf16Unit;
  for (size_t s = 0; s < f32.grads.size(); ++s) {
    const std::vector<float>& a = f32.grads[s].data;
    std::vector<float> d(a.size());
    for (size_t i = 0; i < a.size(); ++i) d[i] = bf.grads[s].data[i] - a[i];
    const double ref = norm_of(a);
    if (ref == 0) {
      EXPECT_EQ(norm_of(bf.grads[s].data), 0) << f32.grads[s].name;
      continue;
    }
    const bool few_sums = static_cast<int64_t>(a.size()) < m.config().hidden_size;
    EXPECT_LE(norm_of(d) / ref, few_sums ? kFewSumsFactor * grad_bound : grad_bound) << f32.grads[s].name;
  }
}

// Runs on the kernel path CTest forces (kernel_path_test.h): a path this CPU lacks skips naming the hardware.
class ModelBf16 : public rf::testing::KernelPathTest {};

// The one decision (cpu::bf16_units_pay): bf16 storage and the bf16 attention kernels where the path multiplies bf16 on
// bf16 units, float32 kernels on rounded values elsewhere; the float32 mode never rounds.
TEST_F(ModelBf16, AttentionStorageFollowsTheBf16Units) {
  const bool units = cpu::bf16_units_pay(cpu::kernel_path());
  EXPECT_EQ(attention_dtype(ComputeDtype::Bfloat16), units ? DType::BF16 : DType::F32)
      << cpu::describe(cpu::kernel_path());
  EXPECT_EQ(attention_dtype(ComputeDtype::Float32), DType::F32);
}

TEST_F(ModelBf16, DenseLossAndGradientsNearFloat32) { expect_near_float32(""); }

TEST_F(ModelBf16, MoeLossAndGradientsNearFloat32) { expect_near_float32(kMoe); }

// Same bits on repeat and for 1, 2 and 3 threads (the bf16 matmuls split as the float32 ones, one oneDNN thread per
// block; the MoE experts' tasks call it inside their own parallel loop; the attention kernels' bits do not depend on
// the thread count either).
TEST_F(ModelBf16, SameBitsAcrossThreadCounts) {
  Gemma4Model m = small_model(kMoe, 4);
  const TextBatch t = text_batch(m.config().vocab_size);
  RunOut one = [&] {
    const ThreadCount c(1);
    return run_model(m, t.view(), ComputeDtype::Bfloat16);
  }();
  for (int n : {1, 2, 3}) {
    const ThreadCount c(n);
    const RunOut r = run_model(m, t.view(), ComputeDtype::Bfloat16);
    EXPECT_EQ(r.result.loss, one.result.loss) << n << " threads";
    for (size_t s = 0; s < one.grads.size(); ++s)
      EXPECT_EQ(r.grads[s].data, one.grads[s].data) << one.grads[s].name << ", " << n << " threads";
  }
}

// The weights' bf16 copies follow the parameters: changed through the store (as the optimizer does: its version
// moves), the next bf16 run gives the bits of a model built with the new values; unchanged, they are not rounded
// again (the version stays).
TEST_F(ModelBf16, WeightCopiesFollowParameterChanges) {
  Gemma4Model m = small_model("", 6);
  const TextBatch t = text_batch(m.config().vocab_size);
  const double before = run_model(m, t.view(), ComputeDtype::Bfloat16).result.loss;
  const uint64_t version = m.params().version();
  EXPECT_EQ(run_model(m, t.view(), ComputeDtype::Bfloat16).result.loss, before);
  EXPECT_EQ(m.params().version(), version);  // a run reads the weights, it does not write them
  const auto scale_all = [](ParamStore& store) {
    for (float& v : store.mutable_flat(Role::Weights)) v *= 1.5f;
  };
  scale_all(m.params());
  EXPECT_GT(m.params().version(), version);
  Gemma4Model fresh = small_model("", 6);
  scale_all(fresh.params());
  const double after = run_model(m, t.view(), ComputeDtype::Bfloat16).result.loss;
  EXPECT_NE(after, before);
  EXPECT_EQ(after, run_model(fresh, t.view(), ComputeDtype::Bfloat16).result.loss);
}

}  // namespace
}  // namespace rf::model
