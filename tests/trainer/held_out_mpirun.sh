#!/usr/bin/env bash
# The end of scripts/demo.sh on a short run: `ringflex data --held-out` writes a held-out document of the built-in
# mock VLM data as a prompt (its picture's soft tokens through the checkpoint's tower, cut after the caption),
# `ringflex generate --in` continues it on the run's checkpoint at P = 2, and `ringflex data --answer` prints the
# expected continuation beside the model's in the mock vocabulary's words. Asserted: the prompt file's tensors and
# the rows the trainer validated on agree (the prompt is a validation document's opening, checked in test_data.cpp's
# HeldOutPrompt test on the same source), and the printed lines' form.
#   held_out_mpirun.sh WORKDIR RINGFLEX MPIEXEC... -- CONFIG
set -euo pipefail
source "$(dirname "$0")/../common/mpirun_lib.sh"
config=$1
common=(--config "$config" --set train.steps=3 --set train.seq_len=128 --set data.val_rows=2)
train_job run 2
ck="$work/run/step-00000003"
"$ringflex" data "${common[@]}" --set model.path="$ck" --held-out "$work/q.safetensors" >"$work/held_out.out"
"${launcher[@]}" -n 2 "$ringflex" generate --model "$ck" --in "$work/q.safetensors" --greedy --max-new-tokens 12 \
  --out "$work/answer.jsonl" >/dev/null
"$ringflex" data "${common[@]}" --set model.path="$ck" --held-out "$work/q.safetensors" --answer "$work/answer.jsonl" \
  >"$work/answer.out"
python3 - "$work" <<'PY'
import json, re, sys
from train_outputs import safetensors_header
work = sys.argv[1]
header = safetensors_header(f"{work}/q.safetensors")[0]
assert header["input_ids"]["shape"] == [1, 18] and header["mm_token_type_ids"]["shape"] == [1, 18], header
assert header["image_features"]["shape"][0] == 16, header  # the example's 16 soft tokens a picture
printed = open(f"{work}/held_out.out").read()
assert re.search(r"the prompt: <bos> <image x16> <(red|green|blue|yellow) (square|disc|wide bar|tall bar)>\n", printed), printed
lines = open(f"{work}/answer.out").read().splitlines()
assert lines[0].startswith("asked:    <bos> <image x16> <"), lines
expected, model = lines[1].split()[1:], lines[2].split()[1:]
assert lines[1].startswith("expected: ") and len(expected) == 12 and all(t.isdigit() for t in expected), lines
answer = json.loads(open(f"{work}/answer.jsonl").readline())["token_ids"]
assert lines[2].startswith("model:    ") and len(answer) == 12, (lines, answer)
# The agreeing prefix, when the model's words are all numbers (a caption's name is several words).
same = re.fullmatch(r"the model's first (\d+) of 12 tokens are the expected ones", lines[3])
assert same, lines
if all(t.isdigit() for t in model):
    assert int(same.group(1)) == next((i for i, (a, b) in enumerate(zip(expected, model)) if a != b), 12), lines
print("held-out question:", *lines, sep="\n  ")
PY
