# shellcheck shell=bash
# What the multi-rank shell tests share (tests/trainer/*_mpirun.sh, tests/trainer/faults.sh,
# tests/cli/stalled_rank.sh). Sourced with no arguments, first thing, so that it reads and shifts the script's own,
# which are always
#   WORKDIR RINGFLEX MPIEXEC... -- SCRIPT_ARGS...
# It leaves `work` (emptied and created), `ringflex`, the launcher and its options in `launcher`, the script's own
# arguments in "$@", RF_TEST_MARK in the environment of every job the script starts (rank_pid), tests/common on
# PYTHONPATH (train_outputs.py, for the scripts' python3 checks), same_checkpoint (same_checkpoint.sh) and the
# functions below.
work=$1 ringflex=$2
shift 2
launcher=()
while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do
  launcher+=("$1")
  shift
done
[ "$#" -gt 0 ] || { echo "$(basename "$0"): expected WORKDIR RINGFLEX MPIEXEC... -- SCRIPT_ARGS..." >&2; exit 2; }
shift
rm -rf "$work"
mkdir -p "$work" || exit 1
tests_common=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export PYTHONPATH="$tests_common${PYTHONPATH:+:$PYTHONPATH}"
source "$tests_common/same_checkpoint.sh"
# A mark in the environment of this script's jobs, so that rank_pid finds their ranks only (other tests, and other
# users' jobs on the machine, run ringflex ranks too).
export RF_TEST_MARK="$$.$RANDOM"

# train_job NAME RANKS ARGS...: `ringflex train` on RANKS ranks under the launcher with the script's `common` options,
# then ARGS, its checkpoints in $work/NAME and its metrics in $work/NAME.jsonl; stdout dropped.
train_job() {
  local name=$1 ranks=$2
  shift 2
  # shellcheck disable=SC2154  # common: the sourcing script's options
  "${launcher[@]}" -n "$ranks" "$ringflex" train "${common[@]}" "$@" --set checkpoint.dir="$work/$name" \
    --metrics "$work/$name.jsonl" >/dev/null
}

# rank_pid RANK: the pid of rank RANK (OMPI_COMM_WORLD_RANK) of a ringflex job this script started, or nothing when
# no such process runs (yet).
rank_pid() {
  local pid environment
  for pid in $(pgrep -x ringflex); do
    environment=$({ tr '\0' '\n' <"/proc/$pid/environ"; } 2>/dev/null)
    if grep -qx "RF_TEST_MARK=$RF_TEST_MARK" <<<"$environment" && grep -qx "OMPI_COMM_WORLD_RANK=$1" <<<"$environment"
    then
      echo "$pid"
      return
    fi
  done
}

# wait_launcher PID BOUND_S [STOPPED_PID]: waits for the background launcher PID and sets `code` to its exit status.
# Returns 1, the launcher killed, when it still runs after BOUND_S seconds; STOPPED_PID (a rank the script stopped)
# is resumed first, so that it can die.
wait_launcher() {
  local pid=$1 bound_s=$2 stopped=${3:-} start
  start=$(date +%s)
  while kill -0 "$pid" 2>/dev/null; do
    if [ $(($(date +%s) - start)) -ge "$bound_s" ]; then
      if [ -n "$stopped" ]; then kill -CONT "$stopped" 2>/dev/null; fi
      kill -9 "$pid" 2>/dev/null
      return 1
    fi
    sleep 0.1
  done
  wait "$pid"
  # shellcheck disable=SC2034  # read by the sourcing script
  code=$?
}
