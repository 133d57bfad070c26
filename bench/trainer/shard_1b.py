#!/usr/bin/env python3
"""The ~1 B-parameter benchmark of issue 22: what parallelism.shard = full makes possible on one 24 GiB machine.

bench/trainer/configs/gemma4_1b.json is Gemma 4-shaped (sliding and full attention layers 4:1, one KV head, head
dims 256 / 512, K = V on the full layers, the final softcap, tied embeddings) with 0.91 B parameters: 14.6 GB of
float32 weights, gradients and AdamW moments replicated, 58 GB for four replicas. Its vocabulary is 32768 tokens,
not Gemma 4's 262144: the table is the head too, and at 262144 x 1152 it alone would be 302 M parameters, which
the rank holding the head gathers whole around the loss. The model is written once as a Hugging Face checkpoint
with random weights (transformers' initialisation, saved in bfloat16: 1.8 GB; ringflex widens it as it loads).

Three parts, each a `mpirun --oversubscribe -n N ringflex train` on the mock data, one thread a rank:

  refuse   N = 4, shard none: the up-front memory check refuses the run before it allocates the weights. Passes
           when the run exits non-zero, every rank printed the check's one line ("needs at least ... of memory per
           rank"), and every rank's peak RSS (/usr/bin/time) stayed far below the weights it would have held.
  train    N = 4 (cp 4), shard full, --steps steps of one row of --seq tokens: tokens/s (the metrics' median over
           the steps after --skip), every rank's peak RSS and the memory check's figure per rank (--stats).
  compare  shard full against none at N = 2 (cp 2), --reps alternating repeats, with full's exposed communication
           (the metrics' shard_comm_wait_s, median per step). The 1 B model does not fit N = 2 under shard none
           (14 GiB a rank), so this part runs --compare-model (bench_train.py's 100m config by default; target full
           >= 0.9 x none).

Before a real run, the memory model's per-rank figure (what `train` must fit with margin; the check divides the
machine's available memory by the ranks on it) is

    build/bench/trainer/memory_table bench/trainer/configs/gemma4_1b.json --ranks 2,4 --tokens 1024,2048 --breakdown 4,1024

The lead's command (an idle machine; writes ~2 GB under --workdir):

    python3 bench/trainer/shard_1b.py build/src/cli/ringflex --seq 1024 --steps 4 --skip 1

A quick check of the script's plumbing on a tiny config (nothing here is timed; the refusal needs the real size):

    python3 bench/trainer/shard_1b.py build/src/cli/ringflex --config TINY.json --parts train,compare \\
        --compare-model tiny_moe_vlm --seq 256 --steps 2 --skip 1 --reps 1
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_train  # noqa: E402  (the compare part reuses its runs)

GIB = 2**30
MIB = 2**20
HERE = os.path.dirname(os.path.abspath(__file__))
# A rank refused before allocating holds its libraries, MPI and the parameter registry: far below this share of the
# float32 weights it would have loaded.
REFUSED_RSS_SHARE = 0.25


def mpi_env(threads=1):
    return dict(os.environ, OMP_NUM_THREADS=str(threads), OMPI_ALLOW_RUN_AS_ROOT="1",
                OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


def write_checkpoint(config_path, out):
    """The config as a Hugging Face checkpoint with transformers' random initial weights, saved in bfloat16."""
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig
    spec = json.load(open(config_path))
    spec.pop("model_type", None)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # initialised in bfloat16: half the memory of a float32 model
    model = Gemma4ForCausalLM(Gemma4TextConfig(**spec))
    model.save_pretrained(out, safe_serialization=True)
    return out


def ringflex_train(a, model_dir, ranks, shard, metrics=None, stats=None, timed=False, seq=None):
    cmd = [a.ringflex, "train", "--set", f"model.path={model_dir}", "--set", f"parallelism.cp={ranks}",
           "--set", "parallelism.dp=1", "--set", f"parallelism.shard={shard}", "--set", "train.threads=1",
           "--set", f"train.seq_len={seq or a.seq}", "--set", f"train.steps={a.steps}", "--set",
           "train.global_batch=1", "--set", "train.micro_batch=1", "--set", "train.val_every=0", "--set",
           "data.val_rows=1"]
    if metrics:
        cmd += ["--metrics", metrics]
    if stats:
        cmd += ["--stats", stats]
    if timed:
        # Every rank's peak RSS (/usr/bin/time) and exit code, printed as it exits; the wrapper itself exits 0 so that
        # mpirun lets every rank finish instead of killing the others at the first failure.
        cmd = ["bash", "-c", '/usr/bin/time -f "peak RSS %M KiB" "$@"; echo "ringflex exit code $?"', "rank", *cmd]
    return subprocess.run(["mpirun", "--oversubscribe", "-n", str(ranks), *cmd], env=mpi_env(), capture_output=True,
                          text=True)


def weight_bytes(config_path):
    """float32 bytes of the parameters: what a shard none rank would load first."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig
    import torch
    spec = json.load(open(config_path))
    spec.pop("model_type", None)
    with torch.device("meta"):
        model = Gemma4ForCausalLM(Gemma4TextConfig(**spec))
    return 4 * sum(p.numel() for p in model.parameters())


def refuse(a, model_dir):
    print("## shard none at N = 4: refused by the memory check before allocating\n")
    run = ringflex_train(a, model_dir, 4, "none", timed=True)
    out = run.stdout + run.stderr
    refusals = [line for line in out.splitlines() if "needs at least" in line]
    peaks = [int(k) * 1024 for k in re.findall(r"peak RSS (\d+) KiB", out)]
    codes = [int(c) for c in re.findall(r"ringflex exit code (\d+)", out)]
    weights = weight_bytes(a.config)
    for line in refusals:
        print("    " + line.strip())
    print(f"\nexit codes {codes}; {len(refusals)} of 4 ranks printed the check's line; peak RSS per rank (MiB): "
          f"{', '.join(f'{p / MIB:.0f}' for p in peaks)} (the float32 weights alone: {weights / MIB:.0f})")
    ok = (len(codes) == 4 and all(c != 0 for c in codes) and len(refusals) == 4 and len(peaks) == 4 and
          max(peaks) < REFUSED_RSS_SHARE * weights)
    print("refused before allocating: " + ("yes" if ok else "NO") + "\n")
    if not ok:
        sys.stderr.write(out)
    return ok


def train_full(a, model_dir, work):
    print(f"## shard full at N = 4 (cp 4), S = {a.seq}, {a.steps} steps (median tokens/s over the last "
          f"{max(1, a.steps - a.skip)})\n")
    metrics, stats = os.path.join(work, "full4.jsonl"), os.path.join(work, "full4_stats.json")
    run = ringflex_train(a, model_dir, 4, "full", metrics=metrics, stats=stats)
    if run.returncode != 0:
        sys.stderr.write(run.stdout + run.stderr)
        return False
    rows = [json.loads(line) for line in open(metrics)]
    timed = rows[a.skip:] or rows
    s = json.load(open(stats))
    need = s["memory_per_rank"]["total_bytes"]
    print("| tokens/s | exposed communication (s per step) | peak RSS per rank (MiB) | memory check per rank (MiB) |\n"
          "|---|---|---|---|")
    print(f"| {statistics.median(r['tokens_per_s'] for r in timed):.0f} | "
          f"{statistics.median(r.get('shard_comm_wait_s', 0.0) for r in timed):.3f} | "
          f"{', '.join(f'{p / MIB:.0f}' for p in s['peak_rss_bytes'])} | {need / MIB:.0f} |")
    print("\nThe check's terms per rank: " +
          "; ".join(f"{t['kind']} {t['bytes'] / MIB:.0f} MiB" for t in s["memory_per_rank"]["terms"]) + "\n")
    return True


def compare(a, work):
    print(f"## shard full against none at N = 2 (cp 2), model {a.compare_model}, S = {a.compare_seq}\n")
    model_args, _ = bench_train.make_model(a.compare_model, work)
    b = argparse.Namespace(seq=a.compare_seq, steps=a.steps, batch=1, skip=a.skip)
    print("| rep | none tok/s | full tok/s | ratio | full: exposed communication (s per step) |\n|---|---|---|---|---|")
    for rep in range(a.reps):
        waits = []
        none, _ = bench_train.train(a.ringflex, model_args, 2, 1, b, work, f"cmp_none_{rep}")
        full, _ = bench_train.train(a.ringflex, model_args, 2, 1, b, work, f"cmp_full_{rep}", shard="full",
                                    waits=waits)
        print(f"| {rep} | {none:.0f} | {full:.0f} | {full / none:.2f} | {waits[0]:.3f} |")
    print()
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ringflex")
    ap.add_argument("--config", default=os.path.join(HERE, "configs", "gemma4_1b.json"))
    ap.add_argument("--checkpoint", help="an existing checkpoint of --config (default: written under --workdir)")
    ap.add_argument("--workdir", help="where the checkpoint and the runs' files go (default: a temporary directory)")
    ap.add_argument("--parts", default="refuse,train,compare")
    ap.add_argument("--seq", type=int, default=1024, help="tokens of the row at N = 4")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--skip", type=int, default=1, help="steps left out of the median")
    ap.add_argument("--reps", type=int, default=3, help="repeats of the compare part")
    ap.add_argument("--compare-model", choices=["tiny_moe_vlm", "100m"], default="100m")
    ap.add_argument("--compare-seq", type=int, default=4096)
    a = ap.parse_args()
    parts = a.parts.split(",")
    with tempfile.TemporaryDirectory(prefix="rf_shard_1b_") as tmp:
        work = a.workdir or tmp
        os.makedirs(work, exist_ok=True)
        ok = True
        if "refuse" in parts or "train" in parts:
            model_dir = a.checkpoint or write_checkpoint(a.config, os.path.join(work, "model"))
            if "refuse" in parts:
                ok = refuse(a, model_dir) and ok
            if "train" in parts:
                ok = train_full(a, model_dir, work) and ok
        if "compare" in parts:
            ok = compare(a, work) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
