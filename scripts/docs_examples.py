"""Run the examples in docs/*.md and print, check or write back their output.

An example is a marker line, a ```python block, and the ```text block holding what it printed:

    <!-- run on GPU: scripts/docs_examples.py -->      (needs a CUDA device)
    <!-- run on CPU: scripts/docs_examples.py -->      (cupyquant.reference only: NumPy, no GPU)

Usage (repository root):

    python scripts/docs_examples.py              # run the GPU examples, print paste-ready output
    python scripts/docs_examples.py --cpu        # the CPU (reference) examples instead
    python scripts/docs_examples.py --all        # both
    python scripts/docs_examples.py --write      # ... and write each output into its ```text block
    python scripts/docs_examples.py --check      # ... exit 1 if a recorded output differs

Each example runs in a fresh namespace, in this process, with NumPy's default print options; its
stdout is the output. On the GPU machine: ``python scripts/docs_examples.py --write`` fills in the
GPU outputs (copy docs/*.md back afterwards). ``tests/test_docs.py`` checks the CPU examples.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MARKERS = {
    "GPU": "<!-- run on GPU: scripts/docs_examples.py -->",
    "CPU": "<!-- run on CPU: scripts/docs_examples.py -->",
}
PENDING = "(output pending: run `python scripts/docs_examples.py --write` on a GPU machine)"


@dataclass
class Example:
    path: Path
    kind: str  # "GPU" or "CPU"
    line: int  # 1-based line of the marker
    code: str
    output: str | None  # the recorded ```text block, None if there is none
    out_span: tuple | None  # (first, last) line indices of the ```text fence lines, inclusive

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _fence_end(lines, start: int) -> int:
    for j in range(start + 1, len(lines)):
        if lines[j].strip() == "```":
            return j
    raise ValueError(f"unclosed code block at line {start + 1}")


def parse(path: Path) -> list[Example]:
    lines = path.read_text().splitlines()
    examples = []
    for i, line in enumerate(lines):
        kind = next((k for k, m in MARKERS.items() if line.strip() == m), None)
        if kind is None:
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        if j >= len(lines) or lines[j].strip() != "```python":
            raise ValueError(f"{path}:{i + 1}: the marker must be followed by a ```python block")
        end = _fence_end(lines, j)
        code = "\n".join(lines[j + 1 : end]) + "\n"
        k = end + 1
        while k < len(lines) and not lines[k].strip():
            k += 1
        output = span = None
        if k < len(lines) and lines[k].strip() == "```text":
            kend = _fence_end(lines, k)
            output = "\n".join(lines[k + 1 : kend])
            span = (k, kend)
        examples.append(Example(path, kind, i + 1, code, output, span))
    return examples


def collect(kinds) -> list[Example]:
    return [e for p in sorted(DOCS.glob("*.md")) for e in parse(p) if e.kind in kinds]


def run(example: Example) -> str:
    """Execute the example; returns its stdout with trailing whitespace removed from each line."""
    import numpy as np

    sys.path.insert(0, str(ROOT))
    buf = io.StringIO()
    namespace = {"__name__": "__docs_example__"}
    with np.printoptions(), contextlib.redirect_stdout(buf):
        exec(compile(example.code, example.where, "exec"), namespace)  # noqa: S102 - our own docs
    return "\n".join(line.rstrip() for line in buf.getvalue().rstrip("\n").splitlines())


def write(results) -> None:
    """Replace (or insert) the ```text block after each example, file by file, bottom up."""
    by_file = {}
    for ex, out in results:
        by_file.setdefault(ex.path, []).append((ex, out))
    for path, items in by_file.items():
        lines = path.read_text().splitlines()
        for ex, out in sorted(items, key=lambda t: -t[0].line):
            block = ["```text", *out.splitlines(), "```"]
            if ex.out_span:
                a, b = ex.out_span
                lines[a : b + 1] = block
            else:  # insert after the python block
                i = ex.line - 1
                j = i + 1
                while lines[j].strip() != "```python":
                    j += 1
                end = _fence_end(lines, j)
                lines[end + 1 : end + 1] = ["", *block]
        path.write_text("\n".join(lines) + "\n")


def _has_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no driver, no device, no CuPy: all mean "no GPU"
        return False


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Run the examples in docs/*.md.")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--cpu", action="store_true", help="run the CPU (reference) examples instead of the GPU ones")
    g.add_argument("--all", action="store_true", help="run both kinds")
    p.add_argument("--write", action="store_true", help="write the outputs into the docs")
    p.add_argument("--check", action="store_true", help="exit 1 if a recorded output differs")
    args = p.parse_args(argv)
    kinds = {"CPU", "GPU"} if args.all else {"CPU"} if args.cpu else {"GPU"}
    if "GPU" in kinds and not _has_gpu():
        print(
            "docs_examples.py: the GPU examples need a CUDA device (use --cpu for the reference ones)", file=sys.stderr
        )
        return 1
    examples = collect(kinds)
    results, failed, differ = [], 0, 0
    for ex in examples:
        try:
            out = run(ex)
        except Exception:  # noqa: BLE001 - report every failing example, then fail
            failed += 1
            print(f"FAILED {ex.where} ({ex.kind})\n{traceback.format_exc()}", file=sys.stderr)
            continue
        results.append((ex, out))
        same = ex.output is not None and ex.output.rstrip("\n") == out
        differ += not same
        if args.check:
            print(f"{'ok     ' if same else 'DIFFERS'} {ex.where} ({ex.kind})")
            if not same:
                print(f"--- recorded\n{ex.output}\n--- now\n{out}\n")
        else:
            print(f"<!-- {ex.where} ({ex.kind} example): paste into its ```text block -->")
            print("```text\n" + out + "\n```\n")
    if args.write and results:
        write(results)
        print(f"wrote {len(results)} outputs into {len({e.path for e, _ in results})} files", file=sys.stderr)
    if failed:
        return 1
    return 1 if args.check and differ else 0


if __name__ == "__main__":
    sys.exit(main())
