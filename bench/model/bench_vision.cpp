// Benchmark tool behind bench/model/bench_vision.py: times the C++ vision encoder's forward on a checkpoint's tower
// (loaded and read as tests/model/vision_case does: tests/common/vision_tower.h).
//
//     bench_vision CHECKPOINT_DIR IMAGES.safetensors OUT.safetensors REPS [COMPUTE_DTYPE]
//
// CHECKPOINT_DIR  a multimodal Gemma 4 checkpoint (config.json with a vision_config, the tower under
//                 model.vision_tower.), loaded as ringflex loads any checkpoint
// IMAGES          pixel_values [n, P, 3 * patch^2] F32 and pixel_position_ids [n, P, 2] I32, as the image processor
//                 lays them out
// OUT             soft_tokens [N, hidden_size] F32 of the last repeat (the driver checks them against transformers
//                 before it reports any time)
// REPS            forward passes over all n images, each timed alone
// COMPUTE_DTYPE   float32 (the default) or bfloat16: what the tower's matmuls multiply in
//                 (VisionEncoder::set_compute_dtype; the weights' bf16 copies are made before the timing)
// Prints one line per repeat, "forward_s <seconds>". Threads: OMP_NUM_THREADS, as for ringflex; the OpenBLAS core as
// ringflex chooses it (a fallback core is replaced by a restart, src/cpu/blas_core.h). Loading the
// checkpoint and writing OUT are not timed. Exits 1 with the error's one line on any failure.
#include <chrono>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "common/vision_tower.h"
#include "cpu/blas_core.h"
#include "io/safetensors.h"
#include "model/vision_encoder.h"

int main(int argc, char** argv) {
  rf::cpu::restart_on_best_openblas_core(argv);  // the OpenBLAS kernels the tower's sgemm runs on (blas_core.h)
  if (argc != 5 && argc != 6) {
    std::fprintf(stderr,
                 "usage: bench_vision CHECKPOINT_DIR IMAGES.safetensors OUT.safetensors REPS [COMPUTE_DTYPE]\n");
    return 2;
  }
  try {
    rf::model::VisionEncoder encoder = rf::testing::load_checkpoint_tower(argv[1]);
    if (argc == 6) encoder.set_compute_dtype(rf::model::parse_compute_dtype(argv[5]));
    const rf::testing::ImageArrays images = rf::testing::read_images(rf::io::SafetensorsFile::open(argv[2]));
    const rf::model::VisionBatch b = images.view();
    const int reps = std::stoi(argv[4]);
    rf::model::VisionOutput out;
    for (int r = 0; r < reps; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      out = encoder.forward(b, argv[2]);
      const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
      std::printf("forward_s %.6f\n", dt.count());
      std::fflush(stdout);
    }
    rf::io::SafetensorsWriter w;
    const int64_t H = encoder.config().hidden_size;
    w.add("soft_tokens", rf::io::StDType::F32, {static_cast<int64_t>(out.soft_tokens.size()) / H, H},
          std::span<const float>(out.soft_tokens));
    w.write(argv[3]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
