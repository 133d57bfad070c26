#!/usr/bin/env python3
"""Router near-ties: ringflex's MoE routing against a float64 reference, across a sweep of gaps between the k-th and
(k+1)-th router scores from float32 rounding level to far above it (issue 37: one token of a 2048-token MoE row
differed from PyTorch's float32 loss by 0.079; docs/model-fidelity.md, "Router near-ties").

A tiny MoE model (tests/model/parity.py's config and random weights, 6 experts, top 3) whose router rows are
w + j * delta_l * u for expert j: every expert's score is w.x + j * delta_l * (u.x), so all adjacent experts are
delta_l * |u.x| apart, and layer l's delta_l (1e-4 down to 1e-7) with the tokens' spread of u.x sweeps the gap from
clear to below float32's resolution of an O(1) score. `ringflex forward --router` gives its scores and choices,
tests/model/float64_router.py's float64 transformers (its norms and router in float64 too) routed as ringflex chose
the reference's: each layer's float64 scores and own top-k on ringflex's history (a choice that flips moves that
token's later scores by O(1), so only the same history compares). Checked:
  1. ringflex's choices are the top-k of its own scores (where they are further apart than its softmax rounds);
  2. its scores are within SCORE_TOL of float64's (err = the largest difference);
  3. wherever float64's gap exceeds 2 err, ringflex chose float64's experts: no score of either side can cross
     the other's then, so a different choice there would be a bug; below it either side of the tie is float32's
     rounding, and the sweep must hold such pairs as well as clear ones (else it tests nothing);
  4. the float64 model routed as ringflex chose gives ringflex's loss and every token's within parity.py's REL_TOL:
     the same choices give the same outputs (a path difference, e.g. a wrong weight or expert, would not).

At each rank count given (tests/common/launchers.py: under CP each rank routes its own tokens and rank 0 gathers
the router outputs back into row order). Exit code 77 (CTest's skip) when torch, transformers or safetensors is
missing.

    python3 tests/model/router_near_tie.py build/src/cli/ringflex --ranks 1 2 -- mpirun --oversubscribe
"""
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from launchers import launchers, ranks_of  # noqa: E402
from oracle_env import missing_oracle  # noqa: E402

try:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Gemma4ForCausalLM
    import float64_router as f64r
    import parity  # noqa: E402  (tests/model/parity.py: configs, random weights, REL_TOL)
except ImportError as e:
    missing_oracle(e)

E, K = 6, 3
S = 96  # tokens of the one row: with 4 layers, 384 (token, layer) choices
DELTAS = [1e-4, 1e-5, 1e-6, 1e-7]  # per layer: adjacent experts' score spacing per unit of u.x
# ringflex's float32 scores against float64's on this model: the row's hidden states after a few float32 layers
# carry ~1e-6 relative rounding into O(1) scores (measured on a Zen 4: 1.9e-6 native, 3.5e-6 on the AVX2 path);
# 1e-5 leaves room for other CPUs' kernels and would still catch a wrong norm, scale or weight (1e-3 and more).
SCORE_TOL = 1e-5
OWN_GAP = 1e-6  # check 1: scores this far apart stay apart through the float32 softmax (probabilities ~1/E)


def build(workdir):
    cfg = parity.CONFIGS["moe"](False)
    cfg.num_experts, cfg.top_k_experts = E, K
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(cfg).float()
    gen = torch.Generator().manual_seed(37)
    parity.randomize(model, gen)
    H = cfg.hidden_size
    with torch.no_grad():
        for l, layer in enumerate(model.model.layers):
            w = torch.randn(H, generator=gen, dtype=torch.float64)
            u = torch.randn(H, generator=gen, dtype=torch.float64)
            rows = torch.stack([w + j * DELTAS[l] * u for j in range(E)])
            layer.router.proj.weight.copy_(rows.float())
            layer.router.per_expert_scale.fill_(1.0)
    ckpt = os.path.join(workdir, "ckpt")
    model.save_pretrained(ckpt, safe_serialization=True)
    ids = torch.randint(1, cfg.vocab_size, (1, S), generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (1, S), generator=gen)
    batch = os.path.join(workdir, "batch.safetensors")
    save_file({"input_ids": ids, "labels": labels}, batch)
    return model, ckpt, batch, ids, labels


def check(tag, out, model, ids, labels, failures):
    t = load_file(out)
    layers = f64r.moe_layers(model)
    rf_loss = t["token_loss"][0].double()
    if sorted(int(k.split(".")[1]) for k in t if k.startswith("router_experts.")) != layers:
        failures.append(f"{tag}: router outputs {sorted(k for k in t if k.startswith('router'))}, want layers {layers}")
        return
    rf_scores = {l: t[f"router_logits.{l}"][0].double() for l in layers}
    rf_experts = {l: t[f"router_experts.{l}"][0].long() for l in layers}
    # The reference on ringflex's history: float64 routed as ringflex chose, its own top-k recorded at each layer.
    forced_loss, ref_scores, ref_experts = f64r.run_routed(model, ids, labels, forced=rf_experts)

    err = max((rf_scores[l] - ref_scores[l]).abs().max().item() for l in layers)
    print(f"{tag}: router scores vs float64: max abs {err:.2e} (tolerance {SCORE_TOL:.0e})")
    if not err <= SCORE_TOL:
        failures.append(f"{tag}: router scores {err:.2e} from float64's (tolerance {SCORE_TOL:.0e})")
    clear = ties = flips = 0
    for l in layers:
        # ringflex ranks the float32 probabilities, whose rounding (a few 2^-24 relative) can merge scores closer
        # than OWN_GAP; so check 1 holds where its own scores' k-th/(k+1)-th gap is wider.
        own_gap = f64r.kth_gap(rf_scores[l], K)
        for tok in range(S):
            s = rf_scores[l][tok].float()
            want = sorted(range(E), key=lambda e: (-s[e].item(), e))[:K]
            if own_gap[tok] > OWN_GAP and sorted(rf_experts[l][tok].tolist()) != sorted(want):
                failures.append(f"{tag}: layer {l} token {tok}: chose {rf_experts[l][tok].tolist()}, its scores "
                                f"rank {want}")
        gap = f64r.kth_gap(ref_scores[l], K)
        agree = f64r.same_set(rf_experts[l], ref_experts[l])
        above = gap > 2 * err
        clear += int(above.sum())
        ties += int((~above).sum())
        flips += int((~agree).sum())
        for tok in (above & ~agree).nonzero().flatten().tolist():
            failures.append(f"{tag}: layer {l} token {tok}: float64 gap {gap[tok]:.2e} > 2 x {err:.2e} but ringflex "
                            f"chose {sorted(rf_experts[l][tok].tolist())}, float64 "
                            f"{sorted(ref_experts[l][tok].tolist())}")
        print(f"{tag}: layer {l} (delta {DELTAS[l]:.0e}): float64 k-th/(k+1)-th gap {gap.min():.1e}..{gap.max():.1e}, "
              f"{int(above.sum())} of {S} above 2 x err; ringflex chose other experts than float64 at "
              f"{int((~agree).sum())} (largest gap there {gap[~agree].max().item() if (~agree).any() else 0:.1e})")
    print(f"{tag}: {clear} clear choices, {ties} within rounding of a tie, {flips} chosen unlike float64")
    if clear < S or ties < 8:
        failures.append(f"{tag}: the sweep holds {clear} clear choices and {ties} near-ties: too few to test both")

    # 4. The same choices give the same outputs: the loss of float64 routed as ringflex chose.
    rel = ((rf_loss - forced_loss).norm() / forced_loss.norm()).item()
    worst = (rf_loss - forced_loss).abs().max().item()
    print(f"{tag}: token loss vs float64 routed as ringflex: relative {rel:.1e}, max abs {worst:.1e} "
          f"(tolerance {parity.REL_TOL:.0e} relative)")
    if not rel <= parity.REL_TOL:
        failures.append(f"{tag}: token loss {rel:.1e} from float64's with ringflex's choices (tolerance "
                        f"{parity.REL_TOL})")


def main():
    ringflex = sys.argv[1]
    failures = []
    with tempfile.TemporaryDirectory() as d:
        model, ckpt, batch, ids, labels = build(d)
        outs = []
        for launcher in launchers(sys.argv[2:]):
            out = os.path.join(d, f"out{ranks_of(launcher)}.safetensors")
            subprocess.run([*launcher, ringflex, "forward", "--model", ckpt, "--in", batch, "--out", out,
                            "--no-logits", "--router"], check=True, stdout=subprocess.DEVNULL)
            outs.append((f"P = {ranks_of(launcher)}", out))
        f64r.use_float64_norms()
        model = model.double()
        for tag, out in outs:
            check(tag, out, model, ids, labels, failures)
    for f in failures:
        print("FAILED:", f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
