#!/usr/bin/env python3
"""Gemma 4 model benchmark: forward + backward tokens/s, model FLOP utilisation and peak memory, ringflex vs PyTorch.

Both sides run the same transformers-built checkpoint (random weights, float32) on the same batch (B = 1, one
document, every position labelled), on the same CPU, in the same invocation, alternating repeats:
  - ringflex: `ringflex forward --model DIR --in BATCH --out OUT --grad --no-logits [--no-recompute]`; the step time
    is the forward+backward time the command prints (checkpoint loading and writing the gradients excluded); peak
    memory is the process's maximum resident set (/usr/bin/time -v), which includes weights and gradients; the
    command also prints the activation memory it kept and the largest one-layer recompute set.
  - PyTorch eager: Gemma4ForCausalLM from the same directory, attn_implementation "eager" and "sdpa", forward,
    cross-entropy over the [S, V] logits, backward; torch.set_num_threads = the same thread count; peak memory is
    ru_maxrss of that process.
  - 1-thread sgemm: OpenBLAS's cblas_sgemm (the library ringflex is linked against, found with ldd), N = 1024,
    measured right before and right after each repeat's ringflex runs (median of 5 calls each; the figure used is
    the median of all those readings), so the FLOP utilisation compares numbers of the same minutes.
Model FLOP utilisation (MFU) = (6 N T + attention FLOPs) / step time / (threads x 1-thread sgemm), with N the
parameter count (the tied head counted once: it is one matmul each way), T = S tokens, and attention as
docs/spec.md section 9 counts it: forward 4 Hq D A per layer (A = allowed (q, k) pairs of the layer's mask),
backward 2.5 x forward. The recomputed layer forward (the default) is work the figure does not credit.
Reported: medians over the repeats; tokens/s and peak memory as ratios to PyTorch SDPA.

    python3 bench/model/bench_model.py build/src/cli/ringflex --config tiny --seq 512 --reps 3
    python3 bench/model/bench_model.py build/src/cli/ringflex --config 100m --seq 4096 --reps 3
    python3 bench/model/bench_model.py build/src/cli/ringflex --config 100m --seq 4096 --reps 3 --keep-mlp
    python3 bench/model/bench_model.py build/src/cli/ringflex --config 100m-moe --seq 4096 --reps 3
    python3 bench/model/bench_model.py build/src/cli/ringflex --config 100m --seq 4096 --reps 3 --compute-dtype both

--compute-dtype bf16 runs ringflex's matmuls in bfloat16 (`ringflex forward --compute-dtype bf16`: operands rounded
to bf16, float32 accumulation); `both` runs ringflex in float32 and bf16 alternately in the same repeats, so the
bf16 / float32 step ratio comes from one run. MFU stays relative to the float32 sgemm (the FLOP count is the same).
"""
import argparse
import ctypes
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
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

LOSS_CHUNK_BUDGET = 64 << 20  # kLossChunkBytes in src/model/gemma4.h: the budget of the loss's one [chunk, V] buffer
LOSS_CHUNK_MIN_TOKENS = 256  # kMinLossChunkTokens in src/model/loss.h: the chunk's floor

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


def loss_chunk_bytes(V, T):
    """The loss's [chunk, V] float32 buffer (src/model/loss.h loss_chunk_tokens), chunk <= T."""
    chunk = max(LOSS_CHUNK_MIN_TOKENS, LOSS_CHUNK_BUDGET // (4 * V))
    return min(chunk, T) * V * 4


SGEMM_N = 1024  # square sgemm: large enough for OpenBLAS's peak, small enough to repeat (bench/kernels does the same)
BACKWARD_FLOP_FACTOR = 2.5  # docs/spec.md section 9


class Sgemm:
    """1-thread cblas_sgemm of the OpenBLAS the ringflex binary is linked against."""

    def __init__(self, ringflex):
        ldd = subprocess.run(["ldd", ringflex], capture_output=True, text=True, check=True).stdout
        path = next(line.split("=>")[1].split("(")[0].strip() for line in ldd.splitlines()
                    if re.search(r"lib(open)?blas", line))
        # The core ringflex runs (src/cpu/blas_core.h restarts it off an OpenBLAS fallback such as Prescott), set
        # before this process loads the library: OpenBLAS reads OPENBLAS_CORETYPE only while loading.
        info = subprocess.run([ringflex, "info"], capture_output=True, text=True, check=True).stdout
        core = re.search(r"model float32 matmuls: OpenBLAS (\w+)", info)
        if core and "OPENBLAS_CORETYPE" not in os.environ:
            os.environ["OPENBLAS_CORETYPE"] = core.group(1)
        self.core = core.group(1) if core else "unknown"
        self.lib = ctypes.CDLL(path)
        if hasattr(self.lib, "openblas_set_num_threads"):
            self.lib.openblas_set_num_threads(1)
        n = SGEMM_N
        self.a = np.full((n, n), 0.5, dtype=np.float32)
        self.b = np.full((n, n), 0.25, dtype=np.float32)
        self.c = np.zeros((n, n), dtype=np.float32)
        self.lib.cblas_sgemm.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int,
                                                              ctypes.c_void_p, ctypes.c_int, ctypes.c_float,
                                                              ctypes.c_void_p, ctypes.c_int]
        self.run()  # warm-up: pages and OpenBLAS buffers

    def run(self):
        row_major, no_trans, n = 101, 111, SGEMM_N
        self.lib.cblas_sgemm(row_major, no_trans, no_trans, n, n, n, 1.0, self.a.ctypes.data, n, self.b.ctypes.data,
                             n, 0.0, self.c.ctypes.data, n)

    def gflops(self, repeats=5):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            self.run()
            times.append(time.perf_counter() - start)
        return 2.0 * SGEMM_N ** 3 / statistics.median(times) / 1e9


def allowed_pairs(S, window):
    """(q, k) pairs of one causal row of S tokens, one document: a query sees itself and min(window, q + 1) - 1
    earlier tokens (window 0: all of them)."""
    if window == 0 or window >= S:
        return S * (S + 1) // 2
    return window * (window + 1) // 2 + (S - window) * window


def active_parameters(model, cfg):
    """Parameters one token's matmuls use: every dense parameter, and of the MoE experts' weights only the top-k
    share each token is routed to (counting all experts would credit MoE steps with FLOPs they never do)."""
    share = cfg.top_k_experts / cfg.num_experts if getattr(cfg, "enable_moe_block", False) else 1.0
    return sum(p.numel() * (share if ".experts." in name else 1.0) for name, p in model.named_parameters())


def model_flops(spec, n_params, S):
    """6 N T + attention (forward + backward) of one row of S tokens, N the active parameters; spec: a CONFIGS
    entry with COMMON."""
    flops = 6.0 * n_params * S
    for layer_type in spec["layer_types"]:
        sliding = layer_type == "sliding_attention"
        D = spec["head_dim"] if sliding else spec["global_head_dim"]
        pairs = allowed_pairs(S, spec["sliding_window"] if sliding else 0)
        flops += (1.0 + BACKWARD_FLOP_FACTOR) * 4.0 * spec["num_attention_heads"] * D * pairs
    return flops


def run_ringflex(ringflex, ckpt, batch, out, threads, recompute, keep_mlp, compute_dtype):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    cmd = ["/usr/bin/time", "-v", ringflex, "forward", "--model", ckpt, "--in", batch, "--out", out, "--grad",
           "--no-logits", "--compute-dtype", compute_dtype] + ([] if recompute else ["--no-recompute"]) + \
        (["--keep-mlp"] if keep_mlp else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    step = float(re.search(r"forward\+backward ([0-9.]+) s", proc.stdout).group(1))
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
    kept = re.search(r"kept ([0-9.]+) MiB of activations for the backward, one layer's recomputed ([0-9.]+) MiB",
                     proc.stdout)
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
    ap.add_argument("--no-recompute", dest="recompute", action="store_false",
                    help="ringflex keeps every layer's activations instead of recomputing them in the backward")
    ap.add_argument("--keep-mlp", action="store_true",
                    help="ringflex keeps each MLP's projections, so its recompute skips the MLP sgemms")
    ap.add_argument("--compute-dtype", choices=["float32", "bf16", "both"], default="float32",
                    help="what ringflex's matmuls multiply in; both: float32 and bf16 alternately in the same run")
    ap.add_argument("--skip-eager", action="store_true", help="run PyTorch with SDPA only (eager is slow at long S)")
    a = ap.parse_args()
    cfg = Gemma4TextConfig(**CONFIGS[a.config], **COMMON)
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(cfg).float()
    n_params = sum(p.numel() for p in model.parameters())
    n_active = active_parameters(model, cfg)
    sgemm = Sgemm(a.ringflex)
    S = a.seq
    flops = model_flops({**CONFIGS[a.config], **COMMON}, n_active, S)
    impls = ["torch sdpa"] if a.skip_eager else ["torch eager", "torch sdpa"]
    with tempfile.TemporaryDirectory() as d:
        ckpt = os.path.join(d, "ckpt")
        model.save_pretrained(ckpt, safe_serialization=True)
        del model
        g = torch.Generator().manual_seed(0)
        batch = os.path.join(d, "batch.safetensors")
        save_file({"input_ids": torch.randint(1, cfg.vocab_size, (1, S), generator=g),
                   "labels": torch.randint(0, cfg.vocab_size, (1, S), generator=g)}, batch)
        dtypes = ["float32", "bf16"] if a.compute_dtype == "both" else [a.compute_dtype]
        ours = {dt: f"ringflex {dt}" for dt in dtypes}
        results = {**{ours[dt]: [] for dt in dtypes}, **{name: [] for name in impls}}
        peaks = []
        for _ in range(a.reps):
            peaks.append(sgemm.gflops())
            for dt in dtypes:
                results[ours[dt]].append(run_ringflex(a.ringflex, ckpt, batch, os.path.join(d, "out.safetensors"),
                                                      a.threads, a.recompute, a.keep_mlp, dt))
            # Once more right after: on a shared VM the sgemm rate moves by 2x from minute to minute, and the median
            # over readings on both sides of each run is steadier than one reading before it.
            peaks.append(sgemm.gflops())
            for name in impls:
                results[name].append(run_torch(ckpt, name.split()[1], a.threads, S))
    peak = statistics.median(peaks)
    mode = ("keeps every activation" if not a.recompute else
            "recomputes layers but the MLP projections" if a.keep_mlp else "recomputes layers")
    print(f"config {a.config}: {n_params / 1e6:.1f}M parameters ({n_active / 1e6:.1f}M active per token), S = {S}, B = 1, threads = {a.threads}, "
          f"reps = {a.reps}, ringflex {mode}")
    print(f"CPU: {cpu_name()}; 1-thread sgemm (OpenBLAS {sgemm.core}, N = {SGEMM_N}) median {peak:.1f} GFLOP/s "
          f"(runs: {', '.join(f'{p:.1f}' for p in peaks)}); model FLOPs per step {flops / 1e12:.3f} T "
          f"(6 N T + attention)")
    print("| implementation | fwd+bwd step (median s) | tokens/s | MFU | peak RSS (GiB) | tokens/s vs torch sdpa | "
          "peak RSS vs torch sdpa |")
    print("|---|---|---|---|---|---|---|")
    sdpa_step = statistics.median(r[0] for r in results["torch sdpa"])
    sdpa_rss = statistics.median(r[1] for r in results["torch sdpa"])
    for name, runs in results.items():
        step = statistics.median(r[0] for r in runs)
        rss = statistics.median(r[1] for r in runs)
        mfu = flops / step / (a.threads * peak * 1e9)
        print(f"| {name} | {step:.3f} | {S / step:.0f} | {mfu:.2f} | {rss / 2**20:.2f} | {sdpa_step / step:.2f}x | "
              f"{rss / sdpa_rss:.2f} |")
    if len(dtypes) == 2:
        ratio = statistics.median(r[0] for r in results[ours["bf16"]]) / \
            statistics.median(r[0] for r in results[ours["float32"]])
        print(f"ringflex bf16 / float32 step time: {ratio:.2f}")
    kept, layer = results[ours[dtypes[0]]][0][2]
    print(f"ringflex training memory: activations kept for the backward {kept:.1f} MiB, one layer's recomputed "
          f"activations {layer:.1f} MiB, loss chunk at most {loss_chunk_bytes(cfg.vocab_size, S) / 2**20:.0f} MiB")


def cpu_name():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
