// ringflex model: LoRA over a frozen base, one more implementation of the parameter store (model/param_store.h).
// The base is frozen, held in the checkpoint's own dtype (mapped read-only, shared by a machine's ranks) and widened
// to float32 one layer at a time in the hooks; each targeted linear gets PEFT's trainable adapters A [r, in] and
// B [out, r] (y = x W^T + scale * (x A^T) B^T), the only slots with gradients and moments. Targets, the experts'
// 3-D adapters, their file layout and expert parallelism: docs/parameter-store.md, "LoraStore".
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
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
  // PEFT's target_parameters: the MoE experts' 3-D weights ("experts.gate_up_proj", "experts.down_proj"), names
  // matched as target's list is, against "model.layers.N.experts.gate_up_proj".
  std::vector<std::string> target_parameters;
  bool use_rslora = false;
  uint64_t seed = 0;  // A's initial values are a function of (seed, the adapter's name, the element) only

  double scale() const;
  // Throws rf::Error naming the field: rank < 1, alpha <= 0, dropout != 0, no target and no target_parameters.
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
  int64_t experts = 1;  // E of a 3-D experts weight [experts, out, in] (1: a linear, or an MoE of one expert)
  // A 3-D experts weight (target_parameters), whatever E: its adapter is named as PEFT's ParamWrapper names it even
  // when E = 1, where the layout is a linear's.
  bool experts_weight = false;
};
std::vector<LoraTarget> lora_targets(const ParamStore& shapes, const LoraConfig& config);
// Float32 bytes of the adapters of `targets` (one of weights, gradients, exp_avg, exp_avg_sq). With `ep` > 1 an EP
// rank's: the experts' adapters are E / ep experts' worth (LoraStore::place_experts).
int64_t lora_adapter_bytes(const std::vector<LoraTarget>& targets, int rank, int ep = 1);
// Float32 bytes of the largest layer's widening of its base that the hooks hold (one layer at a time) when the base
// is not float32: of `base`, a registry of the model's parameters alone (every slot a base slot: the memory check's
// shapes), or of a LoraStore's base slots (its adapters, float32 already, left out).
int64_t lora_layer_buffer_bytes(const ParamStore& base);
class LoraStore;
int64_t lora_layer_buffer_bytes(const LoraStore& store);
// Float32 bytes of the global group's widened matmul operands but the head (the per-layer-input projection), alive
// for the whole run, and of the loss's float32 panel of the head (ParamInfo::streamed matmul operands; loss.h
// head_panel_bytes), alive for the loss.
int64_t lora_global_buffer_bytes(const ParamStore& shapes);
int64_t lora_head_buffer_bytes(const ParamStore& shapes);

class LoraStore : public ParamStore {
 public:
  explicit LoraStore(LoraConfig config);

  const LoraConfig& config() const { return cfg_; }

  // Expert parallelism: before allocate_weights, this store becomes EP rank `ep_rank` of `ep` (the header says what
  // it holds). Throws rf::Error once allocated, or when an experts weight's E does not divide over ep (at
  // allocate_weights).
  void place_experts(int ep_rank, int ep);
  // A LoraStore with this one's registry, its adapters whole (every expert's), their weights and (when this one has
  // them) moments allocated, the rows this store holds copied; the base has no values. What a checkpoint writer
  // fills with the other EP ranks' rows (trainer/state/expert_state.h) and saves.
  std::unique_ptr<LoraStore> whole_adapters() const;

  // A whole adapter tensor (`slot` holds every row) in PEFT's file layout: its shape, and its values from the
  // store's (an experts' B reordered from [E * out, r] to [out, r * E]; every other tensor as it is). from_file is
  // the inverse.
  std::vector<int64_t> file_shape(size_t slot) const;
  void to_file_layout(size_t slot, std::span<const float> held, std::span<float> file) const;
  void from_file_layout(size_t slot, std::span<const float> file, std::span<float> held) const;

  // Registers the adapters of every targeted slot (throws rf::Error as the header says), freezes the base,
  // allocates the adapters and their state and initialises them. The base gets no storage here: the loader maps it
  // (hold_mapped), or mutable_weight makes a float32 one.
  void allocate_weights() override;
  bool weights_allocated() const override { return allocated_; }
  // A's Kaiming-uniform values and B's zeros again (after Gemma4Model::init_random, which fills every slot).
  void init_adapters();

  struct Adapter {
    size_t base = 0, a = 0, b = 0;  // slots: W [out, in], A [r, in], B [out, r] (experts: held_weight.h's layout)
    int64_t out = 0, in = 0;
    int64_t experts = 1;          // E of an experts weight (1: a linear, or an MoE of one expert)
    bool experts_weight = false;  // a 3-D experts weight (LoraTarget::experts_weight)
    int64_t experts_held = 1;     // how many of them this store holds (E / ep), from expert experts_begin on
    int64_t experts_begin = 0;
  };
  const std::vector<Adapter>& adapters() const { return adapters_; }
  // The slots the model registered (the base); the adapters' follow them.
  size_t base_slots() const { return base_slots_; }
  // The modules that carry adapters, in registration order (PEFT's target_modules as resolved names), and the 3-D
  // parameters that do (PEFT's target_parameters, resolved).
  std::vector<std::string> target_modules() const;
  std::vector<std::string> target_parameters() const;
  // Bytes of the base as it is held (its dtype; mapped or not), and of the part that is mapped from the files.
  int64_t held_base_bytes() const;
  int64_t mapped_base_bytes() const;
  // Float32 bytes of the base's widenings the hooks hold now (what lora_*_buffer_bytes count per phase).
  int64_t widened_bytes() const;

  const float* weight(size_t slot) const override;
  float* mutable_weight(size_t slot) override;
  const Bf16Lookup& bf16_weights() override { return *this; }
  // A bf16 base's mapped values, for src inside a float32 widening the hooks made of it; null otherwise (the matmul
  // rounds that operand itself).
  const bf16* find(const float* src, int64_t extent) const override;

  void allocate_grads() override { adapters_store_.allocate_grads(); }
  void allocate_moments() override { adapters_store_.allocate_moments(); }
  bool has_grads() const override { return adapters_store_.has_grads(); }
  bool has_moments() const override { return adapters_store_.has_moments(); }
  void zero_grads() override { adapters_store_.zero_grads(); }
  float* grad(size_t slot) override;
  const float* grad(size_t slot) const override;
  float* moment(Role role, size_t slot) override;
  const float* moment(Role role, size_t slot) const override;
  void set_moment_range(int64_t begin, int64_t end) override;
  // Grads, ExpAvg, ExpAvgSq: the adapters' arenas, the trainable layout. Weights: the adapters' weights only (the base
  // is no float32 arena).
  std::span<const float> flat(Role role) const override { return adapters_store_.flat(role); }
  std::span<float> mutable_flat(Role role) override;

  HeldWeight held_weight(size_t slot) const override;
  bool hold_mapped(size_t slot, HeldWeight values, std::shared_ptr<const void> keep) override;
  bool maps_frozen_weights() const override { return true; }
  std::optional<LinearAdapter> adapter(size_t slot) override;

  // The head (the tied token table of Gemma 4, 1.5 GiB as float32 for E2B) is never widened whole: the loss reads it
  // as held (held_weight), by panels (loss.h). Only a float32 head not aligned for float is copied, for the loss alone.
  void acquire_head(size_t slot) override;
  void release_head(size_t slot) override;
  void before_forward(int layer) override { acquire(layer); }
  void after_forward(int layer) override { release(layer); }
  void before_backward(int layer) override { acquire(layer); }
  void after_backward(int layer) override { release(layer); }

 protected:
  void release_training_state() override { adapters_store_.release(); }

 private:
  // The adapters' float32 arenas: their slots are this store's adapter slots less base_slots_.
  struct AdapterArena : ReplicatedStore {
    void release() { release_training_state(); }
  };
  struct Base {
    HeldWeight held;           // data null: no values yet
    std::vector<float> owned;  // float32 values written through mutable_weight (held points here then)
  };
  bool is_base(size_t slot) const { return slot < base_slots_; }
  size_t inner(size_t slot) const { return slot - base_slots_; }
  // Whether the float32 view of a base slot needs a widened copy (not float32, or not aligned for float).
  bool needs_widening(size_t slot) const;
  // Widens a base slot into widened_ unless it is there, a lookup table, or needs no widening.
  void widen_slot(size_t slot);
  void acquire(int layer);
  void release(int layer);
  // The adapter index of a base slot, or -1.
  int adapter_of(size_t slot) const { return slot < adapter_of_.size() ? adapter_of_[slot] : -1; }

  // The Adapter of an adapter slot (its A or B), or null.
  const Adapter* adapter_owning(size_t slot) const;

  LoraConfig cfg_;
  int ep_rank_ = 0, ep_ = 1;  // place_experts
  bool allocated_ = false;
  size_t base_slots_ = 0;  // slots registered by the model; the adapters' follow
  std::vector<Adapter> adapters_;
  std::vector<int> adapter_of_;  // [base slots] adapter index or -1
  AdapterArena adapters_store_;
  std::vector<Base> base_;                         // [base slots]
  std::vector<std::shared_ptr<const void>> keep_;  // the mapped files the base points into
  std::unordered_map<size_t, Widened> widened_;    // base slot -> its float32 widening, acquired layers'
  mutable std::vector<float> scratch_;             // weight() of an unacquired widened slot (tools)
  mutable size_t scratch_slot_ = ~size_t{0};
  mutable uint64_t scratch_version_ = 0;
};

}  // namespace rf::model
