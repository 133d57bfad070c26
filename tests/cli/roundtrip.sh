#!/usr/bin/env bash
# One `ringflex attn` round trip: generate an input, run ringflex on it, check the output against the scalar
# reference on the same input.
#   roundtrip.sh ATTN_CASE WORKDIR "MAKE_OPTIONS" "ATTN_OPTIONS" COMMAND...
# COMMAND is how to start ringflex (e.g. `path/ringflex`, or `mpirun -n 1 path/ringflex`); ATTN_OPTIONS go to
# both ringflex and the checker, which must agree on the mask.
set -euo pipefail
attn_case=$1 workdir=$2 make_options=$3 attn_options=$4
shift 4
mkdir -p "$workdir"
in="$workdir/in.safetensors" out="$workdir/out.safetensors"
rm -f "$out"
# shellcheck disable=SC2086  # the option strings are word lists
"$attn_case" make "$in" $make_options
# shellcheck disable=SC2086
"$@" attn --in "$in" --out "$out" $attn_options
# shellcheck disable=SC2086
"$attn_case" check "$in" "$out" $attn_options
