// The message of the rf::Error a call throws ("" when it does not throw), for asserting on error text.
#pragma once

#include <string>

#include "core/error.h"

namespace rf::trainer::testing {

template <typename Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const rf::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace rf::trainer::testing
