#!/usr/bin/env bash
# parallelism.split_vision true (the tower's work divided over the ranks, each image encoded once) against false
# (every rank encodes every image itself, as a reference system does) under a real mpirun at cp 2:
# - a frozen tower (the built-in MoE VLM's, on the mock data's drawings): the same bits. Each drawing's soft tokens
#   are the same wherever it is encoded (the tower's attention stays within an image and its sgemm rows do not depend
#   on how many images share the batch), and the split's sum over the ranks adds zeros to them (x + 0 = x), so every
#   loss, gradient norm, validation loss and the written weights are equal bit for bit.
# - a training tower (model.train_vision, the built-in dense model): the first step's loss is equal bit for bit (the
#   same weights and the same soft tokens, as above). The tower's gradients are not: with the split one rank
#   back-propagates an image's whole d soft tokens once, without it each rank back-propagates its own positions'
#   share and the gradient reduction adds the shares, the same sum in another float32 order. The losses then stay
#   within 1e-4 relative: optimizer.eps = 1e-4 (as train_mpirun_same_loss_train_vision_cp2_dp2, whose comment says
#   why: AdamW with eps 1e-8 turns rounding in near-zero tower entries into steps of lr), measured 4e-9 apart at
#   step 4; a lost image or a gradient counted twice moves the loss by >= 1e-3.
# And the switch is taken: without the split the training tower's gradient norm differs in its last bits from step 3
# on (measured), which the same code path could not give.
#   split_vision_mpirun.sh WORKDIR RINGFLEX MPIEXEC... --
set -euo pipefail
source "$(dirname "$0")/../common/mpirun_lib.sh"
common=(--set train.seq_len=96 --set train.steps=4 --set train.global_batch=2 --set data.val_rows=2
        --set train.threads=1 --set train.val_every=2 --set optimizer.lr=0.003 --set schedule.warmup_steps=2
        --set parallelism.cp=2)
for split in true false; do
  train_job "frozen_$split" 2 --set parallelism.split_vision=$split
  "${launcher[@]}" -n 2 "$ringflex" train "${common[@]}" --set parallelism.split_vision=$split \
    --set model.builtin=tiny_dense --set model.init_std=0.1 --set model.train_vision=true --set optimizer.eps=1e-4 \
    --metrics "$work/trained_$split.jsonl" >/dev/null
done
cmp "$work/frozen_true/step-00000004/model.safetensors" "$work/frozen_false/step-00000004/model.safetensors"
python3 - "$work" <<'PY'
import os, sys
from train_outputs import EXACT_KEYS, expect_same_steps, metrics
def lines(name):
    return metrics(os.path.join(sys.argv[1], name))
expect_same_steps(lines("frozen_true.jsonl"), lines("frozen_false.jsonl"), 4, keys=(*EXACT_KEYS, "tokens"),
                  what="frozen tower, ")
print("frozen tower: the same losses, norms and weights' bits with and without the split")
split, whole = lines("trained_true.jsonl"), lines("trained_false.jsonl")
assert len(split) == len(whole) == 4, (len(split), len(whole))
assert split[0]["loss"] == whole[0]["loss"], (split[0], whole[0])
for a, b in zip(split, whole):
    assert a["tokens"] == b["tokens"], (a, b)
    rel = abs(a["loss"] - b["loss"]) / a["loss"]
    assert rel < 1e-4, f"training tower, step {a['step']}: loss {a['loss']} vs {b['loss']} (relative {rel:.2e})"
assert any(a["grad_norm"] != b["grad_norm"] for a, b in zip(split, whole)), \
    "the training tower's gradient norms are the split's bits: was the split switched off?"
print("training tower: step 1's loss bit for bit, then within 1e-4:", [r["loss"] for r in whole])
PY
