#!/usr/bin/env python3
"""Gemma 4 vision tower benchmark: images per second through the tower's forward, ringflex vs PyTorch.

For each tower size, both sides run the same transformers-built tower (Gemma4ForConditionalGeneration with a tiny
text decoder beside it, random weights at transformers' init, saved in float32) on the same images, on the same
CPU, in the same invocation, with the same thread count, alternating repeats (after one untimed PyTorch call per
dtype), in float32 and in bfloat16:
  - ringflex: bench/model/bench_vision (load_checkpoint, then model::VisionEncoder::forward on all the images at
    once, each repeat timed alone; loading and the weights' bf16 copies are not timed); bfloat16 is the tower's bf16
    mode (VisionEncoder::set_compute_dtype: bf16 matmul operands, float32 accumulation, as the decoder's). Its soft
    tokens are checked against PyTorch's float32 ones before any time is reported: float32 within 1e-3 relative
    (both float32, rounding ~1e-7 per op amplified by the depth and the sums of 27 layers, far below the 1e-1 of a
    wrong term), bfloat16 within 5e-2 (bf16 operands round by up to 2^-9 each, compounded over 16-27 layers; PyTorch's
    own bfloat16 tower is reported beside it);
  - PyTorch: model.model.vision_tower(pixel_values, pixel_position_ids) under torch.inference_mode, SDPA attention,
    torch.set_num_threads = the same count; float32, and a bfloat16 copy of the tower (weights and inputs cast to
    bfloat16, PyTorch's usual bf16 inference).
Images: each a full grid of patches for --soft-tokens soft tokens (rows x columns of pooling cells, the most square
factorisation; 280 = 14 x 20 cells, 42 x 60 patches of 16 x 16 pixels at pooling 3), random pixels, no padding, as
the image processor lays out an image of that aspect. Reported: medians over the repeats, images/s, and the ratios.

    python3 bench/model/bench_vision.py build/bench/model/bench_vision --threads 2              # e2b and 26b
    python3 bench/model/bench_vision.py build/bench/model/bench_vision --configs e2b --images 4 --reps 5
    python3 bench/model/bench_vision.py build/bench/model/bench_vision --configs tiny   # a check that it runs

Configs: e2b = the E2B/E4B tower (hidden 768, 16 layers, 12 heads of 64, MLP 3072, patch 16, pooling 3);
26b = the 26B/31B tower (hidden 1152, 27 layers, 16 heads of 72, MLP 4304, patch 16, pooling 3; the SigLIP-so400m
shape, assumed from the published sizes); tiny = hidden 32, 1 layer, patch 4, pooling 2, for a quick check.
"""
import argparse
import copy
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import Gemma4Config, Gemma4ForConditionalGeneration

TEXT = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, global_head_dim=8, sliding_window=4, layer_types=["full_attention"],
            hidden_size_per_layer_input=0, vocab_size_per_layer_input=32, pad_token_id=0)
CONFIGS = {
    "e2b": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=12,
                num_key_value_heads=12, head_dim=64, patch_size=16, pooling_kernel_size=3),
    "26b": dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                num_key_value_heads=16, head_dim=72, patch_size=16, pooling_kernel_size=3),
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2, position_embedding_size=64),
}
REL_TOL = 1e-3
BF16_TOL = 5e-2
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def grid(soft_tokens):
    rows = max(r for r in range(1, int(soft_tokens ** 0.5) + 1) if soft_tokens % r == 0)
    return rows, soft_tokens // rows


def make_images(vcfg, n, soft_tokens, gen):
    k, patch = vcfg["pooling_kernel_size"], vcfg["patch_size"]
    rows, cols = grid(soft_tokens)
    h, w = rows * k, cols * k  # in patches
    P = h * w
    pixels = torch.rand((n, P, 3 * patch * patch), generator=gen)
    pos = torch.empty((n, P, 2), dtype=torch.int64)
    pos[:, :, 0] = torch.arange(P) % w
    pos[:, :, 1] = torch.arange(P) // w
    return pixels, pos


def time_torch(tower, pixels, pos, dtype):
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = tower(pixel_values=pixels.to(dtype), pixel_position_ids=pos).last_hidden_state
        return time.perf_counter() - t0, out.float()


def bench(a, config, gen):
    vcfg = CONFIGS[config]
    cfg = Gemma4Config(text_config=TEXT, vision_config=vcfg)
    cfg.vision_config._attn_implementation = "sdpa"
    model = Gemma4ForConditionalGeneration(cfg).float().eval()
    towers = {"float32": model.model.vision_tower}
    towers["bfloat16"] = copy.deepcopy(towers["float32"]).to(torch.bfloat16)
    pixels, pos = make_images(vcfg, a.images, a.soft_tokens, gen)
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), OPENBLAS_NUM_THREADS="1")
    ours = {d: [] for d in DTYPES}
    theirs = {d: [] for d in DTYPES}
    with tempfile.TemporaryDirectory() as work:
        ckpt = os.path.join(work, "ckpt")
        model.save_pretrained(ckpt)
        inputs, out = os.path.join(work, "in.safetensors"), os.path.join(work, "out.safetensors")
        save_file({"pixel_values": pixels.contiguous(), "pixel_position_ids": pos.to(torch.int32).contiguous()},
                  inputs)
        # Warm-up: PyTorch's first call builds its kernels' state; the float32 one is the reference.
        ref = time_torch(towers["float32"], pixels, pos, torch.float32)[1]
        time_torch(towers["bfloat16"], pixels, pos, torch.bfloat16)
        for rep in range(a.reps):
            for d, dt in DTYPES.items():
                proc = subprocess.run([a.bench_vision, ckpt, inputs, out, "1", d], capture_output=True, text=True,
                                      env=env)
                if proc.returncode != 0:
                    sys.exit(f"bench_vision failed: {proc.stderr.strip()}")
                ours[d].append(float(proc.stdout.split()[1]))
                theirs[d].append(time_torch(towers[d], pixels, pos, dt)[0])
                if rep == 0:
                    got = load_file(out)["soft_tokens"]
                    err = float((got - ref).norm() / ref.norm())
                    tol = REL_TOL if d == "float32" else BF16_TOL
                    if not (got.shape == ref.shape and err <= tol):
                        sys.exit(f"ringflex's {d} soft tokens {tuple(got.shape)} differ from PyTorch's float32 "
                                 f"{tuple(ref.shape)}: relative error {err:.2e} > {tol:.0e}")
                    print(f"{config} {d}: soft tokens agree with PyTorch float32: {tuple(got.shape)}, relative "
                          f"error {err:.2e}", flush=True)
    n = a.images
    print(f"config {config}: {n} images of {a.soft_tokens} soft tokens ({pixels.shape[1]} patches), "
          f"{a.threads} threads, {a.reps} repeats (medians)")
    for d in DTYPES:
        r, t = statistics.median(ours[d]), statistics.median(theirs[d])
        print(f"  {d:8s} ringflex {r:8.3f} s {n / r:8.3f} images/s   PyTorch {t:8.3f} s {n / t:8.3f} images/s   "
              f"ringflex / PyTorch = {t / r:.2f}x", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench_vision", help="path to the bench_vision binary (build/bench/model/bench_vision)")
    ap.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=["e2b", "26b"])
    ap.add_argument("--images", type=int, default=1)
    ap.add_argument("--soft-tokens", type=int, default=280)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    a = ap.parse_args()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(a.threads)
    for config in a.configs:
        bench(a, config, torch.Generator().manual_seed(0))


if __name__ == "__main__":
    main()
