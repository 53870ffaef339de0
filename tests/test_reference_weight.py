"""The NumPy weight-only reference (``weight_scheme``, ``quantize_weight``, ``dequantize_weight``)
against hand-worked values, an independent float64 model and error bounds (CPU only, no CuPy)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from cupyquant import reference as ref

BF16, E4M3 = np.dtype(ml_dtypes.bfloat16), "float8_e4m3fn"
DTYPES = (np.dtype(np.float16), BF16, np.dtype(np.float32))
SCHEMES = ("int4", "uint4", E4M3)
SUB16 = 2.0**-24  # the smallest float16 subnormal


def _codes(data, K):
    """Unpack INT4 bytes by hand: element 2i is the low nibble of byte i."""
    d = np.asarray(data, np.uint8)
    return np.stack([d & 0xF, d >> 4], axis=-1).reshape(d.shape[0], -1)[:, :K]


def _group(vals, dtype=np.float32, G=32):
    """One row, one group of G: ``vals`` then zeros."""
    w = np.zeros((1, G), np.float64)
    w[0, : len(vals)] = vals
    return w.astype(dtype)


def _rand(shape, seed, dtype):
    rng = np.random.default_rng(seed)
    v = rng.standard_normal(shape) * np.exp(rng.standard_normal(shape))
    return v.astype(np.float32).astype(dtype)


def _f32(x):
    """Round float64 to float32 and back: one +, -, / of float32 operands done in float64 and
    rounded once like this equals the IEEE float32 operation (53 >= 2 * 24 + 2 bits)."""
    return np.asarray(x, np.float64).astype(np.float32).astype(np.float64)


def _model(w, scheme, G):
    """Independent model of the docstring: returns (codes (N, K), scales as float64, z or None)."""
    N, K = w.shape
    g = w.astype(np.float64).reshape(N, K // G, G)
    z = None
    if scheme == "uint4":
        mx, mn = g.max(-1), g.min(-1)
        s = _f32(np.maximum(_f32(mx - mn), _f32(1e-5)) / 15)
    else:
        s = _f32(np.abs(g).max(-1) / (7 if scheme == "int4" else 448))
    s = s.astype(np.float32).astype(w.dtype).astype(np.float64)[..., None]
    v = _f32(g / s)
    if scheme == "int4":
        q = np.clip(np.rint(v), -8, 7) + 8
    elif scheme == "uint4":
        z = np.clip(np.rint(_f32(-mn[..., None] / s)), 0, 15)
        q = np.clip(np.rint(v) + z, 0, 15)
    else:
        q = np.clip(v, -448, 448).astype(np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return q.reshape(N, K).astype(np.uint8), s[..., 0], z


@pytest.mark.parametrize(
    "dtype, symmetric, scheme",
    [
        ("int4", True, "int4"),
        ("int4", False, "uint4"),
        ("uint4", True, "uint4"),
        ("uint4", False, "uint4"),
        (E4M3, True, E4M3),
        # the ml_dtypes type and its np.dtype name the FP8 scheme too, as they do for quantize_fp8
        (ml_dtypes.float8_e4m3fn, True, E4M3),
        (np.dtype(ml_dtypes.float8_e4m3fn), True, E4M3),
    ],
)
def test_weight_scheme(dtype, symmetric, scheme):
    assert ref.weight_scheme(dtype, symmetric) == scheme


def test_int4_hand_worked():
    # amax 1.4 -> s = f32(1.4f / 7) = 0.2f exactly; 0.7f / 0.2f rounds in float32 to 3.5 -> even 4
    # -> code 12; -1.4f / 0.2f = -7 -> code 1; 0.1f / 0.2f = 0.5 -> even 0 -> code 8; 0 -> 8.
    # byte 0 = 12 | 1 << 4 = 28, byte 1 = 8 | 8 << 4 = 136. -0.3 / 0.2 = -1.5 -> even -2 -> code 6.
    data, s, zeros = ref.quantize_weight(_group([0.7, -1.4, 0.1, 0, -0.3]), group_size=32)
    assert zeros is None and s.dtype == np.float32 and s.tolist() == [[np.float32(0.2)]]
    assert data[0, :3].tolist() == [28, 136, 6 | 8 << 4]
    y = ref.dequantize_weight(data, s)
    assert y[0, :5].tolist() == [
        np.float32(4 * np.float32(0.2)),
        np.float32(-7 * np.float32(0.2)),
        0,
        0,
        np.float32(-2 * np.float32(0.2)),
    ]


def test_int4_clamps_to_0_15():
    # float16 [10, -10, -9] * 2^-24: amax / 7 = 1.43 * 2^-24 -> s = 2^-24 (rounded down), so
    # w / s = 10, -10, -9 -> clamp to 7, -8, -8 -> codes 15, 0, 0: bytes 15 | 0 << 4, 0 | 8 << 4.
    data, s, _ = ref.quantize_weight(_group(np.array([10, -10, -9]) * SUB16, np.float16), group_size=32)
    assert s.astype(np.float32).tolist() == [[SUB16]] and data[0, :2].tolist() == [15, 128]


def test_uint4_hand_worked():
    # group 0: min -3, max 4.5 -> s = 7.5 / 15 = 0.5, z = rne(3 / 0.5) = 6; 4.5 -> 9 + 6 = 15,
    # -3 -> 0, 1.25 -> 2.5 -> even 2 -> 8, 1.75 -> 3.5 -> even 4 -> 10, 0 -> 6.
    # group 1: min -0.75, max 6.75 -> s = 0.5, z = rne(1.5) = 2 (tie, even); 6.75 -> 13.5 -> 14,
    # + 2 = 16 -> clamps to 15 (dequant (15 - 2) * 0.5 = 6.5); -0.75 -> -1.5 -> even -2, + 2 = 0;
    # 0 -> 2. zeros byte = 6 | 2 << 4 = 38.
    w = np.concatenate([_group([4.5, -3, 1.25, 1.75]), _group([6.75, -0.75])], axis=1)
    data, s, zeros = ref.quantize_weight(w, "uint4", group_size=32)
    assert s.tolist() == [[0.5, 0.5]] and zeros.dtype == np.uint8 and zeros.tolist() == [[38]]
    c = _codes(data, 64)[0]
    assert c[:5].tolist() == [15, 0, 8, 10, 6] and c[32:35].tolist() == [15, 0, 2]
    y = ref.dequantize_weight(data, s, zeros, "uint4")
    assert y[0, :5].tolist() == [4.5, -3, 1, 2, 0] and y[0, 32:34].tolist() == [6.5, -1]
    assert ref.quantize_weight(w, "int4", group_size=32, symmetric=False)[2].tolist() == [[38]]


def test_uint4_dequantization_needs_its_zero_points():
    data, s, zeros = ref.quantize_weight(_group([4.5, -3, 1.25]), "uint4", group_size=32)
    with pytest.raises(ValueError, match="^zeros must be given for uint4 weights"):
        ref.dequantize_weight(data, s, None, "uint4")
    with pytest.raises(ValueError, match="^zeros must have shape"):
        ref.dequantize_weight(data, s, zeros[:, :0], "uint4")
    # a K short of the data's width reads only the bytes that hold it
    y = ref.dequantize_weight(data, s, zeros, "uint4")
    np.testing.assert_array_equal(ref.dequantize_weight(data, s, zeros, "uint4", K=16), y[:, :16])


def test_fp8_hand_worked():
    # amax 28 -> s = 28 / 448 = 2^-4. w / s: 28 -> 448 = 0x7e; -1 -> -16 = 2^4 -> 0xd8;
    # 2^-5 -> 0.5 -> 0x30; 0.1f -> 1.6000000238 -> nearest 1.625 -> 0x3d; ties to even:
    # 1.0625 -> 1.0 (0x38), 1.1875 -> 1.25 (0x3a).
    w = _group([28, -1, 2.0**-5, 0.1, 1.0625 / 16, 1.1875 / 16])
    data, s, zeros = ref.quantize_weight(w, E4M3, group_size=32)
    assert zeros is None and data.shape == (1, 32) and s.tolist() == [[0.0625]]
    assert data[0, :7].tolist() == [0x7E, 0xD8, 0x30, 0x3D, 0x38, 0x3A, 0x00]
    assert ref.dequantize_weight(data, s, dtype=E4M3)[0, :4].tolist() == [28, -1, 2.0**-5, 1.625 / 16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group_size", [32, 64, 128, None])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_layout(scheme, group_size, dtype):
    N, K = 4, 384
    data, s, zeros = ref.quantize_weight(_rand((N, K), 1, dtype), scheme, group_size=group_size)
    ng = 1 if group_size is None else K // group_size
    assert data.dtype == np.uint8 and data.shape == ((N, K) if scheme == E4M3 else (N, K // 2))
    assert s.dtype == dtype and s.shape == (N, ng)
    if scheme == "uint4":
        assert zeros.dtype == np.uint8 and zeros.shape == (N, (ng + 1) // 2)
        if ng % 2:  # the padding nibble of an odd group count is 0
            assert not (zeros[:, -1] >> 4).any()
    else:
        assert zeros is None


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group_size", [32, 64, 128, None])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_matches_model_and_round_trip_bound(scheme, group_size, dtype, seed):
    N, K = 8, 256
    w = _rand((N, K), seed, dtype)
    G = K if group_size is None else group_size
    data, s, zeros = ref.quantize_weight(w, scheme, group_size=group_size)
    q, s_model, z = _model(w, scheme, G)
    assert np.array_equal(s.astype(np.float64), s_model)
    codes = data if scheme == E4M3 else _codes(data, K)
    assert np.array_equal(codes.astype(np.int32), q.astype(np.int32))
    if scheme == "uint4":
        assert np.array_equal(_codes(zeros, K // G).astype(np.int32), z[..., 0].astype(np.int32))

    y = ref.dequantize_weight(data, s, zeros, scheme, np.float32).astype(np.float64)
    wf, sf = w.astype(np.float64), np.repeat(s.astype(np.float64), G, axis=1)
    err = np.abs(wf - y)
    # Slack 2^-20 * s: the float32 quotient w / s (|w / s| <= 7.03) is off by < 2^-21 in units of
    # s and can land on a tie, and for float32 scales the product q * s rounds once (2^-24 * 8 s).
    if scheme == "int4":
        # T(s) may round below amax / 7, but amax / s <= 7 * (1 + 2^-8) < 7.5: 7 never clamps.
        assert (err <= sf / 2 + sf * 2.0**-20).all()
    elif scheme == "uint4":
        g = wf.reshape(N, K // G, G)
        assert (g.min(-1) < 0).all() and (g.max(-1) > 0).all()  # 0 inside [min, max]
        # When T(s) rounds below (max - min) / 15, (max - min) / s exceeds 15 and the top code may
        # clamp by that excess: slack max(0, (max - min) - 15 s) (<= 15 * 2^-8 s for bfloat16).
        excess = np.repeat(np.maximum(0, (g.max(-1) - g.min(-1)) - 15 * s.astype(np.float64)), G, axis=1)
        assert (err <= sf / 2 + excess + sf * 2.0**-20).all()
    else:
        normal = np.abs(wf) >= sf * 2.0**-6  # E4M3 normals: 3 mantissa bits, rel. error <= 1/17
        assert (err[normal] <= np.abs(wf[normal]) * 2.0**-4).all()
        assert (err[~normal] <= sf[~normal] * (2.0**-10 + 2.0**-20)).all()  # half of 2^-9 spacing
        assert not np.isin(data, [0x7F, 0xFF]).any()  # saturates, never NaN
    for out in (np.float16, BF16):  # other outputs: the float32 result rounded to nearest even
        y2 = ref.dequantize_weight(data, s, zeros, scheme, out)
        assert y2.dtype == out and np.array_equal(y2, y.astype(np.float32).astype(out))


ZERO_CODE = {"int4": 8, "uint4": 0, E4M3: 0}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_all_zero_group(scheme, dtype):
    w = np.concatenate([_group([], dtype), _group([1, -2], dtype)], axis=1)
    data, s, zeros = ref.quantize_weight(w, scheme, group_size=32)
    codes = data if scheme == E4M3 else _codes(data, 64)
    assert (codes[0, :32] == ZERO_CODE[scheme]).all()
    # AWQ floors max - min at 1e-5, so a uint4 zero group keeps a nonzero scale and z = 0; the
    # second group [1, -2]: s = 3 / 15 = 0.2, z = rne(2 / 0.2) = 10 -> zeros byte 0 | 10 << 4.
    s0 = np.float32(np.float32(1e-5) / np.float32(15)).astype(dtype) if scheme == "uint4" else 0
    assert s[0, 0] == s0 and (scheme != "uint4" or zeros.tolist() == [[0 | 10 << 4]])
    y = ref.dequantize_weight(data, s, zeros, scheme)
    assert (y[0, :32] == 0).all() and not np.signbit(y[0, :32]).any()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_nan_weight_quantizes_to_zero_code(scheme):
    w = _group([np.nan, 1.0, -2.0, 0.5])
    data, s, zeros = ref.quantize_weight(w, scheme, group_size=32)
    data0, s0, _ = ref.quantize_weight(np.nan_to_num(w), scheme, group_size=32)
    assert s.tolist() == s0.tolist()  # max / min / amax ignore the NaN (0 is inside [-2, 1])
    codes = data if scheme == E4M3 else _codes(data, 32)
    zero = _codes(zeros, 1)[0, 0] if scheme == "uint4" else ZERO_CODE[scheme]
    assert codes[0, 0] == zero, f"NaN weight -> code {codes[0, 0]:#x}, expected the zero code {zero:#x}"
    assert np.array_equal(codes[0, 1:], (data0 if scheme == E4M3 else _codes(data0, 32))[0, 1:])


@pytest.mark.parametrize("scheme", SCHEMES)
def test_inf_weight_clamps(scheme):
    # The docstring: "+-inf clamps", i.e. +inf -> the top code, -inf -> the bottom code.
    data, _, _ = ref.quantize_weight(_group([np.inf, -np.inf, 1.0]), scheme, group_size=32)
    codes = data if scheme == E4M3 else _codes(data, 32)
    hi, lo = (0x7E, 0xFE) if scheme == E4M3 else (15, 0)
    assert codes[0, :2].tolist() == [hi, lo], f"+-inf -> codes {codes[0, :2].tolist()}"


@pytest.mark.parametrize("scheme", ["int4", E4M3])
def test_float16_scale_underflow(scheme):
    # amax 3 * 2^-24: amax / 7 = 0.43 * 2^-24 and amax / 448 both round to float16 0 -> zero codes.
    w = _group(np.array([2, -1, 3]) * SUB16, np.float16)
    data, s, _ = ref.quantize_weight(w, scheme, group_size=32)
    assert s.tolist() == [[0.0]]
    assert ((data if scheme == E4M3 else _codes(data, 32)) == ZERO_CODE[scheme]).all()
    assert (ref.dequantize_weight(data, s, dtype=scheme) == 0).all()


W, W96, W0 = (np.ones((4, k), np.float32) for k in (64, 96, 0))
ERRORS = {  # id: (call, exception, message fragment naming the argument)
    "scheme-int8-asym": (lambda: ref.weight_scheme("int8", False), ValueError, "symmetric"),
    "scheme-int16": (lambda: ref.weight_scheme(np.int16), ValueError, "dtype"),
    "scheme-type": (lambda: ref.weight_scheme(np.float16), ValueError, "dtype"),
    "scheme-e5m2": (lambda: ref.weight_scheme(ml_dtypes.float8_e5m2), ValueError, "dtype"),
    "scheme-object": (lambda: ref.weight_scheme(object()), TypeError, "dtype"),
    "scheme-fp8-asym": (lambda: ref.weight_scheme(E4M3, False), ValueError, "symmetric"),
    "int8": (lambda: ref.quantize_weight(W, "int8"), ValueError, "dtype"),
    "fp8-asym": (lambda: ref.quantize_weight(W, E4M3, symmetric=False), ValueError, "symmetric"),
    "g48": (lambda: ref.quantize_weight(W, group_size=48), ValueError, "group_size"),
    "g256": (lambda: ref.quantize_weight(W, group_size=256), ValueError, "group_size"),
    "g128-K64": (lambda: ref.quantize_weight(W, group_size=128), ValueError, "group_size"),
    "g64-K96": (lambda: ref.quantize_weight(W96, group_size=64), ValueError, "group_size"),
    "1d": (lambda: ref.quantize_weight(np.ones(64, np.float32)), ValueError, "w must be 2-D"),
    "3d": (lambda: ref.quantize_weight(np.ones((2, 4, 64), np.float32)), ValueError, "w must be 2-D"),
    "int32": (lambda: ref.quantize_weight(W.astype(np.int32)), TypeError, "w must be float"),
    "float64": (lambda: ref.quantize_weight(W.astype(np.float64)), TypeError, "w must be float"),
    "K0-g32": (lambda: ref.quantize_weight(W0, group_size=32), ValueError, "K = 0"),
    "K0-gNone": (lambda: ref.quantize_weight(W0, group_size=None), ValueError, "K = 0"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_errors(case):
    call, exc, match = ERRORS[case]
    with pytest.raises(exc, match=match):
        call()


# ---------------------------------------------------------------- the prepared layout
def test_prepare_weight_hand_worked():
    """FP8: N = 17 rows, K = 128 (2 chunks of 64 bytes), 2 groups of 64: two tiles (the second
    padded with 15 zero rows). Byte b of row n lands at [n // 16, b // 64, n % 16, b % 64]."""
    N, B = 17, 128
    data = (np.arange(N * B) % 251 + 1).astype(np.uint8).reshape(N, B)  # no zero byte
    scales = (np.arange(N * 2) + 1).astype(np.float16).reshape(N, 2)
    zc = np.arange(N * 2).astype(np.uint8).reshape(N, 2) % 16
    d, s, z = ref.prepare_weight(data, scales, ref.pack_fp4(zc), scheme="float8_e4m3fn")
    assert d.shape == (2, 2, 16, 64) and s.shape == (2, 2, 16) and z.shape == (2, 2, 8)
    assert d[0, 0, 0, 0] == data[0, 0] and d[0, 1, 0, 0] == data[0, 64] and d[0, 0, 1, 0] == data[1, 0]
    assert d[1, 1, 0, 6] == data[16, 70] and d[0, 1, 15, 63] == data[15, 127]
    assert not d[1, :, 1:].any()  # padding rows
    assert d.reshape(-1)[1024] == data[0, 64]  # chunk 1 of tile 0 starts 1 KB in
    assert s[0, 1, 5] == scales[5, 1] and s[1, 0, 0] == scales[16, 0] and not s[1, :, 1:].any()
    # zero codes: row i of a tile in nibble i % 2 of byte i // 2
    assert z[0, 1, 2] == zc[4, 1] | (zc[5, 1] << 4)
    assert z[1, 0, 0] == zc[16, 0] and not z[1, :, 1:].any()


def test_prepare_weight_int4_hand_worked():
    """INT4 fragment order, worked by hand. Codes q[n, k] = (n + k) % 16 for N = 17, K = 256, groups
    of 32 (so the chunks' k are not permuted: see the next test). With k % 128 = 16 s + 8 kb + 2 t + e,
    byte [T, k // 128, s % 2, 4 g + s // 2, 4 t + kb + 2 e] holds rows 16 T + g (low nibble) and
    16 T + g + 8 (high)."""
    N, K = 17, 256
    n, k = np.indices((N, K))
    q = ((n + k) % 16).astype(np.uint8)
    d, s, z = ref.prepare_weight(ref.pack_fp4(q), np.ones((N, 8), np.float16), scheme="int4")
    assert d.shape == (2, 2, 2, 32, 16) and z is None
    # piece 0, word 0 (lane (0, 0), step 0 of chunk 0): rows 0 / 8 at k = 0, 8, 1, 9 in bytes 0..3
    assert list(d[0, 0, 0, 0, :4]) == [0 | 8 << 4, 8 | 0 << 4, 1 | 9 << 4, 9 | 1 << 4]
    # step s = 3 (s % 2 = 1, s // 2 = 1), lane (g = 3, t = 2): piece 4 * 3 + 1 = 13, word 2; byte 3 (kb = 1,
    # e = 1): k = 48 + 8 + 4 + 1 = 61
    assert d[0, 0, 1, 13, 11] == ((3 + 61) % 16) | (((11 + 61) % 16) << 4)
    # chunk 1, step 6 (s % 2 = 0, s // 2 = 3), lane (g = 1, t = 1): piece 7, word 1; byte 0: k = 128 + 96 + 2 = 226
    assert d[0, 1, 0, 7, 4] == ((1 + 226) % 16) | (((9 + 226) % 16) << 4)
    # tile 1: only row 16 (g = 0: the low nibbles of pieces 0..3); the high nibbles and pieces 4.. are padding
    assert d[1, 0, 0, 1, 0] == (16 + 32) % 16 and not (d[1] >> 4).any() and not d[1, :, :, 4:].any()
    # pieces 4 g + j of both halves hold rows g and g + 8 at k = 32 j .. 32 j + 31 (g = 2, j = 3)
    got = np.sort(np.concatenate([d[0, 0, 0, 11], d[0, 0, 1, 11]]))
    want = np.sort(ref.pack_fp4(np.stack([q[2, 96:128], q[10, 96:128]], axis=-1)).reshape(-1))
    np.testing.assert_array_equal(got, want)
    # the 32-bit word of lane (0, 0), step 0: nibble j is register j % 4 (rows 0, 8, 0, 8; k 0, 0, 8, 8), half j // 4 (k + 1)
    word = int(d[0, 0, 0, 0, :4].view("<u4")[0])
    assert [(word >> (4 * j)) & 15 for j in range(8)] == [
        q[0, 0],
        q[8, 0],
        q[0, 8],
        q[8, 8],
        q[0, 1],
        q[8, 1],
        q[0, 9],
        q[8, 9],
    ]


def test_prepare_weight_int4_whole_chunk_groups_hand_worked():
    """Groups of 128 (or one a row): each chunk's k = 32 a + 8 b + r takes the place of 32 b + 8 a + r
    in the fragment order. Codes q[n, k] = k // 8 % 16 (the block of 8 k) + row bits, N = 16, K = 256:
    pieces 4 g + j of a chunk hold blocks j, 4 + j, 8 + j and 12 + j, and lane t's four 16-byte loads
    of activations (t = 0..3 in each) read blocks 4 i + t, i.e. 64 contiguous bytes per load."""
    N, K = 16, 256
    n, k = np.indices((N, K))
    q = ((k // 8) % 16).astype(np.uint8)
    for ng in (2, 1):  # groups of 128; per-channel
        d, _, _ = ref.prepare_weight(ref.pack_fp4(q), np.ones((N, ng), np.float16), scheme="int4")
        codes = ref.unpack_fp4(d, 32)  # [tile, chunk, s % 2, 4 g + s // 2, 32 codes]
        for g in (0, 5):
            for j in range(4):
                blocks = np.unique(np.concatenate([codes[0, 0, 0, 4 * g + j], codes[0, 0, 1, 4 * g + j]]))
                np.testing.assert_array_equal(blocks, [j, 4 + j, 8 + j, 12 + j])
        # chunk 1: blocks 16.. (% 16 again); word 0 of piece (0, 0) is step 0: layout k 0, 1, 8, 9 =
        # chunk k 0, 1 (block 0) and 32, 33 (block 4)
        word = int(d[0, 1, 0, 0, :4].view("<u4")[0])
        assert [(word >> (4 * j)) & 15 for j in range(8)] == [0, 0, 4, 4, 0, 0, 4, 4]
    # groups of 64: not permuted (piece 0 holds the first 32 k, blocks 0..3)
    d, _, _ = ref.prepare_weight(ref.pack_fp4(q), np.ones((N, 4), np.float16), scheme="int4")
    codes = ref.unpack_fp4(d, 32)
    np.testing.assert_array_equal(np.unique(np.concatenate([codes[0, 0, 0, 0], codes[0, 0, 1, 0]])), [0, 1, 2, 3])


@pytest.mark.parametrize("N,B,ng", [(1, 64, 1), (16, 64, 2), (33, 192, 3), (100, 256, 8), (20, 128, 1)])
def test_prepare_weight_is_the_tile_transpose(N, B, ng):
    """The scatter of ref.prepare_weight against the reshape and transpose of the padded rows (FP8:
    tile-major rows; INT4: the fragment order as cupyquant.weight writes it, in NumPy, with the
    chunks' 4 x 4 blocks of 8 k transposed where the groups are whole chunks: G = 2 B / ng of 128,
    256 and per-channel here, 64 not)."""
    rng = np.random.default_rng(N * B)
    data = rng.integers(0, 256, (N, B), dtype=np.uint8)
    scales = rng.standard_normal((N, ng)).astype(BF16)
    zc = rng.integers(0, 16, (N, ng), dtype=np.uint8)
    T = -(-N // 16)

    def pad(x):
        return np.concatenate([x, np.zeros((16 * T - N,) + x.shape[1:], x.dtype)])

    for scheme in ("float8_e4m3fn", "uint4"):
        d, s, z = ref.prepare_weight(data, scales, ref.pack_fp4(zc), scheme=scheme)
        if scheme == "float8_e4m3fn":
            np.testing.assert_array_equal(d, pad(data).reshape(T, 16, B // 64, 64).transpose(0, 2, 1, 3))
        else:
            kperm = (2 * B // ng) % 128 == 0
            codes = ref.unpack_fp4(pad(data), 2 * B).reshape(T, 2, 8, B // 64, 2, 2, 2, 2, 4, 2)
            fwd = (0, 3, 4, 2, 6, 7, 8, 9, 5, 1) if kperm else (0, 3, 6, 2, 4, 5, 8, 9, 7, 1)
            frag = codes.transpose(fwd).reshape(T, B // 64, 2, 32, 32)
            np.testing.assert_array_equal(d, ref.pack_fp4(frag))
            # and back: the inverse transpose of cupyquant.weight._plain_of
            inv = (0, 9, 3, 1, 2, 8, 4, 5, 6, 7) if kperm else (0, 9, 3, 1, 4, 5, 2, 8, 6, 7)
            back = ref.unpack_fp4(d, 32).reshape(T, B // 64, 2, 8, 2, 2, 4, 2, 2, 2).transpose(inv)
            np.testing.assert_array_equal(ref.pack_fp4(back.reshape(16 * T, 2 * B))[:N], data)
        np.testing.assert_array_equal(
            s.view(np.uint16), pad(scales).reshape(T, 16, ng).transpose(0, 2, 1).view(np.uint16)
        )
        tz = pad(zc).reshape(T, 16, ng).transpose(0, 2, 1)
        np.testing.assert_array_equal(ref.unpack_fp4(z, 16), tz)
        assert ref.prepare_weight(data, scales, scheme=scheme)[2] is None


def test_prepare_weight_rejects_partial_chunks():
    with pytest.raises(ValueError, match="multiple of 64"):
        ref.prepare_weight(np.zeros((4, 96), np.uint8), np.zeros((4, 1), np.float16), scheme="int4")
    with pytest.raises(ValueError, match="scheme"):
        ref.prepare_weight(np.zeros((4, 64), np.uint8), np.zeros((4, 1), np.float16), scheme="int8")


# ---------------------------------------------------------------- FP4 weights (NVFP4, MXFP4)
FP4 = ("nvfp4", "mxfp4")
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])  # magnitudes of the codes 0..7 (bit 3 the sign)


def test_nvfp4_hand_worked():
    """amax 6: S_enc = 2688 / 6 = 448, scale_2 = float32(1 / 448), and 448 * scale_2 = 1 exactly."""
    w = np.zeros((2, 32), np.float32)
    w[0, :8] = [6, -3, 1.5, 0.5, 0, -6, 4, 2]  # block amax 6: sf = e4m3(6 * 448 / 6) = 448 (0x7e)
    w[0, 16:24] = [3, 1, -0.25, 0.75, 1.25, -2, 0, 0.5]  # amax 3: sf = 224 (0x76), the values doubled
    w[1, :4] = [0.25, 0.75, 2.5, 5]  # amax 5: sf = e4m3(373.3) = 384 (0x7c), the values times 448 / 384
    d, s, s2 = ref.quantize_weight(w, "nvfp4")
    assert d.dtype == np.uint8 and d.shape == (2, 16) and s.dtype == np.uint8 and s.shape == (2, 2)
    assert s2.dtype == np.float32 and s2.shape == (1,) and s2[0] == np.float32(1) / np.float32(448)
    assert s.tolist() == [[0x7E, 0x76], [0x7C, 0x00]]
    codes = _codes(d, 32)
    assert codes[0, :8].tolist() == [7, 8 | 5, 3, 1, 0, 8 | 7, 6, 4]
    # 1.25 * 2 = 2.5 is a tie between 2 and 3: the even code 2 (0x4)
    assert codes[0, 16:24].tolist() == [7, 4, 8 | 1, 3, 4, 8 | 6, 0, 2]
    assert codes[1, :4].tolist() == [1, 2, 5, 7] and not codes[1, 4:].any()
    y = ref.dequantize_weight(d, s, dtype="nvfp4", scale_2=s2)
    assert y.dtype == np.float32 and y.shape == (2, 32)
    assert y[0, :8].tolist() == [6, -3, 1.5, 0.5, 0, -6, 4, 2]
    assert y[0, 16:24].tolist() == [3, 1, -0.25, 0.75, 1, -2, 0, 0.5]
    sf = np.float32(np.float32(384) * s2[0])  # 384 / 448 rounded to float32
    assert y[1, :4].tolist() == [np.float32(v * sf) for v in (0.5, 1, 3, 6)]
    assert ref.quantize_weight_fp4(w, "nvfp4")[2] == s2 and ref.quantize_weight(w, "nvfp4", group_size=16)[2] == s2


def test_mxfp4_hand_worked():
    w = np.zeros((2, 64), np.float32)
    w[0, :8] = [6, -3, 1.5, 0.5, 0.25, 0.75, 2.5, 5]  # amax 6: b = 127 (2^0); ties to even: 0, 1, 2, 4
    w[0, 32:36] = [12, -1, 3, 0.5]  # amax 12: b = 128, the values halved (0.25 -> 0)
    w[1, 0] = 1e-39  # a subnormal amax: b = 0 (2^-127), and 1e-39 * 2^127 = 0.17 gives the code 0
    d, s, s2 = ref.quantize_weight(w, "mxfp4")
    assert s2 is None and d.shape == (2, 32) and s.dtype == np.uint8 and s.tolist() == [[127, 128], [0, 0]]
    codes = _codes(d, 64)
    assert codes[0, :8].tolist() == [7, 8 | 5, 3, 1, 0, 2, 4, 6] and codes[0, 32:36].tolist() == [7, 8 | 1, 3, 0]
    assert not codes[1].any()
    y = ref.dequantize_weight(d, s, dtype="mxfp4")
    assert y[0, :8].tolist() == [6, -3, 1.5, 0.5, 0, 1, 2, 4] and y[0, 32:36].tolist() == [12, -1, 3, 0]
    # E8M0 0 is the subnormal 2^-127, 255 NaN (CUDA's canonical NaN in the output)
    one = ref.pack_fp4(np.full((1, 32), 2, np.uint8))  # every code 1.0
    y = ref.dequantize_weight(np.concatenate([one, one]), np.array([[0], [255]], np.uint8), dtype="mxfp4")
    assert (y[0] == np.float32(2.0**-127)).all() and (y[1].view(np.uint32) == 0x7FFFFFFF).all()


def _fp4_model(data, scales, fmt, scale_2, out_dtype):
    """The dequantization written independently of the reference: E2M1 from a table, each float32
    product done in float64 (exact) and rounded once."""
    K = 2 * data.shape[1]
    block = 16 if fmt == "nvfp4" else 32
    codes = _codes(data, K)
    v = np.where(codes & 8, -1.0, 1.0) * E2M1[codes & 7]
    b = np.repeat(np.asarray(scales, np.uint8), block, axis=1).astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        if fmt == "nvfp4":
            e4m3 = np.asarray(scales, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
            s = _f32(np.repeat(e4m3, block, axis=1) * np.float64(np.float32(scale_2)))
        else:
            s = np.where(b == 255, np.nan, 2.0 ** (b - 127))
        y = _f32(v * s).astype(np.float32)
    return ref.round_to(y, out_dtype)


@pytest.mark.parametrize("out_dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("fmt", FP4)
def test_fp4_dequantize_every_code_and_scale_byte(fmt, out_dtype):
    """Row b: scale byte b (every E4M3 / E8M0 byte, NaN included), the codes 0..15 twice per block."""
    block = 16 if fmt == "nvfp4" else 32
    data = np.tile(ref.pack_fp4(np.arange(32) % 16), (256, 2 * block // 32))
    scales = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 2, axis=1)
    for s2 in (1.0, 0.0123, 2.0**-140, 2.0**100, np.inf, np.nan) if fmt == "nvfp4" else (None,):
        scale_2 = None if s2 is None else np.array([s2], np.float32)
        y = ref.dequantize_weight(data, scales, dtype=fmt, scale_2=scale_2, out_dtype=out_dtype)
        want = _fp4_model(data, scales, fmt, s2, out_dtype)
        assert y.dtype == np.dtype(out_dtype)
        np.testing.assert_array_equal(y.view(np.uint8), want.view(np.uint8), err_msg=f"scale_2 {s2}")
        direct = ref.dequantize_weight_fp4(data, scales, fmt, scale_2, out_dtype)
        np.testing.assert_array_equal(direct.view(np.uint8), y.view(np.uint8))
    if fmt == "mxfp4":  # the numbers of dequantize_mx
        want = ref.dequantize_mx(data, scales, "float4_e2m1fn", out_dtype)
        np.testing.assert_array_equal(y.view(np.uint8), want.view(np.uint8))
    # the scale bytes as the ml_dtypes type
    typed = scales.view(ml_dtypes.float8_e4m3fn if fmt == "nvfp4" else ml_dtypes.float8_e8m0fnu)
    again = ref.dequantize_weight(data, typed, dtype=fmt, scale_2=scale_2, out_dtype=out_dtype)
    np.testing.assert_array_equal(again.view(np.uint8), y.view(np.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("fmt", FP4)
@pytest.mark.parametrize("N,blocks", [(1, 1), (7, 3), (33, 8)])
def test_fp4_is_quantize_nvfp4_and_mx(fmt, dtype, N, blocks):
    block = 16 if fmt == "nvfp4" else 32
    w = _rand((N, blocks * block), N + blocks, dtype)
    w[0, 1] = 0
    if N > 2:
        w[1, :3] = np.array([np.inf, -np.inf, 0], np.float32).astype(dtype)
        w[2, -1] = np.array(np.nan, np.float32).astype(dtype)
    d, s, s2 = ref.quantize_weight(w, fmt)
    if fmt == "nvfp4":
        qd, qs, S_enc = ref.quantize_nvfp4(w)
        assert s2.dtype == np.float32 and s2.tolist() == [np.float32(1) / S_enc]
    else:
        (qd, qs), S_enc = ref.quantize_mx(w, "float4_e2m1fn"), None
        assert s2 is None
    np.testing.assert_array_equal(d, qd)
    np.testing.assert_array_equal(s, qs)
    for out_dtype in DTYPES:
        y = ref.dequantize_weight(d, s, dtype=fmt, scale_2=s2, out_dtype=out_dtype)
        np.testing.assert_array_equal(y.view(np.uint8), _fp4_model(d, s, fmt, s2, out_dtype).view(np.uint8))
        if fmt == "mxfp4":
            want = ref.dequantize_mx(d, s, "float4_e2m1fn", out_dtype)
        elif np.float32(1) / (np.float32(1) / S_enc) == S_enc:  # dequantize_nvfp4 takes S_enc, not scale_2
            want = ref.dequantize_nvfp4(d, s, S_enc, out_dtype)
        else:
            continue
        np.testing.assert_array_equal(y.view(np.uint8), want.view(np.uint8))


def test_nvfp4_scale_2_subnormal():
    """A weight whose amax is below 2688 * 2^-126: S_enc above 2^126, so scale_2 = 1 / S_enc is a
    float32 subnormal, kept (not flushed)."""
    for w in (np.full((3, 16), 1e-38, np.float32), np.full((1, 32), 2.0**-125, BF16)):
        d, s, s2 = ref.quantize_weight(w, "nvfp4")
        S_enc = ref.quantize_nvfp4(w)[2]
        assert 0 < s2[0] < np.finfo(np.float32).tiny and s2[0] == np.float32(1) / S_enc
        y = ref.dequantize_weight(d, s, dtype="nvfp4", scale_2=s2)
        assert (y > 0).all()


def test_fp4_arguments():
    w = np.ones((4, 64), np.float32)
    d, s, s2 = ref.quantize_weight(w, "nvfp4")
    for fmt, gs in (("nvfp4", 32), ("nvfp4", None), ("mxfp4", 16), ("nvfp4", 16.0)):
        with pytest.raises(ValueError, match=f"^group_size={gs!r} is not supported for {fmt}"):
            ref.quantize_weight(w, fmt, group_size=gs)
    ref.quantize_weight(w, "mxfp4", group_size=32)  # the block itself is fine
    with pytest.raises(ValueError, match="^symmetric=False"):
        ref.quantize_weight(w, "nvfp4", symmetric=False)
    with pytest.raises(ValueError, match="^block_size is for float8_e4m3fn"):
        ref.quantize_weight(w, "mxfp4", block_size=(128, 128))
    with pytest.raises(ValueError, match="^w's K = 48 must be a nonzero multiple of 32 for mxfp4"):
        ref.quantize_weight(np.ones((4, 48), np.float32), "mxfp4")
    with pytest.raises(ValueError, match="^w's K = 0"):
        ref.quantize_weight(np.ones((4, 0), np.float32), "nvfp4")
    with pytest.raises(ValueError, match="^w must be 2-D"):
        ref.quantize_weight(np.ones(64, np.float32), "nvfp4")
    with pytest.raises(TypeError, match="^w"):
        ref.quantize_weight(np.ones((4, 64), np.float64), "nvfp4")
    with pytest.raises(ValueError, match="^fmt must be one of"):
        ref.quantize_weight_fp4(w, "int4")
    deq = ref.dequantize_weight
    with pytest.raises(ValueError, match="^scale_2 must be given for nvfp4"):
        deq(d, s, dtype="nvfp4")
    with pytest.raises(TypeError, match="^scale_2 must be a float32 array"):
        deq(d, s, dtype="nvfp4", scale_2=1.0)
    with pytest.raises(ValueError, match="^scale_2 must be a float32 array of one element"):
        deq(d, s, dtype="nvfp4", scale_2=np.ones(2, np.float32))
    with pytest.raises(ValueError, match="^scale_2 is for nvfp4 weights only"):
        deq(d, s[:, :2], dtype="mxfp4", scale_2=s2)
    with pytest.raises(ValueError, match="^scale_2 must be None for mxfp4"):
        ref.dequantize_weight_fp4(d, s[:, :2], "mxfp4", s2)
    with pytest.raises(ValueError, match="^scale_2 is for nvfp4 weights only"):
        deq(d, np.ones((4, 1), np.float16), dtype="int4", scale_2=s2)
    with pytest.raises(ValueError, match=r"^scales must have shape \(4, 2\)"):
        deq(d, s, dtype="mxfp4")
    with pytest.raises(TypeError, match="^scales must be uint8 or float8_e8m0fnu"):
        deq(d, s[:, :2].view(ml_dtypes.float8_e4m3fn), dtype="mxfp4")
    with pytest.raises(ValueError, match="^nvfp4 weights take neither zeros nor block_size"):
        deq(d, s, dtype="nvfp4", scale_2=s2, block_size=(128, 128))
    with pytest.raises(ValueError, match="^K=63 must be 2"):
        deq(d, s, dtype="nvfp4", scale_2=s2, K=63)
    assert deq(d, s, dtype="nvfp4", scale_2=s2, K=64).shape == (4, 64)
    with pytest.raises(ValueError, match="^data's K = 24 must be a nonzero multiple of 16"):
        ref.dequantize_weight_fp4(d[:, :12], s[:, :1], "nvfp4", s2)


@pytest.mark.parametrize("fmt", FP4)
@pytest.mark.parametrize("N,B", [(1, 64), (16, 128), (33, 192), (70, 512)])
def test_prepare_weight_fp4(fmt, N, B):
    """The data exactly as INT4's with the chunks' k permuted (an INT4 weight of one group a row),
    the scale bytes of a 16-row tile and a 128-k chunk together, a row's 128 / block bytes
    contiguous (by hand, and as the transpose of the padded rows)."""
    block = 16 if fmt == "nvfp4" else 32
    nb, nch, T = 128 // block, B // 64, -(-N // 16)
    rng = np.random.default_rng(N + B)
    data = rng.integers(0, 256, (N, B), dtype=np.uint8)
    scales = rng.integers(0, 256, (N, 2 * B // block), dtype=np.uint8)
    d, s, z = ref.prepare_weight(data, scales, scheme=fmt)
    assert z is None and d.shape == (T, nch, 2, 32, 16) and s.shape == (T, nch, 16, nb) and s.dtype == np.uint8
    np.testing.assert_array_equal(d, ref.prepare_weight(data, np.ones((N, 1), np.float16), scheme="int4")[0])
    pad = np.zeros((16 * T, scales.shape[1]), np.uint8)
    pad[:N] = scales
    np.testing.assert_array_equal(s, pad.reshape(T, 16, nch, nb).transpose(0, 2, 1, 3))
    n, j = N - 1, scales.shape[1] - 1  # the last row's last block, by hand
    assert s[n // 16, j // nb, n % 16, j % nb] == scales[n, j]
    assert s[0, 0, 0].tolist() == scales[0, :nb].tolist()  # row 0's bytes of chunk 0, contiguous
    if N % 16:
        assert not s[-1, :, N % 16 :].any()  # padding rows
    typed = scales.view(ml_dtypes.float8_e4m3fn if fmt == "nvfp4" else ml_dtypes.float8_e8m0fnu)
    np.testing.assert_array_equal(ref.prepare_weight(data, typed, scheme=fmt)[1], s)
    with pytest.raises(ValueError, match="^zeros must be None"):
        ref.prepare_weight(data, scales, np.zeros((N, 1), np.uint8), scheme=fmt)
    with pytest.raises(ValueError, match="^scales must have shape"):
        ref.prepare_weight(data, scales[:, :1], scheme=fmt)


# ---------------------------------------------------------------- FP8 weights in 128 x 128 blocks: the weight-only matmul
def _block_weight(N, K, seed, finite=True):
    """Random E4M3 codes (finite ones only, or any) and float32 block scales with full 24-bit
    significands (none of them a bfloat16 or float16 value)."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, (N, K), dtype=np.uint8)
    if finite:
        codes[(codes & 0x7F) == 0x7F] = 0x3F
    nb, kb = -(-N // 128), -(-K // 128)
    scales = (np.float32(1) + rng.integers(1, 2**23, (nb, kb)).astype(np.float32) * np.float32(2.0**-23)) * np.ldexp(
        np.float32(1), rng.integers(-12, -4, (nb, kb))
    )
    return codes, scales.astype(np.float32)


def test_prepare_weight_blocks():
    """Block scales go once per row (row n takes scales[n // 128]), tile-major like group scales, as
    float32 values as stored; the data as FP8's; N and K past whole blocks (200 x 192: the second row
    of blocks has 72 rows, the second column of blocks 64 k)."""
    N, K = 200, 192
    data, scales = _block_weight(N, K, 1)
    d, s, z = ref.prepare_weight(data, scales, scheme=E4M3, block_size=(128, 128))
    d8, _, _ = ref.prepare_weight(data, np.ones((N, 3), np.float16), scheme=E4M3)
    np.testing.assert_array_equal(d, d8)
    T = -(-N // 16)
    assert z is None and s.dtype == np.float32 and s.shape == (T, 2, 16)
    n = np.arange(N)
    for j in range(2):
        np.testing.assert_array_equal(s[n // 16, j, n % 16].view(np.uint32), scales[n // 128, j].view(np.uint32))
    assert not s[T - 1, :, N % 16 :].any()  # padding rows
    with pytest.raises(ValueError, match=r"float32 of shape \(2, 2\)"):
        ref.prepare_weight(data, scales.astype(np.float16), scheme=E4M3, block_size=(128, 128))
    with pytest.raises(ValueError, match=r"float32 of shape \(2, 2\)"):
        ref.prepare_weight(data, scales[:1], scheme=E4M3, block_size=(128, 128))
    with pytest.raises(ValueError, match="block_size=.128, 128. takes float8_e4m3fn"):
        ref.prepare_weight(data, scales, scheme="int4", block_size=(128, 128))
    with pytest.raises(ValueError, match="block_size=.128, 128. takes float8_e4m3fn"):
        ref.prepare_weight(data, scales, np.zeros((N, 1), np.uint8), scheme=E4M3, block_size=(128, 128))


@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["float16", "bfloat16"])
def test_weight_matmul_blocks_formula(dtype):
    """ref is the float64 product with each weight fp8(q) * s[n // 128, k // 128] in float32, rounded
    once to a's dtype, written here element by element; leading dimensions of a kept. Rounding the
    float32 scale to a's dtype first would change that weight (the formula is sharp enough to tell)."""
    N, K = 200, 320
    data, scales = _block_weight(N, K, 2)
    rng = np.random.default_rng(3)
    a = rng.standard_normal((2, 3, K)).astype(np.float32).astype(dtype)
    y, S = ref.weight_matmul_blocks(a, data, scales)
    assert y.shape == S.shape == (2, 3, N) and y.dtype == np.float64
    v = data.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    sf = scales[np.arange(N)[:, None] // 128, np.arange(K)[None, :] // 128]
    W = (v * sf).astype(np.float32).astype(dtype).astype(np.float64)
    a64 = a.astype(np.float64).reshape(-1, K)
    np.testing.assert_array_equal(y.reshape(-1, N), a64 @ W.T)
    np.testing.assert_array_equal(S.reshape(-1, N), np.abs(a64) @ np.abs(W).T)
    W16 = (v * sf.astype(dtype).astype(np.float32)).astype(np.float32).astype(dtype).astype(np.float64)
    assert (W16 != W).mean() > 0.05
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        ref.weight_matmul_blocks(a.astype(np.float32), data, scales)
    with pytest.raises(ValueError, match="share K"):
        ref.weight_matmul_blocks(a[..., :-64], data, scales)
    with pytest.raises(ValueError, match="float32"):
        ref.weight_matmul_blocks(a, data, scales.astype(np.float16))


@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["float16", "bfloat16"])
def test_weight_matmul_error_bound_covers_float32_sums(dtype):
    """Float32 sums of the exact products in three orders (sequential, reversed, and per 64-k chunk
    then chunk by chunk, as the kernels add), rounded once to a's dtype, lie within
    weight_matmul_error_bound of ref; with integer activations and weights of few bits and
    power-of-two scales every partial sum is exact, and all three are round_to(ref) bit for bit."""
    N, K = 130, 1280
    data, scales = _block_weight(N, K, 4)
    rng = np.random.default_rng(5)
    a = (rng.standard_normal((9, K)) * 2.0 ** rng.uniform(-4, 4, (9, 1))).astype(np.float32).astype(dtype)
    W = ref.dequantize_weight_blocks(data, scales, dtype).astype(np.float32)
    prods = a.astype(np.float32)[:, None, :] * W[None, :, :]  # exact in float32

    def sums(p):
        seq = np.zeros(p.shape[:2], np.float32)
        rev = np.zeros(p.shape[:2], np.float32)
        for k in range(K):
            seq += p[..., k]
            rev += p[..., K - 1 - k]
        chunks = np.zeros(p.shape[:2], np.float32)
        for c in range(K // 64):
            part = np.zeros(p.shape[:2], np.float32)
            for k in range(64 * c, 64 * c + 64):
                part += p[..., k]
            chunks += part
        return seq, rev, chunks

    want, S = ref.weight_matmul_blocks(a, data, scales)
    bound = ref.weight_matmul_error_bound(want, S, K, dtype)
    for y in sums(prods):
        y16 = ref.round_to(y, dtype).astype(np.float64)
        assert (np.abs(y16 - want) <= bound).all()
    # exact sums: integer activations, E4M3 values of few bits, power-of-two block scales
    codes = rng.choice(np.array([0, 0x38, 0xB8, 0x40, 0xC0, 0x3C, 0x44, 0x30], np.uint8), (N, K))
    pow2 = np.ldexp(np.float32(1), rng.integers(-2, 2, scales.shape)).astype(np.float32)
    ai = rng.integers(-4, 5, (9, K)).astype(np.float32).astype(dtype)
    We = ref.dequantize_weight_blocks(codes, pow2, dtype).astype(np.float32)
    want, _ = ref.weight_matmul_blocks(ai, codes, pow2)
    for y in sums(ai.astype(np.float32)[:, None, :] * We[None, :, :]):
        np.testing.assert_array_equal(ref.round_to(y, dtype).view(np.uint16), ref.round_to(want, dtype).view(np.uint16))
