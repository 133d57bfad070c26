// ringflex trainer: the sharded parameter store, parallelism.shard = full (ZeRO-3 / FSDP) and gradients (ZeRO-2)
// over all cp x dp ranks (model/param_store.h has the design; docs/spec.md the modes).
//
// Ownership. Rank r of N owns slice_of(trainable elements, N, r) of the trainable layout (the same slice as ZeRO-1's
// moments, so clipping's partial sums and the optimizer's elements are shard none's) and slice_of(frozen elements,
// N, r) of the frozen parameters taken in registration order. A parameter's piece on rank r is where its elements
// meet r's slice: nothing has to divide by N, a rank may own parts of several tensors or none of one.
//
// full: a rank holds float32 masters of its pieces only [own slices], gradients of its trainable slice, AdamW's
// moments of it. A decoder layer's weights are all-gathered (the pieces of every rank) into a layer buffer just
// before its forward and again before its recompute + backward, and freed after each (the last layer, whose backward
// follows its forward, stays gathered between them); the next layer's gather is posted while this one computes, and
// progresses between its ops (progress()). The global group (embeddings, final norm, head, projections: read at a run's
// start and end, the head's gradient written before any layer's) stays gathered for the run, with a whole-size
// gradient buffer, and is gathered again after each update.
// gradients: the weights stay whole on every rank (the optimizer updates this rank's trainable pieces of them, and
// after_update all-gathers the others'); the gradients are as in full.
// Both: a layer's gradients are written into a layer-sized buffer during its backward; after_backward sends every
// owner its pieces (an all-to-all-v posted, in flight during the next layer's backward), and each owner sums the N
// contributions in rank order in double, rounded once (comm::Communicator::reduce_scatter's combination, so one
// micro-batch a step gives shard none's bits at every N), adding the result into its slice.
// With gradient accumulation the micro-batches' reduced sums are added in the slice where shard none adds raw
// micro-batch gradients and reduces once: the same terms, associated differently (float32 rounding, not bits).
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "model/param_store.h"

namespace rf::trainer {

class ShardedStore : public model::ReplicatedStore {
 public:
  enum class Mode { Gradients, Full };
  // `comm`: the store's own communicator over all cp x dp ranks, so its posted collectives never interleave with
  // the trainer's or the ring's. `timeout` bounds each of its waits. `freeze`: model.freeze, applied when the
  // weights are allocated (the pieces follow the trainable flags, so they are final before any piece exists).
  ShardedStore(std::unique_ptr<comm::Communicator> comm, Mode mode, comm::Timeout timeout,
               std::vector<std::string> freeze = {});
  ~ShardedStore() override;

  // Two ways in. allocate_weights (a loader's or the model's own) freezes, lays the pieces out and allocates this
  // rank's (full; all weights under gradients), which write_weight then fills tensor by tensor: no rank holds a
  // whole copy. Or adopt takes the weights of `whole`, a store with the same registry and trainable flags (a
  // resumed model's), keeping this rank's pieces (full) or all of them (gradients). No communication either way.
  void adopt(const model::ParamStore& whole);
  // This rank's piece of a parameter while sharded (empty when it owns none), and its first element in the tensor.
  std::span<const float> own_piece(size_t slot, int64_t* first) const;
  // full: every rank gathers every weight into one whole arena (collective), so weight(slot) and flat(Weights) read
  // any parameter, as in the replicated store, until reshard() drops it (the end of an in-process run that asks for
  // whole weights, TrainOptions::whole_model; a save streams tensors through read_weight instead).
  void unshard();
  void reshard();
  bool sharded() const { return mode_ == Mode::Full && adopted_ && !ReplicatedStore::weights_allocated(); }
  // After the optimizer updated this rank's masters. gradients: all-gathers every rank's updated trainable pieces
  // into every rank's weights (collective). full: the global group is gathered again at the next run.
  void after_update();
  // Seconds this rank waited on the store's collectives since the last call: the exposed communication.
  double take_exposed_seconds();
  // The bytes the store's own communicator moved so far (tests: what its posted collectives delivered).
  comm::Communicator::Traffic traffic() const { return comm_->traffic(); }

  // The bytes one rank holds for a store of this registry over `ranks` ranks, by kind (the memory check's terms).
  struct Bytes {
    int64_t weight_shard = 0;  // full: the float32 masters of the rank's pieces; gradients: every weight
    int64_t gathered = 0;      // full: the global group, plus two layers (the current one and the next, posted)
    int64_t gradients = 0;     // the rank's slice, the global group's buffer, one layer's buffer
    int64_t moments = 0;       // AdamW's two moments of the slice
    int64_t comm_buffers = 0;  // a layer gather's staging (x2 in flight) and one reduction's send + receive (x2)
  };
  static Bytes bytes_for(const model::ParamStore& registry, const std::vector<bool>& trainable, Mode mode, int ranks);

  // --- ParamStore ---
  void allocate_weights() override;
  bool weights_allocated() const override { return sharded() || ReplicatedStore::weights_allocated(); }
  // full: this rank's pieces; gradients: every weight.
  int64_t resident_weight_bytes() const override;
  void write_weight(size_t slot, std::span<const float> in) override;
  const float* weight(size_t slot) const override;
  float* mutable_weight(size_t slot) override;
  void read_weight(size_t slot, std::span<float> out) override;
  float* mutable_master(size_t slot, int64_t first) override;
  int64_t grads_begin() const override { return static_cast<int64_t>(mine_trainable_.begin); }
  const model::Bf16Lookup& bf16_weights() override;
  const bf16* find(const float* src, int64_t extent) const override;

  void allocate_grads() override;
  bool has_grads() const override { return grads_allocated_; }
  void zero_grads() override;
  float* grad(size_t slot) override;
  const float* grad(size_t slot) const override;
  std::span<const float> flat(model::Role role) const override;
  std::span<float> mutable_flat(model::Role role) override;

  void before_forward(int layer) override;
  void after_forward(int layer) override;
  void before_backward(int layer) override;
  void after_backward(int layer) override;
  // Advances the gathers posted ahead and the last layer's reduction (one test of their transfers each, which also
  // posts their next rounds); true when none is in flight.
  bool progress() override;

 protected:
  void release_training_state() override;

 private:
  struct Group;
  struct Gathered;
  struct Reduction;
  // A parameter's piece on rank q: elements [first, first + n) of it, at `local` in q's own slice.
  struct Piece {
    int64_t first = 0, n = 0, local = 0;
  };
  Piece piece(size_t slot, int q) const;
  void lay_out();  // the groups, the frozen layout and this rank's slices, from the registry and its flags
  Group& group_of(int layer);
  const Group& group_of(int layer) const;
  std::unique_ptr<Gathered> post_gather(const Group& g, bool trainable_only);
  void finish_gather(Gathered& t);
  void acquire(int layer);
  std::unique_ptr<Reduction> post_reduce(const Group& g, const float* grads);
  void finish_reduce(Reduction& t);
  void wait(comm::PostedCollective& c);

  std::unique_ptr<comm::Communicator> comm_;
  Mode mode_;
  comm::Timeout timeout_;
  std::vector<std::string> freeze_;
  int P_ = 1, me_ = 0;
  int layers_ = 0;
  std::vector<Group> groups_;           // [layers_ + 1]: the global group, then the decoder layers
  std::vector<int64_t> frozen_offset_;  // [slots]: first element in the frozen layout; -1 when trainable
  int64_t frozen_total_ = 0;
  comm::Slice mine_trainable_, mine_frozen_;       // this rank's slices of the two layouts
  std::vector<float> own_trainable_, own_frozen_;  // full: the masters of this rank's pieces
  bool adopted_ = false;
  bool global_stale_ = true;  // full: the global group's gathered copy predates the last update
  bool bf16_wanted_ = false;  // a run asked for bf16 compute copies: round every gathered layer's matmul operands
  std::vector<std::unique_ptr<Gathered>> live_;  // [layers_ + 1]: the gathered (or in flight) groups
  // Gradients: this rank's slice of the trainable layout [mine_trainable_.size()], the global group's buffer, and
  // the layer in backward's buffer (layer grad_layer_).
  bool grads_allocated_ = false;
  std::vector<float> grads_, global_grads_, layer_grads_;
  int grad_layer_ = model::kGlobalGroup - 1;
  std::unique_ptr<Reduction> pending_;  // the last layer's reduction, in flight
  double exposed_seconds_ = 0.0;
};

}  // namespace rf::trainer
