#!/usr/bin/env bash
# model.train_vision under parallelism.shard = full resumes bit for bit under a real mpirun (RANKS ranks, the model
# and grid in GRID_SETS): a run of 3 steps saves at step 2 and 3; resumed from step 2 (each rank loading its pieces of
# the tower's parameters and of the moments straight into the sharded store, or with parallelism.ep > 1 the files
# whole and keeping its parts, the held experts' and the sharded store's; the tower's groups gathered from them
# as it computes), its step 3 has the uninterrupted run's loss and gradient norm and writes the same weights byte for byte.
# Every value is made by the same operations in the same order either way, so only a piece or moment loaded into the
# wrong place (or a tower group gathered from stale weights) could change a bit.
#   train_vision_shard_resume_mpirun.sh WORKDIR RINGFLEX MPIEXEC... -- RANKS GRID_SETS...
set -euo pipefail
source "$(dirname "$0")/../common/mpirun_lib.sh"
ranks=$1
shift
common=(--set model.train_vision=true --set parallelism.shard=full --set train.seq_len=64 --set train.steps=3
        --set data.val_rows=2 --set train.threads=1 --set train.val_every=0 --set optimizer.lr=0.003
        --set schedule.warmup_steps=1 --set checkpoint.every=2)
train_job whole "$ranks" "$@"
train_job resumed "$ranks" "$@" --resume "$work/whole/step-00000002"
cmp "$work/whole/step-00000003/model.safetensors" "$work/resumed/step-00000003/model.safetensors"
python3 - "$work/whole.jsonl" "$work/resumed.jsonl" <<'PY'
import json, sys
whole = [json.loads(l) for l in open(sys.argv[1])]
resumed = [json.loads(l) for l in open(sys.argv[2])]
assert len(whole) == 3 and len(resumed) == 1 and resumed[0]["step"] == 3, (len(whole), resumed)
for key in ("loss", "grad_norm"):
    assert whole[2][key] == resumed[0][key], f"step 3: {key} {whole[2][key]!r} vs {resumed[0][key]!r}"
print("train_vision under shard full: resumed step 3 bit for bit", resumed[0]["loss"])
PY
