#!/usr/bin/env python3
"""Gemma 4 model under context parallelism (issue 8, items 15-16): memory per rank, speed, longest trainable row.

Every run is `mpirun --oversubscribe -n P ringflex forward --model DIR --in BATCH --out OUT --grad --no-logits
--threads T --stats STATS.json` on the 100m config of bench_model.py (5 sliding : 1 full layers, 84M parameters),
B = 1, one document, every position labelled. Figures come from the per-rank --stats JSON: tokens held,
kept_activation_bytes (activations the model keeps for the backward), peak_rss_bytes (the rank's maximum resident
set: weights, gradients, activations, runtime) and wall_s (the step: forward, backward, gradient all-reduce and
the gather of token losses).

  memory   S = --seq (16384) at P = 1, 2, 4, 8 (1 thread each): activations and peak RSS per rank; the target is
           activations falling ~1/P. On 2 cores P = 4 and 8 oversubscribe, which costs time, not memory.
  speed    the same row at P = 1 with 2 threads vs P = 2 with 1 thread each, --reps alternating repeats; the target
           is P = 2 tokens/s >= 0.9 x P = 1.
  longest  peak RSS of the busiest rank at S = 2048, 4096, 8192 for P = 1 and P = 4, fitted per P by least squares
           as a + b S (attention keeps O(S) state and the loss one fixed chunk, so memory is linear in S), and
           solved for the longest S whose P ranks together stay within --budget-gib (24) less --headroom-gib (2,
           for the OS and MPI), and for the longest S when each rank has such a machine of its own (CP across
           machines; on one machine CP spreads the same bytes over processes rather than removing them). It prints the prediction; --verify also runs one step at the predicted S (long: the
           full layer is quadratic in S).

    python3 bench/model/bench_model_cp.py build/src/cli/ringflex memory
    python3 bench/model/bench_model_cp.py build/src/cli/ringflex speed --reps 3
    python3 bench/model/bench_model_cp.py build/src/cli/ringflex longest
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import save_file
from transformers import Gemma4ForCausalLM, Gemma4TextConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_model import COMMON, CONFIGS  # noqa: E402  the same 100m config

GIB = 2**30
# Seconds a rank waits for a peer: at S = 16384 and P = 8 on 2 cores a rank may reach a layer minutes after another.
STEP_TIMEOUT_S = 3600
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def make_checkpoint(d, config):
    cfg = Gemma4TextConfig(**CONFIGS[config], **COMMON)
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(cfg).float()
    ckpt = os.path.join(d, "ckpt")
    model.save_pretrained(ckpt, safe_serialization=True)
    return ckpt, cfg.vocab_size


def make_batch(d, S, vocab):
    g = torch.Generator().manual_seed(0)
    path = os.path.join(d, f"batch_{S}.safetensors")
    save_file({"input_ids": torch.randint(1, vocab, (1, S), generator=g),
               "labels": torch.randint(0, vocab, (1, S), generator=g)}, path)
    return path


def step(ringflex, ckpt, batch, d, P, threads):
    """One forward+backward at P ranks; returns the per-rank stats records."""
    stats = os.path.join(d, "stats.json")
    cmd = ["mpirun", "--oversubscribe", "-n", str(P), ringflex, "forward", "--model", ckpt, "--in", batch,
           "--out", os.path.join(d, "out.safetensors"), "--grad", "--no-logits", "--threads", str(threads),
           "--stats", stats, "--timeout", str(STEP_TIMEOUT_S)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), **MPI_ENV)
    subprocess.run(cmd, check=True, env=env, capture_output=True, text=True)
    with open(stats) as f:
        return json.load(f)["ranks"]


def memory(a, d, ckpt, vocab):
    batch = make_batch(d, a.seq, vocab)
    print(f"{a.config}, S = {a.seq}, B = 1, 1 thread per rank")
    print("| P | tokens per rank | activations kept per rank (MiB, max) | x P=1 | peak RSS per rank (GiB, max) |"
          " step (s) |")
    print("|---|---|---|---|---|---|")
    base = None
    for P in (1, 2, 4, 8):
        ranks = step(a.ringflex, ckpt, batch, d, P, 1)
        kept = max(r["kept_activation_bytes"] for r in ranks)
        base = base or kept
        print(f"| {P} | {max(r['tokens'] for r in ranks)} | {kept / 2**20:.1f} | {kept / base:.3f} | "
              f"{max(r['peak_rss_bytes'] for r in ranks) / GIB:.2f} | {max(r['wall_s'] for r in ranks):.1f} |")


def speed(a, d, ckpt, vocab):
    batch = make_batch(d, a.seq, vocab)
    times = {1: [], 2: []}
    for _ in range(a.reps):
        times[1].append(max(r["wall_s"] for r in step(a.ringflex, ckpt, batch, d, 1, 2)))
        times[2].append(max(r["wall_s"] for r in step(a.ringflex, ckpt, batch, d, 2, 1)))
    t1, t2 = statistics.median(times[1]), statistics.median(times[2])
    print(f"{a.config}, S = {a.seq}, B = 1, {a.reps} alternating repeats (medians)")
    print("| run | step (s) | tokens/s | vs P = 1 |")
    print("|---|---|---|---|")
    print(f"| P = 1, 2 threads | {t1:.2f} | {a.seq / t1:.0f} | 1.00x |")
    print(f"| P = 2, 1 thread each | {t2:.2f} | {a.seq / t2:.0f} | {t1 / t2:.2f}x |")


def longest(a, d, ckpt, vocab):
    sizes = (2048, 4096, 8192)
    budget = (a.budget_gib - a.headroom_gib) * GIB
    print(f"{a.config}, B = 1; fit of the busiest rank's peak RSS over S = {sizes}; budget {a.budget_gib} GiB less "
          f"{a.headroom_gib} GiB headroom, shared by the P ranks of one machine")
    print("| P | peak RSS per rank at S = " + " / ".join(map(str, sizes)) + " (GiB) | a (GiB) | b (KiB/token) |"
          " longest S, P ranks on one machine | longest S, one machine per rank |")
    print("|---|---|---|---|---|---|")
    predicted = {}
    for P in (1, 4):
        rss = []
        for S in sizes:
            ranks = step(a.ringflex, ckpt, make_batch(d, S, vocab), d, P, 1)
            rss.append(max(r["peak_rss_bytes"] for r in ranks))
        n = len(sizes)
        mean_s, mean_r = sum(sizes) / n, sum(rss) / n
        b = sum((s - mean_s) * (r - mean_r) for s, r in zip(sizes, rss)) / sum((s - mean_s) ** 2 for s in sizes)
        c = mean_r - b * mean_s
        s_shared = int((budget / P - c) / b)  # the P ranks share the budget
        s_own = int((budget - c) / b)         # each rank has a machine of its own (a CP group of P machines)
        predicted[P] = s_shared
        print(f"| {P} | {' / '.join(f'{r / GIB:.2f}' for r in rss)} | {c / GIB:.2f} | {b / 1024:.1f} | {s_shared} |"
              f" {s_own} |")
    if a.verify:
        for P, S in predicted.items():
            ranks = step(a.ringflex, ckpt, make_batch(d, S, vocab), d, P, 1)
            total = sum(r["peak_rss_bytes"] for r in ranks)
            print(f"verify P = {P}, S = {S}: ranks' peak RSS sum {total / GIB:.2f} GiB, step "
                  f"{max(r['wall_s'] for r in ranks):.0f} s")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ringflex")
    ap.add_argument("mode", choices=["memory", "speed", "longest"])
    ap.add_argument("--config", choices=CONFIGS, default="100m")
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget-gib", type=float, default=24)
    ap.add_argument("--headroom-gib", type=float, default=2)
    ap.add_argument("--verify", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        ckpt, vocab = make_checkpoint(d, a.config)
        {"memory": memory, "speed": speed, "longest": longest}[a.mode](a, d, ckpt, vocab)


if __name__ == "__main__":
    main()
