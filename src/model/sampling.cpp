// ringflex model: greedy and sampled token choice (see sampling.h).
#include "model/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"

namespace rf::model {

void check_sampling(const SamplingOptions& o) {
  RF_CHECK(o.temperature > 0.f && std::isfinite(o.temperature), "--temperature must be a positive number, not ",
           o.temperature);
  RF_CHECK(o.top_k >= 0, "--top-k must be 0 (off) or positive, not ", o.top_k);
  RF_CHECK(o.top_p >= 0.f && o.top_p <= 1.f, "--top-p must be in [0, 1], not ", o.top_p);
  RF_CHECK(!o.min_p || (*o.min_p >= 0.f && *o.min_p <= 1.f), "--min-p must be in [0, 1], not ", o.min_p.value_or(0));
}

Sampler::Sampler(const SamplingOptions& options) : o_(options), state_(options.seed) { check_sampling(options); }

double Sampler::uniform() {
  // splitmix64, the top 53 bits as a double in [0, 1).
  constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ull, kMul1 = 0xBF58476D1CE4E5B9ull, kMul2 = 0x94D049BB133111EBull;
  uint64_t z = (state_ += kGamma);
  z = (z ^ (z >> 30)) * kMul1;
  z = (z ^ (z >> 27)) * kMul2;
  z ^= z >> 31;
  constexpr double kTwoToMinus53 = 1.0 / 9007199254740992.0;
  return static_cast<double>(z >> 11) * kTwoToMinus53;
}

int32_t Sampler::next(std::span<const float> logits) {
  const int64_t V = static_cast<int64_t>(logits.size());
  RF_CHECK(V > 0, "sampling from an empty vocabulary");
  if (o_.greedy) return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  constexpr float kRemoved = -std::numeric_limits<float>::infinity();  // transformers' filter_value
  std::vector<float> s(logits.begin(), logits.end());
  if (o_.temperature != 1.f)
    for (float& x : s) x /= o_.temperature;
  if (o_.top_k > 0 && o_.top_k < V) {
    std::vector<float> sorted = s;
    std::nth_element(sorted.begin(), sorted.begin() + (o_.top_k - 1), sorted.end(), std::greater<float>());
    const float kth = sorted[static_cast<size_t>(o_.top_k - 1)];
    for (float& x : s)
      if (x < kth) x = kRemoved;
  }
  const auto softmax = [](const std::vector<float>& z) {
    const float mx = *std::max_element(z.begin(), z.end());
    std::vector<double> p(z.size());
    double sum = 0;
    for (size_t i = 0; i < z.size(); ++i) sum += p[i] = z[i] == kRemoved ? 0.0 : std::exp(double{z[i]} - mx);
    for (double& x : p) x /= sum;
    return p;
  };
  if (o_.top_p < 1.f) {
    // Ascending order; drop the low tail whose cumulative probability stays <= 1 - top_p, never the largest token.
    // Only the tokens top-k kept are ordered: the removed ones come first in the whole order and add probability 0,
    // so the same tokens fall, for a sort of the ~top_k kept (Gemma's default 64) instead of the whole vocabulary.
    std::vector<int64_t> order;
    for (int64_t i = 0; i < V; ++i)
      if (s[static_cast<size_t>(i)] != kRemoved) order.push_back(i);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return s[a] < s[b]; });
    const std::vector<double> p = softmax(s);
    double cumulative = 0;
    for (size_t i = 0; i + 1 < order.size(); ++i) {
      cumulative += p[static_cast<size_t>(order[i])];
      if (cumulative <= 1.0 - o_.top_p) s[static_cast<size_t>(order[i])] = kRemoved;
    }
  }
  if (o_.min_p) {
    const std::vector<double> p = softmax(s);
    const double top = *std::max_element(p.begin(), p.end());
    for (size_t i = 0; i < s.size(); ++i)
      if (p[i] < *o_.min_p * top) s[i] = kRemoved;
  }
  const std::vector<double> p = softmax(s);
  const double u = uniform();
  double cumulative = 0;
  int64_t last = 0;
  for (int64_t i = 0; i < V; ++i) {
    if (p[static_cast<size_t>(i)] == 0.0) continue;
    last = i;
    cumulative += p[static_cast<size_t>(i)];
    if (u < cumulative) return static_cast<int32_t>(i);
  }
  return static_cast<int32_t>(last);  // u within rounding of 1: the last token that has any probability
}

}  // namespace rf::model
