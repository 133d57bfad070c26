// ringflex forward: one forward (and optionally backward) pass of a Hugging Face Gemma 4 checkpoint on a batch.
//
//     ringflex forward --model DIR --in BATCH.safetensors --out OUT.safetensors [--grad] [--no-logits]
//                      [--no-check-finite] [--timeout SECONDS]
//
// Input tensors: input_ids [B, S] (I32 or I64), and optionally labels [B, S] (-100 = ignored; the target of each
// position, already shifted), position_ids [B, S], doc [B, S] (packed documents, 0 = padding),
// mm_token_type_ids [B, S] (0 text, 1 image, 2 video), image_features [N, F] (one row per image/video slot in
// row-major order; F = hidden size, or the width of the checkpoint's vision projection).
// Output: loss (scalar, mean over label tokens), token_loss [B, S], logits [B, S, V] unless --no-logits, and
// with --grad every parameter gradient as grad.<HF name> (plus grad.image_features when features are given).
#include <chrono>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "cli/command.h"
#include "cli/finite.h"
#include "core/error.h"
#include "io/atomic_file.h"
#include "io/safetensors.h"
#include "io/tensor_access.h"
#include "model/checkpoint.h"

namespace rf::cli {

namespace {

struct ForwardOptions {
  std::string model, in, out;
  bool grad = false;
  bool no_logits = false;
  bool check_finite = true;  // reject NaN/inf in the checkpoint's parameters and image_features up front
};

// An integer [B, S] tensor as int32 (I64 values must fit).
std::vector<int32_t> read_ids(const io::TensorView& v) {
  if (v.dtype == io::StDType::I32) return io::copy_as<int32_t>(v);
  const std::vector<int64_t> wide = io::copy_as<int64_t>(v);
  std::vector<int32_t> out(wide.size());
  for (size_t i = 0; i < wide.size(); ++i) {
    RF_CHECK(wide[i] >= std::numeric_limits<int32_t>::min() && wide[i] <= std::numeric_limits<int32_t>::max(),
             "tensor `", v.name, "` value ", wide[i], " at element ", i, " does not fit in int32");
    out[i] = static_cast<int32_t>(wide[i]);
  }
  return out;
}

int run_forward(const ForwardOptions& opt) {
  io::check_writable(opt.out);  // before loading anything: an unwritable output is found in no time
  const model::Checkpoint ck = model::load_checkpoint(opt.model);
  const model::Gemma4Model& m = *ck.model;
  if (opt.check_finite)
    for (const model::Tensor& p : m.params()) check_finite(opt.model, p.name, p.data, p.shape);
  const io::SafetensorsFile in = io::SafetensorsFile::open(opt.in);
  io::DimSizes dims;
  const std::vector<io::StDType> ints = {io::StDType::I32, io::StDType::I64};
  const std::vector<io::StDType> floats = {io::StDType::F32, io::StDType::BF16};
  const io::TensorView& ids_v = io::require(in, {"input_ids", ints, {"B", "S"}, ""}, dims);
  const std::vector<int32_t> ids = read_ids(ids_v);
  std::vector<int32_t> labels, pos, doc, mm;
  for (auto [name, dst] : {std::pair{"labels", &labels}, {"position_ids", &pos}, {"doc", &doc},
                           {"mm_token_type_ids", &mm}}) {
    if (const io::TensorView* v = io::optional(in, {name, ints, {"B", "S"}, ""}, dims)) *dst = read_ids(*v);
  }
  const int F = m.vision_feature_dim() > 0 ? m.vision_feature_dim() : m.config().hidden_size;
  std::vector<float> features;
  int64_t n_features = 0;
  if (const io::TensorView* v = io::optional(in, {"image_features", floats, {"N", "F"}, ""}, dims)) {
    RF_CHECK(dims["F"] == F, opt.in, ": image_features has ", dims["F"], " columns, the model expects ", F,
             m.vision_feature_dim() > 0 ? " (its vision projection's input width)" : " (its hidden size)");
    if (opt.check_finite) check_finite(opt.in, *v, "[N, F]");
    features = io::to_float32(*v);
    n_features = dims["N"];
  }

  model::Batch b;
  b.B = static_cast<int>(dims["B"]);
  b.S = static_cast<int>(dims["S"]);
  b.input_ids = ids.data();
  b.labels = labels.empty() ? nullptr : labels.data();
  b.position_ids = pos.empty() ? nullptr : pos.data();
  b.doc = doc.empty() ? nullptr : doc.data();
  b.mm_token_type = mm.empty() ? nullptr : mm.data();
  b.image_features = features.empty() ? nullptr : features.data();
  b.n_image_features = n_features;
  model::RunOptions ro;
  ro.want_grad = opt.grad;
  ro.want_logits = !opt.no_logits;
  RF_CHECK(!opt.grad || b.labels != nullptr, opt.in, ": --grad needs a `labels` tensor");
  model::TensorSet grads;
  if (opt.grad) grads = m.params().zeros_like();
  const auto start = std::chrono::steady_clock::now();
  const model::Result r = m.run(b, ro, opt.grad ? &grads : nullptr);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  io::SafetensorsWriter w;
  const float loss = static_cast<float>(r.loss);
  const int64_t B = b.B, S = b.S, V = m.config().vocab_size;
  w.add("loss", io::StDType::F32, {}, std::span<const float>(&loss, 1));
  w.add("token_loss", io::StDType::F32, {B, S}, std::span<const float>(r.token_loss));
  if (ro.want_logits) w.add("logits", io::StDType::F32, {B, S, V}, std::span<const float>(r.logits));
  if (opt.grad) {
    for (const model::Tensor& g : grads)
      w.add("grad." + model::file_name_of(g.name, ck.text_prefix), io::StDType::F32, g.shape,
            std::span<const float>(g.data));
    if (!r.d_image_features.empty())
      w.add("grad.image_features", io::StDType::F32, {n_features, F}, std::span<const float>(r.d_image_features));
  }
  w.write(opt.out);
  if (opt.grad) {
    constexpr double kMiB = 1 << 20;
    std::printf("ringflex forward: activations kept for the backward %.1f MiB, one layer's recomputed %.1f MiB\n",
                static_cast<double>(r.kept_activation_bytes) / kMiB, static_cast<double>(r.layer_recompute_bytes) / kMiB);
  }
  std::printf("ringflex forward: wrote %s (B=%lld S=%lld, %lld label tokens, loss %.6f, %s %.3f s)\n",
              opt.out.c_str(), static_cast<long long>(B), static_cast<long long>(S),
              static_cast<long long>(r.label_tokens), r.loss, opt.grad ? "forward+backward" : "forward", seconds);
  return 0;
}

}  // namespace

void add_forward_command(CLI::App& app, Runner& run) {
  auto opt = std::make_shared<ForwardOptions>();
  CLI::App* cmd = app.add_subcommand("forward", "Forward (and backward) of a Hugging Face Gemma 4 checkpoint on a batch");
  cmd->add_option("--model", opt->model, "Checkpoint directory: config.json and *.safetensors")->required();
  cmd->add_option("--in", opt->in, "Batch: input_ids [, labels, position_ids, doc, mm_token_type_ids, image_features]")
      ->required();
  cmd->add_option("--out", opt->out, "Output: loss, token_loss [, logits] [, grad.<name>]")->required();
  cmd->add_flag("--grad", opt->grad, "Also write every parameter's gradient as grad.<name>");
  cmd->add_flag("--no-logits", opt->no_logits, "Do not write the [B, S, V] logits");
  cmd->add_flag("--check-finite,!--no-check-finite", opt->check_finite,
                "Reject a NaN or infinity in the parameters or image_features before computing (default)");
  cmd->callback([&run, opt] { run = [opt] { return run_forward(*opt); }; });
}

}  // namespace rf::cli
