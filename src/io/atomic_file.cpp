// ringflex io: files written all or nothing (see atomic_file.h).
#include "io/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "core/error.h"

namespace rf::io {

namespace {

namespace fs = std::filesystem;

constexpr mode_t kNewFileMode = 0666;  // before the umask, as fopen creates files
constexpr mode_t kPermissionBits = 07777;

// The file a write to `path` replaces: `path` itself, or the target of a symbolic link (renaming over the link
// would replace the link, not the file the user named through it).
std::string resolve_target(const std::string& path) {
  RF_CHECK(!path.empty(), "an output file name is empty");
  std::error_code ec;
  if (!fs::is_symlink(fs::symlink_status(path, ec))) return path;
  const fs::path target = fs::weakly_canonical(path, ec);
  RF_CHECK(!ec, path, ": cannot resolve the symbolic link: ", ec.message());
  return target.string();
}

std::string directory_of(const std::string& target) {
  const fs::path dir = fs::path(target).parent_path();
  return dir.empty() ? std::string(".") : dir.string();
}

// Throws unless `target` is absent or a regular file; returns its permission bits when it exists (the
// replacement keeps them), else -1.
int existing_mode(const std::string& path, const std::string& target) {
  struct stat st {};
  if (::stat(target.c_str(), &st) != 0) {
    RF_CHECK(errno == ENOENT, path, ": cannot write: ", std::strerror(errno));
    return -1;
  }
  RF_CHECK(!S_ISDIR(st.st_mode), path, ": cannot write: it is a directory");
  RF_CHECK(S_ISREG(st.st_mode), path, ": cannot write: it exists and is not a regular file (a device, FIFO or socket)");
  return static_cast<int>(st.st_mode & kPermissionBits);
}

void check_directory(const std::string& path, const std::string& dir) {
  struct stat st {};
  RF_CHECK(::stat(dir.c_str(), &st) == 0, path, ": cannot write: directory ", dir, ": ", std::strerror(errno));
  RF_CHECK(S_ISDIR(st.st_mode), path, ": cannot write: ", dir, " is not a directory");
}

// A fresh name beside the target: hidden, and unique per process and per call so concurrent writers never share one.
std::string temp_name(const std::string& target) {
  static std::atomic<uint64_t> counter{0};
  const fs::path t(target);
  const std::string name = concat(".", t.filename().string(), ".tmp.", ::getpid(), ".", counter.fetch_add(1));
  return (fs::path(directory_of(target)) / name).string();
}

// Creates `temp` exclusively; returns the descriptor or -1 with errno set.
int create_exclusive(const std::string& temp) {
  int fd;
  do {
    fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, kNewFileMode);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

// The fault-injection hook (atomic_file.h): whether this write to `path` is the one RINGFLEX_FAIL_WRITE=N[:TEXT]
// fails. The variable is read once; writes to other files do not count.
bool injected_failure(const std::string& path) {
  struct Hook {
    int64_t n = 0;  // 0: off
    std::string text;
  };
  static const Hook hook = [] {
    Hook h;
    const char* v = std::getenv("RINGFLEX_FAIL_WRITE");
    if (v == nullptr) return h;
    const std::string spec(v);
    h.n = std::strtoll(spec.c_str(), nullptr, 10);
    if (const size_t colon = spec.find(':'); colon != std::string::npos) h.text = spec.substr(colon + 1);
    return h;
  }();
  static std::atomic<int64_t> calls{0};
  if (hook.n <= 0 || path.find(hook.text) == std::string::npos) return false;
  return calls.fetch_add(1) + 1 == hook.n;
}

}  // namespace

int write_all(int fd, const std::string& path, std::span<const std::byte> bytes) {
  if (injected_failure(path)) return ENOSPC;
  const std::byte* p = bytes.data();
  size_t left = bytes.size();
  while (left > 0) {
    const ssize_t n = ::write(fd, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return n < 0 ? errno : ENOSPC;  // 0 bytes written: the device is full
    p += n;
    left -= static_cast<size_t>(n);
  }
  return 0;
}

AtomicFile::AtomicFile(const std::string& path) : path_(path), target_(resolve_target(path)) {
  const int mode = existing_mode(path_, target_);
  check_directory(path_, directory_of(target_));
  temp_ = temp_name(target_);
  fd_ = create_exclusive(temp_);
  if (fd_ < 0) {
    const int err = errno;
    temp_.clear();  // nothing to remove
    fail("cannot create a file in its directory", err);
  }
  if (mode >= 0 && ::fchmod(fd_, static_cast<mode_t>(mode)) != 0) fail("cannot set permissions", errno);
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_ && !temp_.empty()) ::unlink(temp_.c_str());
}

void AtomicFile::fail(const char* what, int err) { rf::fail(path_, ": ", what, ": ", std::strerror(err)); }

void AtomicFile::write(std::span<const std::byte> bytes) {
  RF_CHECK(fd_ >= 0, path_, ": write after the file was finished");
  const int err = write_all(fd_, path_, bytes);
  if (err != 0) fail("write failed", err);
}

void AtomicFile::finish() {
  if (fd_ < 0) return;
  // The data must be on the disk before the rename makes it the file: otherwise a crash after the rename can
  // leave a complete-looking name with missing blocks.
  if (::fsync(fd_) != 0) fail("write failed (fsync)", errno);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) fail("write failed (close)", errno);
}

void AtomicFile::commit() {
  RF_CHECK(!committed_, path_, ": committed twice");
  finish();
  if (::rename(temp_.c_str(), target_.c_str()) != 0) fail("cannot replace the file", errno);
  committed_ = true;
  // Persist the rename itself. A failure here leaves the new file in place and complete, so it is not an error.
  const int dir = ::open(directory_of(target_).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {
    ::fsync(dir);
    ::close(dir);
  }
}

void commit_all(std::span<AtomicFile* const> files) {
  for (AtomicFile* f : files) f->finish();
  for (AtomicFile* f : files) f->commit();
}

void check_writable(const std::string& path) {
  const std::string target = resolve_target(path);
  existing_mode(path, target);
  check_directory(path, directory_of(target));
  // Probe with a real file: permissions, a read-only filesystem and quota limits show up here, not after the work.
  const std::string probe = temp_name(target);
  const int fd = create_exclusive(probe);
  RF_CHECK(fd >= 0, path, ": cannot create a file in ", directory_of(target), ": ", std::strerror(errno));
  ::close(fd);
  ::unlink(probe.c_str());
}

bool same_destination(const std::string& a, const std::string& b) {
  std::error_code ec_a, ec_b;
  if (fs::equivalent(a, b, ec_a)) return true;  // both exist and are one file (hard links included)
  const fs::path ca = fs::weakly_canonical(fs::absolute(a, ec_a), ec_a);
  const fs::path cb = fs::weakly_canonical(fs::absolute(b, ec_b), ec_b);
  return !ec_a && !ec_b && ca == cb;
}

void write_file_atomically(const std::string& path, std::string_view text) {
  AtomicFile f(path);
  f.write(text);
  f.commit();
}

}  // namespace rf::io
