// ringflex trainer: the sharded parameter store, parallelism.shard full (ZeRO-3) and gradients (ZeRO-2) over all
// cp x dp ranks, and optimizer (ZeRO-1) with model.param_dtype bfloat16. Rank r owns slice_of(trainable, N, r) of the
// trainable layout and slice_of(frozen, N, r) of the frozen one; full gathers a layer around its forward and backward,
// both modes reduce-scatter a layer's gradients after its backward; the token tables are read by row, the head gathered
// around the loss. The design (ownership, tables, head, bounded reductions, bf16 masters): docs/parallel-state.md.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "model/param_store.h"
#include "trainer/state/shard_layout.h"

namespace rf::trainer {

class ShardedStore : public model::ReplicatedStore {
 public:
  // Optimizer: only with param_dtype bfloat16 (with float32 the replicated store serves ZeRO-1, step.cpp).
  enum class Mode { Optimizer, Gradients, Full };
  // `comm`: the store's own communicator over all cp x dp ranks, so its posted collectives never interleave with
  // the trainer's or the ring's. `timeout` bounds each of its waits. `freeze`: model.freeze, applied when the
  // weights are allocated (the pieces follow the trainable flags, so they are final before any piece exists).
  // `param_dtype`: model.param_dtype, known before the weights are laid out (under optimizer and gradients it
  // decides where the masters live).
  ShardedStore(std::unique_ptr<comm::Communicator> comm, Mode mode, comm::Timeout timeout,
               std::vector<std::string> freeze = {}, model::ParamDtype param_dtype = model::ParamDtype::Float32);
  ~ShardedStore() override;

  // Two ways in. allocate_weights (a loader's or the model's own) freezes, lays the pieces out and allocates this
  // rank's (full, and with param_dtype bfloat16 beside the whole bf16 working copy; all weights under gradients),
  // which write_weight then fills tensor by tensor: no rank holds a whole float32 copy. Or adopt takes the weights of
  // `whole`, a store with the same registry and trainable flags (a resumed model's), keeping this rank's pieces
  // (as allocate_weights lays them out) or all of them (gradients). No communication either way.
  void adopt(const model::ParamStore& whole);
  // This rank's piece of a parameter while the masters are sharded (empty when it owns none), and its first element
  // in the tensor.
  std::span<const float> own_piece(size_t slot, int64_t* first) const;
  // Whether the float32 masters are this rank's pieces now: under full while sharded(); under optimizer and gradients
  // with param_dtype bfloat16 until unshard(). Then read_weight is a collective.
  bool masters_sharded() const;
  // While the masters are sharded: every rank gathers every float32 master into one whole arena (collective), so
  // weight(slot) and flat(Weights) read any parameter, as in the replicated store, until reshard() drops it (the end
  // of an in-process run that asks for whole weights, TrainOptions::whole_model; a save streams tensors through
  // read_weight instead).
  void unshard();
  void reshard();
  bool sharded() const { return mode_ == Mode::Full && adopted_ && !ReplicatedStore::weights_allocated(); }
  // After the optimizer updated this rank's masters. gradients: all-gathers every rank's updated trainable pieces
  // into every rank's weights (collective); optimizer and gradients with param_dtype bfloat16: rounded to bf16, into
  // every rank's working copy. full: the global group is gathered again at the next run.
  void after_update();
  // Seconds this rank waited on the store's collectives since the last call: the exposed communication.
  double take_exposed_seconds();
  // The bytes the store's own communicator moved so far (tests: what its posted collectives delivered).
  comm::Communicator::Traffic traffic() const { return comm_->traffic(); }
  // The bytes each reduction's receive buffers may take (Communicator::post_reduce_parts' budget; bytes_for assumes
  // the default). Tests set a small one, so that a tiny model's reductions take many rounds.
  void set_reduce_budget(size_t bytes) { reduce_budget_ = bytes; }
  // The largest receive buffer one of this store's reductions held so far (tests: it stays within the budget).
  int64_t largest_reduce_buffer() const { return largest_reduce_buffer_; }

  // The bytes one rank holds for a store of this registry over `ranks` ranks, by kind (the memory check's terms; the
  // largest over the ranks of each), with `step_tokens` tokens in all ranks' micro-batches together and `rank_tokens`
  // in one rank's (the tables' rows; -1: step_tokens).
  struct Bytes {
    int64_t weight_shard = 0;  // full: the float32 masters of the rank's pieces; gradients: every weight
    int64_t gathered = 0;      // full: the global group's small parameters, plus one layer or the head and the last
                               // layer (around the loss); the tables' rows (both modes)
    int64_t gradients = 0;     // the rank's slice, the global group's small buffer, one layer's buffer or the head's,
                               // the tables' gradient rows
    int64_t moments = 0;       // AdamW's two moments of the slice
    int64_t comm_buffers = 0;  // full: one gather's staging (the next layer's, or the head's; at a run's start the
                               // first layer's beside the tables' row fetch's send buffers); one reduction's
                               // in-flight layer gradients and its receive buffers: the N contributions to two
                               // bounded chunks of the rank's part (Communicator::reduce_parts_bytes), whatever the
                               // group's size
    int64_t working = 0;       // held() only: the whole bf16 working weights (param_dtype bfloat16 under optimizer
                               // and gradients; working_bytes_for counts them for the memory check)
  };
  static Bytes bytes_for(const model::ParamStore& registry, const std::vector<bool>& trainable, Mode mode, int ranks,
                         int64_t step_tokens, int64_t rank_tokens = -1);
  // model.param_dtype bfloat16: the bytes the bf16 working weights add on one rank, beside bytes_for's (or the
  // replicated layout's) float32 terms. full: the bf16 copy of what is gathered (`full_gathered`, bytes_for's gathered
  // term; the float32 staging it counts for a gather in flight is twice a bf16 one's: an over-count of a layer's
  // bf16 bytes). Otherwise (full_gathered < 0): the replicated bf16 copy of every weight, and the float32 widening of
  // the largest decoder layer, the global group's parameters that are not streamed and the largest streamed one (the
  // head, around the loss). These replace model.compute_dtype's bf16 copies, which are then not made.
  static int64_t working_bytes_for(const model::ParamStore& registry, int64_t full_gathered);
  // The float32 masters one rank holds when they are sharded (full; optimizer and gradients with param_dtype
  // bfloat16): its slices of the trainable and of the frozen layout, the largest over the ranks.
  static int64_t master_bytes_for(const model::ParamStore& registry, const std::vector<bool>& trainable, int ranks);
  // The bytes this rank holds now, by the same kinds (the buffers' sizes, bf16 copies counted with what they copy).
  Bytes held() const;

  // --- ParamStore ---
  // Under optimizer and gradients the dtype is the constructor's once the weights are laid out (throws rf::Error
  // for another).
  void set_param_dtype(model::ParamDtype t) override;
  void allocate_weights() override;
  bool weights_allocated() const override { return masters_sharded() || ReplicatedStore::weights_allocated(); }
  // full: this rank's pieces; optimizer and gradients with param_dtype bfloat16: those and the whole bf16 working
  // copy; gradients: every weight.
  int64_t resident_weight_bytes() const override;
  void write_weight(size_t slot, std::span<const float> in) override;
  void load_weight(size_t slot, const io::TensorView& v) override;
  const float* weight(size_t slot) const override;
  float* mutable_weight(size_t slot) override;
  void read_weight(size_t slot, std::span<float> out) override;
  float* mutable_master(size_t slot, int64_t first) override;
  int64_t grads_begin() const override;
  const model::Bf16Lookup& bf16_weights() override;
  const bf16* find(const float* src, int64_t extent) const override;

  // Gradients: optimizer keeps the replicated store's whole arena; gradients and full this rank's slice.
  void allocate_grads() override;
  bool has_grads() const override;
  void zero_grads() override;
  float* grad(size_t slot) override;
  const float* grad(size_t slot) const override;
  std::span<const float> flat(model::Role role) const override;
  std::span<float> mutable_flat(model::Role role) override;

  TableRows rows(size_t slot, std::span<const int32_t> ids, bool want_grads) override;
  void acquire_head(size_t slot) override;
  void release_head(size_t slot) override;

  void before_forward(int layer) override;
  void after_forward(int layer) override;
  void before_backward(int layer) override;
  void after_backward(int layer) override;
  // Advances the gathers posted ahead and the last layer's reduction (one test of their transfers each, which also
  // posts their next rounds); true when none is in flight.
  bool progress() override;

 protected:
  void release_training_state() override;
  // The whole working copy (optimizer and gradients with param_dtype bfloat16), current since the last write or
  // after_update; else the replicated store's.
  const bf16* working(size_t slot) override;

 private:
  // Where the masters live, fixed once laid out: this rank's pieces (full, and optimizer / gradients with
  // param_dtype bfloat16), or the replicated store's whole weights.
  bool own_masters() const { return mode_ == Mode::Full || whole_working(); }
  // Optimizer and gradients with param_dtype bfloat16: every rank holds the whole bf16 working copy.
  bool whole_working() const { return mode_ != Mode::Full && param_dtype() == model::ParamDtype::Bfloat16; }
  struct Group;
  struct Gathered;
  struct Reduction;
  struct Table;
  // A parameter's piece on rank q (layout_.piece).
  using Piece = ShardLayout::Piece;
  Piece piece(size_t slot, int q) const;
  // Elements [elem, elem + n) of a parameter, at `at` in a local buffer (a table's rows, the head's gradient).
  struct Span {
    int64_t at = 0, elem = 0, n = 0;
  };
  // The parts of rows `ids` (sorted, distinct) of table `slot` inside `pc`, `at` indexing the rows [ids, W].
  std::vector<Span> row_spans(size_t slot, const std::vector<int32_t>& ids, const Piece& pc) const;
  // The elements of `pc` outside rows `ids` (sorted, distinct) of `slot`, `at` indexing the whole tensor.
  std::vector<Span> spans_outside(size_t slot, const std::vector<int32_t>& ids, const Piece& pc) const;
  float* own(size_t slot, const Piece& pc);
  // Sends each owner q the spans spans_of(q) of `src` and adds the N contributions this rank receives for its own
  // spans (spans_of(me_)), summed in rank order in double and rounded once, into its gradient slice (collective;
  // received in rounds of bounded chunks). `src` is packed in place for the send: its values are gone after.
  template <class SpansOf>
  void reduce_spans(size_t slot, float* src, SpansOf spans_of);
  // [P]: every rank's ids, sorted and distinct (collective).
  std::vector<std::vector<int32_t>> every_ranks_ids(std::span<const int32_t> ids);
  // A table tied to the head, which a run with gradients reads whole (acquire_head) and by row.
  bool is_trained_head_table(size_t slot) const;
  void reduce_rows(Table& t);  // the table's gradient rows to their owners (collective)
  void lay_out();              // the groups, the frozen layout and this rank's slices, from the registry and its flags
  Group& group_of(int layer);
  const Group& group_of(int layer) const;
  size_t index_of(int layer) const;  // the group's index in groups_ and live_
  std::unique_ptr<Gathered> post_gather(const Group& g, bool working);
  template <class T, class Pack>
  void fetch_rows(size_t slot, const Table& t, T* rows, Pack pack);
  void finish_gather(Gathered& t);
  void gather_updated(const Group& g, bool working16);  // after_update's all-gather of the group's trainable pieces
  void acquire(int layer);
  std::unique_ptr<Reduction> post_reduce(const Group& g, std::vector<float> grads);
  // Posts t's reduction of `send` (each owner's values packed in rank order) and adds the sums of this rank's part
  // into grads_ through t.into as they arrive. The runs of each rank's contributions: `to` (this rank's, to each
  // owner) and `from` (each rank's, to this one), every part covered whole by every rank when not given.
  void post_parts(Reduction& t, const float* send, const std::vector<size_t>& parts);
  void post_parts(Reduction& t, const float* send, const std::vector<size_t>& parts,
                  std::vector<std::vector<comm::Slice>> to, std::vector<std::vector<comm::Slice>> from);
  void finish_reduce(Reduction& t);
  void wait(comm::PostedCollective& c);

  std::unique_ptr<comm::Communicator> comm_;
  Mode mode_;
  comm::Timeout timeout_;
  std::vector<std::string> freeze_;
  int P_ = 1, me_ = 0;
  int layers_ = 0;
  int towers_ = 0;  // the vision tower's groups (model::tower_group), with model.train_vision
  // [layers_ + 1 + towers_ + streamed]: the global group (its parameters that are not streamed), the decoder layers,
  // the tower's groups, then one group of its own for each streamed parameter (gathered whole only around the loss
  // (the head), or by unshard)
  std::vector<Group> groups_;
  std::vector<size_t> group_of_slot_, at_in_group_;  // [slots]: the slot's group in groups_, its index there
  ShardLayout layout_;  // which rank holds which elements of each slot, from the registry and its flags
  std::vector<float> own_trainable_, own_frozen_;  // own_masters(): the masters of this rank's pieces
  bool adopted_ = false;
  bool global_stale_ = true;  // full: the global group's gathered copy predates the last update
  bool bf16_wanted_ = false;  // a run asked for bf16 compute copies: round every gathered layer's matmul operands
  std::vector<std::unique_ptr<Gathered>> live_;  // [layers_ + 1]: the gathered (or in flight) groups
  // Gradients: this rank's slice of the trainable layout [layout_.trainable_slice(me_).size()], the global group's
  // buffer, and the layer in backward's buffer (layer grad_layer_).
  bool grads_allocated_ = false;
  std::vector<float> grads_, global_grads_, layer_grads_;
  int grad_layer_ = model::kNoParamGroup;
  std::unique_ptr<Reduction> pending_;  // the last layer's reduction, in flight
  size_t reduce_budget_ = comm::Communicator::kReduceSliceBytes;
  int64_t largest_reduce_buffer_ = 0;
  std::vector<std::unique_ptr<Table>> tables_;  // the run's token tables' rows (rows()), until its global group ends
  size_t head_ = SIZE_MAX;                      // the slot between acquire_head and release_head
  size_t last_head_ = SIZE_MAX;    // the last run's head: its gather is posted during the last layer's forward
  std::vector<float> head_grads_;  // [its numel] the head's gradient there, made by grad(head_)
  double exposed_seconds_ = 0.0;
};

}  // namespace rf::trainer
