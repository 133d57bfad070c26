#!/usr/bin/env bash
# parallelism.shard = optimizer under a real mpirun gives the bits of shard none at the same grid: every step's loss
# and gradient norm in the metrics, and the final checkpoint's weights and AdamW moments byte for byte (the moments
# gathered from every rank's shard to the writer).
#   same_bits_shard_mpirun.sh WORKDIR RINGFLEX MPIEXEC... -- RANKS GRID_SETS...
set -euo pipefail
work=$1 ringflex=$2
shift 2
launcher=()
while [ "$1" != "--" ]; do launcher+=("$1"); shift; done
shift
ranks=$1
shift
rm -rf "$work"
mkdir -p "$work"
common=(--set train.seq_len=64 --set train.steps=3 --set train.global_batch=12 --set data.val_rows=2
        --set train.threads=1 --set train.val_every=2 --set optimizer.lr=0.003 --set schedule.warmup_steps=1
        --set optimizer.grad_clip=0.5)
for mode in none optimizer; do
  "${launcher[@]}" -n "$ranks" "$ringflex" train "${common[@]}" "$@" --set parallelism.shard=$mode \
    --set checkpoint.dir="$work/$mode" --metrics "$work/$mode.jsonl" >/dev/null
done
python3 - "$work/none.jsonl" "$work/optimizer.jsonl" <<'PY'
import json, sys
none = [json.loads(l) for l in open(sys.argv[1])]
shard = [json.loads(l) for l in open(sys.argv[2])]
assert len(none) == len(shard) == 3, (len(none), len(shard))
for a, b in zip(none, shard):
    for key in ("loss", "grad_norm", "val_loss"):
        assert a.get(key) == b.get(key), f"step {a['step']}: {key} {a.get(key)!r} vs {b.get(key)!r}"
print("same losses and norms:", [r["loss"] for r in shard])
PY
for file in model.safetensors optimizer.safetensors; do
  cmp "$work/none/step-00000003/$file" "$work/optimizer/step-00000003/$file"
done
echo "same checkpoint bytes"
