#!/usr/bin/env python3
"""A stale checkpoint is written back whole: a Gemma4ForCausalLM config beside the vision projection.

Older ringflex checkpoints (and the examples made from them) declare Gemma4ForCausalLM (model_type gemma4_text) yet
hold model.embed_vision.embedding_projection.weight, which transformers reports as unexpected and drops. Made here:
a tiny Gemma4ForCausalLM saved by transformers, the projection [hidden, 8] added to its model.safetensors. Then
`ringflex train` (mock data, its image features 8 wide through that projection) writes a checkpoint whose
config.json is a Gemma4ForConditionalGeneration describing what the files hold (src/model/checkpoint.h): the
decoder under model.language_model., the trained projection, a placeholder tower of width 8 with no encoder
layers. Checked: transformers loads it with no missing and no unexpected keys, every tensor as ringflex wrote it
(the projection included, bit for bit in float32), and ringflex resumes from it.
Exit 77 (CTest's skip) when torch, transformers or safetensors is missing.
"""
import json
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
    from transformers import Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4TextConfig
except ImportError as e:  # pragma: no cover - depends on the environment
    missing_oracle(e)

TEXT = dict(vocab_size=128, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, global_head_dim=16, sliding_window=16,
            layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=0, pad_token_id=0)
F = 8
PROJECTION = "model.embed_vision.embedding_projection.weight"


def train(ringflex, work, name, sets, extra=()):
    cmd = [ringflex, "train", *extra, "--set", "train.seq_len=64", "--set", "train.threads=1", "--set", "data.val_rows=0",
           "--set", "train.global_batch=2", "--set", "train.micro_batch=1", "--set", f"checkpoint.dir={work}/{name}"]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))


def main():
    if len(sys.argv) < 2:
        print("usage: stale_multimodal.py PATH/TO/ringflex")
        return 2
    ringflex = sys.argv[1]
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    gen = torch.Generator().manual_seed(3)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**TEXT))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_((1.0 if p.dim() == 1 else 0.0) + 0.2 * torch.randn(p.shape, generator=gen))
    failures = []
    with tempfile.TemporaryDirectory() as work:
        old = os.path.join(work, "old")
        model.save_pretrained(old)
        tensors = load_file(os.path.join(old, "model.safetensors"))
        tensors[PROJECTION] = 0.2 * torch.randn((TEXT["hidden_size"], F), generator=gen)
        save_file(tensors, os.path.join(old, "model.safetensors"), metadata={"format": "pt"})
        run = train(ringflex, work, "ck", [f"model.path={old}", "train.steps=2", "checkpoint.every=2"])
        if run.returncode != 0:
            print(f"FAIL ringflex train: {run.stderr.strip()}")
            return 1
        step = os.path.join(work, "ck", "step-00000002")
        config = json.load(open(os.path.join(step, "config.json")))
        if config.get("architectures") != ["Gemma4ForConditionalGeneration"] or "vision_config" not in config:
            failures.append(f"config.json: architectures {config.get('architectures')}, keys {sorted(config)}")
        written = load_file(os.path.join(step, "model.safetensors"))
        loaded, info = Gemma4ForConditionalGeneration.from_pretrained(step, output_loading_info=True)
        for what in ("missing_keys", "unexpected_keys", "mismatched_keys"):
            if info.get(what):
                failures.append(f"transformers loads it with {what} {sorted(info[what])[:4]}")
        params = dict(loaded.state_dict())
        differ = [k for k, v in written.items() if k not in params or not torch.equal(params[k].float(), v.float())]
        if differ:
            failures.append(f"tensors transformers holds differently from the files: {differ[:4]}")
        if PROJECTION not in written or torch.equal(written[PROJECTION], tensors[PROJECTION]):
            failures.append("the projection is not in the checkpoint, or did not train")
        resumed = train(ringflex, work, "ck", [f"model.path={old}", "train.steps=3"], ["--resume", step])
        if resumed.returncode != 0:
            failures.append(f"resuming from the re-described checkpoint failed: {resumed.stderr.strip()}")
    if failures:
        for f in failures:
            print("FAIL " + f)
        return 1
    print(f"ok   a Gemma4ForCausalLM config beside {PROJECTION} is written back as Gemma4ForConditionalGeneration: "
          f"{len(written)} tensors, transformers loads them all, ringflex resumes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
