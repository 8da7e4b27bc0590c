#!/usr/bin/env python3
"""Render golden chat prompts with jinja2 set up the way Hugging Face transformers renders
chat templates, for engine/tests/chat.rs to compare our minijinja renderer against.

The environment mirrors transformers' `_compile_jinja_template` (utils/chat_template_utils.py):
an ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the loopcontrols extension
and a `{% generation %}` block extension (transformers' AssistantTracker; here it only renders
its body), the `tojson` filter as `json.dumps(x, ensure_ascii=False, indent, separators,
sort_keys)`, and the globals `raise_exception` (raises TemplateError) and `strftime_now`. The
render call passes what `apply_chat_template` passes: messages, tools=None, documents=None,
add_generation_prompt, the special tokens, and enable_thinking when it is set.

strftime_now uses the fixed time FIXED_NOW so the goldens do not change with the date; the
Rust test uses the same instant.

Usage: pip install jinja2; scripts/render-chat-golden.py [templates_dir] [out_dir]
Writes <out_dir>/<template>.<variant>.txt and <out_dir>/manifest.tsv.
"""

import datetime
import json
import os
import sys

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TEMPLATES = os.path.join(ROOT, "..", "shared", "data", "templates")
DEFAULT_OUT = os.path.join(ROOT, "engine", "tests", "golden", "chat")
# Templates of our own, rendered beside the model templates: (stem, path).
OWN_TEMPLATES = [("bmoe-builtin", os.path.join(ROOT, "engine", "assets", "chat_template.jinja"))]

# Keep in step with engine/tests/chat.rs.
FIXED_NOW = datetime.datetime(2025, 3, 14, 15, 9, 26)
BOS = "<|bos|>"
EOS = "<|eos|>"
MESSAGES = [
    {"role": "system", "content": "You are a careful assistant. Answer briefly."},
    {"role": "user", "content": "What is 17 * 3?"},
    {
        "role": "assistant",
        "content": "17 * 3 = 51.",
        "reasoning_content": "17 * 3 is 17 + 17 + 17. That is 34 + 17 = 51.",
    },
    {"role": "user", "content": "And in Ünïcode — write it as \"fünfzig-eins\"? <ok> & done."},
]
# (variant name, add_generation_prompt, enable_thinking or None for "not passed")
VARIANTS = [
    ("think", True, True),
    ("nothink", True, False),
    ("default", False, None),
]


class GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body (transformers records the
    span for assistant masks, which does not change the text)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def strftime_now(fmt):
    return FIXED_NOW.strftime(fmt)


def make_env():
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def render(template, add_generation_prompt, enable_thinking):
    kwargs = {
        "messages": MESSAGES,
        "tools": None,
        "documents": None,
        "add_generation_prompt": add_generation_prompt,
        "bos_token": BOS,
        "eos_token": EOS,
    }
    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
    return template.render(**kwargs)


def main():
    templates_dir = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_TEMPLATES
    out_dir = sys.argv[2] if len(sys.argv) > 2 else DEFAULT_OUT
    os.makedirs(out_dir, exist_ok=True)
    env = make_env()
    rows = []
    sources = [
        (name[: -len(".jinja")], os.path.join(templates_dir, name))
        for name in sorted(os.listdir(templates_dir))
        if name.endswith(".jinja")
    ] + OWN_TEMPLATES
    for stem, template_path in sources:
        with open(template_path, encoding="utf-8") as f:
            source = f.read()
        try:
            template = env.from_string(source)
        except jinja2.TemplateError as e:
            for variant, _, _ in VARIANTS:
                rows.append((stem, variant, "error", f"compile: {type(e).__name__}: {e}"))
            continue
        for variant, agp, think in VARIANTS:
            path = os.path.join(out_dir, f"{stem}.{variant}.txt")
            try:
                text = render(template, agp, think)
            except Exception as e:  # the template refused this conversation
                msg = str(e).replace("\t", " ").replace("\n", " ")
                rows.append((stem, variant, "error", f"{type(e).__name__}: {msg}"))
                if os.path.exists(path):
                    os.remove(path)
                continue
            with open(path, "w", encoding="utf-8", newline="") as f:
                f.write(text)
            rows.append((stem, variant, "ok", ""))
    with open(os.path.join(out_dir, "manifest.tsv"), "w", encoding="utf-8", newline="") as f:
        f.write("# template\tvariant\tstatus\tdetail (written by scripts/render-chat-golden.py)\n")
        for row in rows:
            f.write("\t".join(row) + "\n")
    n_ok = sum(1 for r in rows if r[2] == "ok")
    print(f"{n_ok}/{len(rows)} renders written to {out_dir}")
    for r in rows:
        if r[2] != "ok":
            print(f"  {r[0]} [{r[1]}]: {r[3]}")


if __name__ == "__main__":
    main()
