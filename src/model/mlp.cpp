// ringflex model: the dense GeGLU MLP of a Gemma 4 layer, forward and backward (gemma4_run.h).
#include <algorithm>

#include "core/error.h"
#include "model/gemma4_run.h"

namespace rf::model {

void Gemma4Model::Run::mlp_gate_up(int l, const float* m_in, float* g, float* u, TokenRows rows) {
  const LayerSlots& sl = m.slots_[l];
  const int64_t I = m.specs_[l].intermediate, n = rows.count(T);
  const float* x = m_in + rows.first * H;
  SharedOperands shared(mm);
  shared.add(x, n * H);  // gate and up both read it: rounded once in the bf16 mode
  linear_forward(shared.matmul(), x, W(sl.gate_proj), g, n, H, I);
  adapter_forward(sl.gate_proj, x, {}, g, {}, rows);
  linear_forward(shared.matmul(), x, W(sl.up_proj), u, n, H, I);
  adapter_forward(sl.up_proj, x, {}, u, {}, rows);
}

void Gemma4Model::Run::mlp_forward(int l, const float* x1, MlpActs& a) {
  const LayerSlots& sl = m.slots_[l];
  const int64_t I = m.specs_[l].intermediate;
  // A recompute is handed the forward's output (always) and its gate/up projections
  // (RunOptions::keep_mlp_projections); it redoes only what it was not handed, and GeGLU, whose product the
  // down_proj gradient reads.
  const bool projections_kept = !a.g.empty();
  a.m_in = uninit(T * H);
  a.r_pf = uninit(T);
  rmsnorm_forward(x1, W(sl.pre_ff_norm), eps, a.m_in.data(), a.r_pf.data(), T, H);
  if (opt.tile_mlp) {
    // The output a tile at a time, each tile's [tile, I] products dropped after its down_proj; a recompute handed
    // the output has nothing to do here (the backward recomputes the tiles it needs).
    RF_CHECK(!projections_kept, "run: the tiled MLP keeps no gate/up projections (keep_mlp_projections)");
    if (!a.mo.empty()) return;
    a.mo = uninit(T * H);
    const int64_t tile = gemm_tile_rows(opt.mlp_tile_tokens, T);
    Vec g = uninit(tile * I), u = uninit(tile * I), hmid = uninit(tile * I);
    for (int64_t t0 = 0; t0 < T; t0 += tile) {
      const TokenRows rows{t0, std::min(tile, T - t0)};
      mlp_gate_up(l, a.m_in.data(), g.data(), u.data(), rows);
      geglu_forward(g.data(), u.data(), hmid.data(), rows.rows * I);
      linear_forward(mm, hmid.data(), W(sl.down_proj), a.mo.data() + t0 * H, rows.rows, I, H);
      adapter_forward(sl.down_proj, hmid.data(), {}, a.mo.data() + t0 * H, {}, rows);
    }
    return;
  }
  if (!projections_kept) {
    a.g = uninit(T * I);
    a.u = uninit(T * I);
    mlp_gate_up(l, a.m_in.data(), a.g.data(), a.u.data(), {});
  }
  a.hmid = uninit(T * I);
  geglu_forward(a.g.data(), a.u.data(), a.hmid.data(), T * I);
  if (a.mo.empty()) {
    a.mo = uninit(T * H);
    linear_forward(mm, a.hmid.data(), W(sl.down_proj), a.mo.data(), T, I, H);
    adapter_forward(sl.down_proj, a.hmid.data(), {}, a.mo.data(), {});
  }
}

void Gemma4Model::Run::mlp_backward(int l, MlpActs& a, const float* x1, const float* dmo, float* dx1) {
  const LayerSlots& sl = m.slots_[l];
  const int64_t I = m.specs_[l].intermediate;
  const int64_t tile = gemm_tile_rows(opt.mlp_tile_tokens, T);
  // One tile's dh [tile, I] = dmo W_down, written (beta 0), not accumulated into zeros: no fill of an [tile, I]
  // buffer; with tile_mlp the tile's gate, up and GeGLU products, recomputed.
  Vec dh = uninit(tile * I);
  Vec g_tile, u_tile, hmid_tile;
  if (opt.tile_mlp) {
    g_tile = uninit(tile * I);
    u_tile = uninit(tile * I);
    hmid_tile = uninit(tile * I);
  }
  Vec dm = zeros(T * H);
  for (int64_t t0 = 0; t0 < T; t0 += tile) {
    const TokenRows rows{t0, std::min(tile, T - t0)};
    const int64_t n = rows.rows;
    float* g = opt.tile_mlp ? g_tile.data() : a.g.data() + t0 * I;
    float* u = opt.tile_mlp ? u_tile.data() : a.u.data() + t0 * I;
    const float* hmid = opt.tile_mlp ? hmid_tile.data() : a.hmid.data() + t0 * I;
    if (opt.tile_mlp) {
      mlp_gate_up(l, a.m_in.data(), g, u, rows);
      geglu_forward(g, u, hmid_tile.data(), n * I);
    }
    const float* dmo_t = dmo + t0 * H;
    const float* m_in_t = a.m_in.data() + t0 * H;
    float* dm_t = dm.data() + t0 * H;
    SharedOperands shared(mm);
    shared.add(dmo_t, n * H);  // read by dh's product and down_proj's weight gradient
    if (G(sl.gate_proj) || G(sl.up_proj)) shared.add(m_in_t, n * H);  // by both weight gradients below
    const Matmul ms = shared.matmul();
    gemm(ms, false, false, n, I, H, 1.f, dmo_t, H, W(sl.down_proj), I, 0.f, dh.data(), I);
    linear_backward(ms, hmid, W(sl.down_proj), dmo_t, nullptr, G(sl.down_proj), n, I, H);
    adapter_backward(sl.down_proj, hmid, {}, dmo_t, {}, dh.data(), rows);
    // dg and du overwrite g and u, which nothing reads after this: two [T, I] buffers fewer in the layer's backward.
    geglu_backward(g, u, dh.data(), g, u, n * I, false);
    linear_backward(ms, m_in_t, W(sl.gate_proj), g, dm_t, G(sl.gate_proj), n, H, I);
    adapter_backward(sl.gate_proj, m_in_t, {}, g, {}, dm_t, rows);
    linear_backward(ms, m_in_t, W(sl.up_proj), u, dm_t, G(sl.up_proj), n, H, I);
    adapter_backward(sl.up_proj, m_in_t, {}, u, {}, dm_t, rows);
  }
  rmsnorm_backward(x1, W(sl.pre_ff_norm), a.r_pf.data(), dm.data(), dx1, G(sl.pre_ff_norm), T, H);
}

}  // namespace rf::model
