// ringflex io: tensors carried through a job unchanged (see passthrough.h).
#include "io/passthrough.h"

#include <algorithm>

#include "core/error.h"

namespace rf::io {

void Passthrough::add(Entry e) {
  RF_CHECK(index_.emplace(e.name, entries_.size()).second, "tensor `", e.name, "` is kept twice");
  entries_.push_back(std::move(e));
}

void Passthrough::borrow(const std::shared_ptr<const Checkpoint>& files, std::string_view name) {
  const TensorView* v = files->find(name);
  RF_CHECK(v != nullptr, files->dir(), ": no tensor `", name, "` in the checkpoint");
  add(Entry{v->name, v->dtype, v->shape, v->bytes});
  if (std::find(sources_.begin(), sources_.end(), files) == sources_.end()) sources_.push_back(files);
}

void Passthrough::own(std::string name, StDType dtype, std::vector<int64_t> shape, std::vector<std::byte> bytes) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  RF_CHECK(n >= 0 && static_cast<size_t>(n) * element_size(dtype) == bytes.size(), "tensor `", name, "` of shape ",
           shape_string(shape), " ", dtype_name(dtype), " was given ", bytes.size(), " bytes");
  auto held = std::make_shared<const std::vector<std::byte>>(std::move(bytes));
  add(Entry{std::move(name), dtype, std::move(shape), std::span<const std::byte>(*held)});
  owned_.push_back(std::move(held));
}

void Passthrough::drop(std::string_view name) {
  const auto it = index_.find(name);
  if (it == index_.end()) return;
  entries_.erase(entries_.begin() + static_cast<std::ptrdiff_t>(it->second));
  index_.clear();
  for (size_t i = 0; i < entries_.size(); ++i) index_.emplace(entries_[i].name, i);
}

const Passthrough::Entry* Passthrough::find(std::string_view name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &entries_[it->second];
}

void Passthrough::release_pages() const {
  for (const auto& files : sources_) files->release_pages();
}

}  // namespace rf::io
