// ringflex trainer: train.recompute and the keep_* fields left at auto, chosen by the memory check
// (choose_recompute, describe_recompute: trainer.h).
#include <algorithm>
#include <array>
#include <string>
#include <vector>

#include "trainer/trainer.h"

namespace rf::trainer {

namespace {

struct Keeps {
  bool recompute, keep_mlp, keep_o_proj, keep_down_proj;
  bool operator==(const Keeps&) const = default;
};

Keeps keeps_of(const TrainSection& t) { return {t.recompute, t.keep_mlp, t.keep_o_proj, t.keep_down_proj}; }

// Most kept first (trainer.h): each step down frees memory for more of the backward's sgemm work.
constexpr std::array<Keeps, 5> kLadder = {{{false, false, true, true},
                                           {true, true, true, true},
                                           {true, false, true, true},
                                           {true, false, false, true},
                                           {true, false, false, false}}};

// The settings `c` allows, most kept first: the ladder's values in its auto fields, its own in the others.
std::vector<Keeps> candidates(const TrainSection& t) {
  const TrainSection::Automatic& a = t.automatic;
  const bool spill = !t.spill_dir.empty();
  // A keep_* set false asks for that product's recompute; a set true is honoured by no recompute too.
  const bool keep_refused =
      (!a.keep_mlp && !t.keep_mlp) || (!a.keep_o_proj && !t.keep_o_proj) || (!a.keep_down_proj && !t.keep_down_proj);
  std::vector<Keeps> out;
  for (const Keeps& step : kLadder) {
    if (!a.recompute && step.recompute != t.recompute) continue;
    Keeps k = keeps_of(t);
    k.recompute = step.recompute;
    if (!k.recompute && a.recompute && (spill || keep_refused)) continue;
    if (k.recompute) {  // without recompute every layer keeps everything: the keep_* values do not matter
      if (a.keep_mlp) k.keep_mlp = step.keep_mlp && !spill && !t.tile_mlp;
      if (a.keep_o_proj) k.keep_o_proj = step.keep_o_proj;
      if (a.keep_down_proj) k.keep_down_proj = step.keep_down_proj;
    }
    if (std::find(out.begin(), out.end(), k) == out.end()) out.push_back(k);
  }
  return out;
}

TrainConfig with(const TrainConfig& c, const Keeps& k) {
  TrainConfig out = c;
  out.train.recompute = k.recompute;
  out.train.keep_mlp = k.keep_mlp;
  out.train.keep_o_proj = k.keep_o_proj;
  out.train.keep_down_proj = k.keep_down_proj;
  return out;
}

}  // namespace

TrainConfig choose_recompute(const TrainConfig& c, const model::Gemma4Multimodal& m, int world_size, int ranks_on_node,
                             std::span<const int64_t> sample_prompt_tokens, int64_t budget) {
  if (!c.train.automatic.any()) return c;
  const std::vector<Keeps> options = candidates(c.train);
  if (options.empty()) return c;  // nothing the fields allow (validate names the conflict)
  // 95% (trainer.h): the check is a lower bound, within ~1% of measured peaks.
  const double headroom = 0.95 * static_cast<double>(budget);
  for (size_t i = 0; i + 1 < options.size(); ++i) {
    const TrainConfig k = with(c, options[i]);
    const int64_t bytes = train_memory_at_least(k, m, world_size, ranks_on_node, sample_prompt_tokens).total();
    if (bytes >= 0 && static_cast<double>(bytes) <= headroom) return k;
  }
  return with(c, options.back());
}

std::string describe_recompute(const TrainConfig& c) {
  const TrainSection& t = c.train;
  const std::string how = t.automatic.any() ? " (auto)" : "";
  if (!t.recompute) return "recompute: none, every layer's activations kept" + how;
  std::string outputs;  // "o_proj and down_proj outputs", "down_proj output"
  if (t.keep_o_proj) outputs = "o_proj";
  if (t.keep_down_proj)
    outputs += outputs.empty() ? "down_proj output" : " and down_proj outputs";
  else if (!outputs.empty())
    outputs += " output";
  std::string list = t.keep_mlp ? "its MLP projections" : "";
  if (!outputs.empty()) list += (list.empty() ? "its " : ", ") + outputs;
  if (list.empty()) list = "none of its products";
  return "recompute: each layer in the backward, keeping " + list + how;
}

}  // namespace rf::trainer
