// Tests' view of one run's gradients: the model accumulates them into its parameter store, and a test that compares
// several runs takes a copy of each as named tensors.
#pragma once

#include "core/attention_backend.h"
#include "model/gemma4.h"

namespace rf::model {

// Zeroes the store's gradients, runs with opt (want_grad set) and copies the gradients into `grads` (frozen
// parameters' tensors left without memory).
// `Model`: a decoder (gemma4.h) or a multimodal model (multimodal.h).
template <class Model>
Result run_with_grads(Model& m, const Batch& b, const RunOptions& opt, TensorSet& grads, AttentionBackend& attn) {
  m.params().allocate_grads();
  m.params().zero_grads();
  Result r = m.run(b, opt, attn);
  grads = m.params().snapshot(Role::Grads);
  return r;
}

template <class Model>
Result run_with_grads(Model& m, const Batch& b, const RunOptions& opt, TensorSet& grads) {
  m.params().allocate_grads();
  m.params().zero_grads();
  Result r = m.run(b, opt);
  grads = m.params().snapshot(Role::Grads);
  return r;
}

}  // namespace rf::model
