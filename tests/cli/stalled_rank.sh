#!/usr/bin/env bash
# Issue 10 item 6: a stalled peer (SIGSTOP) ends the job within --timeout on every rank, with a message naming the
# peer and the step; bounded in time by this script itself (the test fails, never hangs).
#   stalled_rank.sh WORKDIR RINGFLEX MPIEXEC... -- ATTN_CASE
# Rank 1 is stopped once it has used some CPU time (past MPI start-up, inside the attention job, which is sized
# to run for much longer than that), so the other ranks are left waiting for it in the ring or a collective.
set -uo pipefail
source "$(dirname "$0")/../common/mpirun_lib.sh"
attn_case=$1
readonly ranks=3 timeout_s=5 bound_s=60 stop_after_ticks=30  # ticks: 1/100 s of CPU time (USER_HZ)
"$attn_case" make "$work/in.st" --B 1 --Hq 8 --Hkv 1 --S 6144 --D 128 --dout --no-causal || exit 1
fail() {
  echo "stalled_rank: $1" >&2
  echo "--- stderr:" >&2
  cat "$work/stderr" >&2
  exit 1
}

"${launcher[@]}" -n "$ranks" "$ringflex" attn --in "$work/in.st" --out "$work/out.st" --no-causal \
  --timeout "$timeout_s" >/dev/null 2>"$work/stderr" &
job=$!
start=$(date +%s)
# This job's rank 1, once it has used stop_after_ticks of CPU time.
stalled=""
while [ -z "$stalled" ] && kill -0 "$job" 2>/dev/null; do
  pid=$(rank_pid 1)
  if [ -n "$pid" ]; then
    ticks=$({ awk '{print $14 + $15}' "/proc/$pid/stat"; } 2>/dev/null || echo 0)
    [ "${ticks:-0}" -ge "$stop_after_ticks" ] && stalled=$pid
  fi
  [ $(($(date +%s) - start)) -lt "$bound_s" ] || { kill -9 "$job"; fail "rank 1 never started"; }
  sleep 0.05
done
[ -n "$stalled" ] || fail "the job ended before rank 1 could be stopped"
kill -STOP "$stalled"
stopped_at=$(date +%s)
wait_launcher "$job" "$bound_s" "$stalled" ||
  fail "the job was still running ${bound_s} s after rank 1 stopped (--timeout ${timeout_s})"
kill -9 "$stalled" 2>/dev/null  # normally mpirun has already ended it
[ "$code" -ne 0 ] || fail "the job succeeded with a stopped rank"
# The first rank to give up names the peer it waited for and what for (a ring step, or a collective). That is
# rank 1, or a rank that was itself waiting for rank 1 (in a ring of 3, rank 0 receives from rank 2, which
# receives from rank 1), whichever deadline passes first.
grep -Eq "^ringflex: error: rank [02]: timed out after ${timeout_s}000 ms (.* (to|from) rank [0-9]+ |.*no answer from rank [0-9])" \
  "$work/stderr" || fail "no rank reported the timeout naming a peer"
grep -E "^ringflex: error: " "$work/stderr" | head -n 1
[ -e "$work/out.st" ] && fail "an output was written"
echo "stalled_rank: the job ended $(($(date +%s) - stopped_at)) s after rank 1 stopped (--timeout ${timeout_s})"
exit 0
