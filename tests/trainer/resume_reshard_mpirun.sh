#!/usr/bin/env bash
# Checkpoints under a real mpirun with the weights in several files (checkpoint.max_shard_size) and the moments one
# file a rank: a run of 4 ranks (cp 2 x dp 2, shard optimizer) saves at step 2 and 4.
#  - Resumed from step 2 at the same grid in shard none, it ends on the uninterrupted run's step-4 weights byte for
#    byte (every model-0000k-of-0000n.safetensors and the index): ZeRO-1 is shard none's arithmetic, so only a moment
#    read from the wrong file or range could change a bit.
#  - Resumed at N = 2 (dp 2, shard optimizer: each rank reads parts of two of the four files) and at N = 1 (shard
#    none: all four), its losses stay within 1e-5 relative of the uninterrupted run's (test_train.cpp's
#    kSameTrainingRel: the grid changes the order of the float32 gradient sums, ~1e-7 relative, while a misplaced
#    moment moves the next update of its element by up to lr and the loss by far more); and the other way, the N = 1
#    run's own step-2 checkpoint (one optimizer.safetensors) resumed at N = 4 shard optimizer stays within the same
#    bound of the N = 1 run. (test_train.cpp's ShardOptimizer.ReshardsTheMomentsExactlyAtAnyRankCount checks the
#    re-sharding bit for bit against moments rewritten by the test.)
#   resume_reshard_mpirun.sh WORKDIR RINGFLEX MPIEXEC... --
set -euo pipefail
source "$(dirname "$0")/../common/mpirun_lib.sh"
common=(--set model.builtin=tiny_dense --set train.seq_len=64 --set train.steps=4 --set train.global_batch=4
        --set data.val_rows=2 --set train.threads=1 --set train.val_every=0 --set optimizer.lr=0.003
        --set schedule.warmup_steps=1 --set checkpoint.every=2 --set checkpoint.keep=10
        --set checkpoint.max_shard_size=200KB)
train_job four 4 --set parallelism.cp=2 --set parallelism.dp=2 --set parallelism.shard=optimizer
ck=$work/four/step-00000002
[ -f "$ck/model.safetensors.index.json" ] && [ -f "$ck/optimizer-00004-of-00004.safetensors" ] &&
  [ -f "$ck/optimizer.json" ] || { echo "step 2 is not in the multi-file layout: $(ls "$ck")" >&2; exit 1; }
train_job four_none 4 --set parallelism.cp=2 --set parallelism.dp=2 --set parallelism.shard=none --resume "$ck"
for f in "$work/four/step-00000004"/model*; do
  cmp "$f" "$work/four_none/step-00000004/$(basename "$f")"
done
echo "N = 4 optimizer -> N = 4 none: the same weights' bytes"
train_job two 2 --set parallelism.dp=2 --set parallelism.shard=optimizer --resume "$ck"
train_job one 1 --set parallelism.shard=none --resume "$ck"
train_job single 1 --set parallelism.shard=none
train_job single_four 4 --set parallelism.cp=2 --set parallelism.dp=2 --set parallelism.shard=optimizer \
  --resume "$work/single/step-00000002"
python3 - "$work" <<'PY'
import json, os, sys
work = sys.argv[1]
def losses(name):
    return [json.loads(l)["loss"] for l in open(os.path.join(work, name + ".jsonl"))]
def close(ref, run, what):
    a, b = losses(ref)[2:], losses(run)[-2:]
    assert len(a) == len(b) == 2, (ref, run, a, b)
    for x, y in zip(a, b):
        assert abs(x - y) <= 1e-5 * abs(x), f"{what}: loss {y!r}, uninterrupted {x!r}"
    print(what, "within 1e-5:", b)
close("four", "two", "N = 4 -> N = 2 optimizer")
close("four", "one", "N = 4 -> N = 1 none")
close("single", "single_four", "N = 1 none -> N = 4 optimizer")
PY
