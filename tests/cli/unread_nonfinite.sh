#!/usr/bin/env bash
# The property of docs/numerics.md through the real command, at the rank count of COMMAND: for random metadata and
# masks, NaN/±inf in every element of the tokens no result may depend on (padding's q/k/v/dout, keys no query
# reads, rows that read nothing) changes no output bit — the output files are identical byte for byte.
#   unread_nonfinite.sh ATTN_CASE WORKDIR COMMAND...   (COMMAND: `ringflex`, or `mpirun -n P ringflex`)
set -euo pipefail
attn_case=$1 work=$2
shift 2
mkdir -p "$work"
# "make options|mask options": each case has padding, so something is always poisoned (checked below).
cases=(
  "--meta padded --S 150 --D 16 --seed 21|--window 9 --bidirectional-groups"
  "--meta padded --S 97 --D 72 --Hq 4 --Hkv 1 --seed 22|--bidirectional-groups"
  "--meta padded --S 130 --D 8 --B 3 --seed 23|--no-causal --window 5"
  "--meta padded --dtype bf16 --S 200 --D 64 --Hq 2 --Hkv 2 --seed 24|"
  "--meta all_padding --S 40 --D 8 --seed 25|"
)
for c in "${cases[@]}"; do
  make_options=${c%%|*} mask_options=${c#*|}
  # shellcheck disable=SC2086  # option strings are word lists
  "$attn_case" make "$work/clean.st" --dout $make_options $mask_options
  # shellcheck disable=SC2086
  "$attn_case" make "$work/bad.st" --dout $make_options $mask_options --poison-unread
  if cmp -s "$work/clean.st" "$work/bad.st"; then echo "unread_nonfinite: nothing poisoned in: $c" >&2; exit 1; fi
  # shellcheck disable=SC2086
  "$@" attn --in "$work/clean.st" --out "$work/clean_out.st" $mask_options --no-check-finite >/dev/null
  # shellcheck disable=SC2086
  "$@" attn --in "$work/bad.st" --out "$work/bad_out.st" $mask_options --no-check-finite >/dev/null
  if ! cmp "$work/clean_out.st" "$work/bad_out.st"; then
    echo "unread_nonfinite: non-finite values no query reads changed the output in: $c" >&2
    exit 1
  fi
done
