#!/usr/bin/env bash
# train.samples under a real mpirun (docs/train-samples.md): the greedy samples a run writes at a step are the tokens
# `ringflex generate --greedy` gives on the checkpoint saved at that step, at the same P, under parallelism.shard
# none, optimizer, gradients and full, at parallelism.ep 2 (held experts; across the DP replicas and inside the CP
# group, where ep 2's samples are also ep 1's) and for a LoRA run (generate --lora on its base): the
# samples run the store's hooks as the training forward does, so they see the weights exactly as the step left them.
# Both sides are the same computation at the same P (the prefill's layers through the same ring, the same decode
# steps), so the tokens are compared for equality. Also asserted: the samples file's records (step, prompt, where,
# prompt_ids, token_ids, stop_reason) at the sample steps (every 2 and the last), the first sample printed, and that
# a run with samples trains the bits of one without (shard full: every loss, norm and validation loss), and that a
# sample stops on the end tokens of the checkpoint's generation_config.json with generate's tokens and stop reason.
# Conversations: the tiny chat example with {"messages": ...} prompts gives `generate --messages`' tokens and text on
# its checkpoint (which carries the example's tokenizer and template).
#   samples_mpirun.sh WORKDIR RINGFLEX MPIEXEC... -- SOURCE_DIR
set -euo pipefail
source "$(dirname "$0")/../common/mpirun_lib.sh"
source_dir=$1
new_tokens=8
# Two prompts of the mock vocabulary (a document opener and a count by 3), the second past a sliding window of the
# tiny models at no cost: the same length, so that one --in batch file holds both for generate.
python3 - "$work" <<'PY'
import json, struct, sys
work = sys.argv[1]
prompts = [[1] + [32 + 3 * k for k in range(19)], [1] + [40 + 7 * k for k in range(19)]]
with open(f"{work}/prompts.jsonl", "w") as f:
    for p in prompts:
        f.write(json.dumps({"ids": p}) + "\n")
data = b"".join(struct.pack("<i", t) for p in prompts for t in p)
header = json.dumps({"input_ids": {"dtype": "I32", "shape": [len(prompts), len(prompts[0])],
                                   "data_offsets": [0, len(data)]}}).encode()
header += b" " * (-len(header) % 8)
with open(f"{work}/prompts.safetensors", "wb") as f:
    f.write(struct.pack("<Q", len(header)) + header + data)
PY
common=(--set train.seq_len=64 --set train.steps=3 --set data.val_rows=2 --set train.threads=1
        --set model.builtin=tiny_moe_vlm --set model.init_std=0.4 --set checkpoint.every=2
        --set train.samples.prompts="$work/prompts.jsonl" --set train.samples.every=2
        --set train.samples.max_new_tokens=$new_tokens)
"${launcher[@]}" -n 2 "$ringflex" train "${common[@]}" --set parallelism.cp=2 --set checkpoint.dir="$work/none" \
  --metrics "$work/none.jsonl" >"$work/none.out"
train_job optimizer 2 --set parallelism.dp=2 --set parallelism.shard=optimizer
train_job gradients 2 --set parallelism.dp=2 --set parallelism.shard=gradients
train_job full 2 --set parallelism.cp=2 --set parallelism.shard=full
# The same run without samples: sampling leaves the training bits alone (every loss, norm and validation loss).
train_job full_plain 2 --set parallelism.cp=2 --set parallelism.shard=full --set train.samples.prompts=
train_job ep 2 --set parallelism.dp=2 --set parallelism.ep=2 --set parallelism.shard=gradients
# EP inside the CP group (cp 2 x ep 2): the samples' decode steps run each expert on its holder (cp/decode_experts.h).
train_job ep_cp 2 --set parallelism.cp=2 --set parallelism.ep=2
train_job lora 2 --set parallelism.cp=2 --set model.path="$work/none/step-00000003" --set model.lora.rank=2
# Stop tokens: a sample ends on the end tokens of the generation_config.json the run's checkpoints carry, as generate
# on them does. A probe run from none's last checkpoint (no generation_config.json: every sample runs 8 tokens) shows
# the tokens its last step's samples take; that folder then gets a generation_config.json whose eos_token_id (a list,
# as Gemma 4's) holds an id no sample takes and a token of the first sample, and the same run again (the same bits:
# samples leave training alone) must stop that sample right after it, as generate on its checkpoint does.
cp -r "$work/none/step-00000003" "$work/stop_base"
stop=(--set parallelism.cp=2 --set model.path="$work/stop_base" --set train.steps=2 --set train.samples.every=0)
train_job stop_probe 2 "${stop[@]}"
python3 - "$work" <<'PY'
import json, sys
work = sys.argv[1]
samples = [json.loads(line)["token_ids"] for line in open(f"{work}/stop_probe.samples.jsonl")]
first = samples[0]
# The first token not seen before it, past the first where there is one: the sample then stops early.
k = next((i for i in range(1, len(first) - 1) if first[i] not in first[:i]), 0)
unused = next(t for t in range(511, 0, -1) if all(t not in s for s in samples))
json.dump({"do_sample": False, "eos_token_id": [unused, first[k]]}, open(f"{work}/stop_base/generation_config.json", "w"))
PY
train_job stop 2 "${stop[@]}"
"${launcher[@]}" -n 2 "$ringflex" generate --model "$work/stop/step-00000002" --in "$work/prompts.safetensors" \
  --greedy --max-new-tokens $new_tokens --out "$work/stop.generate2.jsonl" >/dev/null
# generate's tokens on each run's checkpoint at each sample step, at P = 2.
for run in none optimizer gradients full ep ep_cp lora; do
  for step in 2 3; do
    ck="$work/$run/step-0000000$step"
    model=(--model "$ck")
    [ "$run" != lora ] || model=(--model "$work/none/step-00000003" --lora "$ck")
    "${launcher[@]}" -n 2 "$ringflex" generate "${model[@]}" --in "$work/prompts.safetensors" --greedy \
      --max-new-tokens $new_tokens --out "$work/$run.generate$step.jsonl" >/dev/null
  done
done
# The chat example with two conversations as prompts, the last step only (every 0).
cat >"$work/chat_prompts.jsonl" <<'JSONL'
{"messages": [{"role": "user", "content": "Name a thing that is red."}]}
{"messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 35 plus 14?"}]}
JSONL
chat=(--config "$source_dir/examples/gemma4_tiny_chat.yaml" --set train.steps=2 --set train.seq_len=128
      --set data.path="$source_dir/examples/tiny_chat/conversations.jsonl"
      --set data.tokenizer="$source_dir/examples/tiny_chat/tokenizer.json"
      --set data.chat_template="$source_dir/examples/tiny_chat/chat_template.jinja"
      --set train.samples.prompts="$work/chat_prompts.jsonl" --set train.samples.max_new_tokens=$new_tokens
      --set checkpoint.dir="$work/chat" --set checkpoint.every=0)
"${launcher[@]}" -n 2 "$ringflex" train "${chat[@]}" --metrics "$work/chat.jsonl" >/dev/null
"${launcher[@]}" -n 2 "$ringflex" generate --model "$work/chat/step-00000002" --messages "$work/chat_prompts.jsonl" \
  --greedy --max-new-tokens $new_tokens --out "$work/chat.generate2.jsonl" >/dev/null
python3 - "$work" "$new_tokens" <<'PY'
import json, sys
work, new_tokens = sys.argv[1], int(sys.argv[2])
samples = [json.loads(line) for line in open(f"{work}/chat.samples.jsonl")]
generated = [json.loads(line) for line in open(f"{work}/chat.generate2.jsonl")]
assert [(s["step"], s["prompt"]) for s in samples] == [(2, 0), (2, 1)], samples
for s, g in zip(samples, generated):
    assert s["token_ids"] == g["token_ids"] and s["text"] == g["text"], (s, g)
print("conversations: generate --messages' tokens and text:", [s["text"] for s in samples])
from train_outputs import expect_same_steps, metrics
expect_same_steps(metrics(f"{work}/full_plain.jsonl"), metrics(f"{work}/full.jsonl"), 3)
prompts = [json.loads(line)["ids"] for line in open(f"{work}/prompts.jsonl")]
for run in ("none", "optimizer", "gradients", "full", "ep", "ep_cp", "lora"):
    samples = [json.loads(line) for line in open(f"{work}/{run}.samples.jsonl")]
    assert [(s["step"], s["prompt"]) for s in samples] == [(2, 0), (2, 1), (3, 0), (3, 1)], (run, samples)
    for s in samples:
        assert s["where"] == f"{work}/prompts.jsonl:{s['prompt'] + 1}", s
        assert s["prompt_ids"] == prompts[s["prompt"]], s
        assert len(s["token_ids"]) == new_tokens and s["stop_reason"] == "length", s
        generated = [json.loads(line) for line in open(f"{work}/{run}.generate{s['step']}.jsonl")]
        assert s["token_ids"] == generated[s["prompt"]]["token_ids"], \
            f"{run} step {s['step']} prompt {s['prompt']}: sample {s['token_ids']} vs generate " \
            f"{generated[s['prompt']]['token_ids']}"
# Expert parallelism changes no bit of training or generation: ep 2's samples are ep 1's, with the EP group inside the
# CP group (ep_cp against none, cp 2) and across the DP replicas (ep against gradients, dp 2).
for ep_run, plain in (("ep_cp", "none"), ("ep", "gradients")):
    tokens = lambda run: [json.loads(line)["token_ids"] for line in open(f"{work}/{run}.samples.jsonl")]
    assert tokens(ep_run) == tokens(plain), f"{ep_run} {tokens(ep_run)} vs {plain} {tokens(plain)}"
expect_same_steps(metrics(f"{work}/stop_probe.jsonl"), metrics(f"{work}/stop.jsonl"), 2)
probe = [json.loads(line) for line in open(f"{work}/stop_probe.samples.jsonl")]
stopped = [json.loads(line) for line in open(f"{work}/stop.samples.jsonl")]
generated = [json.loads(line) for line in open(f"{work}/stop.generate2.jsonl")]
eos = json.load(open(f"{work}/stop_base/generation_config.json"))["eos_token_id"]
first = stopped[0]["token_ids"]
assert stopped[0]["stop_reason"] == "eos" and first[-1] == eos[1] and first == probe[0]["token_ids"][:len(first)], \
    (stopped[0], probe[0], eos)
for s, g in zip(stopped, generated):
    assert s["step"] == 2 and (s["token_ids"], s["stop_reason"]) == (g["token_ids"], g["stop_reason"]), (s, g)
print(f"stop tokens {eos}: the first sample stops after {len(first)} of {new_tokens} tokens (eos), as generate on the",
      "step's checkpoint:", [(s["token_ids"], s["stop_reason"]) for s in stopped])
# The first prompt's sample is printed at each sample step, in the mock vocabulary's words.
printed = [line for line in open(f"{work}/none.out") if ": sample (" in line]
assert [line.split(":")[0] for line in printed] == ["step 2", "step 3"], printed
print("train.samples = generate on the step's checkpoint under shard none, optimizer, gradients, full, ep 2, LoRA;",
      "e.g.", printed[-1].strip())
PY
