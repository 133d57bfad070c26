#!/usr/bin/env bash
# `ringflex train --plan` against `ringflex train` itself, under a real mpirun on 2 ranks of this machine:
#   - rows that fit: the job run in that layout writes --stats, the memory check's terms for its run, and each term
#     equals the plan's byte for byte (the runtime baseline aside: each process measures its own resident set);
#   - a row that does not fit: with RINGFLEX_MEMORY_LIMIT between the plan's figures, `ringflex train` in that layout
#     is refused by its memory check, and the terms its error line shows are the plan's, formatted as it formats them.
#   plan_mpirun.sh WORKDIR RINGFLEX MPIEXEC... --
set -euo pipefail
source "$(dirname "$0")/../common/mpirun_lib.sh"
common=(--set model.builtin=tiny_moe_vlm --set train.seq_len=2048 --set train.steps=1 --set train.global_batch=2
        --set data.val_rows=2 --set train.threads=1 --set checkpoint.every=0)
"$ringflex" train --plan "${common[@]}" --ranks 2 --ranks-per-node 2 --node-memory 1TiB \
  --plan-json "$work/plan.json" >"$work/plan.txt"
# (1 2 2 gradients: held experts over a sharded rest, whose token tables' rows --stats once counted as 0 bytes.)
rows=("2 1 1 none float32" "1 2 1 optimizer bfloat16" "1 2 2 none float32" "2 1 1 gradients float32" "1 2 1 full bfloat16"
      "1 2 2 gradients float32")
for row in "${rows[@]}"; do
  read -r cp dp ep shard dtype <<<"$row"
  train_job "$cp.$dp.$ep.$shard.$dtype" 2 --set parallelism.cp="$cp" --set parallelism.dp="$dp" \
    --set parallelism.ep="$ep" --set parallelism.shard="$shard" --set model.param_dtype="$dtype" \
    --stats "$work/$cp.$dp.$ep.$shard.$dtype.stats.json"
done
python3 - "$work" "${rows[@]}" <<'PY'
import json, sys
work, rows = sys.argv[1], sys.argv[2:]
plan = json.load(open(f"{work}/plan.json"))
BASELINE = "runtime baseline (libraries, MPI, start-up heap)"
def planned(cp, dp, ep, shard, dtype):
    found = [r for r in plan["rows"] if (r["cp"], r["dp"], r["ep"], r["shard"], r["param_dtype"], r["lora"]) ==
             (int(cp), int(dp), int(ep), shard, dtype, False)]
    assert len(found) == 1, (cp, dp, ep, shard, dtype, len(found))
    return found[0]
for row in rows:
    r = planned(*row.split())
    stats = json.load(open(f"{work}/{row.replace(' ', '.')}.stats.json"))
    ran = [(t["kind"], t["bytes"]) for t in stats["memory_per_rank"]["terms"] if t["kind"] != BASELINE]
    want = [(t["kind"], t["bytes"]) for t in r["terms"] if t["kind"] != BASELINE]
    assert ran == want, (row, ran, want)
    assert r["fits"], row
print("plan rows equal the memory check of", len(rows), "runs")
PY
# A limit halfway between the smallest and the largest figure: the plan says which rows fit under it, and the
# largest row (beyond it by at least half the spread, far more than two processes' baselines differ) is refused.
# Rows of 32K tokens, whose activations spread the figures (a refused job trains nothing: it stops at the check).
# What the backward recomputes is set here: left at auto, the job under the limit would choose to keep less than the
# plan's 1 TiB machine does, and fit.
common+=(--set train.seq_len=32768 --set train.recompute=true --set train.keep_mlp=false --set train.keep_o_proj=true
         --set train.keep_down_proj=true)
"$ringflex" train --plan "${common[@]}" --ranks 2 --ranks-per-node 2 --node-memory 1TiB \
  --plan-json "$work/plan.json" >/dev/null
read -r limit cp dp ep shard dtype < <(python3 - "$work/plan.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
totals = sorted(r["total_bytes"] for r in rows)
limit = (totals[0] + totals[-1]) // 2
big = max(rows, key=lambda r: r["total_bytes"])
assert big["total_bytes"] - limit > 64 << 20, (limit, big["total_bytes"])
print(limit, big["cp"], big["dp"], big["ep"], big["shard"], big["param_dtype"])
PY
)
RINGFLEX_MEMORY_LIMIT=$limit "$ringflex" train --plan "${common[@]}" --ranks 2 --ranks-per-node 2 \
  --node-memory 1TiB --plan-json "$work/tight.json" >/dev/null
if RINGFLEX_MEMORY_LIMIT=$limit "${launcher[@]}" -n 2 "$ringflex" train "${common[@]}" --set parallelism.cp="$cp" \
  --set parallelism.dp="$dp" --set parallelism.ep="$ep" --set parallelism.shard="$shard" \
  --set model.param_dtype="$dtype" --set checkpoint.dir="$work/refused" >/dev/null 2>"$work/refused.err"; then
  echo "plan_mpirun: the row the plan says does not fit ran" >&2
  exit 1
fi
python3 - "$work/tight.json" "$work/refused.err" "$limit" "$cp" "$dp" "$ep" "$shard" "$dtype" <<'PY'
import json, re, sys
plan, err, limit = json.load(open(sys.argv[1])), open(sys.argv[2]).read(), int(sys.argv[3])
key = (int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), sys.argv[7], sys.argv[8], False)
for r in plan["rows"]:
    assert r["fits"] == (r["total_bytes"] <= limit), r
row = next(r for r in plan["rows"] if (r["cp"], r["dp"], r["ep"], r["shard"], r["param_dtype"], r["lora"]) == key)
assert not row["fits"], row
def fmt(b):  # core/memory.cpp format_bytes
    if b >= 1 << 30: return f"{b / (1 << 30):.1f} GiB"
    if b >= 1 << 20: return f"{b / (1 << 20):.1f} MiB"
    return f"{b} B"
line = next(l for l in err.splitlines() if l.startswith("ringflex: error: "))
m = re.search(r"train needs at least .* of memory per rank \((.*) at seq_len", line)
assert m, line
# "kind size, kind size, ..." (a kind may hold commas: the runtime baseline's does).
shown = re.findall(r"(.+?) (\d+(?:\.\d)? (?:GiB|MiB|B))(?:, |$)", m.group(1).removesuffix(", ..."))
planned = {t["kind"]: fmt(t["bytes"]) for t in row["terms"]}
compared = 0
for kind, size in shown:
    if kind.startswith("runtime baseline"):
        continue
    assert planned.get(kind) == size, (kind, size, planned.get(kind), line)
    compared += 1
assert compared >= 3, line
print("refused as planned:", line)
PY
