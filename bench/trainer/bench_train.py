#!/usr/bin/env python3
"""`ringflex train` throughput and memory (issue 13, item 9). Prints markdown tables for BENCHMARKS.md.

Every ringflex run is `[mpirun --oversubscribe -n P] ringflex train --metrics M.jsonl ...` on the mock VLM data
(packed rows with documents, 16-slot images and padding), global batch --batch rows of --seq tokens, micro-batches
of one row. Figures come from the metrics file: tokens_per_s (non-padding tokens of the global batch per second
of the step, the median over the steps after the first --skip, which pay for page faults and warm-up) and
peak_rss_bytes (the largest peak resident set over the ranks).

  speed    CP = 1 with 2 threads vs CP = 2 with 1 thread each, --reps alternating repeats (target: CP = 2 >= 0.9 x
           CP = 1 tokens/s on the 2 cores).
  memory   peak RSS per rank at S = --seq for CP = 1, 2, 4, 8 (1 thread each; 4 and 8 oversubscribe the cores, which
           costs time, not memory). Target: the activation part falls ~1/P (weights, gradients and AdamW state are
           replicated and do not).
  shard-memory  peak RSS per rank for each parallelism.shard mode (none, optimizer, gradients, full) at N = CP = 1,
           2, 4, 8 (1 thread each), beside the memory model's per-rank total (the up-front check's, --stats).
           Target (issue 22): the state part falls as 1/N under full.
  shard-speed   parallelism.shard full against none at CP = 2 (1 thread each), --reps alternating repeats, with the
           exposed communication (the metrics' shard_comm_wait_s, median per step). Target: full >= 0.9 x none.
  torch    PyTorch training steps (transformers Gemma4ForCausalLM, SDPA, AdamW, float32, 2 threads) on the same
           model and row shape, one causal document per row (SDPA has no packed-document mask; the mask changes the
           attention's work, which at these sizes is a small part of the step), against ringflex at CP = 1, 2 threads.

--model tiny_moe_vlm (the built-in, 0.45M parameters) or 100m (bench/model's 84M-parameter config, written here as
a Hugging Face checkpoint with random weights; image features then arrive at the hidden size).

    python3 bench/trainer/bench_train.py build/src/cli/ringflex speed --model 100m --seq 4096
    python3 bench/trainer/bench_train.py build/src/cli/ringflex memory --model 100m --seq 8192
    python3 bench/trainer/bench_train.py build/src/cli/ringflex torch --model 100m --seq 4096
    python3 bench/trainer/bench_train.py build/src/cli/ringflex shard-memory --model 100m --seq 4096 --steps 3 --skip 1
    python3 bench/trainer/bench_train.py build/src/cli/ringflex shard-speed --model 100m --seq 4096
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

MIB = 2**20


def make_model(name, workdir):
    """--set arguments selecting the model; writes the 100m checkpoint when asked for it."""
    if name == "tiny_moe_vlm":
        return ["--set", "model.builtin=tiny_moe_vlm"], None
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "model"))
    from bench_model import COMMON, CONFIGS  # the same 100m config as the model benchmarks
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**CONFIGS[name], **COMMON))
    path = os.path.join(workdir, name)
    model.save_pretrained(path, safe_serialization=True)
    return ["--set", f"model.path={path}"], path


def train(ringflex, model_args, P_cp, threads, a, workdir, tag, shard="none", waits=None, model_bytes=None):
    """Median tokens/s and the largest peak RSS of any rank; with model_bytes, appends the memory model's per-rank
    total (ringflex train --stats: the figure the up-front memory check used)."""
    metrics = os.path.join(workdir, f"{tag}.jsonl")
    stats = os.path.join(workdir, f"{tag}.stats.json")
    cmd = [ringflex, "train", *model_args, "--set", f"parallelism.cp={P_cp}", "--set", "parallelism.dp=1",
           "--set", f"parallelism.shard={shard}",
           "--set", f"train.threads={threads}", "--set", f"train.seq_len={a.seq}", "--set", f"train.steps={a.steps}",
           "--set", f"train.global_batch={a.batch}", "--set", "train.micro_batch=1", "--set", "train.val_every=0",
           "--set", "data.val_rows=1", "--metrics", metrics]
    if model_bytes is not None:
        cmd += ["--stats", stats]
    if P_cp > 1:
        cmd = ["mpirun", "--oversubscribe", "-n", str(P_cp), *cmd]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in open(metrics)]
    timed = rows[a.skip:] or rows
    if waits is not None:  # the exposed communication of the sharded modes, median seconds per step
        waits.append(statistics.median(r.get("shard_comm_wait_s", 0.0) for r in timed))
    if model_bytes is not None:
        with open(stats) as f:
            model_bytes.append(json.load(f)["memory_per_rank"]["total_bytes"])
    return statistics.median(r["tokens_per_s"] for r in timed), max(r["peak_rss_bytes"] for r in rows)


TORCH_STEPS = r"""
import resource, statistics, sys, time, torch
from transformers import Gemma4ForCausalLM
path, threads, S, B, steps, skip = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
torch.set_num_threads(threads)
model = Gemma4ForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
g = torch.Generator().manual_seed(0)
times = []
for _ in range(steps):
    ids = torch.randint(1, model.config.vocab_size, (B, S), generator=g)
    start = time.perf_counter()
    for b in range(B):  # micro-batches of one row, as ringflex runs them
        logits = model(input_ids=ids[b:b + 1], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[b, 1:]) / B
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    times.append(time.perf_counter() - start)
print(B * S / statistics.median(times[skip:] or times), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ringflex")
    ap.add_argument("what", choices=["speed", "memory", "torch", "shard-memory", "shard-speed"])
    ap.add_argument("--model", choices=["tiny_moe_vlm", "100m"], default="tiny_moe_vlm")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2, help="rows per optimizer step")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--skip", type=int, default=2, help="steps left out of the median")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="rf_bench_train_") as work:
        model_args, path = make_model(a.model, work)
        print(f"model {a.model}, S = {a.seq}, {a.batch} rows a step, {a.steps} steps (median over the last "
              f"{max(1, a.steps - a.skip)})\n")
        if a.what == "speed":
            print("| rep | CP = 1, 2 threads tok/s | CP = 2, 1 thread each tok/s | ratio |\n|---|---|---|---|")
            for rep in range(a.reps):
                one, _ = train(a.ringflex, model_args, 1, 2, a, work, f"cp1_{rep}")
                two, _ = train(a.ringflex, model_args, 2, 1, a, work, f"cp2_{rep}")
                print(f"| {rep} | {one:.0f} | {two:.0f} | {two / one:.2f} |")
        elif a.what == "memory":
            print("| CP | peak RSS per rank (MiB, the largest rank) | tok/s |\n|---|---|---|")
            for P in (1, 2, 4, 8):
                tps, rss = train(a.ringflex, model_args, P, 1, a, work, f"mem{P}")
                print(f"| {P} | {rss / MIB:.0f} | {tps:.0f} |")
        elif a.what == "shard-memory":
            modes = ("none", "optimizer", "gradients", "full")
            print("| N | " + " | ".join(f"{m}: peak RSS per rank (MiB) / memory model" for m in modes) +
                  " |\n|---|" + "---|" * len(modes))
            for P in (1, 2, 4, 8):
                predicted = []
                rss = [train(a.ringflex, model_args, P, 1, a, work, f"shard_{m}_{P}", shard=m, model_bytes=predicted)[1]
                       for m in modes]
                print(f"| {P} | " + " | ".join(f"{r / MIB:.0f} / {m / MIB:.0f}" for r, m in zip(rss, predicted)) +
                      " |")
        elif a.what == "shard-speed":
            print("| rep | none tok/s | full tok/s | ratio | full: exposed communication (s per step) |\n"
                  "|---|---|---|---|---|")
            for rep in range(a.reps):
                waits = []
                none, _ = train(a.ringflex, model_args, 2, 1, a, work, f"none_{rep}")
                full, _ = train(a.ringflex, model_args, 2, 1, a, work, f"full_{rep}", shard="full", waits=waits)
                print(f"| {rep} | {none:.0f} | {full:.0f} | {full / none:.2f} | {waits[0]:.3f} |")
        else:
            if path is None:
                # The built-in model as a checkpoint transformers can load: one ringflex step that saves it.
                subprocess.run([a.ringflex, "train", *model_args, "--set", "train.steps=1", "--set", "data.val_rows=1",
                                "--set", f"checkpoint.dir={work}/ck"], check=True, stdout=subprocess.DEVNULL)
                path = os.path.join(work, "ck", "step-00000001")
            ours, ours_rss = train(a.ringflex, model_args, 1, 2, a, work, "ours")
            out = subprocess.run([sys.executable, "-c", TORCH_STEPS, path, "2", str(a.seq), str(a.batch), str(a.steps),
                                  str(a.skip)], check=True, capture_output=True, text=True).stdout.split()
            theirs, theirs_rss = float(out[-2]), int(out[-1])
            print("| | tok/s | peak RSS (MiB) |\n|---|---|---|")
            print(f"| ringflex train, CP = 1, 2 threads | {ours:.0f} | {ours_rss / MIB:.0f} |")
            print(f"| PyTorch (transformers, SDPA), 2 threads | {theirs:.0f} | {theirs_rss / MIB:.0f} |")
            print(f"\nringflex / PyTorch tokens/s: {ours / theirs:.2f}")


if __name__ == "__main__":
    main()
