#!/usr/bin/env python3
"""`ringflex generate --messages` against transformers: conversations rendered through the chat template.

The checkpoint is tests/trainer/chat_train.py's: a tiny random Gemma4ForConditionalGeneration with a vision tower,
the tiny chat example's tokenizer.json and tokenizer_config.json, and a real Gemma 4 chat template (the newest
revision in the pinned TRL wheel). Oracle: transformers' apply_chat_template(messages, tools=...,
add_generation_prompt=True) ids and generate(do_sample=False, use_cache=True, float32) on them. Checked at every
launcher (`--ranks 1 2 -- MPIEXEC...`): the same greedy tokens for text conversations (a system turn, several model
turns, a tool call and its response with tools declared), the record's text equal to tokenizers' decode and the
streamed stdout equal to the records' text (random weights emit byte-fallback runs, invalid ones too), and a
conversation with an image (the checkpoint's processor budget, through the tower) giving the same tokens at every P.
Bad input through tests/cli/expect_error.sh: a missing image and a line that does not parse, one line on every rank.
Exit 77 (CTest's skip) without torch, transformers or trl.
"""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "common"))
sys.path.insert(0, os.path.join(HERE, "..", "text"))
sys.path.insert(0, os.path.join(HERE, "..", "trainer"))
from launchers import describe, launchers, ranks_of  # noqa: E402
from oracle_env import missing_oracle  # noqa: E402

try:
    import torch
    from transformers import PreTrainedTokenizerFast
    from chat_train import SOFT, TOOLS, checkpoint
except ImportError as e:  # pragma: no cover - depends on the environment
    missing_oracle(e)

NEW_TOKENS = 24
EOS = [1, 106]  # <eos> and <turn|> in the tiny chat tokenizer, as Gemma 4's generation_config lists them
EXPECT_ERROR = os.path.join(HERE, "..", "cli", "expect_error.sh")
TEXT_CONVERSATIONS = [
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Count to three."},
                  {"role": "assistant", "content": "1, 2, 3."},
                  {"role": "user", "content": "And to four?"}]},
    {"messages": [{"role": "user", "content": "Add 2 and 3 with the tool."},
                  {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                        "function": {"name": "add", "arguments": {"a": 2}}}]},
                  {"role": "tool", "tool_call_id": "c", "name": "add", "content": "5"}], "tools": TOOLS},
]
IMAGE_CONVERSATION = {"messages": [{"role": "user", "content": [{"type": "image", "path": "img/0.png"},
                                                                {"type": "text", "text": "What is this?"}]}]}


def generate(ringflex, launcher, ckpt, messages, out):
    proc = subprocess.run([*launcher, ringflex, "generate", "--model", ckpt, "--messages", messages,
                           "--max-new-tokens", str(NEW_TOKENS), "--greedy", "--out", out],
                          capture_output=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode != 0:
        return None, f"exit {proc.returncode}: {proc.stderr.decode(errors='replace').strip()[-600:]}"
    with open(out) as f:
        records = [json.loads(line) for line in f]
    streamed, text = proc.stdout.decode("utf-8", errors="replace"), "".join(r["text"] + "\n" for r in records)
    if streamed != text:  # a byte run's text printed before the run ended would differ
        return None, f"streamed {streamed!r}, the records' text {text!r}"
    return records, None


def main():
    if len(sys.argv) < 2:
        raise SystemExit("usage: chat_generate.py RINGFLEX [--ranks P... -- MPIEXEC...]")
    ringflex, runs = sys.argv[1], launchers(sys.argv[2:])
    failures = []
    with tempfile.TemporaryDirectory() as work:
        model, ckpt, stock = checkpoint(work)
        model = model.float().eval()
        with open(os.path.join(ckpt, "generation_config.json"), "w") as f:
            json.dump({"do_sample": False, "eos_token_id": EOS}, f)
        with open(os.path.join(ckpt, "processor_config.json"), "w") as f:
            json.dump({"image_processor": {"max_soft_tokens": SOFT}}, f)
        tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(ckpt, "tokenizer.json"), bos_token="<bos>",
                                      eos_token="<eos>", pad_token="<pad>")
        expected = []
        for c in TEXT_CONVERSATIONS:
            ids = tok.apply_chat_template(c["messages"], tools=c.get("tools"), chat_template=stock,
                                          add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
            with torch.no_grad():
                seq = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True,
                                     eos_token_id=EOS, pad_token_id=0)
            expected.append(seq[0, len(ids):].tolist())
        text_file = os.path.join(work, "text.jsonl")
        with open(text_file, "w") as f:
            f.write("".join(json.dumps(c) + "\n" for c in TEXT_CONVERSATIONS))
        image_file = os.path.join(work, "image.jsonl")
        with open(image_file, "w") as f:
            f.write(json.dumps(IMAGE_CONVERSATION) + "\n")
        image_tokens = None
        for launcher in runs:
            P = ranks_of(launcher)
            records, error = generate(ringflex, launcher, ckpt, text_file, os.path.join(work, f"text_{P}.jsonl"))
            if error:
                failures.append(f"text P={P}: {error}")
            else:
                for i, (r, want) in enumerate(zip(records, expected)):
                    if r["token_ids"] != want:
                        failures.append(f"conversation {i} P={P}: tokens {r['token_ids']}, transformers {want}")
                    if r["text"] != tok.decode(r["token_ids"], skip_special_tokens=True):
                        failures.append(f"conversation {i} P={P}: text {r['text']!r} is not tokenizers' decode")
                if len(records) != len(expected):
                    failures.append(f"text P={P}: {len(records)} records for {len(expected)} conversations")
            records, error = generate(ringflex, launcher, ckpt, image_file, os.path.join(work, f"image_{P}.jsonl"))
            if error:
                failures.append(f"image P={P}: {error}")
            elif image_tokens is None:
                image_tokens = records[0]["token_ids"]
            elif records[0]["token_ids"] != image_tokens:
                failures.append(f"image P={P}: tokens differ from the first run's")
        bad_image = os.path.join(work, "bad_image.jsonl")
        with open(bad_image, "w") as f:
            f.write(json.dumps(TEXT_CONVERSATIONS[0]) + "\n")
            f.write(json.dumps(IMAGE_CONVERSATION).replace("img/0.png", "img/missing.png") + "\n")
        bad_json = os.path.join(work, "bad_json.jsonl")
        with open(bad_json, "w") as f:
            f.write(json.dumps(TEXT_CONVERSATIONS[0]) + "\n{\"messages\": [\n")
        for launcher in runs:
            P = ranks_of(launcher)
            for path, regex in ((bad_image, r"bad_image\.jsonl:2: .*missing\.png"),
                                (bad_json, r"bad_json\.jsonl:2: not valid JSON")):
                proc = subprocess.run(["bash", EXPECT_ERROR, str(P), regex, *launcher, ringflex, "generate",
                                       "--model", ckpt, "--messages", path], capture_output=True, text=True)
                if proc.returncode != 0:
                    failures.append(f"{os.path.basename(path)} P={P}: {proc.stderr.strip()[-600:]}")
    print(f"--messages: {len(TEXT_CONVERSATIONS)} text conversations equal transformers' {NEW_TOKENS} greedy tokens, "
          f"an image conversation the same tokens, bad input one line, at P = {describe(runs)}")
    for f in failures:
        print("FAIL", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
