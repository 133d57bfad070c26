#!/usr/bin/env bash
# Runs a command that must succeed (or end with the given exit code) AND print output matching a regular expression:
# what CTest's PASS_REGULAR_EXPRESSION cannot say, since a matching output makes CTest ignore the exit code (a line
# printed before a crash would pass). The regex is Perl-compatible and matched against the whole of stdout and
# stderr together, as CTest's is: `^` is the start of the output, `\n` a line break.
#   expect_ok.sh [--code N] [--not REGEX] REGEX COMMAND...
#     --code N      the exit code required (default 0)
#     --not REGEX   the output must not match REGEX (as CTest's FAIL_REGULAR_EXPRESSION)
set -uo pipefail
want=0 reject=""
while [ "$#" -gt 0 ]; do
  case $1 in
    --code) want=$2; shift 2 ;;
    --not) reject=$2; shift 2 ;;
    *) break ;;
  esac
done
# A line break written into the pattern itself (CMake's "\n" in a string) is grep's pattern separator: spelt \n.
regex=${1//$'\n'/\\n}
reject=${reject//$'\n'/\\n}
shift
command="$*"
output_file=$(mktemp)
trap 'rm -f "$output_file"' EXIT
"$@" >"$output_file" 2>&1
code=$?
fail() {
  echo "expect_ok: $1" >&2
  echo "--- output of: $command" >&2
  cat "$output_file" >&2
  exit 1
}
[ "$code" -eq "$want" ] || fail "exit code $code, expected $want"
grep -Pzq -- "$regex" "$output_file" || fail "the output does not match /$regex/"
if [ -n "$reject" ] && grep -Pzq -- "$reject" "$output_file"; then fail "the output matches /$reject/"; fi
exit 0
