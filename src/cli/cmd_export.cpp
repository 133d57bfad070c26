// ringflex export --merge: a PEFT LoRA adapter merged into its base, written as a full Hugging Face checkpoint.
//
//     ringflex export --model BASE --merge ADAPTER --out DIR
//
// Every tensor of BASE's files is written again under its own name and dtype (vision and audio towers included, so
// DIR is BASE with the adapted weights changed); each adapted weight becomes W + scale * B A, computed in float32
// (model/lora_store.h) and rounded to the tensor's dtype (float32 or bfloat16; a float16 base is refused).
// config.json is copied as it is. The result loads with transformers' from_pretrained and computes what BASE with
// the adapter computes, to the base dtype's rounding.
#include <cmath>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cli/command.h"
#include "core/dtype.h"
#include "core/error.h"
#include "io/atomic_file.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "model/checkpoint.h"
#include "model/lora_store.h"
#include "model/ops.h"
#include "model/peft_files.h"

namespace rf::cli {
namespace {

namespace fs = std::filesystem;

struct ExportOptions {
  std::string model, merge, out;
};

int run_export(const ExportOptions& opt) {
  RF_CHECK(!opt.merge.empty(), "export: --merge is empty; it names the PEFT LoRA adapter directory to merge");
  model::AdaptedCheckpoint adapted = model::load_adapted_checkpoint(opt.model, opt.merge);
  const model::Checkpoint& ck = adapted.checkpoint;
  const model::LoraStore& store = *adapted.adapters;
  const float scale = static_cast<float>(store.config().scale());
  const int64_t r = store.config().rank;
  // The merged weights by their file names, float32.
  std::map<std::string, std::vector<float>> merged;
  for (const model::LoraStore::Adapter& a : store.adapters()) {
    const float* W = store.weight(a.base);
    std::vector<float> m(W, W + a.experts * a.out * a.in);
    // W_e [out, in] += scale * B_e [out, r] A_e [r, in] for each expert e (one of them for a 2-D weight), with
    // A_e = rows e*r.. of A and B_e = rows e*out.. of B (the store's expert-major layout, model/held_weight.h).
    const float* A = store.weight(a.a);
    const float* B = store.weight(a.b);
    for (int64_t e = 0; e < a.experts; ++e)
      model::gemm(false, false, a.out, a.in, r, scale, B + e * a.out * r, r, A + e * r * a.in, a.in, 1.f,
                  m.data() + e * a.out * a.in, a.in);
    // A NaN or inf in the base or the adapter, or a product beyond float32, would be written without a word.
    const std::string name = model::file_name_of(store.info(a.base).name, ck.text_prefix);
    const std::vector<int64_t>& shape = store.info(a.base).shape;  // [out, in], or [experts, out, in]
    for (size_t i = 0; i < m.size(); ++i)
      RF_CHECK(std::isfinite(m[i]), opt.merge, ": the merged `", name, "` has ", m[i], " at ",
               io::index_string(static_cast<int64_t>(i), shape),
               " (a value of the base or the adapter is not finite, or W + scale * B A overflows float32)");
    merged.emplace(name, std::move(m));
  }
  const io::Checkpoint files = io::Checkpoint::open(opt.model);
  std::error_code ec;
  fs::create_directories(opt.out, ec);
  RF_CHECK(!ec, opt.out, ": cannot create the directory (", ec.message(), ")");
  io::SafetensorsWriter w;
  w.set_metadata("format", "pt");
  std::vector<std::vector<bf16>> rounded;  // the bf16 images the writer borrows until write()
  rounded.reserve(merged.size());
  size_t used = 0;
  for (const std::string& name : files.names()) {
    const io::TensorView& v = *files.find(name);
    const auto it = merged.find(name);
    if (it == merged.end()) {
      w.add(name, v.dtype, v.shape, v.bytes);
      continue;
    }
    ++used;
    const std::vector<float>& m = it->second;
    if (v.dtype == io::StDType::F32) {
      w.add(name, v.dtype, v.shape, std::span<const float>(m));
    } else {
      RF_CHECK(v.dtype == io::StDType::BF16, opt.model, ": tensor `", name, "` is ", io::dtype_name(v.dtype),
               ": export --merge writes float32 and bfloat16 bases only");
      rounded.emplace_back(m.size());
      model::round_to_bf16(m.data(), rounded.back().data(), static_cast<int64_t>(m.size()));
      w.add(name, v.dtype, v.shape, std::span<const bf16>(rounded.back()));
    }
  }
  RF_ASSERT(used == merged.size());
  // All or nothing: the weights and config.json written and synced, then both renamed (a full disk leaves --out as
  // it was, never a config beside the old weights or none).
  io::AtomicFile weights((fs::path(opt.out) / std::string(io::Checkpoint::kSingleFile)).string());
  w.write(weights);
  io::AtomicFile config((fs::path(opt.out) / "config.json").string());
  config.write(ck.model->config().source_json);
  std::vector<io::AtomicFile*> outputs = {&weights, &config};
  io::commit_all(outputs);
  // An index left in --out by an earlier sharded checkpoint would shadow the file just written.
  fs::remove(fs::path(opt.out) / std::string(io::Checkpoint::kIndexFile), ec);
  RF_CHECK(!ec, opt.out, ": cannot remove the stale ", io::Checkpoint::kIndexFile, " (", ec.message(), ")");
  return 0;
}

}  // namespace

void add_export_command(CLI::App& app, Runner& run) {
  auto opt = std::make_shared<ExportOptions>();
  CLI::App* cmd = app.add_subcommand(
      "export",
      "merge a PEFT LoRA adapter into its base and write the full checkpoint (Hugging Face layout, the "
      "base's dtypes)");
  cmd->add_option("--model", opt->model, "The base checkpoint directory")->required();
  cmd->add_option("--merge", opt->merge,
                  "The PEFT LoRA adapter directory (adapter_config.json, "
                  "adapter_model.safetensors)")
      ->required();
  cmd->add_option("--out", opt->out, "Output directory: config.json and model.safetensors")->required();
  cmd->callback([opt, &run] { run = [opt] { return run_export(*opt); }; });
}

}  // namespace rf::cli
