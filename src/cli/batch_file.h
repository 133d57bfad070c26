// ringflex cli: the batch file `ringflex forward --in` and `ringflex generate --in` read (safetensors: input_ids
// [B, S] and the optional tensors cmd_forward.cpp lists, images as features or as pixels through the tower).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "io/tensor_access.h"
#include "model/multimodal.h"

namespace rf::cli {

// An integer tensor of the batch file `path` as int32 (I64 values must fit), its index named as the tensor's shape
// has it.
std::vector<int32_t> read_ids(const std::string& path, const io::TensorView& v);

// The input batch as read from --in; every rank holds all of it.
struct BatchData {
  std::vector<int32_t> ids, labels, pos, doc, mm;
  std::vector<float> features;
  int64_t n_features = 0;
  int F = 0;
  bool has_features = false;  // the batch has image_features (N may be 0)
  int B = 0, S = 0;

  model::Batch view() const {
    model::Batch b;
    b.B = B;
    b.S = S;
    b.input_ids = ids.data();
    b.labels = labels.empty() ? nullptr : labels.data();
    b.position_ids = pos.empty() ? nullptr : pos.data();
    b.doc = doc.empty() ? nullptr : doc.data();
    b.mm_token_type = mm.empty() ? nullptr : mm.data();
    b.image_features = features.empty() ? nullptr : features.data();
    b.n_image_features = n_features;
    return b;
  }
};

// The batch file at `path`, validated against the model's widths; pixel inputs go through the model's tower here.
BatchData read_batch(const std::string& path, model::Gemma4Multimodal& m, bool finite);

}  // namespace rf::cli
