// ringflex io: tensors a job carries from the checkpoint it read into every checkpoint it writes, bit for bit.
//
// A Gemma 4 checkpoint holds more than ringflex trains: the vision and audio towers, their embedders, names a newer
// release adds. Each such tensor is kept as its name, dtype, shape and bytes, never widened or converted, and
// writing adds it to a SafetensorsWriter as it is, so the written checkpoint holds everything its config describes.
// The bytes are either borrowed from the source files (the mapped shards; a Passthrough keeps them open, so nothing
// of a multi-GB tower is read until it is written) or owned (tensors ringflex makes itself, such as the vision tower
// of a built-in model).
//
// Borrowed bytes are a read-only private mapping of the source file. Deleting or renaming that file while the job
// runs is safe (the mapping keeps the old file's pages: keep-last-K may delete the checkpoint a run resumed from);
// rewriting it in place is not, as for any mapped file, and ringflex never does (every file it writes is replaced
// whole, io/atomic_file.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "io/checkpoint.h"
#include "io/safetensors.h"

namespace rf::io {

class Passthrough {
 public:
  struct Entry {
    std::string name;
    StDType dtype = StDType::F32;
    std::vector<int64_t> shape;
    std::span<const std::byte> bytes;  // borrowed from a source file or from an owned buffer of this Passthrough
  };

  // Keeps tensor `name` of `files` (it must be there; throws rf::Error naming the checkpoint otherwise).
  void borrow(const std::shared_ptr<const Checkpoint>& files, std::string_view name);
  // Keeps a tensor that no file holds. Throws rf::Error when the bytes are not shape x element size.
  void own(std::string name, StDType dtype, std::vector<int64_t> shape, std::vector<std::byte> bytes);

  // Stops carrying tensor `name` (a tensor the job now holds and writes itself, such as the vision tower's parameters
  // under model.train_vision); no-op when it is not kept. The bytes stay alive with the Passthrough.
  void drop(std::string_view name);

  // In the order added; names are unique (a second entry of one name throws rf::Error).
  const std::vector<Entry>& entries() const { return entries_; }
  const Entry* find(std::string_view name) const;  // nullptr when not kept
  bool empty() const { return entries_.empty(); }
  size_t size() const { return entries_.size(); }

  // Drops the resident pages of the borrowed files (SafetensorsFile::release_pages): after the load that read the
  // rest of them, and after each write that read the kept tensors, so that carrying a tower costs no resident memory
  // between saves.
  void release_pages() const;

 private:
  void add(Entry e);

  std::vector<Entry> entries_;
  std::map<std::string, size_t, std::less<>> index_;                  // name -> position in entries_
  std::vector<std::shared_ptr<const Checkpoint>> sources_;            // the files borrowed entries point into
  std::vector<std::shared_ptr<const std::vector<std::byte>>> owned_;  // owned entries' bytes (stable addresses)
};

}  // namespace rf::io
