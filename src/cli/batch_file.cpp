// ringflex cli: reading a batch file (see batch_file.h).
#include "cli/batch_file.h"

#include <limits>
#include <optional>
#include <utility>

#include "cli/finite.h"
#include "core/error.h"
#include "model/vision_encoder.h"

namespace rf::cli {

// An integer tensor of the batch file `path` as int32 (I64 values must fit), its index named as the tensor's shape
// has it.
std::vector<int32_t> read_ids(const std::string& path, const io::TensorView& v) {
  if (v.dtype == io::StDType::I32) return io::copy_as<int32_t>(v);
  const std::vector<int64_t> wide = io::copy_as<int64_t>(v);
  std::vector<int32_t> out(wide.size());
  for (size_t i = 0; i < wide.size(); ++i) {
    RF_CHECK(wide[i] >= std::numeric_limits<int32_t>::min() && wide[i] <= std::numeric_limits<int32_t>::max(), path,
             ": tensor `", v.name, "` has ", wide[i], " at ", io::index_string(static_cast<int64_t>(i), v.shape),
             ", which does not fit in int32");
    out[i] = static_cast<int32_t>(wide[i]);
  }
  return out;
}

namespace {

// The soft tokens of the batch's images (pixel_values, image_position_ids) through the model's vision tower (in the
// model's vision compute dtype, --compute-dtype), whose float32 copy is freed again when they are made.
std::vector<float> encode_images(const std::string& path, const io::SafetensorsFile& in, model::Gemma4Multimodal& m,
                                 io::DimSizes& dims, int64_t& n_tokens) {
  const std::optional<model::VisionConfig>& cfg = m.parts().vision;
  RF_CHECK(cfg.has_value(), path, ": has pixel_values, but the checkpoint's config.json has no vision_config");
  const model::VisionEncoder& encoder = *m.vision_tower();
  const int64_t values = 3 * int64_t{cfg->patch_size} * cfg->patch_size;  // RGB patches
  const io::TensorView& px =
      io::require(in, {"pixel_values", {io::StDType::F32, io::StDType::BF16}, {"n", "P", "V"}, ""}, dims);
  RF_CHECK(dims["V"] == values, path, ": pixel_values has ", dims["V"], " values a patch, the tower's patch_size ",
           cfg->patch_size, " makes ", values);
  const io::TensorView& pos =
      io::require(in, {"image_position_ids", {io::StDType::I32, io::StDType::I64}, {"n", "P", "XY"}, ""}, dims);
  RF_CHECK(dims["XY"] == 2, path, ": image_position_ids must be [n, P, 2], found ", io::shape_string(pos.shape));
  const std::vector<float> pixels = io::to_float32(px);
  const std::vector<int32_t> positions = read_ids(path, pos);
  model::VisionBatch b;
  b.n = static_cast<int>(dims["n"]);
  b.P = dims["P"];
  b.pixels = pixels.data();
  b.positions = positions.data();
  model::VisionOutput out = encoder.forward(b, path);
  m.drop_vision_tower();
  n_tokens = static_cast<int64_t>(out.soft_tokens.size()) / cfg->hidden_size;
  return std::move(out.soft_tokens);
}

}  // namespace

BatchData read_batch(const std::string& path, model::Gemma4Multimodal& m, bool finite) {
  BatchData d;
  const io::SafetensorsFile in = io::SafetensorsFile::open(path);
  io::DimSizes dims;
  const std::vector<io::StDType> ints = {io::StDType::I32, io::StDType::I64};
  const std::vector<io::StDType> floats = {io::StDType::F32, io::StDType::BF16};
  d.ids = read_ids(path, io::require(in, {"input_ids", ints, {"B", "S"}, ""}, dims));
  for (auto [name, dst] :
       {std::pair{"labels", &d.labels}, {"position_ids", &d.pos}, {"doc", &d.doc}, {"mm_token_type_ids", &d.mm}}) {
    if (const io::TensorView* v = io::optional(in, {name, ints, {"B", "S"}, ""}, dims)) *dst = read_ids(path, *v);
  }
  d.F = m.image_feature_width();
  if (const io::TensorView* v = io::optional(in, {"image_features", floats, {"N", "F"}, ""}, dims)) {
    RF_CHECK(dims["F"] == d.F, path, ": image_features has ", dims["F"], " columns, the model expects ", d.F,
             m.vision_feature_dim() > 0 ? " (its vision projection's input width)" : " (its hidden size)");
    if (finite) check_finite(path, *v, "[N, F]");
    d.features = io::to_float32(*v);
    d.n_features = dims["N"];
    d.has_features = true;
  }
  if (in.find("pixel_values") || in.find("image_position_ids")) {
    RF_CHECK(!d.has_features, path, ": give image_features or pixel_values, not both");
    RF_CHECK(m.vision_feature_dim() > 0, path, ": has pixel_values, but the checkpoint has no vision projection ",
             "(model.embed_vision.embedding_projection.weight) to take the tower's soft tokens");
    d.features = encode_images(path, in, m, dims, d.n_features);
    RF_CHECK(static_cast<int64_t>(d.features.size()) == d.n_features * d.F, path,
             ": the vision tower's soft tokens are ", d.features.size() / std::max<int64_t>(d.n_features, 1),
             " wide, the vision projection takes ", d.F);
    d.has_features = true;
  }
  d.B = static_cast<int>(dims["B"]);
  d.S = static_cast<int>(dims["S"]);
  return d;
}

}  // namespace rf::cli
