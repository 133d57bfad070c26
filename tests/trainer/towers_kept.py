#!/usr/bin/env python3
"""A checkpoint written by `ringflex train` keeps every tensor of its input, and transformers loads all of it.

For each input, `mpirun -n 2 ringflex train` (cp = 2) fine-tunes it for 2 steps and writes a step checkpoint, then
  1. transformers' from_pretrained (the class the config names) loads that checkpoint with no missing, no
     unexpected and no mismatched weights, and its loaded parameters equal the checkpoint's (none re-initialised);
  2. every tensor of the input that ringflex does not train (vision tower, audio tower, audio embedder) is in the
     checkpoint with the same name, dtype, shape and bytes; the checkpoint holds exactly the input's names;
  3. config.json, generation_config.json and the processor, tokenizer and chat template files beside the input's
     weights are in the checkpoint unchanged;
  4. `ringflex forward --model CKPT` and transformers (float64, eager attention, the docs/spec.md §3 masks built as
     tests/model/parity.py builds them) give the same loss on one batch (with image features through the trained
     projection where the model has one).
Inputs, tiny random models made here with transformers' save_pretrained:
  text     Gemma4ForCausalLM, float32;
  vision   Gemma4ForConditionalGeneration with a vision tower (clipped linears, standardize), saved in bfloat16, so
           that a tower widened to float32 or rounded anywhere would show; trained on rows with image features;
  audio    Gemma4ForConditionalGeneration with an audio tower (and its embedder, which ringflex does not use);
  builtin  ringflex's built-in tiny_moe_vlm (a Gemma4ForConditionalGeneration whose one-layer vision tower ringflex
           makes itself), trained on the mock data with its experts held apart (parallelism.ep = 2 under shard full:
           the writer receives each tensor from the ranks holding its parts, trainer/state/held_checkpoint.h): only 1 and
           2's name set (its tower has no input to match).
Tolerance of 4: 1e-4 relative, as in tests/model/parity.py (float32 ringflex against float64 transformers on a tiny
model: rounding ~1e-7 per op amplified by depth stays ~1e-5; a wrong or missing weight shows at 1e-2).
Exit 77 (CTest's skip) when torch, transformers or safetensors is missing.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "common"))
from oracle_env import missing_oracle  # noqa: E402

try:
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    import transformers
    from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4TextConfig
    from spec_mask import spec_masks
except ImportError as e:  # pragma: no cover - depends on the environment
    missing_oracle(e)

REL_TOL = 1e-4
S = 32            # tokens a row (cp = 2 splits it)
TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, global_head_dim=16, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=30.0,
            hidden_size_per_layer_input=0, vocab_size_per_layer_input=128, pad_token_id=0)
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
              head_dim=8, patch_size=4, position_embedding_size=32, pooling_kernel_size=2, standardize=True,
              use_clipped_linears=True)
AUDIO = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, subsampling_conv_channels=[8, 4],
             output_proj_dims=24)
# What ringflex trains or reads: the decoder, the vision projection. Everything else must come back bit for bit.
CARRIED = ("model.vision_tower.", "model.audio_tower.", "model.embed_audio.")
# Files of a Hugging Face checkpoint beside its config and weights (its processor, tokenizer and chat template, added
# here; generation_config.json, which save_pretrained writes), carried unchanged into every checkpoint ringflex writes.
SIDE_FILES = {
    "processor_config.json": json.dumps({"processor_class": "Gemma4Processor", "image_seq_length": 280}, indent=2),
    "tokenizer_config.json": json.dumps({"tokenizer_class": "GemmaTokenizer", "padding_side": "left"}),
    "tokenizer.json": json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {}, "merges": []}}),
    "chat_template.jinja": "{% for m in messages %}{{ m['content'] }}{% endfor %}\n",
    "special_tokens_map.json": json.dumps({"pad_token": "<pad>"}),
}


def make_input(kind, path, gen):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    if kind == "text":
        model = Gemma4ForCausalLM(Gemma4TextConfig(**TEXT))
    else:
        text = dict(TEXT, use_bidirectional_attention="vision") if kind == "vision" else TEXT
        cfg = Gemma4Config(text_config=text, vision_config=VISION if kind == "vision" else None,
                           audio_config=AUDIO if kind == "audio" else None)
        model = Gemma4ForConditionalGeneration(cfg)
    with torch.no_grad():  # off the init values, so that every tensor's bits say something
        for name, p in model.named_parameters():
            p.copy_((1.0 if p.dim() == 1 else 0.0) + 0.1 * torch.randn(p.shape, generator=gen))
    if kind == "vision":
        model = model.to(torch.bfloat16)
    model.save_pretrained(path)
    add_side_files(path)


def add_side_files(path):
    for name, text in SIDE_FILES.items():
        with open(os.path.join(path, name), "w") as f:
            f.write(text)


def check_side_files(source, ckpt, failures):
    """config.json and every side file of `source` (SIDE_FILES, generation_config.json, preprocessor_config.json) are
    in `ckpt` unchanged."""
    for name in ["config.json", "generation_config.json", "preprocessor_config.json", *SIDE_FILES]:
        if not os.path.exists(os.path.join(source, name)):
            continue
        if not os.path.exists(os.path.join(ckpt, name)):
            failures.append(f"{name} is not carried over")
        elif open(os.path.join(source, name), "rb").read() != open(os.path.join(ckpt, name), "rb").read():
            failures.append(f"{name} is not carried over unchanged")


def feature_dim(ckpt):
    with safe_open(os.path.join(ckpt, "model.safetensors"), "pt") as f:
        name = "model.embed_vision.embedding_projection.weight"
        return f.get_slice(name).get_shape()[1] if name in f.keys() else 0


def write_data(work, gen, fdim):
    """16 documents of 20 random tokens; with image features, each opens with a 4-slot image."""
    rows, feats = [], []
    for _ in range(16):
        ids = torch.randint(1, TEXT["vocab_size"], (20,), generator=gen).tolist()
        line = {"input_ids": ids}
        if fdim:
            line["image_spans"] = [[1, 4]]
            feats.append(torch.randn((4, fdim), generator=gen))
        rows.append(json.dumps(line))
    data = os.path.join(work, "data.jsonl")
    with open(data, "w") as f:
        f.write("\n".join(rows) + "\n")
    sets = ["data.source=jsonl_tokens", f"data.path={data}"]
    if fdim:
        save_file({"image_features": torch.cat(feats).contiguous()}, os.path.join(work, "features.safetensors"))
        sets.append(f"data.features={os.path.join(work, 'features.safetensors')}")
    return sets


def train(ringflex, launcher, work, sets):
    args = [*launcher, "-n", "2", ringflex, "train"]
    for s in sets + ["parallelism.cp=2", "parallelism.dp=1", "train.steps=2", f"train.seq_len={S}",
                     "train.global_batch=2", "train.micro_batch=1", "train.threads=1", "train.val_every=0",
                     "data.val_rows=1", f"checkpoint.dir={work}/ck", "checkpoint.every=2"]:
        args += ["--set", s]
    proc = subprocess.run(args, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, f"ringflex train failed: {proc.stderr.strip()}"
    return os.path.join(work, "ck", "step-00000002")


def tensors(path):
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def bits(t):
    """The tensor's bytes as integers of its width, so that equality is bitwise (-0.0, inf and NaN included)."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def check_loads(ckpt, failures):
    arch = json.load(open(os.path.join(ckpt, "config.json")))["architectures"][0]
    cls = {"Gemma4ForCausalLM": Gemma4ForCausalLM, "Gemma4ForConditionalGeneration": Gemma4ForConditionalGeneration}[arch]
    model, info = cls.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager",
                                      output_loading_info=True)
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        if info.get(what):
            failures.append(f"transformers reports {what}: {sorted(info[what])[:6]}")
    weights = tensors(ckpt)
    for name, t in model.state_dict().items():
        if name in weights and not torch.equal(t, weights[name].to(t.dtype)):
            failures.append(f"{name} differs after from_pretrained (re-initialised?)")
    return model, weights


def check_carried(source, weights, failures):
    before = tensors(source)
    if set(before) != set(weights):
        failures.append(f"names lost {sorted(set(before) - set(weights))[:4]}, "
                        f"added {sorted(set(weights) - set(before))[:4]}")
    carried = [n for n in before if n.startswith(CARRIED)]
    for n in carried:
        a, b = before[n], weights.get(n)
        if b is None or a.dtype != b.dtype or a.shape != b.shape or not torch.equal(bits(a), bits(b)):
            failures.append(f"{n}: {a.dtype} {list(a.shape)} in, "
                            f"{'absent' if b is None else f'{b.dtype} {list(b.shape)}'} out, or other bits")
    return len(carried)


def check_loss(ringflex, ckpt, model, work, gen, failures):
    fdim = feature_dim(ckpt)
    text_cfg = model.config.get_text_config()
    ids = torch.randint(1, text_cfg.vocab_size, (1, S), generator=gen)
    labels = torch.randint(1, text_cfg.vocab_size, (1, S), generator=gen)
    doc = torch.ones((1, S), dtype=torch.int64)
    doc[0, 14:] = 2
    doc[0, 28:] = 0
    labels[doc == 0] = -100
    pos = torch.cat([torch.arange(14), torch.arange(14), torch.zeros(4, dtype=torch.int64)])[None]
    mm = torch.zeros((1, S), dtype=torch.int64)
    if fdim:
        mm[0, 2:6] = 1
        mm[0, 16:19] = 1
        labels[mm > 0] = -100
    n_slots = int((mm > 0).sum())
    feats = torch.randn((n_slots, fdim), generator=gen) if fdim else None

    model = model.double()
    lm = model.model.language_model if hasattr(model.model, "language_model") else model.model
    with torch.no_grad():
        slots = mm > 0
        embeds = lm.embed_tokens(torch.where(slots, torch.full_like(ids, text_cfg.pad_token_id), ids))
        if fdim:
            placed = model.model.embed_vision(feats.double())
            embeds = embeds.masked_scatter(slots[..., None].expand_as(embeds), placed)
        hidden = lm(inputs_embeds=embeds, position_ids=pos, attention_mask=spec_masks(text_cfg, doc, mm),
                    use_cache=False).last_hidden_state
        logits = model.lm_head(hidden)[0]
        cap = text_cfg.final_logit_softcapping
        logits = torch.tanh(logits / cap) * cap
    keep = labels[0] != -100
    ref = torch.nn.functional.cross_entropy(logits[keep], labels[0][keep]).item()

    batch = {"input_ids": ids.to(torch.int32), "labels": labels.to(torch.int32), "position_ids": pos.to(torch.int32),
             "doc": doc.to(torch.int32)}
    if fdim:
        batch["mm_token_type_ids"] = mm.to(torch.int32)
        batch["image_features"] = feats
    batch_path, out_path = os.path.join(work, "batch.safetensors"), os.path.join(work, "out.safetensors")
    save_file(batch, batch_path)
    proc = subprocess.run([ringflex, "forward", "--model", ckpt, "--in", batch_path, "--out", out_path, "--no-logits"],
                          capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode != 0:
        failures.append(f"ringflex forward failed: {proc.stderr.strip()}")
        return float("nan")
    ours = load_file(out_path)["loss"].item()
    rel = abs(ours - ref) / abs(ref)
    if not rel < REL_TOL:
        failures.append(f"loss: ringflex {ours:.8f}, transformers {ref:.8f} (relative {rel:.2e})")
    return rel


def run(kind, ringflex, launcher, root):
    gen = torch.Generator().manual_seed({"text": 1, "vision": 2, "audio": 3, "builtin": 4}[kind])
    work = os.path.join(root, kind)
    os.makedirs(work)
    failures = []
    if kind == "builtin":
        ckpt = train(ringflex, launcher, work, ["model.builtin=tiny_moe_vlm", "data.source=mock", "parallelism.ep=2",
                                                "parallelism.shard=full"])
        _, weights = check_loads(ckpt, failures)
        tower = [n for n in weights if n.startswith("model.vision_tower.")]
        if not tower or "model.embed_vision.embedding_projection.weight" not in weights:
            failures.append("the built-in checkpoint has no vision tower or no vision projection")
        summary = f"{len(weights)} tensors, {len(tower)} of the tower"
    else:
        source = os.path.join(work, "input")
        make_input(kind, source, gen)
        ckpt = train(ringflex, launcher, work, [f"model.path={source}"] + write_data(work, gen, feature_dim(source)))
        model, weights = check_loads(ckpt, failures)
        carried = check_carried(source, weights, failures)
        check_side_files(source, ckpt, failures)
        rel = check_loss(ringflex, ckpt, model, work, gen, failures)
        summary = f"{len(weights)} tensors, {carried} carried bit for bit, loss relative difference {rel:.2e}"
    if failures:
        print(f"FAIL {kind:8s}: " + "; ".join(failures[:6]))
        return False
    print(f"ok   {kind:8s}: {summary}")
    return True


def main():
    if len(sys.argv) < 3:
        print("usage: towers_kept.py PATH/TO/ringflex MPIEXEC [MPIEXEC ARGS...]")
        return 2
    ringflex, launcher = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    root = tempfile.mkdtemp(prefix="rf_towers_")
    ok = True
    for kind in ("text", "vision", "audio", "builtin"):
        ok = run(kind, ringflex, launcher, root) and ok
    if ok:
        shutil.rmtree(root)
    else:
        print(f"work kept in {root}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
