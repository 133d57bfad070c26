// ringflex reference: the scalar oracle's forward and backward, in double (see attention_ref.h).
#include "reference/attention_ref.h"

#include <cmath>
#include <limits>

namespace rf {

namespace {

// Widen a [n] buffer of dtype t to double.
std::vector<double> widen(const void* p, int64_t n, DType t) {
  std::vector<float> f(static_cast<size_t>(n));
  if (n > 0) to_float(f.data(), p, static_cast<size_t>(n), t);
  return {f.begin(), f.end()};
}

double dot(const double* a, const double* b, int D) {
  double s = 0;
  for (int d = 0; d < D; ++d) s += a[d] * b[d];
  return s;
}

// Scores of one query row against every key: s[j] = scale * q.k_j where the mask allows the pair (allowed[j] =
// 1), else -inf. Returns the row's log-sum-exp: -inf when nothing is allowed, NaN when an allowed score is NaN or
// the sum is inf - inf (docs/numerics.md: a non-finite value a row reads makes the row NaN, never "masked").
double score_row(const AttnChunk& c, int b, const double* q, const double* k_head, int qi, std::vector<double>& s,
                 std::vector<char>& allowed_key) {
  const AttnShape& sh = c.shape;
  const TokenMeta& qm = c.q_meta[int64_t{b} * sh.Lq + qi];
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  double max_s = kNegInf;
  bool any_allowed = false, any_nan = false;
  for (int j = 0; j < sh.Lk; ++j) {
    const TokenMeta& km = c.k_meta[int64_t{b} * sh.Lk + j];
    allowed_key[j] = allowed(c.mask, qm, km);
    s[j] = allowed_key[j] ? c.scale * dot(q, k_head + int64_t{j} * sh.D, sh.D) : kNegInf;
    any_allowed |= allowed_key[j] != 0;
    any_nan |= std::isnan(s[j]);
    if (s[j] > max_s) max_s = s[j];
  }
  if (any_nan) return std::numeric_limits<double>::quiet_NaN();
  if (!any_allowed || max_s == kNegInf) return kNegInf;
  double sum = 0;
  for (int j = 0; j < sh.Lk; ++j)
    if (allowed_key[j]) sum += std::exp(s[j] - max_s);  // max_s = +inf gives exp(inf - inf) = NaN, as it should
  return max_s + std::log(sum);
}

}  // namespace

RefForward reference_forward(const AttnChunk& c) {
  validate(c);
  const AttnShape& sh = c.shape;
  const std::vector<double> q = widen(c.q, sh.q_elems(), c.dtype);
  const std::vector<double> k = widen(c.k, sh.kv_elems(), c.dtype);
  const std::vector<double> v = widen(c.v, sh.kv_elems(), c.dtype);
  RefForward r{std::vector<double>(static_cast<size_t>(sh.q_elems()), 0.0),
               std::vector<double>(static_cast<size_t>(sh.lse_elems()), 0.0)};
  std::vector<double> s(static_cast<size_t>(sh.Lk));
  std::vector<char> allowed_key(static_cast<size_t>(sh.Lk));
  for (int b = 0; b < sh.B; ++b)
    for (int h = 0; h < sh.Hq; ++h) {
      const int64_t kv_head = int64_t{b} * sh.Hkv + h / sh.group_size();
      const double* k_head = k.data() + kv_head * sh.Lk * sh.D;
      const double* v_head = v.data() + kv_head * sh.Lk * sh.D;
      for (int i = 0; i < sh.Lq; ++i) {
        const int64_t row = (int64_t{b} * sh.Hq + h) * sh.Lq + i;
        const double lse = score_row(c, b, q.data() + row * sh.D, k_head, i, s, allowed_key);
        r.lse[row] = lse;
        if (lse == -std::numeric_limits<double>::infinity()) continue;
        double* o = r.o.data() + row * sh.D;
        for (int j = 0; j < sh.Lk; ++j) {
          if (!allowed_key[j]) continue;  // skipped, not multiplied by 0: 0 * NaN would leak a value never read
          const double p = std::exp(s[j] - lse);
          for (int d = 0; d < sh.D; ++d) o[d] += p * v_head[int64_t{j} * sh.D + d];
        }
      }
    }
  return r;
}

RefBackward reference_backward(const AttnChunk& c, const void* dout) {
  validate(c);
  const AttnShape& sh = c.shape;
  const std::vector<double> q = widen(c.q, sh.q_elems(), c.dtype);
  const std::vector<double> k = widen(c.k, sh.kv_elems(), c.dtype);
  const std::vector<double> v = widen(c.v, sh.kv_elems(), c.dtype);
  const std::vector<double> dO = widen(dout, sh.q_elems(), c.dtype);
  RefBackward g{std::vector<double>(static_cast<size_t>(sh.q_elems()), 0.0),
                std::vector<double>(static_cast<size_t>(sh.kv_elems()), 0.0),
                std::vector<double>(static_cast<size_t>(sh.kv_elems()), 0.0)};
  std::vector<double> s(static_cast<size_t>(sh.Lk)), dp(static_cast<size_t>(sh.Lk));
  std::vector<char> allowed_key(static_cast<size_t>(sh.Lk));
  for (int b = 0; b < sh.B; ++b)
    for (int h = 0; h < sh.Hq; ++h) {
      const int64_t kv_head = int64_t{b} * sh.Hkv + h / sh.group_size();
      const int64_t kv_off = kv_head * sh.Lk * sh.D;
      for (int i = 0; i < sh.Lq; ++i) {
        const int64_t row = (int64_t{b} * sh.Hq + h) * sh.Lq + i;
        const double* qi = q.data() + row * sh.D;
        const double* doi = dO.data() + row * sh.D;
        const double lse = score_row(c, b, qi, k.data() + kv_off, i, s, allowed_key);
        if (lse == -std::numeric_limits<double>::infinity()) continue;  // no keys: zero gradients
        // P = exp(S - lse); dP = dO . V^T; delta = sum_j P dP (= dO . O); dS = P (dP - delta). Every sum runs
        // over the allowed keys only, so a forbidden key's values never enter it.
        double delta = 0;
        for (int j = 0; j < sh.Lk; ++j) {
          if (!allowed_key[j]) continue;
          s[j] = std::exp(s[j] - lse);
          dp[j] = dot(doi, v.data() + kv_off + int64_t{j} * sh.D, sh.D);
          delta += s[j] * dp[j];
        }
        double* dqi = g.dq.data() + row * sh.D;
        for (int j = 0; j < sh.Lk; ++j) {
          if (!allowed_key[j]) continue;
          const double ds = s[j] * (dp[j] - delta) * c.scale;
          const int64_t kj = kv_off + int64_t{j} * sh.D;
          for (int d = 0; d < sh.D; ++d) {
            dqi[d] += ds * k[kj + d];
            g.dk[kj + d] += ds * qi[d];
            g.dv[kj + d] += s[j] * doi[d];
          }
        }
      }
    }
  return g;
}

}  // namespace rf
