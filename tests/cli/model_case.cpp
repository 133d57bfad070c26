// Test-only tool behind tests/cli: writes the `ringflex forward` inputs of the bad-input tests (issue: memory
// from claims and clear messages), generated here rather than committed as binary files.
//
//     model_case bad-models DIR
//
// DIR/good/            a tiny random Gemma 4 checkpoint (config.json + model.safetensors)
// DIR/vocab_claim/     its tensors, with a config.json claiming V = 262144 and H = 2^20 (a 1 TiB embedding)
// DIR/wrong_type/      its tensors, with num_hidden_layers written as a string
// DIR/llama/           its tensors, with model_type "llama"
// DIR/batch.safetensors        input_ids and labels [1, 4]
// DIR/empty_batch.safetensors  input_ids and labels [1, 0]
// DIR/huge_empty_batch.safetensors  input_ids and labels [2^31 - 1, 0]: a 152-byte file claiming 2^31 - 1 rows
// DIR/wide_doc.safetensors     doc [0, 2^32 + 5]: no tokens, in a shape whose S does not fit in 32 bits
// DIR/fifo.safetensors         a FIFO (nothing ever writes it)
#include <sys/stat.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "model/checkpoint.h"

namespace {

namespace fs = std::filesystem;
using rf::model::Gemma4Config;
using rf::model::Gemma4Multimodal;

// A tiny dense model: every field the loader reads is given, so the edits below change one thing each.
std::string tiny_config(const std::string& model_type, const std::string& vocab, const std::string& hidden,
                        const std::string& layers) {
  return R"({"model_type": )" + model_type + R"(, "vocab_size": )" + vocab + R"(, "hidden_size": )" + hidden +
         R"(, "intermediate_size": 12, "num_hidden_layers": )" + layers +
         R"(, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "global_head_dim": 8,
  "sliding_window": 3, "layer_types": ["sliding_attention", "full_attention"], "hidden_size_per_layer_input": 0})";
}

void write_text(const fs::path& p, const std::string& text) {
  std::ofstream f(p);
  f << text;
  if (!f.good()) throw std::runtime_error(p.string() + ": cannot write");
}

// A checkpoint directory holding `config` and the good checkpoint's tensors.
void edited_checkpoint(const fs::path& good, const fs::path& dir, const std::string& config) {
  fs::create_directories(dir);
  fs::copy_file(good / "model.safetensors", dir / "model.safetensors", fs::copy_options::overwrite_existing);
  write_text(dir / "config.json", config);
}

void write_ids(const fs::path& p, std::vector<int64_t> shape, const std::vector<int32_t>& ids) {
  rf::io::SafetensorsWriter w;
  w.add("input_ids", rf::io::StDType::I32, shape, std::span<const int32_t>(ids));
  w.add("labels", rf::io::StDType::I32, shape, std::span<const int32_t>(ids));
  w.write(p.string());
}

void make_bad_models(const fs::path& dir) {
  fs::create_directories(dir);
  const fs::path good = dir / "good";
  rf::model::Checkpoint ck;
  ck.model =
      std::make_unique<Gemma4Multimodal>(Gemma4Config::from_json(tiny_config(R"("gemma4_text")", "24", "8", "2")));
  constexpr uint64_t kSeed = 3;
  constexpr float kStd = 0.2f;
  ck.model->init_random(kSeed, kStd);
  rf::model::save_checkpoint(ck, good.string());
  edited_checkpoint(good, dir / "vocab_claim", tiny_config(R"("gemma4_text")", "262144", "1048576", "2"));
  edited_checkpoint(good, dir / "wrong_type", tiny_config(R"("gemma4_text")", "24", "8", R"("2")"));
  edited_checkpoint(good, dir / "llama", tiny_config(R"("llama")", "24", "8", "2"));
  write_ids(dir / "batch.safetensors", {1, 4}, {1, 2, 3, 4});
  write_ids(dir / "empty_batch.safetensors", {1, 0}, {});
  write_ids(dir / "huge_empty_batch.safetensors", {std::numeric_limits<int32_t>::max(), 0}, {});
  {
    constexpr int64_t kWideS = (int64_t{1} << 32) + 5;
    rf::io::SafetensorsWriter w;
    w.add("doc", rf::io::StDType::I32, {0, kWideS}, std::span<const int32_t>());
    w.write((dir / "wide_doc.safetensors").string());
  }
  {
    // int64 ids, one beyond int32 (it would wrap to token 5).
    const std::vector<int64_t> ids = {1, 2, 3, (int64_t{1} << 32) + 5};
    rf::io::SafetensorsWriter w;
    w.add("input_ids", rf::io::StDType::I64, {1, 4}, std::span<const int64_t>(ids));
    w.write((dir / "wide_ids.safetensors").string());
  }
  const fs::path fifo = dir / "fifo.safetensors";
  fs::remove(fifo);
  if (mkfifo(fifo.c_str(), 0600) != 0) throw std::runtime_error(fifo.string() + ": mkfifo failed");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3 || std::string(argv[1]) != "bad-models") {
    std::fprintf(stderr, "usage: model_case bad-models DIR\n");
    return 2;
  }
  try {
    make_bad_models(argv[2]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "model_case: %s\n", e.what());
    return 1;
  }
  return 0;
}
