"""Generate docs/api.md from the numpydoc docstrings of cupyquant's public API.

    python scripts/gen_api_docs.py            # write docs/api.md
    python scripts/gen_api_docs.py --check    # exit 1 if docs/api.md is out of date

Every name in ``cupyquant.__all__`` gets a section (signature, summary, Parameters, Returns, Raises,
Notes, Attributes, and the public methods and properties of classes), grouped by the module that
defines it, after that module's docstring; then every public function of ``cupyquant.reference``.
The op modules import CuPy, which imports without a GPU. ``tests/test_docs.py`` regenerates the
page and fails when the committed one differs, so edit the docstrings, not docs/api.md.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
API_MD = ROOT / "docs" / "api.md"

#: Module order on the page, and what each section is called.
MODULES = [
    ("quantized", "Quantized tensors and dequantization"),
    ("per_tensor", "Per-tensor FP8"),
    ("groupwise", "Per-token and per-group FP8/INT8, fused SiLU*Mul"),
    ("mx", "Microscaling: MXFP8, MXFP4"),
    ("nvfp4", "NVFP4"),
    ("norm", "Fused (residual add +) RMSNorm + quantization"),
    ("kv_cache", "Quantized KV-cache writes"),
    ("weight", "Weight-only INT4/FP8 and the matmul"),
    ("w8a8", "W8A8 FP8 and INT8 matmul"),
    ("_jit", "Errors"),
    ("_device", "GPU capabilities"),
]

SECTIONS = ("Parameters", "Returns", "Raises", "Attributes", "Notes", "Examples", "See Also", "Warns", "Yields")
_LISTED = ("Parameters", "Returns", "Raises", "Attributes", "Warns", "Yields")


# ---------------------------------------------------------------- reST -> Markdown, inline
def _inline(text: str) -> str:
    """reST inline markup to Markdown: ``x`` and :role:`x` become `x`, with a ~ prefix dropped and
    whitespace inside a role target (a target broken across lines) removed."""

    def role(m):
        target = re.sub(r"\s+", "", m.group(1)).lstrip("~")
        return f"`{target}`"

    text = re.sub(r":(?:func|class|meth|attr|mod|data|exc|obj):`([^`]+)`", role, text, flags=re.S)
    text = re.sub(r"``(.+?)``", lambda m: "`" + re.sub(r"\s*\n\s*", " ", m.group(1)) + "`", text, flags=re.S)
    return text


def _paragraphs(lines) -> list[str]:
    """Join wrapped lines into paragraphs; lines starting with '- ' start list items."""
    out, cur = [], []
    for line in lines:
        s = line.strip()
        if not s:
            if cur:
                out.append(" ".join(cur))
                cur = []
            continue
        if s.startswith("- ") and cur:
            out.append(" ".join(cur))
            cur = []
        cur.append(s)
    if cur:
        out.append(" ".join(cur))
    return out


def _text(lines) -> str:
    paras = _paragraphs(lines)
    blocks, items = [], []
    for p in paras:
        if p.startswith("- "):
            items.append(p)
            continue
        if items:
            blocks.append("\n".join(items))
            items = []
        blocks.append(p)
    if items:
        blocks.append("\n".join(items))
    return _inline("\n\n".join(blocks))


# ---------------------------------------------------------------- numpydoc parsing
def _split_sections(doc: str):
    """(intro lines, {section: lines}) of a cleaned docstring."""
    lines = doc.splitlines()
    intro, sections, cur = [], {}, None
    i = 0
    while i < len(lines):
        line = lines[i]
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if line.strip() in SECTIONS and nxt.strip() and set(nxt.strip()) == {"-"}:
            cur = line.strip()
            sections[cur] = []
            i += 2
            continue
        (intro if cur is None else sections[cur]).append(line)
        i += 1
    return intro, sections


def _entries(lines):
    """numpydoc list entries: ('name : type' or 'Type', description lines)."""
    entries = []
    for line in lines:
        if line and not line[0].isspace():
            entries.append((line.strip(), []))
        elif entries:
            entries[-1][1].append(line)
    return entries


def _entry_md(head: str, desc) -> str:
    if " : " in head:
        name, typ = head.split(" : ", 1)
        lead = f"- `{name}` ({_inline(typ)})"
    else:
        lead = f"- `{head}`"
    body = _text(textwrap.dedent("\n".join(desc)).splitlines())
    if not body:
        return lead
    body = body.replace("\n\n", "\n\n  ").replace("\n- ", "\n  - ")
    return f"{lead}: {body}"


def docstring_md(obj) -> str:
    doc = inspect.getdoc(obj) or ""
    if not doc:
        return ""
    intro, sections = _split_sections(doc)
    parts = []
    if any(line.strip() for line in intro):
        parts.append(_text(intro))
    for name in SECTIONS:
        if name not in sections:
            continue
        if name in _LISTED:
            items = [_entry_md(h, d) for h, d in _entries(sections[name])]
            parts.append(f"**{name}**\n\n" + "\n".join(items))
        else:
            parts.append(f"**{name}**\n\n" + _text(sections[name]))
    return "\n\n".join(parts)


# ---------------------------------------------------------------- signatures
def _annotation(a) -> str:
    if a is inspect.Parameter.empty:
        return ""
    return a if isinstance(a, str) else inspect.formatannotation(a)


def signature(name: str, obj) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return name
    parts, star_done, slash_pending = [], False, False
    for p in sig.parameters.values():
        if p.kind is p.POSITIONAL_ONLY:
            slash_pending = True
        elif slash_pending:
            parts.append("/")
            slash_pending = False
        if p.kind is p.KEYWORD_ONLY and not star_done:
            parts.append("*")
            star_done = True
        s = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        if p.kind is p.VAR_POSITIONAL:
            star_done = True
        ann = _annotation(p.annotation)
        if ann:
            s += f": {ann}"
        if p.default is not inspect.Parameter.empty:
            s += f" = {p.default!r}" if ann else f"={p.default!r}"
        parts.append(s)
    if slash_pending:
        parts.append("/")
    ret = _annotation(sig.return_annotation)
    return f"{name}({', '.join(parts)})" + (f" -> {ret}" if ret else "")


# ---------------------------------------------------------------- page
def _anchor(name: str) -> str:
    return name.lower().replace(".", "")


def _members(cls):
    """Public methods and properties defined on the class itself, in definition order."""
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, classmethod):
            value = value.__func__
        if isinstance(value, property) or inspect.isfunction(value):
            yield name, value


def _class_md(qual: str, cls) -> list[str]:
    out = []
    init = cls.__init__ if "__init__" in vars(cls) else None
    if init is not None and not issubclass(cls, BaseException):
        sig = signature(qual, init).replace("(self, ", "(").replace("(self)", "()")
    elif "__dataclass_fields__" in vars(cls):
        sig = signature(qual, cls).removesuffix(" -> None")
    else:
        sig = f"class {qual}"
    if issubclass(cls, BaseException):
        bases = ", ".join(b.__name__ for b in cls.__bases__)
        sig = f"class {qual}({bases})"
    out += ["```python", sig, "```", ""]
    body = docstring_md(cls)
    if body:
        out += [body, ""]
    for name, value in _members(cls):
        if isinstance(value, property):
            out += [f"#### `{qual}.{name}` (property)", ""]
            doc = docstring_md(value.fget)
        else:
            msig = signature(f"{qual}.{name}", value)
            msig = msig.replace("(self, ", "(").replace("(self)", "()").replace("(cls, ", "(").replace("(cls)", "()")
            out += [f"#### `{qual}.{name}`", "", "```python", msig, "```", ""]
            doc = docstring_md(value)
        if doc:
            out += [doc, ""]
    return out


def render() -> str:
    sys.path.insert(0, str(ROOT))
    import cupyquant

    exports = dict(cupyquant._EXPORTS)
    names = [n for n in cupyquant.__all__ if n != "__version__"]
    missing = sorted(set(names) - set(exports))
    if missing:
        raise RuntimeError(f"names in cupyquant.__all__ without a module in _EXPORTS: {missing}")
    modules = [m for m, _ in MODULES]
    unknown = sorted({exports[n] for n in names} - set(modules))
    if unknown:
        raise RuntimeError(f"add these modules to MODULES in scripts/gen_api_docs.py: {unknown}")

    lines = [
        "# API reference",
        "",
        "<!-- Generated by scripts/gen_api_docs.py from the docstrings; do not edit by hand. "
        "tests/test_docs.py checks that it is up to date. -->",
        "",
        f"cupyquant {cupyquant.__version__}. Every name below is importable from `cupyquant` "
        "(`import cupyquant as cq; cq.quantize_fp8(...)`); the op modules load on first use. "
        "The NumPy reference, `cupyquant.reference`, is listed after them. The scheme pages "
        "([index](index.md)) explain the formulas and layouts with examples.",
        "",
        "## Contents",
        "",
    ]
    by_module = {m: [n for n in names if exports[n] == m] for m in modules}
    for m, title in MODULES:
        if by_module[m]:
            links = ", ".join(f"[`{n}`](#{_anchor(n)})" for n in by_module[m])
            lines.append(f"- {title}: {links}")
    lines += [
        "- `cupyquant.__version__`: the package version string",
        "- [`cupyquant.reference`](#cupyquantreference)",
        "",
    ]

    for m, title in MODULES:
        if not by_module[m]:
            continue
        mod = importlib.import_module(f"cupyquant.{m}")
        lines += [f"## {title}", ""]
        if m != "_jit" and mod.__doc__:
            lines += [f"*Module `cupyquant.{m}`.*", "", docstring_md(mod), ""]
        for n in by_module[m]:
            obj = getattr(mod, n)
            lines += [f"### {n}", ""]
            if inspect.isclass(obj):
                lines += _class_md(n, obj)
            else:
                lines += ["```python", signature(n, obj), "```", ""]
                body = docstring_md(obj)
                if body:
                    lines += [body, ""]

    ref = importlib.import_module("cupyquant.reference")
    lines += ["## cupyquant.reference", "", docstring_md(ref), ""]
    # the functions the reference package defines, in the order of its __all__ (family by family);
    # those it re-exports from elsewhere (FP4 packing, the weight scheme checks) are documented there
    funcs = [
        (name, f)
        for name, f in ((n, getattr(ref, n)) for n in ref.__all__)
        if inspect.isfunction(f) and f.__module__.startswith(ref.__name__ + ".")
    ]
    for name, f in funcs:
        lines += [f"### reference.{name}", "", "```python", signature(f"reference.{name}", f), "```", ""]
        body = docstring_md(f)
        if body:
            lines += [body, ""]
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text).rstrip() + "\n"
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Generate docs/api.md from the docstrings.")
    p.add_argument("--check", action="store_true", help="exit 1 if docs/api.md differs from the generated page")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if not API_MD.is_file() or API_MD.read_text() != text:
            print("docs/api.md is out of date: run python scripts/gen_api_docs.py", file=sys.stderr)
            return 1
        print("docs/api.md is up to date")
        return 0
    API_MD.parent.mkdir(exist_ok=True)
    API_MD.write_text(text)
    print(f"wrote {API_MD.relative_to(ROOT)} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
