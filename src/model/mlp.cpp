// ringflex model: the dense GeGLU MLP of a Gemma 4 layer, forward and backward (gemma4_run.h).
#include "model/gemma4_run.h"

namespace rf::model {

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
  if (!projections_kept) {
    a.g = uninit(T * I);
    a.u = uninit(T * I);
    SharedOperands shared(mm);
    shared.add(a.m_in.data(), T * H);  // gate and up both read it: rounded once in the bf16 mode
    linear_forward(shared.matmul(), a.m_in.data(), W(sl.gate_proj), a.g.data(), T, H, I);
    adapter_forward(sl.gate_proj, a.m_in.data(), {}, a.g.data(), {});
    linear_forward(shared.matmul(), a.m_in.data(), W(sl.up_proj), a.u.data(), T, H, I);
    adapter_forward(sl.up_proj, a.m_in.data(), {}, a.u.data(), {});
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
  // dh[T, I] = dmo W_down, written (beta 0), not accumulated into zeros: no fill of a [T, I] buffer.
  Vec dh = uninit(T * I);
  SharedOperands shared(mm);
  shared.add(dmo, T * H);  // read by dh's product and down_proj's weight gradient
  if (G(sl.gate_proj) || G(sl.up_proj)) shared.add(a.m_in.data(), T * H);  // by both weight gradients below
  const Matmul ms = shared.matmul();
  gemm(ms, false, false, T, I, H, 1.f, dmo, H, W(sl.down_proj), I, 0.f, dh.data(), I);
  linear_backward(ms, a.hmid.data(), W(sl.down_proj), dmo, nullptr, G(sl.down_proj), T, I, H);
  adapter_backward(sl.down_proj, a.hmid.data(), {}, dmo, {}, dh.data());
  // dg and du overwrite g and u, which nothing reads after this: two [T, I] buffers fewer in the layer's backward.
  geglu_backward(a.g.data(), a.u.data(), dh.data(), a.g.data(), a.u.data(), T * I, false);
  const float* dg = a.g.data();
  const float* du = a.u.data();
  Vec dm = zeros(T * H);
  linear_backward(ms, a.m_in.data(), W(sl.gate_proj), dg, dm.data(), G(sl.gate_proj), T, H, I);
  adapter_backward(sl.gate_proj, a.m_in.data(), {}, dg, {}, dm.data());
  linear_backward(ms, a.m_in.data(), W(sl.up_proj), du, dm.data(), G(sl.up_proj), T, H, I);
  adapter_backward(sl.up_proj, a.m_in.data(), {}, du, {}, dm.data());
  rmsnorm_backward(x1, W(sl.pre_ff_norm), a.r_pf.data(), dm.data(), dx1, G(sl.pre_ff_norm), T, H);
}

}  // namespace rf::model
