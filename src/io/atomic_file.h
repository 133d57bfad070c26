// ringflex io: files written all or nothing.
//
// Every file the project writes (attn/forward outputs, --stats, --json, --svg, training checkpoints) goes through
// AtomicFile: the bytes go to a temporary file in the destination's own directory (so the final rename stays
// within one filesystem and is atomic), are flushed to the disk with fsync, and only then renamed over the
// destination. A write cut off part way (disk full, a file size limit, a crash, an error thrown) leaves the
// previous file, or no file, in place — never a truncated one — and the temporary is removed.
//
// A job that writes several files commits them together with commit_all: every file is written and fsync'd
// first, and none is renamed unless all of them were, so a failed --stats write does not leave the main output
// behind either.
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <string_view>

namespace rf::io {

class AtomicFile {
 public:
  // Creates the temporary beside `path` (a symbolic link is followed: its target is replaced). Throws rf::Error
  // naming `path` when its directory is missing or not writable, or when `path` exists and is not a regular file
  // (a directory, a device, a FIFO: renaming over those would replace them rather than write into them).
  explicit AtomicFile(const std::string& path);
  ~AtomicFile();  // removes the temporary unless commit() renamed it
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  // Appends bytes; throws rf::Error "<path>: write failed: <reason>" on a short or failed write.
  void write(std::span<const std::byte> bytes);
  void write(std::string_view text) { write(std::as_bytes(std::span<const char>(text.data(), text.size()))); }

  // Flushes the temporary to the disk and closes it (idempotent); throws on failure. The destination is unchanged.
  void finish();
  // finish(), then renames the temporary over the destination and syncs the directory entry.
  void commit();

  const std::string& path() const { return path_; }  // the destination as given

 private:
  void fail(const char* what, int err);  // throws rf::Error naming path_ and strerror(err)

  std::string path_;    // as given (messages)
  std::string target_;  // the file that will be replaced (path_ with a symbolic link resolved)
  std::string temp_;
  int fd_ = -1;
  bool committed_ = false;
};

// Commits several files of one job: finish() on all (any failure throws and renames nothing), then commit() each.
void commit_all(std::span<AtomicFile* const> files);

// Checks that `path` could be written by AtomicFile, without creating it: its directory exists and accepts a new
// file, and `path` is absent or a writable regular file. Throws rf::Error naming `path` and the reason. This is the
// up-front check commands run on every output before computing.
void check_writable(const std::string& path);

// Whether two output names denote one file (equal after resolving links, "." and ".."; or one existing file), so a
// job writing both would overwrite one with the other.
bool same_destination(const std::string& a, const std::string& b);

// Writes all of `bytes` to the descriptor `fd` of the file `path`, retrying short writes and EINTR; returns 0, or the
// errno of the failure (ENOSPC for a write that made no progress). Every file the project writes goes through it
// (AtomicFile, the trainer's metrics file), and so does its fault-injection hook for tests: with
// RINGFLEX_FAIL_WRITE=N[:TEXT] in the environment, the process's N-th call (counted from 1) for a file whose path
// contains TEXT (any file without it) fails with ENOSPC without writing, as on a full disk (DEVELOPERS.md).
int write_all(int fd, const std::string& path, std::span<const std::byte> bytes);

// Writes `text` to `path` atomically (one AtomicFile, committed).
void write_file_atomically(const std::string& path, std::string_view text);

}  // namespace rf::io
