#!/usr/bin/env bash
# model.train_vision with train.recompute true against false under a real mpirun: the tower that keeps each layer's
# input only and recomputes the layer in its backward (as the decoder does) gives the bits of the tower that keeps
# every activation. Every step's loss, gradient norm and validation loss are equal, and the final checkpoint's files
# byte for byte: the weights (the tower's among them, moved by its gradients) and the AdamW moments (a function of
# the gradients alone from the same start, so the tower's gradients were the same bits at every step). The tower ran:
# some step reports a tower share above 0.
#   recompute_vision_mpirun.sh WORKDIR RINGFLEX MPIEXEC... -- RANKS SETS...
set -euo pipefail
source "$(dirname "$0")/../common/mpirun_lib.sh"
ranks=$1
shift
common=(--set model.builtin=tiny_dense --set model.init_std=0.1 --set model.train_vision=true
        --set train.seq_len=128 --set train.steps=3 --set train.global_batch=2 --set data.val_rows=2
        --set train.threads=1 --set train.val_every=2 --set optimizer.lr=0.003 --set schedule.warmup_steps=1)
for recompute in true false; do
  train_job "$recompute" "$ranks" "$@" --set train.recompute=$recompute
done
python3 - "$work/true.jsonl" "$work/false.jsonl" <<'PY'
import sys
from train_outputs import expect_same_steps, metrics
recompute, keep = metrics(sys.argv[1]), metrics(sys.argv[2])
expect_same_steps(recompute, keep, 3)
assert max(line.get("tower_share", 0) for line in recompute) > 0, "the tower never ran"
print("same losses and norms:", [line["loss"] for line in recompute])
PY
files=("$work/true/step-00000003"/*.safetensors)
[ "${#files[@]}" -ge 2 ] || { echo "expected the weights and the moments, found ${files[*]}" >&2; exit 1; }
for file in "${files[@]}"; do
  cmp "$file" "$work/false/step-00000003/$(basename "$file")"
done
echo "train.recompute true and false: the same bits (${#files[@]} files)"
