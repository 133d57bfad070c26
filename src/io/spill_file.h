// ringflex io: a run's spill file, where the training forward's kept activations wait on disk for the backward.
//
// The backward reads back what the forward kept of each layer, last layer first; held in memory, those bytes grow
// with the row and are most of a long row's need. A SpillFile moves them to a file in a directory the user names
// (train.spill_dir): an unnamed file (created and unlinked at once, so the kernel removes it when the run ends, is
// killed or throws), its whole size reserved on disk up front with posix_fallocate, so a disk without room fails
// at the start with one error line rather than part way. Each block is written through a shared memory mapping of
// its own page-aligned region, then unmapped (its pages leave this process's resident set and go to the page
// cache, written back by the kernel); read() maps the region, copies it out and drops its cached pages; prefetch()
// asks the kernel to read a region ahead (posix_fadvise WILLNEED) while the caller computes. Never swap: the pages
// are the file's, reclaimed by writing them back to it.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace rf::io {

class SpillFile {
 public:
  // A region of the file: its byte offset (a multiple of the page size) and length.
  struct Region {
    int64_t offset = 0;
    int64_t bytes = 0;
  };

  // Page-aligned bytes a block of `bytes` takes in the file (what the disk must hold for it).
  static int64_t block_bytes(int64_t bytes);

  // An unnamed file in `dir` with `capacity` bytes reserved. Throws rf::Error naming `dir` when it is missing, not
  // writable, or has not the room ("no space left on device").
  SpillFile(const std::string& dir, int64_t capacity);
  ~SpillFile();  // closes the file: the kernel frees its blocks
  SpillFile(const SpillFile&) = delete;
  SpillFile& operator=(const SpillFile&) = delete;

  // Copies the arrays `parts`, one after another, into the next free region; throws when they pass the reserved
  // capacity.
  Region write(const std::vector<std::span<const float>>& parts);
  // Starts reading `r` into the page cache without waiting.
  void prefetch(Region r) const;
  // Copies `r` back into `parts` (the sizes it was written with), then frees the region's blocks and cached pages:
  // each region is read once.
  void read(Region r, const std::vector<std::span<float>>& parts) const;

  int64_t capacity() const { return capacity_; }
  int64_t used() const { return used_; }

 private:
  std::string dir_;
  int fd_ = -1;
  int64_t capacity_ = 0;
  int64_t used_ = 0;
};

}  // namespace rf::io
