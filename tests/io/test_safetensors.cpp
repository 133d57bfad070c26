// Tests of src/io: the safetensors round trip for every dtype, the layout Python's writer produces, one test per
// kind of corruption (each must be rejected with a message naming the file and the problem), and the typed
// accessors. The oracle is the bytes and shapes the test wrote, and hand-built file images.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>

#include "common/error_of.h"
#include "core/error.h"
#include "io/json_text.h"
#include "io/safetensors.h"
#include "io/tensor_access.h"

namespace rf::io {
namespace {

using rf::testing::error_of;

constexpr StDType kAllDTypes[] = {StDType::BOOL, StDType::U8,  StDType::I8,  StDType::F8_E5M2, StDType::F8_E4M3,
                                  StDType::I16,  StDType::U16, StDType::F16, StDType::BF16,    StDType::I32,
                                  StDType::U32,  StDType::F32, StDType::I64, StDType::U64,     StDType::F64};

// Distinct, non-repeating bytes so a tensor read from the wrong offset cannot pass.
std::vector<std::byte> pattern(size_t n, int seed) {
  std::vector<std::byte> b(n);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<std::byte>((i * 131 + static_cast<size_t>(seed) * 17 + 7) & 0xff);
  return b;
}

#define EXPECT_ERROR_HAS(expr, text)                                                        \
  do {                                                                                      \
    const std::string message_ = error_of([&] { (void)(expr); });                           \
    EXPECT_NE(message_.find(text), std::string::npos)                                       \
        << "expected an error containing \"" << (text) << "\", got \"" << message_ << "\""; \
  } while (0)

// A file image from a header text and a data buffer, with the length field set to `header.size()` unless given.
std::vector<std::byte> image(const std::string& header, size_t buffer_bytes,
                             std::optional<uint64_t> length = std::nullopt) {
  const uint64_t n = length.value_or(header.size());
  std::vector<std::byte> out(8 + header.size() + buffer_bytes, std::byte{0});
  std::memcpy(out.data(), &n, 8);
  std::memcpy(out.data() + 8, header.data(), header.size());
  return out;
}

SafetensorsFile open_image(const std::vector<std::byte>& img) {
  return SafetensorsFile::from_bytes(img, "bad.safetensors");
}

TEST(Safetensors, RoundTripsEveryDTypeAndShape) {
  std::vector<std::vector<std::byte>> data;
  std::vector<std::vector<int64_t>> shapes;
  SafetensorsWriter w;
  int i = 0;
  for (StDType t : kAllDTypes) {
    // Odd sizes so that a 1-byte tensor sorted before an 8-byte one would misalign it if the writer got the
    // order wrong; plus a scalar and an empty tensor of the same dtype.
    shapes.push_back({3, 1, 5});
    shapes.push_back({});
    shapes.push_back({2, 0});
    for (int j = 0; j < 3; ++j) {
      const std::vector<int64_t>& s = shapes[shapes.size() - 3 + j];
      const int64_t n = std::accumulate(s.begin(), s.end(), int64_t{1}, std::multiplies<>());
      data.push_back(pattern(static_cast<size_t>(n) * element_size(t), i * 3 + j));
    }
    ++i;
  }
  for (size_t k = 0; k < data.size(); ++k) {
    const StDType t = kAllDTypes[k / 3];
    w.add(std::string(dtype_name(t)) + "_" + std::to_string(k % 3), t, shapes[k], std::span<const std::byte>(data[k]));
  }
  w.set_metadata("format", "pt");
  w.set_metadata("note", "ringflex test");

  const std::string path = (std::filesystem::temp_directory_path() / "rf_io_roundtrip.safetensors").string();
  w.write(path);
  for (const SafetensorsFile& f : {SafetensorsFile::open(path), SafetensorsFile::from_bytes(w.serialize(), "mem")}) {
    ASSERT_EQ(f.tensors().size(), data.size());
    EXPECT_EQ(f.metadata().at("format"), "pt");
    EXPECT_EQ(f.metadata().at("note"), "ringflex test");
    for (size_t k = 0; k < data.size(); ++k) {
      const StDType t = kAllDTypes[k / 3];
      const TensorView& v = f.at(std::string(dtype_name(t)) + "_" + std::to_string(k % 3));
      EXPECT_EQ(v.dtype, t);
      EXPECT_EQ(v.shape, shapes[k]);
      ASSERT_EQ(v.bytes.size(), data[k].size());
      EXPECT_TRUE(std::equal(v.bytes.begin(), v.bytes.end(), data[k].begin())) << v.name;
    }
  }
  std::filesystem::remove(path);
}

TEST(Safetensors, WritesTheLayoutPythonWrites) {
  const std::vector<uint8_t> small(3, 1);
  const std::vector<double> wide(2, 2.0);
  const std::vector<bf16> half(1, bf16{0x3f80});
  SafetensorsWriter w;
  w.add("a_small", StDType::U8, {3}, std::span<const uint8_t>(small));
  w.add("b_half", StDType::BF16, {1}, std::span<const bf16>(half));
  w.add("c_wide", StDType::F64, {2}, std::span<const double>(wide));
  const std::vector<std::byte> img = w.serialize();
  uint64_t n;
  std::memcpy(&n, img.data(), 8);
  EXPECT_EQ(n % 8, 0u) << "the header is padded so that the buffer starts 8-aligned";
  const std::string header(reinterpret_cast<const char*>(img.data()) + 8, n);
  EXPECT_EQ(header.substr(header.rfind('}') + 1).find_first_not_of(' '), std::string::npos) << "padding is spaces";
  const auto j = nlohmann::json::parse(header);
  // Largest elements first: F64 at 0, BF16 at 16, U8 at 18, each at a multiple of its element size.
  EXPECT_EQ(j["c_wide"]["data_offsets"], nlohmann::json({0, 16}));
  EXPECT_EQ(j["b_half"]["data_offsets"], nlohmann::json({16, 18}));
  EXPECT_EQ(j["a_small"]["data_offsets"], nlohmann::json({18, 21}));
  EXPECT_FALSE(j.contains("__metadata__")) << "no empty metadata object";
  EXPECT_LT(header.find("a_small"), header.find("b_half")) << "keys are written sorted";
  EXPECT_LT(header.find("b_half"), header.find("c_wide"));
}

// A filled tensor's bytes are made while the file is written (one at a time, in the data order), and the file is
// the one the same bytes added whole would give. A write that cannot happen still runs every fill (a fill may be a
// collective other ranks wait in) before it throws.
TEST(Safetensors, FillsRunInDataOrderAndMatchBorrowedBytes) {
  const std::vector<std::byte> a = pattern(12, 1), b = pattern(6, 2), c = pattern(8, 3);
  SafetensorsWriter whole;
  whole.add("a", StDType::F32, {3}, std::span<const std::byte>(a));
  whole.add("b", StDType::U16, {3}, std::span<const std::byte>(b));
  whole.add("c", StDType::F64, {1}, std::span<const std::byte>(c));
  std::vector<std::string> filled;
  const auto fill_with = [&](const std::string& name, const std::vector<std::byte>& bytes) {
    return [&filled, name, &bytes](std::span<std::byte> out) {
      ASSERT_EQ(out.size(), bytes.size());
      std::memcpy(out.data(), bytes.data(), bytes.size());
      filled.push_back(name);
    };
  };
  SafetensorsWriter lazy;
  lazy.add_fill("a", StDType::F32, {3}, fill_with("a", a));
  lazy.add("b", StDType::U16, {3}, std::span<const std::byte>(b));
  lazy.add_fill("c", StDType::F64, {1}, fill_with("c", c));
  EXPECT_EQ(lazy.data_order(), (std::vector<std::string>{"c", "a", "b"})) << "largest elements first, then by name";
  EXPECT_EQ(lazy.serialize(), whole.serialize());
  EXPECT_EQ(filled, (std::vector<std::string>{"c", "a"}));
  EXPECT_EQ(lazy.file_bytes(), whole.serialize().size());

  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "rf_io_fills_missing_dir";
  std::filesystem::remove_all(dir);
  filled.clear();
  EXPECT_ERROR_HAS(lazy.write((dir / "x.safetensors").string()), "rf_io_fills_missing_dir");
  EXPECT_EQ(filled, (std::vector<std::string>{"c", "a"})) << "the fills ran although nothing could be written";
  filled.clear();
  lazy.run_fills();
  EXPECT_EQ(filled, (std::vector<std::string>{"c", "a"}));
}

TEST(Safetensors, WriterRejectsBadTensors) {
  const std::vector<float> four(4);
  SafetensorsWriter w;
  w.add("x", StDType::F32, {4}, std::span<const float>(four));
  EXPECT_ERROR_HAS(w.add("x", StDType::F32, {4}, std::span<const float>(four)), "`x` added twice");
  EXPECT_ERROR_HAS(w.add("y", StDType::F32, {3}, std::span<const float>(four)), "needs 12 bytes but was given 16");
  EXPECT_ERROR_HAS(w.add("z", StDType::F32, {-1, -4}, std::span<const float>(four)), "negative shape");
  EXPECT_ERROR_HAS(w.add("__metadata__", StDType::F32, {4}, std::span<const float>(four)), "reserved");
  EXPECT_ERROR_HAS(w.write("/nonexistent-dir/x.safetensors"),
                   "/nonexistent-dir/x.safetensors: cannot write: directory /nonexistent-dir: No such file");
}

// One corrupt image per rule in the reader; the message must name the file and say what is wrong.
struct Corruption {
  const char* what;
  std::vector<std::byte> img;
  const char* message;
};

std::vector<Corruption> corruptions() {
  const std::string ok_entry = R"("t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  std::vector<std::byte> truncated = image("{" + ok_entry + "}", 8);
  truncated.erase(truncated.end() - 3, truncated.end());  // the last tensor loses 3 bytes
  return {
      {"too short", std::vector<std::byte>(5), "5 bytes long, shorter than the 8-byte header length"},
      {"length past end", image("{}", 0, 1000), "header length 1000 exceeds the 2 bytes that follow it"},
      {"not json", image("{\"t\": [", 0), "header is not valid JSON"},
      {"trailing garbage", image("{} x", 0), "header is not valid JSON"},
      {"not an object", image("[1, 2]", 0), "header is not a JSON object"},
      {"entry not object", image(R"({"t": 3})", 0), "tensor `t`: its entry is not an object"},
      {"unknown dtype", image(R"({"t":{"dtype":"F4X","shape":[2],"data_offsets":[0,8]}})", 8), "unknown dtype `F4X`"},
      {"no dtype", image(R"({"t":{"shape":[2],"data_offsets":[0,8]}})", 8), "tensor `t`: no `dtype`"},
      {"no shape", image(R"({"t":{"dtype":"F32","data_offsets":[0,8]}})", 8), "tensor `t`: no `shape`"},
      {"negative dim", image(R"({"t":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8),
       "`shape` is not an array of non-negative integers"},
      {"fractional dim", image(R"({"t":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", 8),
       "`shape` is not an array of non-negative integers"},
      {"no offsets", image(R"({"t":{"dtype":"F32","shape":[2]}})", 8), "tensor `t`: no `data_offsets`"},
      {"three offsets", image(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,4,8]}})", 8),
       "`data_offsets` is not a pair"},
      {"reversed offsets", image(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8),
       "data_offsets [8, 0] are reversed"},
      {"offsets past buffer", image(R"({"t":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8),
       "data_offsets [0, 16] run past the end of the 8-byte data buffer"},
      {"truncated buffer", truncated, "run past the end of the 5-byte data buffer"},
      {"shape vs span", image(R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
       "shape [3] of F32 needs 12 bytes but data_offsets [0, 8] hold 8"},
      {"shape overflow", image(R"({"t":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8),
       "needs more than 2^64 bytes"},
      {"overlap",
       image(
           R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
           12),
       "tensors `a` and `b` overlap"},
      {"gap",
       image(
           R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
           12),
       "bytes [4, 8) of the data buffer belong to no tensor"},
      {"trailing bytes", image("{" + ok_entry + "}", 12), "the last 4 bytes of the data buffer belong to no tensor"},
      {"duplicate name", image("{" + ok_entry + "," + ok_entry + "}", 8), "the key `t` appears twice"},
      {"metadata not strings", image(R"({"__metadata__":{"n":1}})", 0), "`__metadata__` entry `n` is not a string"},
      {"metadata not object", image(R"({"__metadata__":[]})", 0), "`__metadata__` is not an object"},
      // nlohmann would stop reading at the NUL and skip the byte-order mark; Python's safetensors rejects both.
      {"NUL in header", image(std::string("{}\0{{{", 6), 0), "the header: byte 2 is a NUL"},
      {"byte-order mark", image("\xEF\xBB\xBF{}", 0), "the header: it starts with a UTF-8 byte-order mark"},
      {"deep nesting", image(std::string(kMaxJsonDepth + 1, '['), 0),
       "the header: it nests more than 128 brackets deep"},
  };
}

TEST(Safetensors, RejectsEachCorruptionWithItsMessage) {
  for (const Corruption& c : corruptions()) {
    const std::string message = error_of([&] { open_image(c.img); });
    EXPECT_EQ(message.rfind("bad.safetensors: not a valid safetensors file: ", 0), 0u) << c.what << ": " << message;
    EXPECT_NE(message.find(c.message), std::string::npos) << c.what << ": got \"" << message << "\"";
    EXPECT_EQ(message.find('\n'), std::string::npos) << c.what << ": one line";
  }
}

// Brackets inside strings are text, not nesting; nesting up to the limit parses as usual.
TEST(JsonText, CountsOnlyBracketsOutsideStrings) {
  const std::string deep = std::string(kMaxJsonDepth, '[') + std::string(kMaxJsonDepth, ']');
  EXPECT_NO_THROW(check_json_text(deep, "x: "));
  EXPECT_NO_THROW(check_json_text(R"({"k": "[[[[\"{{{{", "a": [1]})", "x: "));
  EXPECT_EQ(error_of([&] { check_json_text("[" + deep + "]", "x: "); }),
            "x: it nests more than 128 brackets deep (at byte 128)");
  EXPECT_EQ(json_error_text("[json.exception.parse_error.101] parse error at line 1"), "parse error at line 1");
  EXPECT_EQ(json_error_text("plain"), "plain");
}

TEST(Safetensors, AcceptsEmptyFileAndMetadataOnly) {
  const SafetensorsFile f = open_image(image(R"({"__metadata__":{"k":"v"}})", 0));
  EXPECT_TRUE(f.tensors().empty());
  EXPECT_EQ(f.metadata().at("k"), "v");
}

TEST(Safetensors, ReportsFilesThatCannotBeOpened) {
  EXPECT_ERROR_HAS(SafetensorsFile::open("/nonexistent/in.safetensors"), "/nonexistent/in.safetensors: cannot open");
  const std::string dir = std::filesystem::temp_directory_path().string();
  EXPECT_ERROR_HAS(SafetensorsFile::open(dir), dir + ": not a regular file");
  EXPECT_ERROR_HAS(open_image(image("{}", 0)).at("q"), "bad.safetensors: no tensor `q`");
}

// --- typed access -------------------------------------------------------------------------------------------------

SafetensorsFile attention_like_file() {
  static const std::vector<float> q(2 * 4 * 3 * 8), k(2 * 2 * 3 * 8), short_k(2 * 2 * 5 * 8);
  static const std::vector<int32_t> doc(2 * 3);
  SafetensorsWriter w;
  w.add("q", StDType::F32, {2, 4, 3, 8}, std::span<const float>(q));
  w.add("k", StDType::F32, {2, 2, 3, 8}, std::span<const float>(k));
  w.add("k_long", StDType::F32, {2, 2, 5, 8}, std::span<const float>(short_k));
  w.add("doc", StDType::I32, {2, 3}, std::span<const int32_t>(doc));
  return SafetensorsFile::from_bytes(w.serialize(), "in.safetensors");
}

TEST(TensorAccess, BindsDimensionsAcrossTensors) {
  const SafetensorsFile f = attention_like_file();
  DimSizes dims;
  const TensorView& q = require(f, {"q", {StDType::F32, StDType::BF16}, {"B", "Hq", "S", "D"}, ""}, dims);
  EXPECT_EQ(q.numel(), 2 * 4 * 3 * 8);
  require(f, {"k", {StDType::F32}, {"B", "Hkv", "S", "D"}, "like `q`"}, dims);
  EXPECT_EQ(dims["B"], 2);
  EXPECT_EQ(dims["Hq"], 4);
  EXPECT_EQ(dims["Hkv"], 2);
  EXPECT_EQ(dims["S"], 3);
  EXPECT_EQ(dims["D"], 8);
  EXPECT_EQ(optional(f, {"dout", {StDType::F32}, {"B", "Hq", "S", "D"}, ""}, dims), nullptr);
}

TEST(TensorAccess, NamesTheTensorAndTheProblem) {
  const SafetensorsFile f = attention_like_file();
  DimSizes dims;
  require(f, {"q", {StDType::F32}, {"B", "Hq", "S", "D"}, ""}, dims);
  EXPECT_ERROR_HAS(require(f, {"v", {StDType::F32}, {"B", "Hkv", "S", "D"}, ""}, dims),
                   "in.safetensors: missing tensor `v` [B, Hkv, S, D]");
  EXPECT_ERROR_HAS(require(f, {"doc", {StDType::F32, StDType::BF16}, {"B", "S"}, "like `q`"}, dims),
                   "in.safetensors: tensor `doc` has dtype I32, expected F32 or BF16 like `q`");
  EXPECT_ERROR_HAS(require(f, {"doc", {StDType::I32}, {"B", "Hq", "S"}, ""}, dims),
                   "in.safetensors: tensor `doc` has shape [2, 3], expected rank 3 [B, Hq, S]");
  EXPECT_ERROR_HAS(
      require(f, {"k_long", {StDType::F32}, {"B", "Hkv", "S", "D"}, ""}, dims),
      "tensor `k_long` has shape [2, 2, 5, 8] [B, Hkv, S, D], but its S = 5 differs from S = 3 of tensor `q`");
  EXPECT_ERROR_HAS(copy_as<float>(f.at("doc")), "tensor `doc` has dtype I32, expected F32");
}

TEST(TensorAccess, WidensFloatDTypesExactly) {
  // Hand-picked bit patterns: 1, -2, the smallest subnormal (2^-24), the largest finite (65504), +inf, for F16;
  // 1 and -0.5 for BF16 (top half of the float32 pattern).
  const std::vector<uint16_t> f16 = {0x3c00, 0xc000, 0x0001, 0x7bff, 0x7c00};
  const std::vector<uint16_t> b16 = {0x3f80, 0xbf00};
  const std::vector<double> f64 = {0.1, -3.0};
  const std::vector<int32_t> i32 = {1};
  SafetensorsWriter w;
  w.add("h", StDType::F16, {5}, std::span<const uint16_t>(f16));
  w.add("b", StDType::BF16, {2}, std::span<const uint16_t>(b16));
  w.add("d", StDType::F64, {2}, std::span<const double>(f64));
  w.add("i", StDType::I32, {1}, std::span<const int32_t>(i32));
  const SafetensorsFile f = SafetensorsFile::from_bytes(w.serialize(), "mem");
  EXPECT_EQ(to_float32(f.at("h")),
            (std::vector<float>{1.f, -2.f, std::ldexp(1.f, -24), 65504.f, std::numeric_limits<float>::infinity()}));
  EXPECT_EQ(to_float32(f.at("b")), (std::vector<float>{1.f, -0.5f}));
  EXPECT_EQ(to_float32(f.at("d")), (std::vector<float>{0.1f, -3.f}));  // rounded to nearest, as static_cast does
  EXPECT_ERROR_HAS(to_float32(f.at("i")), "tensor `i` has dtype I32, expected a floating-point dtype");
  EXPECT_EQ(copy_as<int32_t>(f.at("i")), i32);
}

}  // namespace
}  // namespace rf::io
