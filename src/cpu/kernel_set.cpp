// ringflex cpu: the KernelSet of one ISA (kernels.h), compiled once per ISA like the kernels it lists.
#include <algorithm>
#include <cstdint>

#include "cpu/dispatch.h"
#include "cpu/isa_target.h"
#include "cpu/kernels.h"
#include "cpu/microkernels.h"

RF_ISA_BEGIN
namespace rf::cpu::RF_ISA_NS {

namespace {

using namespace detail;

void exp2_array(const float* x, float* y, int n) {
#if RF_ISA_AVX512 || RF_ISA_AVX2
  int i = 0;
  for (; i + kLanes <= n; i += kLanes) vstore(y + i, exp2_ps(vload(x + i)));
  if (i < n) {  // the tail through a zero-padded vector
    float in[kLanes] = {}, out[kLanes];
    std::copy(x + i, x + n, in);
    vstore(out, exp2_ps(vload(in)));
    std::copy(out, out + (n - i), y + i);
  }
#else
  for (int i = 0; i < n; ++i) y[i] = exp2_scalar(x[i]);
#endif
}

void score_tile(const float* a, int lda, const float* bt, int Dp, int rows, float* c) {
  abt<0>(a, lda, bt, Dp, rows, c);
}

#if RF_ISA_AVX512
RF_BF16_TARGET void score_tile_bf16(const uint32_t* a, int lda, const uint32_t* bt, int Dp, int rows, float* c) {
  abt_bf16<0>(a, lda, bt, Dp, rows, c);
}
#endif

}  // namespace

}  // namespace rf::cpu::RF_ISA_NS
RF_ISA_END

namespace rf::cpu {

const KernelSet& RF_ISA_EXPORT(kernels)() {
#if RF_ISA_AVX512
  constexpr Isa kIsa = Isa::Avx512;
  constexpr auto kScoreTileBf16 = RF_ISA_NS::score_tile_bf16;
#elif RF_ISA_AVX2
  constexpr Isa kIsa = Isa::Avx2;
  constexpr decltype(KernelSet::score_tile_bf16) kScoreTileBf16 = nullptr;
#else
  constexpr Isa kIsa = Isa::Scalar;
  constexpr decltype(KernelSet::score_tile_bf16) kScoreTileBf16 = nullptr;
#endif
  static constexpr KernelSet kSet{
      kIsa, RF_ISA_NS::forward, RF_ISA_NS::backward, RF_ISA_NS::exp2_array, RF_ISA_NS::score_tile, kScoreTileBf16};
  return kSet;
}

}  // namespace rf::cpu
