// ringflex io: safetensors reading (map + validate everything up front) and writing (the layout Python's
// `safetensors` writes). See safetensors.h for the format.
#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <nlohmann/json.hpp>
#include <optional>
#include <vector>

#include "core/error.h"
#include "io/atomic_file.h"
#include "io/json_text.h"

namespace rf::io {

// The format stores integers and tensor bytes little-endian; this code hands those bytes out unconverted.
static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes a little-endian host");

namespace {

using nlohmann::json;

constexpr size_t kLengthBytes = 8;                 // the u64 header length that starts every file
constexpr uint64_t kMaxHeaderBytes = 100'000'000;  // the Python package's own limit; a larger N is corruption
constexpr size_t kBufferAlignment = 8;             // the header is space-padded so the buffer starts 8-aligned
constexpr std::string_view kMetadataKey = "__metadata__";

struct DTypeInfo {
  StDType type;
  std::string_view name;
  size_t size;
};

constexpr std::array<DTypeInfo, 15> kDTypes{{
    {StDType::BOOL, "BOOL", 1},
    {StDType::U8, "U8", 1},
    {StDType::I8, "I8", 1},
    {StDType::F8_E5M2, "F8_E5M2", 1},
    {StDType::F8_E4M3, "F8_E4M3", 1},
    {StDType::I16, "I16", 2},
    {StDType::U16, "U16", 2},
    {StDType::F16, "F16", 2},
    {StDType::BF16, "BF16", 2},
    {StDType::I32, "I32", 4},
    {StDType::U32, "U32", 4},
    {StDType::F32, "F32", 4},
    {StDType::I64, "I64", 8},
    {StDType::U64, "U64", 8},
    {StDType::F64, "F64", 8},
}};

const DTypeInfo& info(StDType t) { return kDTypes[static_cast<size_t>(t)]; }

// Element count of `shape` times `element`, or nullopt when it overflows 64 bits (a corrupt shape).
std::optional<uint64_t> byte_count(std::span<const int64_t> shape, size_t element) {
  uint64_t bytes = element;
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(d), &bytes)) return std::nullopt;
  }
  return bytes;
}

uint64_t read_u64_le(const std::byte* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Reads a JSON array of non-negative integers; nullopt when `j` is anything else.
std::optional<std::vector<int64_t>> unsigned_array(const json& j) {
  if (!j.is_array()) return std::nullopt;
  std::vector<int64_t> out;
  for (const json& e : j) {
    if (!e.is_number_unsigned() || e.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) return std::nullopt;
    out.push_back(e.get<int64_t>());
  }
  return out;
}

}  // namespace

size_t element_size(StDType t) { return info(t).size; }
std::string_view dtype_name(StDType t) { return info(t).name; }

std::optional<StDType> parse_dtype(std::string_view name) {
  for (const DTypeInfo& d : kDTypes)
    if (d.name == name) return d.type;
  return std::nullopt;
}

StDType to_st(DType t) { return t == DType::F32 ? StDType::F32 : StDType::BF16; }

std::optional<DType> to_core(StDType t) {
  if (t == StDType::F32) return DType::F32;
  if (t == StDType::BF16) return DType::BF16;
  return std::nullopt;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string shape_string(std::span<const int64_t> shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string index_string(int64_t flat, std::span<const int64_t> shape) {
  std::vector<int64_t> index(shape.size());
  for (size_t a = shape.size(); a-- > 0;) {
    index[a] = shape[a] > 0 ? flat % shape[a] : 0;
    flat = shape[a] > 0 ? flat / shape[a] : 0;
  }
  return shape_string(index);
}

// ---------------------------------------------------------------------------------------------------------------
// Reading
// ---------------------------------------------------------------------------------------------------------------

// The file image: a read-only private mapping (the page cache serves it; nothing is copied), or an owned copy.
struct SafetensorsFile::Storage {
  const std::byte* data = nullptr;
  size_t size = 0;
  void* mapping = nullptr;
  std::vector<std::byte> copy;

  Storage() = default;
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  ~Storage() {
    if (mapping) munmap(mapping, size);
  }
};

SafetensorsFile::SafetensorsFile(std::string path, std::unique_ptr<Storage> storage)
    : path_(std::move(path)), storage_(std::move(storage)) {}
SafetensorsFile::SafetensorsFile(SafetensorsFile&&) noexcept = default;
SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&&) noexcept = default;
SafetensorsFile::~SafetensorsFile() = default;

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  // O_NONBLOCK: opening a FIFO (or a device) for reading would otherwise wait for a writer forever; with it the
  // open returns at once and the S_ISREG check below names the problem. It changes nothing for regular files.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  RF_CHECK(fd >= 0, path, ": cannot open: ", std::strerror(errno));
  auto storage = std::make_unique<Storage>();
  struct stat st {};
  const bool stat_ok = fstat(fd, &st) == 0;
  const int stat_errno = errno;
  if (stat_ok && S_ISREG(st.st_mode) && st.st_size > 0) {
    storage->size = static_cast<size_t>(st.st_size);
    void* m = mmap(nullptr, storage->size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m != MAP_FAILED) {
      storage->mapping = m;
      storage->data = static_cast<const std::byte*>(m);
    }
  }
  const int map_errno = errno;
  ::close(fd);
  RF_CHECK(stat_ok, path, ": cannot stat: ", std::strerror(stat_errno));
  RF_CHECK(S_ISREG(st.st_mode), path,
           ": not a regular file (a FIFO, device or directory cannot be read as safetensors)");
  RF_CHECK(st.st_size == 0 || storage->mapping, path, ": cannot map: ", std::strerror(map_errno));
  SafetensorsFile f(path, std::move(storage));
  f.parse();
  return f;
}

SafetensorsFile SafetensorsFile::from_bytes(std::span<const std::byte> image, const std::string& label) {
  auto storage = std::make_unique<Storage>();
  storage->copy.assign(image.begin(), image.end());
  storage->data = storage->copy.data();
  storage->size = storage->copy.size();
  SafetensorsFile f(label, std::move(storage));
  f.parse();
  return f;
}

void SafetensorsFile::parse() {
  const std::string where = path_ + ": not a valid safetensors file: ";
  const std::byte* data = storage_->data;
  const uint64_t size = storage_->size;

  RF_CHECK(size >= kLengthBytes, where, "it is ", size, " bytes long, shorter than the ", kLengthBytes,
           "-byte header length");
  const uint64_t header_bytes = read_u64_le(data);
  RF_CHECK(header_bytes <= size - kLengthBytes, where, "the header length ", header_bytes, " exceeds the ",
           size - kLengthBytes, " bytes that follow it");
  RF_CHECK(header_bytes <= kMaxHeaderBytes, where, "the header length ", header_bytes,
           " exceeds the format's limit of ", kMaxHeaderBytes);
  const char* header = reinterpret_cast<const char*>(data + kLengthBytes);
  const std::byte* buffer = data + kLengthBytes + header_bytes;
  const uint64_t buffer_bytes = size - kLengthBytes - header_bytes;

  check_json_text(std::string_view(header, header_bytes), where + "the header: ");
  std::string duplicate;  // a file naming one tensor twice: two readers would disagree on which bytes it is
  json root;
  try {
    root = parse_tracking_duplicates(std::string_view(header, header_bytes), &duplicate);
  } catch (const json::parse_error& e) {
    fail(where, "the header is not valid JSON (at byte ", e.byte, " of ", header_bytes, ")");
  }
  RF_CHECK(duplicate.empty(), where, "the key `", duplicate, "` appears twice in the header");
  RF_CHECK(root.is_object(), where, "the header is not a JSON object");

  for (const auto& [name, entry] : root.items()) {
    if (name == kMetadataKey) {
      RF_CHECK(entry.is_object(), where, "`", kMetadataKey, "` is not an object");
      for (const auto& [key, value] : entry.items()) {
        RF_CHECK(value.is_string(), where, "`", kMetadataKey, "` entry `", key, "` is not a string");
        metadata_[key] = value.get<std::string>();
      }
      continue;
    }
    const std::string t = "tensor `" + name + "`: ";
    RF_CHECK(entry.is_object(), where, t, "its entry is not an object");
    RF_CHECK(entry.contains("dtype") && entry["dtype"].is_string(), where, t, "no `dtype` string");
    const std::string dtype_text = entry["dtype"].get<std::string>();
    const std::optional<StDType> dtype = parse_dtype(dtype_text);
    RF_CHECK(dtype.has_value(), where, t, "unknown dtype `", dtype_text, "`");
    RF_CHECK(entry.contains("shape"), where, t, "no `shape`");
    const std::optional<std::vector<int64_t>> shape = unsigned_array(entry["shape"]);
    RF_CHECK(shape.has_value(), where, t, "`shape` is not an array of non-negative integers");
    RF_CHECK(entry.contains("data_offsets"), where, t, "no `data_offsets`");
    const std::optional<std::vector<int64_t>> offsets = unsigned_array(entry["data_offsets"]);
    RF_CHECK(offsets.has_value() && offsets->size() == 2, where, t,
             "`data_offsets` is not a pair of non-negative integers");
    const uint64_t begin = static_cast<uint64_t>((*offsets)[0]), end = static_cast<uint64_t>((*offsets)[1]);
    RF_CHECK(begin <= end, where, t, "data_offsets [", begin, ", ", end, "] are reversed");
    RF_CHECK(end <= buffer_bytes, where, t, "data_offsets [", begin, ", ", end, "] run past the end of the ",
             buffer_bytes, "-byte data buffer");
    const std::optional<uint64_t> need = byte_count(*shape, element_size(*dtype));
    RF_CHECK(need.has_value() && *need == end - begin, where, t, "shape ", shape_string(*shape), " of ", dtype_text,
             " needs ", need ? std::to_string(*need) : std::string("more than 2^64"), " bytes but data_offsets [",
             begin, ", ", end, "] hold ", end - begin);
    tensors_.push_back(TensorView{name, *dtype, *shape, std::span(buffer + begin, end - begin)});
  }

  // The tensors must tile the buffer exactly: no byte shared by two tensors, none left unowned.
  std::vector<const TensorView*> by_offset;
  for (const TensorView& v : tensors_) by_offset.push_back(&v);
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorView* a, const TensorView* b) {
    return std::pair(a->bytes.data(), a->bytes.size()) < std::pair(b->bytes.data(), b->bytes.size());
  });
  uint64_t covered = 0;
  const TensorView* previous = nullptr;
  for (const TensorView* v : by_offset) {
    const uint64_t begin = static_cast<uint64_t>(v->bytes.data() - buffer);
    RF_CHECK(begin >= covered, where, "tensors `", previous ? previous->name : "", "` and `", v->name,
             "` overlap in the data buffer");
    RF_CHECK(begin == covered, where, "bytes [", covered, ", ", begin, ") of the data buffer belong to no tensor");
    covered = begin + v->bytes.size();
    previous = v;
  }
  RF_CHECK(covered == buffer_bytes, where, "the last ", buffer_bytes - covered,
           " bytes of the data buffer belong to no tensor");
  // items() walks a std::map, so tensors_ is already sorted by name, which find() relies on.
}

const TensorView* SafetensorsFile::find(std::string_view name) const {
  const auto it = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                                   [](const TensorView& v, std::string_view n) { return v.name < n; });
  return it != tensors_.end() && it->name == name ? &*it : nullptr;
}

void SafetensorsFile::release_pages() const {
  // Advice only: on a read-only private mapping MADV_DONTNEED discards nothing that cannot be read again, and a
  // failure leaves the pages resident, which is what not calling it does.
  if (storage_->mapping) madvise(storage_->mapping, storage_->size, MADV_DONTNEED);
}

const TensorView& SafetensorsFile::at(std::string_view name) const {
  const TensorView* v = find(name);
  RF_CHECK(v, path_, ": no tensor `", name, "`");
  return *v;
}

// ---------------------------------------------------------------------------------------------------------------
// Writing
// ---------------------------------------------------------------------------------------------------------------

void SafetensorsWriter::check_new(const std::string& name, StDType dtype, const std::vector<int64_t>& shape) const {
  RF_CHECK(!name.empty(), "safetensors: a tensor needs a name");
  RF_CHECK(!name.starts_with("__"), "safetensors: tensor name `", name, "` is reserved (starts with \"__\")");
  RF_CHECK(!entries_.contains(name), "safetensors: tensor `", name, "` added twice");
  for (int64_t d : shape) RF_CHECK(d >= 0, "safetensors: tensor `", name, "` has negative shape ", shape_string(shape));
  RF_CHECK(byte_count(shape, element_size(dtype)), "safetensors: tensor `", name, "` of shape ", shape_string(shape),
           " ", dtype_name(dtype), " has more bytes than a file can hold");
}

void SafetensorsWriter::add(std::string name, StDType dtype, std::vector<int64_t> shape,
                            std::span<const std::byte> bytes) {
  check_new(name, dtype, shape);
  const uint64_t need = *byte_count(shape, element_size(dtype));
  RF_CHECK(need == bytes.size(), "safetensors: tensor `", name, "` of shape ", shape_string(shape), " ",
           dtype_name(dtype), " needs ", need, " bytes but was given ", bytes.size());
  entries_.emplace(std::move(name), Entry{dtype, std::move(shape), bytes, {}, need});
}

void SafetensorsWriter::add_fill(std::string name, StDType dtype, std::vector<int64_t> shape, Fill fill) {
  check_new(name, dtype, shape);
  RF_CHECK(fill, "safetensors: tensor `", name, "` has no fill");
  const uint64_t need = *byte_count(shape, element_size(dtype));
  entries_.emplace(std::move(name), Entry{dtype, std::move(shape), {}, std::move(fill), need});
}

namespace {

// The data order: larger elements first, then by name. The buffer starts 8-aligned and every size is a power
// of two <= 8, so each tensor then starts on a multiple of its element size and a mapping reader can use it
// in place. (Python's writer sorts by dtype, largest first, to the same end.)
template <typename Entries>
auto entries_in_data_order(const Entries& entries) {
  std::vector<typename Entries::const_pointer> order;
  for (const auto& e : entries) order.push_back(&e);
  std::stable_sort(order.begin(), order.end(),
                   [](auto a, auto b) { return element_size(a->second.dtype) > element_size(b->second.dtype); });
  return order;
}

}  // namespace

std::vector<std::string> SafetensorsWriter::data_order() const {
  std::vector<std::string> out;
  for (const auto* e : entries_in_data_order(entries_)) out.push_back(e->first);
  return out;
}

uint64_t SafetensorsWriter::file_bytes() const {
  uint64_t total = kLengthBytes + header().size();
  for (const auto& [name, e] : entries_) total += e.size;
  return total;
}

std::string SafetensorsWriter::header() const {
  json j = json::object();
  if (!metadata_.empty()) j[std::string(kMetadataKey)] = metadata_;
  uint64_t offset = 0;
  for (const auto* e : entries_in_data_order(entries_)) {
    const Entry& t = e->second;
    j[e->first] = {{"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.size}}};
    offset += t.size;
  }
  // json objects are std::maps, so dump() writes the keys sorted, as Python's writer does.
  std::string text = j.dump();
  text.append((kBufferAlignment - text.size() % kBufferAlignment) % kBufferAlignment, ' ');
  return text;
}

std::vector<std::byte> SafetensorsWriter::serialize() const {
  const std::string text = header();
  const auto order = entries_in_data_order(entries_);
  size_t total = kLengthBytes + text.size();
  for (const auto* e : order) total += e->second.size;
  std::vector<std::byte> image(total);
  const uint64_t n = text.size();
  std::memcpy(image.data(), &n, kLengthBytes);
  std::memcpy(image.data() + kLengthBytes, text.data(), text.size());
  size_t at = kLengthBytes + text.size();
  for (const auto* e : order) {
    const Entry& t = e->second;
    if (t.fill)
      t.fill(std::span<std::byte>(image.data() + at, t.size));
    else if (!t.bytes.empty())
      std::memcpy(image.data() + at, t.bytes.data(), t.bytes.size());
    at += t.size;
  }
  return image;
}

void SafetensorsWriter::write(AtomicFile& out) const {
  // Streamed piece by piece from the borrowed buffers and one filled tensor at a time, so saving a checkpoint needs
  // no second copy of it. After a failed write the remaining fills still run (their bytes dropped) before the error
  // is thrown: a fill may be a collective the other ranks are waiting in.
  std::exception_ptr failed;
  const auto put = [&](std::span<const std::byte> bytes) {
    if (failed) return;
    try {
      out.write(bytes);
    } catch (...) {
      failed = std::current_exception();
    }
  };
  const std::string text = header();
  const uint64_t n = text.size();
  put(std::as_bytes(std::span<const uint64_t>(&n, 1)));
  put(std::as_bytes(std::span<const char>(text.data(), text.size())));
  std::vector<std::byte> staging;  // one filled tensor at a time (its capacity: the largest so far)
  for (const auto* e : entries_in_data_order(entries_)) {
    const Entry& t = e->second;
    if (!t.fill) {
      put(t.bytes);
      continue;
    }
    staging.resize(t.size);
    t.fill(staging);
    put(staging);
  }
  if (failed) std::rethrow_exception(failed);
}

void SafetensorsWriter::run_fills() const {
  std::vector<std::byte> staging;
  for (const auto* e : entries_in_data_order(entries_)) {
    if (!e->second.fill) continue;
    staging.resize(e->second.size);
    e->second.fill(staging);
  }
}

void SafetensorsWriter::write(const std::string& path) const {
  std::optional<AtomicFile> out;
  try {
    out.emplace(path);
  } catch (...) {
    run_fills();  // a file that cannot even be created: the fills still run, as after any failed write
    throw;
  }
  write(*out);
  out->commit();
}

}  // namespace rf::io
