#!/usr/bin/env python3
"""Prefill and decode tokens/s of `ringflex generate` against transformers' generate on the same checkpoint and
threads (bench_model.py's Gemma 4-shaped configs, random weights, float32, greedy), with the machine's memory
bandwidth measured in the same run and the decode bound it sets: bytes read per new token (the weights the step
multiplies, every matrix once, plus the KV cache it reads) over that bandwidth.

    python3 bench/model/bench_generate.py build/src/cli/ringflex --config 100m --prompt 512 --new 64 --threads 2

transformers' prefill is timed as its generate with max_new_tokens=1, its decode as the rest of a
max_new_tokens=NEW generate; ringflex's from its --out record (prefill: the prompt to the first token's logits).
Each figure the median of --reps runs. With --batch B > 1, ringflex also decodes B prompts of that length together
(one --in of B rows): its per-sequence decode tok/s, their sum, and the bound of a batched step (the weights read
once for B tokens, every sequence's cache once).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import Gemma4ForCausalLM, Gemma4TextConfig  # noqa: E402

from bench_model import COMMON, CONFIGS  # noqa: E402


def bandwidth(threads):
    """Bytes/s of a large copy (read + write counted), the median of 5, numpy on `threads` threads' worth of data."""
    a = np.ones(64 << 20, dtype=np.float32)  # 256 MiB, far past every cache
    b = np.empty_like(a)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(b, a)
        times.append(time.perf_counter() - t)
    return 2 * a.nbytes / statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ringflex")
    ap.add_argument("--config", default="100m", choices=list(CONFIGS))
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cfg = Gemma4TextConfig(**CONFIGS[a.config], **COMMON)
    model = Gemma4ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.02)
    model.generation_config.eos_token_id = None
    with tempfile.TemporaryDirectory() as work:
        ckpt = os.path.join(work, "ckpt")
        model.save_pretrained(ckpt, safe_serialization=True)
        with open(os.path.join(ckpt, "generation_config.json"), "w") as f:
            json.dump({"do_sample": False}, f)
        ids = torch.randint(1, cfg.vocab_size, (1, a.prompt))
        prompt = os.path.join(work, "prompt.safetensors")
        save_file({"input_ids": ids.to(torch.int32)}, prompt)
        rf_prefill, rf_decode, rf_cache = [], [], 0
        for _ in range(a.reps):
            out = os.path.join(work, "out.jsonl")
            subprocess.run([a.ringflex, "generate", "--model", ckpt, "--in", prompt, "--max-new-tokens", str(a.new),
                            "--out", out, "--threads", str(a.threads)], check=True, capture_output=True)
            with open(out) as f:
                r = json.loads(f.readline())
            rf_prefill.append(r["prefill_tokens_per_s"])
            rf_decode.append(r["decode_tokens_per_s"])
            rf_cache = r["cache_bytes"]
        rf_batch = []
        if a.batch > 1:
            rows = os.path.join(work, "rows.safetensors")
            save_file({"input_ids": torch.randint(1, cfg.vocab_size, (a.batch, a.prompt)).to(torch.int32)}, rows)
            for _ in range(a.reps):
                out = os.path.join(work, "batch.jsonl")
                subprocess.run([a.ringflex, "generate", "--model", ckpt, "--in", rows, "--max-new-tokens",
                                str(a.new), "--out", out, "--threads", str(a.threads)], check=True, capture_output=True)
                with open(out) as f:
                    rf_batch.append(statistics.median(json.loads(line)["decode_tokens_per_s"] for line in f))
        hf_prefill, hf_decode = [], []
        with torch.no_grad():
            for _ in range(a.reps):
                t = time.perf_counter()
                model.generate(ids, max_new_tokens=1, do_sample=False, use_cache=True)
                first = time.perf_counter() - t
                t = time.perf_counter()
                model.generate(ids, max_new_tokens=a.new, min_new_tokens=a.new, do_sample=False, use_cache=True)
                whole = time.perf_counter() - t
                hf_prefill.append(a.prompt / first)
                hf_decode.append((a.new - 1) / max(whole - first, 1e-9))
    weights = sum(p.numel() for n, p in model.named_parameters() if p.dim() >= 2 and "embed_tokens" not in n) * 4
    weights += cfg.vocab_size * cfg.hidden_size * 4  # the LM head (tied: the embedding, read whole once a step)
    bw = bandwidth(a.threads)
    per_token = weights + rf_cache
    bound = bw / per_token
    med = statistics.median
    print(f"config {a.config}, prompt {a.prompt}, {a.new} new tokens, {a.threads} threads, median of {a.reps}")
    print(f"| | prefill tok/s | decode tok/s |")
    print(f"|---|---|---|")
    print(f"| transformers generate | {med(hf_prefill):.0f} | {med(hf_decode):.1f} |")
    print(f"| ringflex generate | {med(rf_prefill):.0f} | {med(rf_decode):.1f} |")
    print(f"| ratio | {med(rf_prefill) / med(hf_prefill):.2f}x | {med(rf_decode) / med(hf_decode):.2f}x |")
    print(f"memory bandwidth {bw / 1e9:.1f} GB/s (copy), bytes a new token reads {per_token / 2**20:.1f} MiB "
          f"(weights {weights / 2**20:.1f}, cache {rf_cache / 2**20:.1f}): bound {bound:.1f} tok/s, ringflex at "
          f"{med(rf_decode) / bound:.2f} of it")
    if rf_batch:
        batch_bound = a.batch * bw / (weights + a.batch * rf_cache)
        print(f"batch of {a.batch}: {med(rf_batch):.1f} decode tok/s a sequence, {a.batch * med(rf_batch):.1f} in all "
              f"({a.batch * med(rf_batch) / med(rf_decode):.2f}x one sequence's); a batched step's bound "
              f"{batch_bound:.1f} tok/s, ringflex at {a.batch * med(rf_batch) / batch_bound:.2f} of it")


if __name__ == "__main__":
    main()
