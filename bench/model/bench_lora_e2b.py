#!/usr/bin/env python3
"""LoRA fine-tuning of Gemma 4 E2B at its real shape (issue 23's target): a few steps at CP = 2 with rows of 8192 tokens.

  1. Writes Gemma 4 E2B as transformers configures it (35 layers, hidden 1536, per-layer embeddings 256 wide, KV
     sharing over the last 20 layers, double-wide MLPs there, vocabulary 262144) with random bf16 weights
     (Gemma4ForCausalLM built in bf16 and saved by save_pretrained: ~9.3 GB of safetensors) into WORKDIR/e2b, and rows
     of random token ids into WORKDIR/rows.jsonl. Both are kept between runs (delete WORKDIR to rebuild them).
  2. Runs `mpirun -n 2 ringflex train` on examples/gemma4_e2b_lora.yaml over them for --steps steps and prints each
     step's loss, tokens/s and the peak RSS of the ranks (the metrics file's peak_rss_bytes: the larger rank's; the
     mapped base's pages count in each rank's RSS, though the page cache holds them once).

Run it alone on the machine (it needs most of its 24 GiB, and its timings mean nothing beside other work):

    python3 bench/model/bench_lora_e2b.py --ringflex build/src/cli/ringflex --workdir /work/tmp/e2b_lora

--tiny makes the same structure at a toy size (4 layers, hidden 64, vocabulary 512, rows of 64 tokens) to check the
script itself in seconds. Not in CTest: it writes ~10 GB and runs for many minutes.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import time

REAL = dict(vocab_size=262144, hidden_size=1536, num_hidden_layers=35, num_attention_heads=8, num_key_value_heads=1,
            intermediate_size=6144, use_double_wide_mlp=True, hidden_size_per_layer_input=256,
            num_kv_shared_layers=20, layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7,
            final_logit_softcapping=30.0)
TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
            head_dim=16, global_head_dim=32, intermediate_size=128, use_double_wide_mlp=True,
            hidden_size_per_layer_input=16, vocab_size_per_layer_input=512, num_kv_shared_layers=2,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            sliding_window=16, final_logit_softcapping=30.0)


def make_model(path, fields):
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig
    if os.path.exists(os.path.join(path, "config.json")):
        return
    cfg = Gemma4TextConfig(**fields)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: never a float32 copy of the 5 B parameters
    model = Gemma4ForCausalLM(cfg)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(path, safe_serialization=True)
    print(f"wrote {path}: {n / 1e9:.2f} B parameters in bf16", flush=True)


def make_rows(path, vocab, seq_len, rows):
    if os.path.exists(path):
        return
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(rows):
            f.write(json.dumps({"input_ids": [rng.randrange(1, vocab) for _ in range(seq_len)]}) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ringflex", required=True)
    ap.add_argument("--workdir", required=True, help="where the model and rows are written (not in the repository)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=1, help="train.threads per rank (2 ranks on 2 cores: 1)")
    ap.add_argument("--tiny", action="store_true", help="the same structure at a toy size (checks the script)")
    a = ap.parse_args()
    fields = TINY if a.tiny else REAL
    seq_len = 64 if a.tiny else a.seq_len
    os.makedirs(a.workdir, exist_ok=True)
    model_dir = os.path.join(a.workdir, "e2b_tiny" if a.tiny else "e2b")
    rows = os.path.join(a.workdir, f"rows_{fields['vocab_size']}_{seq_len}.jsonl")
    make_model(model_dir, fields)
    make_rows(rows, fields["vocab_size"], seq_len, rows=4 * a.steps)
    config = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "gemma4_e2b_lora.yaml")
    metrics = os.path.join(a.workdir, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    sets = {"model.path": model_dir, "data.path": rows, "data.val_rows": 0, "train.steps": a.steps,
            "train.seq_len": seq_len, "train.global_batch": 1, "train.threads": a.threads,
            "checkpoint.dir": os.path.join(a.workdir, "ckpt"), "checkpoint.every": a.steps}
    cmd = ["mpirun", "--oversubscribe", "-n", "2", a.ringflex, "train", "--config", config, "--metrics", metrics]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    print(" ".join(cmd), flush=True)
    start = time.time()
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0:
        return proc.returncode
    print(f"ran {a.steps} steps in {time.time() - start:.0f} s (loading included)")
    with open(metrics) as f:
        for line in f:
            m = json.loads(line)
            print(f"step {m['step']}: loss {m['loss']:.4f}, {m['tokens_per_s']:.1f} tokens/s, "
                  f"peak RSS {m['peak_rss_bytes'] / 2**30:.2f} GiB (the larger rank)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
