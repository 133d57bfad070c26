#!/usr/bin/env python3
"""LoRA parity: ringflex's adapters (model/lora_store.h) against transformers + peft (the versions pinned in
tests/requirements.txt), in float64.

For tiny random Gemma 4 configs (tests/model/parity.py's dense one with attention_k_eq_v, and its MoE one with the
experts left out of the targets) and both scalings (alpha / r, and use_rslora's alpha / sqrt(r)):
  1. peft wraps a random Gemma4ForCausalLM with LoRA on q/k/v/o and gate/up/down, A and B set random (B != 0, so
     every adapter gradient is nonzero), and saves the adapter with save_pretrained (PEFT's own files); the base
     is saved in float32, and once more in bfloat16 (values rounded to bf16 on both sides), which ringflex holds as
     the files have it;
  2. `ringflex forward --model BASE --lora ADAPTER --grad` (through LAUNCHER when given, e.g. mpirun -n 2; with
     `--ranks 1 2 -- MPIEXEC...` at each P against the one peft reference, tests/common/launchers.py) must give
     peft's float64 loss and every adapter gradient, and no gradient of the base;
  3. `ringflex train` with model.lora writes a checkpoint whose adapter directory peft loads with no missing or
     unexpected keys and which then gives the loss ringflex computes with it; the base's files are bit-identical
     after the run; --resume from an earlier checkpoint writes the same adapters and moments bit for bit; under a
     launcher of N ranks (cp N) the losses equal those at cp 1 and at dp N, and so do they with model.lora.dropout
     (masks keyed by the token's global position); `ringflex export --merge` writes the
     base with the adapted weights merged, which plain transformers loads and which gives peft's loss.
  4. `ringflex train` on the MoE config with the experts adapted too (target_parameters, PEFT's nested ParamWrapper
     names) writes an adapter directory that peft loads with no missing or unexpected keys, every tensor of the file
     landing in peft's adapter with its shape and values, and which gives ringflex's loss in float64; its --stats
     count the base as mapped from the files.

Tolerance: 1e-4 relative per tensor, parity.py's (float32 against float64 on these badly conditioned tiny models;
a wrong term shows up at 1e-2 or more).

Exit code 77 (CTest's skip) when torch, transformers, peft or safetensors is missing.
"""
import copy
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from launchers import describe, launchers, ranks_of  # noqa: E402
from oracle_env import missing_oracle  # noqa: E402

try:
    import torch
    import peft
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file, save_file
    from transformers import Gemma4ForCausalLM
    import parity  # noqa: E402  (tests/model/parity.py: configs, random weights, batches)
    from spec_mask import spec_masks
except ImportError as e:
    missing_oracle(e)

REL_TOL = parity.REL_TOL
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EXPERT_TARGETS = ["experts.gate_up_proj", "experts.down_proj"]
RANK, ALPHA = 4, 6.0


def rel_err(mine, ref):
    ref = ref.detach().double()
    return float((mine.double() - ref).norm() / max(float(ref.norm()), 1e-300))


def peft_loss(model, cfg, batch):
    ids, labels, pos, doc, mm = batch
    masks = spec_masks(cfg, doc, mm)
    logits = model(input_ids=ids, attention_mask=masks, position_ids=pos, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, parity.V), labels.reshape(-1), ignore_index=-100)


def write_batch(path, batch):
    ids, labels, pos, doc, _ = batch
    save_file({"input_ids": ids.contiguous(), "labels": labels.contiguous(), "position_ids": pos.contiguous(),
               "doc": doc.to(torch.int32).contiguous()}, path)


def ringflex_forward(ringflex, launcher, base, adapter, batch_path, out_path):
    proc = subprocess.run([*launcher, ringflex, "forward", "--model", base, "--lora", adapter, "--in", batch_path,
                           "--out", out_path, "--grad"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise AssertionError(f"ringflex forward --lora failed: {proc.stderr.strip()}")
    return load_file(out_path)


def grad_case(ringflex, runs, name, rslora, workdir, bf16_base=False, experts=False):
    """Builds the case and peft's reference once; checks `ringflex forward` through every launcher in `runs`."""
    gen = torch.Generator().manual_seed(99)
    cfg = parity.CONFIGS[name](False)
    cfg._attn_implementation = "eager"
    base = Gemma4ForCausalLM(cfg).float()
    base.config._attn_implementation = "eager"
    base.config._experts_implementation = "eager"
    parity.randomize(base, gen)
    base_dir = os.path.join(workdir, f"base_{name}{'_bf16' if bf16_base else ''}")
    if bf16_base:
        # A bf16 checkpoint, which ringflex holds as it is in the files (mapped, never a float32 copy): peft's base
        # has the same values, rounded to bf16 here and widened exactly.
        with torch.no_grad():
            for t in base.state_dict().values():  # the parameters and the saved buffers (layer_scalar)
                if t.is_floating_point():
                    t.copy_(t.to(torch.bfloat16).float())
        # A copy is cast: casting `base` there and back would round its RoPE tables (buffers not in the files) too.
        copy.deepcopy(base).to(torch.bfloat16).save_pretrained(base_dir, safe_serialization=True)
    else:
        base.save_pretrained(base_dir, safe_serialization=True)
    # experts: PEFT's ParamWrapper LoRA on the experts' 3-D weights too (one A_e, B_e per expert).
    model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS,
                                            target_parameters=EXPERT_TARGETS if experts else None,
                                            use_rslora=rslora, task_type="CAUSAL_LM"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                # Of the base's magnitude (parity.randomize: 0.15), so B A moves W by a few percent.
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    adapter_dir = os.path.join(workdir, f"adapter_{name}_{int(rslora)}_{int(experts)}")
    model.save_pretrained(adapter_dir)
    batch = parity.make_batch(gen, False)
    model = model.double()
    loss = peft_loss(model, cfg, batch)
    loss.backward()
    batch_path = os.path.join(workdir, f"batch_{name}.safetensors")
    write_batch(batch_path, batch)
    lora = {n.replace("base_model.model.", "", 1).replace(".default", ""): p.grad
            for n, p in model.named_parameters() if "lora_" in n}
    label = (f"{name:5s} {'rslora' if rslora else 'alpha/r':7s}{' bf16 base' if bf16_base else ''}"
             f"{' expert adapters' if experts else ''}")
    ok = True
    for launcher in runs:
        tag = f"{name}_{int(rslora)}_{int(experts)}_P{ranks_of(launcher)}"
        out = ringflex_forward(ringflex, launcher, base_dir, adapter_dir, batch_path,
                               os.path.join(workdir, f"out_{tag}.safetensors"))
        failures = []
        worst = rel_err(out["loss"].reshape(()), loss)
        if worst > REL_TOL:
            failures.append(f"loss: relative error {worst:.3e}")
        for n, g in lora.items():
            key = "grad." + n
            if key not in out:
                failures.append(f"{key} missing from ringflex's output")
                continue
            err = rel_err(out[key], g)
            worst = max(worst, err)
            if err > REL_TOL:
                failures.append(f"{key}: relative error {err:.3e}")
        extra = sorted(k for k in out if k.startswith("grad.") and k[len("grad."):] not in lora)
        if extra:
            failures.append(f"gradients of the frozen base written: {extra[:3]}")
        where = f"{label} P={ranks_of(launcher)}"
        if failures:
            print(f"FAIL {where}: " + "; ".join(failures[:6]))
            ok = False
            continue
        print(f"ok   {where}: loss and {len(lora)} adapter gradients, worst relative error {worst:.2e}")
    return ok


def digest(directory):
    h = hashlib.sha256()
    for f in sorted(os.listdir(directory)):
        with open(os.path.join(directory, f), "rb") as fh:
            h.update(f.encode() + fh.read())
    return h.hexdigest()


def write_base_and_tokens(gen, name, workdir, suffix):
    """The train cases' inputs: a random base of parity's `name` config saved in float32 (train{suffix}_base) and eight
    token rows of 8 to 19 ids for its tiny vocabulary (tokens{suffix}.jsonl; the mock source needs more than 64
    tokens), drawn from `gen` in that order. Returns (config, base dir, data path)."""
    cfg = parity.CONFIGS[name](False)
    base = Gemma4ForCausalLM(cfg).float()
    parity.randomize(base, gen)
    base_dir = os.path.join(workdir, f"train{suffix}_base")
    base.save_pretrained(base_dir, safe_serialization=True)
    data = os.path.join(workdir, f"tokens{suffix}.jsonl")
    with open(data, "w") as f:
        for _ in range(8):
            n = int(torch.randint(8, 20, (1,), generator=gen))
            f.write(json.dumps({"input_ids": torch.randint(1, parity.V, (n,), generator=gen).tolist()}) + "\n")
    return cfg, base_dir, data


def train_case(ringflex, launcher, workdir):
    gen = torch.Generator().manual_seed(7)
    cfg, base_dir, data = write_base_and_tokens(gen, "dense", workdir, "")
    before = digest(base_dir)
    ranks = ranks_of(launcher)
    config = os.path.join(workdir, "lora.yaml")
    with open(config, "w") as f:
        f.write(f"""model:
  path: {base_dir}
  lora: {{rank: {RANK}, alpha: {ALPHA}, target: [q_proj, v_proj, o_proj, down_proj]}}
data: {{source: jsonl_tokens, path: {data}, val_rows: 0}}
optimizer: {{lr: 0.01}}
parallelism: {{cp: {ranks}}}
train: {{steps: 4, seq_len: 24, global_batch: 2, micro_batch: 1, threads: 1, log_every: 1}}
checkpoint: {{dir: {os.path.join(workdir, "ckpt")}, every: 2, keep: 2}}
""")
    def train(*args, runner=launcher):
        proc = subprocess.run([*runner, ringflex, "train", "--config", config, *args], capture_output=True, text=True)
        if proc.returncode != 0:
            raise AssertionError(f"ringflex train {' '.join(args)} failed: {proc.stderr.strip()[-2000:]}")

    def losses(path):
        with open(path) as f:
            return [json.loads(line)["loss"] for line in f]

    metrics = os.path.join(workdir, "metrics.jsonl")
    train("--metrics", metrics)
    adapter = os.path.join(workdir, "ckpt", "step-00000004")
    failures = []
    # --resume from step 2 gives step 4's adapters and moments bit for bit.
    train("--resume", os.path.join(workdir, "ckpt", "step-00000002"), "--set",
          "checkpoint.dir=" + os.path.join(workdir, "resumed"))
    for f in ("adapter_model.safetensors", "optimizer.safetensors"):
        with open(os.path.join(adapter, f), "rb") as a, \
                open(os.path.join(workdir, "resumed", "step-00000004", f), "rb") as b:
            if a.read() != b.read():
                failures.append(f"--resume: {f} differs from the uninterrupted run's")
    # The same steps at one rank, and at dp 2 (rows split over replicas instead of tokens over CP ranks): float32
    # sums in other orders only (docs/training.md "Batches": ~1e-6 relative over a few steps of this size).
    if ranks > 1:
        for grid in (["--set", f"parallelism.cp=1"], ["--set", "parallelism.cp=1", "--set", f"parallelism.dp={ranks}"]):
            other = os.path.join(workdir, "metrics_other.jsonl")
            train("--metrics", other, "--set", "checkpoint.dir=" + os.path.join(workdir, "other"), *grid,
                  runner=launcher if "parallelism.dp=" + str(ranks) in grid else [])
            a, b = losses(metrics), losses(other)
            if len(a) != len(b) or any(abs(x - y) > 1e-5 * abs(y) for x, y in zip(a, b)):
                failures.append(f"losses at {' '.join(grid[1::2])}: {b} against {a}")
        # model.lora.dropout: its masks depend on the token's global position, not on the CP grid, so cp N and cp 1
        # give the same losses (to the float32 sums' order, as above), and other ones than without dropout.
        dropped = []
        for cp, runner in ((ranks, launcher), (1, [])):
            path = os.path.join(workdir, f"metrics_dropout_{cp}.jsonl")
            train("--metrics", path, "--set", "model.lora.dropout=0.25", "--set", f"parallelism.cp={cp}", "--set",
                  "checkpoint.dir=" + os.path.join(workdir, f"dropout_{cp}"), runner=runner)
            dropped.append(losses(path))
        a, b = dropped
        if len(a) != len(b) or any(abs(x - y) > 1e-5 * abs(y) for x, y in zip(a, b)):
            failures.append(f"dropout: losses at cp {ranks} {a} against cp 1 {b}")
        if a[1:] == losses(metrics)[1:]:
            failures.append("dropout: the losses are those without dropout")
    if digest(base_dir) != before:
        failures.append("the base's files changed")
    fresh = Gemma4ForCausalLM.from_pretrained(base_dir, attn_implementation="eager").double()
    model = PeftModel.from_pretrained(fresh, adapter)
    # PEFT's own load report: every tensor of the file went into an adapter, and every adapter came from the file.
    result = peft.set_peft_model_state_dict(model, peft.utils.load_peft_weights(adapter))
    lora_missing = [k for k in result.missing_keys if "lora_" in k]
    if result.unexpected_keys or lora_missing:
        failures.append(f"peft: unexpected {result.unexpected_keys[:3]}, missing {lora_missing[:3]}")
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        ac = json.load(f)
    if (ac.get("peft_type"), ac.get("task_type"), ac.get("r"), ac.get("lora_alpha")) != ("LORA", "CAUSAL_LM", RANK,
                                                                                          ALPHA):
        failures.append(f"adapter_config.json: {ac}")
    model = model.double()
    batch = parity.make_batch(gen, False)
    loss = peft_loss(model, cfg, batch)
    batch_path = os.path.join(workdir, "batch_train.safetensors")
    write_batch(batch_path, batch)
    out = ringflex_forward(ringflex, launcher, base_dir, adapter, batch_path, os.path.join(workdir, "out_train.st"))
    err = rel_err(out["loss"].reshape(()), loss)
    if err > REL_TOL:
        failures.append(f"loss with the trained adapter: relative error {err:.3e}")
    # export --merge: the full checkpoint with W + scale B A in place of each adapted W gives the same loss through
    # plain transformers, and every other tensor is the base's, bit for bit.
    merged_dir = os.path.join(workdir, "merged")
    proc = subprocess.run([ringflex, "export", "--model", base_dir, "--merge", adapter, "--out", merged_dir],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        failures.append(f"export --merge failed: {proc.stderr.strip()}")
    else:
        merged = Gemma4ForCausalLM.from_pretrained(merged_dir, attn_implementation="eager").double()
        with torch.no_grad():
            merr = rel_err(peft_loss(merged, cfg, batch), loss)
        if merr > REL_TOL:
            failures.append(f"export --merge: loss relative error {merr:.3e}")
        base_tensors = load_file(os.path.join(base_dir, "model.safetensors"))
        merged_tensors = load_file(os.path.join(merged_dir, "model.safetensors"))
        adapted = {m + ".weight" for m in ac["target_modules"]}
        if set(base_tensors) != set(merged_tensors):
            failures.append("export --merge: tensor names differ from the base's")
        for n, t in base_tensors.items():
            same = torch.equal(t, merged_tensors.get(n, torch.empty(0)))
            if same == (n in adapted):
                failures.append(f"export --merge: `{n}` {'unchanged' if same else 'changed'}")
                break
        # Again into the same folder with a sharded checkpoint's index left there: the index (which would shadow the
        # new file) is removed, and the folder loads the merged weights.
        with open(os.path.join(merged_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": {n: "gone.safetensors" for n in merged_tensors}}, f)
        again = subprocess.run([ringflex, "export", "--model", base_dir, "--merge", adapter, "--out", merged_dir],
                               capture_output=True, text=True)
        if again.returncode != 0 or os.path.exists(os.path.join(merged_dir, "model.safetensors.index.json")):
            failures.append(f"export --merge over a stale index: rc {again.returncode}, {again.stderr.strip()}")
    # A full disk at the weights (io::write_all's hook) leaves no config.json behind: both are committed together.
    full_out = os.path.join(workdir, "merged_full")
    proc = subprocess.run([ringflex, "export", "--model", base_dir, "--merge", adapter, "--out", full_out],
                          capture_output=True, text=True,
                          env={**os.environ, "RINGFLEX_FAIL_WRITE": "1:merged_full/model.safetensors"})
    if proc.returncode == 0 or "No space left on device" not in proc.stderr or os.listdir(full_out):
        failures.append(f"export --merge on a full disk: rc {proc.returncode}, left {os.listdir(full_out)}, "
                        f"{proc.stderr.strip()}")
    # A NaN in the adapter is refused by name, and nothing is written (it would be merged into every row of W).
    nan_adapter = os.path.join(workdir, "nan_adapter")
    shutil.copytree(adapter, nan_adapter)
    nan_tensors = load_file(os.path.join(nan_adapter, "adapter_model.safetensors"))
    nan_name = sorted(n for n in nan_tensors if "lora_A" in n)[0]
    nan_tensors[nan_name][0, 1] = float("nan")
    save_file(nan_tensors, os.path.join(nan_adapter, "adapter_model.safetensors"))
    nan_out = os.path.join(workdir, "merged_nan")
    proc = subprocess.run([ringflex, "export", "--model", base_dir, "--merge", nan_adapter, "--out", nan_out],
                          capture_output=True, text=True)
    errors = [x for x in proc.stderr.splitlines() if x.startswith("ringflex: error:")]
    module = nan_name[len("base_model.model."):-len(".lora_A.weight")]
    if (proc.returncode == 0 or len(errors) != 1 or f"the merged `{module}.weight` has " not in errors[0]
            or "nan at [" not in errors[0] or os.path.exists(os.path.join(nan_out, "model.safetensors"))):
        failures.append(f"export --merge of a NaN adapter: rc {proc.returncode}, {proc.stderr.strip()}")
    trained = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    if all(float(t.abs().max()) == 0 for n, t in trained.items() if "lora_B" in n):
        failures.append("the adapters' B did not train")
    if failures:
        print("FAIL train: " + "; ".join(failures))
        return False
    print(f"ok   train: peft loads the adapter ({len(trained)} tensors, no missing or unexpected keys), "
          f"loss relative error {err:.2e}, base unchanged, resume bit-exact, export --merge loads in transformers")
    return True


def train_experts_case(ringflex, launcher, workdir, ep=1):
    """`ringflex train` on the tiny MoE config with the experts' 3-D weights adapted (target_parameters) beside the
    attention: the adapter directory it writes must load in peft with no missing or unexpected keys (the experts'
    nested ParamWrapper names included) and give, in float64, the loss ringflex computes with it. With ep > 1 each
    rank holds and trains its experts' adapters only, and the writer gathers every expert's into PEFT's layout."""
    gen = torch.Generator().manual_seed(11)
    cfg, base_dir, data = write_base_and_tokens(gen, "moe", workdir, "_moe")
    ranks = ranks_of(launcher)
    ckpt = os.path.join(workdir, "ckpt_moe")
    config = os.path.join(workdir, "lora_moe.yaml")
    with open(config, "w") as f:
        f.write(f"""model:
  path: {base_dir}
  lora: {{rank: {RANK}, alpha: {ALPHA}, target: [q_proj, o_proj], target_parameters: {EXPERT_TARGETS}}}
data: {{source: jsonl_tokens, path: {data}, val_rows: 0}}
optimizer: {{lr: 0.01}}
parallelism: {{cp: {ranks}, ep: {ep}}}
train: {{steps: 2, seq_len: 24, global_batch: 2, micro_batch: 1, threads: 1, log_every: 1}}
checkpoint: {{dir: {ckpt}, every: 2, keep: 1}}
""")
    stats = os.path.join(workdir, "stats_moe.json")
    proc = subprocess.run([*launcher, ringflex, "train", "--config", config, "--stats", stats], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        print(f"FAIL train experts (ep {ep}): ringflex train failed: {proc.stderr.strip()[-2000:]}")
        return False
    adapter = os.path.join(ckpt, "step-00000002")
    failures = []
    # --stats counts the base as the run holds it, mapped from the files (not as float32 weights of each rank).
    with open(stats) as f:
        kinds = [t["kind"] for t in json.load(f)["memory_per_rank"]["terms"]]
    if not any(k.startswith("LoRA base, mapped") for k in kinds):
        failures.append(f"--stats: no mapped LoRA base among {kinds}")
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        ac = json.load(f)
    if sorted(ac.get("target_parameters") or []) != sorted(
            f"model.layers.{i}.{t}" for i in range(cfg.num_hidden_layers) for t in EXPERT_TARGETS):
        failures.append(f"adapter_config.json target_parameters: {ac.get('target_parameters')}")
    fresh = Gemma4ForCausalLM.from_pretrained(base_dir, attn_implementation="eager").double()
    fresh.config._experts_implementation = "eager"
    model = PeftModel.from_pretrained(fresh, adapter)
    result = peft.set_peft_model_state_dict(model, peft.utils.load_peft_weights(adapter))
    lora_missing = [k for k in result.missing_keys if "lora_" in k]
    if result.unexpected_keys or lora_missing:
        failures.append(f"peft: unexpected {result.unexpected_keys[:3]}, missing {lora_missing[:3]}")
    trained = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    experts_b = [n for n in trained if ".experts." in n and "lora_B" in n]
    if not experts_b or all(float(trained[n].abs().max()) == 0 for n in experts_b):
        failures.append(f"the experts' B did not train ({len(experts_b)} tensors)")
    # Every adapter tensor of the file is one of peft's, with its values (no silent drop or reshape on load).
    state = {n.replace("base_model.model.", "", 1).replace(".default", ""): p
             for n, p in model.named_parameters() if "lora_" in n}
    for n, t in trained.items():
        p = state.get(n.replace("base_model.model.", "", 1))
        if p is None or tuple(p.shape) != tuple(t.shape) or not torch.equal(p.detach().float(), t.float()):
            what = "absent" if p is None else (f"shape {tuple(p.shape)} against {tuple(t.shape)}" if tuple(
                p.shape) != tuple(t.shape) else f"max difference {float((p.detach().float() - t).abs().max()):.3e}")
            failures.append(f"peft's `{n}` is not the file's: {what}")
            break
    model = model.double()
    batch = parity.make_batch(gen, False)
    with torch.no_grad():
        loss = peft_loss(model, cfg, batch)
    batch_path = os.path.join(workdir, "batch_train_moe.safetensors")
    write_batch(batch_path, batch)
    out = ringflex_forward(ringflex, launcher, base_dir, adapter, batch_path, os.path.join(workdir, "out_moe.st"))
    err = rel_err(out["loss"].reshape(()), loss)
    if err > REL_TOL:
        failures.append(f"loss with the trained adapter: relative error {err:.3e}")
    if failures:
        print(f"FAIL train experts (ep {ep}): " + "; ".join(failures))
        return False
    print(f"ok   train experts (ep {ep}): peft loads the adapter ({len(trained)} tensors, {len(experts_b)} experts' "
          f"B, no missing or unexpected keys), loss relative error {err:.2e}")
    return True


def main():
    if len(sys.argv) < 2:
        print("usage: lora_parity.py PATH/TO/ringflex [LAUNCHER... | --ranks P... [-- MPIEXEC...]]")
        return 2
    ringflex, runs = sys.argv[1], launchers(sys.argv[2:])
    torch.set_num_threads(1)
    print(f"peft {peft.__version__}, torch {torch.__version__}, at P = {describe(runs)}")
    ok = True
    with tempfile.TemporaryDirectory() as workdir:
        for name, rslora, bf16_base, experts in (("dense", False, False, False), ("dense", True, False, False),
                                                 ("moe", False, False, False), ("small", False, False, False),
                                                 ("dense", False, True, False), ("moe", False, True, False),
                                                 ("moe", False, False, True), ("moe", True, True, True)):
            ok = grad_case(ringflex, runs, name, rslora, workdir, bf16_base, experts) and ok
        for launcher in runs:
            with tempfile.TemporaryDirectory(dir=workdir) as train_dir:
                ok = train_case(ringflex, launcher, train_dir) and ok
                ok = train_experts_case(ringflex, launcher, train_dir) and ok
            if ranks_of(launcher) > 1:  # the experts' adapters placed over the ranks (parallelism.ep)
                with tempfile.TemporaryDirectory(dir=workdir) as train_dir:
                    ok = train_experts_case(ringflex, launcher, train_dir, ep=ranks_of(launcher)) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
