// Test-only tool for the Python cross-check (python_crosscheck.py): `write PATH` writes one tensor per dtype
// with values given by a formula; `check PATH` reads a file (written by Python's safetensors) and verifies every
// tensor against the same formula. The formula is repeated in the Python script, so neither side is its own
// oracle. Exit 0 on success; otherwise one line on stderr saying what differed.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/safetensors.h"
#include "io/tensor_access.h"

namespace {

using rf::io::StDType;

const std::vector<int64_t> kShape = {2, 3, 5};
constexpr int kElements = 2 * 3 * 5;
constexpr char kOriginKey[] = "origin";

// The formula (mirrored in python_crosscheck.py). Float values are multiples of 0.5 in [-3, 3]: exact in F16,
// BF16, F32 and F64, so both sides compare bit for bit.
double float_value(int i) { return (i % 13) * 0.5 - 3.0; }
int64_t signed_value(int i) { return (i * 7) % 100 - 50; }
uint64_t unsigned_value(int i) { return static_cast<uint64_t>((i * 7) % 200); }
bool bool_value(int i) { return i % 3 == 0; }

// Every dtype NumPy can write; BF16 only when the Python side has torch (checked if present).
const std::vector<StDType> kNumpyDTypes = {StDType::BOOL, StDType::U8,  StDType::I8,  StDType::I16,
                                           StDType::U16,  StDType::F16, StDType::I32, StDType::U32,
                                           StDType::F32,  StDType::I64, StDType::U64, StDType::F64};

std::string tensor_name(StDType t) {
  std::string n = "t_" + std::string(rf::io::dtype_name(t));
  for (char& c : n) c = static_cast<char>(std::tolower(c));
  return n;
}

// A float exactly representable in half precision (as every formula value is) to its F16 bits.
uint16_t exact_half(double x) {
  constexpr int kHalfBias = 15, kHalfMantissaBits = 10;
  if (x == 0) return 0;
  const uint16_t sign = x < 0 ? 0x8000 : 0;
  int e;
  const double m = std::frexp(std::fabs(x), &e);  // |x| = m * 2^e, m in [0.5, 1)
  const auto mantissa = static_cast<uint16_t>((m * 2 - 1) * (1 << kHalfMantissaBits));
  return static_cast<uint16_t>(sign | ((e - 1 + kHalfBias) << kHalfMantissaBits) | mantissa);
}

// The expected bytes of tensor t_<dtype>.
std::vector<std::byte> expected_bytes(StDType t) {
  std::vector<std::byte> out(kElements * rf::io::element_size(t));
  for (int i = 0; i < kElements; ++i) {
    std::byte* p = out.data() + i * rf::io::element_size(t);
    auto put = [p](auto v) { std::memcpy(p, &v, sizeof v); };
    switch (t) {
      case StDType::BOOL:
        put(static_cast<uint8_t>(bool_value(i)));
        break;
      case StDType::U8:
        put(static_cast<uint8_t>(unsigned_value(i)));
        break;
      case StDType::I8:
        put(static_cast<int8_t>(signed_value(i)));
        break;
      case StDType::I16:
        put(static_cast<int16_t>(signed_value(i)));
        break;
      case StDType::U16:
        put(static_cast<uint16_t>(unsigned_value(i)));
        break;
      case StDType::F16:
        put(exact_half(float_value(i)));
        break;
      case StDType::BF16:
        put(rf::float_to_bf16(static_cast<float>(float_value(i))));
        break;
      case StDType::I32:
        put(static_cast<int32_t>(signed_value(i)));
        break;
      case StDType::U32:
        put(static_cast<uint32_t>(unsigned_value(i)));
        break;
      case StDType::F32:
        put(static_cast<float>(float_value(i)));
        break;
      case StDType::I64:
        put(signed_value(i));
        break;
      case StDType::U64:
        put(unsigned_value(i));
        break;
      case StDType::F64:
        put(float_value(i));
        break;
      default:
        rf::fail("no formula for dtype ", rf::io::dtype_name(t));
    }
  }
  return out;
}

void write(const std::string& path) {
  std::vector<StDType> dtypes = kNumpyDTypes;
  dtypes.push_back(StDType::BF16);
  std::vector<std::vector<std::byte>> data;
  for (StDType t : dtypes) data.push_back(expected_bytes(t));
  rf::io::SafetensorsWriter w;
  for (size_t i = 0; i < dtypes.size(); ++i)
    w.add(tensor_name(dtypes[i]), dtypes[i], kShape, std::span<const std::byte>(data[i]));
  w.set_metadata(kOriginKey, "ringflex");
  w.write(path);
}

void check(const std::string& path) {
  const rf::io::SafetensorsFile f = rf::io::SafetensorsFile::open(path);
  RF_CHECK(f.metadata().count(kOriginKey) && f.metadata().at(kOriginKey) == "python", path,
           ": metadata `origin` is not \"python\"");
  for (StDType t : kNumpyDTypes) RF_CHECK(f.find(tensor_name(t)), path, ": no tensor `", tensor_name(t), "`");
  for (const rf::io::TensorView& v : f.tensors()) {
    RF_CHECK(v.name == tensor_name(v.dtype), path, ": tensor `", v.name, "` has dtype ", rf::io::dtype_name(v.dtype));
    RF_CHECK(v.shape == kShape, path, ": tensor `", v.name, "` has shape ", rf::io::shape_string(v.shape));
    const std::vector<std::byte> want = expected_bytes(v.dtype);
    RF_CHECK(std::equal(v.bytes.begin(), v.bytes.end(), want.begin(), want.end()), path, ": tensor `", v.name,
             "` holds different values");
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc == 3 ? argv[1] : "";
  if (mode != "write" && mode != "check") {
    std::fprintf(stderr, "usage: %s write|check PATH\n", argv[0]);
    return 2;
  }
  try {
    mode == "write" ? write(argv[2]) : check(argv[2]);
  } catch (const rf::Error& e) {
    std::fprintf(stderr, "safetensors_fixture: %s\n", e.what());
    return 1;
  }
  return 0;
}
