#!/usr/bin/env bash
# parallelism.ep under a real mpirun against ep 1 at the same grid: the first step's loss (the forward is the same
# bits at any EP: each token's rows meet the same sgemms and combine in ascending expert order on its rank), every
# step's loss and gradient norm within 1e-5 relative (the experts' weight gradients reassociate at most 4 float32
# partial sums per element, tests/model/test_model_ep_mpi.cpp, and three steps of AdamW carry that ulp-level
# difference into the next losses), validation included (replicas with fewer validation rows run filler batches);
# then the ep run's step-2 checkpoint resumed at ep 1, at ep itself and at another EP the ranks allow gives the ep
# run's step-3 loss bit for bit (the weights are whole tensors, every expert written once in the Hugging Face layout
# at any EP, gathered from the ranks holding them, and a forward is the same bits). Resumed at ep itself the step-3
# checkpoint (weights and AdamW moments, each rank's experts' moments taken back from the files) is the ep run's
# byte for byte; at another EP its weights are within 3e-6 of it (0.1% of the step's lr 0.003, measured 6e-8:
# AdamW normalises an element's update to about lr, and the experts' gradients reassociate as above; a lost expert
# moment moves an element by about the whole lr). The resume at another EP also runs another shard mode (none <->
# optimizer, gradients <-> full: modes that sum the same terms in the same order, same_bits_shard_mpirun.sh; the
# micro-batches' sums reassociate between the two pairs): the files are the same whole layout whatever wrote them. The metrics say how many
# experts a rank holds: E / ep in every shard mode (each rank its own; trainer/state/held_expert_store.h under sharding).
# Last, ep 1's step-2 checkpoint (under sharding its moments in one file a rank) resumed at ep gives ep 1's step-3
# loss bit for bit, and a fresh start from its files (model.path) at ep gives ep 1's first loss from them. A load at
# ep > 1 reads each rank's experts' rows alone and a save gathers one tensor at a time (trainer/state/held_checkpoint.h).
#   same_loss_ep_mpirun.sh WORKDIR RINGFLEX MPIEXEC... -- RANKS EP GRID_SETS...
set -euo pipefail
source "$(dirname "$0")/../common/mpirun_lib.sh"
ranks=$1 ep=$2
shift 2
common=(--set train.seq_len=64 --set train.steps=3 --set train.global_batch=4 --set data.val_rows=3
        --set train.threads=1 --set train.val_every=2 --set optimizer.lr=0.003 --set schedule.warmup_steps=1
        --set model.builtin=tiny_moe_vlm --set model.init_std=0.4 --set checkpoint.every=2)
for e in 1 "$ep"; do
  train_job "ep$e" "$ranks" "$@" --set parallelism.ep="$e" --stats "$work/stats$e.json"
done
# Another EP to resume at: twice ep where the ranks allow it, else half of it; and another shard mode there.
if [ $((ranks % (2 * ep))) -eq 0 ]; then other=$((2 * ep)); else other=$((ep / 2)); fi
case " $* " in
  *parallelism.shard=full*) other_shard=gradients ;;
  *parallelism.shard=optimizer*) other_shard=none ;;
  *parallelism.shard=gradients*) other_shard=full ;;
  *) other_shard=optimizer ;;
esac
for e in 1 "$ep" "$other"; do
  shard=()
  if [ "$e" = "$other" ]; then shard=(--set parallelism.shard="$other_shard"); fi
  train_job "resumed$e" "$ranks" "$@" "${shard[@]}" --set parallelism.ep="$e" --resume "$work/ep$ep/step-00000002"
done
# And ep 1's step-2 checkpoint (its moments in one file a rank under sharding) resumed at ep: step 3's loss is ep 1's.
train_job from1 "$ranks" "$@" --set parallelism.ep="$ep" --resume "$work/ep1/step-00000002"
# A fresh start from ep 1's step-2 files (model.path: the Hugging Face layout) at ep 1 and at ep, each rank of the ep
# run reading its experts' rows of the files alone (trainer/state/held_checkpoint.h): step 1's loss is the same bits.
for e in 1 "$ep"; do
  train_job "path$e" "$ranks" "$@" --set parallelism.ep="$e" --set train.steps=1 \
    --set model.path="$work/ep1/step-00000002"
done
python3 - "$work/path1.jsonl" "$work/path$ep.jsonl" <<'PY'
import sys
from train_outputs import metrics
one, ep = metrics(sys.argv[1]), metrics(sys.argv[2])
assert one[0]["loss"] == ep[0]["loss"], f"from model.path: step 1 loss {one[0]['loss']!r} vs {ep[0]['loss']!r}"
print("from model.path at ep 1 and ep: step 1 loss", one[0]["loss"])
PY
cmp "$work/ep$ep/step-00000003/model.safetensors" "$work/resumed$ep/step-00000003/model.safetensors"
for f in "$work/ep$ep/step-00000003"/optimizer*; do  # optimizer.safetensors, or the sharded files and their layout
  cmp "$f" "$work/resumed$ep/step-00000003/$(basename "$f")"
done
python3 - "$work/ep$ep/step-00000003/model.safetensors" "$work/resumed$other/step-00000003/model.safetensors" <<'PY'
import sys
from train_outputs import max_abs_difference, safetensors_header
assert any(".experts." in k for k in safetensors_header(sys.argv[1])[0]), "no expert tensors"
worst = max_abs_difference(sys.argv[1], sys.argv[2])
assert worst <= 3e-6, f"step-3 weights resumed at another EP differ by up to {worst}"
print("resumed at another EP: step-3 weights within", worst)
PY
# --stats: the memory check's terms count a rank's experts, E / ep of the expert tensors' float32 bytes (the files'
# sizes), where ep 1 counts them all.
python3 - "$work/stats1.json" "$work/stats$ep.json" "$work/ep$ep/step-00000003/model.safetensors" "$ep" <<'PY'
import json, sys
from train_outputs import safetensors_header
one, ep = (json.load(open(p)) for p in sys.argv[1:3])
header = safetensors_header(sys.argv[3])[0]
experts = sum(t["data_offsets"][1] - t["data_offsets"][0] for n, t in header.items() if ".experts." in n)
ep_size = int(sys.argv[4])
terms = {t["kind"]: t["bytes"] for t in ep["memory_per_rank"]["terms"]}
if ep["shard"] == "none":
    drop = one["memory_per_rank"]["terms"][0]["bytes"] - terms["weights"]
    assert drop == experts - experts // ep_size, (drop, experts)
else:
    assert terms["experts held (E / ep)"] == experts // ep_size, (terms, experts)
assert ep["ep"] == ep_size and len(ep["peak_rss_bytes"]) > 0, ep
print("--stats: experts counted", experts // ep_size, "of", experts, "bytes a rank")
PY
python3 - "$work/ep1.jsonl" "$work/ep$ep.jsonl" "$work/resumed1.jsonl" "$work/resumed$ep.jsonl" \
  "$work/resumed$other.jsonl" "$ep" "$work/from1.jsonl" <<'PY'
import sys
from train_outputs import metrics
one, ep, resumed, again, other = (metrics(p) for p in sys.argv[1:6])
from1 = metrics(sys.argv[7])
assert from1[-1]["step"] == 3 and from1[-1]["loss"] == one[2]["loss"], (from1, one[2])
experts, ep_size = 4, int(sys.argv[6])  # model.builtin tiny_moe_vlm has 4 experts a MoE layer
held = ep[0]["ep_experts_held"]
assert held == experts // ep_size, held
assert all(r["ep_bytes_per_layer"] > 0 and r["ep_exposed_s"] >= 0 for r in ep), ep
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
for run in (resumed, again, other):
    last = [r for r in run if r["step"] == 3]
    assert last and last[0]["loss"] == ep[2]["loss"], (last, ep[2])
    assert close(last[0]["grad_norm"], ep[2]["grad_norm"]), (last, ep[2])
assert again[-1]["grad_norm"] == ep[2]["grad_norm"], (again, ep[2])
print("same losses:", [r["loss"] for r in one], [r["loss"] for r in ep], "resumed at ep 1, ep, other:",
      [run[-1]["loss"] for run in (resumed, again, other)], "rows sent:", [r["ep_rows_sent"] for r in ep],
      "experts held:", held, "bytes per layer:", [r["ep_bytes_per_layer"] for r in ep])
PY
