// ringflex cpu: the floating-point mode the attention kernels run in: denormals flushed to zero.
//
// Why. On Intel cores (measured on a Skylake-SP), an SSE/AVX multiply or FMA with a denormal operand or result
// (|x| < 2^-126) leaves the fast path for a microcode assist of the order of a hundred cycles, and the softmax
// makes such values routinely: a key more than 126 (log2 units) below its row's maximum score gets a denormal
// weight P from AVX-512's vscalefps (which underflows gradually), and dS = P (dP - delta) inherits it; each one is
// then broadcast into Dp FMAs of P·V, dS·K or dSᵀ·Q. A Gemma 4 training step (100M config, S = 2048) took 53 s
// with denormals and 26.5 s with them flushed in the kernels on one thread (29.5 s and 15.9 s on two), the same
// loss to the printed digits. On the AMD Zen 4 of BENCHMARKS.md the unflushed step already ran near the FLOP limit:
// there the mode changes only the flushed bits.
//
// What it costs numerically: nothing float32 can show. A flushed weight is below 2^-126, next to the row
// maximum's weight 1 in the same sum (2^102 times smaller than float32's resolution there); a flushed input (q, k, v,
// dO below 2^-126 in magnitude) reads as a zero of its sign, changing each product it enters by less than 2^-126 times
// the other factor. vdpbf16ps and AMX read denormal bf16 inputs as zero anyway (docs/numerics.md). NaN and Inf are
// untouched.
//
// How: MXCSR's FTZ (results) and DAZ (operands) bits, set by each OpenMP thread at the top of a kernel's parallel
// region and restored at its end, so the caller's threads (the model's sgemm, the user's code) keep their mode.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace rf::cpu {

class FlushDenormalsScope {
 public:
#if defined(__x86_64__) || defined(__i386__)
  FlushDenormalsScope() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | kFlushToZero | kDenormalsAreZero); }
  ~FlushDenormalsScope() { _mm_setcsr(saved_); }
#else
  FlushDenormalsScope() = default;  // other architectures: their default mode (the kernels there are scalar)
#endif
  FlushDenormalsScope(const FlushDenormalsScope&) = delete;
  FlushDenormalsScope& operator=(const FlushDenormalsScope&) = delete;

 private:
#if defined(__x86_64__) || defined(__i386__)
  static constexpr unsigned kFlushToZero = 0x8000;       // MXCSR bit 15: denormal results become zero
  static constexpr unsigned kDenormalsAreZero = 0x0040;  // MXCSR bit 6: denormal operands read as zero
  unsigned saved_;
#endif
};

}  // namespace rf::cpu
