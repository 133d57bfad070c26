#!/usr/bin/env python3
"""model.train_vision: the vision tower trains, from image files, against transformers in float64.

The tiny Gemma4ForConditionalGeneration and PNG images of tests/trainer/images_train.py (a tower of patch 2 and
pooling 2, images of odd sizes, RGB and grey with alpha). Then
  1. one step on one row holding two images (jsonl_tokens `images`; optimizer.grad_clip = 0, so AdamW's first moment
     after step 1 is (1 - beta1) times the unclipped gradient, read from the checkpoint's optimizer.safetensors):
     the loss and the gradient of every tower parameter and of the vision projection against transformers' loss on
     the same sample in float64 (the processor's pixel_values and image_position_ids, the placeholder expanded to
     boi, soft tokens, eoi, labels ignored on the image slots, the docs/spec.md masks of tests/common/spec_mask.py),
     at cp = 1 and at cp = 2 (each rank back-propagates its own tokens' share of d image_features through the tower;
     the reduction sums them). Bounds: the loss 1e-4 relative (parity.py's: float32 against float64, rounding ~1e-7
     per op amplified by depth), each gradient 1e-4 in relative norm (tests/model/vision_parity.py's bound; here the
     decoder's backward comes first, still ~1e-5 measured; a gradient that missed a rank's share or an image is
     off by O(1));
     The same with model.param_dtype = bfloat16 (the tower's and the decoder's parameters store slots, run from
     their bf16 working copy) against transformers on the parameters rounded to bf16 (the masters' rounding is the
     only difference; the bounds above, for the same float32-against-float64 reasons);
  2. three steps on ten samples at cp = 1 and cp = 2 give the same losses (1e-4 relative, as images_train.py), the
     tower's weights moved, and the checkpoint loads in transformers with no missing or unexpected weights;
  3. a run resumed from step 2 ends on the same loss and the same checkpoint bits as the run that went through.
Exit 77 (CTest's skip) when torch, transformers or safetensors is missing.
"""
import copy
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "common"))
sys.path.insert(0, HERE)
from oracle_env import missing_oracle  # noqa: E402

try:
    import torch
    from PIL import Image, ImageOps
    from safetensors.torch import load_file
    from transformers.image_transforms import convert_to_rgb
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    from images_train import (BOI, EOI, IMAGE, VISION, expect_loads_in_transformers, expect_same_losses,
                              tiny_checkpoint_and_images, write_samples)
    from spec_mask import spec_masks
except ImportError as e:  # pragma: no cover - depends on the environment
    missing_oracle(e)

LOSS_TOL, GRAD_TOL = 1e-4, 1e-4
SOFT = 70
BETA1 = 0.9
SEQ = 192


def run(ringflex, launcher, work, name, sets, steps, extra=()):
    ranks = ["parallelism.cp=2"] if launcher else ["parallelism.cp=1"]
    common = ["data.source=jsonl_tokens", f"data.image_soft_tokens={SOFT}", f"train.seq_len={SEQ}",
              f"train.steps={steps}", "train.micro_batch=1", "train.threads=1", "train.val_every=0",
              "optimizer.lr=0.003", "schedule.warmup_steps=1", f"optimizer.beta1={BETA1}", "model.train_vision=true",
              f"checkpoint.dir={os.path.join(work, name)}", "checkpoint.every=1", "checkpoint.keep=5"]
    cmd = [*launcher, ringflex, "train", "--metrics", os.path.join(work, name + ".jsonl"), *extra]
    for s in common + ranks + sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode != 0:
        raise RuntimeError(f"ringflex train {name} failed: {proc.stderr.strip()}")
    return [json.loads(x) for x in open(os.path.join(work, name + ".jsonl"))]


def load_rgb(path):
    """An image file's RGB pixels as transformers' processor starts from them: upright (the EXIF orientation applied,
    as its load_image does with a file), transparency composited onto white (convert_to_rgb)."""
    return convert_to_rgb(ImageOps.exif_transpose(Image.open(path)))


def reference(model, ids, images, processor):
    """transformers' float64 loss and gradients of one sample: the placeholders expanded as Gemma4Processor does."""
    feats = processor([load_rgb(p) for p in images], return_tensors="pt")
    counts = [int(n) for n in feats["num_soft_tokens_per_image"]]
    expanded, labels, k = [], [], 0
    for t in ids:
        if t != IMAGE:
            expanded.append(t)
            labels.append(t)
            continue
        expanded += [BOI] + [IMAGE] * counts[k] + [EOI]
        labels += [BOI] + [-100] * counts[k] + [EOI]
        k += 1
    x = torch.tensor([expanded])
    mm = (x == IMAGE).long()
    doc = torch.ones_like(x)
    model.zero_grad()
    logits = model(input_ids=x, pixel_values=feats["pixel_values"].double(),
                   image_position_ids=feats["image_position_ids"], mm_token_type_ids=mm,
                   position_ids=torch.arange(x.shape[1])[None], use_cache=False,
                   attention_mask=spec_masks(model.config.text_config, doc, mm)).logits
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], torch.tensor(labels[1:]), ignore_index=-100)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def compare_grads(what, ckpt_dir, ref_grads, prefixes, failures, missing_why=""):
    """Each reference gradient of a parameter named with one of `prefixes` against the one step's gradient read from
    the checkpoint's first AdamW moment (exp_avg = (1 - beta1) g after one step); returns the worst relative error and
    how many were compared, appending each failure."""
    moments = load_file(os.path.join(ckpt_dir, "optimizer.safetensors"))
    worst, checked = 0.0, 0
    for pname, g in ref_grads.items():
        if not pname.startswith(prefixes):
            continue
        key = "exp_avg." + pname
        if key not in moments:
            failures.append(f"{what}: no moment {key}{missing_why}")
            continue
        got = moments[key].double().reshape(g.shape) / (1 - BETA1)
        err = float((got - g).norm() / max(float(g.norm()), 1e-300))
        worst, checked = max(worst, err), checked + 1
        if not err <= GRAD_TOL:
            failures.append(f"{what}: gradient of {pname}: relative error {err:.2e}")
    return worst, checked


def check_one_step(ringflex, mpiexec, work, ckpt, names, model, failures, param_dtype="float32"):
    ids = [9, 10, IMAGE, 11, 12, 13, 14, IMAGE, 15, 16, 17]
    sample = [names[0], names[2]]  # RGB 13 x 9 and grey + alpha 21 x 30: two patch counts
    data = os.path.join(work, "one.jsonl")
    with open(data, "w") as f:
        f.write(json.dumps({"input_ids": ids, "images": sample}) + "\n")
    processor = Gemma4ImageProcessorPil(patch_size=VISION["patch_size"],
                                        pooling_kernel_size=VISION["pooling_kernel_size"], max_soft_tokens=SOFT)
    ref_loss, ref_grads = reference(model, ids, [os.path.join(work, n) for n in sample], processor)
    sets = [f"model.path={ckpt}", f"data.path={data}", "data.val_rows=0", "train.global_batch=1",
            "optimizer.grad_clip=0", f"model.param_dtype={param_dtype}"]
    for launcher, where in (([], "cp = 1"), ([*mpiexec, "-n", "2"], "cp = 2")):
        what = f"{where}, param_dtype {param_dtype}"
        name = f"grad_{param_dtype}_" + ("two" if launcher else "one")
        try:
            metrics = run(ringflex, launcher, work, name, sets, 1)
        except RuntimeError as e:
            failures.append(str(e))
            continue
        loss_err = abs(metrics[0]["loss"] - ref_loss) / abs(ref_loss)
        worst, checked = compare_grads(what, os.path.join(work, name, "step-00000001"), ref_grads,
                                       ("model.vision_tower.", "model.embed_vision."), failures,
                                       " (the tower's parameter does not train)")
        if not loss_err <= LOSS_TOL:
            failures.append(f"{what}: loss {metrics[0]['loss']} against transformers' {ref_loss}")
        if checked < 10:
            failures.append(f"{what}: only {checked} tower gradients compared")
        print(f"ok   one step at {what}: loss {ref_loss:.6f} (relative error {loss_err:.1e}), {checked} tower and "
              f"projection gradients, worst relative error {worst:.1e}")


def check_cp_and_resume(ringflex, mpiexec, work, ckpt, names, failures):
    data = write_samples(work, names, torch.Generator().manual_seed(5))
    sets = [f"model.path={ckpt}", f"data.path={data}", "data.val_rows=1", "train.global_batch=2"]
    try:
        one = run(ringflex, [], work, "one", sets, 3)
        two = run(ringflex, [*mpiexec, "-n", "2"], work, "two", sets, 3)
        resumed = run(ringflex, [], work, "resumed", sets, 3,
                      ["--resume", os.path.join(work, "one", "step-00000002")])
    except RuntimeError as e:
        failures.append(str(e))
        return
    expect_same_losses(one, two, failures)
    if [x["loss"] for x in resumed] != [x["loss"] for x in one[2:]]:
        failures.append(f"resumed step 3 losses {[x['loss'] for x in resumed]} against {one[2]['loss']}")
    final = load_file(os.path.join(work, "one", "step-00000003", "model.safetensors"))
    again = load_file(os.path.join(work, "resumed", "step-00000003", "model.safetensors"))
    if final.keys() != again.keys() or any(not torch.equal(final[k], again[k]) for k in final):
        failures.append("the resumed run's step-3 weights differ from the straight run's")
    start = load_file(os.path.join(ckpt, "model.safetensors"))
    tower = [k for k in start if k.startswith("model.vision_tower.") and k.endswith(".weight")]
    still = [k for k in tower if torch.equal(start[k].float(), final[k].float())]
    if not tower or still:
        failures.append(f"tower weights did not train: {still[:4]}")
    expect_loads_in_transformers(os.path.join(work, "two", "step-00000003"), failures)
    print(f"ok   cp 1 and cp 2 agree with the tower training: losses {[round(x['loss'], 6) for x in two]}; "
          f"resumed from step 2 ends on the same bits; {len(tower)} tower weights moved")


def main():
    if len(sys.argv) < 3:
        print("usage: train_vision.py PATH/TO/ringflex MPIEXEC [ARGS...]")
        return 2
    ringflex, mpiexec = sys.argv[1], sys.argv[2:]
    gen = torch.Generator().manual_seed(11)
    failures = []
    with tempfile.TemporaryDirectory() as work:
        model, ckpt, names = tiny_checkpoint_and_images(work, gen)
        model = model.double()
        model.config._attn_implementation = "eager"
        for sub in (model.config.text_config, model.config.vision_config):
            sub._attn_implementation = "eager"
        check_one_step(ringflex, mpiexec, work, ckpt, names, model, failures)
        rounded = copy.deepcopy(model)  # what a bf16 working copy of the float32 masters holds
        with torch.no_grad():
            for p in rounded.parameters():
                p.copy_(p.to(torch.bfloat16).double())
        check_one_step(ringflex, mpiexec, work, ckpt, names, rounded, failures, "bfloat16")
        check_cp_and_resume(ringflex, mpiexec, work, ckpt, names, failures)
    if failures:
        for f in failures:
            print("FAIL " + f)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
