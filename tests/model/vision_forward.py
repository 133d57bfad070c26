#!/usr/bin/env python3
"""`ringflex forward` from pixels: the checkpoint's vision tower, its projection and the decoder, against
transformers' Gemma4ForConditionalGeneration on the same pixels.

A tiny random Gemma4ForConditionalGeneration (a vision tower with clipped linears and standardize, pooling 2, and a
decoder with vision-bidirectional image groups; every weight moved off its init as tests/model/parity.py does) is
saved with save_pretrained. One batch: two rows, three images of different sizes (pixel_values padded to the
longest, image_position_ids with (-1, -1) padding), each image's soft tokens as a run of image slots in a packed row.
transformers runs the whole model in float64 (pixel_values, image_position_ids, the image token at the slots, the
docs/spec.md §3 masks of tests/common/spec_mask.py handed in as its {layer_type: mask} dict); ringflex runs
`ringflex forward` with pixel_values and image_position_ids in place of image_features, at P = 1 and, with a
launcher, over P ranks (the tower runs on every rank on the whole batch, before the rows are split); with
`--ranks P... -- MPIEXEC...` at each of those P against the one reference (tests/common/launchers.py).
Compared: the loss and the logits of every valid token, 1e-4 relative (parity.py's tolerance and reason: float32
against float64, rounding ~1e-7 per op amplified by depth; a wrong soft token moves the image slots' logits by 1e-2).
With `--vision-case PATH` (tests/model/vision_case: the encoder alone, VisionEncoder::set_compute_dtype as the
trainer sets it), `ringflex forward --compute-dtype bf16` from pixels runs its tower in bf16 too: its loss and logits
are the bits of the same command given the bf16 encoder's soft tokens as image_features (one thread each), and not
those of the float32 encoder's (which a float32 tower in the bf16 forward would give).
Exit 77 (CTest's skip) when torch, transformers or safetensors is missing.
"""
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "common"))
sys.path.insert(0, HERE)
from launchers import launchers, ranks_of  # noqa: E402
from oracle_env import missing_oracle  # noqa: E402

try:
    import torch
    import transformers
    from safetensors.torch import load_file, save_file
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    from parity import randomize
    from spec_mask import document_positions, spec_masks
except ImportError as e:  # pragma: no cover - depends on the environment
    missing_oracle(e)

REL_TOL = 1e-4
TEXT = dict(vocab_size=48, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, global_head_dim=16, sliding_window=5,
            layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=0,
            vocab_size_per_layer_input=48, pad_token_id=0, final_logit_softcapping=5.0,
            use_bidirectional_attention="vision")
VISION = dict(hidden_size=12, intermediate_size=20, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
              head_dim=8, patch_size=2, position_embedding_size=16, pooling_kernel_size=2, standardize=True,
              use_clipped_linears=True)
GRIDS = [(4, 4), (6, 2), (2, 4)]  # patch grids (width, height): 4, 3 and 2 soft tokens
B, S = 2, 24


def main():
    if len(sys.argv) < 2:
        print("usage: vision_forward.py PATH/TO/ringflex [--vision-case PATH] [LAUNCHER... | --ranks P... "
              "[-- MPIEXEC...]]")
        return 2
    ringflex, rest, vision_case = sys.argv[1], sys.argv[2:], None
    if rest[:1] == ["--vision-case"]:
        vision_case, rest = rest[1], rest[2:]
    runs = launchers(rest)
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    gen = torch.Generator().manual_seed(2024)
    cfg = Gemma4Config(text_config=TEXT, vision_config=VISION)
    model = Gemma4ForConditionalGeneration(cfg).float()
    randomize(model, gen)  # decoder, projection and tower off their init values
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith(("input_min", "output_min")):
                b.fill_(-1.5)
            elif name.endswith(("input_max", "output_max")):
                b.fill_(1.5)
            elif name.endswith("std_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=gen))
    # Images: each grid padded to the longest, row-major patches, positions (x, y).
    P = max(w * h for w, h in GRIDS)
    pixels = torch.zeros((len(GRIDS), P, 3 * VISION["patch_size"] ** 2))
    pos = torch.full((len(GRIDS), P, 2), -1, dtype=torch.int64)
    for i, (w, h) in enumerate(GRIDS):
        pixels[i, : w * h] = torch.rand((w * h, pixels.shape[-1]), generator=gen)
        pos[i, : w * h, 0] = torch.arange(w * h) % w
        pos[i, : w * h, 1] = torch.arange(w * h) // w
    k = VISION["pooling_kernel_size"]
    soft = [(w // k) * (h // k) for w, h in GRIDS]

    ids = torch.randint(1, TEXT["vocab_size"], (B, S), generator=gen)
    labels = torch.randint(0, TEXT["vocab_size"], (B, S), generator=gen)
    doc = torch.ones((B, S), dtype=torch.int64)
    doc[0, 12:] = 2        # row 0: two documents
    doc[1, 20:] = 0        # row 1: one document, then padding
    mm = torch.zeros((B, S), dtype=torch.int64)
    mm[0, 2:2 + soft[0]] = 1         # image 0 in document 1
    mm[0, 14:14 + soft[1]] = 1       # image 1 in document 2
    mm[1, 5:5 + soft[2]] = 1         # image 2
    labels[(doc == 0) | (mm > 0)] = -100
    position_ids = document_positions(doc)

    with tempfile.TemporaryDirectory() as work:
        ckpt = os.path.join(work, "ckpt")
        model.save_pretrained(ckpt)
        model = model.double()
        model.config._attn_implementation = "eager"
        for sub in (model.config.text_config, model.config.vision_config):
            sub._attn_implementation = "eager"
        tf_ids = torch.where(mm > 0, torch.full_like(ids, cfg.image_token_id), ids)
        with torch.no_grad():
            logits = model(input_ids=tf_ids, pixel_values=pixels.double(), image_position_ids=pos,
                           mm_token_type_ids=mm, position_ids=position_ids, use_cache=False,
                           attention_mask=spec_masks(model.config.text_config, doc, mm)).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, TEXT["vocab_size"]), labels.reshape(-1),
                                                 ignore_index=-100)

        batch = {"input_ids": ids.to(torch.int32), "labels": labels.to(torch.int32),
                 "position_ids": position_ids.to(torch.int32), "doc": doc.to(torch.int32),
                 "mm_token_type_ids": mm.to(torch.int32), "pixel_values": pixels.contiguous(),
                 "image_position_ids": pos.to(torch.int32).contiguous()}
        batch_path, out_path = os.path.join(work, "batch.safetensors"), os.path.join(work, "out.safetensors")
        bad_path = os.path.join(work, "bad.safetensors")
        save_file(batch, batch_path)
        # Bad pixel inputs: one line naming the batch file and the problem, on every rank.
        bad_cases = {
            "both": (dict(batch, image_features=torch.zeros((sum(soft), VISION["hidden_size"]))),
                     "give image_features or pixel_values, not both"),
            "width": (dict(batch, pixel_values=pixels[..., :-1].contiguous()), "values a patch, the tower's patch_size"),
            "position": (dict(batch, image_position_ids=torch.where(pos == 3, 99, pos).to(torch.int32)),
                         "outside [0, 16) (position_embedding_size)"),
        }
        for launcher in runs:
            where = f" over {' '.join(launcher)}" if launcher else ""
            proc = subprocess.run([*launcher, ringflex, "forward", "--model", ckpt, "--in", batch_path, "--out",
                                   out_path], capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"FAIL ringflex forward{where}: {proc.stderr.strip()}")
                return 1
            out = load_file(out_path)
            for what, (bad, expected) in bad_cases.items():
                save_file(bad, bad_path)
                proc = subprocess.run([*launcher, ringflex, "forward", "--model", ckpt, "--in", bad_path, "--out",
                                       out_path], capture_output=True, text=True)
                # One line per rank (mpirun adds its own report after them).
                lines = [line for line in proc.stderr.splitlines() if line.startswith("ringflex: error:")]
                if proc.returncode == 0 or len(lines) != ranks_of(launcher) or any(
                        expected not in line or bad_path not in line for line in lines):
                    print(f"FAIL bad pixels ({what}){where}: rc {proc.returncode}, stderr {proc.stderr.strip()!r}")
                    return 1
            valid = doc > 0
            errs = {"loss": float(abs(out["loss"].double() - loss) / abs(loss)),
                    "logits": float((out["logits"][valid].double() - logits[valid]).norm() / logits[valid].norm())}
            if any(not e <= REL_TOL for e in errs.values()):
                print(f"FAIL forward from pixels{where}: relative errors {errs}")
                return 1
            print(f"ok   forward from pixels{where}: {len(GRIDS)} images ({soft} soft tokens), "
                  f"loss {float(loss):.6f}, relative errors loss {errs['loss']:.1e}, logits {errs['logits']:.1e}")
        if vision_case is not None:
            return bf16_tower(ringflex, vision_case, ckpt, batch, pixels, pos, work)
    return 0


def bf16_tower(ringflex, vision_case, ckpt, batch, pixels, pos, work):
    """forward --compute-dtype bf16 from pixels against the same command on the encoder's soft tokens (one rank)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    images_path = os.path.join(work, "images.safetensors")
    save_file({"pixel_values": pixels.contiguous(), "pixel_position_ids": pos.to(torch.int32).contiguous()},
              images_path)
    text = {k: v for k, v in batch.items() if k not in ("pixel_values", "image_position_ids")}
    outs = {}
    for name, tower in (("pixels", None), ("bf16 tower", "bfloat16"), ("float32 tower", "float32")):
        in_path = os.path.join(work, f"bf16_{name.replace(' ', '_')}.safetensors")
        if tower is None:
            save_file(batch, in_path)
        else:
            soft_path = os.path.join(work, f"soft_{tower}.safetensors")
            proc = subprocess.run([vision_case, ckpt, images_path, soft_path, tower], capture_output=True, text=True,
                                  env=env)
            if proc.returncode != 0:
                print(f"FAIL vision_case {tower}: {proc.stderr.strip()}")
                return 1
            save_file(dict(text, image_features=load_file(soft_path)["soft_tokens"]), in_path)
        out_path = os.path.join(work, "bf16_out.safetensors")
        proc = subprocess.run([ringflex, "forward", "--model", ckpt, "--in", in_path, "--out", out_path,
                               "--compute-dtype", "bf16"], capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            print(f"FAIL ringflex forward --compute-dtype bf16 ({name}): {proc.stderr.strip()}")
            return 1
        outs[name] = load_file(out_path)
    same = all(torch.equal(outs["pixels"][k], outs["bf16 tower"][k]) for k in ("loss", "logits"))
    if not same:
        print("FAIL forward --compute-dtype bf16 from pixels: not the bits of the bf16 encoder's soft tokens")
        return 1
    if torch.equal(outs["pixels"]["logits"], outs["float32 tower"]["logits"]):
        print("FAIL forward --compute-dtype bf16 from pixels: the bits of the float32 encoder's soft tokens")
        return 1
    print(f"ok   forward --compute-dtype bf16 from pixels: the bf16 encoder's soft tokens' loss and logits, bit for "
          f"bit (loss {float(outs['pixels']['loss']):.6f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
