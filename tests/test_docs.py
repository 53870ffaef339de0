"""The docs on the CPU: docs/api.md is what scripts/gen_api_docs.py generates from the docstrings and
names every public name; the reference examples print what the pages say they print; every GPU
example parses and has an output block; relative links resolve; the pages quote the loader's real
error message."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
from _scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


@pytest.fixture(scope="module")
def api_text():
    pytest.importorskip("cupy")  # the op modules import CuPy (which imports without a GPU)
    return load_script("gen_api_docs").render()


def test_api_md_is_up_to_date(api_text):
    committed = (DOCS / "api.md").read_text()
    assert committed == api_text, "docs/api.md is out of date: run python scripts/gen_api_docs.py"


def test_api_md_names_every_public_name(api_text):
    import cupyquant

    headings = set(re.findall(r"^### (\S+)$", api_text, re.M))
    missing = [n for n in cupyquant.__all__ if n != "__version__" and n not in headings]
    assert not missing, f"public names without a section in docs/api.md: {missing}"
    assert "__version__" in api_text


def test_api_md_lists_every_reference_function(api_text):
    from cupyquant import reference

    public = [
        n
        for n, f in vars(reference).items()
        if inspect.isfunction(f) and not n.startswith("_") and f.__module__ == reference.__name__
    ]
    missing = [n for n in public if f"### reference.{n}\n" not in api_text]
    assert not missing, missing


def test_cpu_examples_print_what_the_docs_show():
    ex = load_script("docs_examples")
    examples = ex.collect({"CPU"})
    assert examples, "no CPU examples found in docs/"
    try:
        import cupy  # noqa: F401 - examples of the GPU API's argument checks import it (no GPU needed)
    except ImportError:
        examples = [e for e in examples if "cupyquant as cq" not in e.code]
    for e in examples:
        out = ex.run(e)
        assert e.output is not None, f"{e.where}: no ```text block after the example"
        assert e.output.rstrip("\n") == out, (
            f"{e.where}: the recorded output differs from what the example prints now; "
            f"run python scripts/docs_examples.py --cpu --write\n--- recorded\n{e.output}\n--- now\n{out}"
        )


def test_gpu_examples_parse_and_have_an_output_block():
    ex = load_script("docs_examples")
    examples = ex.collect({"GPU"})
    scheme_pages = {"per_tensor.md", "groupwise.md", "silu_mul.md", "microscaling.md", "nvfp4.md", "weight_only.md"}
    assert scheme_pages <= {e.path.name for e in examples}, "every scheme page has a GPU example"
    for e in examples:
        compile(e.code, e.where, "exec")
        assert e.output is not None, f"{e.where}: no ```text block after the example"


def _links(text):
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # not inside code blocks
    return re.findall(r"\]\(([^)\s]+)\)", text)


def _anchors(path: Path):
    """GitHub-style anchors of a Markdown file's headings."""
    out = set()
    for h in re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", path.read_text(), flags=re.S), re.M):
        a = re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
        out.add(a)
    return out


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_relative_links_resolve(page):
    for link in _links((DOCS / page).read_text()):
        if re.match(r"[a-z]+:", link):
            continue
        target, _, anchor = link.partition("#")
        path = (DOCS / page).parent / target if target else DOCS / page
        assert path.exists(), f"{page}: link to {link!r}: no such file"
        if anchor and path.suffix == ".md":
            assert anchor in _anchors(path), f"{page}: link to {link!r}: no heading with that anchor"


def test_index_links_every_page():
    index = (DOCS / "index.md").read_text()
    linked = {link.partition("#")[0] for link in _links(index)}
    for p in DOCS.glob("*.md"):
        if p.name != "index.md":
            assert p.name in linked, f"docs/index.md does not link {p.name}"


def test_troubleshooting_quotes_the_loaders_messages():
    from cupyquant import _jit

    page = (DOCS / "cache_and_troubleshooting.md").read_text()
    src = inspect.getsource(_jit)
    for fragment in (
        "cupyquant needs the CUDA runtime headers (cuda_fp16.h, cuda_fp8.h) for NVRTC and found none in",
        "cupyquant could not compile kernel family",
        "cupyquant could not find its CUDA sources; looked in",
        "(or [cu12]; from a clone of the repository, ",
    ):
        assert fragment in page, f"the page no longer quotes {fragment!r}"
        assert fragment in src, f"cupyquant._jit no longer says {fragment!r}: update the page"
    for var in (_jit.KERNEL_DIR_ENV, _jit.CUDA_INCLUDE_ENV):
        assert var in page


PAGES = sorted(DOCS.glob("*.md")) + [ROOT / "README.md", ROOT / "BENCHMARKS.md"]


def _prose_code(path: Path):
    """The inline code spans of a page, outside its code blocks (docs/api.md is generated: left out)."""
    return re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", path.read_text(), flags=re.S))


@pytest.mark.parametrize("page", [p.name for p in PAGES if p.name != "api.md"])
def test_pages_name_real_arguments(page):
    """A call written in a page's prose, ``reference.f(a, b, k=v)`` or ``cq.f(x, k=v)``, names
    keyword arguments the function has; a reference function is written with its own parameter
    names, so its bare names are parameters too."""
    pytest.importorskip("cupy")
    import cupyquant
    from cupyquant import reference

    path = next(p for p in PAGES if p.name == page)
    for code in _prose_code(path):
        for m in re.finditer(r"(?<![\w.])(reference|cq|cupyquant)\.(\w+)\(([^()]*)\)", code):
            fn = getattr(reference if m.group(1) == "reference" else cupyquant, m.group(2), None)
            assert callable(fn), f"{page}: {m.group(0)}: no such function"
            params = inspect.signature(fn).parameters
            if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values()):
                continue
            for arg in (a.strip() for a in m.group(3).split(",")):
                name, keyword, _ = arg.partition("=")
                name = name.strip()
                if name.isidentifier() and (keyword or m.group(1) == "reference"):
                    assert name in params, f"{page}: {m.group(0)}: {m.group(2)} has no argument {name!r}"


@pytest.mark.parametrize("page", [p.name for p in PAGES if p.name != "api.md"])
def test_pages_make_no_promises(page):
    """A page says what is known; "not profiled yet" and "not supported yet" go stale unseen."""
    text = next(p for p in PAGES if p.name == page).read_text()
    found = re.findall(r"\bnot (?:\w+ ){0,2}yet\b", text)
    assert not found, f"{page}: {found}"


def test_benchmarks_tables_pointed_to_are_there():
    """ "the H200 table below" needs an H200 heading below it (and "above" one above)."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    for m in re.finditer(r"the (\S+) tables? (below|above)", text):
        headings = re.findall(
            r"^#+ .*" + re.escape(m.group(1)) + ".*$",
            text[m.end() :] if m.group(2) == "below" else text[: m.start()],
            re.M,
        )
        assert headings, f"BENCHMARKS.md: {m.group(0)!r} points to no such table"


def test_weight_only_page_lists_every_checkpoint_format():
    pytest.importorskip("cupy")
    from cupyquant.weight.checkpoint import CHECKPOINT_FORMATS

    text = (DOCS / "weight_only.md").read_text()
    bullet = re.search(r"^- `format`: (.*(?:\n  .*)*)", text, re.M).group(1)
    for fmt in CHECKPOINT_FORMATS:
        assert f'"{fmt}"' in bullet, f"weight_only.md's format bullet does not name {fmt!r}"
