// ringflex model: LoRA over a frozen base (see lora_store.h).
#include "model/lora_store.h"

#include <algorithm>
#include <cmath>
#include <regex>

#include "core/error.h"

namespace rf::model {

namespace {

// splitmix64: one well-mixed 64-bit value per input, so an element's initial value depends on nothing but its
// (seed, name, index), whatever the grid or the order adapters are made in.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// FNV-1a of a name.
uint64_t name_hash(const std::string& s) {
  constexpr uint64_t kOffset = 0xcbf29ce484222325ULL, kPrime = 0x100000001b3ULL;
  uint64_t h = kOffset;
  for (unsigned char c : s) h = (h ^ c) * kPrime;
  return h;
}

constexpr const char* kWeightSuffix = ".weight";

}  // namespace

double LoraConfig::scale() const {
  return use_rslora ? alpha / std::sqrt(static_cast<double>(rank)) : alpha / static_cast<double>(rank);
}

void LoraConfig::validate() const {
  RF_CHECK(rank >= 1, "config: model.lora.rank must be >= 1, got ", rank);
  RF_CHECK(alpha > 0, "config: model.lora.alpha must be > 0, got ", alpha);
  RF_CHECK(dropout == 0.0, "config: model.lora.dropout = ", dropout,
           " is not implemented (only 0: the adapters see the same input as the base)");
  RF_CHECK(!target.empty(), "config: model.lora.target is empty");
}

std::string module_of(const std::string& param_name) {
  const std::string suffix = kWeightSuffix;
  if (param_name.size() > suffix.size() && param_name.ends_with(suffix))
    return param_name.substr(0, param_name.size() - suffix.size());
  return param_name;
}

LoraStore::LoraStore(LoraConfig config) : cfg_(std::move(config)) { cfg_.validate(); }

void LoraStore::allocate_weights() {
  if (weights_allocated()) return;
  const size_t base_slots = size();
  adapter_of_.assign(base_slots, -1);
  std::vector<bool> used(cfg_.target.size(), false);
  const std::regex re = cfg_.target_regex ? std::regex(cfg_.target.at(0)) : std::regex();
  for (size_t slot = 0; slot < base_slots; ++slot) {
    const ParamInfo p = info(slot);
    if (p.layer == kGlobalGroup) continue;
    const std::string module = module_of(p.name);
    bool hit = false;
    if (cfg_.target_regex) {
      hit = std::regex_match(module, re);
      if (hit) used[0] = true;
    } else {
      for (size_t t = 0; t < cfg_.target.size(); ++t) {
        const std::string& name = cfg_.target[t];
        if (module == name || module.ends_with("." + name)) {
          hit = true;
          used[t] = true;
        }
      }
    }
    if (!hit) continue;
    RF_CHECK(p.matmul && p.shape.size() == 2, "model.lora.target matches `", module, "` of shape ",
             p.shape.size(), "-D: only the decoder's linear weights take adapters (expert adapters are not implemented)");
    Adapter a;
    a.base = slot;
    a.out = p.shape[0];
    a.in = p.shape[1];
    a.a = add(module + ".lora_A.weight", {cfg_.rank, a.in}, p.layer, false);
    a.b = add(module + ".lora_B.weight", {a.out, cfg_.rank}, p.layer, false);
    adapter_of_[slot] = static_cast<int>(adapters_.size());
    adapters_.push_back(a);
  }
  for (size_t t = 0; t < used.size(); ++t)
    RF_CHECK(used[t], "config: model.lora.target `", cfg_.target[t], "` matches no linear layer of the text model");
  std::vector<bool> trainable(size(), false);
  for (const Adapter& a : adapters_) trainable[a.a] = trainable[a.b] = true;
  set_trainable(trainable);
  ReplicatedStore::allocate_weights();
  init_adapters();
}

void LoraStore::init_adapters() {
  for (const Adapter& a : adapters_) {
    // PEFT: nn.init.kaiming_uniform_(A, a=sqrt(5)): gain sqrt(2 / (1 + 5)), bound gain * sqrt(3 / fan_in)
    // = 1 / sqrt(in).
    const double bound = 1.0 / std::sqrt(static_cast<double>(a.in));
    const std::string& name = info(a.a).name;
    const uint64_t key = mix(cfg_.seed ^ mix(name_hash(name)));
    float* A = mutable_weight(a.a);
    for (int64_t e = 0; e < info(a.a).numel; ++e) {
      // The top 53 bits as a double in [0, 1).
      const double u = static_cast<double>(mix(key + static_cast<uint64_t>(e)) >> 11) * 0x1.0p-53;
      A[e] = static_cast<float>(bound * (2.0 * u - 1.0));
    }
    std::fill_n(mutable_weight(a.b), info(a.b).numel, 0.f);
  }
}

std::vector<std::string> LoraStore::target_modules() const {
  std::vector<std::string> out;
  for (const Adapter& a : adapters_) out.push_back(module_of(info(a.base).name));
  return out;
}

const float* LoraStore::weight(size_t slot) const {
  const int i = adapter_of(slot);
  if (i >= 0 && !merged_.empty() && info(slot).layer == acquired_) return merged_[static_cast<size_t>(i)].data();
  return ReplicatedStore::weight(slot);
}

float* LoraStore::grad(size_t slot) {
  const int i = adapter_of(slot);
  if (i >= 0 && !dmerged_.empty() && info(slot).layer == acquired_) return dmerged_[static_cast<size_t>(i)].data();
  return ReplicatedStore::grad(slot);
}

const float* LoraStore::grad(size_t slot) const {
  const int i = adapter_of(slot);
  if (i >= 0 && !dmerged_.empty() && info(slot).layer == acquired_) return dmerged_[static_cast<size_t>(i)].data();
  return ReplicatedStore::grad(slot);
}

void LoraStore::merge_layer(int layer) {
  RF_CHECK(acquired_ < kGlobalGroup, "LoRA store: layer ", layer, " acquired while layer ", acquired_,
           " is (one run at a time per store)");
  if (layer == kGlobalGroup) return;
  acquired_ = layer;
  merged_.assign(adapters_.size(), {});
  const float s = static_cast<float>(cfg_.scale());
  for (size_t i = 0; i < adapters_.size(); ++i) {
    const Adapter& a = adapters_[i];
    if (info(a.base).layer != layer) continue;
    const float* W = ReplicatedStore::weight(a.base);
    std::vector<float>& m = merged_[i];
    m.assign(W, W + a.out * a.in);
    // W' [out, in] += scale * B [out, r] A [r, in]
    gemm(false, false, a.out, a.in, cfg_.rank, s, ReplicatedStore::weight(a.b), cfg_.rank,
         ReplicatedStore::weight(a.a), a.in, 1.f, m.data(), a.in);
  }
}

void LoraStore::release_layer() {
  acquired_ = kGlobalGroup - 1;
  merged_.clear();
  dmerged_.clear();
}

void LoraStore::before_forward(int layer) { merge_layer(layer); }

void LoraStore::after_forward(int layer) {
  if (layer != kGlobalGroup) release_layer();
}

void LoraStore::before_backward(int layer) {
  merge_layer(layer);
  if (layer == kGlobalGroup || !has_grads()) return;
  dmerged_.assign(adapters_.size(), {});
  for (size_t i = 0; i < adapters_.size(); ++i)
    if (info(adapters_[i].base).layer == layer)
      dmerged_[i].assign(static_cast<size_t>(adapters_[i].out * adapters_[i].in), 0.f);
}

void LoraStore::after_backward(int layer) {
  if (layer == kGlobalGroup) return;
  const float s = static_cast<float>(cfg_.scale());
  const int64_t r = cfg_.rank;
  for (size_t i = 0; i < adapters_.size() && !dmerged_.empty(); ++i) {
    const Adapter& a = adapters_[i];
    if (info(a.base).layer != layer) continue;
    const float* dW = dmerged_[i].data();
    // dB [out, r] += scale * dW' [out, in] A^T [in, r];  dA [r, in] += scale * B^T [r, out] dW' [out, in]
    gemm(false, true, a.out, r, a.in, s, dW, a.in, ReplicatedStore::weight(a.a), a.in, 1.f,
         ReplicatedStore::grad(a.b), r);
    gemm(true, false, r, a.in, a.out, s, ReplicatedStore::weight(a.b), r, dW, a.in, 1.f, ReplicatedStore::grad(a.a),
         a.in);
  }
  release_layer();
}

}  // namespace rf::model
