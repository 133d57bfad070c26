#!/usr/bin/env bash
# Runs a command that must fail the way docs/spec.md §7 asks: a non-zero exit and, on each of RANKS ranks, one line
# "ringflex: error: ..." matching REGEX (the same line on every rank). With RANKS = 1 (no mpirun) stderr must be
# exactly that one line; under mpirun, mpirun's own report of the failed job may follow it.
#   expect_error.sh RANKS REGEX COMMAND...
set -uo pipefail
ranks=$1 regex=$2
shift 2
command="$*"
stderr_file=$(mktemp)
trap 'rm -f "$stderr_file"' EXIT
"$@" >/dev/null 2>"$stderr_file"
code=$?
fail() {
  echo "expect_error: $1" >&2
  echo "--- stderr of: $command" >&2
  cat "$stderr_file" >&2
  exit 1
}
[ "$code" -ne 0 ] || fail "the command succeeded"
errors=$(grep '^ringflex: error: ' "$stderr_file")
[ "$(printf '%s\n' "$errors" | grep -c .)" -eq "$ranks" ] || fail "expected $ranks error line(s)"
[ "$(printf '%s\n' "$errors" | sort -u | wc -l)" -eq 1 ] || fail "the ranks printed different lines"
grep -Eq -- "$regex" <<<"${errors%%$'\n'*}" || fail "the error line does not match /$regex/"
if [ "$ranks" -eq 1 ] && [ "$(wc -l <"$stderr_file")" -ne 1 ]; then fail "more than one line on stderr"; fi
exit 0
