// ringflex model: the attention block of a Gemma 4 layer, forward and backward (gemma4_run.h).
//
// Q, K and V are produced head-major ([B, heads, S, D], the layout the attention seam reads) by one sgemm per row
// and head, and o_proj reads O head-major the same way, so no full-tensor transpose happens per layer. The op that
// writes Q, K, V (norm and RoPE in one pass) and dO (o_proj's backward) writes them in the attention's storage
// (Run::attn_dtype: bf16 in the bf16 mode where the kernels have bf16 units), so no pass converts them. Attention
// itself runs through the AttentionBackend: the local kernels, or the CP ring over this rank's shard.
#include <algorithm>

#include "model/gemma4_run.h"
#include "model/memory.h"

namespace rf::model {

void Gemma4Model::Run::attention_forward(int l, const float* x, AttnActs& a, bool reuse_attention) {
  const LayerSpec& sp = m.specs_[l];
  const LayerSlots& sl = m.slots_[l];
  const int Hq = cfg.num_heads, D = sp.head_dim;
  const int64_t qd = int64_t{Hq} * D;

  // q/k get a scaled RMSNorm per head then RoPE; v a scale-free RMSNorm and no RoPE.
  attention_input(l, x, a);
  // Projections land head-major, [B, heads, S, D], the layout attention reads; norms and RoPE act per D-vector,
  // so they run on that layout as they are.
  a.q_raw = uninit(T * qd);
  SharedOperands shared(mm);
  shared.add(a.a.data(), T * H);  // q, k and v projections all read it: rounded once in the bf16 mode
  const Matmul ms = shared.matmul();
  heads_forward(ms, a.a.data(), W(sl.q_proj), a.q_raw.data(), B, S, H, Hq, D);
  adapter_forward(sl.q_proj, a.a.data(), {}, a.q_raw.data(), {Hq, D});
  a.q_rms = uninit(T * Hq);
  a.Q = attn_tensor(T * qd);
  rmsnorm_rope_forward(a.q_raw.data(), W(sl.q_norm), eps, &rope(sp), B, Hq, S, D, a.q_rms.data(), out(a.Q));

  const AttnTensor* K = nullptr;
  const AttnTensor* V = nullptr;
  if (sp.kv_source < 0) {
    own_kv_forward(l, ms, a);
    if (sp.stores_kv && !reuse_attention) {
      kv_K[l] = a.K.copy();
      kv_V[l] = a.V.copy();
    }
    K = &a.K;
    V = &a.V;
  } else {
    K = &kv_K[sp.kv_source];
    V = &kv_V[sp.kv_source];
  }
  if (!reuse_attention) {
    a.O = zeros(T * qd);
    a.lse = zeros(T * Hq);
    attn.forward(attention(sp, a.Q, *K, *V), a.O.data(), a.lse.data());
  }
  // A recompute is handed the forward's o_proj output ([T, H], kept beside O) and redoes only its norm.
  if (a.ao.empty()) {
    a.ao = uninit(T * H);
    merge_heads_forward(mm, a.O.data(), W(sl.o_proj), a.ao.data(), B, S, Hq, D, H);
    adapter_forward(sl.o_proj, a.O.data(), {Hq, D}, a.ao.data(), {});
  }
  a.x1 = uninit(T * H);
  a.r_pa = uninit(T);
  rmsnorm_forward(a.ao.data(), W(sl.post_attn_norm), eps, a.x1.data(), a.r_pa.data(), T, H);
  add_into(a.x1.data(), x, T * H);
}

void Gemma4Model::Run::attention_keys_forward(int l, const float* x, AttnActs& a) {
  const LayerSpec& sp = m.specs_[l];
  if (sp.kv_source >= 0) return;  // a KV-shared layer has no keys of its own
  attention_input(l, x, a);
  SharedOperands shared(mm);
  shared.add(a.a.data(), T * H);  // k and v read it: rounded once in the bf16 mode, as attention_forward does
  own_kv_forward(l, shared.matmul(), a);
  attn.keep_keys(attention(sp, a.Q, a.K, a.V));
}

void Gemma4Model::Run::attention_input(int l, const float* x, AttnActs& a) {
  a.a = uninit(T * H);
  a.r_in = uninit(T);
  rmsnorm_forward(x, W(m.slots_[l].input_norm), eps, a.a.data(), a.r_in.data(), T, H);
}

void Gemma4Model::Run::own_kv_forward(int l, const Matmul& ms, AttnActs& a) {
  const LayerSpec& sp = m.specs_[l];
  const LayerSlots& sl = m.slots_[l];
  const int Hkv = sp.kv_heads, D = sp.head_dim;
  const int64_t kd = int64_t{Hkv} * D;
  a.k_raw = uninit(T * kd);
  heads_forward(ms, a.a.data(), W(sl.k_proj), a.k_raw.data(), B, S, H, Hkv, D);
  adapter_forward(sl.k_proj, a.a.data(), {}, a.k_raw.data(), {Hkv, D});
  if (sp.has_v_proj) {
    a.v_raw = uninit(T * kd);
    heads_forward(ms, a.a.data(), W(sl.v_proj), a.v_raw.data(), B, S, H, Hkv, D);
    adapter_forward(sl.v_proj, a.a.data(), {}, a.v_raw.data(), {Hkv, D});
  }
  const Vec& v_src = sp.has_v_proj ? a.v_raw : a.k_raw;  // attention_k_eq_v: V is the raw K projection
  a.k_rms = uninit(T * Hkv);
  a.v_rms = uninit(T * Hkv);
  a.K = attn_tensor(T * kd);
  a.V = attn_tensor(T * kd);
  rmsnorm_rope_forward(a.k_raw.data(), W(sl.k_norm), eps, &rope(sp), B, Hkv, S, D, a.k_rms.data(), out(a.K));
  rmsnorm_rope_forward(v_src.data(), nullptr, eps, nullptr, B, Hkv, S, D, a.v_rms.data(), out(a.V));
}

void Gemma4Model::Run::attention_backward(int l, AttnActs& a, const float* x, const float* dx1, float* dx) {
  const LayerSpec& sp = m.specs_[l];
  const LayerSlots& sl = m.slots_[l];
  const int Hq = cfg.num_heads, Hkv = sp.kv_heads, D = sp.head_dim;
  const int64_t qd = int64_t{Hq} * D, kd = int64_t{Hkv} * D;
  const AttentionGradWidths w = attention_grad_widths(cfg, sp);  // the memory model counts the same buffers

  Vec dao = zeros(T * w.dao);
  rmsnorm_backward(a.ao.data(), W(sl.post_attn_norm), a.r_pa.data(), dx1, dao.data(), G(sl.post_attn_norm), T, H);
  AttnTensor dO = attn_tensor(T * w.dO);  // [B, Hq, S, D], written by o_proj's backward in the attention's storage
  if (has_adapter(sl.o_proj)) {
    // LoRA on o_proj: its adapter's input gradient joins the base's in float32 before dO is stored (and rounded).
    Vec dO_f32 = zeros(T * qd);  // [B, Hq, S, D]
    merge_heads_backward(mm, a.O.data(), W(sl.o_proj), dao.data(), dO_f32.data(), G(sl.o_proj), B, S, Hq, D, H);
    adapter_backward(sl.o_proj, a.O.data(), {Hq, D}, dao.data(), {}, dO_f32.data());
    out(dO).store(dO_f32.data(), T * qd);
  } else {
    merge_heads_backward(mm, a.O.data(), W(sl.o_proj), dao.data(), out(dO), G(sl.o_proj), B, S, Hq, D, H);
  }
  Vec dQ = zeros(T * w.dQ);
  Vec dK = zeros(T * w.dKV), dV = zeros(T * w.dKV);  // this layer's own contribution, written by the backend
  const bool shared = sp.kv_source >= 0;
  const AttnTensor& K = shared ? kv_K[sp.kv_source] : a.K;
  const AttnTensor& V = shared ? kv_V[sp.kv_source] : a.V;
  attn.backward(attention(sp, a.Q, K, V), a.O.data(), a.lse.data(), dO.data(), dQ.data(), dK.data(), dV.data());
  if (shared) {
    // KV-shared layer: its K/V gradients belong to the layer that produced them (reached later in the backward).
    add_into(kv_dK[sp.kv_source].data(), dK.data(), T * kd);
    add_into(kv_dV[sp.kv_source].data(), dV.data(), T * kd);
  } else if (sp.stores_kv) {
    // Plus what the layers that read this layer's K/V sent back.
    add_into(dK.data(), kv_dK[l].data(), T * kd);
    add_into(dV.data(), kv_dV[l].data(), T * kd);
  }

  // Everything stays head-major back to the projections' weights.
  rope_apply_head_major(dQ.data(), rope(sp), B, Hq, S, true);
  Vec dq_raw = zeros(T * w.dq_raw);
  rmsnorm_backward(a.q_raw.data(), W(sl.q_norm), a.q_rms.data(), dQ.data(), dq_raw.data(), G(sl.q_norm), T * Hq, D);
  Vec da = zeros(T * w.da);
  SharedOperands rounded(mm);
  if (G(sl.q_proj) || G(sl.k_proj) || G(sl.v_proj)) rounded.add(a.a.data(), T * H);  // their weight gradients read it
  const Matmul ms = rounded.matmul();
  heads_backward(ms, a.a.data(), W(sl.q_proj), dq_raw.data(), da.data(), G(sl.q_proj), B, S, H, Hq, D);
  adapter_backward(sl.q_proj, a.a.data(), {}, dq_raw.data(), {Hq, D}, da.data());
  if (sp.kv_source < 0) {
    rope_apply_head_major(dK.data(), rope(sp), B, Hkv, S, true);
    Vec dk_raw = zeros(T * w.dk_raw);
    rmsnorm_backward(a.k_raw.data(), W(sl.k_norm), a.k_rms.data(), dK.data(), dk_raw.data(), G(sl.k_norm), T * Hkv, D);
    if (sp.has_v_proj) {
      Vec dv_raw = zeros(T * w.dv_raw);
      rmsnorm_backward(a.v_raw.data(), nullptr, a.v_rms.data(), dV.data(), dv_raw.data(), nullptr, T * Hkv, D);
      heads_backward(ms, a.a.data(), W(sl.v_proj), dv_raw.data(), da.data(), G(sl.v_proj), B, S, H, Hkv, D);
      adapter_backward(sl.v_proj, a.a.data(), {}, dv_raw.data(), {Hkv, D}, da.data());
    } else {
      rmsnorm_backward(a.k_raw.data(), nullptr, a.v_rms.data(), dV.data(), dk_raw.data(), nullptr, T * Hkv, D);
    }
    heads_backward(ms, a.a.data(), W(sl.k_proj), dk_raw.data(), da.data(), G(sl.k_proj), B, S, H, Hkv, D);
    adapter_backward(sl.k_proj, a.a.data(), {}, dk_raw.data(), {Hkv, D}, da.data());
  }
#pragma omp parallel for schedule(static) if (T * H >= kParallelMinElements)
  for (int64_t i = 0; i < T * H; ++i) dx[i] = dx1[i];
  rmsnorm_backward(x, W(sl.input_norm), a.r_in.data(), da.data(), dx, G(sl.input_norm), T, H);
}

}  // namespace rf::model
