#!/usr/bin/env bash
# Issue 26: a training job under mpirun that meets a fault fails cleanly, and its last checkpoint resumes bit-exact.
#   faults.sh WORKDIR RINGFLEX MPIEXEC... -- RANKS GRID_OPTION...
# The faults: a full disk (io::write_all's hook, RINGFLEX_FAIL_WRITE=N:TEXT, DEVELOPERS.md) at each file of the
# step-4 checkpoint, at a metrics line and at the loss picture; a file-size limit (ulimit -f, on the ranks only:
# mpirun's own files need more); rank 1 SIGKILLed, and rank 1 SIGSTOPped, mid-run. For each: the exit code, one
# identical "ringflex: error:" line on every rank naming the file and the rank (no MPI_Abort: the ranks agree),
# no temporaries left, every checkpoint and metrics line written equal to a fault-free run's, and --resume from
# the checkpoint directory finishing with the fault-free run's final checkpoint byte for byte.
# The oracle is that fault-free run of the same config (deterministic: the same bits at every run).
set -uo pipefail
source "$(dirname "$0")/../common/mpirun_lib.sh"
ranks=$1
shift
grid=("$@")
# --timeout: generous for the runs that must not time out (the other ranks wait in an agreement while rank 0 saves,
# and a loaded machine's fsync can take seconds), short for the run whose rank 1 is stopped.
readonly timeout_s=60 stopped_timeout_s=5 bound_s=90
readonly size_limit_kib=1500  # above model.safetensors, below optimizer.safetensors

config=(--set model.builtin=tiny_dense --set train.seq_len=64 --set data.val_rows=2 --set train.threads=1
        --set train.val_every=2 --set checkpoint.every=2 --set checkpoint.keep=100 "${grid[@]}")
current=""
fail() {
  echo "faults ($current): $1" >&2
  [ -f "$work/$current/stderr" ] && { echo "--- stderr:" >&2; cat "$work/$current/stderr" >&2; }
  exit 1
}

# run NAME STEPS [ringflex options...]: the job with its outputs in $work/NAME; sets (and returns) $code. `wrap` (an array,
# normally empty) goes between mpirun and ringflex.
wrap=()
run() {
  local dir=$work/$1 steps=$2
  shift 2
  mkdir -p "$dir"
  "${launcher[@]}" -n "$ranks" "${wrap[@]}" "$ringflex" train "${config[@]}" --set train.steps="$steps" \
    --set checkpoint.dir="$dir/ck" --metrics "$dir/m.jsonl" --timeout "${job_timeout:-$timeout_s}" "$@" \
    >/dev/null 2>>"$dir/stderr"
  code=$?
  return "$code"
}


# The deterministic part of a metrics line: step, loss, lr, grad_norm, tokens (throughput and memory vary).
fixed_metrics() { cut -d, -f1-5 "$1"; }

# The failed run in $work/NAME ended with exit $code: one line on every rank matching REGEX, no temporaries, whole
# metrics lines and checkpoints equal to the reference run's.
check_failed_cleanly() {
  local dir=$work/$1 regex=$2
  [ "$code" -eq 1 ] || fail "exit code $code, expected 1 (main's failure code, through mpirun)"
  local errors
  errors=$(grep '^ringflex: error: ' "$dir/stderr")
  [ "$(printf '%s\n' "$errors" | grep -c .)" -eq "$ranks" ] || fail "expected $ranks error lines"
  [ "$(printf '%s\n' "$errors" | sort -u | wc -l)" -eq 1 ] || fail "the ranks printed different lines"
  grep -Eq -- "$regex" <<<"${errors%%$'\n'*}" || fail "the error line does not match /$regex/"
  ! grep -q 'MPI_ABORT' "$dir/stderr" || fail "the job was aborted (MPI_ABORT) although the ranks could agree"
  check_outputs "$1" no_temporaries
}

# The outputs in $work/NAME: whole metrics lines equal to the reference's, checkpoints equal to the reference's,
# and (unless the second argument says otherwise) no temporaries.
check_outputs() {
  local dir=$work/$1
  if [ "${2:-}" = no_temporaries ] && [ -n "$(find "$dir" -name '.*' -print -quit)" ]; then
    fail "temporaries left: $(find "$dir" -name '.*' | tr '\n' ' ')"
  fi
  if [ -s "$dir/m.jsonl" ]; then
    [ "$(tail -c 1 "$dir/m.jsonl" | od -An -c | tr -d ' ')" = '\n' ] || fail "the metrics file ends in a cut-off line"
    local n
    n=$(wc -l <"$dir/m.jsonl")
    diff <(fixed_metrics "$dir/m.jsonl") <(fixed_metrics "$work/$ref/m.jsonl" | head -n "$n") >/dev/null ||
      fail "the metrics lines differ from the fault-free run's"
  fi
  local ck
  for ck in "$dir"/ck/step-*; do
    [ -d "$ck" ] || continue
    same_checkpoint "$ck" "$work/$ref/ck/$(basename "$ck")" || fail "$ck differs from the fault-free run's"
  done
}

# --resume from $work/NAME's checkpoint directory runs to STEPS and ends on the reference's final checkpoint.
check_resumes() {
  local name=$1 steps=$2
  current="$name, resumed"
  run "$name" "$steps" --resume "$work/$name/ck"
  [ "$code" -eq 0 ] || fail "the resume failed (exit $code)"
  check_outputs "$name" no_temporaries
  diff <(fixed_metrics "$work/$name/m.jsonl") <(fixed_metrics "$work/$ref/m.jsonl" | head -n "$steps") >/dev/null ||
    fail "the metrics after the resume differ from the fault-free run's"
  same_checkpoint "$work/$name/ck/step-$(printf %08d "$steps")" "$work/$ref/ck/step-$(printf %08d "$steps")" ||
    fail "the resumed run's final checkpoint differs from the fault-free run's"
}

# The references: 4 and 12 steps (the schedule depends on train.steps), a checkpoint every 2 (all kept), the
# metrics and the picture.
for steps in 4 12; do
  current=reference$steps
  run "ref$steps" "$steps"
  [ "$code" -eq 0 ] || fail "the fault-free run failed (exit $code)"
done
ref=ref4

# A full disk at each file of the step-4 checkpoint, at step 3's metrics line, and at the loss picture. The step-2
# checkpoint was written before each, so it must be intact, and resuming from it must end on the reference.
disk_full() {  # NAME HOOK REGEX
  current=$1
  RINGFLEX_FAIL_WRITE=$2 run "$1" 4
  check_failed_cleanly "$1" "^ringflex: error: rank 0: .*$3: write failed: No space left on device$"
  [ -d "$work/$1/ck/step-00000002" ] || fail "the step-2 checkpoint is missing"
}
disk_full config 2:config.json '/\.step-00000004\.tmp/config\.json'
disk_full weights 5:step-00000004.tmp/model.safetensors '/\.step-00000004\.tmp/model\.safetensors'
disk_full moments 1:step-00000004.tmp/optimizer.safetensors '/\.step-00000004\.tmp/optimizer\.safetensors'
disk_full state 1:step-00000004.tmp/trainer_state.json '/\.step-00000004\.tmp/trainer_state\.json'
disk_full metrics 3:m.jsonl '/m\.jsonl'
[ "$(wc -l <"$work/metrics/m.jsonl")" -eq 2 ] || fail "the metrics file does not hold steps 1 and 2"
disk_full picture 1:loss.svg '/ck/loss\.svg'
[ ! -e "$work/picture/ck/loss.svg" ] || fail "a loss picture was left by the failed write"
for name in config weights moments state metrics picture; do check_resumes "$name" 4; done
# The picture at step 4, after the step-4 checkpoint: the step-2 picture stays whole.
disk_full picture_later 2:loss.svg '/ck/loss\.svg'
[ -d "$work/picture_later/ck/step-00000004" ] || fail "the step-4 checkpoint is missing"
tail -n 1 "$work/picture_later/ck/loss.svg" | grep -qx '</svg>' || fail "the step-2 loss picture is not whole"

# A file-size limit: the first checkpoint's optimizer.safetensors is larger than it (EFBIG, SIGXFSZ ignored).
current=size_limit
# Open MPI's shared-memory transport would meet the limit too: the ranks talk over TCP here.
wrap=(--mca btl self,tcp bash -c "ulimit -f $size_limit_kib && exec \"\$0\" \"\$@\"")
run size_limit 4
wrap=()
check_failed_cleanly size_limit '^ringflex: error: rank 0: .*/\.step-00000002\.tmp/optimizer\.safetensors: write failed: File too large$'
[ "$(wc -l <"$work/size_limit/m.jsonl")" -eq 2 ] || fail "the metrics file does not hold steps 1 and 2"

# The multi-file layout: the weights in model-0000k-of-0000n.safetensors and an index (checkpoint.max_shard_size) and
# the moments one file a rank (shard optimizer), against a fault-free run of that config. A full disk at the second
# weight file (rank 0 writes the weights), at the index, and at rank 1's moment file (the line names rank 1): the
# step-2 checkpoint stays intact, nothing temporary is left, and resuming ends on the reference.
plain_config=("${config[@]}")
config+=(--set checkpoint.max_shard_size=200KB --set parallelism.shard=optimizer)
current=reference_multi
run ref_multi 4
[ "$code" -eq 0 ] || fail "the fault-free multi-file run failed (exit $code)"
ls "$work/ref_multi/ck/step-00000004/model-00002-of-"* >/dev/null 2>&1 || fail "the weights are not in several files"
ref=ref_multi
multi_full() {  # NAME HOOK RANK REGEX
  current=$1
  RINGFLEX_FAIL_WRITE=$2 run "$1" 4
  check_failed_cleanly "$1" "^ringflex: error: rank $3: .*$4: write failed: No space left on device$"
  [ -d "$work/$1/ck/step-00000002" ] || fail "the step-2 checkpoint is missing"
}
multi_full multi_weights 3:step-00000004.tmp/model-00002-of- 0 \
  '/\.step-00000004\.tmp/model-00002-of-[0-9]{5}\.safetensors'
multi_full multi_index 1:step-00000004.tmp/model.safetensors.index.json 0 \
  '/\.step-00000004\.tmp/model\.safetensors\.index\.json'
multi_full multi_moments 1:step-00000004.tmp/optimizer-00002-of- 1 \
  "/\\.step-00000004\\.tmp/optimizer-00002-of-0000$ranks\\.safetensors"
for name in multi_weights multi_index multi_moments; do check_resumes "$name" 4; done
config=("${plain_config[@]}")

ref=ref12
# Rank 1 of the job in $work/NAME once the step-2 checkpoint exists (the job is in step 3 or later); sets $pid (empty
# if the job ended first).
rank1_after_step2() {  # NAME
  local start
  start=$(date +%s)
  pid=""
  while [ -z "$pid" ] && kill -0 "$launcher_pid" 2>/dev/null; do
    [ -d "$work/$1/ck/step-00000002" ] && pid=$(rank_pid 1)
    [ $(($(date +%s) - start)) -lt "$bound_s" ] || { kill -9 "$launcher_pid"; fail "no step-2 checkpoint"; }
    sleep 0.02
  done
}
# The newest checkpoint the killed job left is whole (equal to the reference's); the resume removes what the kill
# left of a save and ends on the reference.
for signal in KILL STOP; do
  current=$signal
  job_timeout=$([ "$signal" = STOP ] && echo "$stopped_timeout_s" || echo "$timeout_s")
  run "$signal" 12 &
  launcher_pid=$!
  job_timeout=""
  rank1_after_step2 "$signal"
  [ -n "$pid" ] || fail "the job ended before rank 1 could be signalled"
  kill -"$signal" "$pid"
  wait_launcher "$launcher_pid" "$bound_s" "$pid" ||
    fail "the job was still running ${bound_s} s after rank 1 was $signal (--timeout ${stopped_timeout_s})"
  kill -CONT "$pid" 2>/dev/null
  [ "$code" -ne 0 ] || fail "the job succeeded"
  if [ "$signal" = STOP ]; then
    grep -q '^ringflex: error: .*within .* s (--timeout)\|^ringflex: error: .*timed out\|^ringflex: error: .*--timeout' \
      "$work/$signal/stderr" || fail "no rank reported the silent peer"
  fi
  check_outputs "$signal"
  check_resumes "$signal" 12
done
exit 0
