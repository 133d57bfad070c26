// ringflex model: a batch with images through the vision tower and the multimodal model in one call
// (model.train_vision), the tower's work shared over the ranks as the parallel context's images() say
// (core/image_split.h): the model meets the CP group through the context, as its attention does.
//
// Each rank encodes the images it owns (all of them without a split), places their soft tokens at their slots' rows of
// [N, F] and leaves the others zero; images().sum gives every rank all of them (x + 0 = x: the bits of encoding them
// everywhere), where the rows its positions hold are read. In the backward each rank's d image_features holds its
// own tokens' rows (Result::d_image_features); the sum routes each image's whole gradient to its owner, which
// back-propagates it through the tower once, into the store's gradients; the trainer's gradient reduction then sums
// the owners' tower gradients as it sums the decoder's. Without a split every rank encodes every image and
// back-propagates its own d image_features (its positions' rows, the others zero), and that reduction sums the ranks'
// shares: the same soft tokens, the tower's gradients summed in another order (float32 rounding). The tower reads its
// weights and writes its gradients between the store's hooks (vision_encoder.h TowerParams); a rank with no image of
// its own joins those hooks where they are collective (TowerHooks), contributing zero gradients.
// docs/parallel-state.md ("The vision tower") has the design.
#pragma once

#include "core/attention_backend.h"
#include "model/gemma4.h"
#include "model/multimodal.h"
#include "model/vision_encoder.h"

namespace rf::model {

// Where a rank that encodes no image of a batch joins the tower's store hooks (VisionEncoder::join_hooks): where the
// store makes them collective, so that every rank makes the same calls.
struct TowerHooks {
  bool forward_collective = false;   // the forward's (a sharded store's gathers under shard full)
  bool backward_collective = false;  // the backward's (a sharded store's reductions of the tower's gradients)
};

struct ImageRun {
  Result result;               // the model's (loss, gradients into the store)
  double tower_seconds = 0.0;  // this rank's time in the tower: forward, backward and the group's sums
};

// `m` on `batch` whose N = batch.n_image_features image slots are filled by `tower`'s soft tokens of `images` (in
// batch order, each image's whole pooling cells its slots; batch.image_features is not read), with ro.want_grad the
// tower's backward too. A batch without images (images.n == 0) runs the model alone, its image features as given.
// Collective over the context's ranks. Throws rf::Error when the images' soft tokens do not fill the slots.
ImageRun run_with_images(const Gemma4Multimodal& m, const VisionEncoder& tower, const Batch& batch,
                         const VisionBatch& images, const RunOptions& ro, const TowerHooks& hooks,
                         ParallelContext& ctx);

}  // namespace rf::model
