#!/usr/bin/env python3
"""Random-config parity of `ringflex forward --grad` with transformers in float64 (tests/model/parity.py's
machinery and tolerance, on a configuration, rows and masks drawn from a seed).

Each seed draws a Gemma4TextConfig within what transformers 5.24 accepts and ringflex claims to support
(docs/model-fidelity.md, src/model/config.h): vocabulary 4..64 and hidden size 2..40 (now and then up to ~770 and
160), head_dim and global_head_dim (even: 2..96 with 72 and other sizes not multiples of 16, and the kernels'
64..512), query heads 1..16 with any divisor as kv heads (MQA, GQA up to 16:1) and num_global_key_value_heads, any
layer_types pattern (the last layer sliding too: transformers forces it to full, with the warning ringflex repeats),
sliding_window from 1 to past S, attention_k_eq_v, num_kv_shared_layers, per-layer embeddings
(hidden_size_per_layer_input, vocab_size_per_layer_input below, at or above vocab_size), MoE (1..6 experts, top_k,
moe_intermediate_size), use_double_wide_mlp, final_logit_softcapping (None too), tie_word_embeddings both ways,
rope_parameters (default or proportional per layer type, theta, partial rotary factor, factor), rms_norm_eps,
pad_token_id null or any row, use_bidirectional_attention "vision"; config.json as save_pretrained writes it
(per_layer_config), by hand from the keyword arguments (global_head_dim, ...) or inside a multimodal Gemma4Config,
sometimes with per_layer_config overrides per layer type (sliding layers' too), or a text-only
Gemma4ForConditionalGeneration checkpoint (model.language_model.* names). And a batch: 1..3 rows of 1..40
tokens (sometimes up to 140; any count, so not divisible by the rank counts), packed documents with one-token ones,
padding at the end and between documents, labels with -100, image and video runs whose features enter raw or through
the vision projection (parity.py's Images paragraph; their gradient grad.image_features is compared too),
position_ids and doc sometimes left out. A draw transformers rejects (KV sharing without a producer of a layer type)
must be refused by ringflex too, and so must a field ringflex does not support (attention_bias, another activation,
fully bidirectional attention, linear RoPE) written into a few seeds' config.json. About a third of the seeds also
draw a LoRA adapter through peft on the same base and rows (r, lora_alpha, use_rslora, a subset of
q/k/v/o/gate/up/down_proj and of the experts' 3-D weights): `ringflex forward --lora` against peft's float64 loss,
logits and adapter gradients.

Tolerance: parity.py's REL_TOL (1e-4 relative per tensor, and why), widened for a badly conditioned draw to
COND_FACTOR times transformers' own float32 error, and a floor for gradients that are zero in exact arithmetic
(ZERO_FLOOR; both say why below).

Every run is classified:
  ok              rc 0 and loss, logits, token_loss and every gradient within the tolerance
  refused         a non-zero exit with one `ringflex: ...` line, the same on every rank, and nothing written; a pass
                  only when the draw expected that refusal (a row shorter than the rank count, image slots with
                  per-layer embeddings and no pad id, a config transformers rejects: documented limits)
  unexpected-refusal  such a clear refusal of a draw ringflex should run: a failure that names the line
  wrong           rc 0 and some tensor outside the tolerance, or a gradient missing or extra
  ill-conditioned wrong, but transformers' own float32 is so far from float64 (tolerance over MAX_TOL) that the
                  case cannot tell rounding from a wrong term: reported, not a failure
  crash           anything else: a signal, no error line, different lines on different ranks, an output left behind
The draw itself (config, batch) is printed with each failure, so a seed reproduces it.

By hand, many seeds at P = 1, 2 and 3 (about 3 s a seed on 2 cores):
    python3 tests/model/random_parity.py build/src/cli/ringflex --seeds 0-299 \\
        --ranks 1 2 3 -- mpirun --oversubscribe -x OMP_NUM_THREADS=1
CTest (model_random_parity_P1_P2_P3, ~35 s on 2 cores) runs a few fixed seeds, among them those that found a bug
(REGRESSION).
`--seeds` takes a list and ranges (`3,7,10-19`); `--keep DIR` leaves each seed's checkpoint and batch there;
`--train` adds one `ringflex train` step from each text-only seed's checkpoint, whose written checkpoint must load
in transformers with no missing, unexpected or mismatched weight and give ringflex's loss and logits there (CTest
passes it).

Exit code 77 (CTest's skip) when torch, transformers, peft or safetensors is missing.
"""
import copy
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from launchers import describe, launchers, ranks_of  # noqa: E402
from oracle_env import missing_oracle  # noqa: E402

try:
    import torch
    import transformers
    from safetensors.torch import load_file
    from transformers import (Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4TextConfig,
                              Gemma4VisionConfig)
    from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder
    from peft import LoraConfig, get_peft_model
    import parity  # noqa: E402  (tests/model/parity.py: random weights, reference, comparison)
    from spec_mask import document_positions
except ImportError as e:
    missing_oracle(e)

# Seeds CTest runs: a spread of the draw's features, and every seed that found a bug (fixed since), so that the bug
# stays fixed.
# 12: an MoE of one expert with a LoRA adapter on experts.gate_up_proj alone (its adapter was named as a linear's).
REGRESSION = [12]
# 7: MoE, projected image features, expert adapters; 26: rows of 133 tokens (several 64-token tiles and CP blocks);
# 64: KV sharing, MoE, bidirectional images, expert adapters, no position_ids; 4: KV sharing, head dim 512;
# 17: MoE top-2, per-layer embeddings, bidirectional images in a multimodal config.json.
CTEST_SEEDS = [7, 26, 64, 4, 17]

# A gradient that is zero in exact arithmetic (q and k of a layer whose every query sees one key: the softmax is 1
# whatever the score; the router of top_k = 1: the normalised weight is 1) comes out of float32 as the rounding of
# the terms that cancel, ~1e-7 of the largest gradient: relative to its own (float64 ~1e-17) norm that is no
# measure. Each gradient is therefore measured against at least 1e-2 of the largest gradient's norm: that noise
# then reads ~1e-5, under parity.REL_TOL, and a wrong term on a tensor with a small gradient still shows once it
# exceeds 1e-6 of the largest gradient.
ZERO_FLOOR = 1e-2

# Conditioning. A random draw can be far worse conditioned than parity.py's cases (a deep stack of one-unit MLPs,
# a large head dim, saturated softmaxes): transformers' own float32 run, the same computation in ringflex's
# precision, is then more than parity.REL_TOL from float64 (6e-4 on seed 12). Each case measures that distance
# (the worst tensor, as the comparison measures ringflex) and allows COND_FACTOR times it: two float32 runs of
# the same math in different orders have errors of one order of magnitude (ringflex's were up to 4.2x transformers'
# on seed 61 and 16x where both are below 1e-6, over 400 seeds). Above MAX_TOL the case cannot tell rounding from
# a wrong term (which shows at 1e-2 or more) and counts as ill-conditioned, not as a failure.
COND_FACTOR = 10.0
MAX_TOL = 1e-2

# --train: one `ringflex train` step from each text-only seed's checkpoint (train_case), on TRAIN_ROWS rows of up to
# TRAIN_SEQ tokens.
TRAIN = False
TRAIN_ROWS, TRAIN_SEQ = 4, 16
LORA_SHARE = 0.3  # of the seeds
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_EXPERT_TARGETS = ["experts.gate_up_proj", "experts.down_proj"]  # peft's target_parameters

HEAD_DIMS = [2, 4, 6, 8, 10, 12, 14, 18, 24, 26, 40, 72, 96]
TUNED_HEAD_DIMS = [64, 128, 256, 512]  # the kernels' fast paths (docs/spec.md §1), drawn less often
MAX_S, LONG_S = 40, 140
WIDE_SALT = 1000003  # seeds the second generator (draw's wider models)
# Fields transformers accepts and ringflex refuses, each naming the field: (key, value, what the line names).
UNSUPPORTED = [("attention_bias", True, "attention_bias"), ("hidden_activation", "gelu", "hidden_activation"),
               ("use_bidirectional_attention", "all", "use_bidirectional_attention"),
               # on full layers, which every model has (the last layer is one): an unused entry may be anything
               ("rope_parameters", {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                    "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0}},
                "rope_type")]
UNSUPPORTED_SHARE = 0.05


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def draw(seed):
    """A config (kwargs of Gemma4TextConfig plus the draw's own keys) and a batch for `seed`."""
    rng = random.Random(seed)
    layers = rng.randint(1, 5)
    heads = rng.choice([1, 1, 2, 3, 4, 4, 6, 8, 16])
    kv = rng.choice(divisors(heads))
    types = [rng.choice(["sliding_attention", "full_attention"]) for _ in range(layers)]
    if rng.random() < 0.7:
        types[-1] = "full_attention"  # else sliding: transformers and ringflex force it to full, with a warning
    # Mostly up to MAX_S; sometimes past the kernels' 64-token tiles and CP blocks, so rows span several.
    S = rng.choice([1, 2] + [rng.randint(3, MAX_S)] * 6 + [rng.randint(10, MAX_S)] * 2 + [rng.randint(MAX_S, LONG_S)])
    V = rng.randint(4, 64)
    cfg = dict(vocab_size=V, hidden_size=rng.randint(2, 40), intermediate_size=rng.randint(1, 40),
               num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
               head_dim=rng.choice(HEAD_DIMS + TUNED_HEAD_DIMS[:2]),
               global_head_dim=rng.choice(HEAD_DIMS + TUNED_HEAD_DIMS), layer_types=types,
               sliding_window=rng.choice([1, 2, rng.randint(1, S + 1), S, S + rng.randint(1, 20)]),
               rms_norm_eps=rng.choice([1e-6, 1e-6, 1e-3, 0.1]),
               final_logit_softcapping=rng.choice([None, None, rng.uniform(0.5, 3.0), rng.uniform(3.0, 40.0)]),
               tie_word_embeddings=rng.random() < 0.5,
               attention_k_eq_v=rng.random() < 0.4, use_double_wide_mlp=rng.random() < 0.4)
    if cfg["attention_k_eq_v"] and rng.random() < 0.7:
        cfg["num_global_key_value_heads"] = rng.choice(divisors(heads))
    if layers > 1 and rng.random() < 0.4:
        shared = rng.randint(1, layers - 1)
        # transformers needs every layer type among the unshared layers; mostly keep to that (the rest checks that
        # ringflex refuses what transformers does)
        while shared and set(types[:layers - shared]) != set(types) and rng.random() < 0.8:
            shared -= 1
        cfg["num_kv_shared_layers"] = shared
    if rng.random() < 0.5:
        cfg["hidden_size_per_layer_input"] = rng.randint(1, 8)
        cfg["vocab_size_per_layer_input"] = rng.choice([V, V, V + rng.randint(1, 10), rng.randint(2, V)])
    else:
        cfg["hidden_size_per_layer_input"] = 0
    if rng.random() < 0.4:
        experts = rng.randint(1, 6)
        cfg.update(enable_moe_block=True, num_experts=experts, top_k_experts=rng.randint(1, experts),
                   moe_intermediate_size=rng.randint(1, 12))
    if rng.random() < 0.6:
        rope = {}
        for t in ("sliding_attention", "full_attention"):
            entry = {"rope_type": rng.choice(["default", "proportional"]), "rope_theta": 10 ** rng.uniform(1, 6)}
            if entry["rope_type"] == "proportional":
                entry["partial_rotary_factor"] = rng.choice([0.0, 0.25, 0.5, 1.0, round(rng.random(), 3)])
                if rng.random() < 0.5:
                    entry["factor"] = rng.choice([0.5, 2.0, 8.0])
            rope[t] = entry
        cfg["rope_parameters"] = rope
    ple_vocab = cfg.get("vocab_size_per_layer_input", V) if cfg["hidden_size_per_layer_input"] else V
    table = min(V, ple_vocab)  # ids index both tables (transformers fails on an id past the per-layer table)
    cfg["pad_token_id"] = rng.choice([None, 0, rng.randrange(table)])
    vision = rng.random() < 0.4
    if vision:
        cfg["use_bidirectional_attention"] = rng.choice([None, "vision"])

    B = rng.randint(1, 3)
    doc = torch.zeros((B, S), dtype=torch.int64)
    mm = torch.zeros((B, S), dtype=torch.int64)
    for r in range(B):
        s, d = 0, 0
        while s < S:
            n = rng.choice([1, 1, 2, rng.randint(1, S), rng.randint(1, S)])
            pad = rng.random() < 0.15
            if not pad:
                d += 1
            doc[r, s:s + n] = 0 if pad else d
            s += n
    if not (doc > 0).any():
        doc[0, 0] = 1
    ids = torch.tensor([[rng.randrange(table) for _ in range(S)] for _ in range(B)], dtype=torch.int64)
    labels = torch.tensor([[rng.randrange(V) if rng.random() < 0.75 else -100 for _ in range(S)]
                           for _ in range(B)], dtype=torch.int64)
    labels[doc == 0] = -100
    if not (labels != -100).any():  # transformers' mean over no label is NaN (docs/model-fidelity.md)
        r, s = (doc > 0).nonzero()[0].tolist()
        labels[r, s] = rng.randrange(V)
    if vision:
        for r in range(B):
            for _ in range(rng.randint(0, 3)):
                start, n = rng.randrange(S), rng.randint(1, 6)
                mm[r, start:start + n] = rng.choice([1, 2])
        mm[doc == 0] = 0
        if not (mm > 0).any():
            vision = False
    features = None
    if vision:
        projected = rng.random() < 0.5
        features = dict(projected=projected, dim=rng.randint(1, 12) if projected else cfg["hidden_size"],
                        eps=rng.choice([1e-6, 1e-2]))
    # What the batch file leaves out, for ringflex's defaults: position_ids (0..S-1 in each row, transformers' own
    # default too) and doc when the rows are single documents without padding.
    omit = set()
    if rng.random() < 0.15:
        omit.add("position_ids")
    if (doc == 1).all() and rng.random() < 0.5:
        omit.add("doc")
    pos = torch.arange(S).repeat(B, 1) if "position_ids" in omit else document_positions(doc)
    # How config.json is written: save_pretrained's (per_layer_config), or by hand from the draw's keyword
    # arguments (global_head_dim, num_global_key_value_heads), or that inside a multimodal Gemma4Config.
    cfg["_style"] = rng.choice(["saved", "saved", "kwargs", "multimodal"])
    # A LoRA adapter through peft on the same base and rows (text only): r, alpha, rsLoRA, a subset of the targets,
    # the experts' weights too where the model has them.
    lora = None
    if rng.random() < LORA_SHARE:
        targets = [t for t in LORA_TARGETS if rng.random() < 0.5]
        experts = [t for t in LORA_EXPERT_TARGETS if cfg.get("enable_moe_block") and rng.random() < 0.5]
        lora = dict(r=rng.randint(1, 8), alpha=round(rng.uniform(0.5, 16.0), 2), rslora=rng.random() < 0.5,
                    targets=targets or [rng.choice(LORA_TARGETS)], expert_targets=experts)
    # Now and then a wider model: a vocabulary past the head's and the loss's small-V paths, a hidden size past the
    # elementwise kernels' vector widths. From a second generator, so that the rest of each seed's draw stays as it
    # was when the seeds above were chosen.
    wide = random.Random(seed * WIDE_SALT + 1)
    if wide.random() < 0.2:
        cfg["vocab_size"] = V * wide.randint(5, 12)  # ids and labels drawn below V stay valid
    if wide.random() < 0.15:
        cfg["hidden_size"] = wide.randint(41, 160)
        if features is not None and not features["projected"]:
            features["dim"] = cfg["hidden_size"]
    # Now and then a config.json field ringflex refuses by name (docs/model-fidelity.md), written into the file only.
    odd = random.Random(seed * WIDE_SALT + 2)
    if odd.random() < UNSUPPORTED_SHARE:
        cfg["_unsupported"] = odd.choice(UNSUPPORTED)
    # Sometimes per_layer_config itself, as transformers 5.24 writes it: one override per layer type (it requires
    # every layer of a type alike), head_dim and/or num_key_value_heads, sliding layers' too; global_head_dim and
    # num_global_key_value_heads are then unused.
    # Sometimes the checkpoint of a text-only Gemma4ForConditionalGeneration (model.language_model.* names).
    cfg["_conditional"] = odd.random() < 0.15
    if odd.random() < 0.15:
        override = {}
        for t in ("sliding_attention", "full_attention"):
            o = {}
            if odd.random() < 0.6:
                o["head_dim"] = odd.choice(HEAD_DIMS)
            if odd.random() < 0.6:
                o["num_key_value_heads"] = odd.choice(divisors(cfg["num_attention_heads"]))
            override[t] = o
        cfg["per_layer_config"] = {i: override[t] for i, t in enumerate(cfg["layer_types"]) if override[t]}
    return cfg, dict(ids=ids, labels=labels, pos=pos, doc=doc, mm=mm, features=features, omit=omit, lora=lora)


def expected_refusals(cfg, batch, ranks):
    """Substrings of the one error line ringflex is expected to give for this draw at `ranks` (empty: it must run)."""
    out = [cfg["_unsupported"][2]] if "_unsupported" in cfg else []
    if batch["features"] is not None and cfg.get("pad_token_id") is None and cfg["hidden_size_per_layer_input"]:
        out.append("pad")
    if batch["ids"].shape[1] < ranks:
        out.append(f"over {ranks} ranks")
    return out


def describe_draw(cfg, batch):
    shown = dict(cfg)
    doc = batch["doc"].tolist()
    mm = batch["mm"].tolist()
    return (f"config {json.dumps(shown)}; B={batch['ids'].shape[0]} S={batch['ids'].shape[1]} doc={doc} mm={mm} "
            f"features={batch['features']} omitted={sorted(batch['omit'])}")


def classify(proc, out_path, ranks):
    """'ok' (rc 0), ('refused', line) or ('crash', why) for a finished ringflex run."""
    if proc.returncode == 0:
        return "ok", None
    lines = [l for l in proc.stderr.splitlines() if l.startswith("ringflex:") and not l.startswith("ringflex: warning")]
    if proc.returncode < 0 or proc.returncode >= 128:
        return "crash", f"rc {proc.returncode}: {proc.stderr.strip()[-400:]}"
    if len(lines) != ranks or len(set(lines)) != 1:
        return "crash", (f"rc {proc.returncode}, {len(lines)} error lines for {ranks} ranks: "
                         f"{proc.stderr.strip()[-600:]}")
    if os.path.exists(out_path):
        return "crash", f"refused with {lines[0]!r} but wrote {out_path}"
    return "refused", lines[0]


def save_conditional(model, config, cfg, ckpt):
    """Saves the causal LM's weights as a text-only Gemma4ForConditionalGeneration checkpoint (model.language_model.*
    names, a multimodal config.json without towers), as transformers writes one."""
    full = Gemma4ForConditionalGeneration(Gemma4Config(text_config=config.to_dict(), vision_config=None,
                                                       audio_config=None,
                                                       tie_word_embeddings=cfg["tie_word_embeddings"]))
    state = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
             for k, v in model.state_dict().items()}
    result = full.load_state_dict(state, strict=False)
    assert not result.missing_keys and not result.unexpected_keys, result
    full.save_pretrained(ckpt, safe_serialization=True)


def write_config(ckpt, cfg, projected):
    """Rewrites the checkpoint's config.json in the draw's style (save_pretrained's is kept for "saved"); with a
    vision projection parity.write_projection wraps it in a multimodal config afterwards."""
    text = {"model_type": "gemma4_text", **{k: v for k, v in cfg.items() if not k.startswith("_")}}
    if cfg["_style"] == "saved":
        return
    if cfg["_style"] == "multimodal" and not projected:
        text = {"model_type": "gemma4", "text_config": text, "tie_word_embeddings": cfg["tie_word_embeddings"]}
    with open(os.path.join(ckpt, "config.json"), "w") as f:
        json.dump(text, f)


def edit_config(ckpt, key, value):
    """Sets `key` of the checkpoint's text config (config.json, or its text_config) to `value`."""
    path = os.path.join(ckpt, "config.json")
    with open(path) as f:
        root = json.load(f)
    (root["text_config"] if "text_config" in root else root)[key] = value
    with open(path, "w") as f:
        json.dump(root, f)


def check_rejected(ringflex, cfg, config, batch, workdir, why):
    """A draw transformers rejects (`why`): `ringflex forward` at P = 1 on its config.json must refuse it clearly."""
    ckpt = os.path.join(workdir, "rejected")
    os.makedirs(ckpt, exist_ok=True)
    if config is not None:
        config.to_json_file(os.path.join(ckpt, "config.json"))
    else:
        with open(os.path.join(ckpt, "config.json"), "w") as f:
            json.dump({"model_type": "gemma4_text", **{k: v for k, v in cfg.items() if not k.startswith("_")}}, f)
    batch_path = os.path.join(workdir, "rejected.safetensors")
    parity.write_batch(batch_path, batch["ids"], batch["labels"], batch["pos"], batch["doc"])
    out_path = os.path.join(workdir, "rejected_out.safetensors")
    outcome, detail = classify(parity.run_forward(ringflex, [], ckpt, batch_path, out_path), out_path, 1)
    if outcome == "ok":
        outcome, detail = "wrong", "ran a config transformers rejects"
    return [(1, outcome, f"{detail} (transformers: {why[:200]})")]


def run_seed(ringflex, seed, runs, workdir):
    """Draws seed's case, computes transformers' reference once and checks ringflex through every launcher.
    Returns a list of (P, outcome, detail) with outcome ok / refused / wrong / crash / unexpected-refusal."""
    cfg, batch = draw(seed)
    config = None
    try:
        config = Gemma4TextConfig(**{k: v for k, v in cfg.items() if not k.startswith("_")})
        config._attn_implementation = "eager"
        model = Gemma4ForCausalLM(config).float()
    except Exception as e:  # noqa: BLE001  what transformers rejects, ringflex must refuse too
        return check_rejected(ringflex, cfg, config, batch, workdir, f"{type(e).__name__}: {e}")
    gen = torch.Generator().manual_seed(seed)
    model.config._attn_implementation = "eager"
    model.config._experts_implementation = "eager"  # the reference loop (grouped_mm has no float64)
    parity.randomize(model, gen)
    ckpt = os.path.join(workdir, f"seed{seed}")
    projected = batch["features"] is not None and batch["features"]["projected"]
    if cfg.get("_conditional") and not projected:
        save_conditional(model, config, cfg, ckpt)
    else:
        model.save_pretrained(ckpt, safe_serialization=True)
        write_config(ckpt, cfg, projected)

    feats, embedder = None, None
    f = batch["features"]
    if f is not None:
        feats = torch.randn((int((batch["mm"] > 0).sum()), f["dim"]), generator=gen)
        if f["projected"]:
            embedder = Gemma4MultimodalEmbedder(Gemma4VisionConfig(hidden_size=f["dim"], rms_norm_eps=f["eps"]),
                                                config).float()
            with torch.no_grad():
                embedder.embedding_projection.weight.copy_(
                    0.3 * torch.randn((cfg["hidden_size"], f["dim"]), generator=gen))
            parity.write_projection(ckpt, embedder, f["dim"], f["eps"])
    batch_path = os.path.join(workdir, f"batch{seed}.safetensors")
    parity.write_batch(batch_path, batch["ids"], batch["labels"],
                       None if "position_ids" in batch["omit"] else batch["pos"],
                       None if "doc" in batch["omit"] else batch["doc"], batch["mm"], feats)

    if "_unsupported" in cfg:
        edit_config(ckpt, *cfg["_unsupported"][:2])
    # Image slots with per-layer embeddings need a pad id (their per-layer input reads its row): none, no reference.
    has_reference = not (f is not None and cfg.get("pad_token_id") is None and cfg["hidden_size_per_layer_input"])
    has_reference = has_reference and "_unsupported" not in cfg
    base = copy.deepcopy(model) if batch["lora"] and has_reference else None
    inputs = (config, batch["ids"], batch["labels"], batch["pos"], batch["doc"], batch["mm"], feats)
    reference = references(model, embedder, inputs) if has_reference else None
    results = check_runs(ringflex, runs, ckpt, batch_path, os.path.join(workdir, f"out{seed}"), cfg, batch, reference)
    if base is not None:
        results += lora_case(ringflex, runs, seed, base, inputs, batch, workdir)
    if TRAIN and has_reference and f is None:
        results += train_case(ringflex, seed, cfg, config, ckpt, batch, workdir)
    return results


def train_case(ringflex, seed, cfg, config, ckpt, batch, workdir):
    """One `ringflex train` step from the seed's checkpoint: the checkpoint it writes must load in transformers with
    no missing, unexpected or mismatched weight, and give there (float64) the loss and logits `ringflex forward`
    computes from it on the seed's batch."""
    gen = torch.Generator().manual_seed(seed + 2)
    table = min(cfg["vocab_size"], cfg.get("vocab_size_per_layer_input") or cfg["vocab_size"]) \
        if cfg["hidden_size_per_layer_input"] else cfg["vocab_size"]
    data = os.path.join(workdir, f"tokens{seed}.jsonl")
    with open(data, "w") as f:
        for _ in range(TRAIN_ROWS):
            n = int(torch.randint(TRAIN_SEQ // 2, TRAIN_SEQ, (1,), generator=gen))
            f.write(json.dumps({"input_ids": torch.randint(0, table, (n,), generator=gen).tolist()}) + "\n")
    out_dir = os.path.join(workdir, f"train{seed}")
    yaml = os.path.join(workdir, f"train{seed}.yaml")
    with open(yaml, "w") as f:
        f.write(f"""model: {{path: {ckpt}}}
data: {{source: jsonl_tokens, path: {data}, val_rows: 0}}
optimizer: {{lr: 0.01}}
train: {{steps: 1, seq_len: {TRAIN_SEQ}, global_batch: 2, micro_batch: 1, threads: 1, log_every: 1}}
checkpoint: {{dir: {out_dir}, every: 1, keep: 1}}
""")
    proc = subprocess.run([ringflex, "train", "--config", yaml], capture_output=True, text=True)
    outcome, detail = classify(proc, os.path.join(out_dir, "step-00000001", "no-such-file"), 1)
    if outcome != "ok":
        return [(1, "unexpected-refusal" if outcome == "refused" else outcome, "train: " + detail)]
    step = os.path.join(out_dir, "step-00000001")
    with open(os.path.join(step, "config.json")) as f:
        conditional = "ForConditionalGeneration" in json.dumps(json.load(f).get("architectures"))
    cls = Gemma4ForConditionalGeneration if conditional else Gemma4ForCausalLM
    loaded, info = cls.from_pretrained(step, output_loading_info=True)
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if bad:
        return [(1, "wrong", f"train: transformers loads the checkpoint with {bad}")]
    state = {(k.replace("model.language_model.", "model.", 1)): v for k, v in loaded.state_dict().items()}
    model = Gemma4ForCausalLM(config).float()
    model.config._attn_implementation = "eager"
    model.config._experts_implementation = "eager"
    model.load_state_dict({k: v for k, v in state.items() if k in model.state_dict()}, strict=True)
    inputs = (config, batch["ids"], batch["labels"], batch["pos"], batch["doc"], torch.zeros_like(batch["mm"]), None)
    loss, logits, _, tol, _ = references(model, None, inputs)
    batch_path = os.path.join(workdir, f"train_batch{seed}.safetensors")
    parity.write_batch(batch_path, batch["ids"], batch["labels"], batch["pos"], batch["doc"])
    out_path = os.path.join(workdir, f"train_out{seed}.safetensors")
    proc = subprocess.run([ringflex, "forward", "--model", step, "--in", batch_path, "--out", out_path],
                          capture_output=True, text=True)
    outcome, detail = classify(proc, out_path, 1)
    if outcome != "ok":
        return [(1, "unexpected-refusal" if outcome == "refused" else outcome, "train: forward: " + detail)]
    failures = []
    worst = parity.compare_outputs(load_file(out_path), batch["doc"], loss, logits, {}, failures, ZERO_FLOOR, tol)
    if failures:
        return [(1, "wrong", "train: " + "; ".join(failures))]
    return [(1, "ok", f"train: checkpoint loads in transformers, loss and logits within {worst:.2e}")]


def references(model, embedder, inputs, to_compare=lambda grads: grads):
    """transformers' float64 reference (loss, logits, gradients) for `inputs` (parity.reference's arguments after the
    model), with the tolerance this case's conditioning allows (transformers' own float32 run against it) and that
    conditioning. `to_compare` picks and names the gradients to compare."""
    loss32, logits32, grads32 = parity.reference(copy.deepcopy(model), *inputs, copy.deepcopy(embedder),
                                                 dtype=torch.float32)
    loss, logits, grads = parity.reference(model, *inputs, embedder)
    grads, grads32 = to_compare(grads), to_compare(grads32)
    as_output = {"loss": loss32.detach(), "logits": logits32.detach(),
                 **{"grad." + n: g for n, g in grads32.items() if g is not None}}
    conditioning = parity.compare_outputs(as_output, inputs[4], loss.detach(), logits.detach(), grads, [], ZERO_FLOOR,
                                          float("inf"))
    return loss.detach(), logits.detach(), grads, max(parity.REL_TOL, COND_FACTOR * conditioning), conditioning


def check_runs(ringflex, runs, ckpt, batch_path, out_prefix, cfg, batch, reference, extra=(), what=""):
    """`ringflex forward --grad` (with `extra` options) through each launcher, classified against `reference`
    (references()' tuple, or None where transformers has none): a list of (P, outcome, detail)."""
    results = []
    for launcher in runs:
        P = ranks_of(launcher)
        out_path = f"{out_prefix}_P{P}.safetensors"
        if os.path.exists(out_path):
            os.remove(out_path)
        proc = parity.run_forward(ringflex, launcher, ckpt, batch_path, out_path, extra=extra)
        outcome, detail = classify(proc, out_path, P)
        expected = expected_refusals(cfg, batch, P)
        if outcome == "refused":
            if not any(e in detail for e in expected):
                outcome = "unexpected-refusal"
        elif outcome == "ok":
            if expected:
                outcome, detail = "wrong", f"ran where a refusal naming {expected} was expected"
            elif reference is None:
                outcome, detail = "wrong", "ran where transformers has no reference"
            else:
                loss, logits, grads, tol, conditioning = reference
                failures = []
                # A Gemma4ForConditionalGeneration checkpoint's gradients carry its names.
                out = {k.replace("grad.model.language_model.", "grad.model.", 1): v
                       for k, v in load_file(out_path).items()}
                worst = parity.compare_outputs(out, batch["doc"], loss, logits, grads, failures,
                                               ZERO_FLOOR, tol)
                worst = max(worst, compare_token_loss(out, logits, batch["labels"], failures, tol))
                if failures:
                    outcome, detail = "wrong", "; ".join(failures[:6])
                    if tol > MAX_TOL:
                        outcome = "ill-conditioned"
                        detail = f"transformers' own float32 is {conditioning:.1e} from float64, no measure: {detail}"
                else:
                    detail = f"worst relative error {worst:.2e} (transformers' float32: {conditioning:.2e})"
        results.append((P, outcome, what + detail if detail else detail))
    return results


def compare_token_loss(out, logits, labels, failures, tol):
    """ringflex's token_loss [B, S] against each token's cross-entropy of the reference logits (0 where the label is
    -100, padding's included); returns the relative error, appending to `failures` past `tol`."""
    ref = torch.nn.functional.cross_entropy(logits.detach().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                            ignore_index=-100, reduction="none").reshape(labels.shape)
    err = float((out["token_loss"].double() - ref).norm() / max(float(ref.norm()), 1e-300))
    if not err <= tol:
        failures.append(f"token_loss: relative error {err:.3e}")
    return err


def lora_case(ringflex, runs, seed, base, inputs, batch, workdir):
    """The draw's LoRA adapter on the float32 `base` through peft: `ringflex forward --lora` must give peft's float64
    loss, logits and every adapter gradient, and no gradient of the base."""
    lora = batch["lora"]
    gen = torch.Generator().manual_seed(seed + 1)
    base_dir = os.path.join(workdir, f"lora_base{seed}")
    base.save_pretrained(base_dir, safe_serialization=True)
    config = inputs[0]
    try:
        model = get_peft_model(base, LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=0.0,
                                                target_modules=lora["targets"] or None,
                                                target_parameters=lora["expert_targets"] or None,
                                                use_rslora=lora["rslora"], task_type="CAUSAL_LM"))
    except ValueError as e:  # no module of the draw has the targets (a KV-shared model's k/v, say): no case
        return [(0, "skipped", f"lora {lora}: peft: {e}")]
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))  # of the base's magnitude, as lora_parity.py
    adapter_dir = os.path.join(workdir, f"adapter{seed}")
    model.save_pretrained(adapter_dir)
    text_only = (config, *inputs[1:5], torch.zeros_like(inputs[5]), None)  # no image slots: no groups either
    reference = references(model, None, text_only, lambda grads: {
        n.replace("base_model.model.", "", 1).replace(".default", ""): g for n, g in grads.items() if "lora_" in n})
    batch_path = os.path.join(workdir, f"lora_batch{seed}.safetensors")
    parity.write_batch(batch_path, batch["ids"], batch["labels"], batch["pos"], batch["doc"])
    text_batch = {**batch, "features": None}
    return check_runs(ringflex, runs, base_dir, batch_path, os.path.join(workdir, f"lora_out{seed}"), config.to_dict(),
                      text_batch, reference, extra=["--lora", adapter_dir], what=f"lora {lora}: ")


def parse_seeds(text):
    seeds = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        seeds.extend(range(int(lo), int(hi or lo) + 1))
    return seeds


def main():
    args = sys.argv[1:]
    if not args:
        print("usage: random_parity.py PATH/TO/ringflex [--seeds LIST] [--keep DIR] "
              "[LAUNCHER... | --ranks P... [-- MPIEXEC...]]")
        return 2
    ringflex, args = args[0], args[1:]
    seeds, keep = REGRESSION + CTEST_SEEDS, None
    global TRAIN
    while args and args[0] in ("--seeds", "--keep", "--train"):
        if args[0] == "--train":
            TRAIN = True
            args = args[1:]
            continue
        if args[0] == "--seeds":
            seeds = parse_seeds(args[1])
        else:
            keep = args[1]
        args = args[2:]
    runs = launchers(args)
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()  # the forced-full last layer and RoPE key warnings, expected here
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)  # peft's call of a deprecated transformers method
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, at P = {describe(runs)}, "
          f"{len(seeds)} seeds")
    counts, bad = {}, []
    workdir = keep or tempfile.mkdtemp(prefix="random_parity")
    try:
        for seed in seeds:
            try:
                results = run_seed(ringflex, seed, runs, workdir)
            except Exception as e:  # noqa: BLE001  a failure of the harness on a draw is reported with the draw
                results = [(0, "harness-error", f"{type(e).__name__}: {e}")]
            for P, outcome, detail in results:
                counts[outcome] = counts.get(outcome, 0) + 1
                good = outcome in ("ok", "refused", "skipped", "ill-conditioned")
                print(f"{'ok  ' if good else 'FAIL'} seed {seed} P={P}: {outcome}: {detail}")
                if not good:
                    bad.append(seed)
            if seed in bad:
                print(f"     seed {seed}: {describe_draw(*draw(seed))}")
            if not keep:
                for name in os.listdir(workdir):
                    path = os.path.join(workdir, name)
                    shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
            sys.stdout.flush()
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"summary: {counts}; failing seeds: {sorted(set(bad))}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
