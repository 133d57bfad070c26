// ringflex model: a batch with images through the tower and the model in one call (see image_run.h).
#include "model/image_run.h"

#include <algorithm>
#include <chrono>
#include <vector>

#include "core/error.h"

namespace rf::model {

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// The images a rank owns, copied out of the batch in batch order.
struct OwnImages {
  std::vector<int> index;  // [own] each one's index in the batch
  std::vector<float> pixels;
  std::vector<int32_t> positions;
  int64_t P = 0;

  VisionBatch batch() const { return {static_cast<int>(index.size()), P, pixels.data(), positions.data()}; }
};

}  // namespace

ImageRun run_with_images(const Gemma4Multimodal& m, const VisionEncoder& tower, const Batch& batch,
                         const VisionBatch& images, const RunOptions& ro, const TowerHooks& hooks,
                         ParallelContext& ctx) {
  ImageRun run;
  if (images.n == 0) {  // the other ranks' hooks, joined in the same order where they are collective
    if (hooks.forward_collective) tower.join_hooks(false);
    run.result = m.run(batch, ro, ctx);
    if (ro.want_grad && hooks.backward_collective) tower.join_hooks(true);
    return run;
  }
  const auto start = Clock::now();
  ImageSplit& split = ctx.images();
  const int64_t F = tower.config().hidden_size, P = images.P, k = tower.config().pooling_kernel_size;
  const int n = images.n;
  std::vector<int64_t> valid(static_cast<size_t>(n), 0), first(static_cast<size_t>(n) + 1, 0);  // first: slot rows
  for (int i = 0; i < n; ++i) {
    for (int64_t q = 0; q < P; ++q) valid[i] += images.positions[(i * P + q) * 2] >= 0;
    first[i + 1] = first[i] + valid[i] / (k * k);  // whole pooling cells: the processor's and the drawings' grids
  }
  RF_CHECK(first[n] == batch.n_image_features, "the micro-batch's ", n, " images make ", first[n], " soft tokens for ",
           batch.n_image_features, " image slots");
  const std::vector<int> owner = split.owners(valid);
  OwnImages mine;
  mine.P = P;
  const int64_t patch_values = P * 3 * int64_t{tower.config().patch_size} * tower.config().patch_size;  // one image's
  for (int i = 0; i < n; ++i) {
    if (owner[i] != split.rank()) continue;
    mine.pixels.insert(mine.pixels.end(), images.pixels + i * patch_values, images.pixels + (i + 1) * patch_values);
    mine.positions.insert(mine.positions.end(), images.positions + i * P * 2, images.positions + (i + 1) * P * 2);
    mine.index.push_back(i);
  }
  const VisionBatch own = mine.batch();
  VisionTape tape;
  std::vector<float> soft(static_cast<size_t>(batch.n_image_features * F), 0.f);  // [N, F]
  if (own.n == 0 && hooks.forward_collective) tower.join_hooks(false);
  if (own.n > 0) {
    // train.recompute: the tower keeps its layers' inputs only and recomputes each layer in its backward, as the
    // decoder does (the same bits).
    const VisionOutput out =
        tower.forward(own, "the micro-batch's images", ro.want_grad ? &tape : nullptr, ro.recompute_layers);
    int64_t at = 0;
    for (size_t j = 0; j < mine.index.size(); ++j) {
      const int i = mine.index[j];
      RF_CHECK(out.counts[j] == first[i + 1] - first[i], "the micro-batch's image ", i, ": the tower made ",
               out.counts[j], " soft tokens for ", first[i + 1] - first[i], " slots");
      std::copy_n(out.soft_tokens.begin() + at * F, out.counts[j] * F, soft.begin() + first[i] * F);
      at += out.counts[j];
    }
  }
  split.sum(soft.data(), soft.size());
  run.tower_seconds += seconds_since(start);
  Batch b = batch;
  b.image_features = soft.data();
  run.result = m.run(b, ro, ctx);
  if (ro.want_grad) {
    const auto back = Clock::now();
    std::vector<float>& d = run.result.d_image_features;  // [N, F]
    split.sum(d.data(), d.size());
    if (own.n > 0) {
      std::vector<float> d_mine;  // [this rank's soft tokens, F]
      for (int i : mine.index) d_mine.insert(d_mine.end(), d.begin() + first[i] * F, d.begin() + first[i + 1] * F);
      tower.backward(own, tape, d_mine.data());  // into the store's gradients (frozen ones have none)
    } else if (hooks.backward_collective) {
      tower.join_hooks(true);
    }
    run.tower_seconds += seconds_since(back);
  }
  return run;
}

}  // namespace rf::model
