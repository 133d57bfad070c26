// ringflex model: the Gemma 4 text decoder, forward and backward, in float32 on the CPU.
//
// Semantics follow transformers 5.24 (Gemma4ForCausalLM / the text part of Gemma4Model), checked by
// tests/model/parity against it. Attention runs through the AttentionBackend the model is handed
// (core/attention_backend.h): the local kernels on the whole row at P = 1, the CP ring over a group of ranks
// otherwise, with docs/spec.md §3 masks from TokenMeta built on the full rows. Under CP every activation below is this
// rank's shard: T = B * L tokens instead of B * S, so activations fall ~1/P (tests/model/test_model_cp_mpi.cpp
// checks every P against P = 1).
//
// Activation memory (training), T = B*S: per layer the layer's input [T, H], its attention output
// [B, Hq, S, D] and LSE [B, Hq, S], and the o_proj and down_proj outputs [T, H] are kept (RunOptions::keep_*_output),
// i.e. 4 * T * (3H + Hq*D + Hq) bytes a layer (plus the K/V [B, Hkv, S, D] of layers that KV-shared layers read, and
// the per-layer inputs [T, L*P]). Everything else of a layer (q/k/v and gate/up projections, norms, GeGLU, MoE,
// PLE) is recomputed from its input during the backward, one layer at a time, so only one layer's intermediates
// (~4 * T * (4H + 3I + 3*Hq*D) bytes for a dense layer) are alive at once. Attention, the costly part at long S,
// is never recomputed, and neither are the two products whose outputs are no larger than the layer's input (a third
// of a dense layer's sgemm FLOPs). RunOptions::keep_mlp_projections keeps the dense MLP's gate/up projections as
// well (4 * T * 2I bytes a layer), so the recompute skips their sgemms. The loss keeps at most one chunk of logits
// (loss.h). Result reports both figures as measured.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/attention_backend.h"
#include "model/config.h"
#include "model/ops.h"
#include "model/param_store.h"
#include "model/params.h"

namespace rf::model {

class VisionEmbedder;  // multimodal.h

// One batch, row-major over [B, S]. Optional arrays may be null.
struct Batch {
  int B = 0, S = 0;
  const int32_t* input_ids = nullptr;      // [B, S] required
  const int32_t* labels = nullptr;         // [B, S] target at each position; -100 = ignored (null: no loss)
  const int32_t* position_ids = nullptr;   // [B, S] RoPE positions (null: 0..S-1 per row)
  const int32_t* doc = nullptr;            // [B, S] packed document id, 0 = padding (null: one document)
  const int32_t* mm_token_type = nullptr;  // [B, S] 0 text, 1 image, 2 video (null: all text)
  const float* image_features = nullptr;   // [N, F] one vector per vision slot (type 1 or 2), slots in row-major
  int64_t n_image_features = 0;            // N
};

struct RunOptions {
  bool want_logits = false;       // fill Result::logits [B, S, V]
  bool want_grad = false;         // accumulate the gradients into the parameter store's (params().grad)
  int64_t loss_chunk_tokens = 0;  // tokens per loss chunk; 0 = loss_chunk_tokens(V, kLossChunkBytes)
  double loss_normalizer = 0.0;   // divide the summed token loss by this; 0 = number of label tokens
  // Training memory against compute. true (the default): each layer keeps only its input, attention output and LSE,
  // and its o_proj and down_proj outputs, and the backward recomputes the rest of the layer (norms, the other
  // projections, GeGLU, MoE, PLE; never attention) one layer at a time. false: every layer keeps all its activations
  // from the forward, so the backward recomputes nothing (one layer forward less per layer) at about num_layers times
  // Result::layer_recompute_bytes more memory. Both give the same bits: the recompute is the forward's own code on the
  // same inputs.
  bool recompute_layers = true;
  // With recompute_layers: also keep each dense MLP's gate and up projections ([T, 2I] floats a layer), so the
  // recompute runs only the MLP's norm and GeGLU instead of its remaining two sgemms (1/2 of a dense layer's
  // FLOPs). Same bits as either mode above.
  bool keep_mlp_projections = false;
  // With recompute_layers: keep each layer's o_proj output (keep_o_proj_output) and down_proj output
  // (keep_down_proj_output), [T, H] floats each a layer, so the recompute does not redo those two products (o_proj a
  // sixth or less of a dense layer's sgemm FLOPs, down_proj a third). false: the recompute redoes them from the kept
  // attention output and the recomputed GeGLU, for 2 * 4 * T * H bytes a layer less. Same bits either way.
  bool keep_o_proj_output = true;
  bool keep_down_proj_output = true;
  // The dense MLP's backward works through the rank's tokens in tiles of this many (its weight gradients, the
  // adapters' included, summed tile by tile, in this order whatever tile_mlp is). tile_mlp: its forward and the
  // backward's recompute hold the [T, I] gate, up and GeGLU products one tile at a time ([tile, I] each, dropped after
  // the tile's down_proj) and the backward recomputes each tile's before using it (ALST's tiled MLP: the gate and up
  // products once more per layer in the backward), instead of the layer's whole [T, I] products. Same bits at the same
  // mlp_tile_tokens (the products are row-independent, the gradients' sums cut the same way).
  int64_t mlp_tile_tokens = 2048;
  bool tile_mlp = false;
  // With recompute_layers: a directory where what each layer keeps for the backward waits on disk instead of in
  // memory (io/spill_file.h: an unnamed file, its size model::run_spill_bytes reserved up front, removed however
  // the run ends). The forward writes each layer's kept activations there as it finishes the layer; the backward
  // reads layer l back before recomputing it and asks the kernel to read layer l - 1 ahead meanwhile. Empty: kept
  // in memory. Same bits either way (the floats go to the file and back unchanged).
  std::string spill_dir;
  // What the linear layers and attention multiply in (ops.h ComputeDtype). Bfloat16: every matmul of the decoder and
  // the LM head rounds its operands to bf16 and accumulates in float32 (oneDNN, model/matmul_bf16.h), and attention
  // reads q, k, v (and dout) rounded to bf16 by the ops that write them (attention_dtype says in what storage);
  // the parameters, gradients, activations between matmuls, norms, softmax statistics and loss stay float32. The
  // weights' bf16 copies are made once after the parameters change (the parameter store's version), not per call.
  // Loss and gradients differ from Float32 by about the operands' 2^-9 relative rounding
  // (tests/model/test_model_bf16.cpp bounds it).
  ComputeDtype compute_dtype = ComputeDtype::Float32;
  // LoRA dropout (model.lora.dropout, training runs only): the key its masks are drawn from (held_weight.h
  // lora_dropout_keeps); the trainer sets one per step and micro-batch.
  uint64_t dropout_key = 0;
  // > 0: run only the first run_layers layers, then stop without the final norm, the LM head or the loss (the
  // Result's loss and per-token outputs stay empty). Generation's prefill (model/generate.h): what it needs from the
  // run is the K/V its layers hand the attention seam, and the KV-shared layers at the end produce none. The last of
  // them runs only its K/V projections and hands them to AttentionBackend::keep_keys (its output would feed nothing).
  int run_layers = 0;
  // Fill Result::router_logits and router_experts: each MoE layer's router scores and the experts each token chose
  // (diagnostics: whether a token's choice sits on a near-tie of its scores, docs/model-fidelity.md).
  bool want_router = false;
};

// What attention's q, k, v and dout are stored in for a run computing in `t`: float32 for Float32; for Bfloat16, BF16
// where this CPU's attention kernels multiply bf16 on bf16 units that pay (cpu::bf16_units_pay, AMX tiles or
// vdpbf16ps), else float32 holding bf16-rounded values for the float32 kernels (the same numbers, without widening
// each element in the kernels' packing).
DType attention_dtype(ComputeDtype t);

// Default budget of the loss's one chunk of logits (loss.h loss_chunk_tokens: never fewer than kMinLossChunkTokens
// tokens, whatever the vocabulary).
constexpr int64_t kLossChunkBytes = int64_t{64} << 20;

// Under context parallelism (P > 1) each rank computes only the tokens it holds; `shard` says which. Per-token
// outputs are this rank's part, [B, L] in shard order: token j of row b is position shard.mine()[j] of the row
// (positions >= S are sharding padding, 0 in token_loss). Gathering every rank's part by shard.positions gives the
// full [B, S] rows (ringflex forward does it on rank 0). With one rank the shard is the row in order (L = S).
struct Result {
  double loss = 0.0;              // global: summed token losses of the whole batch / label_tokens (or
                                  // loss_normalizer), the same on every rank
  int64_t label_tokens = 0;       // label tokens of the whole batch, counted once
  RowShard shard;                 // which tokens of the rows this rank held
  std::vector<float> token_loss;  // [B, L], 0 where ignored
  std::vector<float> logits;      // [B, L, V] when asked for
  // With RunOptions::want_router, per layer (empty for a layer without MoE): the router's scores before its softmax
  // [B, L, E], and the top_k experts each token chose [B, L, K], highest probability first (ties to the lower index).
  std::vector<std::vector<float>> router_logits;
  std::vector<std::vector<int32_t>> router_experts;
  // [N, F] d loss / d image_features (training with image features): this rank's contribution, i.e. the rows of
  // the features its tokens hold (zero elsewhere); summed over the ranks it is the full gradient.
  std::vector<float> d_image_features;
  // Training memory, measured: activations kept from the forward for the backward (layer inputs, attention
  // outputs and LSE, shared K/V, the embedded row and per-layer inputs), and the largest set of one layer's
  // recomputed activations alive during the backward.
  int64_t kept_activation_bytes = 0;
  int64_t layer_recompute_bytes = 0;
  // With RunOptions::spill_dir: the bytes the spill file held (its layers' page-aligned regions), kept on disk
  // rather than in kept_activation_bytes.
  int64_t spilled_bytes = 0;
};

// Slots (in Gemma4Model::params()) of one decoder layer's parameters; kNoSlot where the layer has none.
constexpr size_t kNoSlot = static_cast<size_t>(-1);
struct LayerSlots {
  size_t q_proj = kNoSlot, q_norm = kNoSlot, k_proj = kNoSlot, v_proj = kNoSlot, k_norm = kNoSlot, o_proj = kNoSlot;
  size_t input_norm = kNoSlot, post_attn_norm = kNoSlot, pre_ff_norm = kNoSlot, post_ff_norm = kNoSlot;
  size_t gate_proj = kNoSlot, up_proj = kNoSlot, down_proj = kNoSlot;
  // MoE block
  size_t router_proj = kNoSlot, router_scale = kNoSlot, per_expert_scale = kNoSlot;
  size_t experts_gate_up = kNoSlot, experts_down = kNoSlot;
  size_t post_ff_norm_1 = kNoSlot, post_ff_norm_2 = kNoSlot, pre_ff_norm_2 = kNoSlot;
  // per-layer embeddings
  size_t ple_gate = kNoSlot, ple_proj = kNoSlot, ple_post_norm = kNoSlot;
  size_t layer_scalar = kNoSlot;  // in buffers()
};

class Gemma4Model {
 public:
  // Registers every parameter in the Hugging Face layout of Gemma4ForCausalLM ("model.layers.0..."): weights 0,
  // norm and router scales 1 (transformers' initial values), to be overwritten by a checkpoint or init_random.
  // Storage::Deferred registers the parameters' names and shapes without memory (what load_checkpoint checks against
  // the files and the machine before allocating them: params().allocate_weights(), then init_scales()).
  // `store`: where the parameters are registered and live, an empty one (null: a ReplicatedStore, every parameter in
  // float32 here); another implementation (sharded, LoRA) changes where the weights are, not the model. A multimodal
  // model (multimodal.h) registers its other parts' parameters in the same store after the decoder's.
  explicit Gemma4Model(Gemma4Config config, TensorSet::Storage storage = TensorSet::Storage::Allocated,
                       std::unique_ptr<ParamStore> store = nullptr);

  const Gemma4Config& config() const { return cfg_; }
  // The multimodal embedder (multimodal.h, owned by the multimodal model, registered in this store) that projects
  // the batch's image features [N, F] into the hidden size when the decoder embeds a row, on the slots this rank's
  // tokens hold; null (the default): the features arrive in the hidden size and are placed as they are.
  void set_vision_embedder(const VisionEmbedder* embedder) { embed_vision_ = embedder; }
  // Writes the initial 1 of every norm and router scale (the constructor does it when it allocates).
  void init_scales();
  // Where the parameters live (model/param_store.h): their registry (Hugging Face names, registration order), the
  // weights, and, once training asks for them, the gradients and AdamW's moments.
  ParamStore& params() { return *store_; }
  const ParamStore& params() const { return *store_; }
  // Puts `store` in place of the parameter store and returns the old one. `store` must register the same names in
  // the same order (the model's slots stay), the shapes may differ only where it holds part of a tensor's leading
  // rows (ParamInfo::rows_begin: expert parallelism's experts, model/expert_store.h). Throws rf::Error otherwise.
  std::unique_ptr<ParamStore> replace_params(std::unique_ptr<ParamStore> store);
  // Bytes of the bf16 compute mode's weight copies (2 per element of every matrix a matmul reads), from the shapes.
  int64_t bf16_weight_bytes() const;
  TensorSet& buffers() { return buffers_; }  // non-trainable: model.layers.<i>.layer_scalar (ones by default)
  const TensorSet& buffers() const { return buffers_; }

  // Deterministic random parameters for tests and benchmarks: weights ~ N(0, stddev), norm scales and the
  // router's scales ~ 1 + N(0, stddev).
  void init_random(uint64_t seed, float stddev);

  // Forward, and with opt.want_grad the backward, accumulating (+=) into the parameter store's gradients (allocated
  // zero by the first such run; params().zero_grads() starts an optimizer step). Frozen parameters have none, and
  // cost no weight-gradient work. The run is const on the model's definition; what it writes is the store's
  // gradients (and its bf16 compute copies, rounded when stale), through the store's layer hooks.
  // Attention runs through `attn`; under CP every rank of its group passes the SAME full batch and the model
  // shards it (the full rows' metadata goes to attn.begin_batch, then every sequence-resident array is gathered
  // to this rank's tokens). The gradients receive this rank's contribution only, NOT reduced over the ranks: sum
  // them over the CP group (comm::Communicator::allreduce over params().flat(Role::Grads), in rank order) once per
  // optimizer step.
  // Throws rf::Error on bad input, naming it; check_batch first throws the same errors without any collective.
  Result run(const Batch& batch, const RunOptions& opt, AttentionBackend& attn) const;
  // One rank, the local kernels (rf::cpu::LocalAttention).
  Result run(const Batch& batch, const RunOptions& opt) const;

  // Validates a batch for `ranks` CP ranks without computing anything (pure: the same verdict on every rank that
  // holds the same batch). Throws rf::Error naming `source` (the batch's file, where there is one), the tensor, the
  // [row, position] and the problem.
  void check_batch(const Batch& batch, int ranks = 1, const std::string& source = "batch") const;

  // The model's distinct layer masks with their layer counts, in layer order (what the attention seam plans for).
  std::vector<MaskLayers> mask_mix() const;

  const LayerSpec& spec(int layer) const { return specs_[layer]; }
  const LayerSlots& slots(int layer) const { return slots_[layer]; }

 private:
  struct Run;  // one run's activations and the steps over them (gemma4.cpp)

  Gemma4Config cfg_;
  std::vector<LayerSpec> specs_;
  std::vector<LayerSlots> slots_;
  std::unique_ptr<ParamStore> store_;
  TensorSet buffers_;
  size_t embed_ = kNoSlot, final_norm_ = kNoSlot, lm_head_ = kNoSlot;
  size_t ple_embed_ = kNoSlot, ple_proj_ = kNoSlot, ple_norm_ = kNoSlot;
  std::vector<size_t> scales_;                    // slots whose initial value is 1 (norm and router scales)
  const VisionEmbedder* embed_vision_ = nullptr;  // not owned (multimodal.h)
};

}  // namespace rf::model
