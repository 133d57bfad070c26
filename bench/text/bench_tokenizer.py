"""Tokenizer encode throughput and load time: rf::text against the `tokenizers` library (Rust), one thread each.

A Gemma-4-style tokenizer.json (BPE over code points with byte fallback, Replace " " -> "▁", Split(" "), Gemma 4's
special tokens and its 256 byte tokens; docs/text.md) is trained here on half the Python standard library's .py
files, and the other half is the text: encoded whole (one call) and line by line (tokenizers' encode_batch, ringflex
a loop of encode). Both sides must give the same ids before anything is timed. Medians of --repeats runs after one
untimed pass. Usage:
  python3 bench/text/bench_tokenizer.py --bench build/bench/text/bench_tokenizer [--vocab 131072] [--text-mb 4]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import time

os.environ["RAYON_NUM_THREADS"] = "1"  # tokenizers on one thread, as ringflex's encode
os.environ["TOKENIZERS_PARALLELISM"] = "false"
from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, trainers  # noqa: E402
from tokenizers.models import BPE  # noqa: E402

SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>",
           "<|tool_response>", "<tool_response|>", '<|"|>', "<|think|>", "<|channel>", "<channel|>", "<|turn>",
           "<turn|>", "<|image>", "<image|>", "<|image|>", "<|audio>", "<audio|>", "<|audio|>", "<|video|>"]


def stdlib_files():
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for d, _, names in os.walk(root):
        files += [os.path.join(d, n) for n in names if n.endswith(".py")]
    return sorted(files)


def read(files, limit):
    out, n = [], 0
    for f in files:
        try:
            with open(f, encoding="utf-8") as fh:
                t = fh.read()
        except (UnicodeDecodeError, OSError):
            continue
        out.append(t)
        n += len(t)
        if n >= limit:
            break
    return "".join(out)


def build(path, vocab, train_text):
    tok = Tokenizer(BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL, limit_alphabet=2000, show_progress=False)
    tok.train_from_iterator(train_text.splitlines(keepends=True), trainer)
    j = json.loads(tok.to_str())
    v = j["model"]["vocab"]
    nxt = max(v.values()) + 1
    for b in range(256):
        if f"<0x{b:02X}>" not in v:
            v[f"<0x{b:02X}>"] = nxt
            nxt += 1
    tok = Tokenizer.from_str(json.dumps(j))
    tok.add_tokens([AddedToken("\n\n\n", normalized=False)])
    tok.save(path)


def synthetic(path, trained):
    """A file of Gemma 4's counts (262,144 tokens, 514,906 merges) for the load time: the trained file's special and
    byte tokens, 64 CJK characters, all their pairs, and triples with both of their splits as merges."""
    import itertools
    j = json.load(open(trained))
    alpha = [chr(0x4E00 + i) for i in range(64)]
    vocab = {t: i for i, t in enumerate(t for t in j["model"]["vocab"] if t.startswith("<"))}
    merges = []
    for c in alpha:
        vocab[c] = len(vocab)
    for a, b in itertools.product(alpha, alpha):
        vocab[a + b] = len(vocab)
        merges.append([a, b])
    for a, b, c in itertools.product(alpha, alpha, alpha):
        if len(vocab) == 262144:
            break
        vocab[a + b + c] = len(vocab)
        merges += [[a, b + c], [a + b, c]]
    j["model"]["vocab"], j["model"]["merges"] = vocab, merges[:514906]
    j["added_tokens"] = [t for t in j["added_tokens"] if t["content"] in vocab and vocab[t["content"]] == t["id"]]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(j, f, ensure_ascii=False)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", required=True, help="build/bench/text/bench_tokenizer")
    ap.add_argument("--workdir", default="/tmp/rf_bench_tokenizer")
    ap.add_argument("--vocab", type=int, default=131072)
    ap.add_argument("--train-mb", type=float, default=24)
    ap.add_argument("--text-mb", type=float, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokenizer", help="time this tokenizer.json instead of training one (its ids still compared)")
    ap.add_argument("--synthetic", action="store_true", help="time a file of Gemma 4's counts (for the load time)")
    a = ap.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    files = stdlib_files()
    tok_file = a.tokenizer or os.path.join(a.workdir, f"tokenizer_{a.vocab}.json")
    if not os.path.exists(tok_file):
        t0 = time.time()
        build(tok_file, a.vocab, read(files[0::2], int(a.train_mb * 1e6)))
        print(f"trained {tok_file} in {time.time() - t0:.0f} s")
    if a.synthetic:
        trained, tok_file = tok_file, os.path.join(a.workdir, "synthetic_262144.json")
        synthetic(tok_file, trained)
    text_file = os.path.join(a.workdir, "text.txt")
    text = read(files[1::2], int(a.text_mb * 1e6))
    with open(text_file, "w", encoding="utf-8") as f:
        f.write(text)
    lines = text.encode().split(b"\n")  # as std::getline splits it
    lines = [x.decode() for x in (lines[:-1] if lines and lines[-1] == b"" else lines)]

    loadavg_before = open("/proc/loadavg").read().strip()
    out = os.path.join(a.workdir, "ringflex.json")
    subprocess.run([a.bench, tok_file, text_file, str(a.repeats), out], check=True)
    with open(out) as f:
        rf = json.load(f)

    def timed(fn, warm):
        """Medians of wall and CPU seconds over --repeats calls, after `warm` untimed ones."""
        walls, cpus = [], []
        for r in range(warm + a.repeats):
            w, c = time.perf_counter(), time.process_time()
            result = fn()
            if r >= warm:
                walls.append(time.perf_counter() - w)
                cpus.append(time.process_time() - c)
        return result, statistics.median(walls), statistics.median(cpus)

    tok, load_s, load_cpu = timed(lambda: Tokenizer.from_file(tok_file), 0)
    ids, whole_s, whole_cpu = timed(lambda: tok.encode(text, add_special_tokens=False).ids, 1)
    batch_ids, batch_s, batch_cpu = timed(
        lambda: [e.ids for e in tok.encode_batch(lines, add_special_tokens=False)], 1)
    assert ids == rf["ids"], "ringflex's ids differ from tokenizers' on the whole text"
    assert batch_ids == rf["batch_ids"], "ringflex's ids differ from tokenizers' line by line"

    j = json.load(open(tok_file))
    mb = rf["bytes"] / 1e6
    cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    print(f"tokenizer: {os.path.getsize(tok_file) / 1e6:.1f} MB, {len(j['model']['vocab'])} tokens, "
          f"{len(j['model']['merges'])} merges; text: {mb:.2f} MB, {rf['tokens']} tokens, {rf['lines']} lines")
    print(f"CPU: {cpu}; load average: {loadavg_before} before, {open('/proc/loadavg').read().strip()} after")
    print("| medians, wall (CPU) | ringflex | tokenizers 0.23.3 | ringflex's speed-up, wall (CPU) |")
    print("|---|---|---|---|")
    print(f"| load tokenizer.json (s) | {rf['load_s']:.3f} ({rf['load_cpu']:.3f}) | {load_s:.3f} ({load_cpu:.3f}) | "
          f"{load_s / rf['load_s']:.2f}x ({load_cpu / rf['load_cpu']:.2f}x) |")
    for name, key, s, c in (("encode whole text", "encode", whole_s, whole_cpu),
                            ("encode line by line (encode_batch)", "batch", batch_s, batch_cpu)):
        print(f"| {name} (MB/s) | {mb / rf[key + '_s']:.2f} ({mb / rf[key + '_cpu']:.2f}) | {mb / s:.2f} ({mb / c:.2f}) | "
              f"{s / rf[key + '_s']:.2f}x ({c / rf[key + '_cpu']:.2f}x) |")


if __name__ == "__main__":
    sys.exit(main())
