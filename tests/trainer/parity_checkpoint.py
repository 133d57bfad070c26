#!/usr/bin/env python3
"""A checkpoint written by `ringflex train` loads in transformers and gives the same loss there.

1. `ringflex train` fine-tunes the built-in tiny dense Gemma 4 for a few steps on mock data and writes a
   checkpoint (a Gemma4ForConditionalGeneration: the decoder, the vision projection and the one-layer vision tower
   ringflex makes for its built-in models);
2. transformers' Gemma4ForConditionalGeneration.from_pretrained loads that directory as it is (config.json +
   model.safetensors, or with checkpoint.max_shard_size model-0000k-of-0000n.safetensors + the index, whose
   tensors must be the single file's bits) with no missing and no unexpected weights; the batch is text only, so
   the loss is the decoder's;
3. `ringflex forward --model CKPT` and transformers (float64, eager attention, the docs/spec.md §3 mask of each layer type
   handed in as the {layer_type: mask} dict, as tests/model/parity.py does) compute the loss of one fixed batch
   of packed documents; they must agree.

Tolerance: 1e-4 relative, as in tests/model/parity.py (float32 ringflex against float64 transformers on a tiny
random-ish model: rounding ~1e-7 per op amplified by depth stays ~1e-5; a wrong or missing weight shows at 1e-2).
Also checks that transformers' loaded parameters equal the checkpoint's bits (no tensor silently re-initialised).
Exit 77 (CTest's skip) when torch, transformers or safetensors is missing.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from oracle_env import missing_oracle  # noqa: E402

try:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Gemma4ForConditionalGeneration

    from spec_mask import MASKED, spec_allowed
except ImportError as e:  # pragma: no cover - depends on the environment
    missing_oracle(e)  # a skip locally, a failure under CI and scripts/test.sh

REL_TOL = 1e-4
S = 48


def checkpoint_weights(ckpt):
    """Every tensor of a checkpoint folder: model.safetensors, or the files model.safetensors.index.json names."""
    index = os.path.join(ckpt, "model.safetensors.index.json")
    if not os.path.exists(index):
        return load_file(os.path.join(ckpt, "model.safetensors"))
    weight_map = json.load(open(index))["weight_map"]
    out = {}
    for file in sorted(set(weight_map.values())):
        part = load_file(os.path.join(ckpt, file))
        assert all(weight_map[name] == file for name in part), f"{file} holds tensors the index puts elsewhere"
        out.update(part)
    assert set(out) == set(weight_map), "the index names tensors no file holds"
    return out


def main():
    ringflex = sys.argv[1]
    # The layouts: one model.safetensors; and (checkpoint.max_shard_size) model-0000k-of-0000n.safetensors with the
    # index, beside the sharded moments' files (shard optimizer at one rank: the same arithmetic, so the same bits).
    layouts = {"single": [],
               "multi": ["--set", "checkpoint.max_shard_size=200KB", "--set", "parallelism.shard=optimizer"]}
    weights = {}
    for layout, sets in layouts.items():
        weights[layout] = check_layout(ringflex, layout, sets)
    assert weights["single"].keys() == weights["multi"].keys()
    for name, t in weights["single"].items():
        assert torch.equal(t, weights["multi"][name]), f"{name} differs between the layouts"


def check_layout(ringflex, layout, sets):
    work = tempfile.mkdtemp(prefix="rf_train_parity_")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([ringflex, "train", "--set", "model.builtin=tiny_dense", "--set", "train.steps=3",
                    "--set", "train.seq_len=64", "--set", "data.val_rows=1", "--set", "train.val_every=0",
                    "--set", "model.init_std=0.1", "--set", f"checkpoint.dir={work}/ck", "--set", "checkpoint.every=3"]
                   + sets, check=True, env=env, stdout=subprocess.DEVNULL)
    ckpt = os.path.join(work, "ck", "step-00000003")
    sharded = os.path.exists(os.path.join(ckpt, "model.safetensors.index.json"))
    assert sharded == (layout == "multi"), f"{layout}: the checkpoint holds {sorted(os.listdir(ckpt))}"
    model, info = Gemma4ForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager",
                                                                 output_loading_info=True)
    for what in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info.get(what), f"transformers reports {what}: {sorted(info[what])[:6]}"
    weights = checkpoint_weights(ckpt)
    for name, p in model.named_parameters():
        assert name in weights, f"transformers has {name}, the checkpoint does not"
        assert torch.equal(p.detach(), weights[name]), f"{name} differs after from_pretrained"
    model = model.double()

    gen = torch.Generator().manual_seed(7)
    cfg = model.config.get_text_config()
    ids = torch.randint(32, cfg.vocab_size, (1, S), generator=gen)
    doc = torch.ones((1, S), dtype=torch.int64)
    doc[0, 20:] = 2
    doc[0, 44:] = 0
    labels = torch.randint(32, cfg.vocab_size, (1, S), generator=gen)
    labels[doc == 0] = -100
    pos = torch.cat([torch.arange(20), torch.arange(24), torch.zeros(4, dtype=torch.int64)])[None]
    masks = {}
    for layer_type, window in (("sliding_attention", cfg.sliding_window), ("full_attention", 0)):
        m = torch.zeros((1, 1, S, S), dtype=torch.float64)
        m[0, 0][~spec_allowed(doc[0], window)] = MASKED
        masks[layer_type] = m
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=pos, attention_mask=masks, use_cache=False).logits[0]
    keep = labels[0] != -100
    ref = torch.nn.functional.cross_entropy(logits[keep], labels[0][keep]).item()

    batch = os.path.join(work, "batch.safetensors")
    out = os.path.join(work, "out.safetensors")
    save_file({"input_ids": ids.to(torch.int32), "labels": labels.to(torch.int32), "position_ids": pos.to(torch.int32),
               "doc": doc.to(torch.int32)}, batch)
    subprocess.run([ringflex, "forward", "--model", ckpt, "--in", batch, "--out", out, "--no-logits"], check=True,
                   env=env, stdout=subprocess.DEVNULL)
    ours = load_file(out)["loss"].item()
    rel = abs(ours - ref) / abs(ref)
    print(f"{layout}: loss: ringflex {ours:.8f}, transformers (float64) {ref:.8f}, relative difference {rel:.2e}")
    assert rel < REL_TOL, f"relative difference {rel:.2e} exceeds {REL_TOL}"
    state = json.load(open(os.path.join(ckpt, "trainer_state.json")))
    assert state["step"] == 3 and state["data_position"] == 12, state
    shutil.rmtree(work)
    return weights


if __name__ == "__main__":
    main()
