#!/usr/bin/env bash
# parallelism.shard = optimizer under a real mpirun gives the bits of shard none at the same grid: every step's loss
# and gradient norm in the metrics, the final checkpoint's weights byte for byte and its AdamW moments value for value
# (each rank writes its shard's; read back here from optimizer.json's files). parallelism.shard = gradients and full give them too when a
# replica runs one micro-batch a step (GRADIENTS = bits); with gradient accumulation (GRADIENTS = rounding) they
# reduce each micro-batch where shard none reduces their sum, so they are held to rounding against none (and full
# to gradients' bits: the same sums added in the same order): every weight of the final checkpoint
# within 9e-5 (1% of the 3 steps' lr 0.003: AdamW normalises an element's update to about lr, and an element whose
# micro-batches nearly cancel may move by a fraction of it; ShardGradients.* in test_train.cpp says more), and
# losses, norms and validation losses within 1e-4 relative: from step 2 on they are computed on weights that already
# differ by up to that 9e-5, and the mock rows' step-3 gradient norm was measured 2.3e-5 apart (a broken reduction or
# gather moves them by whole percents).
#   same_bits_shard_mpirun.sh WORKDIR RINGFLEX MPIEXEC... -- RANKS GRADIENTS GRID_SETS...
set -euo pipefail
source "$(dirname "$0")/../common/mpirun_lib.sh"
ranks=$1 gradients=$2
shift 2
case "$gradients" in bits | rounding) ;; *) echo "GRADIENTS must be bits or rounding, not '$gradients'" >&2; exit 2 ;; esac
common=(--set train.seq_len=64 --set train.steps=3 --set train.global_batch=12 --set data.val_rows=2
        --set train.threads=1 --set train.val_every=2 --set optimizer.lr=0.003 --set schedule.warmup_steps=1
        --set optimizer.grad_clip=0.5)
for mode in none optimizer gradients full; do
  train_job "$mode" "$ranks" "$@" --set parallelism.shard=$mode
done
# The metrics of runs A and B: the same losses, norms and validation losses, bit for bit.
same_steps() {
  python3 - "$work/$1.jsonl" "$work/$2.jsonl" <<'PY'
import sys
from train_outputs import expect_same_steps, metrics
a, b = metrics(sys.argv[1]), metrics(sys.argv[2])
expect_same_steps(a, b, 3)
print("same losses and norms:", [r["loss"] for r in b])
PY
}
same_steps none optimizer
# The moments of two checkpoints, equal value for value: shard none's optimizer.safetensors (per parameter) against
# a sharded run's optimizer.json and one file a rank (flat ranges of the trainable layout), or byte for byte against
# a sharded run's optimizer.safetensors (experts held apart, parallelism.ep > 1: the writer gathers the moments whole).
same_moments() {
  if [ ! -e "$2/optimizer.json" ]; then
    cmp "$1/optimizer.safetensors" "$2/optimizer.safetensors"
    return
  fi
  python3 -c 'import sys; from train_outputs import expect_sharded_moments; expect_sharded_moments(*sys.argv[1:])' \
    "$1" "$2"
}
cmp "$work/none/step-00000003/model.safetensors" "$work/optimizer/step-00000003/model.safetensors"
same_moments "$work/none/step-00000003" "$work/optimizer/step-00000003"
echo "shard optimizer: same weights' bytes, same moments (one file a rank)"
for file in "$work/gradients/step-00000003"/model.safetensors "$work/gradients/step-00000003"/optimizer*.safetensors; do
  cmp "$file" "$work/full/step-00000003/$(basename "$file")"
done
same_steps gradients full
# The exposed communication: a wait time, reported by the sharded modes only.
python3 - "$work" <<'PY'
import os, sys
from train_outputs import metrics
def lines(name):
    return metrics(os.path.join(sys.argv[1], name + ".jsonl"))
assert all(line["shard_comm_wait_s"] >= 0 for line in lines("gradients") + lines("full")), lines("gradients")
assert all("shard_comm_wait_s" not in line for line in lines("none"))
PY
echo "shard full: shard gradients' losses, norms and checkpoint bytes"
if [ "$gradients" = bits ]; then
  cmp "$work/none/step-00000003/model.safetensors" "$work/gradients/step-00000003/model.safetensors"
  same_moments "$work/none/step-00000003" "$work/gradients/step-00000003"
  same_steps none gradients
  echo "shard gradients: same losses, norms and checkpoint bytes"
else
  python3 - "$work/none.jsonl" "$work/gradients.jsonl" "$work/none/step-00000003/model.safetensors" \
    "$work/gradients/step-00000003/model.safetensors" <<'PY'
import sys
from train_outputs import EXACT_KEYS, max_abs_difference, metrics
none, shard = metrics(sys.argv[1]), metrics(sys.argv[2])
assert len(none) == len(shard) == 3, (len(none), len(shard))
for a, b in zip(none, shard):
    for key in EXACT_KEYS:
        x, y = a.get(key), b.get(key)
        assert (x is None) == (y is None), f"step {a['step']}: {key} {x!r} vs {y!r}"
        if x is not None:
            assert abs(x - y) <= 1e-4 * abs(x), f"step {a['step']}: {key} {x!r} vs {y!r}"
worst = max_abs_difference(sys.argv[3], sys.argv[4])
assert worst <= 9e-5, f"weights differ by up to {worst}"
print("shard gradients: losses and norms within 1e-4 relative, weights within", worst)
PY
fi
