#!/usr/bin/env python3
"""LoRA fine-tuning of Gemma 4 E2B at its real shape (issue 23's target), beside PyTorch + peft: one command.

  1. Model. If WORKDIR/e2b has no config.json, writes Gemma 4 E2B as transformers configures it (35 layers, hidden
     1536, per-layer embeddings 256 wide, KV sharing over the last 20 layers, double-wide MLPs there, vocabulary
     262144; 4.63 B parameters of the text model, 8.6 GiB) with random bf16 weights: Gemma4ForCausalLM is built on
     the meta device, then each module in turn is made real in bf16 on the CPU, initialised by transformers' own
     _init_weights, written into safetensors shards (model-0000k-of-0000n.safetensors + the index, as
     save_pretrained lays them out) and dropped again. Never a float32 copy, and never more than one module's
     tensors at a time (the largest, the per-layer embedding table, is 4.7 GB). Rows of random token ids beside it.
  2. ringflex. `mpirun -n 2 ringflex train` on examples/gemma4_e2b_lora.yaml (rank 16 on q/k/v/o and gate/up/down,
     CP = 2, what the backward recomputes chosen by the memory check; --set overrides a field) over rows of
     --seq-len tokens (8192) for --steps steps (3), one row a step. Its progress lines pass
     through; every --report-every seconds a line with the ranks' memory. Then each step's loss and tokens/s, each
     rank's peak RSS (VmHWM: the mapped base's pages count in each rank's), and the machine's peak with the base
     counted once: the largest sum over the ranks of their PSS (proportional set size: a page mapped by both ranks
     counts half in each), sampled every --sample-s seconds, beside the issue's target (base bytes + 30% +
     activations).
  3. PyTorch + peft on the same model and rows: Gemma4ForCausalLM.from_pretrained in bf16 with SDPA attention, the
     same LoRA (peft), one AdamW step under bf16 autocast at each row length from --torch-min-len (512), doubled up
     to --seq-len, in one child process (the model loaded once) with --torch-timeout seconds in all. Before each
     length the child predicts its peak private memory (RssAnon) from the growth the shorter rows measured and does
     not run a length predicted past --torch-mem-gib (default: what this machine had available when it started, less
     1 GiB): at 8192 tokens PyTorch keeps every layer's activations and runs out of memory part-way, minutes in. A
     child whose private memory passes the cap anyway is stopped, as is one the kernel kills. The report names the
     longest row that ran (loss, tokens/s, peak memory) and the length that runs out of memory (measured, or
     predicted and not run).
  The memory model comes first (it reads shapes only): the longest row a ringflex step fits in on this machine
  (bench/model/lora_longest_row: the figure `ringflex train` checks before it allocates), and at the end, with
  --verify-longest, one step at that length, with the same measurements as 2.

Run it alone on the machine (it needs most of its 24 GiB; timings beside other work mean nothing):

    python3 bench/model/bench_lora_e2b.py --ringflex build/src/cli/ringflex \\
        --longest-row build/bench/model/lora_longest_row --workdir /work/tmp/e2b_lora --verify-longest

--tiny builds the same structure at a toy size (4 layers, hidden 256, vocabulary 4096, rows of 512 tokens) to check
the driver end to end in a minute. Not in CTest: at the real shape it writes 8.6 GiB and runs for about 1.5 h
(BENCHMARKS.md).
"""
import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REAL = dict(vocab_size=262144, hidden_size=1536, num_hidden_layers=35, num_attention_heads=8, num_key_value_heads=1,
            intermediate_size=6144, use_double_wide_mlp=True, hidden_size_per_layer_input=256,
            num_kv_shared_layers=20, layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7,
            final_logit_softcapping=30.0)
# Four layers: KV sharing needs each shared layer's type among the layers before the shared ones.
TINY = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
            head_dim=64, global_head_dim=128, intermediate_size=512, use_double_wide_mlp=True,
            hidden_size_per_layer_input=64, vocab_size_per_layer_input=4096, num_kv_shared_layers=2,
            layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=128, final_logit_softcapping=30.0)
TINY_SEQ_LEN = 512
REAL_LAYERS = 35


def cut_down(layers):
    """E2B's real widths (hidden 1536, D 256 sliding / 512 full, MLP 6144 and its double width on KV-shared layers,
    per-layer inputs 256) with `layers` decoder layers: REAL's first layer types (4 sliding, then a full one, ...),
    the last one full as transformers requires, KV sharing over the last min(layers - 5, round(layers * 20 / 35)) layers
    (a shared layer reads the KV of the last unshared layer of its type, so the first 5 stay unshared), and the
    vocabulary scaled with the layer count (262144 * layers / 35, a multiple of 256) so that the head's share of a
    step's FLOPs stays near the real model's (the report prints each part's share: 14.8% at 6 layers, 14.3% real)."""
    if layers < 5:
        raise SystemExit("--layers: at least 5 (4 sliding layers and a full one, E2B's mix)")
    vocab = max(256, REAL["vocab_size"] * layers // REAL_LAYERS // 256 * 256)
    types = list(REAL["layer_types"][:layers - 1]) + ["full_attention"]
    return dict(REAL, num_hidden_layers=layers, layer_types=types,
                num_kv_shared_layers=max(0, min(layers - 5, round(layers * 20 / REAL_LAYERS))), vocab_size=vocab,
                vocab_size_per_layer_input=vocab)


# examples/gemma4_e2b_lora.yaml's adapters, which the PyTorch side copies.
LORA_RANK, LORA_ALPHA = 16, 32
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_SHARD_BYTES = 2 * 2**30  # transformers' shards are a few GB; a tensor larger than this has a file of its own
GiB = 2**30
ST_DTYPES = {"torch.bfloat16": "BF16", "torch.float16": "F16", "torch.float32": "F32", "torch.int64": "I64",
             "torch.int32": "I32", "torch.bool": "BOOL"}


def log(msg):
    print(f"[bench_lora_e2b {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- 1. The model and the rows ---

def write_model(path, fields):
    """Random bf16 weights at `fields`' shape, module by module (see the top of this file)."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig
    cfg = Gemma4TextConfig(**fields)
    cfg.architectures = ["Gemma4ForCausalLM"]
    cfg.dtype = "bfloat16"
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = Gemma4ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    # What save_pretrained writes: the state dict less the head tied to the embedding.
    names = [n for n in model.state_dict() if not (cfg.tie_word_embeddings and n == "lm_head.weight")]
    modules = dict(model.named_modules())
    groups = {}  # module name -> its tensors' names, in state-dict order
    for n in names:
        groups.setdefault(n.rpartition(".")[0], []).append(n)
    meta = model.state_dict()
    nbytes = {n: meta[n].numel() * meta[n].element_size() for n in names}
    shards, size = [[]], 0
    for mod, tensors in groups.items():
        b = sum(nbytes[n] for n in tensors)
        if shards[-1] and size + b > MAX_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(mod)
        size += b
    os.makedirs(path, exist_ok=True)
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for mod in shard:
            for n in groups[mod]:
                t = meta[n]
                header[n] = {"dtype": ST_DTYPES[str(t.dtype)], "shape": list(t.shape),
                             "data_offsets": [offset, offset + nbytes[n]]}
                offset += nbytes[n]
                weight_map[n] = file
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-aligned, as safetensors writes it
        with open(os.path.join(path, file + ".tmp"), "wb") as f:
            f.write(len(text).to_bytes(8, "little") + text)
            for mod in shard:
                module = modules[mod]
                module.to_empty(device="cpu", recurse=False)  # this module's tensors alone, in their bf16
                model._init_weights(module)
                state = module.state_dict(prefix=mod + "." if mod else "")
                for n in groups[mod]:
                    state[n].detach().contiguous().view(torch.uint8).numpy().tofile(f)
                module.to_empty(device="meta", recurse=False)
        os.replace(os.path.join(path, file + ".tmp"), os.path.join(path, file))
        total += offset
        log(f"wrote {file} ({offset / GiB:.2f} GiB)")
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    cfg.save_pretrained(path)  # config.json last: its presence marks a complete model
    log(f"wrote {path}: {sum(meta[n].numel() for n in names) / 1e9:.2f} B parameters, {total / GiB:.2f} GiB of bf16")


def base_bytes(model_dir):
    return sum(os.path.getsize(os.path.join(model_dir, f)) for f in os.listdir(model_dir) if f.endswith(".safetensors"))


def rows_path(workdir, vocab, seq_len, rows):
    """Rows of random token ids, the same first rows at any count (one seed): PyTorch's row is ringflex's first."""
    return os.path.join(workdir, f"rows_{vocab}_{seq_len}_{rows}.jsonl")


def write_rows(path, vocab, seq_len, rows):
    if os.path.exists(path):
        return
    rng = random.Random(0)
    with open(path + ".tmp", "w") as f:
        for _ in range(rows):
            f.write(json.dumps({"input_ids": [rng.randrange(1, vocab) for _ in range(seq_len)]}) + "\n")
    os.replace(path + ".tmp", path)


# --- The step's FLOPs ---

def step_flops(fields, seq_len):
    """FLOPs of one LoRA step on one row of seq_len tokens (both ranks together), from the model's Linear shapes (a
    meta-device Gemma4ForCausalLM, no memory). Model FLOPs (the MFU's numerator, what any implementation must do):
    the frozen base's products forward and their input gradients (2 x 2 x MACs; no weight gradients for the base),
    per_layer_model_projection forward only (its input, the embedding, is frozen: nothing flows back through it), the
    tied head forward and its input gradient (2 x 2 x V x H), the adapters forward, input and weight gradients (3 x 2
    x r (in + out)), and attention forward (QK^T and PV over the allowed pairs) plus its backward at 2.5x
    (bench_model.py's BACKWARD_FLOP_FACTOR). With train.recompute ringflex also redoes the decoder layers' base
    products in the backward (2 x MACs more, adapters with them) but the ones the run keeps: `recompute_macs` has
    each kind's MACs a token (o_proj, down_proj, mlp: gate and up, other), and with_recompute() the count for the
    run's choice (the ~1.2e14 of a real-shape step in BENCHMARKS.md is the count with nothing kept)."""
    import torch
    from bench_model import BACKWARD_FLOP_FACTOR, allowed_pairs
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig
    cfg = Gemma4TextConfig(**fields)
    with torch.device("meta"):
        model = Gemma4ForCausalLM(cfg)
    layer_macs, lora_macs, top_macs = 0, 0, 0
    recompute_macs = {"o_proj": 0, "down_proj": 0, "mlp": 0, "other": 0}  # a token, base and adapters together
    attention = 0.0
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear) or name == "lm_head":
            continue
        if ".layers." in name:
            layer_macs += mod.in_features * mod.out_features
            leaf = name.rpartition(".")[2]
            adapter = LORA_RANK * (mod.in_features + mod.out_features) if leaf in LORA_TARGETS else 0
            lora_macs += adapter
            kind = leaf if leaf in ("o_proj", "down_proj") else "mlp" if leaf in ("gate_proj", "up_proj") else "other"
            recompute_macs[kind] += mod.in_features * mod.out_features + adapter
        else:
            top_macs += mod.in_features * mod.out_features  # per_layer_model_projection
    heads = fields["num_attention_heads"]
    for i, layer in enumerate(model.model.layers):
        D = layer.self_attn.q_proj.out_features // heads
        sliding = cfg.layer_types[i] == "sliding_attention"
        pairs = allowed_pairs(seq_len, fields.get("sliding_window", 512) if sliding else 0)
        attention += (1.0 + BACKWARD_FLOP_FACTOR) * 4.0 * heads * D * pairs
    head_macs = fields["vocab_size"] * fields["hidden_size"]
    T = seq_len
    parts = {"base layers": 4.0 * layer_macs * T, "per-layer input projection": 2.0 * top_macs * T,
             "head": 4.0 * head_macs * T, "adapters": 6.0 * lora_macs * T, "attention": attention}
    model_total = sum(parts.values())
    return {"parts": parts, "model": model_total, "recompute_macs": recompute_macs, "tokens": T,
            "with_recompute": model_total + 2.0 * sum(recompute_macs.values()) * T}  # nothing kept


def with_recompute(flops, recompute):
    """The step's FLOPs with what its backward recomputes: `recompute` as `ringflex train --stats` writes it (layers,
    keep_mlp, keep_o_proj, keep_down_proj), every kept product's MACs left out."""
    if not recompute.get("layers", True):
        return flops["model"]
    kept = {"o_proj": recompute.get("keep_o_proj"), "down_proj": recompute.get("keep_down_proj"),
            "mlp": recompute.get("keep_mlp"), "other": False}
    macs = sum(v for k, v in flops["recompute_macs"].items() if not kept[k])
    return flops["model"] + 2.0 * macs * flops["tokens"]


def measure_child(kind, arg):
    """bench_model.py imports torch (~0.4 GiB): the parent stays small (at the real shape the machine's memory is the
    ringflex ranks'), so the FLOP count and each sgemm reading run in a child of this script; returns its JSON."""
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--measure-child", kind, arg], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


def measure(kind, arg):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if kind == "sgemm":  # bench_model.py's 1-thread cblas_sgemm of the OpenBLAS ringflex (arg) links, N = 1024
        from bench_model import Sgemm, cpu_name
        sgemm = Sgemm(arg)
        return {"gflops": sgemm.gflops(), "core": sgemm.core, "cpu": cpu_name()}
    fields, seq_len = json.loads(arg)
    return step_flops(fields, seq_len)


# --- Memory of a process tree, sampled ---

def descendants(root):
    children = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(pid))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def proc_name(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def kib_fields(path, keys):
    out = {}
    try:
        with open(path) as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in keys:
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


class Sampler(threading.Thread):
    """Every `period` seconds: the RSS, PSS and peak RSS of the processes named `name` under `root`; keeps each one's
    peaks and the peak of their PSS sum (shared pages counted once over them)."""

    def __init__(self, root, name, period, report_every, label):
        super().__init__(daemon=True)
        self.root, self.name, self.period, self.report_every, self.label = root, name, period, report_every, label
        self.stop = threading.Event()
        self.peak_hwm, self.peak_pss, self.peak_anon = {}, {}, {}
        self.peak_pss_sum = 0
        self.last, self.last_anon = {}, {}

    def sample(self):
        pss_sum = 0
        for pid in descendants(self.root):
            if proc_name(pid) != self.name:
                continue
            s = kib_fields(f"/proc/{pid}/status", ("VmHWM", "VmRSS", "RssAnon"))
            r = kib_fields(f"/proc/{pid}/smaps_rollup", ("Pss",))
            if not s or not r:
                continue
            self.peak_hwm[pid] = max(self.peak_hwm.get(pid, 0), s.get("VmHWM", 0))
            self.peak_anon[pid] = max(self.peak_anon.get(pid, 0), s.get("RssAnon", 0))
            self.peak_pss[pid] = max(self.peak_pss.get(pid, 0), r["Pss"])
            self.last[pid] = s.get("VmRSS", 0)
            self.last_anon[pid] = s.get("RssAnon", 0)
            pss_sum += r["Pss"]
        self.peak_pss_sum = max(self.peak_pss_sum, pss_sum)
        return pss_sum

    def run(self):
        next_report = time.time() + self.report_every
        while not self.stop.wait(self.period):
            pss_sum = self.sample()
            if time.time() >= next_report:
                next_report += self.report_every
                rss = " + ".join(f"{v / GiB:.2f}" for v in self.last.values())
                log(f"{self.label}: RSS {rss or '-'} GiB, PSS sum {pss_sum / GiB:.2f} GiB "
                    f"(peak {self.peak_pss_sum / GiB:.2f})")


# --- 2. ringflex ---

def memory_env(a):
    """The environment of ringflex and lora_longest_row: --memory-gib as RINGFLEX_MEMORY_LIMIT (both check the same
    budget then)."""
    env = dict(os.environ)
    if a.memory_gib:
        env["RINGFLEX_MEMORY_LIMIT"] = str(int(a.memory_gib * GiB))
    return env


def run_ringflex(a, model_dir, rows, seq_len, steps, tag):
    config = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "gemma4_e2b_lora.yaml")
    metrics = os.path.join(a.workdir, f"metrics_{tag}.jsonl")
    stats = os.path.join(a.workdir, f"stats_{tag}.json")
    for f in (metrics, stats):
        if os.path.exists(f):
            os.remove(f)
    sets = {"model.path": model_dir, "data.path": rows, "data.val_rows": 0, "train.steps": steps,
            "train.seq_len": seq_len, "train.global_batch": 1, "train.threads": a.threads,
            "parallelism.cp": a.cp, "checkpoint.dir": os.path.join(a.workdir, f"ckpt_{tag}"), "checkpoint.every": steps}
    # --perf: each rank under `perf record -g`, into PREFIX.RANK (perf report -i PREFIX.0 --sort sym).
    perf = ["sh", "-c", 'exec perf record -q -g -o "$0.$OMPI_COMM_WORLD_RANK" "$@"', a.perf] if a.perf else []
    cmd = ["mpirun", "--oversubscribe", *a.mpi_arg, "-n", str(a.cp), *perf, a.ringflex, "train", "--config", config,
           "--metrics", metrics, "--stats", stats, "--timeout", str(a.timeout)]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    for kv in a.set:
        cmd += ["--set", kv]
    env = dict(memory_env(a), OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    log("ringflex: " + " ".join(cmd))
    sgemm = [measure_child("sgemm", a.ringflex)]  # the same minutes' 1-thread sgemm, before and after the run
    start = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    sampler = Sampler(proc.pid, "ringflex", a.sample_s, a.report_every, f"ringflex {tag}")
    sampler.start()
    for line in proc.stdout:
        print(f"  | {line.rstrip()}", flush=True)
    rc = proc.wait()
    sampler.stop.set()
    sampler.join()
    wall = time.time() - start
    sgemm.append(measure_child("sgemm", a.ringflex))
    if rc != 0:
        log(f"ringflex {tag}: exit code {rc} after {wall:.0f} s")
        return None
    with open(metrics) as f:
        steps_out = [json.loads(line) for line in f]
    with open(stats) as f:
        st = json.load(f)
    return {"wall_s": wall, "steps": steps_out, "stats": st, "peak_pss_sum": sampler.peak_pss_sum, "sgemm": sgemm,
            "peak_hwm": sorted(sampler.peak_hwm.values()), "peak_anon": sorted(sampler.peak_anon.values())}


def report_ringflex(r, seq_len, base, cp, flops):
    log(f"ringflex, rows of {seq_len} tokens at CP = {cp}: {len(r['steps'])} steps in {r['wall_s']:.0f} s "
        f"(loading included)")
    for m in r["steps"]:
        log(f"  step {m['step']}: loss {m['loss']!r}, {m['tokens_per_s']:.1f} tokens/s")
    # MFU: the step's model FLOPs/s over cp x the 1-thread sgemm read before and after the run (one thread a rank).
    # The step's time is the median over the steps after the first (its page faults of the mapped base), or the one.
    timed = r["steps"][1:] or r["steps"]
    step_s = sorted(seq_len / m["tokens_per_s"] for m in timed)[len(timed) // 2]
    gflops = [g["gflops"] for g in r["sgemm"]]
    sgemm = statistics.median(gflops)  # on a shared VM the rate moves from minute to minute (bench_model.py)
    shares = ", ".join(f"{k} {v / flops['model']:.1%}" for k, v in flops["parts"].items())
    log(f"  CPU {r['sgemm'][0]['cpu']}; 1-thread sgemm (OpenBLAS {r['sgemm'][0]['core']}, N = 1024) "
        f"{', '.join(f'{g:.1f}' for g in gflops)} GFLOP/s (before, after the run)")
    recompute = r["stats"].get("recompute", {})
    done = with_recompute(flops, recompute)
    chosen = ("none" if not recompute.get("layers", True) else
              "keeping " + (", ".join(k for k in ("keep_mlp", "keep_o_proj", "keep_down_proj") if recompute.get(k))
                            or "nothing")) + (" (auto)" if recompute.get("auto") else "")
    log(f"  model FLOPs a step {flops['model']:.4g} ({shares}); with the backward's recompute ({chosen}) {done:.4g}")
    log(f"  step {step_s:.1f} s: model {flops['model'] / step_s / 1e9:.1f} GFLOP/s, MFU "
        f"{flops['model'] / step_s / (cp * sgemm * 1e9):.3f} of {cp} x {sgemm:.1f}; with the recompute "
        f"{done / step_s / 1e9:.1f} GFLOP/s, {done / step_s / (cp * sgemm * 1e9):.3f}")
    hwm = ", ".join(f"{v / GiB:.2f}" for v in r["stats"]["peak_rss_bytes"])
    anon = ", ".join(f"{v / GiB:.2f}" for v in r["peak_anon"])
    log(f"  peak RSS per rank (VmHWM, the mapped base in each): {hwm} GiB; private (RssAnon) peaks: {anon} GiB")
    terms = {t["kind"]: t["bytes"] for t in r["stats"]["memory_per_rank"]["terms"]}
    activations = cp * sum(v for k, v in terms.items()
                           if k.startswith("activations")
                           or k in ("one layer", "backward buffers", "the attention's gradients"))
    target = base * 1.3 + activations
    log(f"  machine peak, the base counted once (sum of the ranks' PSS): {r['peak_pss_sum'] / GiB:.2f} GiB; target "
        f"base {base / GiB:.2f} GiB + 30% + activations {activations / GiB:.2f} GiB = {target / GiB:.2f} GiB: "
        f"{'met' if r['peak_pss_sum'] <= target else 'NOT met'}")
    log(f"  memory model per rank: {r['stats']['memory_per_rank']['total_bytes'] / GiB:.2f} GiB")


# --- 3. PyTorch + peft ---

def anon_bytes(pid="self"):
    return kib_fields(f"/proc/{pid}/status", ("RssAnon",)).get("RssAnon", 0)


def torch_child(model_dir, rows, lengths, threads, out, cap):
    """PyTorch + peft (bf16 weights, bf16 autocast, SDPA), loaded once, one LoRA step (AdamW) at each row length in
    `lengths` (ascending) on the first row's first tokens. Before each length its peak private memory (RssAnon) is
    predicted from the growth the shorter rows measured (a * L + b * L^2 through the last two: attention's masked
    SDPA is quadratic in L, the rest linear); a length predicted past `cap` is not run (the try would only run out of
    memory part-way, after minutes). Appends one JSON line a length to `out`: {"length", "state": "running" | "ok" |
    "predicted out of memory", ...}."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Gemma4ForCausalLM
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    t0 = time.time()
    model = Gemma4ForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                                             target_modules=LORA_TARGETS, task_type="CAUSAL_LM"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4, weight_decay=0.0)
    with open(rows) as f:
        row = json.loads(f.readline())["input_ids"]
    load_s = time.time() - t0
    print(f"torch: loaded in {load_s:.0f} s; rows of {lengths} tokens", flush=True)
    peak = [0]
    done = threading.Event()

    def watch():  # the step's peak private memory, sampled
        while not done.wait(0.2):
            peak[0] = max(peak[0], anon_bytes())

    def emit(rec):
        with open(out, "a") as f:
            f.write(json.dumps(rec) + "\n")

    measured = []  # (length, growth bytes)
    for length in lengths:
        before = anon_bytes()
        if len(measured) >= 2:
            (l1, g1), (l2, g2) = measured[-2:]
            b = max(0.0, (g2 / l2 - g1 / l1) / (l2 - l1))
            a = g2 / l2 - b * l2
            predicted = before + a * length + b * length * length
            if predicted > cap:
                emit({"length": length, "state": "predicted out of memory", "predicted_bytes": predicted,
                      "cap_bytes": cap})
                return
        emit({"length": length, "state": "running"})
        ids = torch.tensor(row[:length])[None]
        peak[0] = before
        done.clear()
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        t0 = time.time()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_s = time.time() - t0
        done.set()
        watcher.join()
        growth = peak[0] - before
        measured.append((length, max(growth, 1)))
        emit({"length": length, "state": "ok", "loss": loss.item(), "step_s": step_s, "load_s": load_s,
              "tokens_per_s": length / step_s, "peak_anon_bytes": peak[0], "growth_bytes": growth})
        del loss


def run_torch(a, model_dir, fields, seq_len):
    """The PyTorch child over rows of --torch-min-len, doubled up to seq_len, in one process (one load); stopped
    (out of memory) when its private memory passes the cap, or at --torch-timeout seconds in all."""
    limit = int(a.torch_mem_gib * GiB) if a.torch_mem_gib else \
        kib_fields("/proc/meminfo", ("MemAvailable",))["MemAvailable"] - GiB
    lengths = []
    length = min(a.torch_min_len, seq_len)
    while length < seq_len:
        lengths.append(length)
        length *= 2
    lengths.append(seq_len)
    rows = rows_path(a.workdir, fields["vocab_size"], seq_len, 1)
    write_rows(rows, fields["vocab_size"], seq_len, rows=1)
    out = os.path.join(a.workdir, "torch_steps.jsonl")
    if os.path.exists(out):
        os.remove(out)
    cmd = [sys.executable, os.path.abspath(__file__), "--torch-child", model_dir, rows,
           ",".join(str(n) for n in lengths), str(a.threads), out, str(limit)]
    log(f"torch + peft, rows of {lengths} tokens: {' '.join(cmd)} (timeout {a.torch_timeout} s, private memory cap "
        f"{limit / GiB:.1f} GiB)")
    proc = subprocess.Popen(cmd, start_new_session=True)
    # The child is this interpreter again (the same process name), the only one under its own pid.
    sampler = Sampler(proc.pid, proc_name(os.getpid()), a.sample_s, a.report_every, "torch")
    sampler.start()
    start, verdict = time.time(), None
    while proc.poll() is None:
        time.sleep(a.sample_s)
        if sum(sampler.last_anon.values()) > limit:
            verdict = "out of memory (private memory cap)"
        elif time.time() - start > a.torch_timeout:
            verdict = "timeout"
        if verdict:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            break
    sampler.stop.set()
    sampler.join()
    rc = proc.returncode
    if verdict is None and rc != 0:
        verdict = "out of memory (killed)" if rc in (-signal.SIGKILL, 137) else f"failed (exit code {rc})"
    recs = []
    if os.path.exists(out):
        with open(out) as f:
            recs = [json.loads(line) for line in f]
    longest, ran_out = None, None
    for r in recs:
        if r["state"] == "ok":
            longest = r
            log(f"torch + peft, rows of {r['length']}: loss {r['loss']:.4f}, step {r['step_s']:.0f} s, "
                f"{r['tokens_per_s']:.1f} tokens/s, peak private memory {r['peak_anon_bytes'] / GiB:.2f} GiB "
                f"(load {r['load_s']:.0f} s)")
        elif r["state"] == "predicted out of memory":
            ran_out = (f"{r['length']} tokens, predicted (from the shorter rows' growth): "
                       f"{r['predicted_bytes'] / GiB:.1f} GiB of private memory > the cap {r['cap_bytes'] / GiB:.1f} "
                       f"GiB; not run")
    if recs and recs[-1]["state"] == "running" and verdict:
        ran_out = f"{recs[-1]['length']} tokens, measured: {verdict} after {time.time() - start:.0f} s"
    elif verdict and not ran_out:
        log(f"torch + peft: stopped ({verdict}) before its first row")
    peak = max(sampler.peak_hwm.values(), default=0)
    log(f"torch + peft: longest row that ran: {longest['length'] if longest else 'none'}"
        + (f" ({longest['tokens_per_s']:.1f} tokens/s)" if longest else "")
        + (f"; runs out of memory at {ran_out}" if ran_out else "") + f"; peak RSS {peak / GiB:.2f} GiB")


# --- 4. The longest row by the memory model ---

def longest_row(a, model_dir, rows, seq_len):
    config = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "gemma4_e2b_lora.yaml")
    cmd = [a.longest_row, "--config", config, "--granule", str(a.granule)]
    for k, v in {"model.path": model_dir, "data.path": rows, "data.val_rows": 0, "train.seq_len": seq_len,
                 "train.global_batch": 1, "parallelism.cp": a.cp, "train.threads": a.threads}.items():
        cmd += ["--set", f"{k}={v}"]
    for kv in a.set:
        cmd += ["--set", kv]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=memory_env(a))
    if proc.returncode != 0:
        log(f"lora_longest_row failed: {proc.stderr.strip()}")
        return None
    r = json.loads(proc.stdout)
    log(f"memory model: {r['need_bytes'] / GiB:.2f} GiB per rank at {seq_len} tokens; the longest row that fits "
        f"{r['budget_bytes'] / GiB:.2f} GiB per rank: {r['longest_seq_len']} tokens "
        f"({r['need_at_longest_bytes'] / GiB:.2f} GiB per rank)")
    return r["longest_seq_len"]


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--measure-child":
        print(json.dumps(measure(sys.argv[2], sys.argv[3])))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--torch-child":
        model_dir, rows, lengths, threads, out, cap = sys.argv[2:8]
        torch_child(model_dir, rows, [int(n) for n in lengths.split(",")], int(threads), out, int(cap))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ringflex", required=True)
    ap.add_argument("--longest-row", help="bench/model/lora_longest_row (default: beside ringflex's build)")
    ap.add_argument("--workdir", required=True, help="where the model and rows are written (not in the repository)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=None, help="tokens a row (8192; --tiny: 512)")
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="train.threads per rank (2 ranks on 2 cores: 1)")
    ap.add_argument("--granule", type=int, default=512, help="the longest row is searched in multiples of this")
    ap.add_argument("--verify-longest", action="store_true", help="one ringflex step at the memory model's longest row")
    ap.add_argument("--memory-gib", type=float, default=None,
                    help="per-rank budget (RINGFLEX_MEMORY_LIMIT) for the longest row and its step; default: the "
                         "machine's available memory shared by the ranks, as ringflex's own check")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="one more field for ringflex train and lora_longest_row (repeatable), e.g. "
                         "train.keep_down_proj=true")
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--torch-timeout", type=float, default=3600.0,
                    help="seconds for the PyTorch child in all (load and every row length)")
    ap.add_argument("--torch-mem-gib", type=float, default=None,
                    help="private memory (RssAnon) cap of the PyTorch child")
    ap.add_argument("--torch-min-len", type=int, default=512,
                    help="the shortest row PyTorch runs; then doubled up to --seq-len while it is predicted to fit")
    ap.add_argument("--sample-s", type=float, default=1.0, help="memory sampling period")
    ap.add_argument("--report-every", type=float, default=30.0, help="seconds between memory progress lines")
    ap.add_argument("--tiny", action="store_true", help="4 layers, hidden 256: checks the driver end to end")
    ap.add_argument("--layers", type=int, default=None,
                    help="a cut-down E2B: its real widths with this many layers (>= 5; cut_down says what is kept)")
    ap.add_argument("--mpi-arg", action="append", default=[], metavar="ARG",
                    help="one more mpirun argument (repeatable), e.g. --mpi-arg=--mca --mpi-arg=mpi_yield_when_idle "
                         "--mpi-arg=1")
    ap.add_argument("--timeout", type=float, default=3600.0,
                    help="ringflex's --timeout: seconds a rank waits for a peer (on a loaded machine, or under --perf, "
                         "a rank can fall minutes behind the other)")
    ap.add_argument("--perf", metavar="PREFIX", help="run each rank under perf record -g into PREFIX.RANK")
    a = ap.parse_args()
    if a.longest_row is None:
        build = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(a.ringflex))))
        a.longest_row = os.path.join(build, "bench", "model", "lora_longest_row")
    fields = TINY if a.tiny else cut_down(a.layers) if a.layers else REAL
    seq_len = a.seq_len or (TINY_SEQ_LEN if a.tiny else 8192)
    os.makedirs(a.workdir, exist_ok=True)
    model_dir = os.path.join(a.workdir, "e2b_tiny" if a.tiny else f"e2b_{a.layers}_layers" if a.layers else "e2b")
    start = time.time()
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        write_model(model_dir, fields)
    base = base_bytes(model_dir)
    log(f"model {model_dir}: {base / GiB:.2f} GiB of safetensors")
    rows = rows_path(a.workdir, fields["vocab_size"], seq_len, a.steps)
    write_rows(rows, fields["vocab_size"], seq_len, rows=a.steps)
    # The memory model first: it reads shapes only (a second), and says before the long runs whether they fit.
    longest = longest_row(a, model_dir, rows, seq_len)
    ok = longest is not None
    r = run_ringflex(a, model_dir, rows, seq_len, a.steps, f"{seq_len}")
    if r:
        report_ringflex(r, seq_len, base, a.cp, measure_child("flops", json.dumps([fields, seq_len])))
    ok = ok and r is not None
    if not a.skip_torch:
        run_torch(a, model_dir, fields, seq_len)
    if a.verify_longest and longest:
        long_rows = rows_path(a.workdir, fields["vocab_size"], longest, 1)
        write_rows(long_rows, fields["vocab_size"], longest, rows=1)
        r = run_ringflex(a, model_dir, long_rows, longest, 1, f"longest_{longest}")
        if r:
            report_ringflex(r, longest, base, a.cp, measure_child("flops", json.dumps([fields, longest])))
        ok = ok and r is not None
    log(f"done in {time.time() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
