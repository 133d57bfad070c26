#!/usr/bin/env python3
"""Every field ringflex resolves from a config.json equals what transformers (the version pinned in
tests/requirements.txt) resolves from the same file.

For each case (minimal files that lean on the defaults, and edge cases: a null pad_token_id, a multimodal
Gemma4Config with its own vision eps and tie, the older global_head_dim fields, per_layer_config, KV sharing, MoE,
RoPE entries with a `factor` or the old `type` key, a last layer forced to full attention), this script writes the
config.json, runs `config_dump` on it, builds transformers' config class from the same dict, and compares:
  - every scalar field ringflex uses, with transformers' value after its defaults and __post_init__;
  - per layer: type, head dim and kv heads (transformers' per_layer_config), KV sharing (kv_sharing_modes);
  - every parameter and buffer name and shape: Gemma4ForCausalLM built on the meta device (no memory) against
    the tensors ringflex registers;
  - the RoPE inverse frequencies of each layer type: Gemma4TextRotaryEmbedding's buffers against ringflex's RoPE
    table read back at position 1. Tolerance 1e-6 relative: both compute theta^(2i/D) in float32 (one rounding
    each way, ~6e-8), and reading the angle back through float32 sin/cos and atan2 adds ~1e-7.
  - the warnings transformers logs for the config (a RoPE `factor` it ignores, a forced last layer) are among the
    warnings ringflex reports.
A second list of cases is rejected by both, or by ringflex with the message checked here.

Exit code 77 (CTest's skip) when torch or transformers is missing (a failure under CI: tests/common/oracle_env.py).
"""
import json
import logging
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from oracle_env import missing_oracle  # noqa: E402

try:
    import torch
    import transformers
    from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding
except ImportError as e:
    missing_oracle(e)

FREQ_REL_TOL = 1e-6

SMALL = dict(vocab_size=48, hidden_size=16, intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, global_head_dim=16)
FOUR_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]

CASES = {
    "empty": {},
    "text model_type only": {"model_type": "gemma4_text"},
    "multimodal model_type only": {"model_type": "gemma4"},
    "small, PLE by default": SMALL,
    "pad_token_id null": dict(SMALL, pad_token_id=None),
    "pad_token_id 5, softcap, vision bidirectional": dict(SMALL, pad_token_id=5, final_logit_softcapping=30.0,
                                                          use_bidirectional_attention="vision"),
    "k_eq_v with global kv heads": dict(SMALL, attention_k_eq_v=True, num_global_key_value_heads=1,
                                        layer_types=FOUR_TYPES),
    "global kv heads without k_eq_v": dict(SMALL, num_global_key_value_heads=1, layer_types=FOUR_TYPES),
    "per_layer_config": dict(SMALL, layer_types=FOUR_TYPES,
                             per_layer_config={"1": {"head_dim": 32, "num_key_value_heads": 1},
                                               "3": {"head_dim": 32, "num_key_value_heads": 1}}),
    "last layer forced full": dict(SMALL, layer_types=["sliding_attention"] * 4),
    "kv sharing, double-wide MLP": dict(SMALL, layer_types=FOUR_TYPES, num_kv_shared_layers=2,
                                        use_double_wide_mlp=True, hidden_size_per_layer_input=4,
                                        vocab_size_per_layer_input=40),
    "MoE, untied": dict(SMALL, enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=8,
                        tie_word_embeddings=False, hidden_size_per_layer_input=0),
    "rope factor on default and proportional": dict(SMALL, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0, "factor": 8.0},
        "full_attention": {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.5,
                           "factor": 2.0}}),
    "rope old type key, proportional without partial": dict(SMALL, rope_parameters={
        "sliding_attention": {"type": "default", "rope_theta": 500.0},
        "full_attention": {"rope_type": "proportional", "rope_theta": 1e4}}),
    "multimodal with vision eps and untied": {
        "model_type": "gemma4", "tie_word_embeddings": False,
        "text_config": dict(SMALL, model_type="gemma4_text", hidden_size_per_layer_input=0),
        "vision_config": {"model_type": "gemma4_vision", "rms_norm_eps": 1e-3}},
    "multimodal without vision config": {"model_type": "gemma4", "text_config": SMALL},
}

# (name, config, text ringflex's message must contain)
REJECTED = [
    ("another model", {"model_type": "llama"}, "model_type 'llama' is not Gemma 4"),
    ("wrong type", dict(SMALL, num_hidden_layers="4"),
     "field 'num_hidden_layers' must be an integer, found string \"4\""),
    ("null where transformers takes none", dict(SMALL, vocab_size=None),
     "field 'vocab_size' must be an integer, found null"),
    ("float for an int", dict(SMALL, hidden_size=16.0), "field 'hidden_size' must be an integer, found number 16.0"),
    ("nested wrong type", {"model_type": "gemma4", "text_config": dict(SMALL, rms_norm_eps="small")},
     "field 'text_config.rms_norm_eps' must be a number, found string \"small\""),
    ("rope entry missing", dict(SMALL, rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 1e4}}),
     "field 'rope_parameters.full_attention' is missing"),
    ("flat rope", dict(SMALL, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
     "is not a layer type; Gemma 4's rope_parameters are nested by layer type"),
    ("layer_types length", dict(SMALL, layer_types=["full_attention"]), "has 1 entries for num_hidden_layers = 4"),
    ("bad per_layer_config key", dict(SMALL, per_layer_config={"x": {"head_dim": 8}}),
     "field 'per_layer_config.x' does not name a layer"),
    ("pad outside vocab", dict(SMALL, pad_token_id=48), "pad_token_id = 48 must be in [0, vocab_size = 48)"),
    ("fully bidirectional", dict(SMALL, use_bidirectional_attention="all"), "use_bidirectional_attention"),
]


class WarningCollector(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def transformers_view(cfg_dict):
    """(text config, vision eps, tie, warnings) as transformers resolves the file."""
    collector = WarningCollector()
    logger = logging.getLogger("transformers")
    logger.addHandler(collector)
    try:
        d = json.loads(json.dumps(cfg_dict))  # a fresh copy: the config classes edit nested dicts in place
        if d.get("model_type") == "gemma4" or "text_config" in d:
            top = Gemma4Config(**{k: v for k, v in d.items() if k != "model_type"})
            text = top.text_config
            vision_eps = top.vision_config.rms_norm_eps if top.vision_config is not None else 1e-6
            tie = top.tie_word_embeddings
        else:
            text = Gemma4TextConfig(**{k: v for k, v in d.items() if k != "model_type"})
            vision_eps, tie = 1e-6, text.tie_word_embeddings
        rope = Gemma4TextRotaryEmbedding(text)
    finally:
        logger.removeHandler(collector)
    return text, vision_eps, tie, rope, collector.messages


def meta_model_shapes(text, tie):
    cfg = Gemma4TextConfig.from_dict(text.to_dict())
    cfg.tie_word_embeddings = tie
    with torch.device("meta"):
        model = Gemma4ForCausalLM(cfg)
    params = {n: list(p.shape) for n, p in model.named_parameters()}
    buffers = {n: list(b.shape) for n, b in model.named_buffers() if n.endswith("layer_scalar")}
    return params, buffers


def compare_case(dump, name, cfg_dict, workdir):
    path = os.path.join(workdir, "config.json")
    with open(path, "w") as f:
        json.dump(cfg_dict, f)
    proc = subprocess.run([dump, path], capture_output=True, text=True)
    if proc.returncode != 0:
        return [f"config_dump failed: {proc.stderr.strip()}"]
    mine = json.loads(proc.stdout)
    text, vision_eps, tie, rope, hf_warnings = transformers_view(cfg_dict)
    resolved = text.to_dict()  # the global values (head_dim, num_key_value_heads are per-layer attributes there)
    failures = []

    def check(field, ours, theirs):
        if isinstance(ours, dict) and isinstance(theirs, dict):  # name -> shape: say which names differ
            diff = sorted(n for n in set(ours) | set(theirs) if ours.get(n) != theirs.get(n))
            if diff:
                failures.append(f"{field}: {len(diff)} differ, e.g. " + ", ".join(
                    f"{n} ringflex {ours.get(n)} transformers {theirs.get(n)}" for n in diff[:3]))
            return
        if ours != theirs and not (isinstance(ours, float) and isinstance(theirs, (int, float))
                                   and abs(ours - theirs) <= 1e-12 * max(1.0, abs(theirs))):
            failures.append(f"{field}: ringflex {ours!r}, transformers {theirs!r}")

    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "sliding_window", "rms_norm_eps", "final_logit_softcapping",
                  "use_bidirectional_attention", "attention_k_eq_v", "num_kv_shared_layers", "use_double_wide_mlp",
                  "enable_moe_block", "hidden_size_per_layer_input", "vocab_size_per_layer_input", "pad_token_id",
                  "layer_types"):
        check(field, mine[field], resolved[field])
    if text.enable_moe_block:
        for field in ("num_experts", "top_k_experts", "moe_intermediate_size"):
            check(field, mine[field], resolved[field])
    check("vision_config.rms_norm_eps", mine["vision_rms_norm_eps"], vision_eps)
    check("tie_word_embeddings", mine["tie_word_embeddings"], tie)

    modes = text.kv_sharing_modes
    for i, layer in enumerate(mine["layers"]):
        plc = text.per_layer_config[i]
        check(f"layer {i} head_dim", layer["head_dim"], plc.head_dim)
        check(f"layer {i} num_key_value_heads", layer["num_key_value_heads"], plc.num_key_value_heads)
        check(f"layer {i} reuses K/V", layer["kv_source"] >= 0, modes[i] == "reuse")
        if text.num_kv_shared_layers > 0:  # with no sharing, transformers' "store" marks have no reader
            check(f"layer {i} stores K/V", layer["stores_kv"], modes[i] == "store")
        window = text.sliding_window if text.layer_types[i] == "sliding_attention" else 0
        check(f"layer {i} window", layer["window"], window)

    params, buffers = meta_model_shapes(text, tie)
    check("parameter names and shapes", mine["parameters"], params)
    check("buffer names and shapes", mine["buffers"], buffers)

    for layer_type, ours in mine["inv_freq"].items():
        theirs = getattr(rope, f"{layer_type}_inv_freq").double()
        ours = torch.tensor(ours, dtype=torch.float64)
        if ours.shape != theirs.shape:
            failures.append(f"{layer_type} inv_freq: {len(ours)} frequencies, transformers {len(theirs)}")
            continue
        err = float(((ours - theirs).abs() / theirs.abs().clamp_min(1e-30)).where(theirs != 0, ours.abs()).max())
        if not err <= FREQ_REL_TOL:
            failures.append(f"{layer_type} inv_freq: relative error {err:.2e}")

    # transformers' warnings about the config's own content ringflex acts on are repeated by ringflex.
    for w in hf_warnings:
        if w.startswith(("Unrecognized keys in `rope_parameters`", "Last layer must use", "`rope_parameters`'s "
                         "partial_rotary_factor is None")):
            if not any(m.startswith(w) for m in mine["warnings"]):
                failures.append(f"transformers warns {w!r}, ringflex does not")
    return failures


def check_rejected(dump, name, cfg_dict, expected, workdir):
    path = os.path.join(workdir, "config.json")
    with open(path, "w") as f:
        json.dump(cfg_dict, f)
    proc = subprocess.run([dump, path], capture_output=True, text=True)
    lines = proc.stderr.strip().splitlines()
    if proc.returncode != 1 or len(lines) != 1 or expected not in lines[0] or "config.json" not in lines[0]:
        return [f"expected one line with {expected!r}, got rc {proc.returncode}: {proc.stderr.strip()!r}"]
    return []


def main():
    if len(sys.argv) != 2:
        print("usage: config_defaults.py PATH/TO/config_dump")
        return 2
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    ok = True
    with tempfile.TemporaryDirectory() as workdir:
        for name, cfg in CASES.items():
            failures = compare_case(sys.argv[1], name, cfg, workdir)
            print(("FAIL " if failures else "ok   ") + name + (": " + "; ".join(failures[:6]) if failures else ""))
            ok = ok and not failures
        for name, cfg, expected in REJECTED:
            failures = check_rejected(sys.argv[1], name, cfg, expected, workdir)
            print(("FAIL " if failures else "ok   ") + "rejected: " + name +
                  (": " + "; ".join(failures) if failures else ""))
            ok = ok and not failures
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
