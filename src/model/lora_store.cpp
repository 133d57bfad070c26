// ringflex model: LoRA over a frozen base (see lora_store.h).
#include "model/lora_store.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <regex>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include <filesystem>

#include "core/error.h"
#include "core/mix.h"
#include "io/atomic_file.h"
#include "io/json_text.h"
#include "io/safetensors.h"
#include "io/tensor_access.h"
#include "model/checkpoint.h"
#include "model/expert_store.h"
#include "model/loss.h"

namespace rf::model {

namespace {

// FNV-1a of a name.
uint64_t name_hash(const std::string& s) {
  Fnv1a h;
  for (unsigned char c : s) h.add(c);
  return h.h;
}

constexpr const char* kWeightSuffix = ".weight";
// The modules the layer applies adapters to (Gemma4Model::Run::adapter_forward's call sites).
bool adaptable(const std::string& module) {
  for (const char* m : {".self_attn.q_proj", ".self_attn.k_proj", ".self_attn.v_proj", ".self_attn.o_proj",
                        ".mlp.gate_proj", ".mlp.up_proj", ".mlp.down_proj"})
    if (module.ends_with(m)) return true;
  return false;
}

// The module PEFT's ParamWrapper gives the adapter of a 3-D experts weight: PEFT wraps the experts module once per
// targeted parameter, in the module's registration order (gate_up_proj, then down_proj), each wrapper around the
// previous one, so the last is "<experts>" and each earlier one a further ".base_layer" down.
std::string expert_adapter_module(const LoraTarget& t, const std::vector<LoraTarget>& targets, const ParamStore& s) {
  const std::string& name = s.info(t.base).name;
  const std::string module = name.substr(0, name.rfind('.'));  // "model.layers.N.experts"
  std::string out = module;
  for (const LoraTarget& u : targets) {
    const std::string& other = s.info(u.base).name;
    if (u.experts_weight && u.base > t.base && other.substr(0, other.rfind('.')) == module) out += ".base_layer";
  }
  return out;
}

// A lookup table: read by row in the held dtype (the embedding's gathers), never widened as a whole.
bool lookup_table(const ParamInfo& p) { return !p.matmul && p.shape.size() == 2; }

// Whether `pattern` repeats a group that itself holds an unbounded repetition, as in `(a+)*` or `((.*)*)*x`:
// std::regex backtracks through every way of splitting a name between the two, exponentially in its length, so a
// run would hang on every rank while matching. Escaped characters and bracket expressions are skipped.
bool nests_repetitions(const std::string& pattern) {
  std::vector<bool> repeats_inside;  // per open group: whether it holds a `*`, `+` or `{` so far
  bool closed_repeating = false;     // the group just closed held a repetition
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    const bool quantifier = c == '*' || c == '+' || c == '{';
    if (quantifier && closed_repeating) return true;
    closed_repeating = false;
    if (c == '\\') {
      ++i;
    } else if (c == '[') {  // a bracket expression: up to its `]` (one right after `[` or `[^` is a member)
      size_t j = i + 1;
      if (j < pattern.size() && pattern[j] == '^') ++j;
      if (j < pattern.size() && pattern[j] == ']') ++j;
      while (j < pattern.size() && pattern[j] != ']') j += pattern[j] == '\\' ? 2 : 1;
      i = j;
    } else if (c == '(') {
      repeats_inside.push_back(false);
    } else if (c == ')' && !repeats_inside.empty()) {
      closed_repeating = repeats_inside.back();
      repeats_inside.pop_back();
      if (closed_repeating && !repeats_inside.empty()) repeats_inside.back() = true;
    } else if (quantifier && !repeats_inside.empty()) {
      repeats_inside.back() = true;
    }
  }
  return false;
}

}  // namespace

double LoraConfig::scale() const {
  return use_rslora ? alpha / std::sqrt(static_cast<double>(rank)) : alpha / static_cast<double>(rank);
}

void LoraConfig::validate() const {
  RF_CHECK(rank >= 1, "config: model.lora.rank must be >= 1, got ", rank);
  RF_CHECK(alpha > 0, "config: model.lora.alpha must be > 0, got ", alpha);
  // The layers multiply by the scale in float32: one beyond its range is inf, and inf times the zero-initialised B
  // is NaN in every output.
  RF_CHECK(scale() <= std::numeric_limits<float>::max(), "config: model.lora.alpha = ", alpha, " over rank ", rank,
           " gives a scale of ", scale(), ", beyond float32's range");
  RF_CHECK(dropout >= 0.0 && dropout < 1.0, "config: model.lora.dropout = ", dropout, " must be in [0, 1)");
  RF_CHECK(dropout == 0.0 || target_parameters.empty(), "config: model.lora.dropout = ", dropout,
           " with target_parameters: PEFT's adapters on 3-D weights take no dropout (set it to 0)");
  RF_CHECK(!target.empty() || !target_parameters.empty(),
           "config: model.lora.target and model.lora.target_parameters are both empty");
  if (target_regex && !target.empty()) {
    try {
      const std::regex re(target.at(0));
    } catch (const std::regex_error& e) {
      rf::fail("config: model.lora.target '", target.at(0), "' is not a regular expression: ", e.what());
    }
    RF_CHECK(!nests_repetitions(target.at(0)), "config: model.lora.target '", target.at(0),
             "' repeats a group that holds a repetition (as in `(a+)*`), which std::regex matches in exponential time; "
             "write it without the nesting");
  }
}

std::string module_of(const std::string& param_name) {
  const std::string suffix = kWeightSuffix;
  if (param_name.size() > suffix.size() && param_name.ends_with(suffix))
    return param_name.substr(0, param_name.size() - suffix.size());
  return param_name;
}

LoraStore::LoraStore(LoraConfig config) : cfg_(std::move(config)) { cfg_.validate(); }

std::vector<LoraTarget> lora_targets(const ParamStore& shapes, const LoraConfig& config) {
  config.validate();
  std::vector<LoraTarget> out;
  std::vector<bool> used(config.target.size(), false);
  const std::regex re = config.target_regex && !config.target.empty() ? std::regex(config.target.at(0)) : std::regex();
  for (size_t slot = 0; slot < shapes.size() && !config.target.empty(); ++slot) {
    const ParamInfo& p = shapes.info(slot);
    // PEFT's target_modules name modules; a 3-D experts weight is a parameter (target_parameters).
    if (p.layer == kGlobalGroup || p.shape.size() == 3) continue;
    const std::string module = module_of(p.name);
    bool hit = false;
    if (config.target_regex) {
      hit = std::regex_match(module, re);
      if (hit) used[0] = true;
    } else {
      for (size_t t = 0; t < config.target.size(); ++t) {
        const std::string& name = config.target[t];
        if (module == name || module.ends_with("." + name)) {
          hit = true;
          used[t] = true;
        }
      }
    }
    if (!hit) continue;
    RF_CHECK(p.matmul && p.shape.size() == 2 && adaptable(module), "model.lora.target matches `", module,
             "`: only the attention's q/k/v/o_proj and the MLP's gate/up/down_proj take adapters (expert, router and "
             "per-layer-input adapters are not implemented)");
    out.push_back(LoraTarget{slot, p.shape[0], p.shape[1]});
  }
  for (size_t t = 0; t < used.size(); ++t)
    RF_CHECK(used[t], "config: model.lora.target `", config.target[t], "` matches no linear layer of the text model");
  std::vector<bool> used_params(config.target_parameters.size(), false);
  for (size_t slot = 0; slot < shapes.size(); ++slot) {
    const ParamInfo& p = shapes.info(slot);
    if (p.layer == kGlobalGroup) continue;
    bool hit = false;
    for (size_t t = 0; t < config.target_parameters.size(); ++t) {
      const std::string& name = config.target_parameters[t];
      if (p.name == name || p.name.ends_with("." + name)) {
        hit = true;
        used_params[t] = true;
      }
    }
    if (!hit) continue;
    RF_CHECK(
        p.shape.size() == 3 && (p.name.ends_with(".experts.gate_up_proj") || p.name.ends_with(".experts.down_proj")),
        "model.lora.target_parameters matches `", p.name,
        "`: only the MoE experts' 3-D weights (experts.gate_up_proj, experts.down_proj) are targeted as parameters");
    out.push_back(LoraTarget{slot, p.shape[1], p.shape[2], p.shape[0], true});
  }
  for (size_t t = 0; t < used_params.size(); ++t)
    RF_CHECK(used_params[t], "config: model.lora.target_parameters `", config.target_parameters[t],
             "` matches no experts weight of the text model");
  std::sort(out.begin(), out.end(), [](const LoraTarget& a, const LoraTarget& b) { return a.base < b.base; });
  return out;
}

int64_t lora_adapter_bytes(const std::vector<LoraTarget>& targets, int rank, int ep) {
  int64_t n = 0;
  for (const LoraTarget& t : targets) n += int64_t{rank} * (t.experts > 1 ? t.experts / ep : 1) * (t.in + t.out);
  return n * static_cast<int64_t>(sizeof(float));
}

namespace {

// Float32 bytes of the largest decoder layer among the first `base_slots` slots of `shapes`.
int64_t largest_layer_bytes(const ParamStore& shapes, size_t base_slots) {
  std::unordered_map<int, int64_t> per_layer;
  for (size_t slot = 0; slot < base_slots; ++slot)
    if (const ParamInfo& p = shapes.info(slot); p.layer != kGlobalGroup) per_layer[p.layer] += p.numel;
  int64_t most = 0;
  for (const auto& [layer, n] : per_layer) most = std::max(most, n);
  return most * static_cast<int64_t>(sizeof(float));
}

}  // namespace

int64_t lora_layer_buffer_bytes(const ParamStore& base) { return largest_layer_bytes(base, base.size()); }

int64_t lora_layer_buffer_bytes(const LoraStore& store) {
  // The adapters are registered after the base's slots, when the store allocates.
  return largest_layer_bytes(store, store.weights_allocated() ? store.base_slots() : store.size());
}

int64_t lora_global_buffer_bytes(const ParamStore& shapes) {
  int64_t n = 0;
  for (const ParamInfo& p : shapes.infos())
    if (p.layer == kGlobalGroup && !lookup_table(p) && !p.streamed) n += p.numel;
  return n * static_cast<int64_t>(sizeof(float));
}

int64_t lora_head_buffer_bytes(const ParamStore& shapes) {
  // The loss reads the held head by panels (loss.h): its float32 scratch, not the head widened.
  int64_t n = 0;
  for (const ParamInfo& p : shapes.infos())
    if (p.layer == kGlobalGroup && !lookup_table(p) && p.streamed && p.shape.size() == 2)
      n += head_panel_bytes(p.shape[0], p.shape[1]);
  return n;
}

void LoraStore::allocate_weights() {
  if (weights_allocated()) return;
  const std::vector<LoraTarget> targets = lora_targets(*this, cfg_);
  base_slots_ = size();
  adapter_of_.assign(size(), -1);
  for (const LoraTarget& t : targets) {
    const ParamInfo p = info(t.base);  // a copy: add() grows the registry
    Adapter a;
    a.base = t.base;
    a.out = t.out;
    a.in = t.in;
    a.experts = t.experts;
    a.experts_weight = t.experts_weight;
    const std::string module = t.experts_weight ? expert_adapter_module(t, targets, *this) : module_of(p.name);
    if (t.experts_weight) {
      RF_CHECK(t.experts % ep_ == 0, "config: parallelism.ep = ", ep_, " does not divide the ", t.experts,
               " experts of ", p.name);
      a.experts_held = t.experts / ep_;
      a.experts_begin = ep_rank_ * a.experts_held;
    }
    // Expert-major (the header): an expert's A_e and B_e are leading rows, EP rank q's experts a run of them.
    a.a = add(module + ".lora_A.weight", {cfg_.rank * a.experts_held, a.in}, p.layer, false);
    a.b = add(module + ".lora_B.weight", {a.experts_held * a.out, cfg_.rank}, p.layer, false);
    if (a.experts_held < a.experts) {
      hold_rows(a.a, a.experts_begin * cfg_.rank, a.experts * cfg_.rank);
      hold_rows(a.b, a.experts_begin * a.out, a.experts * a.out);
    }
    adapter_of_[t.base] = static_cast<int>(adapters_.size());
    adapters_.push_back(a);
  }
  // The adapters' own store, registered in this store's order: its (all trainable) layout is this store's trainable
  // layout, element for element.
  for (size_t slot = base_slots_; slot < size(); ++slot) {
    const ParamInfo& p = info(slot);
    adapters_store_.add(p.name, p.shape, p.layer, p.matmul);
  }
  std::vector<bool> trainable(size(), false);
  for (const Adapter& a : adapters_) trainable[a.a] = trainable[a.b] = true;
  set_trainable(trainable);
  adapters_store_.allocate_weights();
  base_.assign(base_slots_, Base{});
  allocated_ = true;
  init_adapters();
}

void LoraStore::init_adapters() {
  for (const Adapter& a : adapters_) {
    // PEFT: nn.init.kaiming_uniform_(A, a=sqrt(5)): gain sqrt(2 / (1 + 5)), bound gain * sqrt(3 / fan_in)
    // = 1 / sqrt(in).
    const double bound = 1.0 / std::sqrt(static_cast<double>(a.in));
    const std::string& name = info(a.a).name;
    const uint64_t key = splitmix64(cfg_.seed ^ splitmix64(name_hash(name)));
    float* A = mutable_weight(a.a);
    // Element i of the held rows is element first + i of the whole tensor (expert parallelism holds a run of rows).
    const int64_t first = info(a.a).rows_begin * a.in;
    for (int64_t i = 0; i < info(a.a).numel; ++i) {
      const auto e = static_cast<uint64_t>(first + i);
      // The top 53 bits as a double in [0, 1).
      const double u = static_cast<double>(splitmix64(key + e) >> 11) * 0x1.0p-53;
      A[i] = static_cast<float>(bound * (2.0 * u - 1.0));
    }
    std::fill_n(mutable_weight(a.b), info(a.b).numel, 0.f);
  }
}

void LoraStore::place_experts(int ep_rank, int ep) {
  RF_CHECK(!allocated_, "LoRA store: place_experts after the adapters were allocated");
  RF_CHECK(ep >= 1 && ep_rank >= 0 && ep_rank < ep, "LoRA store: EP rank ", ep_rank, " of ", ep);
  ep_rank_ = ep_rank;
  ep_ = ep;
}

const LoraStore::Adapter* LoraStore::adapter_owning(size_t slot) const {
  for (const Adapter& a : adapters_)
    if (a.a == slot || a.b == slot) return &a;
  return nullptr;
}

std::unique_ptr<LoraStore> LoraStore::whole_adapters() const {
  RF_CHECK(allocated_, "LoRA store: whole_adapters before the adapters were allocated");
  auto whole = std::make_unique<LoraStore>(cfg_);
  for (size_t slot = 0; slot < base_slots_; ++slot) {
    const ParamInfo& p = info(slot);
    whole->add(p.name, p.shape, p.layer, p.matmul);
  }
  whole->allocate_weights();
  if (has_moments()) whole->allocate_moments();
  for (size_t slot = base_slots_; slot < size(); ++slot) {
    const ParamInfo& p = info(slot);
    const ParamInfo& w = whole->info(slot);
    RF_CHECK(p.name == w.name && p.whole_shape() == w.shape, "whole_adapters: adapter ", p.name, " registered as ",
             w.name, " in the whole store");
    const int64_t at = p.rows_begin * row_elements(p);
    std::copy_n(weight(slot), p.numel, whole->mutable_weight(slot) + at);
    for (Role role : {Role::ExpAvg, Role::ExpAvgSq})
      if (const float* m = moment(role, slot)) std::copy_n(m, p.numel, whole->moment(role, slot) + at);
  }
  return whole;
}

std::vector<int64_t> LoraStore::file_shape(size_t slot) const {
  const Adapter* a = adapter_owning(slot);
  if (a == nullptr || a->experts == 1 || slot != a->b) return info(slot).whole_shape();
  return {a->out, cfg_.rank * a->experts};
}

void LoraStore::to_file_layout(size_t slot, std::span<const float> held, std::span<float> file) const {
  const Adapter* a = adapter_owning(slot);
  const ParamInfo& p = info(slot);
  const int64_t n = p.whole_shape().at(0) * row_elements(p);
  RF_CHECK(static_cast<int64_t>(held.size()) == n && file.size() == held.size(), "to_file_layout: ", p.name, " takes ",
           n, " elements whole");
  if (a == nullptr || a->experts == 1 || slot != a->b) {
    std::copy(held.begin(), held.end(), file.begin());
    return;
  }
  // [E * out, r] -> [out, r * E]: B_e[o, k] to column k * E + e of row o.
  const int64_t E = a->experts, out = a->out, r = cfg_.rank;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t o = 0; o < out; ++o)
      for (int64_t k = 0; k < r; ++k) file[o * r * E + k * E + e] = held[(e * out + o) * r + k];
}

void LoraStore::from_file_layout(size_t slot, std::span<const float> file, std::span<float> held) const {
  const Adapter* a = adapter_owning(slot);
  const ParamInfo& p = info(slot);
  const int64_t n = p.whole_shape().at(0) * row_elements(p);
  RF_CHECK(static_cast<int64_t>(held.size()) == n && file.size() == held.size(), "from_file_layout: ", p.name,
           " takes ", n, " elements whole");
  if (a == nullptr || a->experts == 1 || slot != a->b) {
    std::copy(file.begin(), file.end(), held.begin());
    return;
  }
  const int64_t E = a->experts, out = a->out, r = cfg_.rank;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t o = 0; o < out; ++o)
      for (int64_t k = 0; k < r; ++k) held[(e * out + o) * r + k] = file[o * r * E + k * E + e];
}

std::vector<std::string> LoraStore::target_modules() const {
  std::vector<std::string> out;
  for (const Adapter& a : adapters_)
    if (!a.experts_weight) out.push_back(module_of(info(a.base).name));
  return out;
}

std::vector<std::string> LoraStore::target_parameters() const {
  std::vector<std::string> out;
  for (const Adapter& a : adapters_)
    if (a.experts_weight) out.push_back(info(a.base).name);
  return out;
}

int64_t LoraStore::held_base_bytes() const {
  int64_t n = 0;
  for (size_t slot = 0; slot < base_.size(); ++slot)
    if (base_[slot].held.data != nullptr) n += info(slot).numel * held_dtype_size(base_[slot].held.dtype);
  return n;
}

int64_t LoraStore::mapped_base_bytes() const {
  int64_t n = 0;
  for (size_t slot = 0; slot < base_.size(); ++slot)
    if (base_[slot].held.data != nullptr && base_[slot].owned.empty())
      n += info(slot).numel * held_dtype_size(base_[slot].held.dtype);
  return n;
}

int64_t LoraStore::widened_bytes() const {
  int64_t n = 0;
  for (const auto& [slot, values] : widened_) n += static_cast<int64_t>(values.size());
  return n * static_cast<int64_t>(sizeof(float));
}

bool LoraStore::needs_widening(size_t slot) const {
  const HeldWeight& h = base_.at(slot).held;
  return h.dtype != HeldDType::F32 || reinterpret_cast<uintptr_t>(h.data) % alignof(float) != 0;
}

HeldWeight LoraStore::held_weight(size_t slot) const {
  if (!is_base(slot)) return {HeldDType::F32, adapters_store_.weight(inner(slot))};
  const HeldWeight& h = base_.at(slot).held;
  RF_CHECK(h.data != nullptr, "LoRA store: base parameter '", info(slot).name, "' has no values (not loaded)");
  return h;
}

bool LoraStore::hold_mapped(size_t slot, HeldWeight values, std::shared_ptr<const void> keep) {
  if (!allocated_ || !is_base(slot) || values.data == nullptr) return false;
  Base& b = base_.at(slot);
  b.owned = {};
  b.held = values;
  widened_.erase(slot);
  if (std::find(keep_.begin(), keep_.end(), keep) == keep_.end()) keep_.push_back(std::move(keep));
  weights_changed();
  return true;
}

const float* LoraStore::weight(size_t slot) const {
  if (!is_base(slot)) return adapters_store_.weight(inner(slot));
  if (const auto it = widened_.find(slot); it != widened_.end()) return it->second.data();
  const HeldWeight h = held_weight(slot);
  if (!needs_widening(slot)) return static_cast<const float*>(h.data);
  // A tool outside the hooks (export, the finiteness checks): one slot at a time.
  if (scratch_slot_ != slot || scratch_version_ != version()) {
    scratch_.resize(static_cast<size_t>(info(slot).numel));
    widen(h, 0, info(slot).numel, scratch_.data());
    scratch_slot_ = slot;
    scratch_version_ = version();
  }
  return scratch_.data();
}

float* LoraStore::mutable_weight(size_t slot) {
  RF_CHECK(allocated_, "LoRA store: parameter '", info(slot).name, "' written before the weights were allocated");
  weights_changed();
  if (!is_base(slot)) return adapters_store_.mutable_weight(inner(slot));
  Base& b = base_.at(slot);
  if (b.owned.empty()) {
    // The base becomes float32 in memory: its values so far (mapped ones widened), else zeros.
    std::vector<float> values(static_cast<size_t>(info(slot).numel), 0.f);
    if (b.held.data != nullptr) widen(b.held, 0, info(slot).numel, values.data());
    b.owned = std::move(values);
    b.held = {HeldDType::F32, b.owned.data()};
  }
  widened_.erase(slot);
  return b.owned.data();
}

const bf16* LoraStore::find(const float* src, int64_t extent) const {
  for (const auto& [slot, values] : widened_) {
    const float* begin = values.data();
    const float* end = begin + values.size();
    if (src < begin || src + extent > end) continue;
    const HeldWeight& h = base_[slot].held;
    return h.dtype == HeldDType::BF16 ? static_cast<const bf16*>(h.data) + (src - begin) : nullptr;
  }
  return nullptr;
}

float* LoraStore::grad(size_t slot) { return is_base(slot) ? nullptr : adapters_store_.grad(inner(slot)); }
const float* LoraStore::grad(size_t slot) const { return is_base(slot) ? nullptr : adapters_store_.grad(inner(slot)); }
float* LoraStore::moment(Role role, size_t slot) {
  return is_base(slot) ? nullptr : adapters_store_.moment(role, inner(slot));
}
const float* LoraStore::moment(Role role, size_t slot) const {
  return is_base(slot) ? nullptr : adapters_store_.moment(role, inner(slot));
}

void LoraStore::set_moment_range(int64_t begin, int64_t end) {
  adapters_store_.set_moment_range(begin, end);
  record_moment_range(begin, end);
}

std::span<float> LoraStore::mutable_flat(Role role) {
  if (role == Role::Weights) weights_changed();
  return adapters_store_.mutable_flat(role);
}

std::optional<LinearAdapter> LoraStore::adapter(size_t slot) {
  const int i = adapter_of(slot);
  if (i < 0) return std::nullopt;
  const Adapter& a = adapters_[static_cast<size_t>(i)];
  LinearAdapter la;
  la.A = adapters_store_.weight(inner(a.a));
  la.B = adapters_store_.weight(inner(a.b));
  la.dA = adapters_store_.grad(inner(a.a));
  la.dB = adapters_store_.grad(inner(a.b));
  la.rank = cfg_.rank;
  la.in = a.in;
  la.out = a.out;
  la.scale = static_cast<float>(cfg_.scale());
  la.experts = a.experts_held;
  la.experts_begin = a.experts_begin;
  la.dropout = static_cast<float>(cfg_.dropout);
  la.salt = slot;
  return la;
}

void LoraStore::widen_slot(size_t slot) {
  const ParamInfo& p = info(slot);
  if (widened_.count(slot) || lookup_table(p) || !needs_widening(slot)) return;
  widened_.emplace(slot, widened_copy(held_weight(slot), p.numel));
}

void LoraStore::acquire(int layer) {
  for (size_t slot = 0; slot < base_slots_; ++slot)
    if (info(slot).layer == layer && !info(slot).streamed) widen_slot(slot);
}

void LoraStore::release(int layer) {
  for (auto it = widened_.begin(); it != widened_.end();)
    it = info(it->first).layer == layer && !info(it->first).streamed ? widened_.erase(it) : std::next(it);
}

void LoraStore::acquire_head(size_t slot) {
  // A head held in bf16 or f16 goes to the loss as it is held (gemma4.cpp, loss.h: widened by panels there); only a
  // float32 one not aligned for float needs its copy.
  if (is_base(slot) && held_weight(slot).dtype == HeldDType::F32) widen_slot(slot);
}

void LoraStore::release_head(size_t slot) { widened_.erase(slot); }

}  // namespace rf::model
