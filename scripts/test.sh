#!/usr/bin/env bash
# Builds with warnings as errors and runs the whole test suite (unit, multi-rank under mpirun, parity, the
# PyTorch attention oracle), after a sanitizer pass (AddressSanitizer + UndefinedBehaviorSanitizer) over the
# in-process tests of every layer below the model: the kernels, the ring on loopback ranks, the planner and the
# file reader.
#
# A skipped test is a failure here (and under CI=true): every oracle is installed by `scripts/setup.sh --test`,
# so a skip means a check that did not happen. The one exception is a skip that names hardware this machine does
# not have (AMX tiles on a CPU without them); those are listed by name at the end (scripts/check_skips.py).
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)

# In-process test targets run under the sanitizers, as <tests subfolder>/<target>. One per line: add new
# in-process targets here (multi-rank tests under mpirun are not sanitized: Open MPI's own allocations would
# drown the report).
sanitized=(
  core/test_core
  reference/test_reference
  cpu/test_cpu_attention
  cpu/test_cpu_amx_tiles
  io/test_io
  comm/test_loopback
  cp/test_shard
  cp/test_cp_loopback
  cp/test_ep_experts
  cp/test_plan_cp
  cp/test_plan_ring
  comm/test_agree
  report/test_report
)
names=("${sanitized[@]##*/}")
cmake -B build-sanitize -DRINGFLEX_WERROR=ON -DRINGFLEX_SANITIZE=address,undefined -DRINGFLEX_BUILD_BENCH=OFF \
  -DRINGFLEX_SANITIZED_TESTS="$(IFS=';'; echo "${names[*]}")" >/dev/null
cmake --build build-sanitize -j "$jobs" --target sanitized_tests
sanitizer_env=(UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ASAN_OPTIONS=detect_leaks=1)
for t in "${sanitized[@]}"; do
  echo "sanitizer run: $t"
  env "${sanitizer_env[@]}" "build-sanitize/tests/$t" --gtest_brief=1
done
# The AMX kernels once more on the software tile unit (tests/cpu/kernel_path_test.h): their packed operands and
# bounce tiles are what the sanitizers would catch. On a CPU without AVX512_BF16 every test skips, saying why.
echo "sanitizer run: cpu/test_cpu_attention on the AMX tile model"
env "${sanitizer_env[@]}" RF_TEST_AMX_TILE_MODEL=1 build-sanitize/tests/cpu/test_cpu_attention --gtest_brief=1

cmake -B build -DRINGFLEX_WERROR=ON -DRINGFLEX_BUILD_TESTS=ON
cmake --build build -j "$jobs"
results=build/ctest-results.xml
rm -f "$results"
status=0
RINGFLEX_STRICT_SKIPS=1 ctest --test-dir build --output-on-failure --no-tests=error -j "$jobs" \
  --output-junit "$PWD/$results" || status=$?
python3 scripts/check_skips.py "$results" || status=1
exit "$status"
