#!/usr/bin/env bash
# The attention-kernel benchmark behind BENCHMARKS.md "Attention kernels (one rank)": the C++ kernels against
# 1-thread sgemm, then PyTorch (SDPA, compiled flex_attention) on the metadata the C++ bench exported, then one
# merged table. Usage: bench/kernels/run_attention_bench.sh [BUILD_DIR] [OUT_DIR]   (about 10 minutes)
# Run it on an otherwise idle machine: every ratio is taken in this run, but the VM is shared.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=${1:-build}
out=${2:-$(mktemp -d)}
mkdir -p "$out"
# Torch covers the Gemma 4 masks at Gemma 4's head dims (sliding: 256, full: 512) and the plain masks at D = 128.
points="full:128,causal:128,sliding1024:256,vlm_sliding:256,vlm_full:512"
"$build/bench/kernels/bench_attention" --export "$out" --json "$out/kernels.json" >"$out/kernels.log"
for t in 1 2; do
  python3 "$here/torch_attention.py" --cases "$out" --threads "$t" --points "$points" --out "$out/torch_$t.json" \
    >"$out/torch_$t.log" 2>&1
done
python3 "$here/attention_table.py" "$out"
