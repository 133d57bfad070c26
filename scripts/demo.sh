#!/usr/bin/env bash
# The main job: builds ringflex and fine-tunes the built-in tiny Gemma 4 MoE VLM on built-in mock VLM data with
# every row split over 2 ranks (context parallelism), a few hundred steps in a few minutes on 2 cores. It ends
# with the loss picture, the checkpoint's path and a question from the held-out data: a validation document's
# picture and caption given to `ringflex generate` on the final checkpoint, its continuation printed beside the
# expected one (the mock vocabulary as words: docs/train-samples.md). Options go to `ringflex train`, e.g.
# `scripts/demo.sh --set train.steps=50`; `ringflex train --help` lists them.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -B build >/dev/null
cmake --build build -j "$(nproc)" --target ringflex
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# One OpenMP thread per rank (the config says so too): the 2 ranks fill the 2 cores.
export OMP_NUM_THREADS=1
mkdir -p runs
config=examples/gemma4_tiny_moe_vlm.yaml
mpirun --oversubscribe -n 2 ./build/src/cli/ringflex train --config "$config" \
  --metrics runs/gemma4_tiny_moe_vlm.jsonl "$@"
# The --set options shape the data too (seq_len, seed, ...): `ringflex data` takes them to find the same document.
sets=()
while [ "$#" -gt 0 ]; do
  if [ "$1" = --set ] && [ "$#" -ge 2 ]; then
    sets+=(--set "$2")
    shift
  fi
  shift
done
checkpoint=$(ls -d runs/gemma4_tiny_moe_vlm/step-* | sort | tail -n 1)
echo "Asking $checkpoint about a held-out document:"
./build/src/cli/ringflex data --config "$config" "${sets[@]}" --set model.path="$checkpoint" \
  --held-out runs/held_out_prompt.safetensors >/dev/null
mpirun --oversubscribe -n 2 ./build/src/cli/ringflex generate --model "$checkpoint" \
  --in runs/held_out_prompt.safetensors --greedy --max-new-tokens 12 --out runs/held_out_answer.jsonl >/dev/null
./build/src/cli/ringflex data --config "$config" "${sets[@]}" --set model.path="$checkpoint" \
  --held-out runs/held_out_prompt.safetensors --answer runs/held_out_answer.jsonl
