#!/usr/bin/env python3
"""Gemma 4 model benchmark: forward + backward tokens/s and peak memory, ringflex vs PyTorch eager.

Both sides run the same transformers-built checkpoint (random weights, float32) on the same batch (B = 1, one
document, every position labelled), on the same CPU, in the same invocation, alternating repeats:
  - ringflex: `ringflex forward --model DIR --in BATCH --out OUT --grad --no-logits`; the step time is the
    forward+backward time the command prints (checkpoint loading and writing the gradients excluded); peak memory
    is the process's maximum resident set (/usr/bin/time -v), which includes weights and gradients; the command
    also prints the activation memory it kept and the largest one-layer recompute set.
  - PyTorch eager: Gemma4ForCausalLM from the same directory, attn_implementation "eager" and "sdpa", forward,
    cross-entropy over the [S, V] logits, backward; torch.set_num_threads = the same thread count; peak memory is
    ru_maxrss of that process.
Reported: medians over the repeats, and the ratio ringflex / PyTorch of tokens/s.

    python3 bench/model/bench_model.py build/src/cli/ringflex --config tiny --seq 512 --reps 3
    python3 bench/model/bench_model.py build/src/cli/ringflex --config 100m --seq 4096 --reps 2
    python3 bench/model/bench_model.py build/src/cli/ringflex --config 100m-moe --seq 4096 --reps 2
"""
import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from safetensors.torch import save_file
from transformers import Gemma4ForCausalLM, Gemma4TextConfig

# Gemma 4-shaped configs: 5 sliding : 1 full layers, head dim 256 sliding / 512 full, k_eq_v and one global KV
# head on full layers (as 26B/31B), softcap 30, window 512 (1024 on the large variants; 512 keeps S = 4K from
# being all-window).
CONFIGS = {
    "tiny": dict(vocab_size=4096, hidden_size=128, intermediate_size=512, num_hidden_layers=6, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=64, global_head_dim=128, num_global_key_value_heads=1),
    "100m": dict(vocab_size=65536, hidden_size=640, intermediate_size=2560, num_hidden_layers=6,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=256, global_head_dim=512,
                 num_global_key_value_heads=1),
    # The 100m config with the MoE block beside each layer's MLP, shaped as 26B-A4B (moe_intermediate_size = H / 4,
    # top-k 8 of 128 scaled down to 4 of 32 so the experts stay a modest share of the parameters).
    "100m-moe": dict(vocab_size=65536, hidden_size=640, intermediate_size=2560, num_hidden_layers=6,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=256, global_head_dim=512,
                     num_global_key_value_heads=1, enable_moe_block=True, num_experts=32, top_k_experts=4,
                     moe_intermediate_size=160),
}
COMMON = dict(attention_k_eq_v=True, sliding_window=512, final_logit_softcapping=30.0, hidden_size_per_layer_input=0,
              layer_types=["sliding_attention"] * 5 + ["full_attention"])

LOSS_CHUNK_MIB = 64  # kLossChunkBytes in src/model/gemma4.h: the loss's one [chunk, V] float32 buffer

TORCH_STEP = r"""
import resource, sys, time, torch
from transformers import Gemma4ForCausalLM
torch.set_num_threads(int(sys.argv[3]))
model = Gemma4ForCausalLM.from_pretrained(sys.argv[1], attn_implementation=sys.argv[2], dtype=torch.float32)
model.train()
S = int(sys.argv[4])
g = torch.Generator().manual_seed(0)
ids = torch.randint(1, model.config.vocab_size, (1, S), generator=g)
labels = torch.randint(0, model.config.vocab_size, (1, S), generator=g)
start = time.perf_counter()
logits = model(input_ids=ids, use_cache=False).logits
loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
loss.backward()
step = time.perf_counter() - start
print(f"step {step:.4f} maxrss_kb {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}")
"""


def run_ringflex(ringflex, ckpt, batch, out, threads):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    proc = subprocess.run(["/usr/bin/time", "-v", ringflex, "forward", "--model", ckpt, "--in", batch, "--out", out,
                           "--grad", "--no-logits"], capture_output=True, text=True, env=env, check=True)
    step = float(re.search(r"forward\+backward ([0-9.]+) s", proc.stdout).group(1))
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
    kept = re.search(r"kept for the backward ([0-9.]+) MiB, one layer's recomputed ([0-9.]+) MiB", proc.stdout)
    return step, rss, (float(kept.group(1)), float(kept.group(2)))


def run_torch(ckpt, impl, threads, S):
    proc = subprocess.run([sys.executable, "-c", TORCH_STEP, ckpt, impl, str(threads), str(S)], capture_output=True,
                          text=True, check=True)
    m = re.search(r"step ([0-9.]+) maxrss_kb (\d+)", proc.stdout)
    return float(m.group(1)), int(m.group(2))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ringflex")
    ap.add_argument("--config", choices=CONFIGS, default="tiny")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    cfg = Gemma4TextConfig(**CONFIGS[a.config], **COMMON)
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(cfg).float()
    n_params = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory() as d:
        ckpt = os.path.join(d, "ckpt")
        model.save_pretrained(ckpt, safe_serialization=True)
        del model
        g = torch.Generator().manual_seed(0)
        S = a.seq
        batch = os.path.join(d, "batch.safetensors")
        save_file({"input_ids": torch.randint(1, cfg.vocab_size, (1, S), generator=g),
                   "labels": torch.randint(0, cfg.vocab_size, (1, S), generator=g)}, batch)
        results = {"ringflex": [], "torch eager": [], "torch sdpa": []}
        for _ in range(a.reps):
            results["ringflex"].append(run_ringflex(a.ringflex, ckpt, batch, os.path.join(d, "out.safetensors"),
                                                    a.threads))
            results["torch eager"].append(run_torch(ckpt, "eager", a.threads, S))
            results["torch sdpa"].append(run_torch(ckpt, "sdpa", a.threads, S))
    print(f"config {a.config}: {n_params / 1e6:.1f}M parameters, S = {S}, B = 1, threads = {a.threads}, "
          f"reps = {a.reps}")
    print("| implementation | fwd+bwd step (median s) | tokens/s | peak RSS (GiB) | tokens/s vs torch eager |")
    print("|---|---|---|---|---|")
    base = S / statistics.median(r[0] for r in results["torch eager"])
    for name, runs in results.items():
        step = statistics.median(r[0] for r in runs)
        rss = statistics.median(r[1] for r in runs) / 2**20
        print(f"| {name} | {step:.3f} | {S / step:.0f} | {rss:.2f} | {S / step / base:.2f}x |")
    kept, layer = results["ringflex"][0][2]
    print(f"ringflex training memory: activations kept for the backward {kept:.1f} MiB, one layer's recomputed "
          f"activations {layer:.1f} MiB, loss chunk at most {LOSS_CHUNK_MIB} MiB")


if __name__ == "__main__":
    main()
