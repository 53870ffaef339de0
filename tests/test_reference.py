"""The NumPy reference against hand-worked values and against ml_dtypes (CPU only)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from cupyquant import reference as ref

E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"
F32_MAX = np.finfo(np.float32).max


def test_reference_imports_no_cupy():
    code = (
        "import sys; sys.modules['cupy'] = None\n"  # any `import cupy` now raises ImportError
        "import numpy as np, cupyquant.reference as r\n"
        "q, s = r.quantize_fp8(np.ones(4, np.float32)); assert q.tolist() == [0x7e] * 4\n"
        "assert 'cupy' not in [m.split('.')[0] for m in sys.modules if sys.modules[m] is not None]\n"
    )
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


def test_quantize_hand_worked_e4m3():
    # amax 4 -> scale 448/4 = 112; x*112 = 56, -112, 224, 448 -> e4m3 1.75*2^5, -1.75*2^6, ...
    q, s = ref.quantize_fp8(np.array([0.5, -1.0, 2.0, 4.0], np.float32), E4M3)
    assert q.tolist() == [0x66, 0xEE, 0x76, 0x7E]
    assert s.dtype == np.float32 and s.shape == (1,)
    assert s[0] == np.float32(1) / np.float32(112)


def test_quantize_hand_worked_e5m2():
    # amax 8 -> scale 57344/8 = 7168 = 1.75*2^12; 1*7168 -> 0 11011 11 = 0x6f; 8 -> 57344 = 0x7b
    q, s = ref.quantize_fp8(np.array([1.0, -8.0, 0.0, -0.0], np.float32), E5M2)
    assert q.tolist() == [0x6F, 0xFB, 0x00, 0x80]
    assert s[0] == np.float32(1) / np.float32(7168)


def test_quantize_static_scale():
    # scale 0.5 (x ~ q * 0.5): kernel scale 2; 3 * 2 = 6 = 1.5*2^2 -> 0 1001 100 = 0x4c
    q, s = ref.quantize_fp8(np.array([3.0, 1000.0], np.float32), E4M3, scale=0.5)
    assert q.tolist() == [0x4C, 0x7E]  # 2000 saturates to 448
    assert s[0] == np.float32(0.5)


@pytest.mark.parametrize(
    "values, expected",
    [
        ([1.0625, 1.1875, -1.0625], [0x38, 0x3A, 0xB8]),  # ties to even: 1.0 and 1.25
        ([448.0, 463.99, 464.0, 1e30, np.inf, -np.inf], [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE]),
        ([np.nan, -np.nan], [0x7F, 0x7F]),  # canonical NaN, sign dropped
        ([2.0**-9, 2.0**-10, 1.5 * 2.0**-10, 3 * 2.0**-10], [0x01, 0x00, 0x01, 0x02]),  # subnormals
        ([-0.0, -1e-40, 1e-45], [0x80, 0x80, 0x00]),
    ],
)
def test_cast_e4m3(values, expected):
    assert ref.cast_fp8(np.array(values, np.float32), E4M3).tolist() == expected


@pytest.mark.parametrize(
    "values, expected",
    [
        ([57344.0, 61439.0, 61440.0, np.inf, -np.inf], [0x7B, 0x7B, 0x7B, 0x7B, 0xFB]),
        ([np.nan, -np.nan], [0x7F, 0x7F]),
        ([2.0**-16, 2.0**-17, 1.25, 1.375], [0x01, 0x00, 0x3D, 0x3E]),  # 1.375 ties to 1.5
    ],
)
def test_cast_e5m2(values, expected):
    assert ref.cast_fp8(np.array(values, np.float32), E5M2).tolist() == expected


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_cast_matches_ml_dtypes_in_range(fmt):
    rng = np.random.default_rng(7)
    fmax = float(ml_dtypes.finfo(getattr(ml_dtypes, fmt)).max)
    v = (rng.standard_normal(200_000) * np.exp(3 * rng.standard_normal(200_000))).astype(np.float32)
    v = v[np.abs(v) <= fmax]
    expected = v.astype(getattr(ml_dtypes, fmt)).view(np.uint8)
    np.testing.assert_array_equal(ref.cast_fp8(v, fmt), expected)


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_every_fp8_value_round_trips(fmt):
    b = np.arange(256, dtype=np.uint8)
    f = ref.fp8_to_float(b, fmt)
    finite = np.isfinite(f)
    np.testing.assert_array_equal(ref.cast_fp8(f[finite], fmt), b[finite])
    # values exactly halfway between neighbours round to the even pattern
    pos = np.sort(f[finite & (f > 0)])
    mids = ((pos[:-1].astype(np.float64) + pos[1:]) / 2).astype(np.float32)
    got = ref.cast_fp8(mids, fmt)
    lo, hi = ref.cast_fp8(pos[:-1], fmt), ref.cast_fp8(pos[1:], fmt)
    np.testing.assert_array_equal(got, np.where(lo % 2 == 0, lo, hi))


def test_compute_scale_edges():
    assert ref.compute_scale(0.0) == 1
    assert ref.compute_scale(np.inf) == 1
    assert ref.compute_scale(np.nan) == 1
    assert ref.compute_scale(1e-38) == F32_MAX  # 448 / 1e-38 overflows
    assert ref.compute_scale(448.0) == 1
    assert ref.compute_scale(1.0, E5M2) == 57344
    assert ref.compute_scale(3.0) == np.float32(448) / np.float32(3)


def test_amax_ignores_nan_and_counts_subnormals():
    assert ref.amax(np.array([np.nan, -3.0, 2.0], np.float32)) == 3
    assert ref.amax(np.array([np.nan], np.float32)) == 0
    assert ref.amax(np.zeros(0, np.float32)) == 0
    assert ref.amax(np.array([-1e-40, 0], np.float32)) == np.float32(1e-40)
    assert ref.amax(np.array([-np.inf, 1], np.float32)) == np.inf
    assert ref.amax(np.array([1.5, -2.5], ml_dtypes.bfloat16)) == 2.5


def test_all_nan_or_zero_tensor_uses_scale_one():
    q, s = ref.quantize_fp8(np.array([np.nan, np.nan], np.float32))
    assert q.tolist() == [0x7F, 0x7F] and s[0] == 1
    q, s = ref.quantize_fp8(np.zeros(3, np.float16))
    assert q.tolist() == [0, 0, 0] and s[0] == 1


def test_inf_in_tensor():
    # amax inf -> scale 1: finite values cast as they are, inf saturates
    q, s = ref.quantize_fp8(np.array([np.inf, 1.0, -500.0], np.float32))
    assert q.tolist() == [0x7E, 0x38, 0xFE] and s[0] == 1


def test_dequantize_hand_worked():
    y = ref.dequantize_fp8(np.array([0x66, 0xEE, 0x7F, 0x80], np.uint8), np.float32(1) / 112, E4M3)
    assert y[0] == 0.5 and y[1] == -1.0
    assert y.view(np.uint32)[2] == 0x7FFFFFFF  # canonical NaN
    assert y.view(np.uint32)[3] == 0x80000000  # -0 stays -0


@pytest.mark.parametrize("dtype, nan_bits", [(np.float16, 0x7FFF), (ml_dtypes.bfloat16, 0x7FFF)])
def test_round_to_canonical_nan_and_rne(dtype, nan_bits):
    y = ref.round_to(np.array([np.nan, -np.nan, 1.0 + 2.0**-11, 1e-40], np.float32), dtype)
    bits = y.view(np.uint16)
    assert bits[0] == nan_bits and bits[1] == nan_bits
    assert y[2] == 1.0  # tie to even (float16 ulp at 1 is 2^-10; bfloat16 rounds it to 1 too)


def test_round_to_keeps_subnormals():
    # 1e-40 is a float32 subnormal; bfloat16 keeps subnormals (no flush)
    y = ref.round_to(np.array([1e-40], np.float32), ml_dtypes.bfloat16)
    assert y.view(np.uint16)[0] != 0


def test_dequantize_e5m2_inf_and_subnormal_products():
    y = ref.dequantize_fp8(np.array([0x7C, 0x01], np.uint8), np.float32(1e-33), E5M2)
    assert np.isinf(y[0])
    assert y[1] == np.float32(np.float32(2.0**-16) * np.float32(1e-33))  # subnormal float32, not flushed
    assert y[1] != 0


# ------------------------------------------------------------------ per-token / per-group


def _groups_of_32(*groups):
    """One row of float32 groups of 32: each given group's values, then zeros."""
    row = np.zeros(32 * len(groups), np.float32)
    for i, g in enumerate(groups):
        row[32 * i : 32 * i + len(g)] = g
    return row[None, :]


def test_group_hand_worked_e4m3():
    # amax 4 -> s = fl(4 / 448); x / s ~ 112, -224, 56, 448 -> 1.75*2^6, -1.75*2^7, 1.75*2^5, max
    q, s = ref.quantize_groupwise(_groups_of_32([1.0, -2.0, 0.5, 4.0]), group_size=32)
    assert q[:, :4].tolist() == [[0x6E, 0xF6, 0x66, 0x7E]] and not q[:, 4:].any()
    assert s[0, 0] == np.float32(4) / np.float32(448)


def test_group_int8_rounds_half_to_even():
    # pow2: s = pow2_ceil(4/127 = 0.0315) = 2^-4, so x / s is exact: 2.5 -> 2, -1.5 -> -2, 0.5 -> 0
    x = _groups_of_32([2.5 * 2**-4, -1.5 * 2**-4, 0.5 * 2**-4, 4.0])
    q, s = ref.quantize_groupwise(x, "int8", group_size=32, scale_pow2=True)
    assert q.dtype == np.int8 and q[:, :4].tolist() == [[2, -2, 0, 64]]
    assert s[0, 0] == 2.0**-4


def test_per_token_int8_is_vllm_multiply_form():
    # s = 4/127 stored; q = rne(x * (127/4)) = rne(31.75, -63.5, 15.875, 127) -> 32, -64 (tie to even), 16, 127
    q, s = ref.quantize_groupwise(np.array([[1.0, -2.0, 0.5, 4.0]], np.float32), "int8", group_size=None)
    assert q.tolist() == [[32, -64, 16, 127]]
    assert s[0, 0] == np.float32(4) / np.float32(127)
    q, s = ref.quantize_groupwise(np.zeros((1, 3), np.float32), "int8", group_size=None)
    assert q.tolist() == [[0, 0, 0]] and s[0, 0] == 0  # no eps in vLLM's per-token int8


def test_per_token_fp8_min_scale_and_ub():
    q, s = ref.quantize_groupwise(np.zeros((1, 5), np.float32), group_size=None)
    assert s[0, 0] == np.float32(1) / np.float32(448 * 512) and q.tolist() == [[0] * 5]
    x = np.array([[10.0, -1.0, 0.5]], np.float32)
    q, s = ref.quantize_groupwise(x, group_size=None, scale_ub=2.0)  # amax clamped to 2
    assert s[0, 0] == np.float32(2) / np.float32(448)
    assert q[0, 0] == 0x7E and q[0, 1] == 0xF6  # 10/s saturates; -1/s = -224 = -1.75*2^7


def test_group_eps_floor_and_nan_goes_to_qmin():
    q, s = ref.quantize_groupwise(_groups_of_32([0.0, 0.0], [np.nan, 1.0]), group_size=32)
    assert s[0, 0] == np.float32(1e-10) / np.float32(448)  # all-zero group: amax = eps
    assert q[0, 32] == 0xFE  # fminf(fmaxf(NaN, -448), 448) = -448
    q, _ = ref.quantize_groupwise(np.array([[np.nan, 1.0]], np.float32), group_size=None)
    assert q[0, 0] == 0x7E  # per token: fmaxf(-448, fminf(NaN, 448)) = +448


def test_ue8m0_rule():
    e = ref.ue8m0(np.array([1.0, 1.5, 2.0, 2.0**-30 * 1.5, 0.0, np.float32(2.0) + 2**-22], np.float32))
    assert e.tolist() == [127, 128, 128, 98, 94, 129]  # 0 -> fmaxf(0, 1e-10) = 2^-33.2 -> 94
    assert ref.pow2_ceil(np.float32(3.0)) == 4.0
    assert ref.e8m0_to_float(np.array([127, 0, 255], np.uint8))[0] == 1.0
    assert np.isnan(ref.e8m0_to_float(np.array([255], np.uint8))[0])


def test_silu_quantize_intermediate_rules():
    r = np.concatenate([_groups_of_32([0.0]), _groups_of_32([8.96, -1.0, 0.5, 0.0])])
    q, s = ref.quantize_silu_intermediate(r, group_size=32)
    assert s[0, 0] == np.float32(1) / np.float32(448 * 512)  # min scale, no eps
    assert s[1, 0] == np.float32(8.96) / np.float32(448)
    q, s = ref.quantize_silu_intermediate(r, group_size=32, scale_ub=0.01)
    assert s[1, 0] == np.float32(0.01)  # the scale itself is clamped
    q, s = ref.quantize_silu_intermediate(r, "int8", group_size=32)
    assert s[0, 0] == np.float32(2.0**-23)  # FLT_EPSILON for int8


def test_silu_mul_intermediate_values():
    x = np.array([[0.0, 1.0, -2.0, 3.0, 5.0, -1.0]], np.float32)  # gate [0, 1, -2], up [3, 5, -1]
    r = ref.silu_mul(x)
    expected = np.array([0.0, 5.0 / (1 + np.exp(-1.0)), 2.0 / (1 + np.exp(2.0))])
    np.testing.assert_allclose(r[0], expected, rtol=2e-7)


def test_scale_offsets_hand_worked():
    # (B=2, M=5, K) with 2 scale columns, col layout: M_pad = 8, word = b*2*8 + c*8 + m
    off, total = ref.scale_word_offsets((2, 5, 256), 2, "col")
    assert total == 32 and off[1, 3, 1] == 16 + 8 + 3 and off[0, 4, 0] == 4
    off, total = ref.scale_word_offsets((2, 5, 256), 2, "row")
    assert total == 20 and off[1, 3, 1] == (5 + 3) * 2 + 1
    off, total = ref.scale_word_offsets((256,), 3, "col")  # 1-D: one token, M_pad = 4
    assert total == 12 and off.tolist() == [0, 4, 8]


def test_scale_buffer_packs_ue8m0_little_endian_with_zero_padding():
    e = np.array([[1, 2, 3, 4, 5, 6]], np.uint8)
    buf = ref.scale_buffer(e, (1, 768), "row")
    assert buf.tolist() == [0x04030201, 0x00000605]
    buf = ref.scale_buffer(e, (1, 768), "col")  # M_pad 4: column p at word 4p
    assert buf.tolist() == [0x04030201, 0, 0, 0, 0x00000605, 0, 0, 0]


@pytest.mark.parametrize("layout", ["ROW", "column", "dense", None])
def test_scale_layout_must_exist(layout):
    """Any layout but "row" and "col" is refused, as quantize_groupwise refuses it (a layout that is
    not "row" would otherwise be laid out as "col")."""
    match = rf"^scale_layout={layout!r} is not supported; expected one of \('row', 'col'\)"
    with pytest.raises(ValueError, match=match):
        ref.scale_buffer(np.ones((2, 3), np.float32), (2, 384), layout)
    with pytest.raises(ValueError, match=match):
        ref.scale_word_offsets((2, 384), 3, layout)


def test_dequantize_groupwise_hand_worked():
    q = _groups_of_32([0x38, 0xB8], [0x40, 0x00]).astype(np.uint8)  # 1, -1 | 2, 0 in E4M3
    y = ref.dequantize_groupwise(q, np.array([[0.5, 4.0]], np.float32), group_size=32)
    assert y[:, [0, 1, 32, 33]].tolist() == [[0.5, -0.5, 8.0, 0.0]] and not y[:, 2:32].any()
    y = ref.dequantize_groupwise(np.array([[3, -4]], np.int8), np.array([[128]], np.uint8), "int8")
    assert y.tolist() == [[6.0, -8.0]]  # e8m0 128 = 2.0


# ---------------------------------------------------------------- microscaling
def test_cast_e2m1_hand_worked():
    v = [
        0,
        0.25,
        0.26,
        0.75,
        1.25,
        1.3,
        1.75,
        2.5,
        2.6,
        3.5,
        5,
        5.1,
        6,
        1e9,
        np.inf,
        -np.inf,
        np.nan,
        -np.nan,
        -0.0,
        -0.1,
        -6,
        2.0**-140,
    ]
    want = [0, 0, 1, 2, 2, 3, 4, 4, 5, 6, 6, 7, 7, 7, 7, 0xF, 7, 7, 8, 8, 0xF, 0]
    assert ref.cast_e2m1(np.array(v, np.float32)).tolist() == want
    assert ref.e2m1_to_float(np.arange(16)).tolist() == [
        0,
        0.5,
        1,
        1.5,
        2,
        3,
        4,
        6,
        -0.0,
        -0.5,
        -1,
        -1.5,
        -2,
        -3,
        -4,
        -6,
    ]


def test_cast_e2m1_matches_ml_dtypes_off_nan():
    rng = np.random.default_rng(1)
    v = (rng.standard_normal(100_000) * np.exp(rng.standard_normal(100_000) * 2)).astype(np.float32)
    np.testing.assert_array_equal(ref.cast_e2m1(v), v.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF)


def test_pack_unpack_fp4():
    codes = np.array([[1, 2, 3, 4, 5]], np.uint8)
    p = ref.pack_fp4(codes)
    assert p.tolist() == [[0x21, 0x43, 0x05]]  # element 0 in the low nibble, odd tail padded with 0
    assert ref.unpack_fp4(p, 5).tolist() == codes.tolist()


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: ref.pack_fp4(np.array([[1, 16]])), ValueError, r"^codes must be in \[0, 15\].*from 1 to 16"),
        (lambda: ref.pack_fp4(np.array([3, 255], np.uint8)), ValueError, r"^codes must be in \[0, 15\]"),
        (lambda: ref.pack_fp4([-1, 2]), ValueError, r"^codes must be in \[0, 15\]"),
        (lambda: ref.pack_fp4(np.array([1.5, 2.0])), TypeError, "^codes must be integers"),
        (lambda: ref.pack_fp4(np.uint8(3)), ValueError, "^codes must have at least one dimension"),
        (
            lambda: ref.unpack_fp4(np.zeros((2, 3), np.uint8), 7),
            ValueError,
            "^K must be 5 or 6 .* 3 bytes a row, got 7",
        ),
        (lambda: ref.unpack_fp4(np.zeros((2, 3), np.uint8), 4), ValueError, "^K must be 5 or 6"),
        (lambda: ref.unpack_fp4(np.zeros((2, 3), np.uint8), -1), ValueError, "^K must be 5 or 6"),
        (lambda: ref.unpack_fp4(np.zeros(0, np.uint8), -1), ValueError, "^K must be -1 or 0"),
        (lambda: ref.unpack_fp4(np.zeros((2, 3), np.uint8), 6.0), TypeError, "^K must be an int"),
        (lambda: ref.unpack_fp4(np.array([256, 1]), 4), ValueError, r"^packed must be in \[0, 255\]"),
        (lambda: ref.unpack_fp4(np.array([1.0]), 2), TypeError, "^packed must be integers"),
        (lambda: ref.e8m0_to_float(np.array([127, 256])), ValueError, r"^e must be in \[0, 255\].*from 127 to 256"),
        (lambda: ref.e8m0_to_float([-1]), ValueError, r"^e must be in \[0, 255\]"),
        (lambda: ref.e8m0_to_float(np.array([1.5])), TypeError, "^e must be integers"),
        (
            lambda: ref.dequantize_mx(np.zeros((1, 32), np.uint8), np.array([[300]]), "float8_e4m3fn"),
            ValueError,
            r"^scale must be in \[0, 255\]",
        ),
    ],
)
def test_fp4_packing_and_e8m0_refuse_what_they_would_wrap(call, exc, match):
    """A cast to uint8 would wrap 16 to 0 and 256 to 0, truncate 1.5 to 1, and a K that does not
    belong to the packed width would cut or drop codes: each is refused, naming the argument."""
    with pytest.raises(exc, match=match):
        call()


def test_fp4_packing_and_e8m0_take_every_valid_value():
    codes = np.arange(16, dtype=np.int64)
    assert ref.unpack_fp4(ref.pack_fp4(codes), 16).tolist() == codes.tolist()
    assert ref.unpack_fp4(ref.pack_fp4(codes[:15]), 15).tolist() == codes[:15].tolist()
    e2m1 = np.array([0.5, -6.0], ml_dtypes.float4_e2m1fn)  # read as its codes 0x1 and 0xf
    assert ref.pack_fp4(e2m1).tolist() == [0xF1]
    assert ref.unpack_fp4(np.zeros((2, 0), np.uint8), 0).shape == (2, 0)
    e = np.arange(256)
    want = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    for v in (e, e.astype(np.uint8), e.astype(np.int16), e.astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)):
        np.testing.assert_array_equal(ref.e8m0_to_float(v), want)


def test_e8m0_ceil_hand_worked():
    v = np.array(
        [
            0,
            2.0**-149,
            2.0**-127,
            2.0**-127 + 2.0**-149,
            2.0**-126,
            1.0,
            1.0000001,
            1.5,
            2.0,
            2.0**127,
            2.0**127 * 1.5,
            3.4e38,
            np.inf,
            np.nan,
        ],
        np.float32,
    )
    assert ref.e8m0_ceil(v).tolist() == [0, 0, 0, 1, 1, 127, 128, 128, 128, 254, 254, 254, 254, 255]


def test_mx_scale_exponent_hand_worked():
    a = np.array([0, 1.0, 3.0, 448.0, 449.0, 896.0, 2.0**-140, np.inf, np.nan], np.float32)
    # ceil: 3/448 -> 2^-7.2 -> -7 (120); 448/448 = 1 -> 127; 449/448 -> 128; 2^-140/448 -> 0
    assert ref.mx_scale_exponent(a, "float8_e4m3fn").tolist() == [0, 119, 120, 127, 128, 128, 0, 254, 255]
    # floor (OCP): exponent(amax) - 8, so amax 3 (2^1.58) -> 1 - 8 = -7 -> 120; 448 (2^8.8) -> 127
    assert ref.mx_scale_exponent(a, "float8_e4m3fn", "floor").tolist() == [0, 119, 120, 127, 127, 128, 0, 254, 255]
    # E2M1: 3/6 = 0.5 -> 126; 6/6 -> 127
    assert ref.mx_scale_exponent(np.float32([3, 6, 6.5]), "float4_e2m1fn").tolist() == [126, 127, 128]
    assert ref.mx_scale_exponent(np.float32([3, 6, 6.5]), "float4_e2m1fn", "floor").tolist() == [126, 127, 127]


def test_mx_data_multiplier_edges():
    m = ref.mx_data_multiplier(np.array([0, 127, 253, 254, 255], np.uint8))
    assert m.view(np.uint32).tolist()[:4] == [0x7F000000, 0x3F800000, 0x00800000, 0x00400000]
    assert np.isnan(m[4])


def test_quantize_mx_hand_worked():
    x = np.zeros((1, 40), np.float32)
    x[0, :3] = [3.0, 1.0, -0.3]
    x[0, 33] = 0.75  # second, partial block (8 elements, zero-padded)
    q, s = ref.quantize_mx(x, "float8_e4m3fn")
    assert s.tolist() == [[120, 118]]  # 3/448 = 2^-7.2 -> -7; 0.75/448 = 2^-9.2 -> -9
    assert q[0, :3].tolist() == [0x7C, 0x70, 0xE2]  # times 2^7: 384, 128, -38.4 -> -40 (-1.25 * 32)
    assert q.shape == (1, 40)


def test_quantize_mxfp4_and_nvfp4_hand_worked():
    x = np.zeros((1, 32), np.float32)
    x[0, :3] = [3.0, 1.0, 0.3]
    q, s = ref.quantize_mx(x, "float4_e2m1fn")
    assert s.tolist() == [[126]]  # scale 0.5, multiplier 2: 6 -> 7, 2 -> 4, 0.6 -> 0.5 (code 1)
    assert q[0, :2].tolist() == [0x47, 0x01] and q.shape == (1, 16)
    q, sf, g = ref.quantize_nvfp4(np.array([[3.0, -1.0, 0.1] + [0.0] * 13], np.float32), global_scale=1.0)
    assert sf.tolist() == [[0x30]] and g == 1  # e4m3(3 * (1 * float32(1/6))) = 0.5
    assert q[0, :2].tolist() == [0xC7, 0x00]  # 3 * 2 = 6 -> 7; -1 * 2 = -2 -> 0xC; 0.2 -> 0
    q, sf, g = ref.quantize_nvfp4(np.array([[3.0, -1.0, 0.1] + [0.0] * 13], np.float32))
    assert g == np.float32(896) and sf.tolist() == [[0x7E]]  # amax 3: S_enc = 2688 / 3; sf = 448
    assert q[0, :2].tolist() == [0xC7, 0x00]


def test_nvfp4_global_scale_rules():
    assert ref.nvfp4_global_scale(0.0) == 1 and ref.nvfp4_global_scale(np.inf) == 1
    assert ref.nvfp4_global_scale(2688.0) == 1 and ref.nvfp4_global_scale(1.0) == 2688
    assert ref.nvfp4_global_scale(1e-45) == ref.FLT_MAX  # the quotient overflows


def test_swizzle_offsets_hand_worked():
    off = ref.swizzle_offsets(130, 5)
    assert off[0].tolist() == [0, 1, 2, 3, 512]
    assert off[1, 0] == 16 and off[31, 0] == 496 and off[32, 0] == 4 and off[127, 3] == 511
    assert off[128, 0] == 1024 and off[129, 4] == 1552
    s = np.arange(130 * 5, dtype=np.uint32).astype(np.uint8).reshape(130, 5)
    buf = ref.swizzle_scales(s)
    assert buf.shape == (256, 8) and ref.swizzled_shape(130, 5) == (256, 8)
    np.testing.assert_array_equal(ref.unswizzle_scales(buf, (130,), 5), s)
    pad = np.ones(buf.size, bool)
    pad[off.reshape(-1)] = False
    assert not buf.reshape(-1)[pad].any()


def test_dequantize_mx_subnormal_scale_and_nan_scale():
    codes = np.array([[0x38] * 32 + [0x38] * 32], np.uint8)  # 1.0 everywhere, two blocks
    y = ref.dequantize_mx(codes, np.array([[0, 255]], np.uint8))
    assert y[0, 0].view(np.uint32) == 0x00400000  # 1.0 * 2^-127, kept subnormal
    assert np.isnan(y[0, 32:]).all()


# ---------------------------------------------------------------- the wide geometry's NVFP4 rule
# NumPy models of the float32 arithmetic and bit packing of kernels/block_scale.cuh's
# nvfp4_fast_codes (its GPU tests are in test_mx.py): the rule and the packing constants, checked
# against the reference's cast and packing on the CPU.
E2M1_M0, E2M1_M1 = np.float32(2.0**23), np.float32(2.0**23 + 0x500000)


def _e2m1_candidates(c, M):
    """min of the three candidate patterns for float32 c >= 0: each candidate's exact value is
    formed in float64 (exact here) and rounded once to float32, as one FMA rounds it."""
    c = np.asarray(c, np.float32).astype(np.float64)
    M = np.float64(M)
    cands = [(c * 2 + M), (c + (M + 2)), (c * 0.5 + (M + 4))]
    return np.minimum.reduce([x.astype(np.float32).view(np.uint32) for x in cands])


def _prmt(a, b, sel):
    """prmt.b32 (default mode) on uint32 arrays."""
    src = (np.asarray(b, np.uint64) << 32) | np.asarray(a, np.uint64)
    out = np.zeros(np.broadcast(a, b).shape, np.uint64)
    for n in range(4):
        s = (sel >> (4 * n)) & 0xF
        byte = (src >> np.uint64(8 * (s & 7))) & np.uint64(0xFF)
        if s & 8:
            byte = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
        out |= byte << np.uint64(8 * n)
    return out.astype(np.uint32)


def _fast_segment_words(pairs, mult):
    """The two code words of 16 bf16 elements (pairs: (..., 8) uint32, element 2j in the low half of
    pairs[j]) scaled by float32 mult, as nvfp4_fast_codes forms them."""
    pairs = np.asarray(pairs, np.uint32)
    lo = (pairs << 16).view(np.float32)
    hi = (pairs & 0xFFFF0000).view(np.float32)
    x = np.stack([lo, hi], axis=-1).reshape(pairs.shape[:-1] + (16,))
    with np.errstate(all="ignore"):
        c = (np.abs(x) * np.float32(mult)).astype(np.float32)
    words = []
    for u in range(2):
        t = [_e2m1_candidates(c[..., 8 * u + i], E2M1_M1 if i == 1 else E2M1_M0) for i in range(8)]
        mag = t[7].astype(np.uint64)
        for i in range(6, -1, -1):
            mag = (mag * 16 + t[i]) & 0xFFFFFFFF
        p = pairs[..., 4 * u : 4 * u + 4]
        a, b = _prmt(p[..., 0], p[..., 1], 0x7351), _prmt(p[..., 2], p[..., 3], 0x7351)
        sign = (_prmt(a, b, 0xDC98) & 0x0F0F0F0F) | (_prmt(a, b, 0xFEBA) & 0xF0F0F0F0)
        words.append((mag.astype(np.uint32) & 0x77777777) | (sign & 0x88888888))
    return np.stack(words, axis=-1)


def test_e2m1_min_of_three_candidates_rule():
    """For float32 c in [0, 7): the low 3 bits of min(rne(2c + M), rne(c + 2 + M), rne(c / 2 + 4 +
    M)) (M = 2^23 or M1) are the E2M1 code of c (nearest, ties to even, saturating at 6): every
    exponent with the top 13 mantissa bits exhaustive and low bits 0, 1, all ones and random, plus
    65536 patterns on each side of every tie point and every E2M1 value."""
    rng = np.random.default_rng(11)
    e = np.arange(0, 130, dtype=np.uint32)[:, None]
    hi = np.arange(0, 1 << 23, 1 << 10, dtype=np.uint32)[None, :]
    low = rng.integers(0, 1 << 10, hi.shape, dtype=np.uint32)
    pats = [((e << 23) | m).reshape(-1) for m in (hi, hi | 1, hi | 0x3FF, hi | low)]
    for p in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 7.0):
        b = np.float32(p).view(np.uint32)
        pats.append(np.arange(b - 65536, b + 65536, dtype=np.int64).astype(np.uint32))
    pats = np.concatenate(pats)
    c = pats.view(np.float32)
    c = c[c < 7]
    want = ref.cast_e2m1(c)
    for M in (E2M1_M0, E2M1_M1):
        got = _e2m1_candidates(c, M) - np.float32(M).view(np.uint32)
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, (
            f"M={M}: {bad.size} mismatches, first c={c[bad[0]]!r} got {got[bad[0]]} want {want[bad[0]]}"
        )


def test_e2m1_fast_segment_packing_model():
    """The packing of nvfp4_fast_codes (Horner's rule on the candidate patterns with M1 for
    element 1 of every eight, the sign nibbles gathered by four byte permutes) gives the reference's
    packed codes, for every bf16 pattern whose scaled magnitude stays below 7 (-0 and subnormals
    included) in random blocks, at multipliers across the float32 range."""
    rng = np.random.default_rng(12)
    pats = np.arange(1 << 16, dtype=np.uint32)
    for mult in (np.float32(1.0), np.float32(0.37), np.float32(2.0**-120 * 3), np.float32(2.0**100 / 3)):
        with np.errstate(all="ignore"):
            scaled = (np.abs((pats << 16).view(np.float32)) * mult).astype(np.float32)
        ok = pats[scaled < 7]
        body = rng.permutation(np.concatenate([ok, rng.choice(ok, (-ok.size) % 16)])).reshape(-1, 16)
        x = (body << 16).view(np.float32)
        with np.errstate(all="ignore"):
            want = ref.pack_fp4(ref.cast_e2m1((x * mult).astype(np.float32)))
        pairs = body[:, 0::2] | (body[:, 1::2] << 16)
        got = _fast_segment_words(pairs, mult).view(np.uint8).reshape(want.shape)
        np.testing.assert_array_equal(got, want)
