"""rf::text's tokenizer.json reader against the `tokenizers` library (the Rust implementation transformers uses).

Several Gemma-4-style tokenizer.json files are built here with `tokenizers` (BPE with byte fallback and fuse_unk,
Replace " " -> "▁", Split(" ", merged_with_previous), the decoder Replace/ByteFallback/Fuse, Gemma 4's special and
added tokens), trained on a generated corpus, plus one made by transformers' GemmaTokenizer itself and variants that
reach the other options the reader supports (Prepend and Strip, lstrip/rstrip and normalized added tokens, each Split
behaviour, no byte tokens so unknown code points become unk, merges across newlines). Every fuzz case's ids must be
identical to tokenizers' encode(text, add_special_tokens=False), and decode with and without skip_special_tokens
identical on those ids and on random id sequences. Usage: tokenizer_oracle.py TOKENIZER_TOOL
"""
import json
import os
import random
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
import oracle_env  # noqa: E402

try:
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE
except ImportError as e:
    oracle_env.missing_oracle(e)

# Gemma 4's special and added tokens (docs/text.md): ids 0-4 first, the chat tokens, image/audio placeholders.
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>",
           "<|tool_response>", "<tool_response|>", '<|"|>', "<|think|>", "<|channel>", "<channel|>", "<|turn>",
           "<turn|>", "<|image>", "<image|>", "<|image|>", "<|audio>", "<audio|>", "<|audio|>", "<|video|>"]
WORDS = ("the ring passes keys and values around ranks attention mask sliding window gemma token merge byte "
         "fallback 注意力 機械学習 トークン 한국어 données naïve café Ωμέγα привет мир ∑∫√ 🙂 👍🏽 🇫🇷").split()


def corpus(rng, n):
    out = []
    for _ in range(n):
        line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
        if rng.random() < 0.3:
            line += rng.choice(["\n", "\n\n", "  ", "\t", ".\n", ",", "!"]) + rng.choice(WORDS)
        out.append(line)
    return out


def stdlib_text(limit):
    """Real text: the docstrings and comments of a few Python standard library modules."""
    import inspect, json as js, argparse, textwrap  # noqa: E401
    text = "".join(inspect.getsource(m) for m in (js, argparse, textwrap))
    return text[:limit]


def with_byte_tokens(tok, missing=()):
    """The trained file with <0x00>..<0xFF> in the model's vocabulary (as Gemma 4 has them), except `missing`."""
    j = json.loads(tok.to_str())
    vocab = j["model"]["vocab"]
    nxt = max(max(vocab.values()), max(a["id"] for a in j["added_tokens"])) + 1
    for b in range(256):
        name = f"<0x{b:02X}>"
        if b not in missing and name not in vocab:
            vocab[name] = nxt
            nxt += 1
    return Tokenizer.from_str(json.dumps(j))


def gemma_style(texts, vocab_size, alphabet, split=(" ", "merged_with_previous"), missing_bytes=(), extra=None):
    tok = Tokenizer(BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=split[0], behavior=split[1], invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, limit_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok = with_byte_tokens(tok, missing_bytes)
    tok.add_tokens([AddedToken("\n\n\n", normalized=False), AddedToken("<unused0>", normalized=False)])
    if extra:
        extra(tok)
    return tok


def transformers_gemma(texts):
    """A tokenizer made by transformers' GemmaTokenizer (v5) from a trained vocabulary and merges."""
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer
    base = gemma_style(texts, 3000, 400)
    j = json.loads(base.to_str())
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in j["model"]["merges"]]
    vocab = dict(j["model"]["vocab"])
    for a in j["added_tokens"]:
        vocab.setdefault(a["content"], a["id"])
    g = GemmaTokenizer(vocab=vocab, merges=merges)
    g.add_special_tokens({"additional_special_tokens": SPECIAL[5:]})
    return g._tokenizer


def fuzz_cases(rng, texts):
    pieces = WORDS + SPECIAL + ["<|tur", "turn|>", "<0x41>", "▁", "▁▁x", "\u0301", "e\u0301", "a\u0308\u0323",
                                "\x00", "\x07", "\x1b[0m", "\x7f", "\u200b", "\u200d", "\ufeff", "\ufffd", "\U0010ffff",
                                "👨\u200d👩\u200d👧", "\t", "\r\n", "\n", "\n\n", "\n\n\n\n", " ", "   ", "\u3000",
                                "\u00a0", "<unused0>", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "ﬁ", "Ⅻ", "١٢٣", "<lstrip>", "<rstrip>",
                                "<both>", "ring passes", "▁mask", "ab", "abab", "\u2003"]
    cases = ["", " ", "\n", "  \n  ", "▁", "<bos>", "<bos><eos>", "<|turn>user\nhi<turn|>\n", "x" * 3000,
             "ab" * 1500, "🙂" * 500, " " * 300, "\n" * 300, "é" * 1000, "<|image|>" * 20]
    for _ in range(1500):
        k = rng.randint(1, 25)
        cases.append("".join(rng.choice(pieces) + (" " if rng.random() < 0.4 else "") for _ in range(k)))
    for _ in range(300):  # random code points, including ones no file has a token for
        cases.append("".join(chr(rng.choice([rng.randint(0x20, 0x7e), rng.randint(0xa0, 0x2fff),
                                             rng.randint(0x3000, 0xd7ff), rng.randint(0xe000, 0xffff),
                                             rng.randint(0x10000, 0x10ffff)])) for _ in range(rng.randint(1, 40))))
    cases += rng.sample(texts, 200)
    real = stdlib_text(200000)
    cases += [real[i:i + rng.randint(1, 4000)] for i in range(0, len(real), 4000)]
    cases.append(real)
    return cases


def check(tool, name, tok, cases, rng, tmp):
    path = os.path.join(tmp, name)
    os.makedirs(path, exist_ok=True)
    tok_file = os.path.join(path, "tokenizer.json")
    tok.save(tok_file)
    n_vocab = tok.get_vocab_size(with_added_tokens=True)
    id_cases = [[rng.randrange(n_vocab + 3) for _ in range(rng.randint(0, 30))] for _ in range(300)]
    byte_ids = [tok.token_to_id(f"<0x{b:02X}>") for b in range(256)]
    byte_ids = [i for i in byte_ids if i is not None]
    if byte_ids:  # byte tokens in random runs: valid and invalid UTF-8 for ByteFallback
        id_cases += [[rng.choice(byte_ids + [5, 6, 300]) for _ in range(rng.randint(1, 12))] for _ in range(300)]
    with open(os.path.join(path, "cases.jsonl"), "w") as f:
        for c in cases:
            f.write(json.dumps({"text": c}) + "\n")
        for ids in id_cases:
            f.write(json.dumps({"ids": ids}) + "\n")
    out = os.path.join(path, "out.jsonl")
    subprocess.run([tool, tok_file, os.path.join(path, "cases.jsonl"), out], check=True)
    with open(out) as f:
        answers = [json.loads(line) for line in f]
    assert len(answers) == len(cases) + len(id_cases), (name, len(answers))
    failures = 0
    for i, (case, got) in enumerate(zip(cases + id_cases, answers)):
        if isinstance(case, str):
            ids = tok.encode(case, add_special_tokens=False).ids
            if got.get("ids") != ids:
                failures += 1
                if failures <= 5:
                    print(f"{name} case {i}: ids differ for {case[:200]!r}:\n  tokenizers {ids[:60]}\n"
                          f"  ringflex   {got.get('ids', got)!s:.600}")
                continue
        else:
            ids = case
        for key, skip in (("decode", False), ("decode_skip", True)):
            want = tok.decode(ids, skip_special_tokens=skip)
            if got.get(key) != want:
                failures += 1
                if failures <= 5:
                    print(f"{name} case {i}: {key} differs for ids {ids[:40]}:\n  tokenizers {want[:200]!r}\n"
                          f"  ringflex   {got.get(key, got)!r:.200}")
    print(f"{name}: {len(cases)} texts, {len(id_cases)} id sequences, vocabulary {n_vocab}, "
          f"merges {len(json.loads(tok.to_str())['model']['merges'])}: {failures} differences")
    return failures


def main():
    tool = sys.argv[1]
    rng = random.Random(4)
    texts = corpus(rng, 4000)
    multiline = ["\n".join(texts[i:i + 3]) for i in range(0, 600, 3)]  # merges that join across newlines

    def lstrip_rstrip(tok):
        tok.add_tokens([AddedToken("<lstrip>", lstrip=True, normalized=False),
                        AddedToken("<rstrip>", rstrip=True, normalized=False),
                        AddedToken("<both>", lstrip=True, rstrip=True, normalized=False, special=True),
                        AddedToken("ring passes", normalized=True), AddedToken("▁mask", normalized=True)])

    def old_gemma(tok):  # the SentencePiece-converted layout: a "▁" prepended, the decoder strips one leading space
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])

    files = [
        ("gemma4_style", gemma_style(texts, 4000, 1000)),
        ("small_alphabet", gemma_style(texts, 1500, 60)),
        ("no_byte_tokens_unk", gemma_style(texts, 1500, 60, missing_bytes=range(0x80, 0x100))),
        ("merges_across_newlines", gemma_style(texts + multiline, 3000, 400)),
        ("added_lstrip_rstrip_normalized", gemma_style(texts, 2000, 300, extra=lstrip_rstrip)),
        ("prepend_strip", gemma_style(texts, 2000, 300, extra=old_gemma)),
    ]
    # Gemma 4's Split(" ") finds nothing once the normalizer has made every space "▁": these split what is left.
    for pattern, behavior in (("▁", "isolated"), ("▁", "removed"), ("▁", "merged_with_previous"),
                              ("▁", "merged_with_next"), ("▁", "contiguous"), ("\n", "isolated"),
                              ("ab", "contiguous")):
        files.append((f"split_{behavior}_{pattern.encode('unicode_escape').decode()}",
                      gemma_style(texts + multiline, 1500, 200, split=(pattern, behavior))))
    try:
        files.append(("transformers_gemma_v5", transformers_gemma(texts)))
    except ImportError as e:
        oracle_env.missing_oracle(e)
    cases = fuzz_cases(rng, texts)
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, tok in files:
            failures += check(tool, name, tok, cases, rng, tmp)
    if failures:
        print(f"FAILED: {failures} differences from tokenizers")
        sys.exit(1)
    print("tokenizer.json parity with tokenizers: OK")


if __name__ == "__main__":
    main()
