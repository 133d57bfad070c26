#!/usr/bin/env bash
# LoRA with the experts' adapters (model.lora.target_parameters) under parallelism.ep against ep 1, under a real
# mpirun. Every rank keeps the whole frozen base (ep_experts_held = E: the base's experts are all there), and only
# its EP rank's experts' adapters (model::LoraStore::place_experts; --stats counts E / ep experts' adapters), so only
# the tokens travel for the base and the adapters' state is divided (under shard optimizer the moments of a rank's
# held adapters sharded over the ranks holding the same experts: trainer/state/expert_state.h). Asserted:
#   - the first step's loss is ep 1's bit for bit (the forward is the same bits at any EP, the adapters' initial
#     values the whole tensor's rows);
#   - every step's loss and gradient norm within 1e-5 relative (an expert's adapter gradients sum the rows of each
#     source rank in one sgemm, and across ranks over the EDP group, where ep 1 sums each rank's rows and then the
#     ranks: the same terms reassociated, as the experts' own in same_loss_ep_mpirun.sh);
#   - the step-3 adapters (PEFT's files: the same names and whole shapes, every expert once) within 3e-6 (0.1% of the
#     lr 0.003: AdamW normalises an element's update to about lr);
#   - resume across EP: the ep run's step-2 checkpoint resumed at ep 1, and ep 1's at ep, give the step-3 loss of the
#     run they came from bit for bit (the same adapters and moments, read whole and kept by rows, and the forward is
#     EP-invariant), and the resumed ep run's step-3 adapters are the uninterrupted ep run's bit for bit (under shard
#     optimizer ep 1's checkpoint holds one moment file a rank, which the ep run reads by its rows);
#   - under shard optimizer, the ep run is shard none's at the same ep bit for bit: every loss, norm and validation
#     loss, the step-3 adapter and moment files byte for byte (the gradients are summed as under none, and AdamW
#     updates each element alone, whichever rank holds its moments).
#   lora_ep_mpirun.sh WORKDIR RINGFLEX MPIEXEC... -- RANKS EP GRID_SETS...
set -euo pipefail
source "$(dirname "$0")/../common/mpirun_lib.sh"
ranks=$1 ep=$2
shift 2
common=(--set train.seq_len=64 --set train.steps=3 --set train.global_batch=4 --set data.val_rows=2
        --set train.threads=1 --set optimizer.lr=0.003 --set schedule.warmup_steps=1 --set model.builtin=tiny_moe_vlm
        --set model.init_std=0.4 --set model.lora.rank=2 --set checkpoint.every=2
        --set "model.lora.target_parameters=[experts.gate_up_proj, experts.down_proj]")
for e in 1 "$ep"; do
  train_job "ep$e" "$ranks" "$@" --set parallelism.ep="$e" --stats "$work/stats$e.json"
done
# Each run's step-2 checkpoint resumed at the other EP, and the ep run's at ep itself.
train_job from_ep "$ranks" "$@" --set parallelism.ep=1 --resume "$work/ep$ep/step-00000002"
train_job from1 "$ranks" "$@" --set parallelism.ep="$ep" --resume "$work/ep1/step-00000002"
train_job again "$ranks" "$@" --set parallelism.ep="$ep" --resume "$work/ep$ep/step-00000002"
cmp "$work/ep$ep/step-00000003/adapter_model.safetensors" "$work/again/step-00000003/adapter_model.safetensors"
for f in "$work/ep$ep/step-00000003/"optimizer*; do  # optimizer.safetensors, or one file a rank and optimizer.json
  cmp "$f" "$work/again/step-00000003/$(basename "$f")"
done
case " $* " in
  *" parallelism.shard=optimizer "*)
    train_job none "$ranks" "$@" --set parallelism.ep="$ep" --set parallelism.shard=none
    for f in adapter_model.safetensors optimizer.safetensors; do
      cmp "$work/none/step-00000003/$f" "$work/ep$ep/step-00000003/$f"
    done
    python3 - "$work/none.jsonl" "$work/ep$ep.jsonl" <<'PY'
import sys
from train_outputs import expect_same_steps, metrics
expect_same_steps(metrics(sys.argv[1]), metrics(sys.argv[2]), 3)
print("LoRA at ep under shard optimizer: shard none's losses, norms, adapters and moments bit for bit")
PY
    ;;
esac
python3 - "$work" "$ep" <<'PY'
import json, sys
from train_outputs import max_abs_difference, metrics, safetensors_header
work, ep = sys.argv[1], sys.argv[2]
def lines(name):
    return metrics(f"{work}/{name}.jsonl")
one, many = lines("ep1"), lines(f"ep{ep}")
assert len(one) == len(many) == 3, (len(one), len(many))
assert all(r["ep_experts_held"] == 4 for r in many), many  # tiny_moe_vlm: 4 experts, the base's all on every rank
assert one[0]["loss"] == many[0]["loss"], (one[0], many[0])
for a, b in zip(one, many):
    for key in ("loss", "grad_norm"):
        assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), f"step {a['step']}: {key} {a[key]!r} vs {b[key]!r}"
for resumed, source in (("from_ep", many), ("from1", one), ("again", many)):
    last = lines(resumed)[-1]
    assert last["step"] == 3 and last["loss"] == source[2]["loss"], (resumed, last, source[2])
step3 = "step-00000003/adapter_model.safetensors"
a, b = (safetensors_header(f"{work}/{run}/{step3}")[0] for run in ("ep1", f"ep{ep}"))
assert a.keys() == b.keys() and any(".experts." in k for k in a), sorted(set(a) ^ set(b))
assert all(a[k]["shape"] == b[k]["shape"] and a[k]["dtype"] == "F32" for k in a), "adapter shapes or dtypes differ"
worst = max_abs_difference(f"{work}/ep1/{step3}", f"{work}/ep{ep}/{step3}")
assert worst <= 3e-6, f"step-3 adapters differ by up to {worst}"
# The memory check counts each rank's experts' adapters only (E / ep of them), in every mode.
def gradients(name):
    terms = json.load(open(f"{work}/{name}.json"))["memory_per_rank"]["terms"]
    return sum(t["bytes"] for t in terms if t["kind"] == "gradients")
assert gradients(f"stats{ep}") < gradients("stats1"), (gradients(f"stats{ep}"), gradients("stats1"))
print("LoRA at ep as ep 1: losses", [r["loss"] for r in many], "adapters within", worst, "; resumed across EP")
PY
