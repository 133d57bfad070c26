// ringflex bench: forward and backward GFLOP/s of mask area for the cpu attention kernels (docs/spec.md §9), as ratios
// to single-thread OpenBLAS sgemm measured in the same run.
//
// FLOPs: forward = 4·B·Hq·D·A with A = allowed (q, k) pairs; backward (delta + dQ, dK, dV) = 2.5 × forward.
// bwd / fwd: the backward's GFLOP/s over the forward's at the same point (forward and backward timed alternately).
// Masks: full (bidirectional), causal, sliding W = 1024 at S = 16K, and a Gemma 4 VLM row (rf::gemma4_vlm_row:
// packed documents with 256-token image groups) under Gemma 4's two layer masks (sliding W = 1024 + groups,
// full causal + groups). Before timing, each dtype and head dim is checked against the scalar reference on a
// small case. With --export DIR the case list and each row's metadata are written for torch_attention.py
// (cases.json, and <mask>.meta: int32 [S, 3] = {idx, doc, group} per token, the TokenMeta layout).
#include <cblas.h>
#include <omp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/attention_args.h"
#include "core/row_meta.h"
#include "cpu/attention.h"
#include "cpu/blas_core.h"
#include "cpu/dispatch.h"
#include "cpu/isa.h"
#include "cpu/kernels.h"
#include "reference/attention_ref.h"

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kSgemmN = 1024;                // square sgemm: large enough for OpenBLAS's peak, small enough to repeat
constexpr int kSgemmRepeats = 3;             // per measurement point; the VM's speed drifts, so each point gets its own
constexpr double kBackwardFlopFactor = 2.5;  // docs/spec.md §9
constexpr int kGemmaWindow = 1024;           // Gemma 4 26B/31B sliding window
constexpr uint64_t kSeed = 2026;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Single-thread sgemm GFLOP/s: the practical peak of one core (docs/machine.md). Measured again
// right before every kernel point (median of kSgemmRepeats) so each ratio compares numbers from the same minute.
class Sgemm {
 public:
  Sgemm() : a_(size_t{kSgemmN} * kSgemmN, 0.5f), b_(a_.size(), 0.25f), c_(a_.size(), 0.f) {
    openblas_set_num_threads(1);
    run();  // warm-up: pages and OpenBLAS buffers
  }
  double gflops() {
    std::vector<double> t;
    for (int i = 0; i < kSgemmRepeats; ++i) {
      const auto t0 = Clock::now();
      run();
      t.push_back(seconds_since(t0));
    }
    return 2.0 * kSgemmN * kSgemmN * kSgemmN / median(t) / 1e9;
  }

 private:
  void run() {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, kSgemmN, kSgemmN, kSgemmN, 1.f, a_.data(), kSgemmN,
                b_.data(), kSgemmN, 0.f, c_.data(), kSgemmN);
  }
  std::vector<float> a_, b_, c_;
};

struct MaskCase {
  std::string name;
  int S;
  rf::LayerMask mask;
  std::vector<rf::TokenMeta> meta;  // [S]
};

std::vector<MaskCase> mask_cases(int s_short, int s_long) {
  const std::vector<rf::TokenMeta> plain_short = rf::make_row_meta(s_short, nullptr, nullptr);
  const std::vector<rf::TokenMeta> plain_long = rf::make_row_meta(s_long, nullptr, nullptr);
  const std::vector<rf::TokenMeta> vlm = rf::gemma4_vlm_row(s_short, kSeed);
  return {{"full", s_short, {false, 0, false}, plain_short},
          {"causal", s_short, {true, 0, false}, plain_short},
          {"sliding1024", s_long, {true, kGemmaWindow, false}, plain_long},
          {"vlm_sliding", s_short, {true, kGemmaWindow, true}, vlm},
          {"vlm_full", s_short, {true, 0, true}, vlm}};
}

// Allowed pairs of one row: full tiles counted whole, partial ones element by element (as the kernels do).
int64_t mask_area(const MaskCase& m) {
  const int T = rf::cpu::kTileQ, n = (m.S + T - 1) / T;
  std::vector<rf::BlockSummary> sum(static_cast<size_t>(n));
  for (int t = 0; t < n; ++t) sum[t] = rf::summarize(m.meta.data() + t * T, std::min(T, m.S - t * T));
  int64_t area = 0;
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) {
      const rf::BlockClass cls = rf::classify(m.mask, sum[i], sum[j]);
      if (cls == rf::BlockClass::Empty) continue;
      const int q0 = i * T, k0 = j * T, nq = std::min(T, m.S - q0), nk = std::min(T, m.S - k0);
      if (cls == rf::BlockClass::Full) {
        area += int64_t{nq} * nk;
        continue;
      }
      for (int a = 0; a < nq; ++a)
        for (int b = 0; b < nk; ++b) area += rf::allowed(m.mask, m.meta[q0 + a], m.meta[k0 + b]);
    }
  return area;
}

std::vector<uint8_t> random_bytes(int64_t n, rf::DType t, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<float> f(static_cast<size_t>(n));
  for (float& x : f) x = u(rng);
  std::vector<uint8_t> out(static_cast<size_t>(n) * rf::dtype_size(t));
  rf::from_float(out.data(), f.data(), f.size(), t);
  return out;
}

// All buffers of one timed shape.
struct Problem {
  rf::AttnChunk c;
  std::vector<uint8_t> q, k, v, dout;
  std::vector<float> o, lse, delta, dq, dk, dv;

  Problem(const MaskCase& m, int Hq, int Hkv, int D, rf::DType t) {
    c.shape = {1, Hq, Hkv, m.S, m.S, D};
    c.dtype = t;
    q = random_bytes(c.shape.q_elems(), t, kSeed + 1), k = random_bytes(c.shape.kv_elems(), t, kSeed + 2);
    v = random_bytes(c.shape.kv_elems(), t, kSeed + 3), dout = random_bytes(c.shape.q_elems(), t, kSeed + 4);
    c.q = q.data(), c.k = k.data(), c.v = v.data(), c.q_meta = m.meta.data(), c.k_meta = m.meta.data();
    c.mask = m.mask, c.scale = rf::default_scale(D);
    o.assign(static_cast<size_t>(c.shape.q_elems()), 0.f), dq.assign(o.size(), 0.f);
    lse.assign(static_cast<size_t>(c.shape.lse_elems()), 0.f), delta.assign(lse.size(), 0.f);
    dk.assign(static_cast<size_t>(c.shape.kv_elems()), 0.f), dv.assign(dk.size(), 0.f);
  }
  void forward() { rf::cpu::attention_forward(c, o.data(), lse.data()); }
  void backward() {
    rf::cpu::attention_delta(c.shape, c.dtype, dout.data(), o.data(), delta.data());
    rf::cpu::attention_backward(c, dout.data(), lse.data(), delta.data(), dq.data(), dk.data(), dv.data());
  }
};

// The kernels against the scalar reference on a small packed row with images, before any timing. The bound is
// loose (1e-3 of the output's scale, plus 2 · 2^-8 where the path rounds P and dS to bf16): this guards the
// benchmark against timing a broken build; tests/cpu (attention_check.h) holds the derived per-element bounds.
bool validate(int D, rf::DType t) {
  constexpr int kS = 150;
  constexpr double kBf16Unit = 0.00390625;  // 2^-8: bf16's unit roundoff, twice in the backward's dK and dQ
  const bool rounds = t == rf::DType::BF16 && rf::cpu::rounds_bf16_weights(rf::cpu::kernel_path().bf16);
  const double kTol = 1e-3 + (rounds ? 2 * kBf16Unit : 0);
  MaskCase m{"validate", kS, {true, 40, true}, rf::gemma4_vlm_row(kS, kSeed)};
  Problem p(m, 2, 1, D, t);
  p.forward();
  p.backward();
  const rf::RefForward r = rf::reference_forward(p.c);
  const rf::RefBackward g = rf::reference_backward(p.c, p.dout.data());
  auto worst = [](const std::vector<float>& got, const std::vector<double>& want) {
    double err = 0, scale = 1e-30;
    for (size_t i = 0; i < got.size(); ++i) {
      err = std::max(err, std::fabs(got[i] - want[i]));
      scale = std::max(scale, std::fabs(want[i]));
    }
    return err / scale;
  };
  const double e = std::max({worst(p.o, r.o), worst(p.dq, g.dq), worst(p.dk, g.dk), worst(p.dv, g.dv)});
  if (e > kTol)
    std::fprintf(stderr, "validation failed: D = %d %s, relative error %.3g\n", D,
                 std::string(rf::dtype_name(t)).c_str(), e);
  return e <= kTol;
}

// One 64 x 64 x D score-tile product (S = Q K^T, the abt micro-kernel of the path in use, src/cpu/isa.h) with
// float32 FMAs and, where the CPU has AVX512_BF16, with vdpbf16ps on bf16 pairs: what the tile race of
// src/cpu/isa.cpp measures (briefer) where CPUID cannot tell which is faster. Best of kTileTrials timings of
// kTileCalls products, operands in L1.
void tile_products(int D) {
  constexpr int kTileCalls = 200, kTileTrials = 30, kRows = rf::cpu::kTileQ, kCols = rf::cpu::kTileK;
  const rf::cpu::KernelSet& kernels = rf::cpu::kernels_for(rf::cpu::kernel_path().isa);
  std::vector<float> a(static_cast<size_t>(kRows) * D, 0.5f), bt(static_cast<size_t>(D) * kCols, 0.25f);
  std::vector<float> c(static_cast<size_t>(kRows) * kCols);
  std::vector<uint32_t> ab(a.size() / 2, 0x3f003f00u), bb(bt.size() / 2, 0x3e803e80u);  // bf16 pairs 0.5, 0.25
  volatile float sink = 0.f;  // reads each product's result so no call can be optimised away
  auto best = [&](auto&& fn) {
    double t_min = 1e30;
    for (int trial = 0; trial < kTileTrials; ++trial) {
      const auto t0 = Clock::now();
      for (int i = 0; i < kTileCalls; ++i) {
        fn();
        sink = sink + c[0];
      }
      t_min = std::min(t_min, seconds_since(t0));
    }
    return 2.0 * kRows * kCols * D * kTileCalls / t_min / 1e9;
  };
  const double f32 = best([&] { kernels.score_tile(a.data(), D, bt.data(), D, kRows, c.data()); });
  std::printf("score tile 64 x 64 x %d, 1 thread, %s: float32 FMA %.1f GFLOP/s", D, rf::cpu::isa_name(kernels.isa),
              f32);
  if (kernels.score_tile_bf16 && rf::cpu::detect_cpu().avx512_bf16) {
    const double bf = best([&] { kernels.score_tile_bf16(ab.data(), D / 2, bb.data(), D, kRows, c.data()); });
    std::printf(", vdpbf16ps %.1f GFLOP/s", bf);
  }
  std::printf("\n");
}

}  // namespace

int main(int argc, char** argv) {
  rf::cpu::restart_on_best_openblas_core(argv);  // the sgemm peak must come from this CPU's vector kernels
  CLI::App app{"cpu attention kernel benchmark (GFLOP/s of mask area, ratios to 1-thread sgemm)"};
  int repeats = 3, s_short = 4096, s_long = 16384, Hq = 2, Hkv = 1;
  std::vector<int> dims{64, 128, 256, 512}, threads{1, 2};
  std::string export_dir, json_out;
  app.add_option("--repeats", repeats, "timed repeats per point (the median is reported)");
  app.add_option("--seq", s_short, "S of the full, causal and VLM-row cases");
  app.add_option("--seq-long", s_long, "S of the sliding-window case");
  app.add_option("--hq", Hq, "query heads");
  app.add_option("--hkv", Hkv, "key/value heads");
  app.add_option("--dims", dims, "head dims")->delimiter(',');
  app.add_option("--threads", threads, "OpenMP thread counts")->delimiter(',');
  std::vector<std::string> dtype_names{"F32", "BF16"};
  app.add_option("--dtypes", dtype_names, "F32 and/or BF16")->delimiter(',');
  app.add_option("--export", export_dir, "write cases.json and per-mask metadata for torch_attention.py here");
  app.add_option("--json", json_out, "write the measurements as JSON here");
  CLI11_PARSE(app, argc, argv);

  std::vector<rf::DType> dtypes;
  for (const std::string& n : dtype_names) dtypes.push_back(n == "BF16" ? rf::DType::BF16 : rf::DType::F32);
  for (int D : dims)
    for (rf::DType t : dtypes)
      if (!validate(D, t)) return 1;

  const std::vector<MaskCase> masks = mask_cases(s_short, s_long);
  nlohmann::json cases = nlohmann::json::array();
  for (const MaskCase& m : masks) {
    cases.push_back({{"mask", m.name},
                     {"S", m.S},
                     {"causal", m.mask.causal},
                     {"window", m.mask.window},
                     {"groups", m.mask.bidirectional_groups},
                     {"area", mask_area(m)}});
    if (export_dir.empty()) continue;
    std::ofstream f(export_dir + "/" + m.name + ".meta", std::ios::binary);
    f.write(reinterpret_cast<const char*>(m.meta.data()), static_cast<std::streamsize>(m.meta.size() * 12));
  }
  if (!export_dir.empty()) {
    std::ofstream f(export_dir + "/cases.json");
    f << nlohmann::json{{"Hq", Hq}, {"Hkv", Hkv}, {"dims", dims}, {"threads", threads}, {"cases", cases}}.dump(1);
  }

  const std::string path = rf::cpu::describe(rf::cpu::kernel_path());
  const std::string cpu_name = rf::cpu::detect_cpu().cpu_name;
  std::printf("cpu: %s; kernel path: %s\n", cpu_name.c_str(), path.c_str());
  tile_products(128);
  Sgemm sgemm;
  std::printf("Hq = %d, Hkv = %d, B = 1; sgemm: 1-thread %s, N = %d, measured before each row\n\n", Hq, Hkv,
              rf::cpu::describe_openblas_core().c_str(), kSgemmN);
  std::printf(
      "| mask | S | D | dtype | threads | sgemm GFLOP/s | fwd ms | fwd GFLOP/s | fwd / sgemm | bwd ms | "
      "bwd GFLOP/s | bwd / sgemm | bwd / fwd |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::vector<double> peaks;
  nlohmann::json rows = nlohmann::json::array();
  for (size_t mi = 0; mi < masks.size(); ++mi) {
    const MaskCase& m = masks[mi];
    const double area = cases[mi]["area"].get<double>();
    for (int D : dims)
      for (rf::DType t : dtypes) {
        Problem p(m, Hq, Hkv, D, t);
        const double fwd_flop = 4.0 * Hq * D * area, bwd_flop = kBackwardFlopFactor * fwd_flop;
        for (int nt : threads) {
          const double peak = sgemm.gflops();
          peaks.push_back(peak);
          omp_set_num_threads(nt);
          std::vector<double> tf, tb;
          for (int r = 0; r < repeats; ++r) {
            auto t0 = Clock::now();
            p.forward();
            tf.push_back(seconds_since(t0));
            t0 = Clock::now();
            p.backward();
            tb.push_back(seconds_since(t0));
          }
          const double f = median(tf), b = median(tb);
          const double fg = fwd_flop / f / 1e9, bg = bwd_flop / b / 1e9;
          std::printf("| %s | %d | %d | %s | %d | %.0f | %.1f | %.1f | %.2f | %.1f | %.1f | %.2f | %.2f |\n",
                      m.name.c_str(), m.S, D, std::string(rf::dtype_name(t)).c_str(), nt, peak, f * 1e3, fg, fg / peak,
                      b * 1e3, bg, bg / peak, bg / fg);
          std::fflush(stdout);
          rows.push_back({{"mask", m.name},
                          {"S", m.S},
                          {"D", D},
                          {"dtype", rf::dtype_name(t)},
                          {"threads", nt},
                          {"fwd_s", f},
                          {"bwd_s", b},
                          {"fwd_gflops", fg},
                          {"bwd_gflops", bg},
                          {"area", area},
                          {"sgemm_gflops", peak}});
        }
      }
  }
  if (!json_out.empty()) {
    std::ofstream f(json_out);
    f << nlohmann::json{{"sgemm_gflops_median", median(peaks)},
                        {"Hq", Hq},
                        {"Hkv", Hkv},
                        {"cpu", cpu_name},
                        {"kernel_path", path},
                        {"rows", rows}}
             .dump(1);
  }
  return 0;
}
