// ringflex io: the spill file (spill_file.h).
#include "io/spill_file.h"

#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/memory.h"

namespace rf::io {

namespace {

int64_t page_bytes() { return static_cast<int64_t>(sysconf(_SC_PAGESIZE)); }

// A shared mapping of one region, unmapped when it goes.
class Mapping {
 public:
  Mapping(int fd, SpillFile::Region r, int prot, const std::string& dir) : bytes_(r.bytes) {
    if (bytes_ == 0) return;
    addr_ = mmap(nullptr, static_cast<size_t>(bytes_), prot, MAP_SHARED, fd, static_cast<off_t>(r.offset));
    RF_CHECK(addr_ != MAP_FAILED, dir, ": the spill file cannot be mapped: ", std::strerror(errno));
  }
  ~Mapping() {
    if (bytes_ > 0 && addr_ != MAP_FAILED) munmap(addr_, static_cast<size_t>(bytes_));
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  void* data() const { return addr_; }

 private:
  void* addr_ = MAP_FAILED;
  int64_t bytes_ = 0;
};

}  // namespace

int64_t SpillFile::block_bytes(int64_t bytes) {
  const int64_t page = page_bytes();
  return (bytes + page - 1) / page * page;
}

SpillFile::SpillFile(const std::string& dir, int64_t capacity) : dir_(dir), capacity_(capacity) {
  RF_CHECK(capacity >= 0, dir, ": a spill file of ", capacity, " bytes");
  std::string name = dir + "/ringflex-spill-XXXXXX";
  std::vector<char> path(name.begin(), name.end());
  path.push_back('\0');
  fd_ = mkstemp(path.data());
  RF_CHECK(fd_ >= 0, dir, ": cannot create the spill file (train.spill_dir): ", std::strerror(errno));
  // Unnamed from now on: the kernel frees its blocks when the descriptor closes, however the run ends.
  unlink(path.data());
  if (capacity == 0) return;
  const int err = posix_fallocate(fd_, 0, static_cast<off_t>(capacity));
  if (err != 0) {
    close(fd_);
    fd_ = -1;
    RF_CHECK(false, dir, ": no room for the spill file (train.spill_dir): the run's kept activations need ",
             format_bytes(capacity), " of disk on this rank: ", std::strerror(err));
  }
}

SpillFile::~SpillFile() {
  if (fd_ >= 0) close(fd_);
}

SpillFile::Region SpillFile::write(const std::vector<std::span<const float>>& parts) {
  int64_t bytes = 0;
  for (const std::span<const float>& p : parts) bytes += static_cast<int64_t>(p.size_bytes());
  const Region r{used_, bytes};
  RF_CHECK(bytes >= 0 && used_ + block_bytes(bytes) <= capacity_, dir_, ": the spill file's ", format_bytes(capacity_),
           " cannot take ", format_bytes(bytes), " more past ", format_bytes(used_));
  {
    const Mapping map(fd_, r, PROT_WRITE, dir_);
    auto* at = static_cast<std::byte*>(map.data());
    for (const std::span<const float>& p : parts) {
      if (p.empty()) continue;
      std::memcpy(at, p.data(), p.size_bytes());
      at += p.size_bytes();
    }
  }
  used_ += block_bytes(bytes);
  return r;
}

void SpillFile::prefetch(Region r) const {
  if (r.bytes > 0) posix_fadvise(fd_, static_cast<off_t>(r.offset), static_cast<off_t>(r.bytes), POSIX_FADV_WILLNEED);
}

void SpillFile::read(Region r, const std::vector<std::span<float>>& parts) const {
  int64_t bytes = 0;
  for (const std::span<float>& p : parts) bytes += static_cast<int64_t>(p.size_bytes());
  RF_CHECK(bytes == r.bytes, dir_, ": reading ", bytes, " bytes from a spill region of ", r.bytes);
  if (r.bytes == 0) return;
  {
    const Mapping map(fd_, r, PROT_READ, dir_);
    const auto* at = static_cast<const std::byte*>(map.data());
    for (const std::span<float>& p : parts) {
      if (p.empty()) continue;
      std::memcpy(p.data(), at, p.size_bytes());
      at += p.size_bytes();
    }
  }
  // Read once: the region's blocks and cached pages are of no more use. Punching them out frees both at once, and
  // pages still dirty (a layer written late in the forward, read early in the backward) are never written back.
  const off_t at = static_cast<off_t>(r.offset), len = static_cast<off_t>(block_bytes(r.bytes));
  if (fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, at, len) != 0)
    posix_fadvise(fd_, at, len, POSIX_FADV_DONTNEED);  // a filesystem without holes: at least drop the clean pages
}

}  // namespace rf::io
