#!/usr/bin/env python3
"""Per-token loss of `ringflex forward` against PyTorch on bench_model.py's checkpoint and batch, and where a token
differs most, why: each MoE layer's router scores and choices on every side (issue 37: one token of the 100m-moe
S = 2048 run differed by 0.079 on an AVX2-only CPU while the mean loss agreed to 4e-6).

The same checkpoint (bench_model.py's config, torch.manual_seed(0), float32) and batch (random ids and labels,
generator seed 0) as bench_model.py, so a token index here is a token index there. Sides:
  - ringflex: `ringflex forward --no-logits --router` once per --path: native (this CPU's widest kernels) and
    avx2 (RINGFLEX_ISA=avx2 OPENBLAS_CORETYPE=Haswell: the AVX2-only code paths on an AVX-512 machine);
  - torch float32: Gemma4ForCausalLM as bench_model.py runs it (SDPA), per-token cross-entropy;
  - torch float32 routed as ringflex: the float32 run with each MoE layer's experts run on the choices ringflex
    made (weights renormalised from torch's own probabilities, as the router does). If a token's gap is a routing
    choice, this run's token loss lands on ringflex's; were it a difference in the experts or any other path, it
    would not;
  - float64 on each float32 side's history: the same model in float64, its RMSNorms and the router's softmax and
    top-k in float64 too (tests/model/float64_router.py: transformers takes both in float32 whatever the model's
    dtype), its experts run on that side's choices, recording at each layer its own scores and top-k. A choice
    flipped at one layer moves that token's later scores by O(1), so a side's scores and choices are compared with
    float64's on the same history only.
Per side: the largest score difference from float64's, the (token, layer) choices unlike float64's own and the
largest float64 gap between the k-th and (k+1)-th scores among them: a flip at a gap below the float32 score error
is a near-tie float32 cannot resolve, not a bug. For the --top tokens the per-layer choices and boundary gaps.

    python3 bench/model/moe_token_parity.py build/src/cli/ringflex --config 100m-moe --seq 2048
"""
import argparse
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file, save_file
from transformers import Gemma4ForCausalLM, Gemma4TextConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "model"))
from bench_model import COMMON, CONFIGS, cpu_name  # noqa: E402
from float64_router import kth_gap, run_routed, same_set, use_float64_norms  # noqa: E402

PATHS = {"native": {}, "avx2": {"RINGFLEX_ISA": "avx2", "OPENBLAS_CORETYPE": "Haswell"}}


def run_ringflex(ringflex, ckpt, batch, out, threads, env_extra):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), **env_extra)
    subprocess.run([ringflex, "forward", "--model", ckpt, "--in", batch, "--out", out, "--no-logits", "--router",
                    "--threads", str(threads)], check=True, env=env, stdout=subprocess.DEVNULL)
    t = load_file(out)
    layers = sorted(int(k.split(".")[1]) for k in t if k.startswith("router_logits."))
    return (t["token_loss"][0].double(), {l: t[f"router_logits.{l}"][0].double() for l in layers},
            {l: t[f"router_experts.{l}"][0].long() for l in layers})


def flips(experts, ref_scores, ref_experts, K, layers):
    """(token, layer) choices unlike float64's own on the same history, the largest float64 gap among them, and the
    largest score difference from float64's."""
    diff = [(l, t) for l in layers for t in (~same_set(experts[l], ref_experts[l])).nonzero().flatten().tolist()]
    gaps = {l: kth_gap(ref_scores[l], K) for l in layers}
    return diff, max((gaps[l][t].item() for l, t in diff), default=0.0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ringflex")
    ap.add_argument("--config", choices=[c for c in CONFIGS if "moe" in c], default="100m-moe")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--path", nargs="+", choices=PATHS, default=list(PATHS))
    ap.add_argument("--top", type=int, default=3, help="tokens to analyse, largest |ringflex - torch float32| first")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    use_float64_norms()  # the same operations in float32
    cfg = Gemma4TextConfig(**CONFIGS[a.config], **COMMON)
    K, S = cfg.top_k_experts, a.seq
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(cfg).float()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, cfg.vocab_size, (1, S), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (1, S), generator=g)
    runs = {}  # name: (token loss [S], scores {layer: [S, E]}, choices {layer: [S, K]})
    with tempfile.TemporaryDirectory() as d:
        ckpt, batch = os.path.join(d, "ckpt"), os.path.join(d, "batch.safetensors")
        model.save_pretrained(ckpt, safe_serialization=True)
        save_file({"input_ids": ids, "labels": labels}, batch)
        for p in a.path:
            runs[f"ringflex {p}"] = run_ringflex(a.ringflex, ckpt, batch, os.path.join(d, f"{p}.safetensors"),
                                                 a.threads, PATHS[p])
    model.config._attn_implementation = "sdpa"  # as bench_model.py's PyTorch side
    experts_impl = model.config._experts_implementation
    runs["torch float32"] = run_routed(model, ids, labels)
    for p in a.path:
        runs[f"torch float32 routed as ringflex {p}"] = run_routed(model, ids, labels, forced=runs[f"ringflex {p}"][2])
    # float64 on each float32 side's history (its choices forced): the reference scores and choices for that side.
    model = model.double()
    sides = [f"ringflex {p}" for p in a.path] + ["torch float32"]
    ref = {}
    for side in sides:
        same = next((o for o in ref if all(torch.equal(runs[o][2][l], runs[side][2][l]) for l in runs[side][2])), None)
        ref[side] = ref[same] if same else run_routed(model, ids, labels, forced=runs[side][2])
    layers = sorted(runs["torch float32"][1])
    t32 = runs["torch float32"][0]

    print(f"config {a.config}, S = {S}, threads {a.threads}, CPU: {cpu_name()}")
    print("| run | mean loss | mean - torch float32 | max abs token loss - torch float32 (token) | tokens > 1e-3 from "
          "torch float32 | max abs token loss - float64 on its history | max abs token loss - torch float32 routed "
          "as it (token) |")
    print("|---|---|---|---|---|---|---|")
    for name, (loss, _, _) in runs.items():
        d32 = (loss - t32).abs()
        d64 = f"{(loss - ref[name][0]).abs().max():.2e}" if name in ref else "-"
        routed_as = runs.get(name.replace("ringflex", "torch float32 routed as ringflex"))
        same = "-"
        if name.startswith("ringflex"):
            dr = (loss - routed_as[0]).abs()
            same = f"{dr.max():.2e} ({dr.argmax()})"
        print(f"| {name} | {loss.mean():.6f} | {loss.mean() - t32.mean():+.2e} | {d32.max():.2e} ({d32.argmax()}) | "
              f"{int((d32 > 1e-3).sum())} | {d64} | {same} |")

    print(f"\nEach float32 side's choices against float64's own on the same history, all {S} x {len(layers)} "
          "(token, MoE layer) choices:")
    print("| side | max abs score - float64 | choices unlike float64 | largest float64 k-th/(k+1)-th gap there |")
    print("|---|---|---|---|")
    for side in sides:
        err = max((runs[side][1][l] - ref[side][1][l]).abs().max().item() for l in layers)
        diff, worst = flips(runs[side][2], ref[side][1], ref[side][2], K, layers)
        print(f"| {side} | {err:.2e} | {len(diff)} | {worst:.2e} |")

    _, t32_scores, t32_experts = runs["torch float32"]
    for p in a.path:
        loss, scores, experts = runs[f"ringflex {p}"]
        forced = runs[f"torch float32 routed as ringflex {p}"][0]
        for t in (loss - t32).abs().argsort(descending=True)[:a.top].tolist():
            print(f"\nringflex {p}, token {t}: token loss ringflex {loss[t]:.6f}, torch float32 {t32[t]:.6f}, "
                  f"torch float32 routed as ringflex {forced[t]:.6f}, float64 on ringflex's history "
                  f"{ref[f'ringflex {p}'][0][t]:.6f}")
            print("| layer | ringflex top-k | torch float32 top-k | float64 top-k (ringflex's history) | experts at "
                  "the boundary (float64 k-th, (k+1)-th) | their score gap: float64 | ringflex | torch float32 |")
            print("|---|---|---|---|---|---|---|---|")
            ref_scores, ref_experts = ref[f"ringflex {p}"][1], ref[f"ringflex {p}"][2]
            for l in layers:
                top = torch.topk(ref_scores[l][t], K + 1).indices.tolist()
                e1, e2 = top[K - 1], top[K]
                chosen = [sorted(c[l][t].tolist()) for c in (experts, t32_experts, ref_experts)]
                gap = [s[l][t][e1].item() - s[l][t][e2].item() for s in (ref_scores, scores, t32_scores)]
                print(f"| {l} | {chosen[0]} | {chosen[1]} | {chosen[2]} | {e1}, {e2} | {gap[0]:.3e} | {gap[1]:.3e} | "
                      f"{gap[2]:.3e} |")


if __name__ == "__main__":
    main()
