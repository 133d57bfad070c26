#!/usr/bin/env bash
# LoRA with the experts' adapters (model.lora.target_parameters) under parallelism.ep against ep 1, under a real
# mpirun: every rank keeps every expert's base and adapters (ep_experts_held = E; only the tokens travel), so the first
# step's loss is ep 1's bit for bit (the forward is the same bits at any EP), and every step's loss and gradient norm
# are within 1e-5 relative (the adapters' gradients of the experts reassociate the rows' sums, as the experts' own do
# in same_loss_ep_mpirun.sh), and the step-3 adapters (PEFT's files, the same names and shapes) within 3e-6 (0.1% of
# the lr 0.003: AdamW normalises an element's update to about lr).
#   lora_ep_mpirun.sh WORKDIR RINGFLEX MPIEXEC... -- RANKS EP GRID_SETS...
set -euo pipefail
source "$(dirname "$0")/mpirun_script_args.sh"
ranks=$1 ep=$2
shift 2
common=(--set train.seq_len=64 --set train.steps=3 --set train.global_batch=4 --set data.val_rows=2
        --set train.threads=1 --set optimizer.lr=0.003 --set schedule.warmup_steps=1 --set model.builtin=tiny_moe_vlm
        --set model.init_std=0.4 --set model.lora.rank=2
        --set "model.lora.target_parameters=[experts.gate_up_proj, experts.down_proj]")
for e in 1 "$ep"; do
  "${launcher[@]}" -n "$ranks" "$ringflex" train "${common[@]}" "$@" --set parallelism.ep="$e" \
    --set checkpoint.dir="$work/ep$e" --metrics "$work/ep$e.jsonl" >/dev/null
done
python3 - "$work/ep1.jsonl" "$work/ep$ep.jsonl" "$work/ep1/step-00000003/adapter_model.safetensors" \
  "$work/ep$ep/step-00000003/adapter_model.safetensors" <<'PY'
import array, json, struct, sys
one, ep = ([json.loads(l) for l in open(p)] for p in sys.argv[1:3])
assert len(one) == len(ep) == 3, (len(one), len(ep))
assert all(r["ep_experts_held"] == 4 for r in ep), ep  # tiny_moe_vlm: 4 experts, every one on every rank
assert one[0]["loss"] == ep[0]["loss"], (one[0], ep[0])
for a, b in zip(one, ep):
    for key in ("loss", "grad_norm"):
        assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), f"step {a['step']}: {key} {a[key]!r} vs {b[key]!r}"
def tensors(path):  # name -> (shape, float32 values) of a safetensors file
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    return {k: (t["shape"], array.array("f", raw[8 + n + t["data_offsets"][0]:8 + n + t["data_offsets"][1]]))
            for k, t in header.items() if k != "__metadata__"}
a, b = tensors(sys.argv[3]), tensors(sys.argv[4])
assert a.keys() == b.keys() and any(".experts." in k for k in a), sorted(set(a) ^ set(b))
assert all(a[k][0] == b[k][0] for k in a), "adapter shapes differ"
worst = max(abs(x - y) for k in a for x, y in zip(a[k][1], b[k][1]))
assert worst <= 3e-6, f"step-3 adapters differ by up to {worst}"
print("LoRA at ep as ep 1: losses", [r["loss"] for r in ep], "adapters within", worst)
PY
