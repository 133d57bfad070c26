// ringflex cpu: the attention kernels of one instruction set, as a table of entry points.
//
// Internal to src/cpu (and its tests and benchmarks). Each ISA's kernels are compiled in their own translation
// units (isa_target.h) and export only the KernelSet below (isa_table.h); kernels_for() (dispatch.h) picks the set
// for the path isa.h chose. The public functions of attention.h go through that one choice.
#pragma once

#include "core/attention_args.h"
#include "cpu/isa.h"
#include "cpu/isa_table.h"

namespace rf::cpu {

struct KernelSet {
  Isa isa;
  // attention.h's forward and backward on this ISA; `bf16`: the units bf16 inputs multiply on (isa.h; anything
  // but Widen on the Avx512 set only).
  void (*forward)(const AttnChunk& c, Bf16Product bf16, float* o, float* lse);
  void (*backward)(const AttnChunk& c, Bf16Product bf16, const void* dout, const float* lse, const float* delta,
                   float* dq, float* dk, float* dv);
  // y[i] = 2^x[i] for x[i] <= 0 with the softmax's exp2 (tests check its accuracy); n any count.
  void (*exp2)(const float* x, float* y, int n);
  // The score micro-kernel alone, for the tile race (isa.h) and benchmark: c[rows, 64] = a[rows, Dp] (row
  // stride lda) . bt[Dp, 64], Dp a multiple of 16.
  void (*score_tile)(const float* a, int lda, const float* bt, int Dp, int rows, float* c);
  // The same with vdpbf16ps on bf16 pairs (a: [rows, Dp/2] words, stride lda; bt: [Dp/2, 64] words), Dp a
  // multiple of 32; null where the ISA has no such instruction. Call only on a CPU with AVX512_BF16.
  void (*score_tile_bf16)(const uint32_t* a, int lda, const uint32_t* bt, int Dp, int rows, float* c);
};

RF_ISA_TABLE_EXPORTS(KernelSet, kernels);  // avx512_kernels(), avx2_kernels(), scalar_kernels()

}  // namespace rf::cpu
