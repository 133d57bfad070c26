#!/usr/bin/env python3
"""`ringflex generate` (KV cache, prefill, one-token decode steps) against transformers 5.24 in float32.

Cases: parity.py's tiny configs (sliding window 5 with prompts of 20 tokens, so every prompt crosses the window and
the decoded positions leave it again and again): dense with attention_k_eq_v, MoE with an untied head, E2B-like
(per-layer embeddings, the last two layers reading earlier layers' K/V, double-wide MLP), and dense with images
(vision-bidirectional attention on the image run inside the prompt; features through the checkpoint's projection
in the small case). 64 new tokens each, greedy. And a LoRA adapter (peft) on the dense base: --lora against peft's
generate, the same tokens from the checkpoint `ringflex export --merge` writes, and an adapter made on another
base refused with one line on every rank.
Oracle: transformers' generate(use_cache=True, do_sample=False, float32) for the text cases; for the image cases
(which generate cannot take as features) transformers' forward without a cache over the prompt and the tokens so
far, once per step (the same model, docs/spec.md §3 masks), which checks the cache against no cache at all.
Checked: the same new tokens; each step's logits within parity.py's REL_TOL (1e-4 relative per step: both sides are
float32, ringflex's decode only reorders float32 sums, ~1e-6; a wrong term shows at 1e-2); where the oracle's two
largest logits of a step are closer than that tolerance the tokens may part (a tie under rounding): the comparison
stops there, said in the log. Through every launcher (`--ranks 1 2 3 4 -- MPIEXEC...`): the same tokens at every P,
and (dense and E2B-like) a seeded sampled run (temperature, top-k, top-p, min-p) giving the same tokens at every P. The cache: its bytes
at P = 1 equal the formula docs/generate.md gives (what the memory check uses), and no rank's sliding layer ever
holds more than W positions.

With GENERATE_PARITY_CASE=batch, only batch_case (several prompts decoded together, each giving its tokens alone)
and bf16_cache_case (a bf16 cache under float32 compute against the float32 cache). With GENERATE_PARITY_CASE=ep,
only ep_case (--ep: the experts divided over the ranks, the tokens and logits of every expert local).

Exit code 77 (CTest's skip) when torch, transformers or safetensors is missing.
"""
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "text"))
from launchers import describe, launchers, ranks_of  # noqa: E402
from oracle_env import missing_oracle  # noqa: E402

try:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Gemma4ForCausalLM, Gemma4VisionConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder
    from peft import LoraConfig, get_peft_model
    import parity  # noqa: E402
    import tokenizer_oracle  # noqa: E402  (tests/text: Gemma-4-style tokenizer.json files made with tokenizers)  (tests/model/parity.py: configs, random weights, tolerance)
    from spec_mask import spec_masks
except ImportError as e:
    missing_oracle(e)

NEW_TOKENS = 64
PROMPT = 20
REL_TOL = parity.REL_TOL
SAMPLING = ["--temperature", "0.9", "--top-k", "20", "--top-p", "0.9", "--min-p", "0.02", "--seed", "7"]
CASES = [("dense", False), ("moe", False), ("small", False), ("dense", True), ("small", True)]
SAMPLED = {("dense", False), ("small", False)}  # the sampler is the model's: two cases show it agrees at every P


def build(name, vision, workdir, gen):
    cfg = parity.CONFIGS[name](vision)
    cfg._attn_implementation = "eager"
    model = Gemma4ForCausalLM(cfg).float().eval()
    model.config._experts_implementation = "eager"
    parity.randomize(model, gen)
    model.generation_config.eos_token_id = None  # 64 tokens whatever comes
    model.generation_config.pad_token_id = 0
    ckpt = os.path.join(workdir, f"{name}_{int(vision)}")
    model.save_pretrained(ckpt, safe_serialization=True)
    with open(os.path.join(ckpt, "generation_config.json"), "w") as f:
        json.dump({"do_sample": False}, f)  # no end tokens: both sides run all 64 steps
    ids = torch.randint(1, cfg.vocab_size, (1, PROMPT), generator=gen)
    mm, feats, embedder = None, None, None
    if vision:
        mm = torch.zeros((1, PROMPT), dtype=torch.int64)
        mm[0, 3:10] = 1  # an image run of 7 > W tokens inside the prompt
        projected = name.startswith("small")
        fdim = parity.FEATURE_DIM if projected else cfg.hidden_size
        feats = torch.randn((int(mm.sum()), fdim), generator=gen)
        if projected:
            embedder = Gemma4MultimodalEmbedder(Gemma4VisionConfig(hidden_size=fdim, rms_norm_eps=parity.VISION_EPS),
                                                cfg).float()
            with torch.no_grad():
                embedder.embedding_projection.weight.copy_(0.3 * torch.randn((cfg.hidden_size, fdim), generator=gen))
            parity.write_projection(ckpt, embedder, fdim, parity.VISION_EPS)
    batch = {"input_ids": ids.to(torch.int32)}
    if vision:
        batch["mm_token_type_ids"] = mm.to(torch.int32)
        batch["image_features"] = feats
    batch_path = os.path.join(workdir, f"prompt_{name}_{int(vision)}.safetensors")
    save_file({k: v.contiguous() for k, v in batch.items()}, batch_path)
    return cfg, model, ids, mm, feats, embedder, ckpt, batch_path


@torch.no_grad()
def reference_generate(model, ids):
    out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True,
                         output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, ids.shape[1]:].tolist(), torch.stack([z[0] for z in out.logits])


@torch.no_grad()
def reference_no_cache(model, cfg, ids, mm, feats, embedder, tokens):
    """Step n's logits: transformers' forward without a cache over the prompt and tokens[:n] (teacher-forced on
    ringflex's tokens, so a tie under rounding does not derail the later steps); the greedy tokens of those logits."""
    logits = []
    for n in range(len(tokens)):
        seq = torch.cat([ids, torch.tensor([tokens[:n]], dtype=ids.dtype)], dim=1)
        S = seq.shape[1]
        m = torch.cat([mm, torch.zeros((1, S - mm.shape[1]), dtype=mm.dtype)], dim=1)
        doc = torch.ones((1, S), dtype=torch.int64)
        masks = {t: x.float() for t, x in spec_masks(cfg, doc, m).items()}
        slots = m > 0
        llm_ids = torch.where(slots, torch.full_like(seq, cfg.pad_token_id), seq)
        embeds = model.model.embed_tokens(llm_ids)
        placed = embedder(feats) if embedder is not None else feats
        embeds = embeds.masked_scatter(slots[..., None].expand_as(embeds), placed)
        kwargs = dict(attention_mask=masks, position_ids=torch.arange(S)[None], use_cache=False,
                      output_hidden_states=True, inputs_embeds=embeds)
        if cfg.hidden_size_per_layer_input:
            kwargs["per_layer_inputs"] = model.model.get_per_layer_inputs(llm_ids)
        logits.append(model(**kwargs).logits[0, -1])
    z = torch.stack(logits)
    return z.argmax(-1).tolist(), z


def run_generate(ringflex, launcher, ckpt, batch_path, workdir, tag, extra=()):
    out = os.path.join(workdir, f"{tag}.jsonl")
    logits = os.path.join(workdir, f"{tag}.safetensors")
    proc = subprocess.run([*launcher, ringflex, "generate", "--model", ckpt, "--in", batch_path, "--max-new-tokens",
                           str(NEW_TOKENS), "--out", out, "--logits-out", logits, *extra],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return None, None, f"exit {proc.returncode}: {proc.stderr.strip()[-600:]}"
    with open(out) as f:
        record = json.loads(f.readline())
    return record, load_file(logits)["logits"], None


def expected_cache_bytes(model, cfg, S, N, element_bytes=4):
    """docs/generate.md's cache at P = 1: each layer with its own K/V holds (S - 1) + N positions (full) or
    min(W, min(W - 1, S - 1) + N) (sliding), each K and V (k_proj's Hkv * D rows) in float32 (element_bytes 4) or
    bf16 (2) and a 12-byte TokenMeta."""
    total = 0
    first_shared = cfg.num_hidden_layers - (cfg.num_kv_shared_layers or 0)
    for layer, kind in enumerate(cfg.layer_types[:first_shared]):
        W = cfg.sliding_window
        cap = S - 1 + N if kind == "full_attention" else min(W, min(W - 1, S - 1) + N)
        kd = model.model.layers[layer].self_attn.k_proj.weight.shape[0]
        total += cap * (2 * kd * element_bytes + 12)
    return total


def compare(tag, tokens, logits, ref_tokens, ref_logits, failures):
    """Appends what differs to `failures`; returns the worst step's relative logits error."""
    worst = 0.0
    if len(tokens) != NEW_TOKENS:
        failures.append(f"{tag}: {len(tokens)} tokens, not {NEW_TOKENS}")
    for i in range(min(len(tokens), len(ref_tokens))):
        err = float((logits[i].double() - ref_logits[i].double()).norm() / ref_logits[i].double().norm())
        worst = max(worst, err)
        if err > REL_TOL:
            failures.append(f"{tag}: step {i}: logits {err:.2e} from transformers' (tolerance {REL_TOL})")
            break
        if tokens[i] != ref_tokens[i]:
            top = torch.topk(ref_logits[i].double(), 2).values
            if float(top[0] - top[1]) <= REL_TOL * float(ref_logits[i].abs().max()):
                print(f"  {tag}: step {i}: a tie under rounding ({float(top[0] - top[1]):.1e}); compared up to it")
                break
            failures.append(f"{tag}: step {i}: token {tokens[i]}, transformers {ref_tokens[i]}")
            break
    return worst


def make_adapter(model, workdir, tag, targets, gen):
    """A PEFT LoRA adapter on `model` (its B A of a few percent of the weights, as lora_parity.py draws them),
    saved under workdir/tag; returns the PEFT model and the adapter's directory."""
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets,
                                                  task_type="CAUSAL_LM"))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    adapter = os.path.join(workdir, tag)
    peft_model.save_pretrained(adapter)
    return peft_model, adapter


def error_lines(proc):
    return [line for line in proc.stderr.splitlines() if line.startswith("ringflex: error: ")]


def lora_case(ringflex, runs, workdir, failures):
    """An adapter on the dense base: --lora gives peft's generate tokens (and logits) at every P, and the checkpoint
    `ringflex export --merge` writes gives the same tokens. An adapter made on another base (v_proj on every layer,
    where the dense base's full layers have none: attention_k_eq_v) is one error line on every rank."""
    gen = torch.Generator().manual_seed(99)
    cfg, model, ids, _, _, _, ckpt, batch_path = build("dense", False, workdir, gen)
    peft_model, adapter = make_adapter(model, workdir, "adapter_dense", ["q_proj", "o_proj", "down_proj"], gen)
    ref_tokens, ref_logits = reference_generate(peft_model, ids)
    merged = os.path.join(workdir, "merged")
    proc = subprocess.run([ringflex, "export", "--model", ckpt, "--merge", adapter, "--out", merged],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        failures.append(f"export --merge: exit {proc.returncode}: {proc.stderr.strip()[-400:]}")
        return
    worst = 0.0
    for launcher in runs:
        P = ranks_of(launcher)
        record, logits, error = run_generate(ringflex, launcher, ckpt, batch_path, workdir, f"lora_{P}",
                                             ["--lora", adapter])
        if error:
            failures.append(f"lora P={P}: {error}")
            continue
        worst = max(worst, compare(f"lora P={P}", record["token_ids"], logits, ref_tokens, ref_logits, failures))
        merged_record, _, error = run_generate(ringflex, launcher, merged, batch_path, workdir, f"merged_{P}",
                                               ["--greedy"])
        if error:
            failures.append(f"merged P={P}: {error}")
        elif merged_record["token_ids"] != record["token_ids"]:
            failures.append(f"merged P={P}: the export --merge checkpoint's tokens differ from --lora's")
    other = build("small", False, workdir, gen)[1]
    _, foreign = make_adapter(other, workdir, "adapter_small", ["v_proj"], gen)
    refusal = ""
    for launcher in runs[:2]:  # the refusal is the loader's, before any rank meets another: P = 1 and one more
        P = ranks_of(launcher)
        proc = subprocess.run([*launcher, ringflex, "generate", "--model", ckpt, "--lora", foreign, "--in", batch_path,
                               "--max-new-tokens", "4"], capture_output=True, text=True)
        lines = error_lines(proc)
        if proc.returncode == 0 or len(lines) != P or len(set(lines)) != 1:
            failures.append(f"another base's adapter P={P}: exit {proc.returncode}, error lines {lines}")
        elif "v_proj" not in lines[0]:
            failures.append(f"another base's adapter P={P}: the error does not name v_proj: {lines[0]}")
        refusal = lines[0] if lines else refusal
    print(f"lora           greedy {NEW_TOKENS} tokens as peft's (logits within {worst:.1e}), the same from "
          f"export --merge, another base's adapter refused, at P = {describe(runs)}\n  ({refusal})")


def text_case(ringflex, runs, workdir, failures):
    """--prompt TEXT on a checkpoint with a Gemma-4-style tokenizer.json (byte fallback, so new tokens often split a
    character): the prompt's ids are <bos> and tokenizers' encode (the same tokens as --in with those ids), the
    record's text is tokenizers' decode(token_ids, skip_special_tokens=True), and the streamed stdout is that text:
    a U+FFFD printed before a character's last byte token came would stay in it."""
    rng_words = tokenizer_oracle.WORDS
    tok = tokenizer_oracle.gemma_style([" ".join(rng_words[i:] + rng_words[:i]) for i in range(len(rng_words))],
                                       400, 120)
    gen = torch.Generator().manual_seed(7)
    cfg = parity.base_config(vocab_size=tok.get_vocab_size())
    cfg._attn_implementation = "eager"
    model = Gemma4ForCausalLM(cfg).float().eval()
    parity.randomize(model, gen)
    ckpt = os.path.join(workdir, "text")
    model.save_pretrained(ckpt, safe_serialization=True)
    tok.save(os.path.join(ckpt, "tokenizer.json"))
    with open(os.path.join(ckpt, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<bos>", "eos_token": "<eos>"}, f)
    with open(os.path.join(ckpt, "generation_config.json"), "w") as f:
        json.dump({"do_sample": False}, f)
    prompt = "the ring passes 注意力 keys 🙂 and values"
    ids = [tok.token_to_id("<bos>")] + tok.encode(prompt, add_special_tokens=False).ids
    batch_path = os.path.join(workdir, "text_ids.safetensors")
    save_file({"input_ids": torch.tensor([ids], dtype=torch.int32)}, batch_path)
    for launcher in runs:
        P = ranks_of(launcher)
        out = os.path.join(workdir, f"text_{P}.jsonl")
        proc = subprocess.run([*launcher, ringflex, "generate", "--model", ckpt, "--prompt", prompt,
                               "--max-new-tokens", str(NEW_TOKENS), "--out", out], capture_output=True)
        if proc.returncode != 0:
            failures.append(f"--prompt P={P}: exit {proc.returncode}: {proc.stderr.decode(errors='replace')[-400:]}")
            continue
        with open(out, encoding="utf-8") as f:
            record = json.loads(f.readline())
        by_ids, _, error = run_generate(ringflex, launcher, ckpt, batch_path, workdir, f"text_ids_{P}")
        if error or by_ids["token_ids"] != record["token_ids"]:
            failures.append(f"--prompt P={P}: not the tokens of <bos> + tokenizers' ids ({error})")
        text = tok.decode(record["token_ids"], skip_special_tokens=True)
        if record["text"] != text:
            failures.append(f"--prompt P={P}: text {record['text']!r}, tokenizers decode {text!r}")
        streamed = proc.stdout.decode("utf-8")
        if streamed != text + "\n":
            failures.append(f"--prompt P={P}: streamed {streamed!r}, the text is {text!r}")
        # Two prompts of different lengths decoded together: each its tokens alone, streamed one after the other.
        short = "keys 🙂"
        alone = subprocess.run([*launcher, ringflex, "generate", "--model", ckpt, "--prompt", short,
                                "--max-new-tokens", str(NEW_TOKENS)], capture_output=True)
        both = subprocess.run([*launcher, ringflex, "generate", "--model", ckpt, "--prompt", prompt, "--prompt", short,
                               "--max-new-tokens", str(NEW_TOKENS), "--out", out], capture_output=True)
        if alone.returncode != 0 or both.returncode != 0:
            failures.append(f"two --prompt P={P}: exit {alone.returncode}, {both.returncode}: "
                            f"{both.stderr.decode(errors='replace')[-400:]}")
            continue
        with open(out, encoding="utf-8") as f:
            records = [json.loads(line) for line in f]
        if [r["token_ids"] for r in records][:1] != [record["token_ids"]] or len(records) != 2:
            failures.append(f"two --prompt P={P}: the first prompt's tokens differ from its run alone")
        if both.stdout != proc.stdout + alone.stdout:
            failures.append(f"two --prompt P={P}: streamed {both.stdout!r}, alone {proc.stdout + alone.stdout!r}")
    print(f"text           --prompt through the tokenizer, streamed as text, two --prompt decoded together as "
          f"each alone, at P = {describe(runs)}")


def batch_case(ringflex, runs, workdir, failures):
    """Prompts decoded together (--in with several rows; several --prompt of different lengths in text_case): each
    row's greedy and seeded sampled tokens are those of a run of it alone (its own cache and sampler), at every P,
    and a sequence that stops leaves the batch while the others go on (an end token taken from one row's own
    tokens: every row's tokens are then its tokens alone cut after that token's first occurrence). The E2B-like
    config (KV sharing, per-layer embeddings), whose later layers read another layer's cache of the same row."""
    gen = torch.Generator().manual_seed(2468)
    cfg, model, _, _, _, _, ckpt, _ = build("small", False, workdir, gen)
    rows = torch.randint(1, cfg.vocab_size, (3, PROMPT), generator=gen).to(torch.int32)
    batch_path = os.path.join(workdir, "batch_rows.safetensors")
    save_file({"input_ids": rows}, batch_path)
    alone = {}
    for mode, extra in (("greedy", ()), ("sampled", SAMPLING)):
        for r in range(rows.shape[0]):
            one = os.path.join(workdir, f"batch_row_{r}.safetensors")
            save_file({"input_ids": rows[r:r + 1].contiguous()}, one)
            record, _, error = run_generate(ringflex, runs[0], ckpt, one, workdir, f"alone_{mode}_{r}", extra)
            if error:
                failures.append(f"batch: row {r} alone ({mode}): {error}")
                return
            alone[mode, r] = record["token_ids"]
    stop = alone["greedy", 1][NEW_TOKENS // 4]
    stopping = os.path.join(workdir, "small_stopping")
    shutil.copytree(ckpt, stopping)
    with open(os.path.join(stopping, "generation_config.json"), "w") as f:
        json.dump({"do_sample": False, "eos_token_id": stop}, f)

    def cut(tokens):
        return tokens[:tokens.index(stop) + 1] if stop in tokens else tokens

    for launcher in runs:
        P = ranks_of(launcher)
        for mode, model_dir, extra in (("greedy", ckpt, ()), ("sampled", ckpt, SAMPLING),
                                       ("greedy with a stop", stopping, ())):
            out = os.path.join(workdir, f"batch_{P}.jsonl")
            proc = subprocess.run([*launcher, ringflex, "generate", "--model", model_dir, "--in", batch_path,
                                   "--max-new-tokens", str(NEW_TOKENS), "--out", out, *extra],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                failures.append(f"batch {mode} P={P}: exit {proc.returncode}: {proc.stderr.strip()[-400:]}")
                continue
            with open(out) as f:
                records = [json.loads(line) for line in f]
            expected = [alone[mode.split()[0], r] for r in range(rows.shape[0])]
            if mode == "greedy with a stop":
                expected = [cut(t) for t in expected]
            got = [rec["token_ids"] for rec in records]
            if got != expected:
                failures.append(f"batch {mode} P={P}: rows' tokens {got}, alone {expected}")
            streamed = "".join(f"[{r}]" + "".join(f" {t}" for t in toks) + "\n" for r, toks in enumerate(expected))
            if proc.stdout != streamed:
                failures.append(f"batch {mode} P={P}: streamed {proc.stdout!r}, expected {streamed!r}")
    lengths = sorted(len(cut(alone["greedy", r])) for r in range(rows.shape[0]))
    print(f"batch          3 rows decoded together give their tokens alone (greedy, seeded sampling, a stop after "
          f"{lengths} tokens) at P = {describe(runs)}")


# A bf16 cache's logits against the float32 cache's. Each cached K and V element is rounded to bf16 (relative error
# at most 2^-9 = 2.0e-3); a score moves by at most that fraction of |q||k| scale and the output by that fraction of the
# values it averages, so a layer's attention output is within about 2 * 2^-9 relative. The tiny configs have 4
# layers, each reading a rounded cache (KV-shared ones their source's): 4 * 2 * 2^-9 (~1.6e-2) relative per step's
# logits if the errors add through the residual stream (measured: ~5e-3 dense, ~1e-2 E2B-like); a wrong cache read is
# O(1).
BF16_CACHE_TOL = 8 * 2.0 ** -9


def bf16_cache_case(ringflex, runs, workdir, failures):
    """--cache-dtype bfloat16 under float32 compute (stored rounded, widened when read): each step's logits within
    BF16_CACHE_TOL of the float32 cache's, the same greedy tokens up to a step whose two largest logits are closer than
    that (then the runs may part: compared up to it), the same tokens at every P, and at P = 1 the cache's bytes the
    formula's with 2-byte elements (what the memory check computes): half the K/V bytes of the float32 cache."""
    for name in ("dense", "small"):
        gen = torch.Generator().manual_seed(1357)
        cfg, model, _, _, _, _, ckpt, batch_path = build(name, False, workdir, gen)
        base, base_logits, error = run_generate(ringflex, runs[0], ckpt, batch_path, workdir, f"f32cache_{name}")
        if error:
            failures.append(f"bf16 cache {name}: the float32 run: {error}")
            continue
        worst, first = 0.0, None
        for launcher in runs:
            P = ranks_of(launcher)
            tag = f"bf16 cache {name} P={P}"
            record, logits, error = run_generate(ringflex, launcher, ckpt, batch_path, workdir, f"bf16cache_{name}_{P}",
                                                 ["--cache-dtype", "bfloat16"])
            if error:
                failures.append(f"{tag}: {error}")
                continue
            for i in range(min(len(record["token_ids"]), len(base["token_ids"]))):
                err = float((logits[i].double() - base_logits[i].double()).norm() / base_logits[i].double().norm())
                worst = max(worst, err)
                if err > BF16_CACHE_TOL:
                    failures.append(f"{tag}: step {i}: logits {err:.2e} from the float32 cache's")
                    break
                if record["token_ids"][i] != base["token_ids"][i]:
                    top = torch.topk(base_logits[i].double(), 2).values
                    if float(top[0] - top[1]) > BF16_CACHE_TOL * float(base_logits[i].abs().max()):
                        failures.append(f"{tag}: step {i}: token {record['token_ids'][i]}, float32 cache "
                                        f"{base['token_ids'][i]}")
                    break
            if first is None:
                first = record["token_ids"]
            elif record["token_ids"] != first:
                failures.append(f"{tag}: tokens differ from the first run's")
            if P == 1:
                want = expected_cache_bytes(model, cfg, PROMPT, NEW_TOKENS, 2)
                if record["cache_bytes"] != want or base["cache_bytes"] != expected_cache_bytes(model, cfg, PROMPT,
                                                                                                NEW_TOKENS):
                    failures.append(f"{tag}: cache {record['cache_bytes']} bytes (float32 {base['cache_bytes']}), "
                                    f"expected {want}")
        print(f"bf16 cache     {name}: logits within {worst:.1e} of the float32 cache's (tolerance "
              f"{BF16_CACHE_TOL:.1e}), the same tokens at P = {describe(runs)}, cache bytes as the formula")


def bytes_of(line, term):
    """The bytes of memory-check term `term` in an error line ("... (weights 123 B, KV cache ...")."""
    m = re.search(rf"(?:\(|, ){re.escape(term)} (\d+) B[,)]", line)
    return int(m.group(1)) if m else None


def ep_case(ringflex, runs, workdir, failures):
    """--ep E on the MoE config (4 experts, top-2): each rank holds its EP rank's experts only. At every P > 1 of
    `runs` and every E dividing P and the experts: the greedy and seeded sampled tokens of P = 1 without EP, every
    step's logits within REL_TOL of P = 1's (the cross-P rounding of attention) and bit for bit those of the same P
    at ep 1 (EP moves rows, never changes a sum); a LoRA adapter with the experts adapted too (target_parameters)
    the same. The memory check counts E / ep experts: its weights term falls by (ep - 1) / ep of the experts' bytes.
    A bad --ep (not dividing the ranks, not dividing the experts, a dense model) is one error line on every rank."""
    gen = torch.Generator().manual_seed(1357)
    cfg, model, ids, _, _, _, ckpt, batch_path = build("moe", False, workdir, gen)
    experts = cfg.num_experts
    expert_bytes = 4 * sum(p.numel() for n, p in model.named_parameters()
                           if n.endswith("experts.gate_up_proj") or n.endswith("experts.down_proj"))
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj"],
        target_parameters=["experts.gate_up_proj", "experts.down_proj"], task_type="CAUSAL_LM"))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    adapter = os.path.join(workdir, "adapter_moe_experts")
    peft_model.save_pretrained(adapter)
    modes = {"greedy": (), "sampled": SAMPLING, "lora": ("--lora", adapter)}
    base = {}  # mode -> (tokens, logits) at P = 1 without --ep
    for mode, extra in modes.items():
        record, logits, error = run_generate(ringflex, [], ckpt, batch_path, workdir, f"ep_base_{mode}", extra)
        if error:
            failures.append(f"ep: P=1 {mode}: {error}")
            return
        base[mode] = (record["token_ids"], logits)
    worst, shown = 0.0, []
    for launcher in runs:
        P = ranks_of(launcher)
        if P == 1:
            continue
        for mode, extra in modes.items():
            same_p = None  # the logits at this P with every expert local
            for ep in [e for e in range(1, P + 1) if P % e == 0 and experts % e == 0]:
                tag = f"ep: P={P} --ep {ep} {mode}"
                record, logits, error = run_generate(ringflex, launcher, ckpt, batch_path, workdir,
                                                     f"ep_{P}_{ep}_{mode}", (*extra, "--ep", str(ep)))
                if error:
                    failures.append(f"{tag}: {error}")
                    continue
                if record["token_ids"] != base[mode][0]:
                    failures.append(f"{tag}: tokens differ from P = 1's")
                n = min(len(logits), len(base[mode][1]))
                err = float((logits[:n].double() - base[mode][1][:n].double()).norm(dim=1).div(
                    base[mode][1][:n].double().norm(dim=1)).max())
                worst = max(worst, err)
                if err > REL_TOL:
                    failures.append(f"{tag}: logits {err:.2e} from P = 1's (tolerance {REL_TOL})")
                if ep == 1:
                    same_p = logits
                elif same_p is not None and not torch.equal(logits, same_p):
                    failures.append(f"{tag}: logits not bit for bit those of --ep 1 at P = {P}")
                if ep > 1 and mode == "greedy":
                    shown.append(f"{P}x{ep}")
    # The memory check: its weights term per rank, from the error line a 1-byte limit gives.
    weights = {}
    for launcher in runs:
        P = ranks_of(launcher)
        for ep in [e for e in (1, P) if P % e == 0 and experts % e == 0]:
            proc = subprocess.run([*launcher, ringflex, "generate", "--model", ckpt, "--in", batch_path,
                                   "--max-new-tokens", "4", "--ep", str(ep)], capture_output=True, text=True,
                                  env={**os.environ, "RINGFLEX_MEMORY_LIMIT": "1"})
            lines = error_lines(proc)
            got = bytes_of(lines[0], "weights") if lines else None
            if proc.returncode == 0 or len(lines) != P or got is None:
                failures.append(f"ep: memory check P={P} --ep {ep}: exit {proc.returncode}, error lines {lines}")
                continue
            weights[P, ep] = got
    for (P, ep), got in weights.items():
        want = weights.get((1, 1), 0) - expert_bytes * (ep - 1) // ep
        if got != want:
            failures.append(f"ep: memory check P={P} --ep {ep}: weights {got} B a rank, expected {want} "
                            f"(P = 1's less {ep - 1}/{ep} of the experts' {expert_bytes} B)")
    # Bad --ep: one line on every rank, before any work.
    two = next((launcher for launcher in runs if ranks_of(launcher) == 2), None)
    if two is not None:
        three = [*two[:two.index("-n") + 1], "3", *two[two.index("-n") + 2:]]
        dense = build("dense", False, workdir, gen)[6]
        for launcher, model_dir, ep, want in ((two, ckpt, 3, "--ep 3 does not divide the 2 rank(s) of this job"),
                                              (three, ckpt, 3, "--ep 3 does not divide the model's 4 experts"),
                                              (two, dense, 2, "--ep 2 needs a model with MoE layers "
                                                              "(enable_moe_block)")):
            P = ranks_of(launcher)
            proc = subprocess.run([*launcher, ringflex, "generate", "--model", model_dir, "--in", batch_path,
                                   "--max-new-tokens", "4", "--ep", str(ep)], capture_output=True, text=True)
            lines = error_lines(proc)
            if proc.returncode == 0 or len(lines) != P or len(set(lines)) != 1 or not lines[0].endswith(want):
                failures.append(f"ep: --ep {ep} at P={P}: exit {proc.returncode}, error lines {lines}, want {want!r}")
    print(f"ep             greedy, seeded sampled and LoRA (experts adapted) tokens of P = 1 at P x ep = "
          f"{', '.join(shown)} (logits within {worst:.1e}, bit for bit those of ep 1 at the same P); memory "
          f"check's weights a rank {sorted(weights.items())}; bad --ep refused on every rank")


def main():
    if len(sys.argv) < 2:
        raise SystemExit("usage: generate_parity.py RINGFLEX [LAUNCHER... | --ranks P... -- MPIEXEC...]")
    ringflex, runs = sys.argv[1], launchers(sys.argv[2:])
    failures = []
    with tempfile.TemporaryDirectory() as workdir:
        if os.environ.get("GENERATE_PARITY_CASE") == "ep":  # its own CTest, as batch
            ep_case(ringflex, runs, workdir, failures)
            for f in failures:
                print("FAIL", f)
            return 1 if failures else 0
        if os.environ.get("GENERATE_PARITY_CASE") == "batch":  # its own CTest: the others take CTest's timeout
            batch_case(ringflex, runs, workdir, failures)
            bf16_cache_case(ringflex, runs, workdir, failures)
            for f in failures:
                print("FAIL", f)
            return 1 if failures else 0
        for name, vision in CASES:
            gen = torch.Generator().manual_seed(4321)
            cfg, model, ids, mm, feats, embedder, ckpt, batch_path = build(name, vision, workdir, gen)
            case = f"{name}{'+images' if vision else ''}"
            ref_tokens, ref_logits = (None, None) if vision else reference_generate(model, ids)
            greedy_p1, sampled_p1, worst = None, None, 0.0
            for launcher in runs:
                P = ranks_of(launcher)
                tag = f"{case} P={P}"
                record, logits, error = run_generate(ringflex, launcher, ckpt, batch_path, workdir, f"g_{case}_{P}")
                if error:
                    failures.append(f"{tag}: {error}")
                    continue
                tokens = record["token_ids"]
                if vision and ref_tokens is None:
                    ref_tokens, ref_logits = reference_no_cache(model, cfg, ids, mm, feats, embedder, tokens)
                worst = max(worst, compare(tag, tokens, logits, ref_tokens, ref_logits, failures))
                if greedy_p1 is None:
                    greedy_p1 = tokens
                elif tokens != greedy_p1:
                    failures.append(f"{tag}: greedy tokens differ from the first run's")
                if record["max_sliding_positions"] > cfg.sliding_window:
                    failures.append(f"{tag}: a sliding layer holds {record['max_sliding_positions']} positions")
                if P == 1 and record["cache_bytes"] != expected_cache_bytes(model, cfg, PROMPT, NEW_TOKENS):
                    failures.append(f"{tag}: cache {record['cache_bytes']} bytes, expected "
                                    f"{expected_cache_bytes(model, cfg, PROMPT, NEW_TOKENS)}")
                if (name, vision) not in SAMPLED:
                    continue
                record, _, error = run_generate(ringflex, launcher, ckpt, batch_path, workdir, f"s_{case}_{P}",
                                                SAMPLING)
                if error:
                    failures.append(f"{tag} sampled: {error}")
                    continue
                if sampled_p1 is None:
                    sampled_p1 = record["token_ids"]
                elif record["token_ids"] != sampled_p1:
                    failures.append(f"{tag}: sampled tokens differ from the first run's")
            sampled = " and seeded sampling" if (name, vision) in SAMPLED else ""
            print(f"{case:14s} greedy {NEW_TOKENS} tokens (logits within {worst:.1e}){sampled} at P = "
                  f"{describe(runs)}")
        lora_case(ringflex, runs, workdir, failures)
        text_case(ringflex, runs, workdir, failures)
    for f in failures:
        print("FAIL", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
