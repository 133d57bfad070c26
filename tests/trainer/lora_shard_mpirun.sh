#!/usr/bin/env bash
# LoRA under parallelism.shard = optimizer, under a real mpirun: the adapters' AdamW moments sharded over the ranks
# (one moment file a rank), the frozen base whole on every rank. Every step's loss, gradient norm and validation loss,
# the final adapter file byte for byte and the moments value for value are those of shard none at the same grid (an
# element's update depends on that element alone; the reduce-scatter sums in the all-reduce's rank order). And a
# resume of the sharded run's step-2 checkpoint (its moments one file a rank) under shard none writes the same step-3
# adapters.
#   lora_shard_mpirun.sh WORKDIR RINGFLEX MPIEXEC... -- RANKS GRID_SETS...
set -euo pipefail
source "$(dirname "$0")/../common/mpirun_lib.sh"
ranks=$1
shift
common=(--set model.lora.rank=2 --set model.lora.alpha=4 --set train.seq_len=64 --set train.steps=3
        --set train.global_batch=6 --set data.val_rows=2 --set train.threads=1 --set train.val_every=2
        --set optimizer.lr=0.003 --set optimizer.grad_clip=0.5 --set checkpoint.every=2)
for mode in none optimizer; do
  train_job "$mode" "$ranks" "$@" --set parallelism.shard=$mode
done
cmp "$work/none/step-00000003/adapter_model.safetensors" "$work/optimizer/step-00000003/adapter_model.safetensors"
train_job resumed "$ranks" "$@" --set parallelism.shard=none --resume "$work/optimizer/step-00000002"
cmp "$work/none/step-00000003/adapter_model.safetensors" "$work/resumed/step-00000003/adapter_model.safetensors"
python3 - "$work" "$ranks" <<'PY'
import os, sys
from train_outputs import expect_same_steps, expect_sharded_moments, metrics
work, ranks = sys.argv[1], int(sys.argv[2])
expect_same_steps(metrics(os.path.join(work, "none.jsonl")), metrics(os.path.join(work, "optimizer.jsonl")), 3)
layout = expect_sharded_moments(os.path.join(work, "none", "step-00000003"),
                                os.path.join(work, "optimizer", "step-00000003"))
assert layout["ranks"] == ranks, layout["ranks"]
names = [p["name"] for p in layout["parameters"]]
assert names and all(".lora_A." in n or ".lora_B." in n for n in names), names[:4]
print(f"LoRA shard optimizer over {ranks} ranks: shard none's losses, norms, adapter bytes and moments "
      f"({len(names)} adapter tensors); resumed under shard none, the same adapters")
PY
