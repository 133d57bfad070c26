#!/usr/bin/env bash
# LoRA under parallelism.shard = optimizer, under a real mpirun: the adapters' AdamW moments sharded over the ranks
# (one moment file a rank), the frozen base whole on every rank. Every step's loss, gradient norm and validation loss,
# the final adapter file byte for byte and the moments value for value are those of shard none at the same grid (an
# element's update depends on that element alone; the reduce-scatter sums in the all-reduce's rank order). And a
# resume of the sharded run's step-2 checkpoint (its moments one file a rank) under shard none writes the same step-3
# adapters.
#   lora_shard_mpirun.sh WORKDIR RINGFLEX MPIEXEC... -- RANKS GRID_SETS...
set -euo pipefail
source "$(dirname "$0")/mpirun_script_args.sh"
ranks=$1
shift
common=(--set model.lora.rank=2 --set model.lora.alpha=4 --set train.seq_len=64 --set train.steps=3
        --set train.global_batch=6 --set data.val_rows=2 --set train.threads=1 --set train.val_every=2
        --set optimizer.lr=0.003 --set optimizer.grad_clip=0.5 --set checkpoint.every=2)
for mode in none optimizer; do
  "${launcher[@]}" -n "$ranks" "$ringflex" train "${common[@]}" "$@" --set parallelism.shard=$mode \
    --set checkpoint.dir="$work/$mode" --metrics "$work/$mode.jsonl" >/dev/null
done
cmp "$work/none/step-00000003/adapter_model.safetensors" "$work/optimizer/step-00000003/adapter_model.safetensors"
"${launcher[@]}" -n "$ranks" "$ringflex" train "${common[@]}" "$@" --set parallelism.shard=none \
  --set checkpoint.dir="$work/resumed" --resume "$work/optimizer/step-00000002" >/dev/null
cmp "$work/none/step-00000003/adapter_model.safetensors" "$work/resumed/step-00000003/adapter_model.safetensors"
python3 - "$work" "$ranks" <<'PY'
import array, json, os, struct, sys
work, ranks = sys.argv[1], int(sys.argv[2])
none = [json.loads(l) for l in open(os.path.join(work, "none.jsonl"))]
shard = [json.loads(l) for l in open(os.path.join(work, "optimizer.jsonl"))]
assert len(none) == len(shard) == 3, (len(none), len(shard))
for a, b in zip(none, shard):
    for key in ("loss", "grad_norm", "val_loss"):
        assert a.get(key) == b.get(key), f"step {a['step']}: {key} {a.get(key)!r} vs {b.get(key)!r}"
def tensors(path):  # name -> float32 values of a safetensors file
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    return {name: array.array("f", raw[8 + n + t["data_offsets"][0]:8 + n + t["data_offsets"][1]])
            for name, t in header.items() if name != "__metadata__"}
whole = tensors(os.path.join(work, "none", "step-00000003", "optimizer.safetensors"))
ck = os.path.join(work, "optimizer", "step-00000003")
layout = json.load(open(os.path.join(ck, "optimizer.json")))
assert layout["ranks"] == ranks == len(layout["files"]), layout["files"]
flat = {"exp_avg": array.array("f"), "exp_avg_sq": array.array("f")}
for f in layout["files"]:
    part = tensors(os.path.join(ck, f["file"]))
    for k in flat:
        assert len(part[k]) == f["end"] - f["begin"], (f, k)
        flat[k].extend(part[k])
names = [p["name"] for p in layout["parameters"]]
assert names and all(".lora_A." in n or ".lora_B." in n for n in names), names[:4]
for p in layout["parameters"]:
    n = 1
    for d in p["shape"]:
        n *= d
    for k in flat:
        assert flat[k][p["offset"]:p["offset"] + n] == whole[k + "." + p["name"]], f"{k} of {p['name']} differs"
assert 2 * len(names) == len(whole), "the sharded files miss adapters"
print(f"LoRA shard optimizer over {ranks} ranks: shard none's losses, norms, adapter bytes and moments "
      f"({len(names)} adapter tensors); resumed under shard none, the same adapters")
PY
