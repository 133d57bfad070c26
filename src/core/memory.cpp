// ringflex core: the memory a job may allocate (see memory.h).
#include "core/memory.h"

#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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

// Limits at or above this mean "no limit": cgroup v1 reports an unset limit as PAGE_COUNTER_MAX pages, just below
// 2^63 bytes; no machine has 2^62 bytes.
constexpr int64_t kNoCgroupLimit = int64_t{1} << 62;

// The file's first token as a byte count; -1 when the file cannot be read or holds no plain number (v2 writes
// "max" for no limit).
int64_t read_bytes(const std::string& path) {
  std::ifstream file(path);
  std::string token;
  if (!(file >> token) || token.empty() || token.find_first_not_of("0123456789") != std::string::npos) return -1;
  errno = 0;
  const long long n = std::strtoll(token.c_str(), nullptr, 10);
  return errno == 0 ? static_cast<int64_t>(n) : -1;
}

// The value of `key` in a memory.stat file ("key value" lines), or -1 when it is not there.
int64_t stat_bytes(const std::string& path, const std::string& key) {
  std::ifstream file(path);
  std::string name;
  long long value = 0;
  while (file >> name >> value)
    if (name == key) return value;
  return -1;
}

// Headroom under `limit` of a group using `usage` bytes of which `reclaimable` are inactive page cache; -1 when
// the limit is unset or unreadable.
int64_t headroom(int64_t limit, int64_t usage, int64_t reclaimable) {
  if (limit < 0 || limit >= kNoCgroupLimit || usage < 0) return -1;
  const int64_t used = usage - std::clamp<int64_t>(reclaimable, 0, usage);
  return std::max<int64_t>(limit - used, 0);
}

// The lesser of two headrooms, -1 meaning none.
int64_t least_headroom(int64_t a, int64_t b) {
  if (a < 0) return b;
  if (b < 0) return a;
  return std::min(a, b);
}

// The directory of the group at `path` ("/" or "/a/b") under a hierarchy mounted at `mount`.
std::string group_dir(const std::string& mount, const std::string& path) {
  std::string dir = mount;
  if (path != "/") dir.append(path);
  return dir;
}

// Whether a /proc/self/cgroup controller list ("cpu,memory") names `controller`.
bool lists_controller(const std::string& controllers, const std::string& controller) {
  size_t start = 0;
  while (start <= controllers.size()) {
    size_t end = controllers.find(',', start);
    if (end == std::string::npos) end = controllers.size();
    if (controllers.compare(start, end - start, controller) == 0) return true;
    start = end + 1;
  }
  return false;
}

// cgroup v2: the group at `path` (which starts with '/') and each of its ancestors up to the mount, since each
// memory.max bounds its whole subtree; the least headroom wins.
int64_t v2_headroom(const std::string& mount, const std::string& path) {
  int64_t least = -1;
  size_t end = path == "/" ? 0 : path.size();  // the group is path[0, end); end = 0 is the mount itself
  while (true) {
    const std::string dir = mount + path.substr(0, end);
    least = least_headroom(least, headroom(read_bytes(dir + "/memory.max"), read_bytes(dir + "/memory.current"),
                                           stat_bytes(dir + "/memory.stat", "inactive_file")));
    if (end == 0) return least;
    end = path.rfind('/', end - 1);
  }
}

// cgroup v1: the memory controller's group; memory.stat's hierarchical_memory_limit already folds in the
// ancestors' limits.
int64_t v1_headroom(const std::string& mount, const std::string& path) {
  const std::string controller = mount + "/memory";
  std::string dir = group_dir(controller, path);
  int64_t usage = read_bytes(dir + "/memory.usage_in_bytes");
  if (usage < 0) {
    dir = controller;
    usage = read_bytes(dir + "/memory.usage_in_bytes");
  }
  const std::string stat = dir + "/memory.stat";
  const int64_t reclaimable = stat_bytes(stat, "total_inactive_file");
  return least_headroom(headroom(read_bytes(dir + "/memory.limit_in_bytes"), usage, reclaimable),
                        headroom(stat_bytes(stat, "hierarchical_memory_limit"), usage, reclaimable));
}

// The byte count in environment variable `var` (RINGFLEX_MEMORY_LIMIT, RINGFLEX_DISK_LIMIT), or -1 when unset. "0" is
// a valid (if useless) limit; anything but digits and one K/M/G suffix is an error, since a misspelt limit silently
// ignored would defeat its purpose.
int64_t env_limit(const char* var) {
  const char* text = std::getenv(var);
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
  RF_CHECK(fits, var, "=", text, " is not a byte count (digits, optionally followed by K, M or G)");
  return static_cast<int64_t>(n) << shift;
}

}  // namespace

int64_t cgroup_memory_headroom(const std::string& proc_cgroup, const std::string& cgroup_mount) {
  std::ifstream list(proc_cgroup);
  std::string line;
  int64_t least = -1;
  // Each line is "hierarchy-id:controllers:path"; v2's unified hierarchy is "0::path".
  while (std::getline(list, line)) {
    const size_t first = line.find(':');
    const size_t second = first == std::string::npos ? first : line.find(':', first + 1);
    if (second == std::string::npos) continue;
    const std::string controllers = line.substr(first + 1, second - first - 1);
    const std::string path = line.substr(second + 1);
    if (path.empty() || path[0] != '/') continue;
    if (line.compare(0, first, "0") == 0 && controllers.empty()) {
      least = least_headroom(least, v2_headroom(cgroup_mount, path));
    } else if (lists_controller(controllers, "memory")) {
      least = least_headroom(least, v1_headroom(cgroup_mount, path));
    }
  }
  return least;
}

int local_ranks() {
  // Open MPI's count of the ranks of this job on this node; other launchers leave it unset.
  const char* s = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  const int n = s ? std::atoi(s) : 1;
  return n >= 1 ? n : 1;
}

int64_t node_available_bytes() {
  int64_t bytes = meminfo_available();
  if (bytes < 0) bytes = static_cast<int64_t>(sysconf(_SC_AVPHYS_PAGES)) * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
  const int64_t cgroup = cgroup_memory_headroom("/proc/self/cgroup", "/sys/fs/cgroup");
  return cgroup >= 0 ? std::min(bytes, cgroup) : bytes;
}

int64_t rank_share_bytes(int64_t node_bytes, int ranks_on_node) {
  const int64_t bytes = node_bytes / std::max(ranks_on_node, 1);
  const int64_t limit = env_limit("RINGFLEX_MEMORY_LIMIT");
  return limit >= 0 ? std::min(bytes, limit) : bytes;
}

int64_t available_memory_bytes() { return rank_share_bytes(node_available_bytes(), local_ranks()); }

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

int64_t available_disk_bytes(const std::string& dir) {
  struct statvfs fs {};
  RF_CHECK(statvfs(dir.c_str(), &fs) == 0, dir,
           ": cannot read the free space of its filesystem: ", std::strerror(errno));
  int64_t bytes = static_cast<int64_t>(fs.f_bavail) * static_cast<int64_t>(fs.f_frsize) / local_ranks();
  const int64_t limit = env_limit("RINGFLEX_DISK_LIMIT");
  return limit >= 0 ? std::min(bytes, limit) : bytes;
}

void check_disk(int64_t bytes, const std::string& dir, const std::string& what) {
  RF_CHECK(bytes >= 0, what, " needs more than 2^63 bytes of disk in ", dir, " (its sizes overflow)");
  const int64_t available = available_disk_bytes(dir);
  RF_CHECK(bytes <= available, what, " needs ", format_bytes(bytes), " of disk per rank in ", dir, ", but only ",
           format_bytes(available), " is free to this rank");
}

}  // namespace rf
