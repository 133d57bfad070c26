// ringflex tests/io: the message an expression's rf::Error carries, for tests that check what a rejection names.
#pragma once

#include <functional>
#include <string>

#include "core/error.h"

namespace rf::io {

// The message of the rf::Error `f` throws, or "" if it throws nothing.
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const rf::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace rf::io
