#!/usr/bin/env python3
"""End-to-end check of `mpirun -n 3 ringflex attn ... --stats FILE.json` (default sharding: balanced).

Python writes a small packed-document problem with a sliding window, runs ringflex under mpirun, and checks the
stats file: the documented schema, one record per rank in rank order, the scheme and algorithm used, and the
work against an independent oracle: the ranks' work sums to the mask area counted by brute force over the
docs/spec.md §3 predicate in numpy (each allowed (q, k) pair of every row computed exactly once). When numpy or
safetensors is not installed: exits 77 (CTest's skip), or fails under CI (tests/common/oracle_env.py).
"""
import json
import os
import subprocess
import sys
import tempfile

B, HQ, HKV, S, D, P, WINDOW = 2, 2, 1, 150, 16, 3, 20

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from oracle_env import missing_oracle  # noqa: E402

try:
    import numpy as np
    from safetensors.numpy import save_file
except ImportError as e:
    missing_oracle(e)


def mask_area(doc):
    """Allowed pairs of one row: same document, not padding, causal, within the window (no groups)."""
    idx = np.arange(S)
    q, k = idx[:, None], idx[None, :]
    same = (doc[:, None] > 0) & (doc[:, None] == doc[None, :])
    return int((same & (k <= q) & (q - k < WINDOW)).sum())


def main():
    ringflex, mpiexec = sys.argv[1], sys.argv[2:]
    rng = np.random.default_rng(9)
    doc = np.zeros((B, S), np.int32)
    for b in range(B):
        t, d = 0, 1
        while t < S - 7:  # 7 tokens of padding at the end
            n = int(rng.integers(1, 60))
            doc[b, t:min(t + n, S - 7)] = d
            d, t = d + 1, t + n
    tensors = {
        "q": rng.standard_normal((B, HQ, S, D)).astype(np.float32),
        "k": rng.standard_normal((B, HKV, S, D)).astype(np.float32),
        "v": rng.standard_normal((B, HKV, S, D)).astype(np.float32),
        "dout": rng.standard_normal((B, HQ, S, D)).astype(np.float32),
        "doc": doc,
    }
    with tempfile.TemporaryDirectory() as tmp:
        src, out, stats = (os.path.join(tmp, n) for n in ("in.safetensors", "out.safetensors", "stats.json"))
        save_file(tensors, src)
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
        subprocess.run(mpiexec + ["-n", str(P), ringflex, "attn", "--in", src, "--out", out, "--window", str(WINDOW),
                                  "--stats", stats], check=True, env=env, stdout=subprocess.DEVNULL)
        with open(stats) as f:
            report = json.load(f)

    assert report["scheme"] == "balanced", report["scheme"]  # the default
    assert report["algo"] == "ring", report["algo"]
    ranks = report["ranks"]
    assert [r["rank"] for r in ranks] == list(range(P)), ranks
    keys = {"rank", "tokens", "work", "peak_attention_bytes", "bytes_sent", "bytes_received", "compute_s", "wall_s"}
    for r in ranks:
        assert set(r) == keys, set(r) ^ keys
        assert r["peak_attention_bytes"] > 0 and r["wall_s"] >= r["compute_s"] >= 0
    assert sum(r["tokens"] for r in ranks) == int((doc > 0).sum())
    assert sum(r["work"] for r in ranks) == sum(mask_area(doc[b]) for b in range(B))
    assert sum(r["bytes_sent"] for r in ranks) == sum(r["bytes_received"] for r in ranks)
    print("ok")


if __name__ == "__main__":
    main()
