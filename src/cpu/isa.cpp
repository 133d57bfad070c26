// ringflex cpu: CPU feature detection and the choice of kernel path (isa.h).
#include "cpu/isa.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "core/error.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace rf::cpu {

namespace {

constexpr const char* kIsaEnv = "RINGFLEX_ISA";

#if defined(__x86_64__)
// CPUID bits (Intel SDM vol. 2A, CPUID; AMD APM vol. 3 appendix E).
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
    // The kernels drive AMX from AVX-512 code, so AMX counts only with AVX-512 (every AMX CPU has it).
    f.amx = f.avx512 && amx_cpuid && syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
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

KernelPath select_path(const CpuFeatures& f, const char* forced) {
#ifdef RF_BF16_DOT
  // The AVX-512 kernels were built with vdpbf16ps score products (CMake RINGFLEX_BF16_DOT).
  const bool avx512_ok = f.avx512 && f.avx512_bf16;
  const char* avx512_needs = "AVX-512 F/DQ/BW/VL and AVX512_BF16 (this build has RINGFLEX_BF16_DOT=ON)";
#else
  const bool avx512_ok = f.avx512;
  const char* avx512_needs = "AVX-512 F/DQ/BW/VL";
#endif
  KernelPath p;
  const std::string_view want = forced ? forced : "";
  if (want.empty()) {
    p.reason = "best this CPU supports";
    if (avx512_ok)
      p.isa = Isa::Avx512;
    else if (f.avx2)
      p.isa = Isa::Avx2;
    if (p.isa == Isa::Avx512 && f.amx) p.bf16 = Bf16Product::Amx;
    return p;
  }
  p.reason = std::string("forced by ") + kIsaEnv + "=" + std::string(want);
  if (want == "amx") {
    RF_CHECK(avx512_ok && f.amx, kIsaEnv, "=amx but this CPU or OS offers no AMX-TILE + AMX-BF16 with ", avx512_needs);
    p.isa = Isa::Avx512, p.bf16 = Bf16Product::Amx;
  } else if (want == "avx512") {
    RF_CHECK(avx512_ok, kIsaEnv, "=avx512 but this CPU or OS lacks ", avx512_needs);
    p.isa = Isa::Avx512;
  } else if (want == "avx2") {
    RF_CHECK(f.avx2, kIsaEnv, "=avx2 but this CPU or OS lacks AVX2 + FMA");
    p.isa = Isa::Avx2;
  } else if (want == "scalar") {
    p.isa = Isa::Scalar;
  } else {
    fail(kIsaEnv, "=", want, " is not a kernel path: use amx, avx512, avx2 or scalar");
  }
  return p;
}

const KernelPath& kernel_path() {
  // Static-local initialisation is thread-safe, and an exception leaves it uninitialised, so a bad RINGFLEX_ISA
  // throws on every call rather than once.
  static const KernelPath path = select_path(detect_cpu(), std::getenv(kIsaEnv));
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
#ifdef RF_BF16_DOT
      return "vdpbf16ps on AVX-512, else widen to float32";
#else
      return "widen to float32";
#endif
    case Bf16Product::Amx:
      return "amx";
  }
  return "?";
}

std::string describe(const KernelPath& path) {
  return std::string(isa_name(path.isa)) + ", bf16 score products: " + bf16_name(path.bf16) + " (" + path.reason + ")";
}

}  // namespace rf::cpu
