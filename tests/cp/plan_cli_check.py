#!/usr/bin/env python3
"""End-to-end check of `ringflex plan --in FILE --json OUT --svg OUT`.

Python writes random packed-document and image-group metadata with the `safetensors` package, runs the command,
and checks the JSON against the documented schema and against an independent oracle: per-rank work of the
contiguous and zigzag schemes counted by brute force over the docs/spec.md §3 predicate in numpy (balanced is checked
for being a valid report and no more imbalanced than contiguous, as its layout is the command's own choice).
Also checks that a malformed --layers fails with one line naming the problem. When numpy or
safetensors is not installed: exits 77 (CTest's skip), or fails under CI (tests/common/oracle_env.py).
"""
import json
import os
import subprocess
import sys
import tempfile

B, S, P, BLOCK = 2, 301, 3, 8
LAYERS = "3xsliding:20:groups,1xfull:groups"
MIX = [(True, 20, True, 3), (True, 0, True, 1)]  # (causal, window, groups, count)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from oracle_env import missing_oracle  # noqa: E402

try:
    import numpy as np
    from safetensors.numpy import save_file
except ImportError as e:
    missing_oracle(e)


def random_meta(rng):
    doc = np.zeros((B, S), np.int32)
    group = np.full((B, S), -1, np.int32)
    for b in range(B):
        t, d = 0, 1
        while t < S - 10:  # the last 10 tokens stay padding (doc 0)
            n = int(rng.integers(1, 90))
            doc[b, t:min(t + n, S - 10)] = d
            d, t = d + 1, t + n
        t, g = 0, 0
        while t < S:
            n = int(rng.integers(1, 40))
            if rng.random() < 0.4:
                group[b, t:t + n] = g
                g += 1
            t += n + 1
    return doc, group


def allowed_matrix(doc, group, causal, window, groups):
    """[S, S] bool: query q may read key k (docs/spec.md §3), for one row."""
    idx = np.arange(S)
    q, k = idx[:, None], idx[None, :]
    valid = (doc[:, None] > 0) & (doc[None, :] > 0) & (doc[:, None] == doc[None, :])
    ordered = (k <= q) if causal else np.ones((S, S), bool)
    dist = (q - k) if causal else np.abs(q - k)
    in_window = np.ones((S, S), bool) if window == 0 else dist < window
    grouped = groups & (group[:, None] >= 0) & (group[:, None] == group[None, :])
    return valid & ((ordered & in_window) | grouped)


def expected_work(doc, group, positions):
    """Per-rank work for a map given as lists of row positions (padding positions >= S count nothing)."""
    per_query = np.zeros(S, np.int64)
    for b in range(B):
        for causal, window, groups, count in MIX:
            per_query += count * allowed_matrix(doc[b], group[b], causal, window, groups).sum(axis=1)
    return [int(sum(per_query[p] for p in pos if p < S)) for pos in positions]


def contiguous(L):
    return [list(range(r * L, (r + 1) * L)) for r in range(P)]


def zigzag(half):
    return [list(range(r * half, (r + 1) * half)) + list(range((2 * P - 1 - r) * half, (2 * P - r) * half))
            for r in range(P)]


def main():
    ringflex = sys.argv[1]
    rng = np.random.default_rng(5)
    doc, group = random_meta(rng)
    with tempfile.TemporaryDirectory() as tmp:
        meta = os.path.join(tmp, "meta.safetensors")
        out_json, out_svg = os.path.join(tmp, "plan.json"), os.path.join(tmp, "plan.svg")
        save_file({"doc": doc, "group": group}, meta)
        subprocess.run([ringflex, "plan", "--in", meta, "-P", str(P), "--block", str(BLOCK), "--layers", LAYERS,
                        "--json", out_json, "--svg", out_svg], check=True, stdout=subprocess.DEVNULL)
        with open(out_json) as f:
            report = json.load(f)
        with open(out_svg) as f:
            svg = f.read()

        bad = subprocess.run([ringflex, "plan", "--in", meta, "--layers", "5xwindow:3"], capture_output=True, text=True)
        assert bad.returncode != 0, "a malformed --layers must fail"
        assert "unknown layer type 'window'" in bad.stderr and bad.stderr.count("\n") == 1, bad.stderr

    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>"), "not one SVG document"
    assert report["P"] == P
    names = {"causal,W=20,groups": 3, "causal,groups": 1}
    assert {k: v["layers"] for k, v in report["layer_types"].items()} == names, report["layer_types"]
    assert set(report["schemes"]) == {"contiguous", "zigzag", "balanced"}, report["schemes"].keys()
    for name, s in report["schemes"].items():
        for key in ("L", "tokens", "work", "imbalance", "bytes_received", "skipped_steps", "full_ring_bytes_received"):
            assert key in s, f"{name} lacks {key}"
        assert len(s["work"]) == P and len(s["tokens"]) == P
        assert abs(s["imbalance"] - max(s["work"]) * P / sum(s["work"])) < 1e-12  # float64 rounding of one division
        for layer in names:
            assert len(s["bytes_received"][layer]) == P and len(s["skipped_steps"][layer]) == P
            assert all(0 <= x <= s["full_ring_bytes_received"][layer] for x in s["bytes_received"][layer])
            assert all(0 <= x < P for x in s["skipped_steps"][layer])

    c, z = report["schemes"]["contiguous"], report["schemes"]["zigzag"]
    assert c["work"] == expected_work(doc, group, contiguous(c["L"])), (c["work"], expected_work(doc, group, contiguous(c["L"])))
    assert z["work"] == expected_work(doc, group, zigzag(z["L"] // 2)), z["work"]
    assert report["schemes"]["balanced"]["imbalance"] <= c["imbalance"]
    print("ok")


if __name__ == "__main__":
    main()
