#!/usr/bin/env python3
"""train.samples on a model with KV sharing (its last layers read earlier layers' K/V), under a sharded store.

Generation's prefill normally stops after the last layer with K/V of its own (docs/generate.md); inside training the
samples' prefill runs the whole model instead (docs/train-samples.md), so the store's per-layer gathers and their
prefetches run as in a validation forward. A model with KV sharing is where the two differ, so here: a tiny random
Gemma4ForCausalLM with per-layer embeddings and 2 of 4 layers KV-shared (tests/model/parity.py's "small" config),
fine-tuned for 3 steps under `mpirun -n 2` at shard full (cp 2) and shard gradients (dp 2) with samples at every step.
Asserted: each step's samples are the tokens `ringflex generate --greedy` gives on that step's checkpoint at P = 2
(the same computation: equal), and each run's losses, norms and validation losses are a run's without samples bit
for bit. Exit 77 (CTest's skip) when torch or transformers is missing.
"""
import json
import os
import random
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "common"))
sys.path.insert(0, os.path.join(HERE, "..", "model"))
from oracle_env import missing_oracle  # noqa: E402
from train_outputs import expect_same_steps, metrics  # noqa: E402

try:
    import torch
    from transformers import Gemma4ForCausalLM
    import parity  # noqa: E402  (tests/model/parity.py: the configs and random weights)
except ImportError as e:  # pragma: no cover - depends on the environment
    missing_oracle(e)

NEW_TOKENS = 16
STEPS = 3


def main():
    ringflex, launcher = sys.argv[1], sys.argv[2:]
    work = tempfile.mkdtemp(prefix="rf_samples_kv_shared_")
    cfg = parity.CONFIGS["small"](False)
    assert cfg.num_kv_shared_layers, "the small config must share K/V"
    model = Gemma4ForCausalLM(cfg).float().eval()
    parity.randomize(model, torch.Generator().manual_seed(0))
    base = os.path.join(work, "base")
    model.save_pretrained(base, safe_serialization=True)
    with open(os.path.join(base, "generation_config.json"), "w") as f:
        json.dump({"do_sample": False}, f)  # no end tokens: generate runs all NEW_TOKENS, as the samples do
    rng = random.Random(0)
    with open(os.path.join(work, "data.jsonl"), "w") as f:
        for _ in range(40):
            f.write(json.dumps({"input_ids": [rng.randrange(1, cfg.vocab_size) for _ in range(30)]}) + "\n")
    prompt = [rng.randrange(1, cfg.vocab_size) for _ in range(20)]
    with open(os.path.join(work, "prompts.jsonl"), "w") as f:
        f.write(json.dumps({"ids": prompt}) + "\n")
    data = b"".join(struct.pack("<i", t) for t in prompt)
    header = json.dumps({"input_ids": {"dtype": "I32", "shape": [1, len(prompt)],
                                       "data_offsets": [0, len(data)]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(os.path.join(work, "prompt.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + data)

    def run(args, what):
        proc = subprocess.run(launcher + ["-n", "2", ringflex] + args, capture_output=True, text=True)
        assert proc.returncode == 0, f"{what}: exit {proc.returncode}: {proc.stderr.strip()[-600:]}"

    def train(name, grid, samples):
        args = ["train", "--set", f"model.path={base}", "--set", "data.source=jsonl_tokens",
                "--set", f"data.path={work}/data.jsonl", "--set", "train.seq_len=64", "--set", f"train.steps={STEPS}",
                "--set", "data.val_rows=2", "--set", "train.threads=1", "--set", "checkpoint.every=1",
                "--set", f"checkpoint.dir={work}/{name}", "--set", f"checkpoint.keep={STEPS}",
                "--metrics", f"{work}/{name}.jsonl"] + grid
        if samples:
            args += ["--set", f"train.samples.prompts={work}/prompts.jsonl", "--set", "train.samples.every=1",
                     "--set", f"train.samples.max_new_tokens={NEW_TOKENS}"]
        run(args, name)

    for mode, grid in (("full", ["--set", "parallelism.cp=2"]), ("gradients", ["--set", "parallelism.dp=2"])):
        grid = grid + ["--set", f"parallelism.shard={mode}"]
        train(mode, grid, True)
        train(mode + "_plain", grid, False)
        expect_same_steps(metrics(f"{work}/{mode}_plain.jsonl"), metrics(f"{work}/{mode}.jsonl"), STEPS, what=mode)
        samples = [json.loads(line) for line in open(f"{work}/{mode}.samples.jsonl")]
        assert [s["step"] for s in samples] == list(range(1, STEPS + 1)), samples
        for s in samples:
            out = f"{work}/{mode}_generate{s['step']}.jsonl"
            run(["generate", "--model", f"{work}/{mode}/step-{s['step']:08d}", "--in", f"{work}/prompt.safetensors",
                 "--greedy", "--max-new-tokens", str(NEW_TOKENS), "--out", out], f"generate {mode} {s['step']}")
            generated = json.loads(open(out).readline())["token_ids"]
            assert s["token_ids"] == generated, f"shard {mode} step {s['step']}: {s['token_ids']} vs {generated}"
    print(f"KV-shared model: samples = generate at every step under shard full and gradients; training unchanged")


if __name__ == "__main__":
    main()
