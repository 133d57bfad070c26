#!/usr/bin/env bash
# The long soak with faults (issue 38): the tiny MoE VLM example at cp 2 x dp 2 trained for STEPS steps twice, once
# uninterrupted and once with a random rank SIGKILLed at random steps KILLS times, each time resumed from the newest
# checkpoint; the two runs must end on the same checkpoint, byte for byte, and
# the same metrics (step, loss, lr, grad_norm, tokens). Too long for CI (1000 steps: 11 minutes on a loaded
# 2-core machine); its result is in BENCHMARKS.md ("Soak with faults").
#
#   scripts/soak.sh [--steps N] [--kills K] [--seed S] [--seq-len L] [--every E] [--work DIR] [--ringflex PATH]
#
# Defaults: 1000 steps, 5 kills, seed 1, the example's seq_len (256), a checkpoint every 25 steps (the resume redoes
# up to 24 steps each time), work in build/soak, build/src/cli/ringflex. Each kill waits until the metrics file has
# reached its step (drawn uniformly over what is left, away from the end), then SIGKILLs rank R (drawn among the 4) and
# waits for mpirun to end (`scripts/ringflex-mpirun`, so the job ends within --timeout plus its grace whatever the
# rank). Prints one line per kill and the verdict; exits non-zero when anything differs.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
steps=1000 kills=5 seed=1 seq_len=256 every=25 work=$repo/build/soak ringflex=$repo/build/src/cli/ringflex
while [ "$#" -gt 0 ]; do
  case $1 in
    --steps) steps=$2 ;;
    --kills) kills=$2 ;;
    --seed) seed=$2 ;;
    --seq-len) seq_len=$2 ;;
    --every) every=$2 ;;
    --work) work=$2 ;;
    --ringflex) ringflex=$2 ;;
    *) echo "usage: scripts/soak.sh [--steps N] [--kills K] [--seed S] [--seq-len L] [--every E] [--work DIR]" \
         "[--ringflex PATH]" >&2; exit 2 ;;
  esac
  shift 2
done
[ -x "$ringflex" ] || { echo "soak.sh: no ringflex at $ringflex (build it, or pass --ringflex)" >&2; exit 2; }
[ "$steps" -gt $((2 * every)) ] || { echo "soak.sh: --steps must exceed twice --every" >&2; exit 2; }
RANDOM=$seed
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_odls_base_sigkill_timeout=0 OMP_NUM_THREADS=1
# A mark in the ranks' environment, so that the kill finds this soak's ranks only (tests/common/mpirun_lib.sh's way).
export RF_SOAK_MARK="$$.$RANDOM"
rm -rf "$work"
mkdir -p "$work"
# A soak that stops (a failed check, ^C) takes its running job with it: a job left behind would go on writing into
# the work directory of the next soak.
job=""
trap '[ -z "$job" ] || kill -TERM "$job" 2>/dev/null' EXIT
trap 'exit 130' INT TERM
config=(--config "$repo/examples/gemma4_tiny_moe_vlm.yaml" --set parallelism.cp=2 --set parallelism.dp=2
        --set train.steps="$steps" --set train.seq_len="$seq_len" --set checkpoint.every="$every"
        --set checkpoint.keep=2 --set train.val_every=100 --set train.log_every=100 --timeout 30)

# run NAME [ARGS...]: the job into $work/NAME (checkpoints) and $work/NAME.jsonl (metrics), in the background.
run() {
  local name=$1
  shift
  "$repo/scripts/ringflex-mpirun" --oversubscribe -n 4 "$ringflex" train "${config[@]}" \
    --set checkpoint.dir="$work/$name" --metrics "$work/$name.jsonl" "$@" >>"$work/$name.log" 2>&1 &
  job=$!
}
last_step() { tail -n 1 "$1" 2>/dev/null | sed -n 's/^{"step":\([0-9]*\),.*/\1/p'; }
rank_pid() {  # RANK: this soak's rank RANK, or nothing
  local pid env name
  name=$(basename "$ringflex")
  for pid in $(pgrep -x "${name:0:15}"); do  # a process's name: the executable's, cut at 15 characters
    env=$({ tr '\0' '\n' <"/proc/$pid/environ"; } 2>/dev/null)
    grep -qx "RF_SOAK_MARK=$RF_SOAK_MARK" <<<"$env" && grep -qx "OMPI_COMM_WORLD_RANK=$1" <<<"$env" && { echo "$pid"; return; }
  done
}
fixed_metrics() { cut -d, -f1-5 "$1"; }
source "$repo/tests/common/same_checkpoint.sh"

start=$SECONDS
echo "soak: $steps steps of the tiny MoE VLM at cp 2 x dp 2 (seq_len $seq_len, a checkpoint every $every), $kills kills, seed $seed"
run reference
wait "$job" || { tail -n 20 "$work/reference.log" >&2; echo "soak: the uninterrupted run failed" >&2; exit 1; }
echo "soak: uninterrupted run done in $((SECONDS - start)) s"

resume=()
for ((k = 1; k <= kills; k++)); do
  done_step=$(last_step "$work/faulted.jsonl")
  done_step=${done_step:-0}
  # The kill's step: uniform over what is left, leaving room for the remaining kills and a final stretch.
  room=$((steps - done_step - (kills - k + 1) * every))
  [ "$room" -gt 0 ] || room=1
  at=$((done_step + 1 + (RANDOM * 32768 + RANDOM) % room))
  rank=$((RANDOM % 4))
  run faulted "${resume[@]}"
  while [ "$(last_step "$work/faulted.jsonl")" = "" ] || [ "$(last_step "$work/faulted.jsonl")" -lt "$at" ]; do
    kill -0 "$job" 2>/dev/null || { tail -n 20 "$work/faulted.log" >&2; echo "soak: the job ended before step $at" >&2; exit 1; }
    sleep 0.2
  done
  pid=$(rank_pid "$rank")
  [ -n "$pid" ] || { echo "soak: rank $rank not found" >&2; exit 1; }
  kill -KILL "$pid"
  killed_at=$SECONDS
  wait "$job"
  code=$?
  [ "$code" -ne 0 ] || { echo "soak: the job succeeded although rank $rank was killed" >&2; exit 1; }
  newest=$(ls -d "$work/faulted"/step-* 2>/dev/null | tail -n 1)
  [ -n "$newest" ] || { echo "soak: no checkpoint to resume from" >&2; exit 1; }
  # Every whole checkpoint left equals the uninterrupted run's of the same step, where that one is still kept.
  for ck in "$work/faulted"/step-*; do
    [ -d "$work/reference/${ck##*/}" ] || continue
    same_checkpoint "$ck" "$work/reference/${ck##*/}" || { echo "soak: $ck differs from the uninterrupted run's" >&2; exit 1; }
  done
  echo "soak: kill $k: rank $rank at step $(last_step "$work/faulted.jsonl") (drawn $at), mpirun exit $code" \
    "$((SECONDS - killed_at)) s later; resuming from ${newest##*/}"
  resume=(--resume "$newest")
done
run faulted "${resume[@]}"
wait "$job" || { tail -n 20 "$work/faulted.log" >&2; echo "soak: the final resume failed" >&2; exit 1; }

final=step-$(printf %08d "$steps")
same_checkpoint "$work/faulted/$final" "$work/reference/$final" ||
  { echo "soak: FAILED: the final checkpoint differs from the uninterrupted run's" >&2; exit 1; }
diff <(fixed_metrics "$work/reference.jsonl") <(fixed_metrics "$work/faulted.jsonl") >/dev/null ||
  { echo "soak: FAILED: the metrics differ from the uninterrupted run's" >&2; exit 1; }
echo "soak: PASSED: $steps steps, $kills kills, the final checkpoint and every metrics line equal to the" \
  "uninterrupted run's, byte for byte ($((SECONDS - start)) s in all)"
