#!/usr/bin/env python3
"""The training step in one command (issue 27): the machine's 1-thread sgemm rate, the `ringflex forward --grad`
step's model FLOP/s and MFU over threads x that rate, and `ringflex train`'s tokens/s on the same rows against
forward --grad's, so the loop's own cost (data, gradient zeroing, norm and clipping, AdamW, metrics) reads as one
ratio. Prints markdown for BENCHMARKS.md.

One checkpoint (bench/model's 100m or 100m-moe config, random weights, float32) and --rows documents of exactly
--seq random tokens, written as data.source = jsonl_tokens, so every train row is one whole document of S tokens:
  - sgemm: bench_model.py's 1-thread cblas_sgemm of the OpenBLAS ringflex links (N = 1024), read before and after
    each repeat's ringflex runs; the figure is the median of all readings (the MFU's denominator is the same
    minutes' machine).
  - forward --grad: `ringflex forward --model M --in B --out O --grad --no-logits` on the first document (labels
    the next token, the last one ignored, as train packs it); its printed forward+backward time (loading and
    writing excluded). MFU = bench_model.py's model FLOPs (6 N T + attention, N the active parameters) / step time /
    (threads x sgemm).
  - train: `ringflex train` on those rows, one row a step (global_batch = micro_batch = 1), --steps steps, the same
    threads; tokens/s is the metrics' figure (the row's tokens over the whole step's time, optimizer included), the
    median over the steps after the first --skip (page faults, warm-up). It runs first in each repeat: what its
    backward recomputes is train's own choice (train.recompute and keep_* at auto: the most kept that this machine's
    memory fits, docs/training.md), read from its --stats, and forward --grad runs with the same (--no-recompute,
    --keep-mlp); --no-recompute / --keep-mlp / --recompute set it for both instead.
  - ratio: train tokens/s / (S / forward --grad step). Target (issue 27): >= 0.95.
Medians over --reps alternating repeats. Run alone on an idle machine:

    python3 bench/trainer/bench_step.py build/src/cli/ringflex --config 100m --seq 4096 --reps 3
    python3 bench/trainer/bench_step.py build/src/cli/ringflex --config 100m-moe --seq 4096 --reps 3

Targets (issue 27): MFU >= 0.75 dense, >= 0.7 MoE; train / forward --grad >= 0.95.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "model"))
from bench_model import COMMON, CONFIGS, Sgemm, active_parameters, cpu_name, model_flops, run_ringflex  # noqa: E402

IGNORE = -100  # a label the loss skips (docs/spec.md)


def write_data(workdir, vocab, S, rows):
    """--rows documents of S random tokens as JSONL, and the first one as forward's batch (shifted labels)."""
    import torch
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (rows, S), generator=g)
    data = os.path.join(workdir, "rows.jsonl")
    with open(data, "w") as f:
        for r in range(rows):
            f.write(json.dumps({"input_ids": ids[r].tolist()}) + "\n")
    labels = torch.cat([ids[0, 1:], torch.tensor([IGNORE])]).unsqueeze(0)
    batch = os.path.join(workdir, "batch.safetensors")
    save_file({"input_ids": ids[:1].contiguous(), "labels": labels}, batch)
    return data, batch


def run_train(ringflex, ckpt, data, a, workdir, rep):
    """Median tokens/s of the steps after --skip, and what the backward recomputed (--stats' `recompute`)."""
    metrics = os.path.join(workdir, f"train{rep}.jsonl")
    stats = os.path.join(workdir, f"stats{rep}.json")
    recompute = [] if a.recompute is None else ["--set", f"train.recompute={'true' if a.recompute else 'false'}",
                                                "--set", f"train.keep_mlp={'true' if a.keep_mlp else 'false'}"]
    cmd = [ringflex, "train", "--set", f"model.path={ckpt}", "--set", "data.source=jsonl_tokens", "--set",
           f"data.path={data}", "--set", "data.val_rows=1", "--set", f"train.seq_len={a.seq}", "--set",
           f"train.steps={a.steps}", "--set", "train.global_batch=1", "--set", "train.micro_batch=1", "--set",
           "train.val_every=0", "--set", f"train.threads={a.threads}", *recompute, "--set",
           f"model.compute_dtype={a.compute_dtype}", "--metrics", metrics, "--stats", stats]
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in open(metrics)]
    timed = rows[a.skip:] or rows
    with open(stats) as f:
        chosen = json.load(f)["recompute"]
    return statistics.median(r["tokens_per_s"] for r in timed), chosen


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ringflex")
    ap.add_argument("--config", choices=[c for c in CONFIGS if c != "tiny"], default="100m")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="train steps a repeat")
    ap.add_argument("--skip", type=int, default=1, help="train steps left out of the median")
    ap.add_argument("--recompute", dest="recompute", action="store_true", default=None,
                    help="recompute each layer in the backward (default: train's own choice)")
    ap.add_argument("--no-recompute", dest="recompute", action="store_false")
    ap.add_argument("--keep-mlp", action="store_true", help="with --recompute: keep the MLP projections")
    ap.add_argument("--compute-dtype", choices=["float32", "bfloat16"], default="float32")
    a = ap.parse_args()
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig
    spec = {**CONFIGS[a.config], **COMMON}
    cfg = Gemma4TextConfig(**spec)
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(cfg).float()
    n_active = active_parameters(model, cfg)
    flops = model_flops(spec, n_active, a.seq)
    sgemm = Sgemm(a.ringflex)
    forward_dtype = "bf16" if a.compute_dtype == "bfloat16" else "float32"
    with tempfile.TemporaryDirectory(prefix="rf_bench_step_") as work:
        ckpt = os.path.join(work, "ckpt")
        model.save_pretrained(ckpt, safe_serialization=True)
        del model
        data, batch = write_data(work, cfg.vocab_size, a.seq, a.steps + 1)  # + the validation row
        peaks, steps, trains = [], [], []
        for rep in range(a.reps):
            peaks.append(sgemm.gflops())
            train_tps, chosen = run_train(a.ringflex, ckpt, data, a, work, rep)
            trains.append(train_tps)
            # forward --grad keeps the o_proj and down_proj outputs whenever it recomputes, as train's default did.
            assert not chosen["layers"] or (chosen["keep_o_proj"] and chosen["keep_down_proj"]), \
                f"train chose {chosen}: forward --grad has no switch for recomputing o_proj / down_proj"
            recompute, keep_mlp = chosen["layers"], chosen["keep_mlp"]
            step, _, _ = run_ringflex(a.ringflex, ckpt, batch, os.path.join(work, "out.safetensors"), a.threads,
                                      recompute, keep_mlp, forward_dtype)
            steps.append(step)
            peaks.append(sgemm.gflops())
    peak, step, train = statistics.median(peaks), statistics.median(steps), statistics.median(trains)
    forward_tps = a.seq / step
    mfu = flops / step / (a.threads * peak * 1e9)
    print(f"CPU: {cpu_name()}; config {a.config} ({n_active / 1e6:.1f}M active parameters), S = {a.seq}, "
          f"{a.threads} threads, {a.compute_dtype}, recompute {recompute}, keep-mlp {keep_mlp}"
          f"{' (train chose: auto)' if chosen.get('auto') else ''}, reps {a.reps}")
    print(f"1-thread sgemm (OpenBLAS {sgemm.core}): median {peak:.1f} GFLOP/s (readings: "
          f"{', '.join(f'{p:.1f}' for p in peaks)}); model FLOPs a step {flops / 1e12:.3f} T (6 N T + attention)\n")
    print("| forward --grad step (s) | model GFLOP/s | MFU | forward --grad tokens/s | train tokens/s | "
          "train / forward --grad |")
    print("|---|---|---|---|---|---|")
    print(f"| {step:.3f} | {flops / step / 1e9:.1f} | {mfu:.2f} | {forward_tps:.0f} | {train:.0f} | "
          f"{train / forward_tps:.3f} |")
    print(f"\nforward --grad steps: {', '.join(f'{s:.3f}' for s in steps)}; train tokens/s: "
          f"{', '.join(f'{t:.0f}' for t in trains)}")
    mfu_target = 0.7 if "moe" in a.config else 0.75
    print(f"targets (issue 27): MFU >= {mfu_target} ({'met' if mfu >= mfu_target else 'not met'}); train / forward "
          f"--grad >= 0.95 ({'met' if train / forward_tps >= 0.95 else 'not met'})")


if __name__ == "__main__":
    main()
