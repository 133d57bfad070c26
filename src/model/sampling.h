// ringflex model: choosing the next token from a step's logits, as transformers' generate does: greedy (argmax, the
// first index of the largest logit), or sampled after the logits warpers in transformers 5.24's order
// (GenerationMixin._get_logits_processor): temperature, top-k, top-p, min-p, then one draw from the softmax.
//
// Every rank of a generation holds the same logits (the decode step's output is merged identically everywhere), so
// every rank runs the same seeded Sampler and draws the same token without a message.
#pragma once

#include <cstdint>
#include <optional>
#include <span>

namespace rf::model {

struct SamplingOptions {
  bool greedy = true;          // do_sample = false
  float temperature = 1.f;     // scores / temperature; 1 leaves them (TemperatureLogitsWarper)
  int top_k = 0;               // keep the top_k largest (ties with the k-th kept); 0 = off (TopKLogitsWarper)
  float top_p = 1.f;           // keep the smallest set whose probability reaches top_p; 1 = off
  std::optional<float> min_p;  // drop tokens below min_p * the largest probability (MinPLogitsWarper)
  uint64_t seed = 0;           // the generator's seed (the same on every rank)
};

// Throws rf::Error naming the option out of range (temperature <= 0, top_k < 0, top_p or min_p outside [0, 1]).
void check_sampling(const SamplingOptions& o);

class Sampler {
 public:
  explicit Sampler(const SamplingOptions& options);
  // The next token of `logits` [V] (as the model wrote them, final softcap applied).
  int32_t next(std::span<const float> logits);

 private:
  SamplingOptions o_;
  uint64_t state_;  // splitmix64: a fixed, portable sequence for a seed (std:: distributions are not)
  double uniform();
};

}  // namespace rf::model
