#!/usr/bin/env bash
# Training over several hosts for real (issue 38): the tiny MoE VLM at cp 2 x dp 2 over 4 hosts made as network
# namespaces (netns_hosts.sh), one rank a host, Open MPI's TCP transport only (--mca btl tcp,self: no shared memory
# between hosts), launched from a head namespace through scripts/ringflex-mpirun with a launch agent that enters
# each host. The oracle is the same job on this one host under the ordinary launcher (shared memory), whose bits
# the hosts must give: the deterministic metrics (step, loss, lr, grad_norm, tokens) and every checkpoint's bytes.
#   hosts_train.sh WORKDIR RINGFLEX MPIEXEC... -- MODE
# MODE:
#   bits  the hosts' run equals the one-host run; each host's link carried the training's traffic (its veth's byte
#         counter), and every metrics line has comm_wait_s
#   slow  the same with every link slowed by netem (1 ms each way, 1 Gbit/s; a kernel without sch_netem gets the rate
#         alone, and the test says so): the same bits, comm_wait_s reported
#   cut   host 2's link taken down (rank 1) after the step-4 checkpoint; then
#   kill  host 2's rank SIGKILLed after the step-4 checkpoint; then, for cut and kill: the job ends (mpirun non-zero)
#         within --timeout + RINGFLEX_MPIRUN_GRACE + a margin (docs/cluster.md), a line names rank 1, no process is
#         left in any namespace, every checkpoint left equals the one-host run's; the newest resumes on hosts 3 and 4
#         at cp 2 x dp 1 with the bits of the same resume on one host, and losses within 1e-4 relative of the
#         uninterrupted 4-rank run (tests/trainer/same_loss_mpirun.sh's bound for another grid: the grid changes the
#         order of the float32 gradient sums, which AdamW turns into steps of up to lr in near-zero gradient entries;
#         measured 2.5e-5 by step 14 here; a lost or repeated row moves the loss by 1e-2 or more).
set -uo pipefail
source "$(dirname "$0")/../common/mpirun_lib.sh"
source "$(dirname "$0")/netns_hosts.sh"
mode=${1:?hosts_train.sh: MODE (bits, slow, cut or kill) expected}
# --timeout: a peer silent this long ends the job. The grace: what scripts/ringflex-mpirun gives mpirun after the job
# failed. The margin: the watcher's polling and the launcher's exit on a loaded 2-core machine (measured: the cut
# ended 16.3 s after the link went down at --timeout 10 and grace 5).
readonly timeout_s=10 grace_s=5 margin_s=10
export RINGFLEX_MPIRUN_GRACE=$grace_s
steps=6
[ "$mode" = bits ] || [ "$mode" = slow ] || steps=16
common=(--set model.builtin=tiny_moe_vlm --set train.seq_len=64 --set data.val_rows=2 --set train.threads=1
        --set train.val_every=0 --set train.global_batch=4 --set checkpoint.every=2 --set checkpoint.keep=100
        --set "train.steps=$steps" --timeout "$timeout_s")
grid=(--set parallelism.cp=2 --set parallelism.dp=2)
fail() {
  echo "hosts_train ($mode): $1" >&2
  [ -f "${job_err:-}" ] && { echo "--- the hosts' job's stderr ($job_err):" >&2; cat "$job_err" >&2; }
  exit 1
}

# The deterministic part of a metrics file (tests/trainer/faults.sh's): step, loss, lr, grad_norm, tokens.
fixed_metrics() { cut -d, -f1-5 "$1"; }
# Every checkpoint in $work/NAME equals the one in $work/REF of the same step.
same_checkpoints() {
  local name=$1 ref=$2 ck n=0
  for ck in "$work/$name"/step-*; do
    same_checkpoint "$ck" "$work/$ref/${ck##*/}" || fail "$ck differs from $ref's"
    n=$((n + 1))
  done
  [ "$n" -gt 0 ] || fail "no checkpoint in $work/$name"
}
# No process left in any namespace of the test.
nothing_left() {
  local ns left=""
  for ns in "${hosts_made[@]}"; do
    [ -z "$(ip netns pids "$ns")" ] || left+=" $ns:$(for p in $(ip netns pids "$ns"); do printf ' %s' "$(cat "/proc/$p/comm" 2>/dev/null)"; done)"
  done
  [ -z "$left" ] || fail "processes left behind:$left"
}
tx_bytes() { ip netns exec "${host_ns[$1]}" cat /sys/class/net/eth0/statistics/tx_bytes; }

hosts_up 4  # first: where namespaces cannot be made, nothing else runs
# The one-host oracle.
"${launcher[@]}" -n 4 "$ringflex" train "${common[@]}" "${grid[@]}" --set checkpoint.dir="$work/one" \
  --metrics "$work/one.jsonl" >/dev/null 2>"$work/one.err" || { cat "$work/one.err" >&2; fail "the one-host run failed"; }

if [ "$mode" = slow ]; then
  slow_links 1ms 1gbit || fail "tc: cannot slow the links"
  echo "hosts_train (slow): every link slowed by $hosts_slowed"
fi
# hosts_job NAME RANKS HOSTFILE ARGS...: the job over the hosts of HOSTFILE, in the background ($job_pid).
hosts_job() {
  local name=$1 ranks=$2
  # shellcheck disable=SC2034  # read by hosts_mpirun
  hostfile=$3
  job_err=$work/$name.err
  shift 3
  hosts_mpirun -n "$ranks" --mca btl tcp,self "$ringflex" train "${common[@]}" "$@" \
    --set checkpoint.dir="$work/$name" --metrics "$work/$name.jsonl" >/dev/null 2>"$work/$name.err" &
  job_pid=$!
}

if [ "$mode" = bits ] || [ "$mode" = slow ]; then
  declare -a sent_before
  for i in 1 2 3 4; do sent_before[i]=$(tx_bytes "$i"); done
  hosts_job hosts 4 "$work/hostfile" "${grid[@]}"
  wait "$job_pid" || fail "the hosts' run failed (exit $?)"
  # The training's traffic crossed every link: K/V, gradients and the dp reduction are megabytes a step, the
  # launch's own control messages kilobytes.
  for i in 1 2 3 4; do
    sent=$(($(tx_bytes "$i") - sent_before[i]))
    [ "$sent" -gt 1000000 ] || fail "host $i sent only $sent bytes over its link"
  done
  diff <(fixed_metrics "$work/one.jsonl") <(fixed_metrics "$work/hosts.jsonl") >&2 ||
    fail "the hosts' metrics differ from the one-host run's"
  same_checkpoints hosts one
  python3 - "$work/hosts.jsonl" "$steps" <<'PY' || fail "comm_wait_s is not reported on every step"
import json, statistics, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
assert len(lines) == int(sys.argv[2]), len(lines)
waits = [l["comm_wait_s"] for l in lines]
assert all(w >= 0 for w in waits), waits
print(f"comm_wait_s per step: median {statistics.median(waits):.4f} s, max {max(waits):.4f} s")
PY
  nothing_left
  echo "hosts_train ($mode): the one-host bits over 4 hosts"
  exit 0
fi

hosts_job hosts 4 "$work/hostfile" "${grid[@]}"
start=$SECONDS
until [ -d "$work/hosts/step-00000004" ]; do
  kill -0 "$job_pid" 2>/dev/null || fail "the job ended before its step-4 checkpoint"
  [ $((SECONDS - start)) -lt 120 ] || fail "no step-4 checkpoint after 120 s"
  sleep 0.05
done
if [ "$mode" = cut ]; then
  link_down 2 || fail "cannot take host 2's link down"
else
  victim=""
  for pid in $(host_pids 2); do [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = ringflex ] && victim=$pid; done
  [ -n "$victim" ] || fail "no ringflex process on host 2"
  kill -KILL "$victim"
fi
cut_at=$SECONDS
bound_s=$((timeout_s + grace_s + margin_s))
while kill -0 "$job_pid" 2>/dev/null; do
  if [ $((SECONDS - cut_at)) -gt "$bound_s" ]; then
    fail "the job still ran ${bound_s} s after host 2 was lost ($mode)"
  fi
  sleep 0.1
done
wait "$job_pid"
code=$?
ended_s=$((SECONDS - cut_at))
[ "$code" -ne 0 ] || fail "the job succeeded although host 2 was lost"
if [ "$mode" = cut ]; then
  grep -Eq '^ringflex: error: rank [0-9]+: timed out after [0-9]+ ms .*from rank( [0-9]+,)* 1\b' "$job_err" ||
    fail "no rank's line names rank 1"
else
  grep -Eq 'process rank 1 .* exited on signal 9' "$job_err" || fail "no line names rank 1's death"
fi
nothing_left
# The newest checkpoint may be a save the loss cut short: the resume removes such a temporary, and every whole one is
# the oracle's.
same_checkpoints hosts one
last=$(basename "$(ls -d "$work/hosts"/step-* | tail -n 1)")
echo "hosts_train ($mode): the job ended ${ended_s} s after host 2 was lost (exit $code), newest checkpoint $last"

# The resume on the remaining hosts 3 and 4 at cp 2 x dp 1, against the same resume on one host.
small=(--set parallelism.cp=2 --set parallelism.dp=1)
printf '10.200.0.3 slots=1\n10.200.0.4 slots=1\n' >"$work/hostfile34"
"${launcher[@]}" -n 2 "$ringflex" train "${common[@]}" "${small[@]}" --resume "$work/hosts/$last" \
  --set checkpoint.dir="$work/one_small" --metrics "$work/one_small.jsonl" >/dev/null 2>"$work/one.err" ||
  { cat "$work/one.err" >&2; fail "the one-host resume failed"; }
hosts_job resumed 2 "$work/hostfile34" "${small[@]}" --resume "$work/hosts/$last"
wait "$job_pid" || fail "the resume on hosts 3 and 4 failed (exit $?)"
diff <(fixed_metrics "$work/one_small.jsonl") <(fixed_metrics "$work/resumed.jsonl") >&2 ||
  fail "the resume over hosts 3 and 4 differs from the same resume on one host"
same_checkpoint "$work/resumed/step-$(printf %08d "$steps")" "$work/one_small/step-$(printf %08d "$steps")" ||
  fail "the resumed run's final checkpoint differs from the one-host resume's"
python3 - "$work/one.jsonl" "$work/resumed.jsonl" <<'PY' || fail "the resumed losses left the uninterrupted run's"
import json, sys
ref = {l["step"]: l["loss"] for l in map(json.loads, open(sys.argv[1]))}
run = [json.loads(l) for l in open(sys.argv[2])]
assert run[-1]["step"] == max(ref), (run[-1]["step"], max(ref))
for l in run:
    rel = abs(l["loss"] - ref[l["step"]]) / ref[l["step"]]
    assert rel < 1e-4, f"step {l['step']}: {l['loss']} vs {ref[l['step']]} (relative {rel:.2e})"
PY
nothing_left
echo "hosts_train ($mode): resumed from $last on hosts 3 and 4 at cp 2 x dp 1 with the one-host bits"
