// ringflex model: the dense GeGLU MLP of a Gemma 4 layer, forward and backward (gemma4_run.h).
#include "model/gemma4_run.h"

namespace rf::model {

void Gemma4Model::Run::mlp_forward(int l, const float* x1, MlpActs& a) {
  const LayerSlots& sl = m.slots_[l];
  const int64_t I = m.specs_[l].intermediate;
  // A recompute handed the forward's projections (RunOptions::keep_mlp_projections) redoes only the norm and GeGLU.
  const bool kept = !a.g.empty();
  a.m_in = uninit(T * H);
  a.r_pf = uninit(T);
  rmsnorm_forward(x1, W(sl.pre_ff_norm), eps, a.m_in.data(), a.r_pf.data(), T, H);
  if (!kept) {
    a.g = uninit(T * I);
    a.u = uninit(T * I);
    linear_forward(mm, a.m_in.data(), W(sl.gate_proj), a.g.data(), T, H, I);
    linear_forward(mm, a.m_in.data(), W(sl.up_proj), a.u.data(), T, H, I);
  }
  a.hmid = uninit(T * I);
  geglu_forward(a.g.data(), a.u.data(), a.hmid.data(), T * I);
  if (!kept) {
    a.mo = uninit(T * H);
    linear_forward(mm, a.hmid.data(), W(sl.down_proj), a.mo.data(), T, I, H);
  }
}

void Gemma4Model::Run::mlp_backward(int l, MlpActs& a, const float* x1, const float* dmo, float* dx1) {
  const LayerSlots& sl = m.slots_[l];
  const int64_t I = m.specs_[l].intermediate;
  Vec dh = zeros(T * I);
  linear_backward(mm, a.hmid.data(), W(sl.down_proj), dmo, dh.data(), G(sl.down_proj), T, I, H);
  Vec dg = zeros(T * I), du = zeros(T * I);
  geglu_backward(a.g.data(), a.u.data(), dh.data(), dg.data(), du.data(), T * I);
  Vec dm = zeros(T * H);
  linear_backward(mm, a.m_in.data(), W(sl.gate_proj), dg.data(), dm.data(), G(sl.gate_proj), T, H, I);
  linear_backward(mm, a.m_in.data(), W(sl.up_proj), du.data(), dm.data(), G(sl.up_proj), T, H, I);
  rmsnorm_backward(x1, W(sl.pre_ff_norm), a.r_pf.data(), dm.data(), dx1, G(sl.pre_ff_norm), T, H);
}

}  // namespace rf::model
