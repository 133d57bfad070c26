// ringflex model: a LoRA store's adapters in PEFT's files (peft_files.cpp), what peft.PeftModel.from_pretrained loads
// and writes; the store itself: lora_store.h.
#pragma once

#include <string>

#include "model/checkpoint.h"
#include "model/lora_store.h"

namespace rf::model {

// PEFT's adapter files (what peft.PeftModel.from_pretrained loads):
//   adapter_config.json        peft_type LORA, task_type CAUSAL_LM, base_model_name_or_path, r, lora_alpha,
//                              lora_dropout, use_rslora, target_modules (the adapted modules' names in the
//                              checkpoint's layout, e.g. "model.language_model.layers.0.self_attn.q_proj"), ...
//   adapter_model.safetensors  float32 "base_model.model." + <module in the checkpoint's layout> + ".lora_A.weight"
//                              (and lora_B), e.g. base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight;
//                              the experts' adapters as their slots are named (above), target_parameters in the
//                              config
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

// The checkpoint in `dir` (load_checkpoint, `before_allocating` as there) with, where `adapter_dir` is not empty,
// the PEFT adapter in it over the base: the base loaded into a LoraStore of the adapter's config (read_peft_config),
// then the adapter's tensors read (load_peft_adapter). `adapters` is that store, owned by checkpoint.model, or null
// without an adapter (a replicated store).
struct AdaptedCheckpoint {
  Checkpoint checkpoint;
  LoraStore* adapters = nullptr;
};
AdaptedCheckpoint load_adapted_checkpoint(const std::string& dir, const std::string& adapter_dir,
                                          const BeforeAllocating& before_allocating = {});

}  // namespace rf::model
