#!/usr/bin/env bash
# Builds with warnings as errors and runs the whole test suite (unit, multi-rank under mpirun, parity).
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
cmake -B build -DRINGFLEX_WERROR=ON
cmake --build build -j "$jobs"
ctest --test-dir build --output-on-failure -j "$jobs"
