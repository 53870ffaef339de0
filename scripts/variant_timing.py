#!/usr/bin/env python3
"""Time one op under variants of the kernel sources (timing only: variants may be inexact).

    python scripts/variant_timing.py group128 16384x16384

Each variant is a list of (file, old text, new text) replacements applied to a copy of kernels/;
the op runs in a fresh process per variant with CUPYQUANT_KERNEL_DIR pointing at the copy, so the
numbers say what a change would buy before anyone makes it properly.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

VARIANTS = {
    "as is": [],
    "group: x * (1/s) instead of x / s": [
        ("groupwise.cu", "return to_q<F>(fmin_ieee(fmax_ieee(div_rn(x, s),", "return to_q<F>(fmin_ieee(fmax_ieee(mul_rn(x, s),"),
    ],
    "token/silu: x * (1/s) instead of x / s": [
        ("groupwise.cu", "return to_q<F>(fmax_ieee(-F::max_finite, fmin_ieee(div_rn(x, s), F::max_finite)));",
         "return to_q<F>(fmax_ieee(-F::max_finite, fmin_ieee(mul_rn(x, s), F::max_finite)));"),
        ("groupwise.cu", "return to_q<F>(fmax_ieee(-F::max_finite, fmin_ieee(div_rn(r, s), F::max_finite)));",
         "return to_q<F>(fmax_ieee(-F::max_finite, fmin_ieee(mul_rn(r, s), F::max_finite)));"),
    ],
    "no scale store": [("groupwise.cu", "if ((u & (tpg - 1)) == 0) store_scale(sa, row, u / tpg, s);", "")],
}

CHILD = r"""
import sys
sys.argv = ["bench", "--ops", sys.argv[1], "--sizes", sys.argv[2], "--no-torch", "--reps", "40"]
sys.path.insert(0, "scripts")
import bench
bench.main()
"""


def main() -> int:
    op, size = sys.argv[1], sys.argv[2]
    for name, edits in VARIANTS.items():
        with tempfile.TemporaryDirectory() as d:
            shutil.copytree(ROOT / "kernels", d, dirs_exist_ok=True)
            for fname, old, new in edits:
                p = Path(d) / fname
                text = p.read_text()
                if old not in text:
                    print(f"[stale] {name}: {old[:50]!r} not in {fname}")
                text = text.replace(old, new)
                p.write_text(text)
            env = dict(os.environ, CUPYQUANT_KERNEL_DIR=d, CUPY_CACHE_DIR=tempfile.mkdtemp())
            r = subprocess.run([sys.executable, "-c", CHILD, op, size], cwd=ROOT, env=env, capture_output=True, text=True)
            line = [ln for ln in r.stdout.splitlines() if ln.startswith("op=")]
            print(f"{name:42s} {line[0] if line else r.stderr[-300:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
