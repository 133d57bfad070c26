// ringflex core: the library's one error type and its checks.
//
// Two tiers (see DEVELOPERS.md): `RF_CHECK` validates inputs and external calls and throws rf::Error with a
// message that names the problem; `RF_ASSERT` guards internal invariants and is always on. The library never
// calls exit(): only the command line decides how a failed rank ends (MPI_Abort under mpirun).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace rf {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Builds a message from any streamable parts: rf::concat("S = ", s, " is negative").
template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

template <typename... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  throw Error(concat(parts...));
}

}  // namespace rf

#define RF_CHECK(cond, ...)             \
  do {                                  \
    if (!(cond)) rf::fail(__VA_ARGS__); \
  } while (0)

#define RF_ASSERT(cond)                                                                       \
  do {                                                                                        \
    if (!(cond)) rf::fail("internal error: ", #cond, " failed at ", __FILE__, ":", __LINE__); \
  } while (0)
