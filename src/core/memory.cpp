// ringflex core: the memory a job may allocate (see memory.h).
#include "core/memory.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace rf {

namespace {

constexpr int64_t kKiB = 1024;

// MemAvailable in bytes, or -1 when /proc/meminfo does not say (old kernels, other systems).
int64_t meminfo_available() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * kKiB;
  }
  return -1;
}

int local_ranks() {
  // Open MPI's count of the ranks of this job on this node; other launchers leave it unset.
  const char* s = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  const int n = s ? std::atoi(s) : 1;
  return n >= 1 ? n : 1;
}

// RINGFLEX_MEMORY_LIMIT in bytes, or -1 when unset. "0" is a valid (if useless) limit; anything but digits and
// one K/M/G suffix is an error, since a misspelt limit silently ignored would defeat its purpose.
int64_t memory_limit() {
  const char* text = std::getenv("RINGFLEX_MEMORY_LIMIT");
  if (text == nullptr || *text == '\0') return -1;
  errno = 0;
  char* end = nullptr;
  const long long n = std::strtoll(text, &end, 10);
  const bool has_digits = end != text;
  int shift = 0;
  if (*end == 'K' || *end == 'k') shift = 10;
  if (*end == 'M' || *end == 'm') shift = 20;
  if (*end == 'G' || *end == 'g') shift = 30;
  if (shift > 0) ++end;
  const bool fits = n >= 0 && errno == 0 && has_digits && *end == '\0' && n <= (INT64_MAX >> shift);
  RF_CHECK(fits, "RINGFLEX_MEMORY_LIMIT=", text, " is not a byte count (digits, optionally followed by K, M or G)");
  return static_cast<int64_t>(n) << shift;
}

}  // namespace

int64_t available_memory_bytes() {
  int64_t bytes = meminfo_available();
  if (bytes < 0) bytes = static_cast<int64_t>(sysconf(_SC_AVPHYS_PAGES)) * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
  bytes /= local_ranks();
  const int64_t limit = memory_limit();
  return limit >= 0 ? std::min(bytes, limit) : bytes;
}

void MemoryBreakdown::add(std::string name, int64_t bytes) { terms_.push_back({std::move(name), bytes}); }

void MemoryBreakdown::add(const MemoryBreakdown& other) {
  terms_.insert(terms_.end(), other.terms_.begin(), other.terms_.end());
}

int64_t MemoryBreakdown::total() const {
  int64_t sum = 0;
  for (const Term& t : terms_) sum = checked_sum({sum, t.bytes});
  return sum;
}

int64_t MemoryBreakdown::of(const std::string& name) const {
  int64_t sum = 0;
  for (const Term& t : terms_)
    if (t.name == name) sum += t.bytes;
  return sum;
}

std::string MemoryBreakdown::describe(size_t terms) const {
  std::vector<Term> shown;
  for (const Term& t : terms_)
    if (t.bytes != 0) shown.push_back(t);
  // Largest first (an overflowed term, < 0, is the largest of all); equal sizes keep their order.
  const auto size_key = [](const Term& t) { return t.bytes < 0 ? INT64_MAX : t.bytes; };
  std::stable_sort(shown.begin(), shown.end(), [&](const Term& a, const Term& b) { return size_key(a) > size_key(b); });
  std::string text;
  for (size_t i = 0; i < shown.size() && i < terms; ++i) {
    if (!text.empty()) text += ", ";
    text += shown[i].name + " " + (shown[i].bytes < 0 ? std::string("> 2^63 B") : format_bytes(shown[i].bytes));
  }
  if (shown.size() > terms) text += ", ...";
  return text;
}

int64_t checked_sum(std::initializer_list<int64_t> parts) {
  int64_t n = 0;
  for (const int64_t part : parts)
    if (part < 0 || __builtin_add_overflow(n, part, &n)) return -1;
  return n;
}

int64_t checked_bytes(std::initializer_list<int64_t> factors) {
  int64_t n = 1;
  for (const int64_t f : factors)
    if (f < 0 || __builtin_mul_overflow(n, f, &n)) return -1;
  return n;
}

std::string format_bytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  char text[32];
  if (bytes >= kKiB * kKiB * kKiB) {
    std::snprintf(text, sizeof(text), "%.1f GiB", b / static_cast<double>(kKiB * kKiB * kKiB));
  } else if (bytes >= kKiB * kKiB) {
    std::snprintf(text, sizeof(text), "%.1f MiB", b / static_cast<double>(kKiB * kKiB));
  } else {
    std::snprintf(text, sizeof(text), "%lld B", static_cast<long long>(bytes));
  }
  return text;
}

void check_memory(int64_t bytes, const std::string& what) {
  RF_CHECK(bytes >= 0, what, " needs more than 2^63 bytes of memory (its sizes overflow)");
  const int64_t available = available_memory_bytes();
  RF_CHECK(bytes <= available, what, " needs ", format_bytes(bytes), " of memory, but only ", format_bytes(available),
           " is available to this rank");
}

void check_memory(const MemoryBreakdown& need, const std::string& what, const std::string& context) {
  const int64_t bytes = need.total();
  RF_CHECK(bytes >= 0, what, " needs more than 2^63 bytes of memory per rank (", need.describe(), context,
           "; its sizes overflow)");
  const int64_t available = available_memory_bytes();
  RF_CHECK(bytes <= available, what, " needs at least ", format_bytes(bytes), " of memory per rank (", need.describe(),
           context, "), but only ", format_bytes(available), " is available to this rank");
}

}  // namespace rf
