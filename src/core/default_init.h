// ringflex core: an allocator whose size constructors leave float storage uninitialised.
#pragma once

#include <memory>
#include <new>
#include <utility>

namespace rf {

// std::vector<T>(n) value-initialises: n zeros written by the calling thread, taking every first-touch page fault
// of a fresh allocation on that thread while the others wait. With this allocator a size constructor (or resize)
// default-initialises instead (no write for float), so the caller can write the elements itself, in parallel.
template <typename T>
struct DefaultInitAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };
  DefaultInitAllocator() = default;
  template <typename U>
  DefaultInitAllocator(const DefaultInitAllocator<U>&) noexcept {}
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

}  // namespace rf
