// The oracle checks itself: hand-computed cases, and the backward against central finite differences of the
// forward (loss = sum(dout * O)) on tiny cases with every mask feature.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "common/random_case.h"
#include "reference/attention_ref.h"

namespace rf {
namespace {

TEST(Reference, HandComputedTwoKeys) {
  // One query, keys with scores 0 and ln 2: softmax (1/3, 2/3), values 3 and 6 -> O = 5, LSE = ln 3.
  const float q[1] = {1.f}, k[2] = {0.f, std::log(2.f)}, v[2] = {3.f, 6.f};
  const TokenMeta qm[1] = {{1, 1, -1}}, km[2] = {{0, 1, -1}, {1, 1, -1}};
  AttnChunk c;
  c.shape = {1, 1, 1, 1, 2, 1};
  c.q = q, c.k = k, c.v = v, c.q_meta = qm, c.k_meta = km, c.scale = 1.f;
  const RefForward r = reference_forward(c);
  EXPECT_NEAR(r.o[0], 5.0, 1e-6);  // ln 2 rounded to float moves the weights by ~1e-8
  EXPECT_NEAR(r.lse[0], std::log(3.0), 1e-7);
}

TEST(Reference, EmptyRowsGiveZeroAndMinusInfinity) {
  const float q[2] = {1.f, 2.f}, k[1] = {1.f}, v[1] = {4.f};
  const TokenMeta qm[2] = {{0, 0, -1}, {1, 2, -1}}, km[1] = {{0, 1, -1}};  // padding query; other document
  AttnChunk c;
  c.shape = {1, 1, 1, 2, 1, 1};
  c.q = q, c.k = k, c.v = v, c.q_meta = qm, c.k_meta = km, c.scale = 1.f;
  const RefForward r = reference_forward(c);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(r.o[i], 0.0);
    EXPECT_EQ(r.lse[i], -INFINITY);
  }
  const float dout[2] = {1.f, 1.f};
  const RefBackward g = reference_backward(c, dout);
  EXPECT_EQ(g.dq[0], 0.0);
  EXPECT_EQ(g.dq[1], 0.0);
  EXPECT_EQ(g.dk[0], 0.0);
  EXPECT_EQ(g.dv[0], 0.0);
}

double loss(const AttnChunk& c, const std::vector<float>& dout) {
  const RefForward r = reference_forward(c);
  double l = 0;
  for (size_t i = 0; i < dout.size(); ++i) l += dout[i] * r.o[i];
  return l;
}

TEST(Reference, BackwardMatchesFiniteDifferences) {
  struct Case {
    LayerMask mask;
    testing::MetaKind kind;
  };
  const Case cases[] = {{{false, 0, false}, testing::MetaKind::OneDoc},
                        {{true, 0, false}, testing::MetaKind::OneDoc},
                        {{true, 2, false}, testing::MetaKind::Packed},
                        {{true, 3, true}, testing::MetaKind::PackedImages},
                        {{true, 0, true}, testing::MetaKind::Padded}};
  int seed = 0;
  for (const Case& cs : cases) {
    const AttnShape sh{1, 4, 2, 7, 7, 3};  // GQA 2:1
    std::vector<float> q(sh.q_elems()), k(sh.kv_elems()), v(sh.kv_elems()), dout(sh.q_elems());
    for (auto* t : {&q, &k, &v, &dout}) {
      const auto bytes = testing::random_tensor(static_cast<int64_t>(t->size()), DType::F32, ++seed);
      std::memcpy(t->data(), bytes.data(), bytes.size());
    }
    const std::vector<TokenMeta> meta = testing::random_meta(1, 7, cs.kind, seed);
    AttnChunk c;
    c.shape = sh;
    c.q = q.data(), c.k = k.data(), c.v = v.data(), c.q_meta = meta.data(), c.k_meta = meta.data();
    c.mask = cs.mask;
    c.scale = 0.7f;
    const RefBackward g = reference_backward(c, dout.data());

    // Central differences with h = 2^-8: the step is exact in float32 for |x| < 1, the truncation error is
    // O(h^2) ~ 1.5e-5 times the third derivative (order 1 here), and the double forward adds ~1e-15.
    const float h = 1.f / 256;
    auto check = [&](std::vector<float>& x, const std::vector<double>& grad, const char* name) {
      for (size_t i = 0; i < x.size(); ++i) {
        const float x0 = x[i];
        x[i] = x0 + h;
        const double up = loss(c, dout);
        x[i] = x0 - h;
        const double down = loss(c, dout);
        x[i] = x0;
        EXPECT_NEAR((up - down) / (2 * h), grad[i], 2e-4) << name << "[" << i << "] mask " << cs.mask.name();
      }
    };
    check(q, g.dq, "dq");
    check(k, g.dk, "dk");
    check(v, g.dv, "dv");
  }
}

}  // namespace
}  // namespace rf
