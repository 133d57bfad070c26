#!/usr/bin/env bash
# parallelism.ep under a real mpirun against ep 1 at the same grid: the first step's loss (the forward is the same
# bits at any EP: each token's rows meet the same sgemms and combine in ascending expert order on its rank), every
# step's loss and gradient norm within 1e-5 relative (the experts' weight gradients reassociate at most 4 float32
# partial sums per element, tests/model/test_model_ep_mpi.cpp, and three steps of AdamW carry that ulp-level
# difference into the next losses), validation included (replicas with fewer validation rows run filler batches);
# then the ep run's step-2 checkpoint resumed at ep 1 gives the ep run's step-3 loss bit for bit (the weights are
# whole tensors, every expert written once in the Hugging Face layout at any EP, and a forward is the same bits).
#   same_loss_ep_mpirun.sh WORKDIR RINGFLEX MPIEXEC... -- RANKS EP GRID_SETS...
set -euo pipefail
work=$1 ringflex=$2
shift 2
launcher=()
while [ "$1" != "--" ]; do launcher+=("$1"); shift; done
shift
ranks=$1 ep=$2
shift 2
rm -rf "$work"
mkdir -p "$work"
common=(--set train.seq_len=64 --set train.steps=3 --set train.global_batch=4 --set data.val_rows=3
        --set train.threads=1 --set train.val_every=2 --set optimizer.lr=0.003 --set schedule.warmup_steps=1
        --set model.builtin=tiny_moe_vlm --set model.init_std=0.4 --set checkpoint.every=2)
for e in 1 "$ep"; do
  "${launcher[@]}" -n "$ranks" "$ringflex" train "${common[@]}" "$@" --set parallelism.ep="$e" \
    --set checkpoint.dir="$work/ep$e" --metrics "$work/ep$e.jsonl" >/dev/null
done
"${launcher[@]}" -n "$ranks" "$ringflex" train "${common[@]}" "$@" --set parallelism.ep=1 \
  --set checkpoint.dir="$work/resumed" --metrics "$work/resumed.jsonl" --resume "$work/ep$ep/step-00000002" >/dev/null
python3 - "$work/ep1.jsonl" "$work/ep$ep.jsonl" "$work/resumed.jsonl" <<'PY'
import json, sys
one, ep, resumed = ([json.loads(l) for l in open(p)] for p in sys.argv[1:4])
assert len(one) == len(ep) == 3, (len(one), len(ep))
assert all("ep_rows_sent" not in r for r in one), "ep 1 moves no rows"
assert all(r["ep_rows_sent"] > 0 and r["ep_rows_received"] > 0 for r in ep), [r.get("ep_rows_sent") for r in ep]
assert one[0]["loss"] == ep[0]["loss"], f"step 1 loss {one[0]['loss']!r} vs {ep[0]['loss']!r}"
def close(a, b):
    return abs(a - b) <= 1e-5 * abs(a)
for a, b in zip(one, ep):
    for key in ("loss", "grad_norm", "val_loss"):
        if key in a or key in b:
            assert close(a[key], b[key]), f"step {a['step']}: {key} {a[key]!r} vs {b[key]!r}"
last = [r for r in resumed if r["step"] == 3]
assert last and last[0]["loss"] == ep[2]["loss"], (last, ep[2])
print("same losses:", [r["loss"] for r in one], [r["loss"] for r in ep], "resumed at ep 1:", last[0]["loss"],
      "rows sent:", [r["ep_rows_sent"] for r in ep])
PY
