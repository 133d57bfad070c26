#!/usr/bin/env bash
# The same training under real mpirun: one rank (cp 1, dp 1) against a launch of RANKS ranks with the grid given
# as --set arguments; every step's loss and label-token count must agree. Tolerance 1e-4 relative, looser than
# the 1e-5 of the in-process grid test (tests/trainer/test_train.cpp): across processes the one-rank run and the
# grid take different float32 summation orders, and AdamW's update m / (sqrt(v) + eps) turns rounding-level
# differences in near-zero gradient entries into steps of up to lr, so by step 5 the loss moves by ~1e-5 (measured
# 1.5e-5 with the portable build). A lost row or a wrong denominator moves it by >= 1e-2, 100x above the bound.
#   same_loss_mpirun.sh WORKDIR RINGFLEX MPIEXEC... -- RANKS GRID_SETS...
set -euo pipefail
source "$(dirname "$0")/../common/mpirun_lib.sh"
ranks=$1
shift
common=(--set train.seq_len=96 --set train.steps=5 --set train.global_batch=4 --set data.val_rows=2
        --set train.threads=1 --set train.val_every=0 --set optimizer.lr=0.003 --set schedule.warmup_steps=2)
"$ringflex" train "${common[@]}" "$@" --set parallelism.cp=1 --set parallelism.dp=1 --metrics "$work/one.jsonl" >/dev/null
"${launcher[@]}" -n "$ranks" "$ringflex" train "${common[@]}" "$@" --metrics "$work/grid.jsonl" >/dev/null
python3 - "$work/one.jsonl" "$work/grid.jsonl" <<'PY'
import json, sys
one = [json.loads(l) for l in open(sys.argv[1])]
grid = [json.loads(l) for l in open(sys.argv[2])]
assert len(one) == len(grid) == 5, (len(one), len(grid))
for a, b in zip(one, grid):
    assert a["tokens"] == b["tokens"], (a, b)
    rel = abs(a["loss"] - b["loss"]) / a["loss"]
    assert rel < 1e-4, f"step {a['step']}: loss {a['loss']} vs {b['loss']} (relative {rel:.2e})"
print("same losses:", [round(r["loss"], 6) for r in grid])
PY
