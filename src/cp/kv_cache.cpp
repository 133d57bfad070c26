// ringflex cp: generation's KV cache and its sharded decode step (see kv_cache.h, docs/generate.md).
#include "cp/kv_cache.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "core/merge.h"
#include "cp/parallel_context.h"
#include "cpu/attention.h"

namespace rf::cp {

namespace {

// One layer's cache on this rank: K and V [Hkv, C, D] in the run's attention storage, and each slot's TokenMeta
// [C]. A slot not yet written is padding (doc 0), which the mask never lets a query read, so the kernels run on all
// C slots without a length: a sliding layer's slots are a ring (a new position takes the slot of one that left the
// window), a full layer's fill from 0.
struct LayerCache {
  int C = 0, Hkv = 0, D = 0;
  int used = 0;
  std::vector<TokenMeta> meta;
  std::vector<std::byte> k, v;

  void allocate(int capacity, int heads, int dim, DType dtype) {
    C = capacity;
    Hkv = heads;
    D = dim;
    used = 0;
    meta.assign(static_cast<size_t>(C), TokenMeta{0, kPaddingDoc, kNoGroup});
    const size_t bytes = static_cast<size_t>(int64_t{Hkv} * C * D) * dtype_size(dtype);
    k.assign(bytes, std::byte{0});
    v.assign(bytes, std::byte{0});
  }
  int64_t bytes() const { return static_cast<int64_t>(k.size() + v.size() + meta.size() * sizeof(TokenMeta)); }

  // Copies token j of src_k/src_v ([Hkv, L, D] in `dtype`) into `slot`.
  void put(int slot, const void* src_k, const void* src_v, int L, int j, const TokenMeta& m, DType dtype) {
    const size_t es = dtype_size(dtype), row = static_cast<size_t>(D) * es;
    for (int h = 0; h < Hkv; ++h) {
      const size_t from = (static_cast<size_t>(h) * L + j) * row, to = (static_cast<size_t>(h) * C + slot) * row;
      std::memcpy(k.data() + to, static_cast<const std::byte*>(src_k) + from, row);
      std::memcpy(v.data() + to, static_cast<const std::byte*>(src_v) + from, row);
    }
    meta[static_cast<size_t>(slot)] = m;
  }

  // The slot a new position takes: the next free one, else (a sliding layer's ring) the oldest position's, which
  // has left the window (cache_capacity's argument).
  int slot_for(int32_t position, int window) {
    if (used < C) return used++;
    RF_CHECK(window > 0, "a full layer's cache is full: more positions decoded than start_prefill allowed");
    int oldest = 0;
    for (int s = 1; s < C; ++s)
      if (meta[s].idx < meta[oldest].idx) oldest = s;
    RF_CHECK(position - meta[oldest].idx >= window, "a sliding layer's cache would drop a position in its window");
    return oldest;
  }
};

class KvCacheContext final : public DecodeContext {
 public:
  KvCacheContext(comm::Communicator& group, std::vector<CacheLayer> layers, DType dtype,
                 const CpAttentionOptions& options)
      : group_(group),
        layers_(std::move(layers)),
        dtype_(dtype),
        timeout_(options.timeout),
        inner_(make_parallel_context(group, options)),
        cache_(layers_.size()) {}

  // A decode step is one replicated token: the model sees it as a one-rank run (its batch checks, its shard).
  int rank() const override { return decoding_ ? 0 : group_.rank(); }
  int ranks() const override { return decoding_ ? 1 : group_.size(); }

  int cache_ranks() const override { return group_.size(); }

  void start_prefill(int prompt_tokens, int decode_tokens) override {
    RF_CHECK(prompt_tokens >= 0 && decode_tokens >= 0, "generation: negative token counts");
    prompt_tokens_ = prompt_tokens;
    decode_tokens_ = decode_tokens;
    decoding_ = false;
    for (LayerCache& c : cache_) c = LayerCache{};
    // Without a prefill run (a one-token prompt) the cache holds decoded positions only.
    if (prompt_tokens == 0) allocate({});
  }

  void start_decode(int32_t position) override {
    RF_CHECK(position >= prompt_tokens_ && position < prompt_tokens_ + decode_tokens_, "generation: position ",
             position, " is outside the decode range [", prompt_tokens_, ", ", prompt_tokens_ + decode_tokens_, ")");
    decoding_ = true;
    position_ = position;
  }

  RowShard begin_batch(const TokenMeta* rows, int B, int S, const std::vector<MaskLayers>& mix) override {
    layer_ = 0;
    if (decoding_) {
      RF_CHECK(B == 1 && S == 1, "generation: a decode step runs one token, not B = ", B, ", S = ", S);
      RowShard one;
      one.S = one.L = one.P = 1;
      one.positions = {{0}};
      return one;
    }
    RF_CHECK(B == 1 && S == prompt_tokens_, "generation: the prefill runs the ", prompt_tokens_,
             " prompt tokens start_prefill announced as one row, not B = ", B, ", S = ", S);
    RowShard shard = inner_.model->begin_batch(rows, B, S, mix);
    std::vector<int32_t> held;
    for (int32_t p : shard.mine())
      if (!shard.is_pad(p)) held.push_back(p);
    allocate(held);
    return shard;
  }

  void forward(const ShardAttention& x, float* o, float* lse) override {
    RF_CHECK(layer_ < static_cast<int>(layers_.size()), "generation: more attention calls than the model's ",
             layers_.size(), " layers");
    RF_CHECK(x.dtype == dtype_, "generation: the cache keeps ", dtype_name(dtype_), ", the run gave ",
             dtype_name(x.dtype));
    const int l = layer_++;
    if (decoding_)
      decode(l, x, o, lse);
    else
      prefill(l, x, o, lse);
  }

  void backward(const ShardAttention&, const float*, const float*, const void*, float*, float*, float*) override {
    RF_CHECK(false, "generation runs no backward");
  }

  // A decode step's values are the same on every rank (the run is replicated): nothing to add up.
  void sum_over_ranks(double* values, size_t n) override {
    if (!decoding_) inner_.model->sum_over_ranks(values, n);
  }

  int64_t allocated_bytes() const override {
    int64_t n = 0;
    for (const LayerCache& c : cache_) n += c.bytes();
    return n;
  }

  int max_held_positions(bool sliding) const override {
    int n = 0;
    for (size_t l = 0; l < layers_.size(); ++l)
      if (layers_[l].kv_source < 0 && (layers_[l].mask.window > 0) == sliding) n = std::max(n, cache_[l].used);
    return n;
  }

 private:
  // Every own-KV layer's cache for the prompt positions this rank holds (`held`) and its share of the decoded ones.
  void allocate(const std::vector<int32_t>& held) {
    const int P = group_.size(), r = group_.rank();
    const int decoded = decode_tokens_ / P + (r < decode_tokens_ % P ? 1 : 0);
    for (size_t l = 0; l < layers_.size(); ++l) {
      const CacheLayer& cl = layers_[l];
      if (cl.kv_source >= 0) continue;
      const int in_window = static_cast<int>(
          std::count_if(held.begin(), held.end(), [&](int32_t p) { return in_window_after_prompt(cl, p); }));
      cache_[l].allocate(cache_capacity(cl, static_cast<int>(held.size()), in_window, decoded), cl.kv_heads,
                         cl.head_dim, dtype_);
    }
  }

  // Whether prompt position p can still be seen by the first decoded query (at prompt_tokens_) on a layer.
  bool in_window_after_prompt(const CacheLayer& cl, int32_t p) const {
    return cl.mask.window == 0 || prompt_tokens_ - p < cl.mask.window;
  }

  void prefill(int l, const ShardAttention& x, float* o, float* lse) {
    inner_.model->forward(x, o, lse);
    const CacheLayer& cl = layers_[l];
    if (cl.kv_source >= 0) return;
    LayerCache& c = cache_[l];
    const int L = x.shape.Lk;
    for (int j = 0; j < L; ++j) {
      const TokenMeta& m = x.meta[j];
      if (m.doc == kPaddingDoc || !in_window_after_prompt(cl, m.idx)) continue;
      c.put(c.slot_for(m.idx, cl.mask.window), x.k, x.v, L, j, m, dtype_);
    }
  }

  void decode(int l, const ShardAttention& x, float* o, float* lse) {
    const CacheLayer& cl = layers_[l];
    const int P = group_.size();
    const TokenMeta query{position_, 1, kNoGroup};  // one document, no image group: a text token after the prompt
    if (cl.kv_source < 0 && decode_owner(position_, prompt_tokens_, P) == group_.rank()) {
      LayerCache& c = cache_[l];
      c.put(c.slot_for(position_, cl.mask.window), x.k, x.v, 1, 0, query, dtype_);
    }
    const LayerCache& c = cache_[cl.kv_source >= 0 ? cl.kv_source : l];
    const int Hq = x.shape.Hq, D = x.shape.D;
    // This rank's partial: [Hq, D] output and [Hq] LSE over its cached keys (lse -inf, o 0 where it holds none the
    // query sees), followed in one buffer by its LSE, so one allgather moves both.
    std::vector<float> part(static_cast<size_t>(Hq) * (D + 1), 0.f);
    float* part_lse = part.data() + int64_t{Hq} * D;
    std::fill_n(part_lse, Hq, kNegInf);
    if (c.C > 0) {
      AttnChunk chunk;
      chunk.shape = AttnShape{1, Hq, x.shape.Hkv, 1, c.C, D};
      chunk.dtype = dtype_;
      chunk.q = x.q;
      chunk.k = c.k.data();
      chunk.v = c.v.data();
      chunk.q_meta = &query;
      chunk.k_meta = c.meta.data();
      chunk.mask = x.mask;
      chunk.scale = x.scale.value_or(default_scale(D));
      cpu::attention_forward(chunk, part.data(), part_lse);
    }
    if (P == 1) {
      std::copy_n(part.data(), int64_t{Hq} * D, o);
      std::copy_n(part_lse, Hq, lse);
      return;
    }
    std::vector<float> all(part.size() * static_cast<size_t>(P));
    group_.allgather(part.data(), all.data(), part.size() * sizeof(float), timeout_);
    // Rank order 0..P-1 on every rank: every rank merges the same partials in the same order, the same bits.
    std::copy_n(all.data(), int64_t{Hq} * D, o);
    std::copy_n(all.data() + int64_t{Hq} * D, Hq, lse);
    for (int r = 1; r < P; ++r) {
      const float* p = all.data() + part.size() * static_cast<size_t>(r);
      merge_partial(o, lse, p, p + int64_t{Hq} * D, Hq, D);
    }
  }

  comm::Communicator& group_;
  std::vector<CacheLayer> layers_;
  DType dtype_;
  comm::Timeout timeout_;
  JobContext inner_;
  std::vector<LayerCache> cache_;
  int prompt_tokens_ = 0, decode_tokens_ = 0;
  bool decoding_ = false;
  int32_t position_ = 0;
  int layer_ = 0;  // the next attention call's layer in the current run
};

}  // namespace

std::unique_ptr<DecodeContext> make_decode_context(comm::Communicator& group, std::vector<CacheLayer> layers,
                                                   DType dtype, const CpAttentionOptions& options) {
  return std::make_unique<KvCacheContext>(group, std::move(layers), dtype, options);
}

}  // namespace rf::cp
