#!/usr/bin/env python3
"""Prefill and decode tokens/s of `ringflex generate` against transformers' generate on the same checkpoint and
threads (greedy), with the machine's memory bandwidth measured in the same run and the decode bound it sets: bytes
read per new token (every matrix the step multiplies once, in ringflex's float32, plus the KV cache it reads) over
that bandwidth.

    python3 bench/model/bench_generate.py build/src/cli/ringflex --config 100m --prompt 512 --new 64 --threads 2
    python3 bench/model/bench_generate.py build/src/cli/ringflex --checkpoint DIR --prompt 512 --new 32 --reps 1
    python3 bench/model/bench_generate.py build/src/cli/ringflex --config 100m --long --prompt 4096 --new 16 --reps 1

Without --checkpoint the model is bench_model.py's Gemma 4-shaped config of random weights (float32), written to a
temporary checkpoint; --checkpoint DIR runs an existing one (the E2B shape: a random bf16 E2B checkpoint). ringflex
runs first, each run its own process; transformers loads the checkpoint afterwards in --hf-dtype (float32: the same
numbers as ringflex's float32 compute), so the two never hold the weights at once (E2B in float32 is ~19 GB each
side; --skip-hf leaves transformers out).

transformers' prefill is timed as its generate with max_new_tokens=1, its decode as the rest of a
max_new_tokens=NEW generate; ringflex's from its --out record (prefill: the prompt to the first token; decode: the
later steps, each its run and its token's choice). Each figure the median of --reps runs.

Bandwidth, measured around the ringflex runs (before and after, the median of both): `read`, torch summing 1 GiB of
float32 on --threads threads (what a decode step does to the weights: reads them, nothing written), and `copy`,
numpy copying 256 MiB on one thread, counted read + write (the figure of the earlier BENCHMARKS.md sections). The
bound is bytes per token over the read bandwidth, the larger of the two; the fraction over copy is printed beside.

With --batch B > 1, ringflex also decodes B prompts of that length together (one --in of B rows): its per-sequence
decode tok/s, their sum, and the bound of a batched step (the weights read once for B tokens, every sequence's cache
once).

--rf-env NAME=VALUE (repeatable) sets a variable for ringflex's runs only, e.g. GOMP_SPINCOUNT=300000 to run its
decode with libgomp's default idle-thread spin instead of the brief one `ringflex generate` sets (docs/generate.md).

--long: the long-prompt mode, ringflex alone at P = 1, 2, 4 (`mpirun --oversubscribe -n P`, --threads / P threads a
rank, at least 1): the longest prompt each P fits by `ringflex generate`'s memory check (generate_longest_prompt,
built beside ringflex, at this machine's available memory or --budget-gib per rank), then one prompt of --prompt
tokens: prefill time, decode tok/s and rank 0's KV cache bytes.
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
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from bench_model import COMMON, CONFIGS  # noqa: E402

MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
GIB = 1 << 30


def copy_bandwidth():
    """Bytes/s of a 256 MiB numpy copy on one thread (read + write counted), the median of 5."""
    a = np.ones(64 << 20, dtype=np.float32)
    b = np.empty_like(a)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(b, a)
        times.append(time.perf_counter() - t)
    return 2 * a.nbytes / statistics.median(times)


def read_bandwidth(threads):
    """Bytes/s of torch summing 1 GiB of float32 on `threads` threads (reads only), the median of 5."""
    torch.set_num_threads(threads)
    a = torch.ones(256 << 20, dtype=torch.float32)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        a.sum()
        times.append(time.perf_counter() - t)
    return a.numel() * 4 / statistics.median(times)


def text_config(ckpt):
    with open(os.path.join(ckpt, "config.json")) as f:
        c = json.load(f)
    return c.get("text_config", c)


def shapes(ckpt):
    """{name: shape} of every tensor in the checkpoint's safetensors files (headers only)."""
    files = [f for f in os.listdir(ckpt) if f.endswith(".safetensors")]
    out = {}
    for name in files:
        with safe_open(os.path.join(ckpt, name), framework="np") as f:
            for k in f.keys():
                out[k] = f.get_slice(k).get_shape()
    return out


def step_weight_bytes(ckpt):
    """Bytes of the matrices one decode step multiplies, in ringflex's float32: every decoder matrix once (not the
    token tables, read a row a token; not the vision or audio towers; not the k/v projections of KV-shared layers,
    which read an earlier layer's cache), plus the LM head (the tied embedding, read whole once a step)."""
    cfg = text_config(ckpt)
    layers = cfg["num_hidden_layers"]
    shared_from = layers - (cfg.get("num_kv_shared_layers") or 0)
    total = 0
    head = None
    for name, shape in shapes(ckpt).items():
        if len(shape) < 2 or "vision" in name or "audio" in name:
            continue
        if name.endswith("embed_tokens.weight"):
            head = shape
            continue
        if "embed_tokens" in name:  # per-layer embedding tables: a row a token
            continue
        if "lm_head" in name:
            head = shape
            continue
        parts = name.split(".")
        if "layers" in parts and (".k_proj." in name or ".v_proj." in name):
            if int(parts[parts.index("layers") + 1]) >= shared_from:
                continue
        total += int(np.prod(shape)) * 4
    return total + int(np.prod(head)) * 4


def random_checkpoint(config, work):
    """bench_model.py's config of random weights (float32), saved as transformers saves it."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig
    cfg = Gemma4TextConfig(**CONFIGS[config], **COMMON)
    model = Gemma4ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.02)
    model.generation_config.eos_token_id = None
    ckpt = os.path.join(work, "ckpt")
    model.save_pretrained(ckpt, safe_serialization=True)
    with open(os.path.join(ckpt, "generation_config.json"), "w") as f:
        json.dump({"do_sample": False}, f)
    return ckpt


def ringflex_generate(a, ckpt, prompt, out, ranks=1, threads=None):
    cmd = [a.ringflex, "generate", "--model", ckpt, "--in", prompt, "--max-new-tokens", str(a.new), "--greedy",
           "--out", out, "--threads", str(threads or a.threads)]
    env = dict(os.environ, **dict(kv.split("=", 1) for kv in a.rf_env))
    if ranks > 1:
        cmd = ["mpirun", "--oversubscribe", "-n", str(ranks)] + [x for kv in a.rf_env for x in ("-x", kv)] + cmd
        env.update(MPI_ENV)
    subprocess.run(cmd, check=True, capture_output=True, env=env)
    with open(out) as f:
        return [json.loads(line) for line in f]


def loadavg():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def long_mode(a, ckpt, vocab, work):
    tool = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(a.ringflex))), "..", "bench", "model",
                        "generate_longest_prompt")
    tool = os.path.normpath(tool)
    ids = torch.randint(1, vocab, (1, a.prompt))
    prompt = os.path.join(work, "long.safetensors")
    save_file({"input_ids": ids.to(torch.int32)}, prompt)
    print(f"long prompt: {a.prompt} tokens, {a.new} new, {a.threads} threads in all; loadavg {loadavg()}")
    print(f"| P | longest prompt (memory check, budget a rank) | prefill of {a.prompt} (s) | prefill tok/s "
          f"| decode tok/s | rank 0's KV cache |")
    print("|---|---|---|---|---|---|")
    for P in (1, 2, 4):
        cmd = [tool, "--model", ckpt, "--ranks", str(P), "--max-new-tokens", str(a.new)]
        if a.budget_gib:
            cmd += ["--budget-gib", str(a.budget_gib)]
        fit = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        runs = [ringflex_generate(a, ckpt, prompt, os.path.join(work, "long.jsonl"), ranks=P,
                                  threads=max(1, a.threads // P))[0] for _ in range(a.reps)]
        prefill = statistics.median(r["prefill_tokens_per_s"] for r in runs)
        decode = statistics.median(r["decode_tokens_per_s"] for r in runs)
        print(f"| {P} | {fit['longest_prompt']:,} ({fit['budget_bytes'] / GIB:.1f} GiB) | {a.prompt / prefill:.2f} "
              f"| {prefill:.0f} | {decode:.1f} | {runs[0]['cache_bytes'] / 2**20:.1f} MiB |")
    print(f"loadavg after {loadavg()}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ringflex")
    ap.add_argument("--config", default="100m", choices=list(CONFIGS))
    ap.add_argument("--checkpoint", help="an existing checkpoint instead of --config's random one")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--hf-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--skip-hf", action="store_true", help="ringflex alone (no transformers run)")
    ap.add_argument("--rf-env", action="append", default=[], metavar="NAME=VALUE",
                    help="a variable for ringflex's runs only (repeatable)")
    ap.add_argument("--long", action="store_true", help="the long-prompt mode at P = 1, 2, 4 (ringflex alone)")
    ap.add_argument("--budget-gib", type=float, default=0.0, help="--long: memory a rank (default: this machine's)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as work:
        ckpt = a.checkpoint or random_checkpoint(a.config, work)
        vocab = text_config(ckpt)["vocab_size"]
        weights = step_weight_bytes(ckpt)
        if a.long:
            long_mode(a, ckpt, vocab, work)
            return
        load_before = loadavg()
        bandwidths = [(read_bandwidth(a.threads), copy_bandwidth())]
        ids = torch.randint(1, vocab, (1, a.prompt))
        prompt = os.path.join(work, "prompt.safetensors")
        save_file({"input_ids": ids.to(torch.int32)}, prompt)
        rf_prefill, rf_decode, rf_cache = [], [], 0
        for _ in range(a.reps):
            r = ringflex_generate(a, ckpt, prompt, os.path.join(work, "out.jsonl"))[0]
            rf_prefill.append(r["prefill_tokens_per_s"])
            rf_decode.append(r["decode_tokens_per_s"])
            rf_cache = r["cache_bytes"]
        rf_batch = []
        if a.batch > 1:
            rows = os.path.join(work, "rows.safetensors")
            save_file({"input_ids": torch.randint(1, vocab, (a.batch, a.prompt)).to(torch.int32)}, rows)
            for _ in range(a.reps):
                recs = ringflex_generate(a, ckpt, rows, os.path.join(work, "batch.jsonl"))
                rf_batch.append(statistics.median(r["decode_tokens_per_s"] for r in recs))
        bandwidths.append((read_bandwidth(a.threads), copy_bandwidth()))
        load_after = loadavg()
        hf_prefill, hf_decode = [], []
        if not a.skip_hf:
            from transformers import AutoModelForCausalLM
            torch.set_num_threads(a.threads)
            dtype = torch.float32 if a.hf_dtype == "float32" else torch.bfloat16
            model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).eval()
            model.generation_config.eos_token_id = None
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
            del model
    med = statistics.median
    read_bw = med(b[0] for b in bandwidths)
    copy_bw = med(b[1] for b in bandwidths)
    per_token = weights + rf_cache
    bound = max(read_bw, copy_bw) / per_token
    name = a.checkpoint or a.config
    print(f"{name}, prompt {a.prompt}, {a.new} new tokens, {a.threads} threads, greedy, median of {a.reps}"
          f"{'; ringflex with ' + ' '.join(a.rf_env) if a.rf_env else ''}; "
          f"loadavg {load_before} before, {load_after} after")
    print("| | prefill tok/s | decode tok/s |")
    print("|---|---|---|")
    if hf_decode:
        print(f"| transformers generate ({a.hf_dtype}) | {med(hf_prefill):.0f} | {med(hf_decode):.1f} |")
    print(f"| ringflex generate (float32) | {med(rf_prefill):.0f} | {med(rf_decode):.1f} |")
    if hf_decode:
        print(f"| ratio | {med(rf_prefill) / med(hf_prefill):.2f}x | {med(rf_decode) / med(hf_decode):.2f}x |")
    print(f"memory bandwidth: read {read_bw / 1e9:.1f} GB/s ({a.threads} threads), copy {copy_bw / 1e9:.1f} GB/s "
          f"(1 thread, read + write; each the median of before and after: "
          f"{', '.join(f'{r / 1e9:.1f}/{c / 1e9:.1f}' for r, c in bandwidths)}); bytes a new token reads "
          f"{per_token / 2**20:.1f} MiB (weights {weights / 2**20:.1f}, cache {rf_cache / 2**20:.1f}): bound "
          f"{bound:.1f} tok/s; ringflex at {med(rf_decode) / bound:.2f} of it "
          f"({med(rf_decode) * per_token / copy_bw:.2f} of the copy bandwidth's bound)")
    if rf_batch:
        batch_bound = a.batch * max(read_bw, copy_bw) / (weights + a.batch * rf_cache)
        print(f"batch of {a.batch}: {med(rf_batch):.1f} decode tok/s a sequence, {a.batch * med(rf_batch):.1f} in all "
              f"({a.batch * med(rf_batch) / med(rf_decode):.2f}x one sequence's); a batched step's bound "
              f"{batch_bound:.1f} tok/s, ringflex at {a.batch * med(rf_batch) / batch_bound:.2f} of it")


if __name__ == "__main__":
    main()
