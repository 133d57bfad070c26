#!/usr/bin/env bash
# Issue 10 items 3 and 4 through the real command: outputs are all or nothing, and checked before any work.
#   atomic_outputs.sh ATTN_CASE RINGFLEX WORKDIR MPIEXEC...
# Writes fail for real: a file size limit (ulimit -f, with SIGXFSZ ignored so write() returns EFBIG) stands for
# a full disk. Only the ranks get the limit (Open MPI's own shared-memory files would hit it otherwise), and the
# shared-memory transport is left out for the same reason.
set -uo pipefail
attn_case=$1 ringflex=$2 work=$3
shift 3
mpiexec=("$@")
fail() {
  echo "atomic_outputs: $1" >&2
  [ -f "$work/stderr" ] && { echo "--- stderr:" >&2; cat "$work/stderr" >&2; }
  exit 1
}
# limited BLOCKS RANKS COMMAND...: COMMAND on RANKS ranks, each with files capped at BLOCKS x 1024 bytes. Even at
# one rank this goes through mpirun: a singleton MPI start-up writes files of its own that the limit would stop.
limited() {
  local blocks=$1 ranks=$2
  shift 2
  "${mpiexec[@]}" --mca btl self,tcp -n "$ranks" bash -c 'trap "" XFSZ; ulimit -f "$0"; exec "$@"' "$blocks" "$@"
}
# Nothing but the expected names may be left in $work/out (no temporaries).
expect_entries() {
  local got
  got=$(cd "$work/out" && ls -A | sort | tr '\n' ' ')
  [ "$got" = "$1" ] || fail "expected files '$1' in the output folder, found '$got'"
}
rm -rf "$work" && mkdir -p "$work/out" || exit 1
"$attn_case" make "$work/small.st" --B 1 --Hq 1 --Hkv 1 --S 1 --D 1 || exit 1
"$attn_case" make "$work/big.st" --B 1 --Hq 2 --Hkv 1 --S 256 --D 64 --dout || exit 1

# 1. A write cut off part way keeps the previous good output, and leaves no temporary.
"$ringflex" attn --in "$work/small.st" --out "$work/out/o.st" >/dev/null || fail "the good run failed"
cp "$work/out/o.st" "$work/good.st"
limited 8 1 "$ringflex" attn --in "$work/big.st" --out "$work/out/o.st" >/dev/null 2>"$work/stderr" &&
  fail "a write over the size limit succeeded"
grep -q "^ringflex: error: .*/out/o.st: write failed: File too large$" "$work/stderr" || fail "no write error line"
cmp -s "$work/out/o.st" "$work/good.st" || fail "the previous output was changed by the failed write"
expect_entries "o.st "

# 1b. Without the trap: ringflex itself ignores SIGXFSZ, so the kernel's signal does not end it mid-write (with the
# temporary left behind) and the write fails with EFBIG and one line.
"${mpiexec[@]}" --mca btl self,tcp -n 1 bash -c 'trap - XFSZ; ulimit -f 8; exec "$@"' _ \
  "$ringflex" attn --in "$work/big.st" --out "$work/out/o.st" >/dev/null 2>"$work/stderr"
code=$?
[ "$code" -eq 1 ] || fail "a write over the size limit without the trap ended with exit $code, not 1"
grep -q "^ringflex: error: .*/out/o.st: write failed: File too large$" "$work/stderr" || fail "no write error line"
cmp -s "$work/out/o.st" "$work/good.st" || fail "the previous output was changed by the failed write"
expect_entries "o.st "

# 2. One job, all or nothing: --stats fails (8 ranks make it larger than the 1 KiB limit, the main output is
# 144 bytes), so the main output is not left either, on any rank's account.
rm -f "$work/out/o.st"
limited 1 8 "$ringflex" attn --in "$work/small.st" --out "$work/out/o.st" --stats "$work/out/s.json" >/dev/null 2>"$work/stderr" &&
  fail "a --stats write over the size limit succeeded"
[ "$(grep -c '^ringflex: error: .*/out/s.json: write failed: File too large$' "$work/stderr")" -eq 8 ] ||
  fail "expected the --stats write error on each of 8 ranks"
expect_entries ""

# 3. --stats and --out naming one file (through another spelling of the path) is an error, before any work.
"$ringflex" attn --in "$work/small.st" --out "$work/out/x.st" --stats "$work/out/../out/x.st" >/dev/null \
  2>"$work/stderr" && fail "--stats and --out on one file were accepted"
grep -q "^ringflex: error: --stats .* and --out .* name the same file$" "$work/stderr" || fail "no same-file error"
expect_entries ""

# 4. Outputs are checked before anything else: an unwritable --stats is reported even though the input does not
# exist (so nothing was read or computed), on every rank.
"${mpiexec[@]}" -n 2 "$ringflex" attn --in "$work/absent.st" --out "$work/out/o.st" \
  --stats "$work/no_such_dir/s.json" >/dev/null 2>"$work/stderr" && fail "an unwritable --stats was accepted"
[ "$(grep -c '^ringflex: error: .*/no_such_dir/s.json: cannot write: directory .*: No such file or directory$' \
  "$work/stderr")" -eq 2 ] || fail "expected the unwritable --stats error on both ranks"
"$ringflex" attn --in "$work/small.st" --out "$work/out" >/dev/null 2>"$work/stderr" && fail "a folder as --out"
grep -q "^ringflex: error: .*/out: cannot write: it is a directory$" "$work/stderr" || fail "no directory error"
expect_entries ""

# 5. plan: --json and --svg are written together, atomically; naming one file twice is an error.
"$ringflex" plan --generate causal --seq 256 -P 2 --block 64 --json "$work/out/p.json" --svg "$work/out/p.svg" \
  >/dev/null 2>"$work/stderr" || fail "plan failed"
expect_entries "p.json p.svg "
"$ringflex" plan --generate causal --seq 256 -P 2 --block 64 --json "$work/out/p.json" --svg "$work/out/p.json" \
  >/dev/null 2>"$work/stderr" && fail "plan accepted one file for --json and --svg"
grep -q "name the same file$" "$work/stderr" || fail "no plan same-file error"
exit 0
