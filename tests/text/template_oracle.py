#!/usr/bin/env python3
"""ringflex's chat template engine against jinja2 as transformers sets it up, byte for byte.

The real templates are the ones the pinned PyPI `trl` wheel ships (installed without its dependencies by
scripts/setup.sh; located through its file list, since importing trl would import its dependencies): every Gemma 4
revision (gemma4.jinja, gemma4_v2..v5.jinja) and, as further coverage, the other models' templates listed in
EXTRA_TEMPLATES. Each is rendered on seeded random conversations (system or developer turn or none, thinking on or
off, tools with nested parameter schemas, tool calls and role:tool responses with string or parts content, several
and consecutive assistant turns, reasoning, parts with text and images, unicode and special-token text in content,
add_generation_prompt on and off) by jinja2 through transformers' own compiled environment and by
`template_render` (tests/text/template_render.cpp) on the same variables as JSON. A render must be identical, or
both must fail (raise_exception and the like). The variables are what transformers' render_jinja_template passes
(its message preprocessing included), checked against render_jinja_template's own output for every case.

Usage: template_oracle.py TEMPLATE_RENDER [--cases N] [--seed S] [--all] [--template FILE...]
  --all: every template in the wheel, reporting which pass, without failing on those outside GEMMA4 and
  EXTRA_TEMPLATES; --template: these files instead (a checkpoint's chat_template.jinja, another revision), each
  required to match.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from oracle_env import missing_oracle  # noqa: E402

try:
    from importlib.metadata import PackageNotFoundError, files

    import jinja2  # noqa: F401
    from transformers.utils import chat_template_utils as ctu
    try:
        TRL_FILES = files("trl")
    except PackageNotFoundError as e:
        raise ImportError("trl is not installed (scripts/setup.sh installs it with --no-deps)") from e
except ImportError as e:
    missing_oracle(e)

GEMMA4 = ["gemma4", "gemma4_v2", "gemma4_v3", "gemma4_v4", "gemma4_v5"]
# Other models' templates from the same wheel that must match too (their own conventions for tools and reasoning
# reach more of the engine: tojson of schemas, string methods, loop.previtem, raise_exception paths): those on
# which at most a quarter of these random conversations end in the template's own error (the test allows a third).
# The rest of the wheel (`--all`) also renders identically, but mostly refuses these conversations (no tools, no
# parts content, ...).
EXTRA_TEMPLATES = ["diffusion_gemma", "diffusion_gemma_training", "glm4moe", "glm4moe_training", "lfm2_2_5",
                   "lfm2_2_5_v2", "lfm2_2_5_vl", "lfm2_v2", "lfm2_v2_training", "llama3", "llama3_1", "llama3_2",
                   "llama3_training", "muse_glimmer", "muse_glimmer_training", "nemotron_3_5_lightning",
                   "nemotron_3_5_lightning_training", "nemotron_3_nano", "nemotron_3_nano_training",
                   "nemotron_3_super", "nemotron_3_super_training", "nemotron_3_ultra", "nemotron_3_ultra_training",
                   "qwen2_5_vl", "qwen2_5_vl_training", "qwen3", "qwen3_5_nothink", "qwen3_5_nothink_training",
                   "qwen3_5_think", "qwen3_5_think_training", "qwen3_6", "qwen3_6_training", "qwen3_8",
                   "qwen3_8_training", "qwen3_instruct_2507", "qwen3_instruct_2507_training", "qwen3_training",
                   "qwen3_vl", "qwen3_vl_training"]


def template_paths():
    found = {}
    for f in TRL_FILES:
        s = str(f)
        if s.startswith("trl/chat_templates/") and s.endswith(".jinja"):
            found[os.path.basename(s)[: -len(".jinja")]] = str(f.locate())
    return found


WORDS = ["hello", "world", "tool", "  padded  ", "naïve café", "日本語のテキスト", "emoji 🎉🚀", "e\u0301 combining",
         "<|turn>", "<turn|>", "<start_of_turn>", "<|image|>", "{{ not a tag }}", "{% raw %}", "quote ' and \"",
         "back\\slash", "tab\there", "line\nbreak", "\n\nleading newlines", "trailing newline\n", "<|\"|>",
         "<|channel>thought\nhidden<channel|>", "Σίσυφος", "Привет", "ß", "\u00a0nbsp\u00a0", "x" * 40]


def text(rng, n=None):
    n = n or rng.randint(1, 6)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def schema(rng, depth=0):
    kind = rng.choice(["string", "integer", "number", "boolean", "array", "object"] if depth < 2 else
                      ["string", "integer", "number", "boolean"])
    s = {"type": kind}
    if rng.random() < 0.7:
        s["description"] = text(rng, 2)
    if kind == "string" and rng.random() < 0.4:
        s["enum"] = [rng.choice(["celsius", "fahrenheit", "kelvin", "a b", "ü"]) for _ in range(rng.randint(1, 3))]
    if kind == "array":
        s["items"] = schema(rng, depth + 1) if rng.random() < 0.6 else {"type": "string"}
    if kind == "object" and rng.random() < 0.8:
        props = {f"p{k}_{rng.choice(['x', 'Y', 'z'])}": schema(rng, depth + 1) for k in range(rng.randint(1, 3))}
        s["properties"] = props
        if rng.random() < 0.6:
            s["required"] = rng.sample(sorted(props), rng.randint(1, len(props)))
    if rng.random() < 0.2:
        s["nullable"] = True
    return s


def tool(rng, k):
    props = {f"arg{j}": schema(rng) for j in range(rng.randint(0, 4))}
    fn = {"name": f"tool_{k}", "description": text(rng, 3)}
    if rng.random() < 0.9:
        fn["parameters"] = {"type": "object", "properties": props}
        if props and rng.random() < 0.7:
            fn["parameters"]["required"] = rng.sample(sorted(props), rng.randint(1, len(props)))
    if rng.random() < 0.2:
        fn["response"] = {"type": "object", "description": text(rng, 2)}
    return {"type": "function", "function": fn}


def argument_value(rng, depth=0):
    r = rng.random()
    if depth < 2 and r < 0.15:
        return [argument_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if depth < 2 and r < 0.3:
        return {rng.choice(["k", "B", "a_b", "ключ"]) + str(j): argument_value(rng, depth + 1)
                for j in range(rng.randint(0, 3))}
    return rng.choice([text(rng, 1), rng.randint(-1000, 10 ** 12), rng.choice([0.5, 1.0, -2.25, 1e16, 3.14159, 1e-7]),
                       True, False, None])


def content(rng, allow_images=True):
    if rng.random() < 0.6:
        return text(rng)
    parts = []
    for _ in range(rng.randint(1, 3)):
        if allow_images and rng.random() < 0.35:
            parts.append({"type": "image"})
        else:
            parts.append({"type": "text", "text": text(rng)})
    return parts


def conversation(rng, tools):
    messages = []
    if rng.random() < 0.5:
        messages.append({"role": rng.choice(["system", "system", "developer"]), "content": content(rng, False)})
    call_id = 0
    for _ in range(rng.randint(1, 4)):
        messages.append({"role": "user", "content": content(rng)})
        for _ in range(1 if rng.random() < 0.8 else 2):  # sometimes two assistant messages in a row
            msg = {"role": "assistant"}
            if rng.random() < 0.85:
                msg["content"] = content(rng, False)
            if rng.random() < 0.3:
                msg[rng.choice(["reasoning", "reasoning_content"])] = text(rng)
            responses = []
            if tools and rng.random() < 0.4:
                calls = []
                for _ in range(rng.randint(1, 2)):
                    t = rng.choice(tools)["function"]
                    args = {name: argument_value(rng) for name in t.get("parameters", {}).get("properties", {})}
                    call_id += 1
                    calls.append({"id": f"call_{call_id}", "type": "function",
                                  "function": {"name": t["name"],
                                               "arguments": json.dumps(args) if rng.random() < 0.05 else args}})
                    tool_msg = {"role": "tool", "tool_call_id": f"call_{call_id}",
                                "content": content(rng) if rng.random() < 0.5 else json.dumps({"result": text(rng, 1)})}
                    if rng.random() < 0.5:
                        tool_msg["name"] = t["name"]
                    responses.append(tool_msg)
                msg["tool_calls"] = calls
            messages.append(msg)
            messages.extend(responses)
            if responses and rng.random() < 0.7:
                messages.append({"role": "assistant", "content": text(rng)})
    if rng.random() < 0.2:
        messages.pop()  # end on a user or tool turn sometimes
    return messages


def case(rng):
    tools = [tool(rng, k) for k in range(rng.randint(1, 3))] if rng.random() < 0.4 else None
    messages = conversation(rng, tools or [])
    kwargs = {"bos_token": "<bos>", "eos_token": "<eos>"}
    if rng.random() < 0.7:
        kwargs["enable_thinking"] = rng.random() < 0.5
    return messages, tools, rng.random() < 0.5, kwargs


def variables(messages, tools, add_generation_prompt, kwargs):
    """What transformers' render_jinja_template hands the compiled template (its preprocessing repeated)."""
    chat = ctu._alias_reasoning_fields(ctu._plain_template_data(messages))
    return {"messages": chat, "tools": ctu._plain_template_data(tools), "documents": None,
            "add_generation_prompt": add_generation_prompt, **ctu._plain_template_data(kwargs)}


def jinja_render(source, messages, tools, add_generation_prompt, kwargs):
    compiled = ctu._compile_jinja_template(source)
    try:
        direct = compiled.render(**variables(messages, tools, add_generation_prompt, kwargs))
    except Exception as e:  # noqa: BLE001 - any jinja2 failure is an expected failure for ringflex too
        return {"error": f"{type(e).__name__}: {e}"}
    # The same through transformers' public path: the variables above are what it passes.
    rendered, _ = ctu.render_jinja_template(conversations=[messages], tools=tools, chat_template=source,
                                            add_generation_prompt=add_generation_prompt, **kwargs)
    assert rendered[0] == direct, "the test's variables differ from what transformers passes"
    return {"text": direct}


def first_difference(a, b):
    k = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
    return k, a[max(0, k - 60):k + 60], b[max(0, k - 60):k + 60]


def check_template(binary, name, path, n_cases, seed):
    source = open(path, encoding="utf-8").read()
    rng = random.Random(f"{seed}:{name}")
    cases = [case(rng) for _ in range(n_cases)]
    expected = [jinja_render(source, *c) for c in cases]
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False, encoding="utf-8") as f:
        for c in cases:
            f.write(json.dumps(variables(*c), ensure_ascii=False) + "\n")
        cases_path = f.name
    try:
        run = subprocess.run([binary, path, cases_path], capture_output=True, text=True, timeout=240)
    finally:
        os.unlink(cases_path)
    if run.returncode != 0:
        return 0, n_cases, 0, [f"does not parse: {run.stderr.strip()}"]
    got = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(got) == n_cases, f"{name}: {len(got)} results for {n_cases} cases"
    problems = []
    both_failed = 0
    for k, (want, have) in enumerate(zip(expected, got)):
        if "error" in want or "error" in have:
            if "error" in want and "error" in have:
                both_failed += 1
                # raise_exception's message must come through (jinja2 raises it as a bare TemplateError).
                message = want["error"].split(": ", 1)[1]
                if want["error"].startswith("TemplateError: ") and message not in have["error"]:
                    problems.append(f"case {k}: the template's message {message!r} is not in {have['error']!r}")
                continue
            problems.append(f"case {k}: jinja2 {'failed' if 'error' in want else 'rendered'}, ringflex "
                            f"{'failed: ' + have['error'] if 'error' in have else 'rendered'}"
                            + (f" (jinja2: {want['error']})" if "error" in want else ""))
            continue
        if want["text"] != have["text"]:
            at, w, h = first_difference(want["text"], have["text"])
            problems.append(f"case {k}: differs at character {at}:\n  jinja2:   {w!r}\n  ringflex: {h!r}")
    return n_cases - len(problems), n_cases, both_failed, problems


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("--cases", type=int, default=150)
    ap.add_argument("--seed", type=int, default=36)
    ap.add_argument("--all", action="store_true")
    ap.add_argument("--template", nargs="+", default=[])
    args = ap.parse_args()
    if args.template:
        failed = False
        for path in args.template:
            ok, total, both_failed, problems = check_template(args.binary, os.path.basename(path), path, args.cases,
                                                              args.seed)
            print(f"{path}: {ok}/{total} identical to jinja2 ({both_failed} of them an error in both)")
            for p in problems[:3]:
                print("  " + p)
            failed = failed or bool(problems)
        return 1 if failed else 0
    paths = template_paths()
    missing = [n for n in GEMMA4 + EXTRA_TEMPLATES if n not in paths]
    if missing:
        print(f"FAILED: the trl wheel lacks {missing}", file=sys.stderr)
        return 1
    names = sorted(paths) if args.all else GEMMA4 + EXTRA_TEMPLATES
    required = set(GEMMA4 + EXTRA_TEMPLATES)
    failed = False
    for name in names:
        ok, total, both_failed, problems = check_template(args.binary, name, paths[name], args.cases, args.seed)
        print(f"{name}: {ok}/{total} identical to jinja2 ({both_failed} of them an error in both)"
              + ("" if name in required else " (extra)"))
        for p in problems[:3]:
            print("  " + p)
        # Most cases must render: a template that fails on nearly every conversation would pass vacuously.
        if name in required and (problems or both_failed > total // 3):
            failed = True
    if failed:
        print("FAILED: a required template renders differently from jinja2", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
