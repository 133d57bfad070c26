#!/usr/bin/env bash
# The main job: builds ringflex and fine-tunes the built-in tiny Gemma 4 MoE VLM on built-in mock VLM data with
# every row split over 2 ranks (context parallelism), a few hundred steps in a few minutes on 2 cores. It ends
# with the loss picture and the checkpoint's path. Options go to `ringflex train`, e.g.
# `scripts/demo.sh --set train.steps=50`; `ringflex train --help` lists them.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -B build >/dev/null
cmake --build build -j "$(nproc)" --target ringflex
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# One OpenMP thread per rank (the config says so too): the 2 ranks fill the 2 cores.
export OMP_NUM_THREADS=1
mkdir -p runs
mpirun --oversubscribe -n 2 ./build/src/cli/ringflex train --config examples/gemma4_tiny_moe_vlm.yaml \
  --metrics runs/gemma4_tiny_moe_vlm.jsonl "$@"
