#!/usr/bin/env python3
"""Random multimodal checkpoints made by transformers, trained by ringflex, checked against transformers.

Each seed draws a Gemma4ForConditionalGeneration (random small configs, float32 or bfloat16 files, the processor,
tokenizer and chat template files beside them) and a handful of image files, then checks what a user of such a
checkpoint relies on:
  draw    vision tower: hidden size, heads and KV heads, head dim, patch size, pooling kernel (2 or 3: at 1,
          transformers 5.24's pooler keeps the wrong patches, docs/model-fidelity.md), position table (at least the
          widest grid the images make), layers, standardize, clipped linears, the soft-token budget per image (the
          image processor's max_soft_tokens, saved as processor_config.json or preprocessor_config.json, and given
          to ringflex as data.image_soft_tokens or left to its default, that file); an audio tower or none; the text
          decoder dense or MoE, per-layer inputs or not, tied or untied embeddings, vision-bidirectional attention or
          not. Images: tiny, 1 x N and N x 1, huge ones the processor shrinks; RGB, RGBA with transparent pixels, grey,
          grey + alpha, 1-bit, palette (with a transparent index), 16-bit RGB and grey, JPEG (grey and colour, one with
          an EXIF orientation). One to three samples of one to three images each at random places in their text,
          packed into rows of a random length, so that images cross the CP ranks' boundaries at P = 2 and 3.
  images  tests/model/image_case (ringflex's decoding and preprocessing) against Gemma4ImageProcessorPil on the
          image transformers reads from the same file (train_vision.load_rgb): the soft-token counts and positions
          exactly, the pixel values bit for bit for PNGs and within image_parity.py's JPEG bound;
  frozen  `ringflex train` (one step over all the rows, the tower frozen, images from the files) at cp = 1 and
          cp = P: the loss and label count against transformers' float64 loss of the same samples (train_vision.py's
          reference, label-weighted over the samples), the vision projection's gradient (AdamW's first moment with
          grad_clip 0), and the written checkpoint: transformers loads it with no missing, unexpected or mismatched
          keys, every tower tensor kept bit for bit (towers_kept.py's checks), config.json and the side files carried
          over unchanged;
  trained model.train_vision at cp = P: the same, and every tower parameter's gradient;
  spans   precomputed features (`image_spans` and data.features) at cp = P: the loss against transformers' with
          the same features through its embed_vision;
  shard   with an audio tower, cp = 2 under parallelism.shard = full: the towers come back bit for bit and
          from_pretrained on the output holds them unchanged.
Tolerances are the owning tests': losses 1e-4 relative (tests/model/parity.py: float32 against float64, rounding
~1e-7 a step amplified by depth; measured ~1e-7), gradients 1e-4 in relative norm (tests/model/vision_parity.py;
measured ~1e-5 at most). With clipped linears, a rare draw puts a value within float32 rounding of a clip bound, where
float32 and float64 take the clamp's 0/1 gradient differently (tests/model/vision_parity.py says the same of bf16): the
tower's gradients then miss by ~1e-4 to 1e-3 with the loss still at ~1e-8 (seed 219: one value of 2.6 million within
1e-6 of its bound, gradients within 6e-4). Such a seed is that, not a bug, when the count of such values is not zero.

By hand, many seeds (~5 s each):  random_multimodal.py RINGFLEX IMAGE_CASE MPIEXEC... --seeds 0-99
CTest runs three fixed seeds (tests/trainer/CMakeLists.txt). A failing seed prints what failed and keeps its work
folder. Exit 77 (CTest's skip) when torch, transformers, Pillow or safetensors is missing.
"""
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "common"))
sys.path.insert(0, os.path.join(HERE, "..", "model"))
sys.path.insert(0, HERE)
from oracle_env import missing_oracle  # noqa: E402

try:
    import numpy as np
    import torch
    import transformers
    from PIL import Image
    from safetensors.torch import load_file, save_file
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration
    from transformers.modeling_outputs import BaseModelOutputWithPooling
    from transformers.models.gemma4.image_processing_pil_gemma4 import (Gemma4ImageProcessorPil,
                                                                        get_aspect_ratio_preserving_size)

    from image_parity import JPEG_MAX_DIFF, smooth
    from images_train import BOI, EOI, IMAGE
    from parity import randomize
    from spec_mask import spec_masks
    from towers_kept import AUDIO, add_side_files, check_carried, check_loads, check_side_files, tensors
    from train_vision import BETA1, LOSS_TOL, compare_grads, load_rgb, reference
    from vision_parity import randomize as randomize_tower
except ImportError as e:  # pragma: no cover - depends on the environment
    missing_oracle(e)

VOCAB = 64
def draw_images(rng, work):
    """2 to 4 image files of random kinds under work/img: [(path, kind)]."""
    os.makedirs(os.path.join(work, "img"), exist_ok=True)
    out = []
    for i in range(rng.randint(2, 4)):
        shape = rng.choice(["tiny", "thin", "huge", "plain", "plain"])
        w, h = {"tiny": lambda: (rng.randint(1, 6), rng.randint(1, 6)),
                "thin": lambda: (1, rng.randint(20, 300)) if rng.random() < 0.5 else (rng.randint(20, 300), 1),
                "huge": lambda: (rng.randint(900, 1800), rng.randint(700, 1400)),
                "plain": lambda: (rng.randint(7, 90), rng.randint(7, 90))}[shape]()
        kind = rng.choice(["rgb", "rgba", "grey", "grey_alpha", "bits", "palette", "palette_trns", "rgb16", "grey16",
                           "jpeg", "jpeg_grey", "jpeg_exif"])
        px = smooth(w, h, rng.randint(0, 10**6))
        seed = rng.randint(0, 10**6)
        name = os.path.join(work, "img", f"{i}_{shape}_{kind}_{w}x{h}." + ("jpg" if kind.startswith("jpeg") else "png"))
        if kind == "rgb":
            Image.fromarray(px).save(name)
        elif kind == "rgba":
            alpha = np.random.default_rng(seed).integers(0, 256, (h, w, 1), np.uint8)
            alpha[: max(1, h // 3), : max(1, w // 2)] = 0
            Image.fromarray(np.concatenate([px, alpha], -1), "RGBA").save(name)
        elif kind == "grey":
            Image.fromarray(px[..., 0]).save(name)
        elif kind == "grey_alpha":
            alpha = np.random.default_rng(seed).integers(0, 256, (h, w), np.uint8)
            Image.fromarray(np.stack([px[..., 0], alpha], -1), "LA").save(name)
        elif kind == "bits":
            Image.fromarray(px[..., 0] > 128).save(name)
        elif kind == "palette":
            Image.fromarray(px).quantize(rng.randint(2, 40)).save(name)
        elif kind == "palette_trns":
            Image.fromarray(px).quantize(12).save(name, transparency=rng.randint(0, 11))
        elif kind == "rgb16":
            wide = px.astype(np.uint16) * 257 + 31
            Image.frombytes("RGB", (w, h), wide.astype(">u2").tobytes(), "raw", "RGB;16B").save(name)
        elif kind == "grey16":
            Image.fromarray(px[..., 0].astype(np.uint16) * 257 + 3).save(name)  # mode I;16
        elif kind == "jpeg":
            Image.fromarray(px).save(name, quality=rng.choice([75, 90, 95]), subsampling=rng.choice([0, 2]))
        elif kind == "jpeg_grey":
            Image.fromarray(px[..., 0]).save(name, quality=90)
        else:
            exif = Image.Exif()
            exif[0x0112] = rng.randint(2, 8)  # Orientation: every transform but the identity
            Image.fromarray(px).save(name, quality=90, exif=exif.tobytes())
        out.append((name, f"{shape} {kind} {w}x{h}"))
    return out


def draw(seed, work):
    rng = random.Random(seed)
    images = draw_images(rng, work)
    k, patch = rng.choice([2, 3]), rng.choice([2, 3, 4])
    # The processor pads every image to soft * k^2 patches and transformers' eager float64 tower holds [heads, P, P]
    # attention weights (and their gradients) per image: P stays at most 2520 (~1 GB at 4 heads), so 1120 and 560 at
    # k = 3 are left to tests/model/image_parity.py's preprocessing check.
    soft = rng.choice([70, 140, 280, 280] + ([560, 560] if k == 2 else []))
    longest = 0
    for path, _ in images:
        with Image.open(path) as im:
            w, h = im.size
        try:
            th, tw = get_aspect_ratio_preserving_size(h, w, patch, soft * k * k, k)
        except ValueError:
            continue  # refused by the processor: ringflex must refuse it too (checked in check_images)
        longest = max(longest, th // patch, tw // patch)
    heads = rng.choice([1, 2, 4])
    vision = dict(hidden_size=rng.choice([8, 12, 16, 24]), intermediate_size=rng.choice([16, 24, 40]),
                  num_hidden_layers=rng.choice([1, 2]), num_attention_heads=heads,
                  num_key_value_heads=rng.choice([d for d in (1, 2, 4) if heads % d == 0]),
                  head_dim=rng.choice([4, 8, 12, 16]), patch_size=patch, pooling_kernel_size=k,
                  position_embedding_size=longest + rng.randint(0, 6), standardize=rng.random() < 0.5,
                  use_clipped_linears=rng.random() < 0.5)
    text = dict(vocab_size=VOCAB, hidden_size=rng.choice([16, 32]), intermediate_size=24, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=8, global_head_dim=16,
                sliding_window=rng.choice([4, 16, 512]), layer_types=["sliding_attention", "full_attention"],
                hidden_size_per_layer_input=rng.choice([0, 0, 4]), vocab_size_per_layer_input=VOCAB, pad_token_id=0,
                final_logit_softcapping=rng.choice([None, 30.0]),
                use_bidirectional_attention=rng.choice(["vision", None]))
    if rng.random() < 0.4:
        text.update(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=8)
    return dict(seed=seed, vision=vision, text=text, audio=AUDIO if rng.random() < 0.5 else None,
                tied=rng.random() < 0.5, soft=soft, images=images, P=rng.choice([2, 3]),
                bf16=rng.random() < 0.3,
                processor_file=rng.choice(["processor_config.json", "preprocessor_config.json"]),
                soft_given=rng.random() < 0.5, rng=rng)


def make_checkpoint(d, work):
    torch.manual_seed(d["seed"])
    gen = torch.Generator().manual_seed(d["seed"])
    cfg = Gemma4Config(text_config=d["text"], vision_config=d["vision"], audio_config=d["audio"],
                       image_token_id=IMAGE, boi_token_id=BOI, eoi_token_id=EOI, tie_word_embeddings=d["tied"])
    model = Gemma4ForConditionalGeneration(cfg).float()
    randomize(model, gen)
    randomize_tower(model.model.vision_tower, gen)
    if d["bf16"]:  # as released checkpoints are: every tower tensor must come back in bf16, bit for bit
        model = model.to(torch.bfloat16)
    ckpt = os.path.join(work, "input")
    model.save_pretrained(ckpt)
    add_side_files(ckpt)
    # The model's own image processor beside it, as transformers 5 saves a processor (processor_config.json) or an
    # image processor alone (preprocessor_config.json): data.image_soft_tokens defaults to its max_soft_tokens.
    v = d["vision"]
    image_processor = Gemma4ImageProcessorPil(patch_size=v["patch_size"], pooling_kernel_size=v["pooling_kernel_size"],
                                              max_soft_tokens=d["soft"])
    if d["processor_file"] == "processor_config.json":
        with open(os.path.join(ckpt, "processor_config.json"), "w") as f:
            json.dump({"image_processor": image_processor.to_dict(), "processor_class": "Gemma4Processor"}, f, indent=2)
    else:
        image_processor.save_pretrained(ckpt)
    # The reference from the files (the rotary tables made afresh in float64, not cast to the saved dtype and back).
    model = Gemma4ForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float64)
    for c in (model.config, model.config.text_config, model.config.vision_config):
        c._attn_implementation = "eager"
        c._experts_implementation = "eager"  # the reference loop (grouped_mm has no float64)
    return model, ckpt


def check_images(d, image_case, work, failures):
    """ringflex's decode + preprocessing of every image against the processor's (EXIF orientation applied)."""
    v = d["vision"]
    processor = Gemma4ImageProcessorPil(patch_size=v["patch_size"], pooling_kernel_size=v["pooling_kernel_size"],
                                        max_soft_tokens=d["soft"])
    usable = []
    for path, what in d["images"]:
        out = os.path.join(work, "image_case.safetensors")
        proc = subprocess.run([image_case, str(v["patch_size"]), str(v["pooling_kernel_size"]), str(d["soft"]), out,
                               path], capture_output=True, text=True)
        try:
            ref = processor(images=[load_rgb(path)], return_tensors="np")
        except ValueError as e:
            if proc.returncode == 0:
                failures.append(f"image {what}: the processor refuses it ({e}), ringflex does not")
            elif not proc.stderr.startswith(path + ": "):
                failures.append(f"image {what}: refused without naming the file: {proc.stderr.strip()!r}")
            continue
        if proc.returncode != 0:
            failures.append(f"image {what}: image_case failed: {proc.stderr.strip()}")
            continue
        got = load_file(out)
        soft = int(got["image.0.soft_tokens"][0].item())
        if soft != int(ref["num_soft_tokens_per_image"][0]) or not np.array_equal(
                got["image.0.position_ids"].numpy(), ref["image_position_ids"][0]):
            failures.append(f"image {what}: {soft} soft tokens or positions, processor "
                            f"{int(ref['num_soft_tokens_per_image'][0])}")
            continue
        delta = float(np.abs(got["image.0.pixel_values"].double().numpy() - ref["pixel_values"][0]).max()) * 255
        bound = JPEG_MAX_DIFF + 1e-3 if path.endswith(".jpg") else 1e-9
        if delta > bound:
            failures.append(f"image {what}: pixel values differ by up to {delta:.3f} / 255")
            continue
        usable.append((path, what, soft))
    return usable


def train(ringflex, launcher, work, name, sets):
    cmd = [*launcher, ringflex, "train", "--metrics", os.path.join(work, name + ".jsonl")]
    for s in [f"checkpoint.dir={os.path.join(work, name)}", "checkpoint.every=1", "train.steps=1",
              "train.global_batch=1", "train.micro_batch=1", "train.threads=1", "train.val_every=0",
              "data.val_rows=0", "optimizer.grad_clip=0", f"optimizer.beta1={BETA1}", "schedule.warmup_steps=1"] + sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode != 0:
        raise RuntimeError(f"ringflex train {name} failed: {proc.stderr.strip()[-2000:]}")
    with open(os.path.join(work, name + ".jsonl")) as f:
        metrics = [json.loads(x) for x in f]
    return metrics, os.path.join(work, name, "step-00000001")


def soft_sets(d):
    """data.image_soft_tokens given, or left to its default: the checkpoint's processor file's max_soft_tokens."""
    return [f"data.image_soft_tokens={d['soft']}"] if d["soft_given"] else []


def sample(d, usable):
    """A row's input_ids: random text with the usable images' placeholders at random places."""
    rng = d["rng"]
    ids = [rng.randint(8, VOCAB - 1) for _ in range(rng.randint(4, 30))]
    chosen = [usable[rng.randrange(len(usable))] for _ in range(rng.randint(1, min(3, 2 * len(usable))))]
    for _ in chosen:
        ids.insert(rng.randint(0, len(ids)), IMAGE)
    return ids, chosen


def check_output(d, source, out, failures, what, trained=()):
    """The written checkpoint loads whole in transformers, keeps the input's towers (but the `trained` parameters)
    and side files."""
    sub = []
    _, weights = check_loads(out, sub)
    carried = []
    check_carried(source, weights, carried)
    sub += [x for x in carried if x.split(":")[0] not in trained]
    check_side_files(source, out, sub)
    failures.extend(f"{what}: {x}" for x in sub)


def row_len(ids, chosen):
    """The tokens of a sample after expansion: each placeholder becomes boi, the image's soft slots, eoi."""
    return len(ids) + sum(s + 1 for _, _, s in chosen)


def labelled(ids, chosen):
    """The label tokens of a sample after expansion (each image: boi, soft slots without labels, eoi), shifted."""
    return row_len(ids, chosen) - 1 - sum(s for _, _, s in chosen)


def check_frozen_and_trained(d, ringflex, mpiexec, model, ckpt, usable, work, failures):
    """1 to 3 samples packed into rows of a random length (next-fit, as the data source packs them), all the rows in
    one step: the loss and gradients are the label-weighted means of transformers' per-sample ones."""
    rng = d["rng"]
    docs = [sample(d, usable) for _ in range(rng.randint(1, 3))]
    lengths = [row_len(ids, chosen) for ids, chosen in docs]
    seq = 6 * math.ceil(rng.uniform(max(lengths), sum(lengths) + 6) / 6)
    rows, used = 1, 0
    for n in lengths:
        if used + n > seq:
            rows, used = rows + 1, 0
        used += n
    data = os.path.join(work, "row.jsonl")
    with open(data, "w") as f:
        for ids, chosen in docs:
            f.write(json.dumps({"input_ids": ids, "images": [p for p, _, _ in chosen]}) + "\n")
    v = d["vision"]
    processor = Gemma4ImageProcessorPil(patch_size=v["patch_size"], pooling_kernel_size=v["pooling_kernel_size"],
                                        max_soft_tokens=d["soft"])
    total = sum(labelled(ids, chosen) for ids, chosen in docs)
    ref_loss, ref_grads = 0.0, {}
    for ids, chosen in docs:
        loss, grads = reference(model, ids, [p for p, _, _ in chosen], processor)
        w = labelled(ids, chosen) / total
        ref_loss += w * loss
        for name, g in grads.items():
            ref_grads[name] = ref_grads.get(name, 0) + w * g
    P = d["P"]
    base = [f"model.path={ckpt}", "data.source=jsonl_tokens", f"data.path={data}",
            f"train.seq_len={seq}", f"train.global_batch={rows}"] + soft_sets(d)
    layout = (f"rows of {seq}: " + "; ".join(f"{len(ids)} tokens, images {[w for _, w, _ in chosen]} "
                                             f"({[s for _, _, s in chosen]} soft tokens)" for ids, chosen in docs))
    for launcher, cp, name, vision in (([], 1, "frozen_cp1", False), ([*mpiexec, "-n", str(P)], P, "frozen", False),
                                       ([*mpiexec, "-n", str(P)], P, "trained", True)):
        what = f"{name} cp {cp}"
        try:
            metrics, out = train(ringflex, launcher, work, name,
                                 base + [f"parallelism.cp={cp}", f"model.train_vision={str(vision).lower()}"])
        except RuntimeError as e:
            failures.append(f"{what}: {e} [{layout}]")
            continue
        rel = abs(metrics[0]["loss"] - ref_loss) / abs(ref_loss)
        if not rel <= LOSS_TOL or metrics[0]["tokens"] != total:
            failures.append(f"{what}: loss {metrics[0]['loss']} on {metrics[0]['tokens']} tokens, transformers "
                            f"{ref_loss} on {total} (relative {rel:.1e}) [{layout}]")
        prefixes = ("model.embed_vision.", "model.vision_tower.") if vision else ("model.embed_vision.",)
        worst, checked = compare_grads(what, out, ref_grads, prefixes, failures)
        if checked == 0:
            failures.append(f"{what}: no gradient compared")
        check_output(d, ckpt, out, failures, what,
                     [n for n in ref_grads if n.startswith("model.vision_tower.")] if vision else ())
        print(f"       {what}: {len(docs)} samples in {rows} rows, loss relative {rel:.1e}, {checked} gradients "
              f"within {worst:.1e}")


def check_spans(d, ringflex, mpiexec, model, ckpt, work, failures):
    """Precomputed features: image_spans over random slots, the loss against transformers with the same features."""
    rng, gen = d["rng"], torch.Generator().manual_seed(d["seed"])
    n = rng.randint(10, 40)
    ids = [rng.randint(8, VOCAB - 1) for _ in range(n)]
    spans, at = [], rng.randint(0, 3)
    while at < n - 1 and len(spans) < 3:
        length = rng.randint(1, min(8, n - at))
        spans.append([at, length])
        at += length + rng.randint(1, 6)
    mm = torch.zeros((1, n), dtype=torch.int64)
    for s, length in spans:
        mm[0, s:s + length] = 1
    F = d["vision"]["hidden_size"]
    feats = torch.randn((int(mm.sum()), F), generator=gen)
    data, fpath = os.path.join(work, "spans.jsonl"), os.path.join(work, "features.safetensors")
    with open(data, "w") as f:
        f.write(json.dumps({"input_ids": ids, "image_spans": spans}) + "\n")
    save_file({"image_features": feats.contiguous()}, fpath)
    text_cfg = model.config.text_config
    x = torch.tensor([ids])
    labels = torch.where(mm > 0, -100, x)
    with torch.no_grad():
        features = BaseModelOutputWithPooling(pooler_output=(model.model.embed_vision(feats.double()),))
        logits = model(input_ids=torch.where(mm > 0, IMAGE, x), mm_encoder_outputs={"image": features},
                       position_ids=torch.arange(n)[None], use_cache=False,
                       attention_mask=spec_masks(text_cfg, torch.ones_like(x), mm)).logits
    ref = float(torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100))
    P = d["P"]
    try:
        metrics, out = train(ringflex, [*mpiexec, "-n", str(P)], work, "spans",
                             [f"model.path={ckpt}", "data.source=jsonl_tokens", f"data.path={data}",
                              f"data.features={fpath}", f"train.seq_len={6 * math.ceil(n / 6)}",
                              f"parallelism.cp={P}"])
    except RuntimeError as e:
        failures.append(f"spans cp {P}: {e}")
        return
    rel = abs(metrics[0]["loss"] - ref) / abs(ref)
    if not rel <= LOSS_TOL:
        failures.append(f"spans cp {P}: loss {metrics[0]['loss']}, transformers {ref} (relative {rel:.1e}), "
                        f"spans {spans} of {n}")
    print(f"       spans cp {P}: loss relative {rel:.1e}")


def check_shard_full(d, ringflex, mpiexec, ckpt, usable, work, failures):
    """cp 2 under parallelism.shard = full: every tower and audio tensor back bit for bit, from_pretrained agrees."""
    ids, chosen = sample(d, usable)
    data = os.path.join(work, "shard.jsonl")
    with open(data, "w") as f:
        f.write(json.dumps({"input_ids": ids, "images": [p for p, _, _ in chosen]}) + "\n")
    try:
        _, out = train(ringflex, [*mpiexec, "-n", "2"], work, "shard_full",
                       [f"model.path={ckpt}", "data.source=jsonl_tokens", f"data.path={data}",
                        f"train.seq_len={6 * math.ceil(row_len(ids, chosen) / 6)}", "parallelism.cp=2",
                        "parallelism.shard=full"] + soft_sets(d))
    except RuntimeError as e:
        failures.append(f"shard full cp 2: {e}")
        return
    check_output(d, ckpt, out, failures, "shard full cp 2")
    loaded = Gemma4ForConditionalGeneration.from_pretrained(out, dtype=torch.float32)
    source = tensors(ckpt)
    state = loaded.state_dict()
    differ = [n for n, t in source.items() if n.startswith(("model.audio_tower.", "model.embed_audio.",
                                                            "model.vision_tower."))
              and (n not in state or not torch.equal(state[n], t.to(state[n].dtype)))]
    if differ:
        failures.append(f"shard full cp 2: from_pretrained holds other values for {differ[:4]}")


def run_seed(seed, ringflex, image_case, mpiexec, root):
    work = os.path.join(root, f"seed{seed}")
    os.makedirs(work)
    d = draw(seed, work)
    v, t = d["vision"], d["text"]
    print(f"seed {seed}: vision hidden {v['hidden_size']} heads {v['num_attention_heads']}/{v['num_key_value_heads']}"
          f" dim {v['head_dim']} patch {v['patch_size']} k {v['pooling_kernel_size']} pos "
          f"{v['position_embedding_size']} layers {v['num_hidden_layers']} std {v['standardize']} clip "
          f"{v['use_clipped_linears']}; soft {d['soft']}; audio {d['audio'] is not None}; text hidden "
          f"{t['hidden_size']} moe {t.get('enable_moe_block', False)} ple {t['hidden_size_per_layer_input']} tied "
          f"{d['tied']} bidi {t['use_bidirectional_attention']}; bf16 {d['bf16']}; {d['processor_file']}, soft given "
          f"{d['soft_given']}; P {d['P']}")
    failures = []
    model, ckpt = make_checkpoint(d, work)
    usable = check_images(d, image_case, work, failures)
    if usable:
        check_frozen_and_trained(d, ringflex, mpiexec, model, ckpt, usable, work, failures)
        if d["audio"] is not None:
            check_shard_full(d, ringflex, mpiexec, ckpt, usable, work, failures)
    check_spans(d, ringflex, mpiexec, model, ckpt, work, failures)
    if failures:
        for f in failures:
            print(f"FAIL seed {seed}: {f}")
        print(f"     work kept in {work}")
        return False
    shutil.rmtree(work)
    print(f"ok   seed {seed}: {len(usable)} of {len(d['images'])} images usable")
    return True


def seeds_of(words):
    out = []
    for w in words:
        a, _, b = w.partition("-")
        out += list(range(int(a), int(b) + 1)) if b else [int(a)]
    return out


def main():
    args = sys.argv[1:]
    if len(args) < 3:
        print("usage: random_multimodal.py RINGFLEX IMAGE_CASE MPIEXEC... [--seeds N|A-B ...]")
        return 2
    seeds = [0, 1, 2]
    if "--seeds" in args:
        at = args.index("--seeds")
        seeds, args = seeds_of(args[at + 1:]), args[:at]
    ringflex, image_case, mpiexec = args[0], args[1], args[2:]
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    root = tempfile.mkdtemp(prefix="rf_random_mm_")
    ok = True
    for seed in seeds:
        ok = run_seed(seed, ringflex, image_case, mpiexec, root) and ok
    if ok:
        shutil.rmtree(root)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
