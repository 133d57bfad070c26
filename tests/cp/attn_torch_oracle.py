#!/usr/bin/env python3
"""`ringflex attn` against PyTorch in float64: out, LSE, dQ, dK and dV at P = 1 and under mpirun -n P.

The oracle is written here from the mask predicate of docs/spec.md §3 and the numerics of §4, with torch ops only:
a dense [B, S, S] mask built from (idx, doc, group) by broadcasting, scores Q Kᵀ in float64, a softmax that gives
a query with no allowed key O = 0 and LSE = -inf, and autograd of sum(O * dOut) for dQ, dK, dV. Nothing in it
comes from src/reference (the in-repo oracle the other tests use), so a mistake shared by the kernels and that
reference cannot hide here.

Rows are random and Gemma 4-like: packed documents of random lengths, image groups (bidirectional blocks) that
straddle the ranks' shard boundaries, trailing padding, a row that is all padding when B > 1, sliding windows,
GQA up to 16:1, head dims 64, 128, 256, 512 and 72, S not a multiple of 64. Each CTest entry is one (dtype, case
list) pair with its rank counts (-P 1 3: P = 1 and mpirun -n 3); it builds each case's inputs and computes the
oracle once, then runs ringflex at every P given: under the default CP path (balanced shards, planned ring),
--shard zigzag and --algo allgather (at P = 1, once: the options change nothing there).

Tolerances, per output tensor T (the flash-attention tests' rule, plus the terms of ringflex's exp):
    |ringflex - float64| <= MULT * |torch_same_precision - float64|
                            + (ROUND[dtype] + EXP2 + 2 * 2^-24 * max|s|) * max|float64|      (max over the tensor)
torch_same_precision is the same attention computed by PyTorch in the run's precision (float32; for bf16, bf16
matmuls with a float32 softmax, as PyTorch's own bf16 attention does) from the same inputs: what a correct
implementation in that precision loses on these very inputs. MULT = 3: ringflex accumulates in float32 like
PyTorch, in another order (an online softmax over 64-key tiles, then one LSE merge per ring step), so its error
is of the same size but not the same; 3 leaves room for the order. dK and dV get MULT * sqrt(Hq / Hkv): ringflex
sums the contributions of a kv head's Hq / Hkv query heads to a key in one float32 accumulator, where PyTorch sums
each head's inside its own matmul and then adds the heads up, so ringflex's chain is Hq / Hkv times longer and its
random-walk rounding error up to sqrt(Hq / Hkv) times larger (measured: 4.1x PyTorch's at 16:1).
ROUND[dtype] is the unit roundoff of the output dtype (2^-24 float32, 2^-8 bf16): ringflex writes out, dq, dk, dv
in the input's dtype, one rounding no kernel can avoid. The other two terms are ringflex's exp, which PyTorch does
not share: it works in log2 units (flash-attention's form), forming s * log2(e) - max (and, in the backward,
lse * log2(e)) in float32, so a score of magnitude |s| carries an absolute rounding of about 2^-24 * |s| twice,
which becomes a relative error of its probability and so of everything computed from it (max|s| is the largest
|scale * q.k| over allowed pairs, about 60 in the scale = 1.0 case with D = 256, where this term dominates); and
its vector exp2 is a polynomial with relative error below EXP2 = 3e-7 (src/cpu/microkernels.h).
Measured over every entry (scripts print err and tol per tensor): the float32 errors reach at most about 2/3 of
their tolerance, the bf16 ones about 1/5 (bf16 outputs are dominated by their final rounding).
All of it stays far below a real defect: one key wrongly masked or added moves an output row by about
|v - o| / (keys the row sees) >= 1e-3 here, against float32 tolerances of 1e-6 to 1e-4 of max|T|. The bf16 cases
catch gross errors (wrong key, head, rank's data, lost gradient); the float32 cases catch the fine ones.
Exact checks besides: LSE = -inf and O = dQ = 0 exactly on rows with no allowed key, dK = dV = 0 exactly on keys
no query reads, and no NaN anywhere.

    attn_torch_oracle.py --ringflex PATH -P N [N...] --dtype f32|bf16 --cases NAME --work DIR [--mpiexec MPIEXEC...]
"""
import argparse
import math
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from oracle_env import missing_oracle  # noqa: E402

try:
    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file
except ImportError as e:
    missing_oracle(e)

MULT = 3.0
ROUND = {"f32": 2.0**-24, "bf16": 2.0**-8}
EXP2 = 3e-7  # relative error bound of ringflex's vector exp2 (src/cpu/microkernels.h, checked by its own test)
TORCH_DTYPE = {"f32": torch.float32, "bf16": torch.bfloat16}
# The CP variants every case runs: the default (balanced shards, planned ring), zigzag, and all-gather.
VARIANTS = {"default": [], "zigzag": ["--shard", "zigzag"], "allgather": ["--algo", "allgather"]}

# Cases: B, Hq, Hkv, S, D, mask (causal, window, bidirectional groups) and scale (None: 1/sqrt(D)). S is never a
# multiple of 64 (the kernels' key tile) and every list mixes head dims, GQA ratios and masks.
CASES = {
    "small_dims": [
        dict(B=2, Hq=4, Hkv=2, S=201, D=64, causal=True, window=0, groups=True, scale=None),
        dict(B=2, Hq=16, Hkv=1, S=143, D=72, causal=True, window=33, groups=True, scale=None),
        dict(B=1, Hq=3, Hkv=3, S=99, D=128, causal=False, window=0, groups=False, scale=0.3),
        dict(B=1, Hq=2, Hkv=1, S=45, D=8, causal=True, window=0, groups=True, scale=0.0),  # 0 is not "unset"
    ],
    "large_dims": [
        dict(B=2, Hq=8, Hkv=2, S=157, D=256, causal=True, window=40, groups=True, scale=1.0),
        dict(B=1, Hq=2, Hkv=1, S=190, D=512, causal=True, window=0, groups=True, scale=None),
        dict(B=2, Hq=16, Hkv=1, S=75, D=72, causal=False, window=21, groups=True, scale=None),
    ],
}


def gemma4_like_meta(rng, B, S, boundaries):
    """doc [B, S] (1-based, 0 = padding) and group [B, S] (-1 = none) of random packed Gemma 4-like rows.

    Each document is text with one image run inside it (text on both sides, so two images never touch and every
    maximal image run is one group, numbered 0, 1, ... along the row); the row ends in padding, and row 1 (when
    B > 1) is all padding. A document that contains one of `boundaries` (token positions where shards meet) has
    its image centred there, so image groups straddle the ranks' shard boundaries.
    """
    doc = np.zeros((B, S), np.int32)
    group = np.full((B, S), -1, np.int32)
    for b in range(B):
        if b == 1:
            continue  # an all-padding row: every query and key of it is masked
        t, d, g = 0, 1, 0
        end = S - int(rng.integers(1, 9))  # trailing padding
        while t < end:
            n = int(rng.integers(30, 130))
            while any(abs(t + n - x) < 4 for x in boundaries):  # keep boundaries inside documents
                n += 1
            n = min(n, end - t)
            doc[b, t:t + n] = d
            inside = [x for x in boundaries if t + 3 <= x <= t + n - 3]  # a boundary with text room both sides
            image = int(rng.integers(12, 61))
            if inside:
                image = min(image, n - 4)
            if n >= image + 4 and image >= 2:  # room for text on both sides
                first, last = t + 2, t + n - image - 2  # the image's possible starts
                start = int(rng.integers(first, last + 1))
                if inside:  # centred on the boundary: tokens on both sides of it (first < x, x < last + image)
                    start = min(max(inside[0] - image // 2, first), last)
                group[b, start:start + image] = g
                g += 1
            t, d = t + n, d + 1
    return doc, group


def allowed_mask(doc, group, causal, window, groups):
    """[B, S, S] bool, query on dim 1, key on dim 2: the predicate of docs/spec.md §3, from scratch in torch."""
    S = doc.shape[1]
    idx = torch.arange(S)
    qi, ki = idx[:, None], idx[None, :]
    dq, dk = doc[:, :, None], doc[:, None, :]
    gq, gk = group[:, :, None], group[:, None, :]
    same_doc = (dq > 0) & (dk > 0) & (dq == dk)
    ordered = (ki <= qi) if causal else torch.ones(S, S, dtype=torch.bool)
    if window == 0:
        in_window = torch.ones(S, S, dtype=torch.bool)
    elif causal:
        in_window = (qi - ki) < window
    else:
        in_window = (qi - ki).abs() < window
    grouped = (gq >= 0) & (gq == gk) if groups else torch.zeros(1, S, S, dtype=torch.bool)
    return same_doc & ((ordered & in_window)[None] | grouped)


def attention(q, k, v, mask, scale, softmax_dtype):
    """O [B, Hq, S, D] and LSE [B, Hq, S] in q's dtype, differentiable; rows with no allowed key: O = 0, LSE = -inf.

    q: [B, Hq, S, D]; k, v: [B, Hkv, S, D]; mask: [B, S, S]. Query head h reads kv head h // (Hq / Hkv).
    """
    group_size = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group_size, dim=1)
    v = v.repeat_interleave(group_size, dim=1)
    scores = (q @ k.transpose(-1, -2)).to(softmax_dtype) * scale  # [B, Hq, S, S]
    m = mask[:, None]  # [B, 1, S, S]
    empty = ~m.any(-1)  # [B, 1, S]: rows with no allowed key
    # Empty rows take their LSE over plain zeros instead of all -inf: finite, so autograd stays NaN-free, and
    # their probabilities are zeroed by the mask below anyway.
    lse_in = torch.where(m, scores, torch.tensor(-math.inf, dtype=softmax_dtype))
    lse_in = torch.where(empty[..., None], torch.zeros((), dtype=softmax_dtype), lse_in)
    lse = torch.logsumexp(lse_in, dim=-1)  # [B, Hq, S]
    p = torch.exp(scores - lse[..., None]) * m
    o = p.to(q.dtype) @ v
    return o, torch.where(empty, torch.tensor(-math.inf, dtype=softmax_dtype), lse)


def oracle(inputs, case, dtype, softmax_dtype):
    """out, lse, dq, dk, dv of the case in `dtype`, autograd of sum(out * dout)."""
    q, k, v = (inputs[n].to(dtype).requires_grad_() for n in ("q", "k", "v"))
    mask = allowed_mask(inputs["doc"].long(), inputs["group"].long(), case["causal"], case["window"], case["groups"])
    scale = case["scale"] if case["scale"] is not None else 1.0 / math.sqrt(case["D"])
    o, lse = attention(q, k, v, mask, scale, softmax_dtype)
    (o * inputs["dout"].to(dtype)).sum().backward()
    out = {"out": o, "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    # max |s| over allowed pairs, s = scale * q.k (for the exp-argument term of the tolerance)
    s = (q.detach().double() @ k.detach().double().repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2))
    max_score = (s.abs() * scale * mask[:, None]).max().item()
    return {n: t.detach().double() for n, t in out.items()}, mask, max_score


def make_inputs(rng, case, dtype, ranks):
    """The case's tensors, with image groups placed on the contiguous shard boundaries of the P > 1 in `ranks`."""
    B, Hq, Hkv, S, D = case["B"], case["Hq"], case["Hkv"], case["S"], case["D"]
    boundaries = sorted({x for P in ranks if P > 1 for x in contiguous_boundaries(S, P)}) or contiguous_boundaries(S, 2)
    doc, group = gemma4_like_meta(rng, B, S, boundaries)
    t = {}
    for name, heads in (("q", Hq), ("k", Hkv), ("v", Hkv), ("dout", Hq)):
        t[name] = torch.from_numpy(rng.standard_normal((B, heads, S, D))).to(TORCH_DTYPE[dtype])
    t["doc"], t["group"] = torch.from_numpy(doc), torch.from_numpy(group)
    return t


def contiguous_boundaries(S, P):
    """Token positions r * ceil(S / P), r = 1 .. P-1: where contiguous shards of the padded row meet."""
    L = -(-S // P)
    return [r * L for r in range(1, P) if r * L < S]


def straddles(group, P):
    """True when some image group has tokens on both sides of a contiguous shard boundary."""
    return any(group[b, x - 1] >= 0 and group[b, x - 1] == group[b, x]
               for b in range(group.shape[0]) for x in contiguous_boundaries(group.shape[1], P))


def mask_options(case):
    opts = ["--window", str(case["window"])]
    if not case["causal"]:
        opts.append("--no-causal")
    if case["groups"]:
        opts.append("--bidirectional-groups")
    if case["scale"] is not None:
        opts += ["--scale", repr(case["scale"])]
    return opts


def compare(name, got, ref, cmp, dtype, label, reads, mult, max_score):
    """Checks one output tensor; returns a failure message or None. reads: [B, Hq or Hkv, S] bool, or None."""
    if torch.isnan(got).any():
        return f"{label}: {name} has NaN"
    if name == "lse":
        inf_ref = torch.isinf(ref)
        if not torch.equal(torch.isinf(got) & (got < 0), inf_ref):
            return f"{label}: lse is -inf on different rows than the oracle's rows with no allowed key"
        got, ref, cmp = (torch.where(inf_ref, torch.zeros((), dtype=torch.float64), x) for x in (got, ref, cmp))
    if reads is not None and (got[~reads] != 0).any():
        return f"{label}: {name} is not exactly 0 where no (query, key) pair is allowed"
    scale = ref.abs().max().item()
    rounding = ROUND["f32" if name == "lse" else dtype]
    tol = mult * (cmp - ref).abs().max().item() + (rounding + EXP2 + 2 * ROUND["f32"] * max_score) * scale
    err = (got - ref).abs().max().item()
    print(f"  {label:<42} {name:<4} err {err:9.2e}  tol {tol:9.2e}  (max|ref| {scale:8.2e})")
    if not err <= tol:
        at = np.unravel_index(int((got - ref).abs().argmax()), tuple(got.shape))
        return f"{label}: {name} differs from float64 by {err:.3e} > {tol:.3e} at {tuple(int(i) for i in at)}"
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ringflex", required=True)
    ap.add_argument("--mpiexec", nargs=argparse.REMAINDER, default=[],
                    help="last: the launcher's words before `-n P`, e.g. mpirun --oversubscribe")
    ap.add_argument("-P", type=int, nargs="+", default=[1], help="rank counts, each checked against the same oracle")
    ap.add_argument("--dtype", choices=("f32", "bf16"), required=True)
    ap.add_argument("--cases", choices=sorted(CASES), required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.set_num_threads(1)  # CTest runs these entries side by side on few cores
    os.makedirs(a.work, exist_ok=True)
    if max(a.P) > 1 and not a.mpiexec:
        sys.exit("attn_torch_oracle.py: -P > 1 needs --mpiexec")
    rng = np.random.default_rng([a.seed, *a.P, 0 if a.dtype == "f32" else 1, sorted(CASES).index(a.cases)])
    failures = []
    for n, case in enumerate(CASES[a.cases]):
        inputs = make_inputs(rng, case, a.dtype, a.P)
        for P in a.P:
            if P > 1 and case["groups"] and not straddles(inputs["group"].numpy(), P):
                failures.append(f"case {n}: no image group straddles a shard boundary at P = {P}; the generator "
                                "must place one")
        ref, mask, max_score = oracle(inputs, case, torch.float64, torch.float64)
        cmp, _, _ = oracle(inputs, case, TORCH_DTYPE[a.dtype], torch.float32)
        # Which query rows have an allowed key, and which keys some query reads: there the result must be 0.
        q_reads = mask.any(-1)[:, None].expand(-1, case["Hq"], -1)  # [B, Hq, S]
        k_read = mask.any(1)[:, None].expand(-1, case["Hkv"], -1)  # [B, Hkv, S]
        path_in = os.path.join(a.work, f"case{n}_in.safetensors")
        save_file({name: t.contiguous() for name, t in inputs.items()}, path_in)
        for P in a.P:
            launcher = a.mpiexec + ["-n", str(P)] if P > 1 else []  # P = 1: plainly, as a user runs it
            # At P = 1 the CLI runs the row as one chunk: the scheme and algorithm options change nothing.
            for variant, opts in (VARIANTS if P > 1 else {"default": []}).items():
                label = (f"P={P} {a.dtype} {variant} B{case['B']} Hq{case['Hq']}:{case['Hkv']} S{case['S']} "
                         f"D{case['D']}")
                path_out = os.path.join(a.work, f"case{n}_P{P}_{variant}_out.safetensors")
                if os.path.exists(path_out):
                    os.remove(path_out)
                cmd = launcher + [a.ringflex, "attn", "--in", path_in, "--out", path_out] + mask_options(case) + opts
                run = subprocess.run(cmd, capture_output=True, text=True)
                if run.returncode != 0:
                    failures.append(f"{label}: `{' '.join(cmd)}` exited {run.returncode}:\n{run.stdout}{run.stderr}")
                    continue
                got = {name: t.double() for name, t in load_file(path_out).items()}
                for name in ("out", "lse", "dq", "dk", "dv"):
                    reads = {"out": q_reads[..., None], "dq": q_reads[..., None], "dk": k_read[..., None],
                             "dv": k_read[..., None]}.get(name)
                    if reads is not None:
                        reads = reads.expand_as(got[name])
                    mult = MULT * math.sqrt(case["Hq"] // case["Hkv"]) if name in ("dk", "dv") else MULT
                    msg = compare(name, got[name], ref[name], cmp[name], a.dtype, label, reads, mult, max_score)
                    if msg:
                        failures.append(msg)
    for f in failures:
        print("FAILED: " + f, file=sys.stderr)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
