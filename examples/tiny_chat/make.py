#!/usr/bin/env python3
"""Writes the tiny chat example's files (docs/text.md, "The tiny chat example"): conversations.jsonl, the small PNG
images it names under images/, and tokenizer.json + tokenizer_config.json, a 512-token tokenizer made with the
Gemma 4 recipe (a BPE over code points with byte fallback, spaces as U+2581, newline runs apart from other text,
Gemma 4's special tokens whole, at Gemma 4's ids where they fit under 512) for the built-in tiny models.

Run once with PyPI `tokenizers` and Pillow (tests/requirements.txt); its outputs are committed, so the example runs
without Python:  python3 examples/tiny_chat/make.py
"""
import json
import os
import random

from PIL import Image, ImageDraw
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB = 512  # the built-in tiny models' vocab_size
# Gemma 4's special tokens at its own ids (docs/text.md); the image tokens at the ids the built-in models' config
# gives them (boi_token_id, image_token_id, eoi_token_id), the audio and video ones beside them.
SPECIAL = {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 4: "<mask>", 46: "<|tool>", 47: "<tool|>",
           48: "<|tool_call>", 49: "<tool_call|>", 50: "<|tool_response>", 51: "<tool_response|>", 52: '<|"|>',
           98: "<|think|>", 100: "<|channel>", 101: "<channel|>", 105: "<|turn>", 106: "<turn|>",
           494: "<|image>", 495: "<|image|>", 496: "<image|>", 497: "<|audio>", 498: "<|audio|>", 499: "<audio|>",
           500: "<|video|>"}
NEWLINES = {107: "\n", 108: "\n\n", 109: "\n\n\n"}
FIRST_BYTE = 238  # <0x00> .. <0xFF> at 238..493, as in Gemma 4

COLOURS = {"red": (220, 40, 40), "green": (40, 190, 60), "blue": (50, 80, 230), "yellow": (230, 210, 40)}
SHAPES = ["square", "circle", "bar"]
SYSTEM = "You are a concise assistant. Answer in one short sentence."
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Adds two whole numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "first"},
                                                   "b": {"type": "integer", "description": "second"}},
                   "required": ["a", "b"]}}}]


def draw(path, colour, shape, size, rng):
    im = Image.new("RGB", (size, size), (30, 30, 30))
    d = ImageDraw.Draw(im)
    c, h = size // 2 + rng.randint(-3, 3), size // 3
    box = [c - h, c - h, c + h, c + h]
    if shape == "square":
        d.rectangle(box, fill=COLOURS[colour])
    elif shape == "circle":
        d.ellipse(box, fill=COLOURS[colour])
    else:
        d.rectangle([c - h, c - h // 3, c + h, c + h // 3], fill=COLOURS[colour])
    im.save(path, optimize=True)


def conversations(rng):
    out = []
    os.makedirs(os.path.join(HERE, "images"), exist_ok=True)
    for i in range(6):  # a few with images
        colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
        name = f"images/{i}_{colour}_{shape}.png"
        draw(os.path.join(HERE, name), colour, shape, rng.choice([24, 32, 40]), rng)
        out.append({"messages": [
            {"role": "user", "content": [{"type": "image", "path": name},
                                         {"type": "text", "text": "What is in this picture?"}]},
            {"role": "assistant", "content": f"A {colour} {shape} on a dark background."}]})
    for i in range(24):
        a, b = rng.randint(1, 40), rng.randint(1, 40)
        kind = i % 4
        if kind == 0:
            msgs = [{"role": "user", "content": f"What is {a} plus {b}?"},
                    {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]
        elif kind == 1:
            msgs = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Count from {a} to {a + 3}."},
                    {"role": "assistant", "content": ", ".join(str(a + k) for k in range(4)) + "."},
                    {"role": "user", "content": "And back?"},
                    {"role": "assistant", "content": ", ".join(str(a + 3 - k) for k in range(4)) + "."}]
        elif kind == 2:
            msgs = [{"role": "user", "content": f"Use the tool: add {a} and {b}."},
                    {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                        "name": "add", "arguments": {"a": a, "b": b}}}]},
                    {"role": "tool", "tool_call_id": "c1", "name": "add", "content": str(a + b)},
                    {"role": "assistant", "content": f"The sum is {a + b}."}]
            out.append({"messages": msgs, "tools": TOOLS})
            continue
        else:
            colour = rng.choice(list(COLOURS))
            msgs = [{"role": "user", "content": f"Name a thing that is {colour}."},
                    {"role": "assistant", "content": {"red": "A tomato.", "green": "A leaf.", "blue": "The sky.",
                                                      "yellow": "A lemon."}[colour]}]
        out.append({"messages": msgs})
    rng.shuffle(out)
    return out


def tokenizer(corpus):
    """A BPE trained on the corpus, then laid out at Gemma 4's ids (special tokens, newlines, bytes) with its own
    pieces in the ids left free."""
    trial = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    trial.normalizer = normalizers.Replace(" ", "\u2581")
    trial.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous")
    free = [i for i in range(VOCAB) if i not in SPECIAL and i not in NEWLINES
            and not FIRST_BYTE <= i < FIRST_BYTE + 256]
    texts = [line.replace("\n", " ") for line in corpus]
    trainer = trainers.BpeTrainer(vocab_size=len(free), show_progress=False, special_tokens=[], limit_alphabet=200)
    trial.train_from_iterator(texts, trainer=trainer)
    learned = json.loads(trial.to_str())["model"]
    pieces = sorted(learned["vocab"], key=learned["vocab"].get)[:len(free)]
    vocab = {tok: i for i, tok in SPECIAL.items()}
    vocab.update({tok: i for i, tok in NEWLINES.items()})
    vocab.update({f"<0x{b:02X}>": FIRST_BYTE + b for b in range(256)})
    for i, piece in zip(free, pieces):
        vocab.setdefault(piece, i)
    # Newline runs merge among themselves only (the corpus has none inside text), as in Gemma 4.
    merges = [["\n", "\n"], ["\n\n", "\n"]]
    merges += [m for m in learned["merges"] if "".join(m) in vocab and m[0] in vocab and m[1] in vocab]
    spec = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i, t in sorted(SPECIAL.items())],
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
        "pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious",
                          "invert": False},
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }
    text = json.dumps(spec, ensure_ascii=False, indent=1)
    Tokenizer.from_str(text)  # it loads
    return text


def main():
    rng = random.Random(0)
    convs = conversations(rng)
    with open(os.path.join(HERE, "conversations.jsonl"), "w") as f:
        for c in convs:
            f.write(json.dumps(c) + "\n")
    corpus = [m["content"] if isinstance(m.get("content"), str) else " ".join(
        p.get("text", "") for p in m.get("content") or []) for c in convs for m in c["messages"]]
    corpus += ["user model system tool thought call response declaration add description"] * 4
    with open(os.path.join(HERE, "tokenizer.json"), "w") as f:
        f.write(tokenizer(corpus))
    config = {"backend": "tokenizers", "tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>",
              "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>", "mask_token": "<mask>",
              "model_max_length": 512}
    with open(os.path.join(HERE, "tokenizer_config.json"), "w") as f:
        f.write(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    main()
