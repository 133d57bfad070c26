// ringflex cp: generation's KV cache and its sharded decode step (see kv_cache.h, docs/generate.md).
#include "cp/kv_cache.h"

#include <algorithm>
#include <cstring>
#include <exception>

#include "core/error.h"
#include "core/merge.h"
#include "cp/decode_experts.h"
#include "cp/parallel_context.h"
#include "cpu/attention.h"

namespace rf::cp {

namespace {

// One layer's cache of one sequence on this rank: K and V [Hkv, C, D] in the cache's dtype, and each slot's TokenMeta
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

  // Copies token j of src_k/src_v ([Hkv, L, D] in `from`) into `slot` (stored in `to`: the same, or bf16 from
  // float32, rounded to nearest even).
  void put(int slot, const void* src_k, const void* src_v, int L, int j, const TokenMeta& m, DType from, DType to) {
    const size_t in_row = static_cast<size_t>(D) * dtype_size(from), out_row = static_cast<size_t>(D) * dtype_size(to);
    for (int h = 0; h < Hkv; ++h) {
      const size_t src = (static_cast<size_t>(h) * L + j) * in_row, dst = (static_cast<size_t>(h) * C + slot) * out_row;
      store(k.data() + dst, static_cast<const std::byte*>(src_k) + src, from, to);
      store(v.data() + dst, static_cast<const std::byte*>(src_v) + src, from, to);
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

 private:
  void store(std::byte* dst, const std::byte* src, DType from, DType to) const {
    if (from == to) {
      std::memcpy(dst, src, static_cast<size_t>(D) * dtype_size(to));
      return;
    }
    from_float(dst, reinterpret_cast<const float*>(src), static_cast<size_t>(D), to);
  }
};

// One sequence of the job: its prompt and decode lengths and its layers' caches ([layers]; empty for KV-shared ones).
struct SequenceCache {
  int prompt_tokens = 0, decode_tokens = 0;
  std::vector<LayerCache> layers;
};

class KvCacheContext final : public DecodeContext {
 public:
  KvCacheContext(comm::Communicator& group, std::vector<CacheLayer> layers, DType dtype, DType cache_dtype,
                 const CpAttentionOptions& options, comm::Communicator* ep_group)
      : group_(group),
        layers_(std::move(layers)),
        dtype_(dtype),
        cache_dtype_(cache_dtype),
        timeout_(options.timeout),
        inner_(make_parallel_context(group, options)) {
    RF_CHECK(cache_dtype == dtype || (dtype == DType::F32 && cache_dtype == DType::BF16), "generation: a ",
             dtype_name(cache_dtype), " cache under ", dtype_name(dtype),
             " attention storage (the cache keeps the storage's dtype, or bf16 under float32)");
    if (ep_group && ep_group->size() > 1) {
      auto experts = std::make_unique<DecodeExperts>(*ep_group, options.timeout);
      experts_ = experts.get();
      set_experts(std::move(experts));
    }
  }

  // A decode step is one replicated token a sequence: the model sees it as a one-rank run (its batch checks, its
  // shard).
  int rank() const override { return decoding_ ? 0 : group_.rank(); }
  int ranks() const override { return decoding_ ? 1 : group_.size(); }

  int cache_ranks() const override { return group_.size(); }

  void start_sequences(int sequences) override {
    RF_CHECK(sequences >= 0, "generation: a negative sequence count");
    sequences_.assign(static_cast<size_t>(sequences), SequenceCache{});
    set_decoding(false);
  }

  void start_prefill(int sequence, int prompt_tokens, int decode_tokens) override {
    RF_CHECK(prompt_tokens >= 0 && decode_tokens >= 0, "generation: negative token counts");
    SequenceCache& s = seq(sequence);
    s = SequenceCache{prompt_tokens, decode_tokens, std::vector<LayerCache>(layers_.size())};
    prefilling_ = sequence;
    set_decoding(false);
    // Without a prefill run (a one-token prompt) the cache holds decoded positions only.
    if (prompt_tokens == 0) allocate(s, {});
  }

  void start_decode(std::span<const DecodeRow> rows) override {
    RF_CHECK(!rows.empty(), "generation: a decode step of no rows");
    for (const DecodeRow& r : rows) {
      const SequenceCache& s = seq(r.sequence);
      RF_CHECK(r.position >= s.prompt_tokens && r.position < s.prompt_tokens + s.decode_tokens, "generation: sequence ",
               r.sequence, ": position ", r.position, " is outside the decode range [", s.prompt_tokens, ", ",
               s.prompt_tokens + s.decode_tokens, ")");
    }
    rows_.assign(rows.begin(), rows.end());
    set_decoding(true);
  }

  void release(int sequence) override { seq(sequence).layers = {}; }

  RowShard begin_batch(const TokenMeta* rows, int B, int S, const std::vector<MaskLayers>& mix) override {
    layer_ = 0;
    if (decoding_) {
      RF_CHECK(B == static_cast<int>(rows_.size()) && S == 1, "generation: a decode step runs one token of each of ",
               rows_.size(), " rows, not B = ", B, ", S = ", S);
      RowShard one;
      one.S = one.L = one.P = 1;
      one.positions = {{0}};
      return one;
    }
    SequenceCache& s = seq(prefilling_);
    RF_CHECK(B == 1 && S == s.prompt_tokens, "generation: the prefill runs the ", s.prompt_tokens,
             " prompt tokens start_prefill announced as one row, not B = ", B, ", S = ", S);
    RowShard shard = inner_.model->begin_batch(rows, B, S, mix);
    std::vector<int32_t> held;
    for (int32_t p : shard.mine())
      if (!shard.is_pad(p)) held.push_back(p);
    allocate(s, held);
    return shard;
  }

  void forward(const ShardAttention& x, float* o, float* lse) override {
    const int l = next_layer(x);
    if (decoding_) {
      decode(l, x, o, lse);
      return;
    }
    inner_.model->forward(x, o, lse);
    keep_prefilled(l, x);
  }

  // The prefill's last layer: its keys cached, no attention run (on any rank: the ring's forward is skipped alike).
  void keep_keys(const ShardAttention& x) override {
    RF_CHECK(!decoding_, "generation: a decode step attends every layer");
    keep_prefilled(next_layer(x), x);
  }

  void backward(const ShardAttention&, const float*, const float*, const void*, float*, float*, float*) override {
    RF_CHECK(false, "generation runs no backward");
  }

  // A decode step's values are the same on every rank (the run is replicated): nothing to add up.
  void sum_over_ranks(double* values, size_t n) override {
    if (!decoding_) inner_.model->sum_over_ranks(values, n);
  }

  int64_t allocated_bytes(int sequence) const override {
    int64_t n = 0;
    for (const LayerCache& c : seq(sequence).layers) n += c.bytes();
    return n;
  }

  int max_held_positions(int sequence, bool sliding) const override {
    const SequenceCache& s = seq(sequence);
    int n = 0;
    for (size_t l = 0; l < s.layers.size(); ++l)
      if (layers_[l].kv_source < 0 && (layers_[l].mask.window > 0) == sliding) n = std::max(n, s.layers[l].used);
    return n;
  }

 private:
  void set_decoding(bool decoding) {
    decoding_ = decoding;
    if (experts_) experts_->set_replicated(decoding);
  }

  SequenceCache& seq(int sequence) {
    RF_CHECK(sequence >= 0 && sequence < static_cast<int>(sequences_.size()), "generation: sequence ", sequence, " of ",
             sequences_.size());
    return sequences_[static_cast<size_t>(sequence)];
  }
  const SequenceCache& seq(int sequence) const { return const_cast<KvCacheContext*>(this)->seq(sequence); }

  // Every own-KV layer's cache for the prompt positions this rank holds (`held`) and its share of the decoded ones.
  void allocate(SequenceCache& s, const std::vector<int32_t>& held) {
    const int P = group_.size(), r = group_.rank();
    const int decoded = s.decode_tokens / P + (r < s.decode_tokens % P ? 1 : 0);
    for (size_t l = 0; l < layers_.size(); ++l) {
      const CacheLayer& cl = layers_[l];
      if (cl.kv_source >= 0) continue;
      const int in_window = static_cast<int>(std::count_if(held.begin(), held.end(), [&](int32_t p) {
        return in_window_after_prompt(cl, s.prompt_tokens, p);
      }));
      s.layers[l].allocate(cache_capacity(cl, static_cast<int>(held.size()), in_window, decoded), cl.kv_heads,
                           cl.head_dim, cache_dtype_);
    }
  }

  // Whether prompt position p can still be seen by the first decoded query (at prompt_tokens) on a layer.
  static bool in_window_after_prompt(const CacheLayer& cl, int prompt_tokens, int32_t p) {
    return cl.mask.window == 0 || prompt_tokens - p < cl.mask.window;
  }

  // The layer of this attention call (calls come in layer order), after checking it.
  int next_layer(const ShardAttention& x) {
    RF_CHECK(layer_ < static_cast<int>(layers_.size()), "generation: more attention calls than the model's ",
             layers_.size(), " layers");
    RF_CHECK(x.dtype == dtype_, "generation: the cache was made for ", dtype_name(dtype_), " attention, the run gave ",
             dtype_name(x.dtype));
    return layer_++;
  }

  // Copies a prefill layer's K/V shard (this rank's tokens) into the cache, those a decoded query can still see.
  void keep_prefilled(int l, const ShardAttention& x) {
    const CacheLayer& cl = layers_[l];
    if (cl.kv_source >= 0) return;
    SequenceCache& s = seq(prefilling_);
    LayerCache& c = s.layers[l];
    const int L = x.shape.Lk;
    for (int j = 0; j < L; ++j) {
      const TokenMeta& m = x.meta[j];
      if (m.doc == kPaddingDoc || !in_window_after_prompt(cl, s.prompt_tokens, m.idx)) continue;
      c.put(c.slot_for(m.idx, cl.mask.window), x.k, x.v, L, j, m, dtype_, cache_dtype_);
    }
  }

  // This rank's partial of one query row over a sequence's cached keys: out [Hq, D] and lse [Hq] (-inf, out 0 where
  // it holds none the query sees). A bf16 cache under float32 attention is widened one KV head at a time (its query
  // heads h / (Hq / Hkv) == g read head g alone) so the float32 kernel reads it.
  void attend(const LayerCache& c, const ShardAttention& x, const void* q, const TokenMeta& query, float* out,
              float* out_lse) const {
    const int Hq = x.shape.Hq, Hkv = x.shape.Hkv, D = x.shape.D;
    std::fill_n(out, int64_t{Hq} * D, 0.f);
    std::fill_n(out_lse, Hq, kNegInf);
    if (c.C == 0) return;
    AttnChunk chunk;
    chunk.dtype = dtype_;
    chunk.q_meta = &query;
    chunk.k_meta = c.meta.data();
    chunk.mask = x.mask;
    chunk.scale = x.scale.value_or(default_scale(D));
    if (cache_dtype_ == dtype_) {
      chunk.shape = AttnShape{1, Hq, Hkv, 1, c.C, D};
      chunk.q = q;
      chunk.k = c.k.data();
      chunk.v = c.v.data();
      cpu::attention_forward(chunk, out, out_lse);
      return;
    }
    const int G = Hq / Hkv;
    const size_t head = static_cast<size_t>(c.C) * D;
    std::vector<float> widened(2 * head);  // [2, C, D]: one KV head's K and V
    for (int g = 0; g < Hkv; ++g) {
      to_float(widened.data(), c.k.data() + g * head * sizeof(bf16), head, DType::BF16);
      to_float(widened.data() + head, c.v.data() + g * head * sizeof(bf16), head, DType::BF16);
      chunk.shape = AttnShape{1, G, 1, 1, c.C, D};
      chunk.q = static_cast<const float*>(q) + int64_t{g} * G * D;
      chunk.k = widened.data();
      chunk.v = widened.data() + head;
      cpu::attention_forward(chunk, out + int64_t{g} * G * D, out_lse + int64_t{g} * G);
    }
  }

  // x holds one token of each row (q [B, Hq, 1, D], k and v [B, Hkv, 1, D]); o [B, Hq, 1, D] and lse [B, Hq, 1].
  void decode(int l, const ShardAttention& x, float* o, float* lse) {
    const CacheLayer& cl = layers_[l];
    const int P = group_.size(), B = static_cast<int>(rows_.size());
    const int Hq = x.shape.Hq, Hkv = x.shape.Hkv, D = x.shape.D;
    const size_t es = dtype_size(dtype_);
    const int64_t row = int64_t{Hq} * (D + 1);
    std::vector<const LayerCache*> read(static_cast<size_t>(B));
    std::vector<TokenMeta> queries(static_cast<size_t>(B));
    for (int b = 0; b < B; ++b) {
      const DecodeRow& r = rows_[static_cast<size_t>(b)];
      SequenceCache& s = seq(r.sequence);
      queries[b] = TokenMeta{r.position, 1, kNoGroup};  // one document, no image group: a text token after the prompt
      if (cl.kv_source < 0 && decode_owner(r.position, s.prompt_tokens, P) == group_.rank()) {
        LayerCache& c = s.layers[l];
        const auto* k = static_cast<const std::byte*>(x.k) + static_cast<size_t>(b) * Hkv * D * es;
        const auto* v = static_cast<const std::byte*>(x.v) + static_cast<size_t>(b) * Hkv * D * es;
        c.put(c.slot_for(r.position, cl.mask.window), k, v, 1, 0, queries[b], dtype_, cache_dtype_);
      }
      read[b] = &s.layers[static_cast<size_t>(cl.kv_source >= 0 ? cl.kv_source : l)];
    }
    // Each row's partial: [Hq, D] output followed by its [Hq] LSE, the rows one after another in one buffer, so one
    // allgather a layer moves the whole batch's. With several rows, one parallel region over the rows (the kernel's
    // own regions then run on one thread each): one query's attention is a small job, and a region's fork and join
    // per row and layer cost more than it, worst where the cores are shared. The same bits either way: the kernel's
    // sums do not depend on its thread count.
    std::vector<float> part(static_cast<size_t>(B * row));
    // An exception must not leave an OpenMP region (it would end the process): the first is kept and rethrown after.
    std::exception_ptr failure;
#pragma omp parallel for schedule(dynamic, 1) if (B > 1)
    for (int b = 0; b < B; ++b) {
      try {
        float* p = part.data() + b * row;
        attend(*read[b], x, static_cast<const std::byte*>(x.q) + static_cast<size_t>(b) * Hq * D * es, queries[b], p,
               p + int64_t{Hq} * D);
      } catch (...) {
#pragma omp critical(rf_kv_cache_failure)
        if (!failure) failure = std::current_exception();
      }
    }
    if (failure) std::rethrow_exception(failure);
    std::vector<float> all;
    if (P > 1) {
      all.resize(part.size() * static_cast<size_t>(P));
      group_.allgather(part.data(), all.data(), part.size() * sizeof(float), timeout_);
    }
    // Rank order 0..P-1 on every rank: every rank merges the same partials in the same order, the same bits.
    for (int b = 0; b < B; ++b) {
      float* ob = o + int64_t{b} * Hq * D;
      float* lb = lse + int64_t{b} * Hq;
      const float* first = (P > 1 ? all.data() : part.data()) + b * row;
      std::copy_n(first, int64_t{Hq} * D, ob);
      std::copy_n(first + int64_t{Hq} * D, Hq, lb);
      for (int rk = 1; rk < P; ++rk) {
        const float* p = all.data() + part.size() * static_cast<size_t>(rk) + b * row;
        merge_partial(ob, lb, p, p + int64_t{Hq} * D, Hq, D);
      }
    }
  }

  comm::Communicator& group_;
  std::vector<CacheLayer> layers_;
  DType dtype_, cache_dtype_;
  comm::Timeout timeout_;
  JobContext inner_;
  std::vector<SequenceCache> sequences_;
  std::vector<DecodeRow> rows_;  // the decode step's rows
  int prefilling_ = 0;
  bool decoding_ = false;
  DecodeExperts* experts_ = nullptr;  // the experts' dispatch under expert parallelism (owned by the base), else null
  int layer_ = 0;                     // the next attention call's layer in the current run
};

}  // namespace

std::unique_ptr<DecodeContext> make_decode_context(comm::Communicator& group, std::vector<CacheLayer> layers,
                                                   DType dtype, DType cache_dtype, const CpAttentionOptions& options,
                                                   comm::Communicator* ep_group) {
  return std::make_unique<KvCacheContext>(group, std::move(layers), dtype, cache_dtype, options, ep_group);
}

}  // namespace rf::cp
