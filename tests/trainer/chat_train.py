#!/usr/bin/env python3
"""Fine-tuning on conversations end to end (data.source = jsonl_chat, docs/text.md) against transformers.

A tiny random Gemma4ForConditionalGeneration (a 512-token vocabulary with the image tokens where the tiny chat
example's tokenizer has them) is saved with save_pretrained, and beside it, as the hub lays a Gemma 4 checkpoint
out, that example's tokenizer.json and tokenizer_config.json and a real Gemma 4 chat template (TRL's newest
gemma4 revision, from the pinned wheel). Conversations with images, a system turn, several model turns, a tool call
and its response are packed into one row; `mpirun -n 2 ringflex train` (cp = 2) takes one step, full and LoRA
(whose first step is the base model's function: PEFT's B = 0).

The reference builds the same row independently: transformers' apply_chat_template renders and tokenizes each
conversation through the template with `{% generation %}` blocks (tests/text/chat_labels.py's training_template)
and marks the trained tokens with return_assistant_tokens_mask; the empty thought block is inserted after each
model header, masked; each `<|image|>` becomes `<|image>`, Gemma4ImageProcessorPil's soft tokens, `<image|>`; the
conversations are packed as documents (docs/spec.md's mask, positions restarting). Its float64 loss must equal the
step's loss within 1e-4 relative (train_vision.py's LOSS_TOL: float32 against float64, rounding ~1e-7 per op over a
tiny model's few hundred ops stays far below it, while one mislabeled token of a few hundred moves the loss
~1e-3), and the two runs' label-token counts must equal the reference's.
Usage: chat_train.py RINGFLEX MPIEXEC... Exit 77 (CTest's skip) without torch, transformers, trl or safetensors.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
sys.path.insert(0, os.path.join(HERE, "..", "common"))
sys.path.insert(0, os.path.join(HERE, "..", "text"))
from oracle_env import missing_oracle  # noqa: E402

try:
    import torch
    import transformers
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, PreTrainedTokenizerFast
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    from chat_labels import gemma4_templates, training_template
    from images_train import png, write
    from spec_mask import spec_masks
    from train_vision import LOSS_TOL, load_rgb
except ImportError as e:  # pragma: no cover - depends on the environment
    missing_oracle(e)

BOI, IMAGE, EOI = 494, 495, 496  # examples/tiny_chat/make.py's ids, the built-in models' too
TEXT = dict(vocab_size=512, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, global_head_dim=16, sliding_window=16,
            layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=0,
            vocab_size_per_layer_input=512, pad_token_id=0, use_bidirectional_attention="vision")
VISION = dict(hidden_size=12, intermediate_size=20, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
              head_dim=8, patch_size=2, position_embedding_size=64, pooling_kernel_size=2)
SOFT, SEQ = 70, 1024
PREFIX = "<|channel>thought\n<channel|>"
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Adds two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "description": "first"}}, "required": ["a"]}}}]


def conversations():
    return [
        {"messages": [{"role": "user", "content": [{"type": "image", "path": "img/0.png"},
                                                   {"type": "text", "text": "What is this?"}]},
                      {"role": "assistant", "content": "A red square."}]},
        {"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Count to three."},
                      {"role": "assistant", "content": "1, 2, 3."},
                      {"role": "user", "content": [{"type": "text", "text": "And these?"},
                                                   {"type": "image", "path": "img/1.png"},
                                                   {"type": "image", "path": "img/2.png"}]},
                      {"role": "assistant", "content": "Two pictures."}]},
        {"messages": [{"role": "user", "content": "Add 2 and 3 with the tool."},
                      {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                            "function": {"name": "add", "arguments": {"a": 2}}}]},
                      {"role": "tool", "tool_call_id": "c", "name": "add", "content": "5"},
                      {"role": "assistant", "content": "It is 5."}], "tools": TOOLS},
    ]


def checkpoint(work):
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    gen = torch.Generator().manual_seed(7)
    cfg = Gemma4Config(text_config=TEXT, vision_config=VISION, image_token_id=IMAGE, boi_token_id=BOI,
                       eoi_token_id=EOI)
    model = Gemma4ForConditionalGeneration(cfg)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_((1.0 if p.dim() == 1 else 0.0) + 0.2 * torch.randn(p.shape, generator=gen))
    ckpt = os.path.join(work, "model")
    model.save_pretrained(ckpt)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(ROOT, "examples", "tiny_chat", name), ckpt)
    templates = gemma4_templates()
    stock = templates[sorted(templates, key=lambda n: (len(n), n))[-1]]  # the newest revision
    with open(os.path.join(ckpt, "chat_template.jinja"), "w") as f:
        f.write(stock)
    for i, (w, h, c) in enumerate([(13, 9, 3), (21, 30, 2), (8, 8, 3)]):
        px = torch.randint(0, 256, (w * h * c,), generator=gen).tolist()
        write(os.path.join(work, f"img/{i}.png"), png(w, h, c, px))
    return model.double(), ckpt, stock


def reference(model, ckpt, stock, convs, work):
    """transformers' float64 loss of the packed row and its label-token count."""
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(ckpt, "tokenizer.json"), bos_token="<bos>",
                                  eos_token="<eos>", pad_token="<pad>")
    marked = training_template(stock)
    header = tok.encode("<|turn>model\n", add_special_tokens=False)
    channel = tok.encode("<|channel>", add_special_tokens=False)
    prefix = tok.encode(PREFIX, add_special_tokens=False)
    processor = Gemma4ImageProcessorPil(patch_size=VISION["patch_size"],
                                        pooling_kernel_size=VISION["pooling_kernel_size"], max_soft_tokens=SOFT)
    ids, labels, doc, images = [], [], [], []
    for d, c in enumerate(convs, start=1):
        enc = tok.apply_chat_template(c["messages"], tools=c.get("tools"), chat_template=marked, tokenize=True,
                                      return_dict=True, return_assistant_tokens_mask=True)
        x, m = list(enc["input_ids"]), list(enc["assistant_masks"])
        # The thought prefix after each model header whose turn trains and does not open a channel itself.
        out_x, out_m, t = [], [], 0
        while t < len(x):
            if x[t:t + len(header)] == header:
                out_x += header
                out_m += [0] * len(header)
                t += len(header)
                if x[t:t + len(channel)] != channel:
                    out_x += prefix
                    out_m += [0] * len(prefix)
                continue
            out_x.append(x[t])
            out_m.append(m[t])
            t += 1
        paths = [os.path.join(work, p["path"]) for msg in c["messages"] if isinstance(msg.get("content"), list)
                 for p in msg["content"] if p["type"] == "image"]
        counts = [int(n) for n in processor([load_rgb(p) for p in paths], return_tensors="pt")[
            "num_soft_tokens_per_image"]] if paths else []
        images += paths
        k, xs, ms = 0, [], []
        for tid, tm in zip(out_x, out_m):
            if tid != IMAGE:
                xs.append(tid)
                ms.append(tm)
                continue
            xs += [BOI] + [IMAGE] * counts[k] + [EOI]
            ms += [0] * (counts[k] + 2)
            k += 1
        ids += xs
        labels += [xs[t + 1] if t + 1 < len(xs) and ms[t + 1] else -100 for t in range(len(xs))]
        doc += [d] * len(xs)
    feats = processor([load_rgb(p) for p in images], return_tensors="pt")
    x = torch.tensor([ids])
    mm = (x == IMAGE).long()
    docs = torch.tensor([doc])
    pos = torch.cat([torch.arange(n) for n in torch.bincount(docs[0])[1:].tolist()])[None]
    with torch.no_grad():
        logits = model(input_ids=x, pixel_values=feats["pixel_values"].double(),
                       image_position_ids=feats["image_position_ids"], mm_token_type_ids=mm, position_ids=pos,
                       use_cache=False, attention_mask=spec_masks(model.config.text_config, docs, mm)).logits
    target = torch.tensor(labels)
    loss = torch.nn.functional.cross_entropy(logits[0], target, ignore_index=-100)
    return float(loss), int((target != -100).sum()), len(ids)


def train(ringflex, mpiexec, work, ckpt, data, name, sets):
    metrics = os.path.join(work, name + ".jsonl")
    cmd = [*mpiexec, "-n", "2", ringflex, "train", "--metrics", metrics]
    for s in ["data.source=jsonl_chat", f"data.path={data}", f"model.path={ckpt}", f"data.image_soft_tokens={SOFT}",
              f"train.seq_len={SEQ}", "train.steps=1", "train.global_batch=1", "train.micro_batch=1",
              "train.threads=1", "train.val_every=0", "data.val_rows=0", "parallelism.cp=2",
              f"checkpoint.dir={os.path.join(work, name)}", *sets]:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode != 0:
        raise RuntimeError(f"ringflex train ({name}) failed: {proc.stderr.strip()}")
    return [json.loads(line) for line in open(metrics)][0]


def main():
    if len(sys.argv) < 3:
        print("usage: chat_train.py RINGFLEX MPIEXEC...")
        return 2
    ringflex, mpiexec = sys.argv[1], sys.argv[2:]
    failures = []
    with tempfile.TemporaryDirectory() as work:
        model, ckpt, stock = checkpoint(work)
        convs = conversations()
        data = os.path.join(work, "chats.jsonl")
        with open(data, "w") as f:
            f.write("".join(json.dumps(c) + "\n" for c in convs))
        ref_loss, ref_tokens, length = reference(model, ckpt, stock, convs, work)
        if length > SEQ:
            sys.exit(f"FAILED: the reference row has {length} tokens, more than train.seq_len = {SEQ}")
        for name, sets in (("full", []), ("lora", ["model.lora.rank=4"])):
            try:
                step = train(ringflex, mpiexec, work, ckpt, data, name, sets)
            except RuntimeError as e:
                failures.append(str(e))
                continue
            rel = abs(step["loss"] - ref_loss) / abs(ref_loss)
            if step["tokens"] != ref_tokens or not rel <= LOSS_TOL:
                failures.append(f"{name}: loss {step['loss']} over {step['tokens']} label tokens, transformers "
                                f"{ref_loss} over {ref_tokens} (relative {rel:.1e})")
            else:
                print(f"ok   {name} at cp 2: loss {ref_loss:.6f} (relative error {rel:.1e}) over {ref_tokens} "
                      f"label tokens of a {length}-token row")
    for f in failures:
        print("FAILED:", f, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
