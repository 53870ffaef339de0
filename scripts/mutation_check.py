#!/usr/bin/env python3
"""Check that the GPU tests catch broken kernels: apply each mutation below to a copy of kernels/,
point CUPYQUANT_KERNEL_DIR at it, run the tests that should notice, and report killed/SURVIVED.

    CUPYQUANT_REQUIRE_GPU=1 python scripts/mutation_check.py            # every mutant
    CUPYQUANT_REQUIRE_GPU=1 python scripts/mutation_check.py block_scale.cuh      # those of one kernel file

Exit status 1 if any mutant survives. Each mutant is (name, file, old text, new text, pytest args[,
test file]); the test file defaults to tests/test_per_tensor.py.
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
    (
        "quantize tail loses its last element",
        "per_tensor.cu",
        "for (i64 j = nvec * 16; j < n; ++j)\n                q[j]",
        "for (i64 j = nvec * 16; j < n - 1; ++j)\n                q[j]",
        ["-k", "test_quantize_matches_reference and 2049"],
    ),
    (
        "dequantize skips the last unit",
        "per_tensor.cu",
        "if (unit < nunits) {\n                dequant_unit",
        "if (unit + 1 < nunits) {\n                dequant_unit",
        ["-k", "dequantize_matches"],
    ),
    (
        "quantize vector product by ftz multiply",
        "per_tensor.cu",
        "to_fp8x2<F>(mul_rn(f[4 * i], scale), mul_rn(f[4 * i + 1], scale))",
        "to_fp8x2<F>(f[4 * i] * scale, f[4 * i + 1] * scale)",
        ["-k", "special_values and subnormal_only"],
    ),
    (
        "scale_inv by ftz division",
        "per_tensor.cu",
        "scale_inv = div_rn(1.0f, scale);",
        "scale_inv = 1.0f / scale;",
        ["-k", "tiny_amax"],
    ),
    (
        "quantize product by ftz multiply",
        "per_tensor.cu",
        "mul_rn(to_float(x[j]), scale)",
        "(to_float(x[j]) * scale)",
        ["-k", "special_values and subnormal_only"],
    ),
    (
        "no saturation",
        "common.cuh",
        "make_float2(lo, hi), __NV_SATFINITE",
        "make_float2(lo, hi), __NV_NOSAT",
        ["-k", "special_values"],
    ),
    (
        "amax ignores the last unrolled load",
        "per_tensor.cu",
        "for (int u = 0; u < AMAX_UNROLL; ++u) m = max(m, absmax16<T>(v[u]));",
        "for (int u = 0; u < AMAX_UNROLL - 1; ++u) m = max(m, absmax16<T>(v[u]));",
        ["-k", "amax_max_element_anywhere"],
    ),
    (
        "per-token int8 zero test by ftz compare",
        "groupwise.cu",
        "return __float_as_uint(amax) == 0u ? 0.0f",
        "return amax == 0.0f ? 0.0f",
        ["-k", "special_values and None and int8"],
        "tests/test_groupwise.py",
    ),
    (
        "group quotient without the remainder correction",
        "common.cuh",
        'fma.rn.f32 %0, ne, %2, %3; }" : "=f"(q) : "f"(e), "f"(r), "f"(q0));\n    return q;',
        'fma.rn.f32 %0, ne, %2, %3; }" : "=f"(q) : "f"(e), "f"(r), "f"(q0));\n    return q0;',
        ["-k", "every_combination"],
        "tests/test_groupwise.py",
    ),
    (
        "group quotient by multiplying with the reciprocal",
        "groupwise.cu",
        "for (int i = 0; i < 8; ++i) v[i] = div_by(f[i], s, r);",
        "for (int i = 0; i < 8; ++i) v[i] = mul_rn(f[i], r);",
        ["-k", "every_combination"],
        "tests/test_groupwise.py",
    ),
    (
        "int8 truncates like vLLM's group kernel",
        "groupwise.cu",
        "cvt.rni.sat.s8.f32",
        "cvt.rzi.sat.s8.f32",
        ["-k", "every_combination and int8"],
        "tests/test_groupwise.py",
    ),
    (
        "col padding rows left unwritten",
        "groupwise.cu",
        "if (a.col && m == a.M - 1)\n            for (i64 p = a.M; p < a.M_pad; ++p) a.words",
        "if (false)\n            for (i64 p = a.M; p < a.M_pad; ++p) a.words",
        ["-k", "col_layout_strides"],
        "tests/test_groupwise.py",
    ),
    (
        "silu sigmoid by an approximate division",
        "groupwise.cu",
        "const float sigmoid = rcp_rn(add_rn(1.0f, e));",
        "const float sigmoid = __fdividef(1.0f, 1.0f + e);",
        ["-k", "test_silu_mul_quantize"],
        "tests/test_groupwise.py",
    ),
    (
        "batched sigmoid reciprocal without its Newton step",
        "common.cuh",
        'asm("{ .reg .f32 ne; neg.f32 ne, %1; fma.rn.f32 %0, %2, ne, %2; }" : "=f"(r) : "f"(e), "f"(r0));',
        "r = r0;",
        ["-k", "rcp_fast or (silu_mul_quantize and batched)"],
        "tests/test_groupwise.py",
    ),
    (
        "batched reciprocals take the fast path outside its range",
        "common.cuh",
        "if (key >= 0x02000000u) {",
        "if (key >= 0x01000000u) {",
        ["-k", "rcp_fast or (silu_mul_scale_ub_and_specials and batched)"],
        "tests/test_groupwise.py",
    ),
    (
        "batched silu with the fast exp",
        "groupwise.cu",
        "for (int i = 0; i < 16; ++i) d[i] = add_rn(1.0f, expf(-g[i]));",
        "for (int i = 0; i < 16; ++i) d[i] = add_rn(1.0f, __expf(-g[i]));",
        ["-k", "test_silu_mul_quantize and batched"],
        "tests/test_groupwise.py",
    ),
    (
        "silu with the fast exp",
        "groupwise.cu",
        "return silu_mul_from_exp(gate, up, expf(-gate));",
        "return silu_mul_from_exp(gate, up, __expf(-gate));",
        ["-k", "test_silu_mul_quantize"],
        "tests/test_groupwise.py",
    ),
    (
        "E8M0 ceil never rounds up",
        "block_scale.cuh",
        "return b > 0x7f800000u ? 255u : b == 0x7f800000u ? 254u : e + (up ? 1u : 0u);",
        "return b > 0x7f800000u ? 255u : b == 0x7f800000u ? 254u : e;",
        ["-k", "mx_every_combination and float32 and dense"],
        "tests/test_mx.py",
    ),
    (
        "E = 254 multiplier by the bit formula (0)",
        "block_scale.cuh",
        "E == 254u ? 0x00400000u : (254u - E) << 23",
        "(254u - E) << 23",
        ["-k", "mx_special_blocks"],
        "tests/test_mx.py",
    ),
    (
        "MX block max ignores NaN",
        "block_scale.cuh",
        "(__float_as_uint(f[j][i]) & 0x7fffffffu)",
        "abs_key(f[j][i])",
        ["-k", "mx_special_blocks"],
        "tests/test_mx.py",
    ),
    (
        "swizzled rows placed row-major in the unit",
        "block_scale.cuh",
        "(kb / 4) * 512 + (row_local % 32) * 16 + (row_local / 32) * 4",
        "(kb / 4) * 512 + (row_local / 4) * 16 + (row_local % 4) * 4",
        ["-k", "swizzled_offsets"],
        "tests/test_mx.py",
    ),
    (
        "FP4 odd tail keeps the padding nibble",
        "block_scale.cuh",
        "if (2 * i + 1 >= n) b &= 0x0f;",
        "",
        ["-k", "odd_tail_padding"],
        "tests/test_mx.py",
    ),
    (
        "NVFP4 inverse scale not clamped to FLT_MAX",
        "block_scale.cuh",
        "mult = fmin_ieee(rcp_rn(mul_rn(fp8_to_float<E4M3>((unsigned char)sbyte), S_dec)), FLT_MAX_F);",
        "mult = rcp_rn(mul_rn(fp8_to_float<E4M3>((unsigned char)sbyte), S_dec));",
        ["-k", "nvfp4_special_blocks"],
        "tests/test_mx.py",
    ),
    (
        "software conversion rounds ties up",
        "block_scale.cuh",
        "(b + (1u << (DROP - 1)) - 1u + ((b >> DROP) & 1u)) >> DROP",
        "(b + (1u << (DROP - 1))) >> DROP",
        ["-k", "conversions_against_reference and sw"],
        "tests/test_mx.py",
    ),
    (
        "bf16 MX block max ignores NaN",
        "block_scale.cuh",
        "m2 = NV ? bf2_max(m2, mag[i]) : bf2_max_nan(m2, mag[i]);",
        "m2 = bf2_max(m2, mag[i]);",
        ["-k", "mx_special_blocks and bfloat16"],
        "tests/test_mx.py",
    ),
    (
        "packed E2M1 keeps a NaN's sign",
        "block_scale.cuh",
        "const unsigned sign = w & ~(m + 0x007f007fu) & 0x80008000u;",
        "const unsigned sign = w & 0x80008000u;",
        ["-k", "conversions_against_reference and sw"],
        "tests/test_mx.py",
    ),
    (
        "bf16 round-to-odd loses the sticky bit",
        "block_scale.cuh",
        "return __byte_perm(a | ((a & 0xffffu) + 0xffffu), b | ((b & 0xffffu) + 0xffffu), 0x7632);",
        "return __byte_perm(a, b, 0x7632);",
        ["-k", "conversions_against_reference and sw"],
        "tests/test_mx.py",
    ),
    (
        "E2M1 decode takes the wrong sign byte",
        "block_scale.cuh",
        "(prmt(w4, w, h ? 0xe0a0u : 0xc080u) & 0x80008000u)",
        "(prmt(w4, w, h ? 0xe0a0u : 0xc0c0u) & 0x80008000u)",
        ["-k", "dequantize"],
        "tests/test_mx.py",
    ),
    (
        "dequant rounds toward zero",
        "common.cuh",
        "return __bfloat16_as_ushort(__float2bfloat16_rn(x));",
        "return __bfloat16_as_ushort(__float2bfloat16_rz(x));",
        ["-k", "dequantize"],
    ),
]


def main() -> int:
    survived = 0
    only = sys.argv[1:]
    for name, fname, old, new, args, *test_file in MUTANTS:
        if only and fname not in only:
            continue
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
            cmd = [
                sys.executable,
                "-m",
                "pytest",
                "-x",
                "-q",
                "-p",
                "no:cacheprovider",
                *(test_file or ["tests/test_per_tensor.py"]),
                *args,
            ]
            r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            last = (r.stdout.strip().splitlines() or ["?"])[-1]
            killed = r.returncode == 1
            survived += not killed
            print(f"[{'killed' if killed else 'SURVIVED'}] {name}: {last}")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
