// ringflex core: merge_partial, the LSE merge of two partial attention results (see merge.h).
#include "core/merge.h"

namespace rf {

void merge_partial(float* o_a, float* lse_a, const float* o_b, const float* lse_b, int64_t rows, int D) {
  for (int64_t r = 0; r < rows; ++r) {
    if (lse_b[r] == kNegInf) continue;  // nothing to add; keeps o_a's bits untouched
    const MergeWeights w = merge_weights(lse_a[r], lse_b[r]);
    float* oa = o_a + r * D;
    const float* ob = o_b + r * D;
    for (int d = 0; d < D; ++d) oa[d] = oa[d] * w.a + ob[d] * w.b;
    lse_a[r] = w.lse;
  }
}

}  // namespace rf
