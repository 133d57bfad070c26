// ringflex cpu: CPU feature detection and the choice of kernel path (isa.h).
#include "cpu/isa.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <utility>
#include <vector>

#include "core/error.h"
#include "cpu/amx.h"
#include "cpu/attention.h"
#include "cpu/kernels.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace rf::cpu {

namespace {

#if defined(__x86_64__)
// CPUID bits (Intel SDM vol. 2A, CPUID; AMD APM vol. 3 appendix E).
constexpr unsigned kLeafVendor = 0;  // vendor string in EBX, EDX, ECX
constexpr char kVendorAmd[] = "AuthenticAMD";
constexpr unsigned kLeafBasic = 1;
constexpr unsigned kEcxFma = 1u << 12;
constexpr unsigned kEcxOsxsave = 1u << 27;  // the OS enabled XGETBV, so XCR0 below is meaningful
constexpr unsigned kEcxAvx = 1u << 28;
constexpr unsigned kLeafExt = 7;
constexpr unsigned kEbxAvx2 = 1u << 5;
constexpr unsigned kEbxAvx512F = 1u << 16;
constexpr unsigned kEbxAvx512Dq = 1u << 17;
constexpr unsigned kEbxAvx512Bw = 1u << 30;
constexpr unsigned kEbxAvx512Vl = 1u << 31;
constexpr unsigned kEdxAmxBf16 = 1u << 22;
constexpr unsigned kEdxAmxTile = 1u << 24;
constexpr unsigned kEaxAvx512Bf16 = 1u << 5;  // leaf 7, sub-leaf 1
constexpr unsigned kLeafBrand = 0x80000002;   // three leaves of 16 brand-string bytes each
constexpr int kBrandLeaves = 3;
// XCR0: which register state the OS saves on a context switch. Without it the registers are unusable even on
// a CPU that has them (e.g. AVX-512 disabled by the hypervisor).
constexpr uint64_t kXcr0Ymm = 0x6;   // SSE + AVX (upper ymm halves)
constexpr uint64_t kXcr0Zmm = 0xe0;  // opmask, upper zmm0-15 halves, zmm16-31
// Linux arch_prctl: request permission for the AMX tile data state (an XSAVE feature a process must ask for).
constexpr long kArchReqXcompPerm = 0x1023;
constexpr long kXfeatureXtiledata = 18;

uint64_t read_xcr0() {
  uint32_t lo = 0, hi = 0;
  // XGETBV as an instruction, not the _xgetbv intrinsic: the intrinsic needs the XSAVE target, this file is baseline.
  asm volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return uint64_t{hi} << 32 | lo;
}
#endif

}  // namespace

CpuFeatures detect_cpu() {
  CpuFeatures f;
#if defined(__x86_64__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(kLeafVendor, &a, &b, &c, &d)) {
    char vendor[13] = {};
    std::memcpy(vendor, &b, 4), std::memcpy(vendor + 4, &d, 4), std::memcpy(vendor + 8, &c, 4);
    f.amd = std::string_view(vendor) == kVendorAmd;
  }
  if (!__get_cpuid(kLeafBasic, &a, &b, &c, &d)) return f;
  const bool fma = (c & kEcxFma) != 0, avx = (c & kEcxAvx) != 0;
  const uint64_t xcr0 = (c & kEcxOsxsave) ? read_xcr0() : 0;
  const bool os_ymm = (xcr0 & kXcr0Ymm) == kXcr0Ymm, os_zmm = (xcr0 & kXcr0Zmm) == kXcr0Zmm;
  if (__get_cpuid_count(kLeafExt, 0, &a, &b, &c, &d)) {
    f.avx2 = avx && fma && os_ymm && (b & kEbxAvx2);
    const unsigned avx512 = kEbxAvx512F | kEbxAvx512Dq | kEbxAvx512Bw | kEbxAvx512Vl;
    f.avx512 = f.avx2 && os_zmm && (b & avx512) == avx512;
    const bool amx_cpuid = (d & kEdxAmxTile) && (d & kEdxAmxBf16);
    unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
    f.avx512_bf16 = f.avx512 && __get_cpuid_count(kLeafExt, 1, &a1, &b1, &c1, &d1) && (a1 & kEaxAvx512Bf16);
    // The kernels drive AMX from AVX-512 code, so AMX counts only with AVX-512 and AVX512_BF16 (every AMX CPU
    // has both).
    f.amx = f.avx512_bf16 && amx_cpuid && syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }
  char brand[kBrandLeaves * 16 + 1] = {};
  for (int i = 0; i < kBrandLeaves; ++i) {
    unsigned r[4] = {};
    if (!__get_cpuid(kLeafBrand + i, &r[0], &r[1], &r[2], &r[3])) break;
    std::memcpy(brand + 16 * i, r, sizeof(r));
  }
  std::string_view name(brand);
  while (!name.empty() && name.front() == ' ') name.remove_prefix(1);
  f.cpu_name = std::string(name);
#endif
  return f;
}

bool needs_tile_race(const CpuFeatures& f, const char* forced) {
  return (forced == nullptr || *forced == '\0') && f.avx512 && f.avx512_bf16 && !f.amx && !f.amd;
}

KernelPath select_path(const CpuFeatures& f, const char* forced, const Bf16Race& race) {
  KernelPath p;
  const std::string_view want = forced ? forced : "";
  if (want.empty()) {
    p.reason = "best this CPU supports";
    if (f.avx512)
      p.isa = Isa::Avx512;
    else if (f.avx2)
      p.isa = Isa::Avx2;
    if (p.isa != Isa::Avx512 || !f.avx512_bf16) return p;
    if (f.amx) {
      p.bf16 = Bf16Product::Amx;
    } else if (f.amd) {
      p.bf16 = Bf16Product::Dpbf16;
    } else if (race) {
      const double speedup = race();
      char line[160];
      std::snprintf(line, sizeof(line), "tile race: vdpbf16ps %.2fx float32 FMA GFLOP/s, %s %.2fx", speedup,
                    speedup >= kDpbf16MinSpeedup ? "at least" : "below", kDpbf16MinSpeedup);
      p.reason = line;
      if (speedup >= kDpbf16MinSpeedup) p.bf16 = Bf16Product::Dpbf16;
    }
    return p;
  }
  p.reason = std::string("forced by ") + kIsaEnv + "=" + std::string(want);
  if (want == "amx") {
    RF_CHECK(f.amx, kIsaEnv, "=amx but this CPU or OS offers no AMX-TILE + AMX-BF16 with AVX-512 F/DQ/BW/VL and ",
             "AVX512_BF16");
    p.isa = Isa::Avx512, p.bf16 = Bf16Product::Amx;
  } else if (want == "avx512-dpbf16") {
    RF_CHECK(f.avx512_bf16, kIsaEnv, "=avx512-dpbf16 but this CPU or OS lacks AVX-512 F/DQ/BW/VL with AVX512_BF16");
    p.isa = Isa::Avx512, p.bf16 = Bf16Product::Dpbf16;
  } else if (want == "avx512" || want == "avx512-widen") {
    RF_CHECK(f.avx512, kIsaEnv, "=", want, " but this CPU or OS lacks AVX-512 F/DQ/BW/VL");
    p.isa = Isa::Avx512;
  } else if (want == "avx2") {
    RF_CHECK(f.avx2, kIsaEnv, "=avx2 but this CPU or OS lacks AVX2 + FMA");
    p.isa = Isa::Avx2;
  } else if (want == "scalar") {
    p.isa = Isa::Scalar;
  } else {
    fail(kIsaEnv, "=", want, " is not a kernel path: use amx, avx512-dpbf16, avx512-widen (or avx512), avx2 or scalar");
  }
  return p;
}

double bf16_tile_race() {
#if defined(__x86_64__)
  // One 64 x 64 x 128 score tile, operands in L1 (48 KiB in all): the products the bf16 kernels spend their
  // time in, without memory effects. The two kinds alternate, so a slower moment of a shared machine hits both;
  // the best of the trials is each one's speed when nothing interfered. About 2 ms per kind on Zen 4.
  constexpr int kRows = kTileQ, kCols = kTileK, kDim = 128, kCalls = 16, kTrials = 12;
  const KernelSet& kernels = avx512_kernels();
  RF_ASSERT(kernels.score_tile_bf16 != nullptr);
  std::vector<float> a(static_cast<size_t>(kRows) * kDim, 0.5f), bt(static_cast<size_t>(kDim) * kCols, 0.25f);
  std::vector<float> c(static_cast<size_t>(kRows) * kCols);
  std::vector<uint32_t> ab(a.size() / 2, 0x3f003f00u), bb(bt.size() / 2, 0x3e803e80u);  // bf16 pairs 0.5, 0.25
  using Clock = std::chrono::steady_clock;
  volatile float sink = 0.f;  // reads each product's result so no call can be optimised away
  auto time_calls = [&](auto&& product) {
    const auto t0 = Clock::now();
    for (int i = 0; i < kCalls; ++i) {
      product();
      sink = sink + c[0];
    }
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  double best_f32 = 1e30, best_bf16 = 1e30;
  for (int t = 0; t < kTrials; ++t) {
    best_f32 =
        std::min(best_f32, time_calls([&] { kernels.score_tile(a.data(), kDim, bt.data(), kDim, kRows, c.data()); }));
    best_bf16 =
        std::min(best_bf16,
                 time_calls([&] { kernels.score_tile_bf16(ab.data(), kDim / 2, bb.data(), kDim, kRows, c.data()); }));
  }
  return best_f32 / best_bf16;  // equal FLOPs, so the time ratio is the GFLOP/s ratio
#else
  return 0;
#endif
}

namespace {

Bf16Race& installed_tile_race() {
  static Bf16Race race;
  return race;
}

}  // namespace

void set_tile_race(Bf16Race race) { installed_tile_race() = std::move(race); }

const KernelPath& kernel_path() {
  // A test's software tile unit (amx.h) stands in for AMX hardware: the AMX kernels, whatever this CPU offers.
  static const KernelPath tile_model{Isa::Avx512, Bf16Product::Amx, "AMX tile model installed by a test"};
  if (detail::amx_tile_model()) return tile_model;
  // Static-local initialisation is thread-safe, and an exception leaves it uninitialised, so a bad RINGFLEX_ISA
  // throws on every call rather than once. The race runs at most once per process, here.
  static const KernelPath path = select_path(detect_cpu(), std::getenv(kIsaEnv),
                                             installed_tile_race() ? installed_tile_race() : Bf16Race(bf16_tile_race));
  return path;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Avx512:
      return "avx512";
    case Isa::Avx2:
      return "avx2";
    case Isa::Scalar:
      return "scalar";
  }
  return "?";
}

const char* bf16_name(Bf16Product bf16) {
  switch (bf16) {
    case Bf16Product::Widen:
      return "widen to float32";
    case Bf16Product::Dpbf16:
      return "vdpbf16ps (P and dS rounded to bf16)";
    case Bf16Product::Amx:
      return "amx tiles (P and dS rounded to bf16)";
  }
  return "?";
}

std::string describe(const KernelPath& path) {
  return std::string(isa_name(path.isa)) + ", bf16 products: " + bf16_name(path.bf16) + " (" + path.reason + ")";
}

std::string describe_bf16_attention(const KernelPath& path) {
  if (bf16_units_pay(path))
    return std::string("bf16 kernels, q, k, v and dout stored bf16; products: ") + bf16_name(path.bf16);
  return "float32 kernels on q, k, v and dout rounded to bf16 values (no bf16 units that pay: " + path.reason + ")";
}

}  // namespace rf::cpu
