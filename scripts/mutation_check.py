#!/usr/bin/env python3
"""Check that the GPU tests catch broken kernels: apply each mutation below to a copy of kernels/,
point CUPYQUANT_KERNEL_DIR at it, run the tests that should notice, and report killed/SURVIVED.

    CUPYQUANT_REQUIRE_GPU=1 python scripts/mutation_check.py

Exit status 1 if any mutant survives. Each mutant is (name, file, old text, new text, test args).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MUTANTS = [
    ("quantize tail loses its last element", "fp8_tensor.cu", "for (i64 j = nvec * 16; j < n; ++j)\n                q[j]",
     "for (i64 j = nvec * 16; j < n - 1; ++j)\n                q[j]", ["-k", "test_quantize_matches_reference and 2049"]),
    ("dequantize skips the last unit", "fp8_tensor.cu", "if (unit < nunits) {\n                dequant_unit",
     "if (unit + 1 < nunits) {\n                dequant_unit", ["-k", "dequantize_matches"]),
    ("quantize vector product by ftz multiply", "fp8_tensor.cu", "to_fp8x2<F>(mul_rn(f[4 * i], scale), mul_rn(f[4 * i + 1], scale))",
     "to_fp8x2<F>(f[4 * i] * scale, f[4 * i + 1] * scale)", ["-k", "special_values and subnormal_only"]),
    ("scale_inv by ftz division", "fp8_tensor.cu", "scale_inv = div_rn(1.0f, scale);", "scale_inv = 1.0f / scale;",
     ["-k", "tiny_amax"]),
    ("quantize product by ftz multiply", "fp8_tensor.cu", "mul_rn(to_float(x[j]), scale)", "(to_float(x[j]) * scale)",
     ["-k", "special_values and subnormal_only"]),
    ("no saturation", "common.cuh", "make_float2(lo, hi), __NV_SATFINITE", "make_float2(lo, hi), __NV_NOSAT",
     ["-k", "special_values"]),
    ("amax ignores the last unrolled load", "fp8_tensor.cu", "for (int u = 0; u < AMAX_UNROLL; ++u) m = max(m, absmax16<T>(v[u]));",
     "for (int u = 0; u < AMAX_UNROLL - 1; ++u) m = max(m, absmax16<T>(v[u]));", ["-k", "amax_max_element_anywhere"]),
    ("dequant rounds toward zero", "common.cuh", "return __bfloat16_as_ushort(__float2bfloat16_rn(x));", "return __bfloat16_as_ushort(__float2bfloat16_rz(x));",
     ["-k", "dequantize"]),
]


def main() -> int:
    survived = 0
    for name, fname, old, new, args in MUTANTS:
        with tempfile.TemporaryDirectory() as d:
            shutil.copytree(ROOT / "kernels", d, dirs_exist_ok=True)
            path = Path(d) / fname
            text = path.read_text()
            if text.count(old) < 1:
                print(f"[stale]    {name}: pattern not found in {fname}")
                survived += 1
                continue
            path.write_text(text.replace(old, new))
            env = dict(os.environ, CUPYQUANT_KERNEL_DIR=d, CUPY_CACHE_DIR=tempfile.mkdtemp())
            cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "tests/test_fp8_tensor.py", *args]
            r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            last = (r.stdout.strip().splitlines() or ["?"])[-1]
            killed = r.returncode == 1
            survived += not killed
            print(f"[{'killed' if killed else 'SURVIVED'}] {name}: {last}")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
