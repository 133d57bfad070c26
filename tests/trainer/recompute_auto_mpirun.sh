#!/usr/bin/env bash
# train.recompute and keep_* left at auto (trainer::choose_recompute) under a real mpirun: with memory to spare the
# run keeps every layer's activations; under a RINGFLEX_MEMORY_LIMIT whose 95% lies between what `ringflex train
# --plan` counts for keeping the MLP projections and both outputs and for keeping the two outputs only, it chooses
# the latter. Each run says its choice in its first lines and in --stats, and the two give the same bits (losses,
# norms, the checkpoint byte for byte). Ranks whose memory differs so that they would choose differently stop
# before step 1 with one line on every rank.
#   recompute_auto_mpirun.sh WORKDIR RINGFLEX MPIEXEC... -- RANKS SETS...
set -euo pipefail
source "$(dirname "$0")/../common/mpirun_lib.sh"
ranks=$1
shift
common=(--set train.seq_len=32768 --set train.steps=2 --set train.global_batch=2 --set data.val_rows=2
        --set train.threads=1 --set train.val_every=0 --set optimizer.lr=0.003 --set schedule.warmup_steps=1)
# run NAME ARGS...: a train job whose stdout (the announcement) and --stats are kept.
run() {
  local name=$1
  shift
  "${launcher[@]}" -n "$ranks" "$ringflex" train "${common[@]}" "$@" --set checkpoint.dir="$work/$name" \
    --metrics "$work/$name.jsonl" --stats "$work/$name.stats.json" >"$work/$name.out"
}
# The per-rank figure of setting SETS..., as the plan counts it on a 1 TiB machine.
planned() {
  "$ringflex" train --plan "${common[@]}" "$@" --ranks "$ranks" --ranks-per-node "$ranks" --node-memory 1TiB \
    --plan-json "$work/plan.json" >/dev/null
  python3 - "$work/plan.json" "$ranks" <<'PY'
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["rows"]
        if (r["cp"], r["ep"], r["shard"], r["param_dtype"], r["lora"]) == (int(sys.argv[2]), 1, "none", "float32", False)]
print(rows[0]["total_bytes"])
PY
}
explicit=(--set train.recompute=true --set train.keep_o_proj=true --set train.keep_down_proj=true)
with_mlp=$(planned "$@" "${explicit[@]}" --set train.keep_mlp=true)
outputs=$(planned "$@" "${explicit[@]}" --set train.keep_mlp=false)
# 95% of the limit halfway between them: far more than two processes' start-up baselines differ on each side.
limit=$(python3 -c "import sys; a, b = int(sys.argv[1]), int(sys.argv[2]); assert a - b > 64 << 20, (a, b); \
print(int((a + b) / 2 / 0.95))" "$with_mlp" "$outputs")

run free "$@"
RINGFLEX_MEMORY_LIMIT=$limit run tight "$@"
grep -q "^ringflex train: recompute: none, every layer's activations kept (auto)$" "$work/free.out" ||
  { echo "free: no announcement of the choice in:" >&2; cat "$work/free.out" >&2; exit 1; }
grep -q "^ringflex train: recompute: each layer in the backward, keeping its o_proj and down_proj outputs (auto)$" \
  "$work/tight.out" || { echo "tight: no announcement of the choice in:" >&2; cat "$work/tight.out" >&2; exit 1; }
python3 - "$work" <<'PY'
import json, sys
from train_outputs import expect_same_steps, metrics
work = sys.argv[1]
free, tight = (json.load(open(f"{work}/{n}.stats.json"))["recompute"] for n in ("free", "tight"))
assert free == {"layers": False, "keep_mlp": False, "keep_o_proj": True, "keep_down_proj": True, "auto": True}, free
assert tight == {"layers": True, "keep_mlp": False, "keep_o_proj": True, "keep_down_proj": True, "auto": True}, tight
expect_same_steps(metrics(f"{work}/free.jsonl"), metrics(f"{work}/tight.jsonl"), 2)
print("auto chose", free, "and", tight, "with the same losses")
PY
same_checkpoint "$work/free/step-00000002" "$work/tight/step-00000002"

# Rank 0 with memory to spare, the others under the limit: one line on every rank, before any step.
mpmd=(-n 1 "$ringflex" train "${common[@]}" "$@" --set checkpoint.dir="$work/split")
for ((r = 1; r < ranks; ++r)); do
  mpmd+=(: -n 1 env RINGFLEX_MEMORY_LIMIT="$limit" "$ringflex" train "${common[@]}" "$@" --set checkpoint.dir="$work/split")
done
if out=$("${launcher[@]}" "${mpmd[@]}" 2>&1); then
  echo "ranks choosing differently were not refused" >&2
  exit 1
fi
want="ranks disagree on what the backward recomputes: train.recompute / keep_\* left at auto, each chosen from \
its rank's memory \(set them in the config\)$"
lines=$(grep -cE "ringflex: error: .*$want" <<<"$out" || true)
[ "$lines" -eq "$ranks" ] || { echo "expected $ranks error lines, got $lines:" >&2; echo "$out" >&2; exit 1; }
[ ! -d "$work/split/step-00000001" ] || { echo "the refused job wrote a checkpoint" >&2; exit 1; }
echo "auto's choice: kept with memory to spare, outputs only under the limit, the same bits; split ranks refused"
