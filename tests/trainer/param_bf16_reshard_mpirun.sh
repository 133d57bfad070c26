#!/usr/bin/env bash
# model.param_dtype = bfloat16 with the float32 masters in the shards (shard optimizer and gradients: each rank holds
# its slice of the masters beside the whole bf16 working copy) under a real mpirun, the checkpoint in several files
# (checkpoint.max_shard_size). A run at N = 2 (dp 2) under gradients saves at step 2 and 4, every rank taking part in
# the writer's gathers of each master tensor.
#  - Resumed from step 2 at N = 2 under gradients, it ends on the uninterrupted run's step-4 files byte for byte.
#  - Resumed from step 2 at N = 3 (cp 3) under optimizer, it ends on the bytes of the same checkpoint resumed under
#    shard none at N = 3 (every model-0000k-of-0000n.safetensors and the index): the masters were re-sharded over 3
#    ranks, and shard optimizer's arithmetic is shard none's at a grid, so only a master or a moment read into the
#    wrong place could change a bit.
#   param_bf16_reshard_mpirun.sh WORKDIR RINGFLEX MPIEXEC... --
set -euo pipefail
source "$(dirname "$0")/../common/mpirun_lib.sh"
common=(--set model.builtin=tiny_dense --set train.seq_len=64 --set train.steps=4 --set train.global_batch=2
        --set data.val_rows=2 --set train.threads=1 --set train.val_every=0 --set optimizer.lr=0.003
        --set schedule.warmup_steps=1 --set checkpoint.every=2 --set checkpoint.keep=10
        --set checkpoint.max_shard_size=200KB --set model.param_dtype=bfloat16)
same_files() {  # DIR_A DIR_B: every model file of A, byte for byte in B
  local f n=0
  for f in "$1"/model*; do
    cmp "$f" "$2/$(basename "$f")"
    n=$((n + 1))
  done
  [ "$n" -gt 1 ] || { echo "$1 holds $n model file(s), expected several" >&2; exit 1; }
}
train_job two 2 --set parallelism.dp=2 --set parallelism.shard=gradients
ck=$work/two/step-00000002
train_job two_again 2 --set parallelism.dp=2 --set parallelism.shard=gradients --resume "$ck"
same_files "$work/two/step-00000004" "$work/two_again/step-00000004"
echo "N = 2 gradients -> N = 2 gradients: the uninterrupted run's bytes"
train_job three_none 3 --set parallelism.cp=3 --set train.micro_batch=2 --set parallelism.shard=none --resume "$ck"
train_job three_optimizer 3 --set parallelism.cp=3 --set train.micro_batch=2 --set parallelism.shard=optimizer \
  --resume "$ck"
same_files "$work/three_none/step-00000004" "$work/three_optimizer/step-00000004"
echo "N = 2 gradients -> N = 3 optimizer: shard none's bytes"
