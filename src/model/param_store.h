// ringflex model: the parameter store, the one place that knows where the model's weights, their gradients and
// AdamW's moments live. The model registers its parameters (Hugging Face names) and asks for each weight and gradient
// buffer just before use, between per-layer hooks (before_/after_forward, before_/after_backward) that a sharded store
// fills with its gathers and reductions; roles are contiguous float32 arenas in registration order. The design (roles,
// working bf16 weights, the hooks, the implementations) is docs/parameter-store.md.
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/default_init.h"
#include "core/dtype.h"
#include "io/safetensors.h"
#include "model/held_weight.h"
#include "model/ops.h"
#include "model/params.h"

namespace rf::model {

// The group of the parameters that belong to no decoder layer (embeddings, final norm, LM head, projections).
constexpr int kGlobalGroup = -1;
// The vision tower's groups (model.train_vision, model/vision.h): group 0 its patch embedder, 1 + l encoder layer l,
// numbered below kGlobalGroup so that they never meet a decoder layer. The tower reads and writes them between the
// same hooks as a decoder layer (a sharded store gathers and reduces one at a time).
constexpr int tower_group(int i) { return kGlobalGroup - 1 - i; }
constexpr bool is_tower_group(int group) { return group < kGlobalGroup; }
constexpr int tower_index(int group) { return kGlobalGroup - 1 - group; }
// No group: what a store's hooks hold between a group's backward and the next (no layer's gradients are live). The
// lowest int, below every tower_group a tower of fewer than 2^31 - 2 groups has, and every decoder layer and
// kGlobalGroup above it; never kGlobalGroup - 1, which is tower_group(0), the patch embedder's.
constexpr int kNoParamGroup = std::numeric_limits<int>::min();

enum class Role { Weights, Grads, ExpAvg, ExpAvgSq };
std::string_view role_name(Role r);

struct ParamInfo {
  std::string name;            // Hugging Face name, e.g. "model.layers.0.self_attn.q_proj.weight"
  std::vector<int64_t> shape;  // row-major
  int64_t numel = 0;
  int64_t offset = 0;         // first element in the Weights arena
  int64_t train_offset = -1;  // first element in the Grads / ExpAvg / ExpAvgSq arenas; -1 when frozen
  int64_t bf16_offset = -1;   // first element in the bf16 compute copies; -1 when not a matmul operand
  int layer = kGlobalGroup;   // decoder layer, kGlobalGroup, or a tower_group
  bool matmul = false;        // read by a matmul (has a bf16 compute copy); lookup tables and scales are not
  bool trainable = true;      // false: model.freeze matched it (no gradient, no moments)
  // A global parameter the run reads only in part or for a while (mark_streamed): a token table by row (rows()), the
  // LM head between acquire_head and release_head. A sharded store never keeps it gathered.
  bool streamed = false;
  // AdamW's decoupled weight decay applies: matrices only (norm and router scales are gains around 1).
  bool decays() const { return shape.size() >= 2; }
  // Expert parallelism: the parameter is rows [rows_begin, rows_begin + shape[0]) of the leading dimension (the
  // experts) of a tensor of rows_total rows, and its weights, gradient and moments cover those rows only
  // (model/expert_store.h). rows_total 0: the whole tensor.
  int64_t rows_begin = 0, rows_total = 0;
  bool holds_part() const { return rows_total > 0; }
  std::vector<int64_t> whole_shape() const {
    std::vector<int64_t> s = shape;
    if (holds_part()) s[0] = rows_total;
    return s;
  }
};

// Rank r's part of n elements split over N ranks: ceil(n / N) elements each (the padded size every rank allocates and
// sends), the last ranks' parts cut short (or empty) by the end. Any n, any N >= 1: nothing has to divide.
struct Shard {
  int64_t begin = 0, end = 0;  // [begin, end) of the n elements
  int64_t padded = 0;          // ceil(n / N): the common size of every rank's buffer
  int64_t size() const { return end - begin; }
};
Shard shard_of(int64_t n, int rank, int ranks);

// A weight as the run multiplies it: the float32 values, and their bf16 compute copy where one exists.
struct WeightView {
  const float* f32 = nullptr;
  const bf16* b16 = nullptr;  // null: no copy (not a matmul operand, or the float32 mode)
};

class ParamStore : public Bf16Lookup {
 public:
  ParamStore() = default;
  ParamStore(const ParamStore&) = delete;
  ParamStore& operator=(const ParamStore&) = delete;
  ~ParamStore() override = default;

  // --- The registry (the same for every implementation) ---
  // Registers a parameter (weights zero once allocated); returns its slot. Throws rf::Error if the name exists
  // already, its element count overflows int64, or training state exists already (the layout is fixed then).
  size_t add(const std::string& name, std::vector<int64_t> shape, int layer = kGlobalGroup, bool matmul = false);
  size_t size() const { return infos_.size(); }
  const ParamInfo& info(size_t slot) const { return infos_.at(slot); }
  const std::vector<ParamInfo>& infos() const { return infos_; }
  size_t slot(const std::string& name) const;  // throws rf::Error naming a missing parameter
  bool contains(const std::string& name) const { return index_.count(name) > 0; }
  // Slots of a decoder layer (or kGlobalGroup), in registration order.
  std::vector<size_t> group(int layer) const;
  int64_t total_elements() const { return total_; }
  int64_t trainable_elements() const { return trainable_total_; }
  int64_t weight_bytes() const;     // float32 bytes of every parameter, allocated or not
  int64_t trainable_bytes() const;  // float32 bytes of the trainable parameters (one of Grads, ExpAvg, ExpAvgSq)
  int64_t bf16_bytes() const;       // bytes of the bf16 compute copies (2 per element of every matmul operand)

  // Freezes every parameter whose name contains one of `patterns` (model.freeze). Throws rf::Error naming a pattern
  // that matches nothing. Drops gradients and moments that exist already (the layout changes; allocate them again).
  void freeze(const std::vector<std::string>& patterns);
  // The flags freeze(patterns) would set, without setting them (what the memory check counts); throws as freeze.
  std::vector<bool> trainable_after(const std::vector<std::string>& patterns) const;
  void set_trainable(const std::vector<bool>& trainable);  // one flag per slot; as freeze
  // Marks a registered slot as rows [begin, begin + shape[0]) of a tensor of `total` leading rows (ParamInfo's
  // rows_begin; model/expert_store.cpp). Throws rf::Error when the rows do not lie inside the total.
  void hold_rows(size_t slot, int64_t begin, int64_t total);
  // Marks a global parameter as streamed (ParamInfo::streamed). Throws rf::Error for a decoder layer's parameter.
  void mark_streamed(size_t slot);

  // Bumped by every writer of the weights; the compute copies are current when they were made at this version.
  uint64_t version() const { return version_; }

  // What the run reads the weights as (see the top of this file). Throws rf::Error for a dtype the store does not
  // implement (here: every store takes float32; the replicated and sharded stores take bfloat16 too).
  virtual void set_param_dtype(ParamDtype t);
  ParamDtype param_dtype() const { return param_dtype_; }

  // --- Storage (the implementation's) ---
  // The weights exist only once allocated (zero-filled; no-op when they are): until then a store is names and shapes,
  // so a loader can check what a config claims against its files and the machine's memory before allocating any.
  virtual void allocate_weights() = 0;
  virtual bool weights_allocated() const = 0;
  // Bytes of float32 weights this rank holds once allocate_weights() ran, what a loader checks against the machine
  // before allocating: every parameter's here; a sharded store's pieces (trainer/state/sharded_store.h).
  virtual int64_t resident_weight_bytes() const { return weight_bytes(); }
  virtual const float* weight(size_t slot) const = 0;
  // For writing the weights: moves version(). Write through it right away (a pointer kept across a bf16 run and
  // written later leaves that run's compute copies stale).
  virtual float* mutable_weight(size_t slot) = 0;
  // The whole tensor of `slot` into out [info(slot).numel], on every rank: how the checkpoint writer reads a weight
  // whatever the store. Here a copy of weight(slot); a sharded store (trainer/state/sharded_store.h) gathers it from
  // its owners, a collective: every rank calls it for the same slots in the same order.
  virtual void read_weight(size_t slot, std::span<float> out);
  // Sets the whole tensor of `slot` from in [info(slot).numel] (every rank passes the same values): how a loader or
  // init writes a weight whatever the store. Here a copy into mutable_weight(slot); a sharded store keeps this
  // rank's piece alone, so no rank ever holds the whole weights (no communication).
  virtual void write_weight(size_t slot, std::span<const float> in);
  // The same from a checkpoint's tensor v (any dtype io::widen_into reads), as a loader writes it: here widened
  // straight into mutable_weight(slot), so no float32 copy of the tensor sits beside the store (a copy of E2B's
  // per-layer embedding table was 9.4 GB); a store that keeps a piece widens the whole and keeps its piece.
  virtual void load_weight(size_t slot, const io::TensorView& v);
  // The float32 masters of a trainable parameter from element `first` on, for the optimizer to update in place
  // (moves version()): the weights themselves here; a sharded store's copy of the elements this rank owns.
  virtual float* mutable_master(size_t slot, int64_t first);
  // Which part of the trainable layout flat(Role::Grads) holds: trainable element grads_begin() + i at index i. The
  // whole layout here (0); a sharded store keeps its rank's slice only.
  virtual int64_t grads_begin() const { return 0; }
  // The weights' bf16 compute copies, rounded now if version() moved since they were made (thread-safe).
  virtual const Bf16Lookup& bf16_weights() = 0;
  WeightView weight_view(size_t slot, ComputeDtype dtype);

  // Gradients and moments for the trainable parameters, zero (no-op when they exist).
  virtual void allocate_grads() = 0;
  virtual void allocate_moments() = 0;
  virtual bool has_grads() const = 0;
  virtual bool has_moments() const = 0;
  virtual void zero_grads() = 0;
  // The gradient of a trainable parameter; null when frozen or when there are no gradients.
  virtual float* grad(size_t slot) = 0;
  virtual const float* grad(size_t slot) const = 0;
  // A moment of a trainable parameter (role ExpAvg or ExpAvgSq); null when frozen, absent, or not wholly inside
  // moment_range().
  virtual float* moment(Role role, size_t slot) = 0;
  virtual const float* moment(Role role, size_t slot) const = 0;

  // Which elements of the trainable layout [0, trainable_elements()) the moments hold: flat(ExpAvg)[i] is element
  // moment_range().begin + i. All of them unless set_moment_range chose a part (a rank's shard, ZeRO-1); freeze
  // resets it to all. Setting it keeps the values of the elements inside both the old and the new range, and zeroes
  // the others.
  Shard moment_range() const;
  virtual void set_moment_range(int64_t begin, int64_t end) = 0;

  // The trainable parameters' pieces inside [begin, end) of the trainable layout, in order: where a range of the
  // flat gradient or moment arenas lies in the weights.
  struct Segment {
    size_t slot = 0;
    int64_t first = 0;        // first element within the parameter
    int64_t n = 0;            // elements
    int64_t train_index = 0;  // index of `first` in the trainable layout
  };
  std::vector<Segment> trainable_segments(int64_t begin, int64_t end) const;

  // A role's whole arena (empty when not allocated); writing Weights through mutable_flat moves version().
  virtual std::span<const float> flat(Role role) const = 0;
  virtual std::span<float> mutable_flat(Role role) = 0;
  // Rank r's Shard of a role's arena over N ranks (shard_of over its length).
  std::span<float> shard(Role role, int rank, int ranks);

  // The values of a role as named tensors (tests and tools): every slot, those without storage in that role left
  // as names and shapes.
  TensorSet snapshot(Role role) const;

  // --- Weights held in another dtype than float32, and adapters (model/held_weight.h): a LoRA store's frozen base
  // and its adapters (model/lora_store.h); float32 and none in the other stores ---
  // A parameter's values as the store holds them; readers that take the held dtype as it is (the embedding's row
  // gathers) read these instead of weight(slot), which may widen a copy.
  virtual HeldWeight held_weight(size_t slot) const { return {HeldDType::F32, weight(slot)}; }
  // Asks the store to hold a parameter where the checkpoint's files are mapped, in their dtype, instead of copying it
  // into float32; `keep` keeps the mapping alive. False: the store does not (the loader writes mutable_weight).
  virtual bool hold_mapped(size_t /*slot*/, HeldWeight /*values*/, std::shared_ptr<const void> /*keep*/) {
    return false;
  }
  // Whether hold_mapped holds frozen parameters (then loading them needs no float32 copy).
  virtual bool maps_frozen_weights() const { return false; }
  // The adapter the layer adds to the linear weight of `slot` (between the layer's hooks); nullopt: none.
  virtual std::optional<LinearAdapter> adapter(size_t /*slot*/) { return std::nullopt; }

  // --- Streamed global parameters (ParamInfo::streamed) ---
  // The rows `ids` [n] of a lookup table `slot` [rows, W] for this run (a collective under a sharded store: every rank
  // calls it for the same tables in the same order, with its own ids). values holds the rows as the store holds them,
  // grads (with `want_grads` and a trainable table) their gradients, which the backward accumulates into; ids[i] is
  // row row[i] of both. Here the whole table and its whole gradient, row[i] = ids[i]; a sharded store fetches the
  // rows from their owners and sends the gradient rows back at after_backward(kGlobalGroup). Valid until then (or
  // after_forward(kGlobalGroup) without a backward).
  struct TableRows {
    HeldWeight values;
    float* grads = nullptr;    // null: no gradient wanted, or the table is frozen
    std::vector<int64_t> row;  // [n]
  };
  virtual TableRows rows(size_t slot, std::span<const int32_t> ids, bool want_grads);
  // The LM head around the loss: weight(slot) and grad(slot) are valid between acquire_head and release_head (a
  // sharded store gathers it whole there, and at release sends its gradient to the owners and frees both).
  // Collectives under a sharded store; no-ops here.
  virtual void acquire_head(size_t /*slot*/) {}
  virtual void release_head(size_t /*slot*/) {}

  // --- Layer hooks (see the top of this file): no-ops unless an implementation moves weights around ---
  virtual void before_forward(int /*layer*/) {}
  virtual void after_forward(int /*layer*/) {}
  virtual void before_backward(int /*layer*/) {}
  virtual void after_backward(int /*layer*/) {}
  // Between a layer's ops: advances the implementation's posted transfers without blocking. True when none is still
  // in flight (always here).
  virtual bool progress() { return true; }

 protected:
  void weights_changed() { ++version_; }
  void record_moment_range(int64_t begin, int64_t end);
  bool training_state_exists() const { return has_grads() || has_moments(); }
  // Drops the gradients and moments (the trainable layout changed).
  virtual void release_training_state() = 0;

 private:
  void relayout();  // train_offset and trainable_total_ from the flags

  std::vector<ParamInfo> infos_;
  std::unordered_map<std::string, size_t> index_;
  int64_t total_ = 0, trainable_total_ = 0, bf16_total_ = 0;
  int64_t moment_begin_ = 0, moment_end_ = -1;  // end -1: the whole trainable layout
  uint64_t version_ = 0;

 protected:
  ParamDtype param_dtype_ = ParamDtype::Float32;
};

// Every parameter in float32 on every rank (today's layout): one arena per role, the compute copies rounded from the
// weights arena, the hooks no-ops. With param_dtype bfloat16 also a bf16 working copy of every weight [total elements]
// (2 bytes a parameter beside the masters' 4), rounded when version() moved, which the hooks widen group by group.
class ReplicatedStore : public ParamStore {
 public:
  void set_param_dtype(ParamDtype t) override;
  void allocate_weights() override;
  bool weights_allocated() const override { return weights_allocated_; }
  const float* weight(size_t slot) const override;
  float* mutable_weight(size_t slot) override;
  const Bf16Lookup& bf16_weights() override;

  void allocate_grads() override;
  void allocate_moments() override;
  bool has_grads() const override { return grads_allocated_; }
  bool has_moments() const override { return moments_allocated_; }
  void zero_grads() override;
  float* grad(size_t slot) override;
  const float* grad(size_t slot) const override;
  float* moment(Role role, size_t slot) override;
  const float* moment(Role role, size_t slot) const override;
  void set_moment_range(int64_t begin, int64_t end) override;

  std::span<const float> flat(Role role) const override;
  std::span<float> mutable_flat(Role role) override;

  // Bf16Lookup: the copy of src[0, extent) when it lies inside one matmul operand of the weights arena (param_dtype
  // bfloat16: inside one widened matmul operand, whose working copy it gives).
  const bf16* find(const float* src, int64_t extent) const override;

  TableRows rows(size_t slot, std::span<const int32_t> ids, bool want_grads) override;
  void acquire_head(size_t slot) override;
  void release_head(size_t slot) override;
  void before_forward(int layer) override;
  void after_forward(int layer) override;
  void before_backward(int layer) override;
  void after_backward(int layer) override;

 protected:
  // param_dtype bfloat16: the working copy of `slot` [numel], rounded from the masters if they changed since. A store
  // that keeps its masters elsewhere fills working_ itself and overrides this (trainer/state/sharded_store.h).
  virtual const bf16* working(size_t slot);
  // param_dtype bfloat16: the float32 view of `slot` between its hooks, or null outside them.
  const float* widened(size_t slot) const;
  // Widens the working copy of the group's slots (kGlobalGroup: those not streamed) / of one slot, or drops it.
  void widen_group(int layer);
  void drop_group(int layer);
  void widen_slot(size_t slot);
  void release_training_state() override;
  // Drops the weights and their compute copies (a sharded store that keeps only its pieces between saves).
  void release_weights();

 private:
  std::span<const float> arena(Role role) const;
  std::span<float> arena(Role role);

  bool weights_allocated_ = false, grads_allocated_ = false, moments_allocated_ = false;
  std::vector<float> weights_, exp_avg_, exp_avg_sq_;
  // Allocated without a serial zero fill: allocate_grads zeroes it on every thread (4 bytes a trainable parameter,
  // first touched in the first step).
  std::vector<float, DefaultInitAllocator<float>> grads_;
  std::mutex bf16_mutex_;  // ranks of a loopback group may share a model
  std::vector<bf16> bf16_;
  uint64_t bf16_version_ = ~uint64_t{0};  // the version bf16_ was rounded at (none yet)
  // param_dtype bfloat16: the float32 views of the slots between their hooks (slot -> [numel]).
  std::unordered_map<size_t, Widened> widened_;

 protected:
  // param_dtype bfloat16: the working copy [total elements] (the weights arena's layout) and the version it was
  // rounded at (or, in a store that fills it itself, made current at).
  std::vector<bf16> working_;
  uint64_t working_version_ = ~uint64_t{0};
};

}  // namespace rf::model
