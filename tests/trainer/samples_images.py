#!/usr/bin/env python3
"""train.samples with images in the prompts (docs/train-samples.md), against `ringflex generate --messages`.

The checkpoint is chat_train.py's tiny random Gemma4ForConditionalGeneration (a one-layer vision tower, the tiny chat
tokenizer and a real Gemma 4 chat template) with a processor_config.json (max_soft_tokens 70) beside it, which the
run's checkpoints carry, so that the samples (data.image_soft_tokens, whose default it is) and generate on a
checkpoint lay the images out alike. It is fine-tuned on chat_train.py's conversations (images among them) for
STEPS steps with two sample prompts: a question about one picture, and the same question about another (so the
samples show the image reaches the model: the two continuations differ). Runs: P = 1; P = 2 at cp 2 and at dp 2; P = 2
at cp 2 with model.train_vision (the tower trains and the samples encode the images with each step's tower), under
shard none and full (the tower's weights gathered as the samples encode). Asserted at every sample step: the samples'
greedy tokens are `ringflex generate --greedy --messages` on the checkpoint of that step at the same P and at P = 1
(the same prompts, pixels through the same tower weights, the same computation: equal); cp 2's and dp 2's samples are
P = 1's (training's bits do not depend on the grid). Exit 77 (CTest's skip) without torch, transformers, trl or safetensors.
Usage: samples_images.py RINGFLEX MPIEXEC...
"""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "common"))
from oracle_env import missing_oracle  # noqa: E402

try:
    from chat_train import SOFT, checkpoint, conversations
except ImportError as e:  # pragma: no cover - depends on the environment
    missing_oracle(e)

STEPS = 2
NEW_TOKENS = 12
SEQ = 1024  # chat_train.py's row: its conversations packed, images and all

PROMPTS = [{"messages": [{"role": "user", "content": [{"type": "image", "path": f"img/{i}.png"},
                                                      {"type": "text", "text": "What is this?"}]}]}
           for i in (0, 1)]


def run(launcher, ranks, args, what):
    proc = subprocess.run(launcher + ["-n", str(ranks)] + args, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode != 0:
        sys.exit(f"FAILED: {what}: exit {proc.returncode}: {proc.stderr.strip()[-800:]}")
    return proc.stdout


def main():
    if len(sys.argv) < 3:
        raise SystemExit("usage: samples_images.py RINGFLEX MPIEXEC...")
    ringflex, launcher = sys.argv[1], sys.argv[2:]
    with tempfile.TemporaryDirectory() as work:
        _, ckpt, _ = checkpoint(work)
        with open(os.path.join(ckpt, "processor_config.json"), "w") as f:
            json.dump({"image_processor": {"max_soft_tokens": SOFT}}, f)
        with open(os.path.join(ckpt, "generation_config.json"), "w") as f:
            json.dump({"do_sample": False}, f)  # no end tokens: every sample runs NEW_TOKENS, as generate does
        data = os.path.join(work, "chats.jsonl")
        with open(data, "w") as f:
            f.write("".join(json.dumps(c) + "\n" for c in conversations()))
        prompts = os.path.join(work, "prompts.jsonl")
        with open(prompts, "w") as f:
            f.write("".join(json.dumps(p) + "\n" for p in PROMPTS))
        runs = {"p1": (1, ["parallelism.cp=1"]), "cp2": (2, ["parallelism.cp=2"]),
                "cp2_vision": (2, ["parallelism.cp=2", "model.train_vision=true"]),
                "dp2": (2, ["parallelism.dp=2", "train.global_batch=2"]),
                "cp2_vision_full": (2, ["parallelism.cp=2", "model.train_vision=true", "parallelism.shard=full"])}
        first = None  # p1's samples
        for name, (ranks, sets) in runs.items():
            args = [ringflex, "train", "--metrics", os.path.join(work, name + ".jsonl")]
            for s in ["data.source=jsonl_chat", f"data.path={data}", f"model.path={ckpt}", f"train.seq_len={SEQ}",
                      f"train.steps={STEPS}", "train.global_batch=1", "train.micro_batch=1", "train.threads=1",
                      "train.val_every=0", "data.val_rows=0", "optimizer.lr=0.01", "checkpoint.every=1",
                      f"checkpoint.keep={STEPS}", f"checkpoint.dir={os.path.join(work, name)}",
                      f"train.samples.prompts={prompts}", "train.samples.every=1",
                      f"train.samples.max_new_tokens={NEW_TOKENS}", *sets]:
                args += ["--set", s]
            run(launcher, ranks, args, f"train {name}")
            samples = [json.loads(line) for line in open(os.path.join(work, name + ".samples.jsonl"))]
            assert [(s["step"], s["prompt"]) for s in samples] == [(t, i) for t in range(1, STEPS + 1)
                                                                   for i in range(len(PROMPTS))], samples
            for step in range(1, STEPS + 1):
                mine = [s["token_ids"] for s in samples if s["step"] == step]
                for p in sorted({1, ranks}):
                    out = os.path.join(work, f"{name}.generate{step}.P{p}.jsonl")
                    run(launcher, p, [ringflex, "generate", "--model", os.path.join(work, name, f"step-{step:08d}"),
                                      "--messages", prompts, "--greedy", "--max-new-tokens", str(NEW_TOKENS),
                                      "--out", out], f"generate {name} step {step} P {p}")
                    generated = [json.loads(line)["token_ids"] for line in open(out)]
                    assert mine == generated, f"{name} step {step}: samples {mine} vs generate at P = {p} {generated}"
                assert mine[0] != mine[1], f"{name} step {step}: the two pictures gave the same tokens {mine[0]}"
            if name in ("cp2", "dp2"):  # the same weights as P = 1's (training's bits do not depend on the grid)
                assert samples == first, f"{name}: {samples} vs p1's {first}"
            first = first or samples
            print(f"{name}: samples = generate --messages on each step's checkpoint; step {STEPS}:",
                  [s["token_ids"] for s in samples if s["step"] == STEPS])
    print("train.samples with images: generate's tokens at P = 1, 2 (cp 2, dp 2, cp 2 with the tower training under",
          "shard none and full)")


if __name__ == "__main__":
    main()
