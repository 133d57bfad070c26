// ringflex core: validate(), the checks every attention entry point runs on an AttnChunk (see attention_args.h).
#include "core/attention_args.h"

#include "core/error.h"

namespace rf {

AttnChunk chunk_of(const AttnShard& s, const LayerMask& mask, float scale) {
  AttnChunk c;
  c.shape = s.shape;
  c.dtype = s.dtype;
  c.q = s.q;
  c.k = s.k;
  c.v = s.v;
  c.q_meta = s.meta;
  c.k_meta = s.meta;
  c.mask = mask;
  c.scale = scale;
  return c;
}

void validate(const AttnChunk& c) {
  const AttnShape& s = c.shape;
  RF_CHECK(s.B >= 0 && s.Lq >= 0 && s.Lk >= 0, "negative size: B = ", s.B, ", Lq = ", s.Lq, ", Lk = ", s.Lk);
  RF_CHECK(s.Hq >= 1 && s.Hkv >= 1, "head counts must be positive: Hq = ", s.Hq, ", Hkv = ", s.Hkv);
  RF_CHECK(s.Hq % s.Hkv == 0, "Hq = ", s.Hq, " is not a multiple of Hkv = ", s.Hkv);
  RF_CHECK(s.D >= 1 && s.D <= kMaxHeadDim, "head dimension D = ", s.D, " is outside 1..", kMaxHeadDim);
  RF_CHECK(c.mask.window >= 0, "window = ", c.mask.window, " is negative");
  RF_CHECK(std::isfinite(c.scale), "scale = ", c.scale, " is not finite");
  const bool need_q = s.q_elems() > 0, need_kv = s.kv_elems() > 0;
  RF_CHECK(!need_q || (c.q && c.q_meta), "attention chunk without query buffers");
  RF_CHECK(!need_kv || (c.k && c.v && c.k_meta), "attention chunk without key/value buffers");
}

}  // namespace rf
