// ringflex model: LoRA over a frozen base, one more implementation of the parameter store (model/param_store.h).
//
// Every parameter the model registers is the base, frozen (no gradient, no moments). When the weights are
// allocated, each targeted linear W [out, in] of a decoder layer gets two further trainable slots, PEFT's
//   <module>.lora_A.weight  A [r, in]   Kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in))
//   <module>.lora_B.weight  B [out, r]  zero
// so the gradient arena and AdamW's moments cover the adapters only. The layer computes with
//   W' = W + scale * B A,   scale = alpha / r (alpha / sqrt(r) with use_rslora)
// which is PEFT's y = W x + scale * B (A x) without dropout, regrouped.
//
// How it plugs into the layer hooks: before_forward / before_backward of layer l build W' for each targeted slot
// of the layer (weight(slot) points there until after_forward / after_backward); before_backward also gives each
// targeted slot a zeroed [out, in] gradient buffer (grad(slot) points there, so the model's unchanged backward
// writes dL/dW' into it), and after_backward contracts it into the adapters' gradients:
//   dB += scale * dW' A^T     dA += scale * B^T dW'
// and frees it. This costs, per targeted linear and layer, one [out, in] float32 buffer alive at a time and the
// base's weight-gradient product (which a factored backward would skip: the next step of this file); the base itself
// is never written.
//
// Targets follow PEFT's target_modules, matched against the module names of the text model as Gemma4ForCausalLM
// names them ("model.layers.3.self_attn.q_proj"): a list of names matches a module whose name is one of them or ends
// with "." + one of them; a single regular expression must match the whole module name (std::regex_match, PEFT's
// re.fullmatch). Only 2-D matmul weights of decoder layers can be targets; a target matching nothing is an error,
// and so is one matching the MoE experts' 3-D weights (expert adapters are not implemented yet) or dropout != 0.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/param_store.h"

namespace rf::model {

struct LoraConfig {
  int rank = 0;  // r; 0 = no LoRA
  double alpha = 8.0;
  double dropout = 0.0;  // only 0 is implemented
  // PEFT's target_modules: names (suffix match), or one regular expression (full match) when target_regex is set.
  std::vector<std::string> target = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  bool target_regex = false;
  bool use_rslora = false;
  uint64_t seed = 0;  // A's initial values are a function of (seed, the adapter's name, the element) only

  double scale() const;
  // Throws rf::Error naming the field: rank < 1, alpha <= 0, dropout != 0, an empty target.
  void validate() const;
};

// The module name of a parameter ("model.layers.0.self_attn.q_proj.weight" -> "model.layers.0.self_attn.q_proj").
std::string module_of(const std::string& param_name);

// The targets of `config` among the parameters registered in `shapes` (a store before LoraStore::allocate_weights,
// or any store of the same model): one Adapter per targeted slot, its a and b slots left 0. Throws rf::Error as the
// header says. What the memory check counts before anything is allocated.
struct LoraTarget {
  size_t base = 0;
  int64_t out = 0, in = 0;
};
std::vector<LoraTarget> lora_targets(const ParamStore& shapes, const LoraConfig& config);
// Float32 bytes of the adapters of `targets` (one of weights, gradients, exp_avg, exp_avg_sq), and of the largest
// layer's W' and dL/dW' buffers that the hooks hold (the merged weights and their gradient, one layer at a time).
int64_t lora_adapter_bytes(const std::vector<LoraTarget>& targets, int rank);
int64_t lora_layer_buffer_bytes(const ParamStore& shapes, const std::vector<LoraTarget>& targets);

class LoraStore : public ReplicatedStore {
 public:
  explicit LoraStore(LoraConfig config);

  const LoraConfig& config() const { return cfg_; }

  // Registers the adapters of every targeted slot (throws rf::Error as the header says), freezes the base,
  // allocates everything and initialises the adapters.
  void allocate_weights() override;
  // A's Kaiming-uniform values and B's zeros again (after Gemma4Model::init_random, which fills every slot).
  void init_adapters();

  struct Adapter {
    size_t base = 0, a = 0, b = 0;  // slots: W [out, in], A [r, in], B [out, r]
    int64_t out = 0, in = 0;
  };
  const std::vector<Adapter>& adapters() const { return adapters_; }
  // The modules that carry adapters, in registration order (PEFT's target_modules as resolved names).
  std::vector<std::string> target_modules() const;

  const float* weight(size_t slot) const override;
  float* grad(size_t slot) override;
  const float* grad(size_t slot) const override;

  void before_forward(int layer) override;
  void after_forward(int layer) override;
  void before_backward(int layer) override;
  void after_backward(int layer) override;

 private:
  void merge_layer(int layer);
  void release_layer();
  // The adapter index of a base slot, or -1.
  int adapter_of(size_t slot) const { return slot < adapter_of_.size() ? adapter_of_[slot] : -1; }

  LoraConfig cfg_;
  std::vector<Adapter> adapters_;
  std::vector<int> adapter_of_;      // [slots registered by the model] adapter index or -1
  int acquired_ = kGlobalGroup - 1;  // the layer whose W' exists (none: below kGlobalGroup)
  // Per adapter of the acquired layer (empty elsewhere): W' [out, in], and during the backward dL/dW' [out, in].
  std::vector<std::vector<float>> merged_, dmerged_;
};

// PEFT's adapter files (what peft.PeftModel.from_pretrained loads):
//   adapter_config.json        peft_type LORA, task_type CAUSAL_LM, base_model_name_or_path, r, lora_alpha,
//                              lora_dropout, use_rslora, target_modules (the adapted modules' names in the
//                              checkpoint's layout, e.g. "model.language_model.layers.0.self_attn.q_proj"), ...
//   adapter_model.safetensors  float32 "base_model.model." + <module in the checkpoint's layout> + ".lora_A.weight"
//                              (and lora_B), e.g. base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight
// `text_prefix`: where the decoder lives in the base's files (model/checkpoint.h Checkpoint::text_prefix).
constexpr const char* kPeftConfigFile = "adapter_config.json";
constexpr const char* kPeftWeightsFile = "adapter_model.safetensors";
void save_peft_adapter(const LoraStore& store, const std::string& text_prefix, const std::string& base_model,
                       const std::string& dir);
// The LoraConfig of an adapter directory: r, lora_alpha, use_rslora from its config, the targets from its tensors'
// names (module names of the text model, matched exactly). Throws rf::Error naming the file and the problem (a
// missing file or field, a peft_type other than LORA, lora_dropout != 0, no lora_A tensors).
LoraConfig read_peft_config(const std::string& dir);
// Overwrites the store's adapters with the directory's tensors; every adapter must be there with its shape, and
// nothing else.
void load_peft_adapter(LoraStore& store, const std::string& dir);

}  // namespace rf::model
