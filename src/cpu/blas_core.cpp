// ringflex cpu: the OpenBLAS core check and restart (blas_core.h).
#include "cpu/blas_core.h"

#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdlib>

#include "cpu/restart.h"

namespace rf::cpu {

namespace {

constexpr const char* kCoreEnv = "OPENBLAS_CORETYPE";
constexpr const char* kFallbackEnv = "RINGFLEX_OPENBLAS_FALLBACK";

// The user's OPENBLAS_CORETYPE, or nullptr when it is unset or empty (OpenBLAS reads an empty one as unset).
const char* chosen_core() {
  const char* chosen = std::getenv(kCoreEnv);
  return chosen != nullptr && *chosen != '\0' ? chosen : nullptr;
}

// OpenBLAS's x86-64 cores whose sgemm kernels use AVX2 + FMA or wider (its driver/others/dynamic.c names).
constexpr std::array<std::string_view, 5> kVectorCores{"Haswell", "Zen", "SkylakeX", "Cooperlake", "SapphireRapids"};

bool same_name(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) == std::tolower(static_cast<unsigned char>(y));
         });
}

}  // namespace

std::string openblas_core() {
  // Looked up rather than declared: the model links whichever BLAS CMake finds, and only OpenBLAS has this.
  using CoreName = char* (*)();
  const auto corename = reinterpret_cast<CoreName>(dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  const char* name = corename ? corename() : nullptr;
  return name ? std::string(name) : std::string();
}

const char* better_openblas_core(std::string_view core, const CpuFeatures& cpu) {
  if (core.empty() || !cpu.avx2) return nullptr;
  for (std::string_view good : kVectorCores)
    if (same_name(core, good)) return nullptr;
  return cpu.avx512 ? "SkylakeX" : "Haswell";
}

void restart_on_best_openblas_core(char** argv) {
  if (chosen_core() != nullptr) return;  // the user's choice, or this is the restarted process
  const std::string core = openblas_core();
  const char* better = better_openblas_core(core, detect_cpu());
  if (better == nullptr) return;
  setenv(kCoreEnv, better, 1);
  setenv(kFallbackEnv, core.c_str(), 1);
  restart_self(argv);
  unsetenv(kCoreEnv);  // exec failed: run on with the core OpenBLAS chose, and say so in `info`
  unsetenv(kFallbackEnv);
}

std::string describe_openblas_core() {
  const std::string core = openblas_core();
  if (core.empty()) return "not OpenBLAS";
  std::string line = "OpenBLAS " + core;
  if (const char* fallback = std::getenv(kFallbackEnv))
    line += std::string(" (") + kCoreEnv + " set by ringflex: this OpenBLAS took the CPU for " + fallback + ")";
  else if (const char* forced = chosen_core())
    line += std::string(" (") + kCoreEnv + "=" + forced + ")";
  else if (const char* better = better_openblas_core(core, detect_cpu()))
    line += std::string(" (a fallback: ") + kCoreEnv + "=" + better + " would use this CPU's vector units)";
  return line;
}

}  // namespace rf::cpu
