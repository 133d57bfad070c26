// ringflex model: generation's decode-step products (StreamRowsScope), a path of ops.cpp's gemm that training never
// takes.
//
// A decode step multiplies one token a sequence by every weight of the model: a float32 product x W^T of a few rows,
// bound by reading W from memory once. sgemm first packs the whole of W into its panel layout for that one use (a
// second pass over the bytes that bound the step; 33% of a decode step's samples on the 100m config, BENCHMARKS.md).
// While a StreamRowsScope is open, gemm computes such a product (at most kStreamRowsMax rows, B stored [N, K]) as one
// dot product over K per element of C (elementwise.h dot_scaled), in fixed column panels split over the threads, and
// the attention projections of a one-token row (L = 1, where [B, heads, 1, D] is [B, heads * D]) as one product over
// all heads. Its bits differ from sgemm's (another summation order), so training's products, which must keep theirs,
// never run inside a scope; each element depends only on its row and column, so a row's bits do not depend on the
// other rows of the step or on the thread count.
#pragma once

#include <cstdint>

namespace rf::model {

// The most rows a streamed product takes: up to here the weight's bytes, read once, bound it (M multiply-adds a
// weight element read from L1, against 4 bytes from memory); beyond, sgemm's packed kernels do.
constexpr int64_t kStreamRowsMax = 8;

// Opens the decode-step path for the process while it lives (generation's decode steps, model/generate.cpp). Not
// nested and not shared between concurrent runs: one run at a time opens it, on the thread that calls the model.
class StreamRowsScope {
 public:
  StreamRowsScope();
  ~StreamRowsScope();
  StreamRowsScope(const StreamRowsScope&) = delete;
  StreamRowsScope& operator=(const StreamRowsScope&) = delete;
};

// Whether a StreamRowsScope is open.
bool streaming_rows();

}  // namespace rf::model
