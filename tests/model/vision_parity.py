#!/usr/bin/env python3
"""The C++ vision encoder (src/model/vision_encoder.h) gives transformers 5.24's Gemma4VisionModel soft tokens.

For each tiny random tower (the knobs: patch size, pooling kernel 1, 2 and 3, standardize, clipped linears with
bounds that really clip, GQA, one and two layers) this script
  1. builds Gemma4ForConditionalGeneration (a tiny text decoder beside the tower) in float32 with random weights
     (norm scales and the position table off their init values, so every tensor matters) and saves it;
  2. makes a batch of images of different sizes, each a grid of patches laid out row by row as the image processor
     does (x fastest), padded to the longest with (-1, -1) positions;
  3. computes the reference soft tokens with model.model.vision_tower in float64 (eager attention), and the gradient
     of every tower parameter for the loss sum(soft_tokens * R), R random;
  4. runs tests/model/vision_case (load_checkpoint, then the encoder on the tower the checkpoint carried, forward
     and backward) and compares the soft-token counts per image exactly, the soft tokens and every gradient (and
     that it gives none for a buffer: clip bounds and std_bias/std_scale do not train).

Each case runs twice in float32, on one thread and on two, with the same bits required (the "threaded" case is big
enough for every threaded pass to split). Tolerance: 1e-5 relative (norm of the difference over the norm of the reference). The C++ encoder runs in float32
(rounding ~6e-8 per op); the reference runs in float64 except where transformers itself computes in float32 (the
rotary angles, and the pooling and sqrt(hidden) scale, which Gemma4VisionPooler does in float32 on purpose), so
both sides carry float32 rounding of ~1e-7 amplified by a layer or two of attention and MLP: measured ~1e-6 at
most. A wrong term (a swapped rotary axis, a missed clip, padding in a pool, a wrong cell) moves it by 1e-2 or more.
Gradients: 1e-4 relative per tensor, as tests/model/parity.py allows its backward (the backward's longer chains and
sums over tokens amplify the same rounding; measured ~1e-6 here), still far below the 1e-2 of a wrong term (a clamp
gradient passed outside its bounds, a rotation not transposed).
The bf16 mode (set_compute_dtype, vision_case's COMPUTE_DTYPE) on the same cases: soft tokens within 2e-2 of the
float64 reference and farther than 1e-4 (float32 lands at ~2e-7: above 1e-4 shows the operands really were
rounded). Each bf16 operand carries a relative rounding of at most 2^-9 ~ 2e-3; a layer or two of linears and
attention compound a few of them: measured ~4e-3, 2e-2 leaves room for the random draws while a wrong term still
moves it by 1e-1 or more. Gradients within 5e-2 (measured ~1.5e-2: the backward's chains are about twice the
forward's) on the cases without clipped linears; with them only the soft tokens are checked, since an element whose
value lies within bf16 rounding of a clip bound flips its clamp's 0/1 gradient mask, which on these tiny towers moves
whole gradients by up to ~2e-1 without anything being wrong.
Exit 77 (CTest's skip) when torch, transformers or safetensors is missing.
"""
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from oracle_env import missing_oracle  # noqa: E402

try:
    import torch
    import transformers
    from safetensors.torch import load_file, save_file
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration
except ImportError as e:  # pragma: no cover - depends on the environment
    missing_oracle(e)

REL_TOL = 1e-5
GRAD_TOL = 1e-4
BF16_FLOOR, BF16_TOL, BF16_GRAD_TOL = 1e-4, 2e-2, 5e-2
TEXT = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, global_head_dim=8, sliding_window=4,
            layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=0,
            vocab_size_per_layer_input=32, pad_token_id=0)
# name -> (vision_config, image grids (width, height) in patches)
CASES = {
    # pooling 2: a square, a wide and a small image; standardize and clipped linears.
    "k2_std_clip": (dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, head_dim=8, patch_size=4, position_embedding_size=16,
                         pooling_kernel_size=2, standardize=True, use_clipped_linears=True),
                    [(4, 4), (6, 2), (2, 2)]),
    # pooling 3, patch 2, GQA 4:2, two layers, clipped; a 6x3 image and a 3x3 one.
    "k3_gqa_clip": (dict(hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, patch_size=2, position_embedding_size=12,
                         pooling_kernel_size=3, standardize=False, use_clipped_linears=True),
                    [(6, 3), (3, 3)]),
    # pooling 1 (no pooling: the valid patches are the soft tokens), standardize, head_dim 16, rope_theta 50.
    "k1_std": (dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=1,
                    num_key_value_heads=1, head_dim=16, patch_size=3, position_embedding_size=8,
                    pooling_kernel_size=1, standardize=True, use_clipped_linears=False,
                    rope_parameters={"rope_type": "axial", "rope_theta": 50.0}),
               [(3, 2), (5, 1), (2, 2)]),
    # Big enough that every threaded pass of the encoder runs on several threads (its loops go parallel from 2^15
    # elements, its sgemms from 2^21 multiply-adds, ops.h): 1152 patches of hidden 64, clipped linears.
    "threaded": (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=32, patch_size=2, position_embedding_size=32,
                      pooling_kernel_size=2, standardize=False, use_clipped_linears=True),
                 [(24, 24), (20, 18)]),
}
# Threads of the second float32 run of every case, whose every output must have the same bits as the first's (run with
# CTest's OMP_NUM_THREADS = 1): the encoder splits no sum by thread (vision_encoder.h, ops.h).
THREADS = "2"


def randomize(tower, gen):
    with torch.no_grad():
        for name, p in tower.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
                if name.endswith(("q_norm.weight", "k_norm.weight")):  # O(1) logits, as in parity.py
                    p.mul_(p.shape[0] ** -0.25)
            elif name.endswith("position_embedding_table"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        for name, b in tower.named_buffers():
            if name.endswith(("input_min", "output_min")):  # bounds that clip a few percent of the values
                b.fill_(-1.2 - 0.3 * float(torch.rand((), generator=gen)))
            elif name.endswith(("input_max", "output_max")):
                b.fill_(1.2 + 0.3 * float(torch.rand((), generator=gen)))
            elif name.endswith("std_bias"):
                b.copy_(torch.randn(b.shape, generator=gen))
            elif name.endswith("std_scale"):
                b.copy_(1.0 + 0.2 * torch.randn(b.shape, generator=gen))


def reference(tower, pixels, pos):
    """Gemma4VisionModel's soft tokens. At pooling_kernel_size 1 transformers 5.24 keeps the wrong patches (its pooler
    returns the padding mask, True = padding, where the caller indexes with a validity mask), so there the reference
    is its own parts in its own order, indexed with the valid patches (docs/model-fidelity.md)."""
    if tower.config.pooling_kernel_size > 1:
        return tower(pixel_values=pixels, pixel_position_ids=pos).last_hidden_state
    padding = (pos == -1).all(dim=-1)
    h = tower.patch_embedder(pixels, pos, padding)
    h = tower.encoder(inputs_embeds=h, attention_mask=~padding, pixel_position_ids=pos).last_hidden_state
    h, _ = tower.pooler(hidden_states=h, pixel_position_ids=pos, padding_positions=padding,
                        output_length=pixels.shape[1])
    h = h[~padding]
    if tower.config.standardize:
        h = (h - tower.std_bias.float()) * tower.std_scale.float()
    return h.double()


def images(vcfg, grids, gen):
    k, patch = vcfg["pooling_kernel_size"], vcfg["patch_size"]
    longest = max(w * h for w, h in grids)
    P = -(-longest // (k * k)) * k * k  # padded to a whole number of pooling cells, as the processor does
    pixels = torch.zeros((len(grids), P, 3 * patch * patch))
    pos = torch.full((len(grids), P, 2), -1, dtype=torch.int64)
    for i, (w, h) in enumerate(grids):
        n = w * h
        pixels[i, :n] = torch.rand((n, 3 * patch * patch), generator=gen)
        pos[i, :n, 0] = torch.arange(n) % w
        pos[i, :n, 1] = torch.arange(n) // w
    return pixels, pos


def run(name, vision_case, work):
    vcfg, grids = CASES[name]
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    cfg = Gemma4Config(text_config=TEXT, vision_config=vcfg)
    cfg.vision_config._attn_implementation = "eager"
    model = Gemma4ForConditionalGeneration(cfg).float()
    tower = model.model.vision_tower
    tower.config._attn_implementation = "eager"
    randomize(tower, gen)
    ckpt = os.path.join(work, name)
    model.save_pretrained(ckpt)
    pixels, pos = images(vcfg, grids, gen)
    tower = tower.double()
    ref = reference(tower, pixels.double(), pos)
    # The backward: d loss / d soft tokens of a random linear loss sum(soft_tokens * R).
    R = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    (ref * R).sum().backward()
    ref = ref.detach()
    k = vcfg["pooling_kernel_size"]
    ref_counts = [(-(-w // k)) * (-(-h // k)) for w, h in grids]
    inputs, out = os.path.join(work, f"{name}_in.safetensors"), os.path.join(work, f"{name}_out.safetensors")
    save_file({"pixel_values": pixels.contiguous(), "pixel_position_ids": pos.to(torch.int32).contiguous(),
               "d_soft_tokens": R.float().contiguous()}, inputs)
    proc = subprocess.run([vision_case, ckpt, inputs, out], capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"FAIL {name}: vision_case: {proc.stderr.strip()}")
        return False
    got = load_file(out)
    out2 = os.path.join(work, f"{name}_threads.safetensors")
    proc = subprocess.run([vision_case, ckpt, inputs, out2], capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS=THREADS))
    if proc.returncode != 0:
        print(f"FAIL {name}: vision_case on {THREADS} threads: {proc.stderr.strip()}")
        return False
    got2 = load_file(out2)
    differ = sorted(k for k in got if k not in got2 or not torch.equal(got[k], got2[k]))
    if differ or len(got2) != len(got):
        print(f"FAIL {name}: {THREADS} threads change the bits of {differ[:4] or 'the set of outputs'}")
        return False
    counts = got["counts"].tolist()
    if counts != ref_counts or ref.shape[0] != sum(ref_counts):
        print(f"FAIL {name}: soft tokens per image {counts}, transformers {ref_counts} ({ref.shape[0]} in all)")
        return False
    err = float((got["soft_tokens"].double() - ref).norm() / ref.norm())
    if not err <= REL_TOL:
        print(f"FAIL {name}: soft tokens relative error {err:.2e} > {REL_TOL:.0e}")
        return False
    worst_grad, failures = 0.0, []
    for pname, p in tower.named_parameters():
        key = "grad.model.vision_tower." + pname
        if key not in got:
            failures.append(f"{key} missing")
            continue
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        gerr = float((got[key].double().reshape(g.shape) - g).norm() / max(float(g.norm()), 1e-300))
        worst_grad = max(worst_grad, gerr)
        if not gerr <= GRAD_TOL:
            failures.append(f"{key}: relative error {gerr:.2e}")
    extra = sorted(k for k in got if k.startswith("grad.")
                   and k[len("grad.model.vision_tower."):] not in dict(tower.named_parameters()))
    if extra:
        failures.append(f"gradients of non-parameters {extra[:4]}")
    if failures:
        print(f"FAIL {name}: " + "; ".join(failures[:6]))
        return False
    clipped = ""
    if vcfg["use_clipped_linears"]:
        # The bounds must matter: without them the reference moves far beyond the tolerance.
        with torch.no_grad():
            for b_name, b in tower.named_buffers():
                if b_name.endswith(("_min", "_max")):
                    b.fill_(float("inf") if b_name.endswith("_max") else float("-inf"))
            free = reference(tower, pixels.double(), pos)
        moved = float((free - ref).norm() / ref.norm())
        if not moved > 100 * REL_TOL:
            print(f"FAIL {name}: the clip bounds change the reference by only {moved:.1e}")
            return False
        clipped = f", clipping moves the tokens by {moved:.1e}"
    # The bf16 mode (VisionEncoder::set_compute_dtype): the same tower, images and loss with bf16 matmul operands.
    out16 = os.path.join(work, f"{name}_bf16.safetensors")
    proc = subprocess.run([vision_case, ckpt, inputs, out16, "bfloat16"], capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"FAIL {name}: vision_case bfloat16: {proc.stderr.strip()}")
        return False
    got16 = load_file(out16)
    err16 = float((got16["soft_tokens"].double() - ref).norm() / ref.norm())
    grad16 = 0.0
    for pname, p in tower.named_parameters() if not vcfg["use_clipped_linears"] else []:
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        d = got16["grad.model.vision_tower." + pname].double().reshape(g.shape) - g
        grad16 = max(grad16, float(d.norm() / max(float(g.norm()), 1e-300)))
    if not (BF16_FLOOR < err16 <= BF16_TOL and grad16 <= BF16_GRAD_TOL):
        print(f"FAIL {name}: bfloat16 soft tokens relative error {err16:.2e} outside ({BF16_FLOOR:.0e}, "
              f"{BF16_TOL:.0e}], or gradients {grad16:.2e} > {BF16_GRAD_TOL:.0e}")
        return False
    print(f"ok   {name:12s}: {len(grids)} images, {counts} soft tokens, relative error {err:.2e}, "
          f"{len(dict(tower.named_parameters()))} gradients within {worst_grad:.2e}{clipped}; "
          f"bfloat16 {err16:.2e}, " + ("gradients unchecked (clipped linears)" if vcfg["use_clipped_linears"]
                                        else f"gradients within {grad16:.2e}"))
    return True


def main():
    if len(sys.argv) != 2:
        print("usage: vision_parity.py PATH/TO/vision_case")
        return 2
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    ok = True
    with tempfile.TemporaryDirectory() as work:
        for name in CASES:
            ok = run(name, sys.argv[1], work) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
