// ringflex tests: the message an expression's rf::Error carries, for tests that check what a rejection names.
#pragma once

#include <string>

#include "core/error.h"

namespace rf::testing {

// The message of the rf::Error `fn` throws, or "" if it throws nothing.
template <typename Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const rf::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace rf::testing
