// ringflex core: the constants of computing exp and log in base 2.
//
// The attention kernels, the loss and the elementwise passes compute e^x as 2^(x log2 e), the form the vector
// exp2 (an integer exponent and a polynomial of the fraction) takes, and turn a base-2 log-sum-exp back with ln 2.
// Both are float32 roundings of the exact values (log2 e = 1.4426950408889634..., ln 2 = 0.6931471805599453...).
#pragma once

namespace rf {

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

}  // namespace rf
