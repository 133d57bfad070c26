#!/usr/bin/env python3
"""Fine-tuning from image files: jsonl_tokens samples name their images, the model's frozen vision tower encodes them.

A tiny random Gemma4ForConditionalGeneration (image placeholder, boi and eoi inside its small vocabulary; a vision
tower of patch 2 and pooling 2) is saved with save_pretrained; PNG images of odd sizes (RGB and grey with alpha,
written here with zlib: no imaging package needed) sit in a subfolder, and each JSONL sample puts the placeholder
token where its images go (`"images": ["img/a.png", ...]`, relative to the JSONL file). Then
  1. `ringflex train` at cp = 1 and `mpirun -n 2 ringflex train` at cp = 2 give the same loss and label-token
     count at every step (1e-4 relative: tests/trainer/same_loss_mpirun.sh's bound and reason; the images become
     the same features on every rank, so a rank that encoded or placed them differently shows at 1e-2);
  2. the cp = 2 run's checkpoint loads in transformers with no missing or unexpected weights (the tower included);
  3. every bad image (missing, empty, not an image, truncated, zero-sized, a FIFO, a directory) and a placeholder count
     that does not match the images stop the run on every rank, before step 1, with one line naming the JSONL line
     and the file.
The soft tokens themselves are checked against transformers in tests/model/vision_parity.py and
vision_forward.py, the decoding and preprocessing in tests/model/image_parity.py.
Exit 77 (CTest's skip) when torch, transformers or safetensors is missing.
"""
import json
import os
import struct
import subprocess
import sys
import tempfile
import zlib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from oracle_env import missing_oracle  # noqa: E402

try:
    import torch
    import transformers
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration
except ImportError as e:  # pragma: no cover - depends on the environment
    missing_oracle(e)

REL_TOL = 1e-4
IMAGE, BOI, EOI = 5, 6, 7  # the config's image_token_id, boi_token_id, eoi_token_id
TEXT = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, global_head_dim=16, sliding_window=16,
            layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=0,
            vocab_size_per_layer_input=64, pad_token_id=0, use_bidirectional_attention="vision")
VISION = dict(hidden_size=12, intermediate_size=20, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
              head_dim=8, patch_size=2, position_embedding_size=64, pooling_kernel_size=2)
SEQ = 192  # an image of 70 soft tokens at most, so a row holds two of them and their text
COMMON = ["data.source=jsonl_tokens", "data.image_soft_tokens=70", f"train.seq_len={SEQ}", "train.steps=3",
          "train.global_batch=2", "train.micro_batch=1", "train.threads=1", "train.val_every=0", "data.val_rows=1",
          "optimizer.lr=0.003", "schedule.warmup_steps=1"]


def png(width, height, channels, pixels):
    """A PNG file's bytes: 8-bit RGB (channels 3) or grey + alpha (channels 4 -> colour type 4 takes 2)."""
    colour = {3: 2, 2: 4}[channels]
    raw = b"".join(b"\x00" + bytes(pixels[y * width * channels:(y + 1) * width * channels]) for y in range(height))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, colour, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def write(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def train(ringflex, launcher, work, name, sets):
    ranks = ["parallelism.cp=2"] if launcher else ["parallelism.cp=1"]
    cmd = [*launcher, ringflex, "train", "--metrics", os.path.join(work, name + ".jsonl")]
    for s in COMMON + ranks + [f"checkpoint.dir={os.path.join(work, name)}", "checkpoint.every=3"] + sets:
        cmd += ["--set", s]
    return subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))


def tiny_checkpoint_and_images(work, gen):
    """The tiny random model saved in work/model and the PNG images of odd sizes under work/img, both drawn from
    `gen` (one thread, transformers quiet): (the model, its checkpoint directory, the images' names relative to work)."""
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(11)
    cfg = Gemma4Config(text_config=TEXT, vision_config=VISION, image_token_id=IMAGE, boi_token_id=BOI,
                       eoi_token_id=EOI)
    model = Gemma4ForConditionalGeneration(cfg)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_((1.0 if p.dim() == 1 else 0.0) + 0.2 * torch.randn(p.shape, generator=gen))
    ckpt = os.path.join(work, "model")
    model.save_pretrained(ckpt)
    names = []
    for i, (w, h, c) in enumerate([(13, 9, 3), (40, 7, 3), (21, 30, 2), (8, 8, 3), (25, 16, 2)]):
        px = torch.randint(0, 256, (w * h * c,), generator=gen).tolist()
        names.append(f"img/{i}.png")
        write(os.path.join(work, names[-1]), png(w, h, c, px))
    return model, ckpt, names


def write_samples(work, names, gen):
    """Ten jsonl_tokens samples of random text drawn from `gen`, one or two of `names` each (the placeholder at
    positions 2 and 7), in work/data.jsonl; returns its path."""
    lines = []
    for s in range(10):
        ids = torch.randint(8, 64, (int(torch.randint(6, 20, (1,), generator=gen)),), generator=gen).tolist()
        images = [names[(s + j) % len(names)] for j in range(1 + s % 2)]
        for j in range(len(images)):
            ids.insert(min(len(ids), 2 + 5 * j), IMAGE)
        lines.append(json.dumps({"input_ids": ids, "images": images}))
    data = os.path.join(work, "data.jsonl")
    with open(data, "w") as f:
        f.write("\n".join(lines) + "\n")
    return data


def expect_same_losses(one, two, failures):
    """The cp = 1 and cp = 2 runs' metrics: three steps each, the same label tokens and losses within REL_TOL."""
    for x, y in zip(one, two):
        rel = abs(x["loss"] - y["loss"]) / abs(x["loss"])
        if x["tokens"] != y["tokens"] or not rel < REL_TOL:
            failures.append(f"step {x['step']}: cp 1 loss {x['loss']} ({x['tokens']} tokens), cp 2 "
                            f"{y['loss']} ({y['tokens']}), relative {rel:.1e}")
    if len(one) != 3 or len(two) != 3:
        failures.append(f"{len(one)} and {len(two)} metrics lines, expected 3")


def expect_loads_in_transformers(ckpt, failures):
    """The checkpoint folder loads in transformers with no missing or unexpected weights (the tower included)."""
    _, info = Gemma4ForConditionalGeneration.from_pretrained(ckpt, output_loading_info=True)
    for what in ("missing_keys", "unexpected_keys"):
        if info.get(what):
            failures.append(f"the checkpoint loads with {what} {sorted(info[what])[:4]}")


def main():
    if len(sys.argv) < 3:
        print("usage: images_train.py PATH/TO/ringflex MPIEXEC [ARGS...]")
        return 2
    ringflex, mpiexec = sys.argv[1], sys.argv[2:]
    gen = torch.Generator().manual_seed(11)
    failures = []
    with tempfile.TemporaryDirectory() as work:
        _, ckpt, names = tiny_checkpoint_and_images(work, gen)
        data = write_samples(work, names, gen)
        with open(data) as f:
            lines = f.read().splitlines()
        sets = [f"model.path={ckpt}", f"data.path={data}"]

        one = train(ringflex, [], work, "one", sets)
        two = train(ringflex, [*mpiexec, "-n", "2"], work, "two", sets)
        for run, name in ((one, "cp = 1"), (two, "cp = 2")):
            if run.returncode != 0:
                failures.append(f"ringflex train at {name} failed: {run.stderr.strip()}")
        if not failures:
            a = [json.loads(x) for x in open(os.path.join(work, "one.jsonl"))]
            b = [json.loads(x) for x in open(os.path.join(work, "two.jsonl"))]
            expect_same_losses(a, b, failures)
            expect_loads_in_transformers(os.path.join(work, "two", "step-00000003"), failures)
            if not failures:
                print(f"ok   cp 1 and cp 2 agree: losses {[round(x['loss'], 6) for x in b]}, "
                      f"{[x['tokens'] for x in b]} label tokens")

        # Bad images, each in line 3 of an otherwise good file.
        good = open(os.path.join(work, names[0]), "rb").read()
        ihdr_zero = bytearray(good)
        ihdr_zero[16:20] = struct.pack(">I", 0)
        ihdr_zero[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr_zero[12:29])))
        bad_files = {"missing": None, "empty": b"", "text": b"not an image\n", "truncated": good[: len(good) // 2],
                     "zero": bytes(ihdr_zero), "fifo": "mkfifo", "directory": "mkdir"}
        for what, content in bad_files.items():
            path = os.path.join(work, "bad", what + ".png")
            if content == "mkfifo":  # opening it for reading would wait for a writer forever
                os.makedirs(os.path.dirname(path), exist_ok=True)
                os.mkfifo(path)
            elif content == "mkdir":
                os.makedirs(path)
            elif content is not None:
                write(path, content)
            bad_lines = list(lines)
            sample = json.loads(bad_lines[2])
            sample["images"][0] = os.path.join("bad", what + ".png")
            bad_lines[2] = json.dumps(sample)
            bad_data = os.path.join(work, f"bad_{what}.jsonl")
            with open(bad_data, "w") as f:
                f.write("\n".join(bad_lines) + "\n")
            run = train(ringflex, [*mpiexec, "-n", "2"], work, "run_bad_" + what, [f"model.path={ckpt}",
                                                                                    f"data.path={bad_data}"])
            errors = [x for x in run.stderr.splitlines() if x.startswith("ringflex: error:")]
            metrics = os.path.join(work, f"run_bad_{what}.jsonl")
            if run.returncode == 0 or len(errors) != 2 or any(f"{bad_data}:3: " not in x or path not in x
                                                              for x in errors):
                failures.append(f"bad image {what}: rc {run.returncode}, errors {errors}")
            elif os.path.exists(metrics) and os.path.getsize(metrics) > 0:
                failures.append(f"bad image {what}: a step ran before the error")
            else:
                print(f"ok   bad image {what:9s}: {errors[0][errors[0].index(':3: ') + 4:]}")
        count = list(lines)
        sample = json.loads(count[1])
        sample["images"].append(names[0])  # one image more than placeholders
        count[1] = json.dumps(sample)
        count_data = os.path.join(work, "count.jsonl")
        with open(count_data, "w") as f:
            f.write("\n".join(count) + "\n")
        run = train(ringflex, [*mpiexec, "-n", "2"], work, "run_count", [f"model.path={ckpt}",
                                                                          f"data.path={count_data}"])
        errors = [x for x in run.stderr.splitlines() if x.startswith("ringflex: error:")]
        if run.returncode == 0 or len(errors) != 2 or any(f"{count_data}:2: " not in x or "placeholder" not in x
                                                          for x in errors):
            failures.append(f"placeholder count: rc {run.returncode}, errors {errors}")
    if failures:
        for f in failures:
            print("FAIL " + f)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
