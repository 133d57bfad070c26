// ringflex trainer: what a run reports — the progress line, the metrics JSONL and the loss picture (SVG).
#pragma once

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>

#include "trainer/checkpoint.h"

namespace rf::trainer {

struct StepMetrics {
  int64_t step = 0;
  double loss = 0.0;
  double lr = 0.0;
  double grad_norm = 0.0;      // before clipping
  int64_t tokens = 0;          // label tokens of the global batch (the loss's denominator)
  double tokens_per_s = 0.0;   // non-padding tokens of the global batch per second of the step
  int64_t peak_rss_bytes = 0;  // the largest peak resident set over the ranks
  std::optional<double> val_loss;
  // On more than one rank: the seconds the step waited on communication (comm::blocked_seconds: the ring's K/V and
  // gradients, the gradient reduction, every collective; what computation did not hide), the most of any rank.
  std::optional<double> comm_wait_s;
  // Under expert parallelism (parallelism.ep > 1): routed rows (a token's row for one of its experts) the step's
  // forward passes sent to, and received from, other ranks' experts (a MoE layer's recompute in the backward counts
  // again), the most of any rank.
  std::optional<int64_t> ep_rows_sent, ep_rows_received;
  // Under parallelism.shard = gradients or full: the seconds the step waited on the sharded store's collectives (a
  // layer's gather not yet arrived when the layer starts, a reduction not yet done when the next is posted, the
  // update's gathers): the exposed communication, the most of any rank. Validation's waits are not counted.
  std::optional<double> shard_comm_wait_s;
  // Also: experts of each MoE layer a rank holds (E / ep when it holds only its own, E when sharding or LoRA keep
  // every expert on every rank); bytes the step's dispatches and combines (forward, recompute and backward) sent to
  // other ranks, per MoE layer, the most of any rank; seconds the step waited in them (a dispatch is posted while
  // a rank runs its own rows, so its wait is what is exposed; a combine blocks), the most of any rank.
  std::optional<int64_t> ep_experts_held, ep_bytes_per_layer;
  std::optional<double> ep_exposed_s;
  // With model.train_vision: the tower's share of the step, the most of any rank of its seconds in the tower (its
  // images' forward and backward and the CP group's sums of soft tokens and their gradients) over the step's wall
  // time (validation excluded).
  std::optional<double> tower_share;
  // The data's share of the step: the most of any rank of its seconds fetching and stacking the step's rows (all a
  // source does during training: files are read, rendered, tokenized and packed before step 1) over the step's wall
  // time.
  double data_share = 0.0;
};

// One JSON object per line: step, loss, lr, grad_norm, tokens, tokens_per_s, peak_rss_bytes [, val_loss] [,
// comm_wait_s]
// [, ep_rows_sent, ep_rows_received, ep_experts_held, ep_bytes_per_layer, ep_exposed_s] [, shard_comm_wait_s]
// [, tower_share], data_share.
std::string metrics_json_line(const StepMetrics& m);

// The --metrics JSONL file (rank 0's): each line is written whole or the write fails. Opening keeps the whole lines
// of steps up to `keep_through_step` (a resume's step; 0 for a fresh run, which starts the file empty) and drops
// the rest: the lines of steps the resumed run does again, and a line a hard kill cut off. The destructor closes it
// on every path. A failed write (a full disk, a quota, a file-size limit) throws rf::Error "<path>: write failed:
// <reason>" after cutting the file back to its last whole line, so what the run recorded stays readable.
class MetricsFile {
 public:
  MetricsFile(const std::string& path, int64_t keep_through_step);
  ~MetricsFile();
  MetricsFile(const MetricsFile&) = delete;
  MetricsFile& operator=(const MetricsFile&) = delete;

  void append(const std::string& line);
  void close();  // closes and reports a failed close (a write the kernel could only refuse then); idempotent

 private:
  std::string path_;
  int fd_ = -1;
  int64_t size_ = 0;  // bytes of whole lines
};

// Peak resident set of this process (getrusage), in bytes.
int64_t peak_rss_bytes();

// Train loss (line) and validation loss (points) against the step, as a standalone SVG document.
std::string loss_svg(const LossHistory& h, const std::string& title);

// The progress line on rank 0. On a terminal it rewrites one line in place every step (carriage return) and
// ends it when something else is printed; in a file or pipe it prints a whole line every `every` steps and at
// notable steps, so a log holds no carriage returns. Ranks started by mpirun always print whole lines (their
// stdout is the launcher's pseudo-terminal even when the job's output goes to a file).
class Progress {
 public:
  Progress(std::FILE* out, int total_steps, int every);
  void step(const StepMetrics& m, double eta_s, bool force_line);
  void note(const std::string& line);  // a line of its own (validation, checkpoint, the end)

 private:
  std::FILE* out_;
  bool terminal_;
  int total_, every_;
  bool open_line_ = false;
};

}  // namespace rf::trainer
