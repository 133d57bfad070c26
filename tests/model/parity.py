#!/usr/bin/env python3
"""Parity of `ringflex forward --grad` with transformers (the version pinned in tests/requirements.txt).

For each tiny random Gemma 4 config (a dense sliding/full mix with attention_k_eq_v, an MoE variant, a small
variant with per-layer embeddings, KV sharing and the double-wide MLP), with and without image groups and packed
documents, this script
  1. builds Gemma4ForCausalLM in float32 with random weights (norm scales and layer scalars moved off 1 so every
     parameter matters) and saves it with save_pretrained (safetensors);
  2. computes the reference loss, logits and every parameter gradient with transformers (eager attention), in
     float64 from the same float32 weights and inputs;
  3. runs `ringflex forward --model DIR --in BATCH --out OUT --grad` and compares (the image features' gradient,
     grad.image_features, too).
tests/model/random_parity.py runs the same reference and comparison (reference, write_batch, run_forward,
compare_outputs) on random configs.

Masks. transformers 5.24 has no notion of packed documents in Gemma 4's mask builders, and its vision mask
(create_masks_for_vision_model) is AND(window, OR(causal, group)), which differs from docs/spec.md §3 when an image run
is longer than the window. So the reference mask is built from docs/spec.md §3 (doc, group, idx) by
tests/common/spec_mask.py, as a 4D additive float mask per layer type, and handed to the model as the
{layer_type: mask} dict it accepts in place of its own.
Where docs/spec.md §3 and transformers' own builder agree (one document, image runs shorter than the window) the script
also checks that the two masks are equal, which pins the groups-on-full-layers switch to what 5.24 does (off).

Fidelity cases: the dense config's RoPE entries carry a `factor` (ignored on "default", applied on "proportional",
as transformers does); the small config with images is saved as a multimodal Gemma4Config whose vision_config
sets the projection's pre-norm eps (1e-2, not the text eps); small_nopad has pad_token_id null, so token 0's
main and per-layer embedding rows get gradients.

Images. The vision tower is outside ringflex: image features arrive as vectors. As Gemma4Model does, vision slots
embed the pad id, their per-layer token input uses the pad id, and the features (through Gemma4MultimodalEmbedder,
a scale-free RMSNorm and a projection, when the checkpoint has one) are scattered into the slots in row-major order.

Labels are already shifted (labels[t] is the target predicted at position t), so the reference loss is the plain
mean cross-entropy over labels != -100 of the model's (softcapped) logits.

Tolerance: 1e-4 relative (norm of the difference over the norm of the reference, per tensor) for the loss, the
logits of non-padding tokens and every gradient, against transformers run in float64. Why float64: these tiny
random models are badly conditioned (scale-1 attention on RMS-normed q/k saturates the softmax), and transformers'
own float32 run is up to ~2e-4 away from its float64 run on early-layer gradients when the q/k norm scales are
~1. With the q/k norm scales at D^-1/4 (logits of O(1), as in trained checkpoints; see randomize) ringflex's
float32 run stays within ~2e-5 of float64 (float32 rounding, ~1e-7 per op, amplified by depth and the
backward), so 1e-4 keeps a margin and still catches any wrong term, which shows up at 1e-2 or more.

Context parallelism: `parity.py RINGFLEX [LAUNCHER...]` runs ringflex through LAUNCHER (e.g. `mpirun
--oversubscribe -n 4`), and `parity.py RINGFLEX --ranks 1 2 4 -- MPIEXEC...` at each of those rank counts against
the one reference each case computes (tests/common/launchers.py), so the same comparison checks the model split
over P ranks (S = 24 tokens a row: at P = 4 the balanced shards of 64-token blocks leave whole ranks of padding,
and image groups and documents cross shard boundaries). The tolerance is the same: splitting only reorders
float32 sums.

Exit code 77 (CTest's skip) when torch, transformers or safetensors is missing.
"""
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from launchers import describe, launchers, ranks_of  # noqa: E402
from oracle_env import missing_oracle  # noqa: E402

try:
    import torch
    import transformers
    from safetensors.torch import load_file, save_file
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig, Gemma4VisionConfig
    from transformers.models.gemma4.modeling_gemma4 import (Gemma4MultimodalEmbedder, create_masks_for_vision_model,
                                                            get_block_sequence_ids_for_mask)
    from spec_mask import document_positions, spec_masks
except ImportError as e:
    missing_oracle(e)

REL_TOL = 1e-4
V, H = 48, 16
B, S = 2, 24
WINDOW = 5
FEATURE_DIM = 6  # input width of the vision projection in the projected-features case


def base_config(**extra):
    cfg = dict(vocab_size=V, hidden_size=H, intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, global_head_dim=16, sliding_window=WINDOW,
               layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
               final_logit_softcapping=5.0, hidden_size_per_layer_input=0, pad_token_id=0)
    cfg.update(extra)
    return Gemma4TextConfig(**cfg)


# RoPE entries with a `factor`: transformers 5.24 ignores it on a "default" entry (with a warning) and divides the
# frequencies by it on a "proportional" one; ringflex must do the same.
ROPE_WITH_FACTORS = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "factor": 8.0},
    "full_attention": {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.5, "factor": 2.0},
}
# The vision projection's pre-norm epsilon comes from vision_config, not the text config: a value far from the
# text eps (1e-6) moves the projected features by ~0.5%, far beyond the tolerance.
VISION_EPS = 1e-2

CONFIGS = {
    "dense": lambda vision: base_config(attention_k_eq_v=True, num_global_key_value_heads=1,
                                        use_bidirectional_attention="vision" if vision else None,
                                        rope_parameters=json.loads(json.dumps(ROPE_WITH_FACTORS))),
    # MoE, and an untied LM head (lm_head.weight in the checkpoint) to cover that layout too.
    "moe": lambda vision: base_config(attention_k_eq_v=True, num_global_key_value_heads=1, enable_moe_block=True,
                                      num_experts=4, top_k_experts=2, moe_intermediate_size=8,
                                      tie_word_embeddings=False,
                                      use_bidirectional_attention="vision" if vision else None),
    # E2B-like: per-layer embeddings, the last two layers read the K/V of earlier ones, double-wide MLP there;
    # no vision-bidirectional attention (as E2B/E4B), image features through a trainable projection.
    "small": lambda vision: base_config(hidden_size_per_layer_input=4, vocab_size_per_layer_input=V,
                                        num_kv_shared_layers=2, use_double_wide_mlp=True),
    # pad_token_id null: no padding row, so token 0 (one in row 0) trains its main and per-layer embedding rows.
    # Text only: with image slots transformers itself needs a pad id (it embeds the slots as the pad token).
    "small_nopad": lambda vision: base_config(hidden_size_per_layer_input=4, vocab_size_per_layer_input=V,
                                              num_kv_shared_layers=2, use_double_wide_mlp=True, pad_token_id=None),
}
CASES = [("dense", False), ("dense", True), ("moe", False), ("moe", True), ("small", False), ("small", True),
         ("small_nopad", False)]


def randomize(model, gen):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norm scales, router scales: around 1
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    # Scale-1 attention on RMS-normed q and k: scales of D^-1/4 keep the logits O(1), as trained
                    # checkpoints do; scales ~1 saturate the softmax and make the model badly conditioned.
                    p.mul_(p.shape[0] ** -0.25)
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.8 + 0.4 * torch.rand(b.shape, generator=gen))


def make_batch(gen, vision):
    ids = torch.randint(1, V, (B, S), generator=gen)
    ids[0, 3] = 0  # one pad-id token: its embedding row gets no gradient from the lookup (padding_idx)
    labels = torch.randint(0, V, (B, S), generator=gen)
    labels[torch.rand((B, S), generator=gen) < 0.25] = -100
    doc = torch.ones((B, S), dtype=torch.int64)
    mm = torch.zeros((B, S), dtype=torch.int64)
    if vision:
        doc[0, 9:] = 2       # row 0: documents of 9, 8 and 7 tokens
        doc[0, 17:] = 3
        doc[1, 20:] = 0      # row 1: one document, then 4 padding tokens
        mm[0, 1:8] = 1       # an image run of 7 > WINDOW tokens inside document 1
        mm[0, 11:13] = 1     # a 2-token image in document 2
        mm[1, 4:8] = 2       # a 4-token video run
        mm[1, 9:12] = 1
    labels[doc == 0] = -100
    return ids, labels, document_positions(doc), doc, mm


def check_transformers_mask_agrees(cfg):
    """On one document with a short image run, transformers' own vision masks equal docs/spec.md §3's."""
    mm = torch.zeros((1, S), dtype=torch.int64)
    mm[0, 2:2 + WINDOW - 1] = 1
    doc = torch.ones((1, S), dtype=torch.int64)
    ours = spec_masks(cfg, doc, mm)
    cfg._attn_implementation = "eager"
    theirs = create_masks_for_vision_model(config=cfg, inputs_embeds=torch.zeros((1, S, H), dtype=torch.float64), attention_mask=None,
                                           cache=None, position_ids=torch.arange(S)[None],
                                           block_sequence_ids=get_block_sequence_ids_for_mask(mm, device="cpu"))
    for t in ours:
        mine = ours[t][0, 0] == 0
        hf = theirs[t]
        hf = (hf[0, 0] == 0) if hf.dtype != torch.bool else hf[0, 0]
        assert torch.equal(mine, hf), f"transformers' {t} mask differs from docs/spec.md §3 on a plain row"


def write_projection(ckpt, embedder, feature_dim, vision_eps):
    """Adds the vision projection to a saved Gemma4ForCausalLM checkpoint: its weight into the checkpoint's own file,
    where a multimodal Gemma 4 checkpoint keeps its embed_vision, and the config rewritten as a multimodal
    Gemma4Config whose vision_config holds the projection's norm eps."""
    weights_path = os.path.join(ckpt, "model.safetensors")
    weights = load_file(weights_path)
    weights["model.embed_vision.embedding_projection.weight"] = \
        embedder.embedding_projection.weight.detach().contiguous()
    save_file(weights, weights_path, metadata={"format": "pt"})
    config_path = os.path.join(ckpt, "config.json")
    with open(config_path) as f:
        text_config = json.load(f)
    with open(config_path, "w") as f:
        json.dump({"model_type": "gemma4", "text_config": text_config,
                   "vision_config": {"model_type": "gemma4_vision", "hidden_size": feature_dim,
                                     "rms_norm_eps": vision_eps},
                   "tie_word_embeddings": text_config.get("tie_word_embeddings", True)}, f)


def reference(model, cfg, ids, labels, pos, doc, mm, feats=None, embedder=None, dtype=torch.float64):
    """transformers' loss, logits [B, S, V] and every parameter gradient ({HF name: tensor or None}) in `dtype`
    (float64: the reference), from the float32 `model` (converted in place) and `embedder` (the vision projection,
    or None: features are placed as they are), with docs/spec.md §3's masks. Image slots (mm > 0) take `feats`
    [slots, F] in row-major order."""
    model = model.to(dtype)
    if feats is not None:
        # A leaf of its own: ringflex writes the features' gradient too (grad.image_features).
        feats = feats.detach().to(dtype).requires_grad_()
    masks = {t: m.to(dtype) for t, m in spec_masks(cfg, doc, mm).items()}
    # output_hidden_states keeps 5.24's _maybe_slice_kv_shared_inputs from slicing, which fails on KV sharing
    # without per-layer embeddings (it slices per_layer_inputs, None there).
    kwargs = dict(attention_mask=masks, position_ids=pos, use_cache=False, output_hidden_states=True)
    if feats is not None:
        slots = mm > 0
        # Slots embed the pad id (Gemma4Model); without one (no per-layer embeddings) any row does: the features
        # replace the slots' embeddings.
        slot_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        llm_ids = torch.where(slots, torch.full_like(ids, slot_id), ids)
        embeds = model.model.embed_tokens(llm_ids)
        placed = embedder.to(dtype)(feats) if embedder is not None else feats
        embeds = embeds.masked_scatter(slots[..., None].expand_as(embeds), placed)
        kwargs["inputs_embeds"] = embeds
        if cfg.hidden_size_per_layer_input:
            kwargs["per_layer_inputs"] = model.model.get_per_layer_inputs(llm_ids)
    else:
        kwargs["input_ids"] = ids
    logits = model(**kwargs).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), labels.reshape(-1),
                                             ignore_index=-100)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    if embedder is not None:
        grads["model.embed_vision.embedding_projection.weight"] = embedder.embedding_projection.weight.grad
    if feats is not None:
        grads["image_features"] = feats.grad
    return loss, logits, grads


def write_batch(path, ids, labels, pos, doc, mm=None, feats=None):
    """The batch file `ringflex forward --in` reads; pos or doc None leaves that tensor out (its default: 0..S-1 in
    each row, one document)."""
    batch = {"input_ids": ids, "labels": labels}
    if pos is not None:
        batch["position_ids"] = pos
    if doc is not None:
        batch["doc"] = doc.to(torch.int32)
    if feats is not None:
        batch["mm_token_type_ids"] = mm
        batch["image_features"] = feats
    save_file({k: v.contiguous() for k, v in batch.items()}, path)


def run_case(ringflex, name, vision, workdir, launchers=((),)):
    """Builds the case's model, checkpoint, batch and reference once; checks ringflex through every launcher."""
    gen = torch.Generator().manual_seed(1234)
    cfg = CONFIGS[name](vision)
    cfg._attn_implementation = "eager"
    model = Gemma4ForCausalLM(cfg).float()
    model.config._attn_implementation = "eager"
    model.config._experts_implementation = "eager"  # the reference loop (grouped_mm has no float64)
    randomize(model, gen)
    ids, labels, pos, doc, mm = make_batch(gen, vision)
    projected = vision and name.startswith("small")
    ckpt = os.path.join(workdir, f"{name}_{int(vision)}")
    model.save_pretrained(ckpt, safe_serialization=True)

    embedder = None
    n_slots = int((mm > 0).sum())
    feats = None
    if vision:
        fdim = FEATURE_DIM if projected else H
        feats = torch.randn((n_slots, fdim), generator=gen)
        if projected:
            embedder = Gemma4MultimodalEmbedder(Gemma4VisionConfig(hidden_size=fdim, rms_norm_eps=VISION_EPS),
                                                cfg).float()
            with torch.no_grad():
                embedder.embedding_projection.weight.copy_(0.3 * torch.randn((H, fdim), generator=gen))
            write_projection(ckpt, embedder, fdim, VISION_EPS)

    loss, logits, grads = reference(model, cfg, ids, labels, pos, doc, mm, feats, embedder)
    batch_path = os.path.join(workdir, f"batch_{name}_{int(vision)}.safetensors")
    write_batch(batch_path, ids, labels, pos, doc, mm, feats)
    ok = True
    for launcher in launchers:
        ok = check_forward(ringflex, launcher, f"{name}_{int(vision)}", ckpt, batch_path, workdir, doc, loss, logits,
                           grads, f"{name:11s} {'vision+packed' if vision else 'plain':13s}") and ok
    return ok


def run_forward(ringflex, launcher, ckpt, batch_path, out_path, stats_path=None, extra=()):
    """`ringflex forward --grad` of the batch through `launcher` (the finished process, output captured); `extra`:
    more options (--lora DIR)."""
    extra = [*(["--stats", stats_path] if stats_path else []), *extra]
    return subprocess.run([*launcher, ringflex, "forward", "--model", ckpt, "--in", batch_path, "--out", out_path,
                           "--grad", *extra], capture_output=True, text=True)


def compare_outputs(out, doc, loss, logits, grads, failures, zero_floor=0.0, tol=REL_TOL):
    """ringflex's output file (loaded) against the reference loss, logits (of valid tokens: doc > 0) and gradients;
    appends what differs to `failures`, a gradient ringflex lacks or has beyond the reference's included. Returns
    the worst relative error. A gradient is measured against the larger of its own norm and `zero_floor` times the
    largest gradient's (tests/model/random_parity.py says when that is needed)."""
    largest = max((float(g.norm()) for g in grads.values() if g is not None), default=0.0)

    def compare(what, mine, ref, floor=0.0):
        ref = ref.detach().double()
        err = float((mine.double() - ref).norm() / max(float(ref.norm()), floor, 1e-300))
        if not err <= tol:
            failures.append(f"{what}: relative error {err:.3e}")
        return err

    worst = compare("loss", out["loss"].reshape(()), loss)
    valid = doc > 0
    worst = max(worst, compare("logits", out["logits"][valid], logits[valid]))
    for n, g in grads.items():
        key = "grad." + n
        if key not in out:
            failures.append(f"{key} missing from ringflex's output")
            continue
        worst = max(worst, compare(key, out[key], g if g is not None else torch.zeros_like(out[key]),
                                   zero_floor * largest))
    extra = sorted(k for k in out if k.startswith("grad.") and k[len("grad."):] not in grads)
    if extra:
        failures.append(f"gradients of no reference parameter: {extra[:4]}")
    return worst


def check_forward(ringflex, launcher, tag, ckpt, batch_path, workdir, doc, loss, logits, grads, label):
    """`ringflex forward --grad` of the batch through `launcher` against the reference loss, logits and grads."""
    suffix = f"{tag}_P{ranks_of(launcher)}" if launcher else tag
    out_path = os.path.join(workdir, f"out_{suffix}.safetensors")
    stats_path = os.path.join(workdir, f"stats_{suffix}.json") if launcher else None
    proc = run_forward(ringflex, launcher, ckpt, batch_path, out_path, stats_path)
    if proc.returncode != 0:
        raise AssertionError(f"ringflex forward failed: {proc.stderr.strip()}")
    out = load_file(out_path)

    failures = []
    if launcher:
        # --stats: one record per rank with the fields; the ranks hold every valid (doc > 0) token of the
        # batch once, counted as `attn --stats` counts them.
        with open(stats_path) as f:
            ranks = json.load(f)["ranks"]
        keys = {"rank", "tokens", "kept_activation_bytes", "bytes_received", "compute_s", "wall_s", "peak_rss_bytes"}
        if [r.get("rank") for r in ranks] != list(range(len(ranks))) or any(keys - set(r) for r in ranks):
            failures.append(f"--stats records malformed: {ranks}")
        elif sum(r["tokens"] for r in ranks) != int((doc > 0).sum()):
            failures.append(f"--stats tokens sum to {sum(r['tokens'] for r in ranks)}, the batch has "
                            f"{int((doc > 0).sum())} valid tokens")

    worst = compare_outputs(out, doc, loss, logits, grads, failures)
    label += f" P={ranks_of(launcher)}"
    if failures:
        print(f"FAIL {label}: " + "; ".join(failures[:8]))
        return False
    print(f"ok   {label}: {len(grads)} gradients, worst relative error {worst:.2e}")
    return True


def check_errors_under_launcher(ringflex, workdir, launcher, ranks):
    """Under mpirun: a bad input, or more ranks than tokens in a row, is the same one line on every rank, a
    non-zero exit and no output file."""
    cfg = base_config(attention_k_eq_v=True, num_global_key_value_heads=1)  # nothing ringflex warns about
    ckpt = os.path.join(workdir, "errors_cp")
    Gemma4ForCausalLM(cfg).save_pretrained(ckpt, safe_serialization=True)
    short = ranks - 1
    cases = [
        ("more ranks than tokens", {"input_ids": torch.ones((B, short), dtype=torch.int64)}, f"over {ranks} ranks"),
        ("token out of range", {"input_ids": torch.full((B, S), V, dtype=torch.int64)}, "vocab_size"),
    ]
    ok = True
    for what, tensors, expected in cases:
        path = os.path.join(workdir, "bad_cp.safetensors")
        out = os.path.join(workdir, "bad_cp_out.safetensors")
        save_file(tensors, path)
        proc = subprocess.run([*launcher, ringflex, "forward", "--model", ckpt, "--in", path, "--out", out],
                              capture_output=True, text=True)
        lines = [l for l in proc.stderr.splitlines() if l.startswith("ringflex:")]
        if (proc.returncode == 0 or len(lines) != ranks or len(set(lines)) != 1 or expected not in lines[0]
                or os.path.exists(out)):
            print(f"FAIL error case '{what}' under {' '.join(launcher)}: rc {proc.returncode}, lines {lines!r}")
            ok = False
    if ok:
        print(f"ok   {len(cases)} bad inputs rejected with the same line on all {ranks} ranks")
    return ok


def check_errors(ringflex, workdir):
    """Bad input gives one clear line naming the problem."""
    cfg = base_config(attention_k_eq_v=True, num_global_key_value_heads=1)  # nothing ringflex warns about
    ckpt = os.path.join(workdir, "errors")
    Gemma4ForCausalLM(cfg).save_pretrained(ckpt, safe_serialization=True)
    ids = torch.ones((B, S), dtype=torch.int64)
    cases = [
        ("missing input_ids", {"labels": ids}, None, "input_ids"),
        ("labels shape", {"input_ids": ids, "labels": torch.ones((B, S + 1), dtype=torch.int64)}, None, "labels"),
        ("token out of range", {"input_ids": ids * V}, None, "vocab_size"),
        ("unsupported config", {"input_ids": ids}, ("attention_bias", True), "attention_bias"),
    ]
    ok = True
    for what, tensors, config_edit, expected in cases:
        model_dir = ckpt
        if config_edit:
            model_dir = ckpt + "_edited"
            Gemma4ForCausalLM(cfg).save_pretrained(model_dir, safe_serialization=True)
            with open(os.path.join(model_dir, "config.json")) as f:
                c = json.load(f)
            c[config_edit[0]] = config_edit[1]
            with open(os.path.join(model_dir, "config.json"), "w") as f:
                json.dump(c, f)
        path = os.path.join(workdir, "bad.safetensors")
        save_file(tensors, path)
        proc = subprocess.run([ringflex, "forward", "--model", model_dir, "--in", path, "--out",
                               os.path.join(workdir, "bad_out.safetensors")], capture_output=True, text=True)
        lines = proc.stderr.strip().splitlines()
        if proc.returncode == 0 or len(lines) != 1 or expected not in lines[0]:
            print(f"FAIL error case '{what}': rc {proc.returncode}, stderr {proc.stderr.strip()!r}")
            ok = False
    # A NaN in a parameter is rejected before computing (--check-finite is the default), naming file, tensor and
    # element; an unwritable --out is reported before the checkpoint is loaded.
    nan_dir = ckpt + "_nan"
    Gemma4ForCausalLM(cfg).save_pretrained(nan_dir, safe_serialization=True)
    weights = load_file(os.path.join(nan_dir, "model.safetensors"))
    poisoned = sorted(weights)[0]
    weights[poisoned].view(-1)[3] = float("nan")
    save_file(weights, os.path.join(nan_dir, "model.safetensors"), metadata={"format": "pt"})
    path = os.path.join(workdir, "ids.safetensors")
    save_file({"input_ids": ids}, path)
    late_cases = [
        ("nan parameter", nan_dir, os.path.join(workdir, "nan_out.safetensors"), "has nan at"),
        ("unwritable --out", ckpt, os.path.join(workdir, "absent", "out.safetensors"), "cannot write: directory"),
    ]
    for what, model_dir, out, expected in late_cases:
        proc = subprocess.run([ringflex, "forward", "--model", model_dir, "--in", path, "--out", out],
                              capture_output=True, text=True)
        lines = proc.stderr.strip().splitlines()
        if proc.returncode == 0 or len(lines) != 1 or expected not in lines[0]:
            print(f"FAIL error case '{what}': rc {proc.returncode}, stderr {proc.stderr.strip()!r}")
            ok = False
    if ok:
        print(f"ok   {len(cases) + len(late_cases)} bad inputs rejected with one line naming the problem")
    return ok


def main():
    if len(sys.argv) < 2:
        print("usage: parity.py PATH/TO/ringflex [LAUNCHER... | --ranks P... [-- MPIEXEC...]]")
        return 2
    ringflex, runs = sys.argv[1], launchers(sys.argv[2:])
    torch.set_num_threads(1)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, at P = {describe(runs)}")
    check_transformers_mask_agrees(CONFIGS["dense"](True))
    ok = True
    with tempfile.TemporaryDirectory() as workdir:
        for launcher in runs:
            if not launcher:
                ok = check_errors(ringflex, workdir) and ok
            elif ranks_of(launcher) > 1:
                ok = check_errors_under_launcher(ringflex, workdir, launcher, ranks_of(launcher)) and ok
        for name, vision in CASES:
            ok = run_case(ringflex, name, vision, workdir, runs) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
