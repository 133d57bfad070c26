#!/usr/bin/env bash
# Builds with warnings as errors and runs the whole test suite (unit, multi-rank under mpirun, parity, the
# PyTorch attention oracle, and the numeric suites once more on the AVX2-only path: CTest's `.avx2-path` entries,
# label avx2-path, with RINGFLEX_ISA=avx2 OPENBLAS_CORETYPE=Haswell set on them), after a sanitizer pass (AddressSanitizer + UndefinedBehaviorSanitizer) over the
# in-process tests of every layer below the model: the kernels, the ring on loopback ranks, the planner and the
# file reader.
#
# A skipped test is a failure here (and under CI=true): every oracle is installed by `scripts/setup.sh --test`,
# so a skip means a check that did not happen. The one exception is a skip that names hardware this machine does
# not have (AMX tiles on a CPU without them); those are listed by name at the end (scripts/check_skips.py).
#
#   scripts/test.sh              both passes
#   scripts/test.sh --sanitize   the sanitizer pass only (needs no Python: .ci/run installs the oracles beside it)
#   scripts/test.sh --suite      the build and CTest only
#   --no-bench                   (with either) leaves bench/ out of the build: .ci/run, where nothing runs the
#                                benchmarks and every developer's default build compiles them (12% of the build)
#
# What runs where, and what each pass costs on CI's 2 cores: DEVELOPERS.md, "Test suite: what runs where".
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
pass=all bench=ON
for arg in "$@"; do
  case $arg in
    --sanitize | --suite) pass=$arg ;;
    --no-bench) bench=OFF ;;
    *) echo "usage: scripts/test.sh [--sanitize | --suite] [--no-bench]" >&2; exit 2 ;;
  esac
done

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
  text/test_template
)
names=("${sanitized[@]##*/}")
if [ "$pass" != --suite ]; then
  cmake -B build-sanitize -DRINGFLEX_WERROR=ON -DRINGFLEX_SANITIZE=address,undefined -DRINGFLEX_BUILD_BENCH=OFF \
    -DRINGFLEX_SANITIZED_TESTS="$(IFS=';'; echo "${names[*]}")" >/dev/null
  cmake --build build-sanitize -j "$jobs" --target sanitized_tests
  # The runs, "LABEL [VAR=VALUE...]" each, side by side $jobs at a time (each is mostly one thread), the kernel
  # tests first (the longest, about a minute each on CI's 2 cores); each run's output is printed when it ends.
  # The AMX kernels run once more on the software tile unit (tests/cpu/kernel_path_test.h): their packed operands
  # and bounce tiles are what the sanitizers would catch. On a CPU without AVX512_BF16 every test skips, saying why.
  runs=("cpu/test_cpu_attention" "cpu/test_cpu_attention RF_TEST_AMX_TILE_MODEL=1")
  for t in "${sanitized[@]}"; do
    [ "$t" = cpu/test_cpu_attention ] || runs+=("$t")
  done
  sanitizer_env=(UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ASAN_OPTIONS=detect_leaks=1)
  logs=build-sanitize/logs
  rm -rf "$logs" && mkdir -p "$logs"
  declare -A running=()  # pid -> index into runs
  failed=()
  finish_one() {
    local pid rc=0 i
    wait -n -p pid || rc=$?
    i=${running[$pid]}
    unset "running[$pid]"
    echo "sanitizer run: ${runs[$i]}"
    cat "$logs/$i.log"
    [ "$rc" -eq 0 ] || failed+=("${runs[$i]} (exit $rc)")
  }
  for i in "${!runs[@]}"; do
    read -r t vars <<<"${runs[$i]}"
    # shellcheck disable=SC2086  # vars: VAR=VALUE words, or none
    env "${sanitizer_env[@]}" $vars "build-sanitize/tests/$t" --gtest_brief=1 >"$logs/$i.log" 2>&1 &
    running[$!]=$i
    [ "${#running[@]}" -lt "$jobs" ] || finish_one
  done
  while [ "${#running[@]}" -gt 0 ]; do finish_one; done
  if [ "${#failed[@]}" -gt 0 ]; then
    printf 'sanitizer run failed: %s\n' "${failed[@]}" >&2
    exit 1
  fi
fi
[ "$pass" != --sanitize ] || exit 0

cmake -B build -DRINGFLEX_WERROR=ON -DRINGFLEX_BUILD_TESTS=ON -DRINGFLEX_BUILD_BENCH="$bench"
cmake --build build -j "$jobs"
results=build/ctest-results.xml
rm -f "$results"
status=0
RINGFLEX_STRICT_SKIPS=1 ctest --test-dir build --output-on-failure --no-tests=error -j "$jobs" \
  --output-junit "$PWD/$results" || status=$?
python3 scripts/slowest_tests.py "$results" 20 || status=1
python3 scripts/check_skips.py "$results" || status=1
exit "$status"
