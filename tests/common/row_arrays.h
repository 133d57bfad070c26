// Test helper: the rows of a batch built by hand as arrays, and the model::Batch that views them.
#pragma once

#include <cstdint>
#include <vector>

#include "model/gemma4.h"

namespace rf::testing {

struct RowArrays {
  int B = 2, S = 0;
  std::vector<int32_t> ids, labels, pos, doc, mm;  // [B, S] each (model::Batch's meanings)
  std::vector<float> features;                     // [N, F]: one vector per token with mm != 0, in row-major order

  // images: the batch carries `features` (N counted from mm); otherwise it has none.
  model::Batch view(bool images = false) const {
    model::Batch b;
    b.B = B;
    b.S = S;
    b.input_ids = ids.data();
    b.labels = labels.data();
    b.position_ids = pos.data();
    b.doc = doc.data();
    b.mm_token_type = mm.data();
    if (images) {
      b.image_features = features.data();
      for (const int32_t t : mm) b.n_image_features += t != 0;
    }
    return b;
  }
};

}  // namespace rf::testing
