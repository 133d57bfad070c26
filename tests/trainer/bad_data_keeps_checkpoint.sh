#!/usr/bin/env bash
# Trains 2 steps on a token file with a checkpoint; then the file turns bad (a token id beyond the vocabulary)
# and a resume must fail on every rank with one clear line, leaving the checkpoint byte for byte as it was.
#   bad_data_keeps_checkpoint.sh WORKDIR EXPECT_ERROR BAD_JSONL LAUNCH...
set -euo pipefail
work=$1 expect_error=$2 bad=$3
shift 3
rm -rf "$work"
mkdir -p "$work"
for i in $(seq 1 12); do
  echo "{\"input_ids\": [1, $(seq -s ', ' $((i + 30)) $((i + 60)))]}"
done >"$work/data.jsonl"
small=(--set train.seq_len=64 --set data.val_rows=2 --set train.threads=1 --set parallelism.dp=2
       --set data.source=jsonl_tokens --set data.path="$work/data.jsonl"
       --set checkpoint.dir="$work/ck" --set checkpoint.every=2)
"$@" train "${small[@]}" --set train.steps=2 >/dev/null
before=$(cd "$work/ck" && find . -type f -exec sha256sum {} + | sort)
cp "$bad" "$work/data.jsonl"
"$expect_error" 2 "data.jsonl:2: token id 512 at position 1 is outside the model's vocabulary" \
  "$@" train "${small[@]}" --set train.steps=4 --resume "$work/ck"
after=$(cd "$work/ck" && find . -type f -exec sha256sum {} + | sort)
if [ "$before" != "$after" ]; then
  echo "bad_data_keeps_checkpoint: the checkpoint changed" >&2
  diff <(echo "$before") <(echo "$after") >&2
  exit 1
fi
