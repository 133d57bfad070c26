#!/usr/bin/env bash
# The main job on built-in data: builds ringflex and runs `ringflex demo` (a generated Gemma 4-like case through
# the attention engine, checked against the scalar reference, with a speed summary). Options go to the demo,
# e.g. `scripts/demo.sh --seq 8192` for a longer row; `ringflex demo --help` lists them.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -B build >/dev/null
cmake --build build -j "$(nproc)" --target ringflex
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
./build/src/cli/ringflex demo "$@"
