// ringflex io: reading and writing safetensors files, the format Hugging Face uses for tensors and checkpoints.
//
// Layout of a file (https://github.com/huggingface/safetensors):
//     [8 bytes]  N, the header length, unsigned little-endian
//     [N bytes]  a JSON object: name -> {"dtype", "shape", "data_offsets": [begin, end]}, and an optional
//                "__metadata__" object of string -> string; padded with spaces
//     [rest]     the byte buffer; every tensor's bytes are [begin, end) of it, row-major, little-endian
//
// The reader maps the file and validates all of it before handing out a single tensor: a checkpoint or a CLI
// input that is truncated or hand-edited fails at open with one message naming the file and the problem, not
// later as a crash or as silently wrong numbers. Tensors are views into the mapping (no copy of a multi-GB
// checkpoint); their bytes are not necessarily aligned to the element size, so typed access goes through
// tensor_access.h, which copies.
//
// The writer produces what the Python `safetensors` package writes: header keys in sorted order, the header
// padded with spaces so the buffer starts on an 8-byte boundary, and tensor data ordered by element size
// (largest first) then name, so that every tensor starts on a multiple of its own element size.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"

namespace rf::io {

class AtomicFile;

// Every fixed-width element type of the safetensors format. All of them read, write and round-trip as bytes;
// which ones a command accepts is the caller's choice (tensor_access.h). The sub-byte and exotic float
// formats newer safetensors versions add (F4, F6, F8_E8M0, ...) are rejected at open as unknown dtypes.
enum class StDType : uint8_t { BOOL, U8, I8, F8_E5M2, F8_E4M3, I16, U16, F16, BF16, I32, U32, F32, I64, U64, F64 };

size_t element_size(StDType t);
std::string_view dtype_name(StDType t);                     // the spelling in the header, e.g. "BF16"
std::optional<StDType> parse_dtype(std::string_view name);  // nullopt for a name the format does not define

// The attention dtypes of core/dtype.h as safetensors dtypes, and back (nullopt for anything else).
StDType to_st(DType t);
std::optional<DType> to_core(StDType t);

// One tensor of an open file: a view that lives as long as the SafetensorsFile that produced it.
struct TensorView {
  std::string name;
  StDType dtype = StDType::F32;
  std::vector<int64_t> shape;  // row-major; empty for a scalar
  std::span<const std::byte> bytes;

  int64_t numel() const;
  int rank() const { return static_cast<int>(shape.size()); }
};

// Formats a shape as "[2, 8, 128, 64]" for messages.
std::string shape_string(std::span<const int64_t> shape);
// The row-major index of element `flat` of an array of `shape`, formatted as shape_string does: "[1, 0, 3]".
std::string index_string(int64_t flat, std::span<const int64_t> shape);

// A validated, read-only safetensors file. Move-only; the mapping is released on destruction.
class SafetensorsFile {
 public:
  // Maps and validates `path`; throws rf::Error "<path>: <problem>" on any I/O error or malformed content.
  static SafetensorsFile open(const std::string& path);

  // Validates an in-memory image of a file (what `open` maps); `label` names it in messages.
  // The bytes are copied, so the result does not borrow `image`.
  static SafetensorsFile from_bytes(std::span<const std::byte> image, const std::string& label);

  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::vector<TensorView>& tensors() const { return tensors_; }  // sorted by name

  // nullptr when the file has no tensor of that name.
  const TensorView* find(std::string_view name) const;

  // Drops this process's resident pages of the mapping (the views stay valid: a later read faults them in again
  // from the page cache or the file). A job that keeps a file open for a few tensors (io/passthrough.h) calls it
  // after reading what it needed, so the pages it read are not counted in its resident memory for the whole run.
  void release_pages() const;
  // Throws rf::Error "<path>: no tensor `name`" when absent.
  const TensorView& at(std::string_view name) const;

 private:
  struct Storage;
  SafetensorsFile(std::string path, std::unique_ptr<Storage> storage);
  void parse();

  std::string path_;
  std::unique_ptr<Storage> storage_;  // the mapped (or copied) file image
  std::map<std::string, std::string> metadata_;
  std::vector<TensorView> tensors_;
};

// Collects tensors and writes them as one safetensors file. The writer *borrows* each tensor's bytes: they must
// stay alive and unchanged until write() returns (checkpoints are large; copying them to save them would double
// the memory). A tensor whose bytes do not exist yet (a weight gathered from the ranks that hold its shards, or
// converted to another dtype) is added with a fill instead, which write() calls when the tensor's turn comes: the
// writer then holds one such tensor at a time, never a copy of the whole file.
class SafetensorsWriter {
 public:
  // Writes a tensor's bytes into `out` (exactly its byte count). Fills run in the file's data order (data_order()),
  // the same on every rank that builds the same writer, so a fill may be a collective call.
  using Fill = std::function<void(std::span<std::byte> out)>;

  // Throws rf::Error for a duplicate or empty name, a name starting with "__" (reserved for metadata), a
  // negative dimension, or a byte count that does not match shape x element size.
  void add(std::string name, StDType dtype, std::vector<int64_t> shape, std::span<const std::byte> bytes);

  template <typename T>
  void add(std::string name, StDType dtype, std::vector<int64_t> shape, std::span<const T> values) {
    add(std::move(name), dtype, std::move(shape), std::as_bytes(values));
  }

  // A tensor whose bytes `fill` produces while write() runs; the same checks as add().
  void add_fill(std::string name, StDType dtype, std::vector<int64_t> shape, Fill fill);

  void set_metadata(std::string key, std::string value) { metadata_[std::move(key)] = std::move(value); }

  // The tensors' names in the order their bytes lie in the file (and fills run).
  std::vector<std::string> data_order() const;
  // The file's size in bytes (header length, header, buffer), known before anything is written.
  uint64_t file_bytes() const;

  // The complete file image (header length, header, buffer).
  std::vector<std::byte> serialize() const;

  // Writes the file all or nothing (atomic_file.h): the previous file at `path`, if any, stays until the new one
  // is complete on the disk. Throws rf::Error "<path>: <problem>" if it cannot be written completely. A write that
  // fails still runs every fill not yet run before it throws, so that ranks whose fills are collective stay matched.
  void write(const std::string& path) const;
  // Appends the file image to `out` without committing it, for jobs that commit several files together.
  void write(AtomicFile& out) const;
  // Runs every fill in write()'s order and writes nothing: what the other ranks of a collective write run while
  // one rank writes.
  void run_fills() const;

 private:
  std::string header() const;  // the JSON header, space-padded to a multiple of 8 bytes

  struct Entry {
    StDType dtype;
    std::vector<int64_t> shape;
    std::span<const std::byte> bytes;  // borrowed; unused when `fill` is set
    Fill fill;
    uint64_t size = 0;  // bytes: shape x element size
  };
  void check_new(const std::string& name, StDType dtype, const std::vector<int64_t>& shape) const;
  std::map<std::string, Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace rf::io
