#!/usr/bin/env python3
"""Data preparation's share of a training step (issue 36's second benchmark).

A data source does two things: before step 1 it reads, renders (jsonl_chat: the chat template), tokenizes, lays out
the images of and packs its whole file; during training each step fetches its rows and stacks them into
micro-batches. This runs `ringflex train --config CONFIG` for --steps steps and reports the median over the steps
after the first of the metrics' data_share (the most of any rank of the seconds the step spent fetching and stacking
its rows, over the step's wall time) and of the step's wall time (its non-padding tokens over tokens_per_s); then it
times `ringflex data --config CONFIG --show 0`, which builds the same source as training's setup does without the
model's weights (images laid out, not encoded), --repeats times, median: the one-off preparation before step 1.

    python3 bench/trainer/bench_data_share.py build/src/cli/ringflex --config examples/gemma4_tiny_chat.yaml \\
        --mpiexec "mpirun --oversubscribe -n 2" --steps 20

For Gemma 4 E2B give a config with model.path set to the checkpoint and data.source: jsonl_chat (the machine
alone: its steps take minutes on 2 cores); --set passes fields through (repeatable).
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ringflex")
    p.add_argument("--config", required=True)
    p.add_argument("--mpiexec", default="", help="launcher and its options as one string (empty: one rank)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--set", action="append", default=[], dest="sets")
    a = p.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    with tempfile.TemporaryDirectory() as work:
        metrics = os.path.join(work, "m.jsonl")
        cmd = [*shlex.split(a.mpiexec), a.ringflex, "train", "--config", a.config, "--metrics", metrics]
        for s in [f"train.steps={a.steps}", "train.val_every=0", f"checkpoint.dir={work}/ck",
                  f"checkpoint.every={a.steps}", *a.sets]:
            cmd += ["--set", s]
        run = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if run.returncode != 0:
            sys.exit(f"train failed: {run.stderr.strip()}")
        steps = [json.loads(line) for line in open(metrics)][1:]
        share = statistics.median(s["data_share"] for s in steps)
        tokens = [s["tokens_per_s"] for s in steps]
        data_cmd = [a.ringflex, "data", "--config", a.config, "--show", "0"]
        for s in a.sets:
            data_cmd += ["--set", s]
        setup = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            out = subprocess.run(data_cmd, capture_output=True, text=True, env=env)
            setup.append(time.perf_counter() - t0)
            if out.returncode != 0:
                sys.exit(f"data failed: {out.stderr.strip()}")
    totals = [line for line in out.stdout.splitlines() if line.startswith(("conversations", "tokens", "rows"))]
    print(f"config {a.config} ({' '.join(a.sets) or 'as given'}), {a.mpiexec or 'one rank'}, {a.steps} steps")
    print(f"  data_share per step: median {share:.2e} (min {min(s['data_share'] for s in steps):.2e}, "
          f"max {max(s['data_share'] for s in steps):.2e})")
    print(f"  tokens_per_s: median {statistics.median(tokens):.1f}")
    print(f"  preparation before step 1 (`ringflex data`, whole process): median {statistics.median(setup):.3f} s "
          f"of {a.repeats}")
    for line in totals:
        print("  " + line)


if __name__ == "__main__":
    main()
