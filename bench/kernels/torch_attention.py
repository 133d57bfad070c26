#!/usr/bin/env python3
"""PyTorch CPU attention on the shapes and masks of bench_attention, for the comparison table in BENCHMARKS.md.

Reads the case list and per-mask token metadata that `bench_attention --export DIR` wrote (cases.json and
<mask>.meta = int32 [S, 3] {idx, doc, group}, the TokenMeta layout), so both sides use identical masks, and times:
  - torch.compile(flex_attention) with a BlockMask built from the same docs/spec.md §3 predicate (forward only:
    PyTorch has no flex_attention backward on CPU);
  - scaled_dot_product_attention, forward and backward: no mask for "full", is_causal for "causal", else a dense
    boolean [S, S] mask (it has no sparse path). Skipped above --sdpa-max-seq, where the dense mask and the
    O(S^2) work would dominate the run.
Times are medians of --repeats after one warm-up call; torch.set_num_threads(--threads) matches the C++ run.
FLOP counts follow docs/spec.md §9 (forward 4*B*Hq*D*A over the mask area A, backward 2.5x), as in the C++ bench.
"""
import argparse
import json
import os
import statistics
import time

import numpy as np
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

BACKWARD_FLOP_FACTOR = 2.5
FLEX_BLOCK = 128  # flex_attention's default block size on CPU

# The mask inputs live in module-level tensors that are refilled in place per mask, so one compiled flex kernel
# (per S, D, dtype) serves every mask: dynamo sees the same mask_mod code reading the same tensors.
_MASK = {}


def _mask_mod(b, h, q, k):
    doc, grp = _MASK["doc"], _MASK["group"]
    causal, window, groups = _MASK["causal"], _MASK["window"], _MASK["groups"]
    same_doc = (doc[q] > 0) & (doc[q] == doc[k])
    ordered = (k <= q) | ~causal
    dist = torch.where(causal, q - k, (q - k).abs())
    in_window = (window == 0) | (dist < window)
    grouped = groups & (grp[q] >= 0) & (grp[q] == grp[k])
    return same_doc & ((ordered & in_window) | grouped)


def set_mask(case, meta):
    _MASK["doc"] = torch.from_numpy(meta[:, 1].copy())
    _MASK["group"] = torch.from_numpy(meta[:, 2].copy())
    _MASK["causal"] = torch.tensor(bool(case["causal"]))
    _MASK["window"] = torch.tensor(int(case["window"]), dtype=torch.int32)
    _MASK["groups"] = torch.tensor(bool(case["groups"]))


def dense_mask(S):
    q = torch.arange(S).view(S, 1)
    k = torch.arange(S).view(1, S)
    return _mask_mod(None, None, q, k)


def median_time(fn, repeats):
    fn()  # warm-up (and compilation)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", required=True, help="directory written by bench_attention --export")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sdpa-max-seq", type=int, default=4096)
    ap.add_argument("--points", default="", help="mask:D pairs to run, comma separated (default: all)")
    ap.add_argument("--dtypes", default="F32,BF16")
    ap.add_argument("--out", required=True, help="JSON file for the measurements")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with open(os.path.join(args.cases, "cases.json")) as f:
        spec = json.load(f)
    Hq, Hkv = spec["Hq"], spec["Hkv"]
    points = {tuple(p.split(":")) for p in args.points.split(",") if p}
    flex = torch.compile(flex_attention, dynamic=False)
    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16}
    rows = []
    for case in spec["cases"]:
        S, name, area = case["S"], case["mask"], case["area"]
        meta = np.fromfile(os.path.join(args.cases, name + ".meta"), dtype=np.int32).reshape(S, 3)
        set_mask(case, meta)
        block_mask = create_block_mask(_mask_mod, 1, None, S, S, device="cpu", BLOCK_SIZE=FLEX_BLOCK)
        dense = dense_mask(S) if S <= args.sdpa_max_seq and name not in ("full", "causal") else None
        for D in spec["dims"]:
            if points and (name, str(D)) not in points:
                continue
            for dname in args.dtypes.split(","):
                dt = dtypes[dname]
                q = torch.randn(1, Hq, S, D, dtype=dt)
                k = torch.randn(1, Hkv, S, D, dtype=dt)
                v = torch.randn(1, Hkv, S, D, dtype=dt)
                fwd_flop = 4.0 * Hq * D * area
                row = {"mask": name, "S": S, "D": D, "dtype": dname, "threads": args.threads}
                with torch.no_grad():
                    row["flex_fwd_s"] = median_time(lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=True),
                                                    args.repeats)
                if S <= args.sdpa_max_seq:
                    kw = {"is_causal": True} if name == "causal" else ({"attn_mask": dense} if dense is not None else {})
                    sdpa = torch.nn.functional.scaled_dot_product_attention
                    with torch.no_grad():
                        row["sdpa_fwd_s"] = median_time(lambda: sdpa(q, k, v, enable_gqa=True, **kw), args.repeats)
                    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
                    out = sdpa(qg, kg, vg, enable_gqa=True, **kw)
                    grad = torch.randn_like(out)
                    row["sdpa_bwd_s"] = median_time(
                        lambda: torch.autograd.grad(out, (qg, kg, vg), grad, retain_graph=True), args.repeats)
                row["flex_fwd_gflops"] = fwd_flop / row["flex_fwd_s"] / 1e9
                if "sdpa_fwd_s" in row:
                    row["sdpa_fwd_gflops"] = fwd_flop / row["sdpa_fwd_s"] / 1e9
                    row["sdpa_bwd_gflops"] = BACKWARD_FLOP_FACTOR * fwd_flop / row["sdpa_bwd_s"] / 1e9
                print(json.dumps(row), flush=True)
                rows.append(row)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
