#!/usr/bin/env bash
# The long-row memory levers against none under a real mpirun: train.spill_dir (the layers' kept activations written
# to each rank's spill file and read back), and with it train.tile_mlp (the MLP's [T, I] products one token tile at a
# time, here 48 of a rank's 128 tokens: two tiles and a short one) give the same bits as the kept activations in
# memory and the whole MLP at the same train.mlp_tile_tokens. Every step's loss, gradient norm and validation loss
# are equal, and the final checkpoint's weights and AdamW moments byte for byte. The spill directory is empty after the
# run (the file is unnamed from its creation), and after a run refused for want of disk (RINGFLEX_DISK_LIMIT fakes a
# small disk: one error line on every rank, before any step).
#   spill_mpirun.sh WORKDIR RINGFLEX MPIEXEC... -- RANKS SETS...
set -euo pipefail
source "$(dirname "$0")/../common/mpirun_lib.sh"
ranks=$1
shift
common=(--set train.seq_len=256 --set train.steps=3 --set train.global_batch=2 --set data.val_rows=2
        --set train.threads=1 --set train.val_every=2 --set optimizer.lr=0.003 --set schedule.warmup_steps=1
        --set train.keep_o_proj=false --set train.keep_down_proj=false --set train.mlp_tile_tokens=48)
spill=$work/spill_dir
mkdir -p "$spill"
train_job memory "$ranks" "$@"
train_job spill "$ranks" "$@" --set train.spill_dir="$spill"
[ -z "$(ls -A "$spill")" ] || { echo "the spill directory is not empty after the run: $(ls -A "$spill")" >&2; exit 1; }
train_job spill_tiled "$ranks" "$@" --set train.spill_dir="$spill" --set train.tile_mlp=true
[ -z "$(ls -A "$spill")" ] || { echo "the spill directory is not empty after the run: $(ls -A "$spill")" >&2; exit 1; }
for run in spill spill_tiled; do
  python3 - "$work/memory.jsonl" "$work/$run.jsonl" <<'PY'
import sys
from train_outputs import expect_same_steps, metrics
memory, other = metrics(sys.argv[1]), metrics(sys.argv[2])
expect_same_steps(memory, other, 3)
print(sys.argv[2], "same losses and norms:", [line["loss"] for line in other])
PY
  files=("$work/memory/step-00000003"/*.safetensors)
  [ "${#files[@]}" -ge 2 ] || { echo "expected the weights and the moments, found ${files[*]}" >&2; exit 1; }
  for file in "${files[@]}"; do
    cmp "$file" "$work/$run/step-00000003/$(basename "$file")"
  done
  echo "$run and in memory: the same bits (${#files[@]} files)"
done
out=$(RINGFLEX_DISK_LIMIT=4K "${launcher[@]}" -n "$ranks" "$ringflex" train "${common[@]}" "$@" \
        --set train.spill_dir="$spill" --set checkpoint.dir="$work/refused" 2>&1) && {
  echo "a spill without room ran" >&2
  exit 1
}
lines=$(grep -c "train's spill file (train.spill_dir) at seq_len 256 over cp $ranks needs .* of disk per rank in $spill, but only 4096 B is free to this rank" <<<"$out" || true)
[ "$lines" -eq "$ranks" ] || { echo "expected the disk error on each of $ranks ranks, got:" >&2; echo "$out" >&2; exit 1; }
[ -z "$(ls -A "$spill")" ] || { echo "the spill directory is not empty after the refused run" >&2; exit 1; }
echo "a spill without room: refused on every rank, nothing left in $spill"
