#!/usr/bin/env python3
"""The vision tower's share of a training step with model.train_vision, at CP = 1 and CP = 2 (issue 24, item 4).

A Gemma4ForConditionalGeneration with a small text decoder (hidden 256, 4 layers) and a Gemma 4 tower of the chosen
size (bench/model/bench_vision.py's configs: e2b, 26b, tiny), random weights at transformers' init, saved in float32;
image-heavy rows: each JSONL sample holds --images-per-row random PNG images (sized so the image processor makes
--soft-tokens soft tokens of each) and a little text around them, one sample a row. Then `ringflex train` with
model.train_vision=true at cp = 1 and under `--mpiexec -n 2` at cp = 2, with the split (parallelism.split_vision=true:
the tower's work split over the two ranks by patch count, each image encoded once, its soft tokens summed to both, its
gradient routed back to its encoder) and without it (false: each rank encodes every image of the row and
back-propagates its own positions' share, as a reference system does), --steps steps of one row each. --split picks
which cp = 2 runs (both by default; cp = 1 has nothing to split). Reported per run: the median over the steps after the
first of the metrics' tower_share (the most of any rank of its seconds in the tower, i.e. its images' forward and
backward and, with the split, the group's two sums, over the step's wall time) and of the step's tokens_per_s, and the
largest peak RSS of any rank beside the memory check's tower term (--stats). --recompute off sets train.recompute=false:
the tower (and the decoder) keep every layer's activations instead of recomputing each layer in the backward.

    python3 bench/trainer/bench_tower_share.py build/src/cli/ringflex --config e2b --steps 4 --threads 2
    python3 bench/trainer/bench_tower_share.py build/src/cli/ringflex --config tiny --soft-tokens 70 --steps 3

--mpiexec is the launcher and its options as one string (default `mpirun`; e.g. "mpirun --oversubscribe").
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

import torch
import transformers
from PIL import Image
from transformers import Gemma4Config, Gemma4ForConditionalGeneration

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "model"))
from bench_vision import CONFIGS  # noqa: E402

IMAGE, BOI, EOI = 5, 6, 7
TEXT = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, global_head_dim=64, sliding_window=512,
            layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
            hidden_size_per_layer_input=0, vocab_size_per_layer_input=256, pad_token_id=0,
            use_bidirectional_attention="vision")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ringflex")
    ap.add_argument("--mpiexec", default="mpirun", help="the launcher and its options, one string")
    ap.add_argument("--config", choices=sorted(CONFIGS), default="e2b")
    ap.add_argument("--soft-tokens", type=int, default=280, choices=[70, 140, 280, 560, 1120])
    ap.add_argument("--images-per-row", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="train.threads per rank")
    ap.add_argument("--split", choices=["both", "on", "off"], default="both",
                    help="cp = 2 with the tower's work split over the ranks (on), without (off), or both")
    ap.add_argument("--recompute", choices=["on", "off"], default="on",
                    help="train.recompute: the tower recomputes its layers in the backward (on) or keeps them (off)")
    args = ap.parse_args()
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    vcfg = CONFIGS[args.config]
    cfg = Gemma4Config(text_config=TEXT, vision_config=vcfg, image_token_id=IMAGE, boi_token_id=BOI,
                       eoi_token_id=EOI)
    model = Gemma4ForConditionalGeneration(cfg)
    side = int((args.soft_tokens * vcfg["pooling_kernel_size"] ** 2) ** 0.5) * vcfg["patch_size"]  # about square
    seq = 1 << (args.images_per_row * (args.soft_tokens + 2) + 64).bit_length()
    with tempfile.TemporaryDirectory() as work:
        ckpt = os.path.join(work, "model")
        model.save_pretrained(ckpt)
        os.makedirs(os.path.join(work, "img"))
        lines = []
        for s in range(args.steps + 1):  # one row per step, and one for validation
            names = []
            for j in range(args.images_per_row):
                names.append(f"img/{s}_{j}.png")
                px = torch.randint(0, 256, (side + 8 * j, side, 3), dtype=torch.uint8).numpy()
                Image.fromarray(px).save(os.path.join(work, names[-1]))
            ids = []
            for j in range(args.images_per_row):
                ids += torch.randint(8, 256, (8,)).tolist() + [IMAGE]
            lines.append(json.dumps({"input_ids": ids + [9, 10, 11], "images": names}))
        data = os.path.join(work, "data.jsonl")
        with open(data, "w") as f:
            f.write("\n".join(lines) + "\n")
        sets = ["data.source=jsonl_tokens", f"data.path={data}", f"model.path={ckpt}", "model.train_vision=true",
                f"data.image_soft_tokens={args.soft_tokens}", f"train.seq_len={seq}", f"train.steps={args.steps}",
                "train.global_batch=1", "train.micro_batch=1", f"train.threads={args.threads}", "train.val_every=0",
                "data.val_rows=1", f"train.recompute={str(args.recompute == 'on').lower()}"]
        runs = [(1, True)] + [(2, split) for split in (True, False) if args.split in ("both", "on" if split else "off")]
        for cp, split in runs:
            launcher = [*shlex.split(args.mpiexec), "-n", str(cp)] if cp > 1 else []
            name = f"cp {cp}" + ("" if cp == 1 else ", split" if split else ", no split")
            metrics = os.path.join(work, f"cp{cp}_{split}.jsonl")
            stats = os.path.join(work, f"cp{cp}_{split}.json")
            cmd = [*launcher, args.ringflex, "train", "--metrics", metrics, "--stats", stats]
            for s in sets + [f"parallelism.cp={cp}", f"parallelism.split_vision={str(split).lower()}"]:
                cmd += ["--set", s]
            proc = subprocess.run(cmd, capture_output=True, text=True,
                                  env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
            if proc.returncode != 0:
                print(f"ringflex train at {name} failed: {proc.stderr.strip()}")
                return 1
            steps = [json.loads(x) for x in open(metrics)][1:] or [json.loads(x) for x in open(metrics)]
            share = statistics.median(x["tower_share"] for x in steps)
            tps = statistics.median(x["tokens_per_s"] for x in steps)
            figures = json.load(open(stats))
            peak = max(figures["peak_rss_bytes"]) / 2**30
            tape = sum(t["bytes"] for t in figures["memory_per_rank"]["terms"] if t["kind"].startswith("vision tower"))
            print(f"{args.config} tower, {args.images_per_row} images x {args.soft_tokens} soft tokens a row "
                  f"(S = {seq}), {name}, recompute {args.recompute}: tower share of the step {share:.1%}, "
                  f"{tps:.1f} tokens/s, peak RSS {peak:.2f} GiB (the check's tower tape {tape / 2**30:.2f} GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
