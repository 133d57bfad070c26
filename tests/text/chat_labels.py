#!/usr/bin/env python3
"""Chat labels (src/text/conversation.h) against an independent derivation: transformers' assistant masks.

Every Gemma 4 chat template revision the pinned TRL wheel ships (trl/chat_templates/gemma4*.jinja, found through
importlib.metadata) is turned into a training template here, as TRL's training templates are: `{% generation %}`
blocks around what a model turn is trained on (its thinking, tool calls, content and closing `<turn|>`, never the
newline after it, the header or tool responses; a tool call left without a response trains the `<|tool_response>`
that ends the turn). Rendering with it must give the stock template's text, byte for byte (the blocks add
nothing). Then, over randomly drawn conversations (a system or developer turn or none, thinking on and off, tools,
tool calls and responses, several and consecutive assistant turns, images, reasoning, whitespace to trim, and the
templates' own markup typed inside user and assistant content):
  1. chat_render_tool (the C++ renderer on the *stock* template, data.chat.thought_prefix false) gives the text
     transformers renders, and its trained characters are exactly the generation blocks' (train_on assistant);
     last_assistant trains the last model turn's part of them and all trains everything but images;
  2. with the thought prefix, `<|channel>thought\\n<channel|>` is inserted masked after each model header that does
     not already open a channel, and nothing else changes;
  3. with TOKENIZER (a Gemma-4-recipe tokenizer.json), the ids equal transformers' apply_chat_template(...,
     return_dict=True, return_assistant_tokens_mask=True) and the trained tokens its assistant_masks.
Usage: chat_labels.py CHAT_RENDER_TOOL [TOKENIZER_JSON]. Exit 77 (CTest's skip) without jinja2/transformers/trl.
"""
import importlib.metadata
import json
import os
import random
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from oracle_env import missing_oracle  # noqa: E402

try:
    import transformers  # noqa: F401
    from transformers import PreTrainedTokenizerFast
    from transformers.utils.chat_template_utils import render_jinja_template
except ImportError as e:  # pragma: no cover - depends on the environment
    missing_oracle(e)

PREFIX = "<|channel>thought\n<channel|>"
CASES = 60  # conversations per template revision and setting


def gemma4_templates():
    try:
        files = importlib.metadata.files("trl") or []
    except importlib.metadata.PackageNotFoundError as e:
        missing_oracle(ImportError(f"trl is not installed ({e})"))
    found = sorted(f for f in files if re.fullmatch(r"trl/chat_templates/gemma4(_v\d+)?\.jinja", str(f)))
    if not found:
        sys.exit("FAILED: the trl wheel has no trl/chat_templates/gemma4*.jinja")
    return {os.path.basename(str(f)): f.read_text() for f in found}


def block_end(src, start, open_re, close_re):
    """The end of the tag closing the block whose opening tag starts at `start` (nested blocks counted)."""
    depth, at = 0, start
    tag = re.compile(f"({open_re})|({close_re})")
    for m in tag.finditer(src, start):
        depth += 1 if m.group(1) else -1
        if depth == 0:
            return src.index("%}", m.end()) + 2
        at = m.end()
    raise AssertionError(f"unclosed block at {start} (last tag at {at})")


def wrap(body):
    return "{%- generation -%}" + body + "{%- endgeneration -%}"


def model_only(body):
    return "{%- if role == 'model' -%}" + wrap(body) + "{%- else -%}" + body + "{%- endif -%}"


def training_template(src):
    """The stock template with generation blocks around what trains (module docstring)."""
    loop = src.index("{%- for message in loop_messages -%}")
    head, body = src[:loop], src[loop:]
    # Thinking rendered into a model turn.
    body = re.sub(r"\{\{- '<\|channel>thought\\n' \+ thinking_text \+ '\\n<channel\|>' -\}\}",
                  lambda m: wrap(m.group(0)), body)
    # The tool calls.
    at = re.search(r"\{%- for tool_call in message(\.get\('tool_calls'\)|\['tool_calls'\]) -%\}", body).start()
    end = block_end(body, at, r"\{%-? for ", r"\{%-? endfor")
    body = body[:at] + wrap(body[at:end]) + body[end:]
    # The content: the captured block where the revision has one, else its if/elif chain.
    if "{{- captured_content -}}" in body:
        body = body.replace("{{- captured_content -}}", model_only("{{- captured_content -}}"), 1)
    else:
        at = re.search(r"\{%- if message(\.get\('content'\)|\['content'\]) is string -%\}", body).start()
        end = block_end(body, at, r"\{%-? if ", r"\{%-? endif")
        body = body[:at] + model_only(body[at:end]) + body[end:]
    # The turn's end: `<turn|>` trains, its newline does not; a dangling `<|tool_response>` is a model turn's stop.
    body = body.replace("{{- '<turn|>\\n' -}}", model_only("{{- '<turn|>' -}}") + "{{- '\\n' -}}")
    body = re.sub(r"(prev_message_type == 'tool_call' and not ns_tr_out\.flag -%\}\s*)"
                  r"(\{\{- '<\|tool_response>' -\}\})", lambda m: m.group(1) + wrap(m.group(2)), body)
    return head + body


# ---- random conversations ------------------------------------------------------------------------------------
MARKUP = ["<|turn>model\n", "<turn|>", "<|tool_response>", "<tool_response|>", "<|turn>user\n", "<|image|>"]
WORDS = ["alpha", "beta", "gamma", "Straße", "漢字", "🙂", "x=1", "a  b", "tab\there", "line\nbreak"]


def text(rng, markup=True):
    parts = [rng.choice(WORDS) for _ in range(rng.randint(1, 5))]
    if markup and rng.random() < 0.25:
        parts.insert(rng.randint(0, len(parts)), rng.choice(MARKUP[:5]))
    s = " ".join(parts)
    pad = rng.choice(["", "", " ", "\n", "  \n", "\u3000"])
    return pad + s + rng.choice(["", "", " ", "\n\n"])


def arguments(rng):
    out = {}
    for key in rng.sample(["city", "n", "flag", "items", "opts"], rng.randint(0, 3)):
        out[key] = {"city": lambda: text(rng, False).strip() or "x", "n": lambda: rng.randint(-5, 500),
                    "flag": lambda: rng.random() < 0.5, "items": lambda: ["a", 2, True],
                    "opts": lambda: {"z": "q", "a": 1}}[key]()
    return out


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "description": "The city."}},
                                               "required": ["city"]}}},
         {"type": "function", "function": {"name": "count", "description": "Counts.",
                                           "parameters": {"type": "object", "properties": {
                                               "n": {"type": "integer", "description": "How many."}}}}}]


def conversation(rng):
    msgs, tools = [], None
    first = rng.random()
    if first < 0.3:
        msgs.append({"role": "system", "content": text(rng)})
    elif first < 0.4:
        msgs.append({"role": "developer", "content": text(rng, False)})
    if rng.random() < 0.3:
        tools = TOOLS[:rng.randint(1, 2)]
    for turn in range(rng.randint(1, 3)):
        if rng.random() < 0.3:
            msgs.append({"role": "user", "content": [{"type": "image", "path": "img.png"},
                                                     {"type": "text", "text": text(rng)}]})
        else:
            msgs.append({"role": "user", "content": text(rng)})
        for _ in range(rng.choice([1, 1, 1, 2])):  # consecutive assistant messages now and then
            m = {"role": "assistant"}
            if rng.random() < 0.2:
                m["reasoning_content"] = text(rng, False).strip() or "think"
            if tools and rng.random() < 0.5:
                calls = [{"id": f"c{turn}{k}", "type": "function",
                          "function": {"name": rng.choice(tools)["function"]["name"], "arguments": arguments(rng)}}
                         for k in range(rng.randint(1, 2))]
                m["tool_calls"] = calls
                if rng.random() < 0.5:
                    m["content"] = text(rng)
                msgs.append(m)
                last = turn == 2 and rng.random() < 0.3
                if not last:  # a call left without a response ends a conversation now and then
                    for call in calls:
                        msgs.append({"role": "tool", "tool_call_id": call["id"],
                                     "name": call["function"]["name"], "content": text(rng, False)})
                    msgs.append({"role": "assistant", "content": text(rng)})
            else:
                content = text(rng)
                if rng.random() < 0.15:
                    content = "<|channel>thought\nhidden<channel|>" + content
                m["content"] = content
                msgs.append(m)
    c = {"messages": msgs}
    if tools:
        c["tools"] = tools
    return c


def trained_chars(text_, spans):
    mask = [False] * len(text_)
    for b, e in spans:
        for i in range(b, e):
            mask[i] = True
    return mask


def run_tool(tool, template_path, jsonl, train_on, prefix, thinking, tokenizer=None):
    cmd = [tool, template_path, jsonl, train_on, "1" if prefix else "0"]
    if tokenizer:
        cmd.append(tokenizer)
    cmd += ["--thinking", "1" if thinking else "0"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"FAILED: {' '.join(cmd)}: {out.stderr}")
    return [json.loads(line) for line in out.stdout.splitlines()]


def segment_mask(result):
    text_, mask = "", []
    for seg, trained in result["segments"]:
        text_ += seg
        mask += [trained] * len(seg)
    assert text_ == result["text"]
    return mask


def main():
    if len(sys.argv) < 2:
        sys.exit("usage: chat_labels.py CHAT_RENDER_TOOL [TOKENIZER_JSON]")
    tool, tokenizer_json = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    hf_tok = PreTrainedTokenizerFast(tokenizer_file=tokenizer_json) if tokenizer_json else None
    failures = []
    with tempfile.TemporaryDirectory() as work:
        open(os.path.join(work, "img.png"), "wb").close()  # image parts need a file; nothing decodes it here
        for name, stock in gemma4_templates().items():
            marked = training_template(stock)
            stock_path = os.path.join(work, name)
            with open(stock_path, "w") as f:
                f.write(stock)
            for thinking in (False, True):
                rng = random.Random(f"{name}-{thinking}")
                convs = [conversation(rng) for _ in range(CASES)]
                jsonl = os.path.join(work, f"{name}-{thinking}.jsonl")
                with open(jsonl, "w") as f:
                    for c in convs:
                        f.write(json.dumps(c, ensure_ascii=False) + "\n")
                kwargs = dict(bos_token="<bos>", eos_token="<eos>", enable_thinking=thinking)
                oracle = []
                for c in convs:
                    plain, _ = render_jinja_template([c["messages"]], tools=c.get("tools"), chat_template=stock,
                                                     **kwargs)
                    text_, spans = render_jinja_template([c["messages"]], tools=c.get("tools"), chat_template=marked,
                                                         return_assistant_tokens_mask=True, **kwargs)
                    if plain[0] != text_[0]:
                        sys.exit(f"FAILED: {name}: the generation blocks changed the rendering:\n{plain[0]!r}\n"
                                 f"{text_[0]!r}")
                    oracle.append((text_[0], spans[0]))
                results = {(t, p): run_tool(tool, stock_path, jsonl, t, p, thinking)
                           for t in ("assistant", "last_assistant", "all") for p in (False, True)}
                for i, (want_text, spans) in enumerate(oracle):
                    where = f"{name} thinking={thinking} case {i}"
                    got = results[("assistant", False)][i]
                    if "error" in got:
                        failures.append(f"{where}: {got['error']}")
                        continue
                    if got["text"] != want_text:
                        failures.append(f"{where}: text differs:\n{got['text']!r}\n{want_text!r}")
                        continue
                    want = trained_chars(want_text, spans)
                    if segment_mask(got) != want:
                        failures.append(f"{where}: trained characters differ:\n{got['segments']!r}\nspans {spans}")
                        continue
                    # last_assistant: the trained characters of the last model turn, i.e. those after the last
                    # `<|turn>model\n` header the template wrote (the last trained character's turn).
                    last = segment_mask(results[("last_assistant", False)][i])
                    trained_at = [k for k, t in enumerate(want) if t]
                    if trained_at:
                        # The last header before the last trained character; a header typed inside trained content
                        # would be found instead, so such cases (the header inside a span) are left to check 1.
                        tail = max(want_text.rfind("<|turn>model\n", 0, trained_at[-1] + 1), 0)
                        expect = [t and k >= tail for k, t in enumerate(want)]
                        if not any(b <= tail < e for b, e in spans) and last != expect:
                            failures.append(f"{where}: last_assistant differs: {results[('last_assistant', False)][i]['segments']!r}")
                    # all: every character but the image placeholders (content never types one: MARKUP[:5]).
                    expect_all = [True] * len(want_text)
                    for m in re.finditer(re.escape("<|image|>"), want_text):
                        expect_all[m.start():m.end()] = [False] * (m.end() - m.start())
                    if segment_mask(results[("all", False)][i]) != expect_all:
                        failures.append(f"{where}: train_on all differs")
                    # The thought prefix: same trained text, the prefix only inserted, always masked.
                    with_prefix = results[("assistant", True)][i]
                    trained_text = "".join(s for s, t in got["segments"] if t)
                    if "".join(s for s, t in with_prefix["segments"] if t) != trained_text:
                        failures.append(f"{where}: the thought prefix changed the trained text")
                    headers = want_text.count("<|turn>model\n") - want_text.count("<|turn>model\n<|channel>")
                    if with_prefix["text"].count(PREFIX) - want_text.count(PREFIX) > headers or \
                            with_prefix["text"].replace(PREFIX, "") != want_text.replace(PREFIX, ""):
                        failures.append(f"{where}: the thought prefix is not only inserted:\n{with_prefix['text']!r}")
                if hf_tok is not None:
                    tok_results = run_tool(tool, stock_path, jsonl, "assistant", False, thinking, tokenizer_json)
                    for i, c in enumerate(convs):
                        where = f"{name} thinking={thinking} case {i} (tokens)"
                        enc = hf_tok.apply_chat_template(c["messages"], tools=c.get("tools"), chat_template=marked,
                                                         tokenize=True, return_dict=True,
                                                         return_assistant_tokens_mask=True, **kwargs)
                        got = tok_results[i]
                        if "error" in got:
                            failures.append(f"{where}: {got['error']}")
                        elif got["ids"] != list(enc["input_ids"]):
                            failures.append(f"{where}: ids differ")
                        elif got["trained"] != list(enc["assistant_masks"]):
                            failures.append(f"{where}: trained tokens differ from assistant_masks")
            print(f"{name}: {CASES} conversations x thinking on/off x 3 train_on x thought prefix on/off checked")
    if failures:
        print(f"FAILED: {len(failures)} mismatches; the first ones:", file=sys.stderr)
        for f in sorted(failures, key=lambda f: "text differs" in f)[:8]:
            print(f, file=sys.stderr)
        sys.exit(1)
    print("ok")


if __name__ == "__main__":
    main()
