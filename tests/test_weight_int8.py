"""INT8 weights per output channel (``quantize_weight(w, "int8", group_size=None)``, W8A8 INT8) and
their code sums: the NumPy reference against hand-worked values and an independent float64 model,
argument checks (CPU); the kernels' codes, scales and code sums bit-exact with the reference,
dequantization, ``from_checkpoint``, the container, the weight-only matmul's refusals and bad
inputs (GPU tests)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_bits_equal, heavy_tailed, poisoned, side_stream

import cupyquant as cq
from cupyquant import _checks, _jit
from cupyquant import reference as ref
from cupyquant import weight as cqw

BF16 = np.dtype(ml_dtypes.bfloat16)
W_DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BF16]
SUB16 = 2.0**-24  # the smallest float16 subnormal


def _id(v):
    return np.dtype(v).name


def _q(w):
    return ref.quantize_weight(w, "int8", group_size=None)


def _model(w):
    """The docstring's formula with float64 steps, each rounded once to float32 (an IEEE float32
    division: 53 >= 2 * 24 + 2 bits), written independently of the reference. Returns
    (codes int8, scales (N, 1) of w's dtype, code sums int64)."""
    w = np.asarray(w)
    g = w.astype(np.float64)
    amax = np.where(np.isfinite(g), np.abs(g), 0.0).max(axis=1) if g.size else np.zeros(g.shape[0])
    s = (amax / 127.0).astype(np.float32).astype(w.dtype).reshape(-1, 1)
    sf = s.astype(np.float64)
    q = np.zeros(g.shape, np.int64)
    with np.errstate(invalid="ignore", divide="ignore"):
        v = (g / np.where(sf == 0, 1.0, sf)).astype(np.float32).astype(np.float64)
    v = np.where(np.isnan(v), 0.0, v)
    q = np.where(sf == 0, 0, np.clip(np.rint(v), -128, 127)).astype(np.int64)
    return q.astype(np.int8), s, q.sum(axis=1)


def _special_rows(dtype, K=40):
    """Rows with the edge cases, in float32 before the cast to ``dtype``."""
    info = ml_dtypes.finfo(dtype)
    big, tiny, normal = float(info.max), float(info.smallest_subnormal), float(info.smallest_normal)
    rows = np.zeros((14, K), np.float32)
    rows[0] = np.linspace(-3, 5, K)  # ordinary
    # rows[1]: all zeros
    rows[2, :3] = np.inf, -np.inf, np.nan  # no finite nonzero weight: s = 0, every code 0
    rows[3, :5] = np.nan, np.inf, -np.inf, 2.0, -1.0  # amax 2 over the finite ones
    rows[4, :3] = big, -big, big / 3  # the max finite value
    rows[5, :2] = tiny, -tiny  # a subnormal amax (its scale underflows)
    rows[6, :4] = 189 * tiny, -189 * tiny, 5 * tiny, tiny  # a scale of T's subnormals (float16: saturates)
    rows[7] = normal * np.arange(K)  # near the smallest normal
    rows[8, :] = np.nan  # only NaN
    rows[9, ::2] = -np.inf  # -inf and zeros: s = 0
    rows[10] = 127.0 * (np.arange(K) % 3 - 1)  # amax 127: s = 1, exact codes
    rows[11] = np.linspace(-63.5, 63.5, K)  # halves: round half to even
    rows[12, :] = -big  # every weight -max: codes -127
    rows[13, 0], rows[13, 1] = 1e-30, -np.inf  # a float32 subnormal scale (float16: 0, bfloat16: normal)
    return rows.astype(dtype)


# ---------------------------------------------------------------- reference, hand-worked (CPU)
def test_hand_worked():
    w = np.zeros((4, 8), np.float32)
    w[0] = [127, -63.5, 0.5, 1.5, -0.5, 2.5, 0, 64.5]  # amax 127: s = 1
    w[1] = [254, 1, 3, -5, 0, 0, 0, 0]  # s = 2: 0.5 -> 0, 1.5 -> 2, -2.5 -> -2
    # w[2]: zeros: s = 0, codes 0
    w[3] = [np.nan, np.inf, -np.inf, 63.5, 31.75, -0.25, 0, 0.75]  # amax 63.5: s = 0.5
    d, s, z = _q(w)
    assert z is None and d.dtype == np.int8 and d.shape == (4, 8)
    assert s.dtype == np.float32 and s.shape == (4, 1) and s[:, 0].tolist() == [1.0, 2.0, 0.0, 0.5]
    assert d[0].tolist() == [127, -64, 0, 2, 0, 2, 0, 64]
    assert d[1].tolist() == [127, 0, 2, -2, 0, 0, 0, 0]
    assert d[2].tolist() == [0] * 8
    assert d[3].tolist() == [0, 127, -128, 127, 64, 0, 0, 2]  # NaN -> 0, +-inf -> 127 / -128; 63.5 -> 64
    assert ref.weight_code_sum(d).tolist() == [127 - 64 + 2 + 2 + 64, 127, 0, 127 - 128 + 127 + 64 + 2]
    assert ref.weight_code_sum(d).dtype == np.int32
    y = ref.dequantize_weight(d, s, dtype="int8")
    assert y.dtype == np.float32
    assert y[1].tolist() == [254, 0, 4, -4, 0, 0, 0, 0] and y[3, :4].tolist() == [0, 63.5, -64, 63.5]


def test_scale_rounded_to_the_weight_dtype():
    # bfloat16: 1 / 127 rounds to 0.00787353515625; the codes divide by that stored scale
    w = np.array([[1.0, 0.5, -0.25]], BF16)
    d, s, _ = _q(w)
    want = (np.float32(1) / np.float32(127)).astype(BF16)
    assert s.dtype == BF16 and s[0, 0] == want and float(want) != float(np.float32(1) / np.float32(127))
    v = (w.astype(np.float32) / np.float32(want)).astype(np.float32)
    assert d[0].tolist() == np.rint(v[0]).astype(int).tolist() == [127, 64, -32]


def test_float16_subnormal_scales():
    # amax 3 * 2^-24: 3 / 127 * 2^-24 rounds to float16 0 -> every code 0
    d, s, _ = _q(np.array([[3 * SUB16, -2 * SUB16, SUB16]], np.float16))
    assert s[0, 0] == 0 and (d == 0).all()
    # amax 189 * 2^-24: 189 / 127 = 1.49 ulp rounds to one ulp, 2^-24: the codes saturate at 127 / -128
    d, s, _ = _q(np.array([[189 * SUB16, -189 * SUB16, 5 * SUB16, SUB16]], np.float16))
    assert float(s[0, 0]) == SUB16
    assert d[0].tolist() == [127, -128, 5, 1]
    # a float32 subnormal scale is kept (no flush): amax 2^-140, s = 2^-140 / 127 (a subnormal)
    w = np.array([[2.0**-140, -(2.0**-141), 0.0]], np.float32)
    d, s, _ = _q(w)
    assert s[0, 0] == np.float32(np.float32(2.0**-140) / np.float32(127)) and 0 < s[0, 0] < 2.0**-126
    assert_bits_equal(d, _model(w)[0])


@pytest.mark.parametrize("dtype", W_DTYPES, ids=_id)
def test_max_finite(dtype):
    big = float(ml_dtypes.finfo(dtype).max)
    w = np.array([[big, -big, big / 2, 0]], np.float32).astype(dtype)
    d, s, _ = _q(w)
    assert s[0, 0] == np.float32(np.float32(big) / np.float32(127)).astype(dtype)
    assert d[0, 0] == 127 and d[0, 1] == -127 and d[0, 3] == 0


@pytest.mark.parametrize("dtype", W_DTYPES, ids=_id)
@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (33, 65), (5, 4097), (0, 16)])
def test_matches_model(shape, dtype):
    w = heavy_tailed(shape, sum(shape), dtype)
    d, s, _ = _q(w)
    md, ms, msum = _model(w)
    assert_bits_equal(d, md, "codes")
    assert_bits_equal(s, ms, "scales")
    assert ref.weight_code_sum(d).tolist() == msum.tolist()
    sp = _special_rows(dtype)
    d, s, _ = _q(sp)
    md, ms, msum = _model(sp)
    assert_bits_equal(d, md, "codes of the special rows")
    assert_bits_equal(s, ms, "scales of the special rows")
    assert ref.weight_code_sum(d).tolist() == msum.tolist()


@pytest.mark.parametrize("out_dtype", W_DTYPES, ids=_id)
@pytest.mark.parametrize("scale_dtype", W_DTYPES, ids=_id)
def test_dequantize_model(scale_dtype, out_dtype):
    rng = np.random.default_rng(3)
    d = rng.integers(-128, 128, (9, 37)).astype(np.int8)
    s = (rng.standard_normal((9, 1)) * np.float32(1 / 3)).astype(np.float32).astype(scale_dtype)
    s[0, 0] = 0
    y = ref.dequantize_weight(d, s, dtype="int8", out_dtype=out_dtype)
    prod = (d.astype(np.float64) * s.astype(np.float64)).astype(np.float32)  # one float32 rounding
    assert_bits_equal(y, prod.astype(out_dtype), "dequantized")
    assert_bits_equal(ref.dequantize_weight_int8(d, s.reshape(-1), out_dtype), y, "(N,) scales")
    # the round trip: within half a step of each weight
    w = heavy_tailed((9, 37), 4, np.float32)
    d, s, _ = _q(w)
    back = ref.dequantize_weight(d, s, dtype="int8")
    assert (np.abs(back - w) <= s * 0.5000001).all()


def test_dequantize_canonical_nan():
    d = np.array([[1, 0, -3]], np.int8)
    y = ref.dequantize_weight_int8(d, np.array([[np.inf]], np.float32), np.float16)
    assert y.view(np.uint16)[0, 1] == 0x7FFF and y[0, 0] == np.inf and y[0, 2] == -np.inf


def test_code_sum_limits():
    K = _checks.INT8_WEIGHT_MAX_K
    d = np.full((2, K), -128, np.int8)
    d[1] = 127
    assert ref.weight_code_sum(d).tolist() == [-(2**31), 127 * K]  # the extremes fit int32
    with pytest.raises(ValueError, match=r"^data's K = 16777217 must be at most 2\^24"):
        ref.weight_code_sum(np.zeros((1, K + 1), np.int8))
    with pytest.raises(ValueError, match="^data must be int8"):
        ref.weight_code_sum(np.zeros((1, 4), np.uint8))


@pytest.mark.parametrize("spelling", ["int8", np.int8, np.dtype(np.int8)])
def test_weight_scheme(spelling):
    assert ref.weight_scheme(spelling) == "int8"
    d, s, _ = ref.quantize_weight(np.ones((2, 3), np.float32), spelling, group_size=None)
    assert d.tolist() == [[127] * 3] * 2


W = np.ones((4, 6), np.float32)
REF_ERRORS = {  # id: (call, exception, the message's start)
    "default-group": (lambda: ref.quantize_weight(W, "int8"), ValueError, "dtype='int8'"),
    "g64": (lambda: ref.quantize_weight(W, "int8", group_size=64), ValueError, "group_size=64"),
    "g128": (lambda: ref.quantize_weight(W, "int8", group_size=128), ValueError, "group_size=128"),
    "block": (lambda: ref.quantize_weight(W, "int8", block_size=(128, 128)), ValueError, "block_size"),
    "block-none-group": (
        lambda: ref.quantize_weight(W, "int8", group_size=None, block_size=(128, 128)),
        ValueError,
        "block_size",
    ),
    "asym": (lambda: ref.quantize_weight(W, "int8", group_size=None, symmetric=False), ValueError, "symmetric"),
    "K0": (lambda: ref.quantize_weight(np.ones((4, 0), np.float32), "int8", group_size=None), ValueError, "w's K"),
    "1d": (lambda: ref.quantize_weight(np.ones(6, np.float32), "int8", group_size=None), ValueError, "w must be 2-D"),
    "int32": (lambda: ref.quantize_weight(W.astype(np.int32), "int8", group_size=None), TypeError, "w must be"),
    "deq-zeros": (
        lambda: ref.dequantize_weight(W.astype(np.int8), W[:, :1], W, dtype="int8"),
        ValueError,
        "symmetric=False: int8 weights have no zero points",
    ),
    "deq-K": (lambda: ref.dequantize_weight(W.astype(np.int8), W[:, :1], dtype="int8", K=4), ValueError, "int8"),
    "deq-uint8": (lambda: ref.dequantize_weight(W.astype(np.uint8), W[:, :1], dtype="int8"), ValueError, "data"),
    "deq-scales": (lambda: ref.dequantize_weight(W.astype(np.int8), W[:, :2], dtype="int8"), ValueError, "scales"),
    "deq-scale-dtype": (
        lambda: ref.dequantize_weight(W.astype(np.int8), W[:, :1].astype(np.float64), dtype="int8"),
        TypeError,
        "scales",
    ),
}


@pytest.mark.parametrize("case", REF_ERRORS)
def test_reference_errors(case):
    call, exc, start = REF_ERRORS[case]
    with pytest.raises(exc, match="^" + start.replace("(", r"\(").replace("^", r"\^")):
        call()


def test_option_errors_come_before_the_input_checks():
    """The options are checked before ``w`` or ``data`` is looked at (a NumPy array here)."""
    w = np.ones((4, 6), np.float32)
    with pytest.raises(ValueError, match="^dtype='int8'.*group_size=None"):
        cq.quantize_weight(w, "int8")
    with pytest.raises(ValueError, match="^group_size=32"):
        cq.quantize_weight(w, "int8", group_size=32)
    with pytest.raises(ValueError, match="^block_size"):
        cq.quantize_weight(w, "int8", group_size=None, block_size=(128, 128))
    with pytest.raises(ValueError, match="^symmetric=False"):
        cq.quantize_weight(w, "int8", group_size=None, symmetric=False)
    with pytest.raises(TypeError, match="^w must be a cupy.ndarray"):
        cq.quantize_weight(w, "int8", group_size=None)
    f = cq.QuantizedWeight.from_checkpoint
    d, s = np.zeros((4, 6), np.int8), np.ones(4, np.float32)
    with pytest.raises(ValueError, match=r"^block_size=\(128, 128\) is not supported for format 'int8'"):
        f(d, s, format="int8")
    with pytest.raises(ValueError, match="^block_size"):
        f(d, s, format="int8", block_size=(1, 128))
    with pytest.raises(TypeError, match="^data must be a cupy.ndarray"):
        f(d, s, format="int8", block_size=None)
    with pytest.raises(TypeError, match="^data must be a cupy.ndarray"):
        f(d, s, format=np.int8, block_size=None)


# ---------------------------------------------------------------- kernels (GPU)
cupy = pytest.importorskip("cupy")

SHAPES = [(1, 1), (1, 7), (33, 65), (127, 4097), (300, 1000), (70000, 3), (5, 100003), (0, 16)]


def _no_launch(monkeypatch):
    """Any kernel lookup fails the test: the call must raise before a launch."""

    def boom(*a, **k):
        raise AssertionError(f"a kernel was requested: {a[1:]}")

    monkeypatch.setattr(_jit, "kernel", boom)


def _check_against_reference(qw, wh, what=""):
    d, s, _ = _q(wh)
    assert_bits_equal(qw.data, d, f"codes{what}")
    assert_bits_equal(qw.scale, s, f"scales{what}")
    assert_bits_equal(qw.code_sum, ref.weight_code_sum(d), f"code sums{what}")
    return d, s


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", W_DTYPES, ids=_id)
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_quantize_bit_exact(shape, dtype):
    wh = heavy_tailed(shape, hash(shape) % 1000, dtype)
    if wh.size:
        wh[0, :: max(1, shape[1] // 5)] = np.array(np.inf, np.float32).astype(dtype)
        wh[-1, 0] = np.array(np.nan, np.float32).astype(dtype)
        wh[shape[0] // 2] = 0  # a zero row
    qw = cq.quantize_weight(cupy.asarray(wh), "int8", group_size=None)
    d, s = _check_against_reference(qw, wh)
    sc = qw.scheme
    assert (sc.format, sc.granularity, sc.block, sc.scale_dtype, sc.scale_layout) == (
        "int8",
        "channel",
        (shape[1],),
        dtype.name,
        "row",
    )
    assert qw.data.dtype == np.int8 and qw.data.shape == shape and qw.scale.shape == (shape[0], 1)
    assert qw.code_sum.dtype == np.int32 and qw.code_sum.shape == (shape[0],)
    assert qw.zero_point is None and qw.group_size is None and qw.block_size is None
    assert qw.shape == shape and qw.dtype == dtype
    for out_dtype in W_DTYPES:
        want = ref.dequantize_weight(d, s, dtype="int8", out_dtype=out_dtype)
        out = poisoned(shape, out_dtype)
        y = qw.dequantize(out_dtype, out=out)
        assert y is out
        assert_bits_equal(y, want, f"dequantized to {_id(out_dtype)}")
    assert_bits_equal(cq.dequantize(qw), ref.dequantize_weight(d, s, dtype="int8", out_dtype=dtype))
    assert_bits_equal(cq.dequantize_weight(qw), ref.dequantize_weight(d, s, dtype="int8", out_dtype=dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", W_DTYPES, ids=_id)
@pytest.mark.parametrize("K", [40, 41])
def test_special_values(dtype, K):
    wh = _special_rows(dtype, K)
    qw = cq.quantize_weight(cupy.asarray(wh), np.int8, group_size=None)
    d, s = _check_against_reference(qw, wh)
    md, ms, msum = _model(wh)
    assert_bits_equal(qw.data, md, "codes against the model")
    assert_bits_equal(qw.scale, ms, "scales against the model")
    assert cupy.asnumpy(qw.code_sum).tolist() == msum.tolist()
    for out_dtype in W_DTYPES:
        want = ref.dequantize_weight(d, s, dtype="int8", out_dtype=out_dtype)
        assert_bits_equal(qw.dequantize(out_dtype), want, f"dequantized to {_id(out_dtype)}")


@pytest.mark.gpu
def test_container():
    wh = heavy_tailed((37, 99), 5, BF16)
    qw = cq.quantize_weight(cupy.asarray(wh), "int8", group_size=None)
    cqw.container.check_weight(qw)
    assert qw.plain() is qw
    assert qw.nbytes == 37 * 99 + 37 * 2 + 37 * 4
    r = repr(qw)
    assert "int8" in r and "per-channel" in r and "code sums int32" in r and f"{qw.nbytes} bytes" in r
    c = qw.copy()
    assert c.scheme == qw.scheme and c.code_sum.data.ptr != qw.code_sum.data.ptr
    for a, b in ((c.data, qw.data), (c.scale, qw.scale), (c.code_sum, qw.code_sum)):
        assert_bits_equal(a, b)
    h = qw.to_host()
    d, s, _ = _q(wh)
    assert h["codes"].dtype == np.int8 and h["data"].dtype == np.int8 and h["zero_point"] is None
    assert_bits_equal(h["codes"], d)
    assert_bits_equal(h["scale"], s)
    assert h["code_sum"].dtype == np.int32 and h["code_sum"].tolist() == ref.weight_code_sum(d).tolist()
    # other formats have none
    q4 = cq.quantize_weight(cupy.asarray(heavy_tailed((16, 128), 1, BF16)), "int4", group_size=128)
    assert q4.code_sum is None and q4.to_host()["code_sum"] is None and "code sums" not in repr(q4)
    assert q4.copy().code_sum is None and q4.prepare().code_sum is None
    # made directly without code_sum: computed from the data
    scheme = cqw.formats.weight_scheme("int8", None, 99, BF16)
    w = cq.QuantizedWeight(qw.data, qw.scale, None, scheme, (37, 99), BF16)
    assert w.scheme == qw.scheme
    assert_bits_equal(w.code_sum, qw.code_sum, "computed code sums")
    cqw.container.check_weight(w)
    given = cupy.zeros(37, np.int32)
    assert cq.QuantizedWeight(qw.data, qw.scale, None, scheme, (37, 99), BF16, code_sum=given).code_sum is given


@pytest.mark.gpu
def test_check_weight_rules():
    qw = cq.quantize_weight(cupy.asarray(heavy_tailed((8, 33), 2, np.float16)), "int8", group_size=None)
    check = cqw.container.check_weight

    def bad(**attrs):
        c = qw.copy()
        for k, v in attrs.items():
            setattr(c, k, v)
        return c

    cases = [
        (bad(code_sum=None), ValueError, "^w.code_sum must be the int32 code sums"),
        (bad(code_sum=qw.code_sum.astype(np.int64)), ValueError, "^w.code_sum must be int32"),
        (bad(code_sum=qw.code_sum[:4]), ValueError, "^w.code_sum must be int32 of shape"),
        (bad(code_sum=cupy.asnumpy(qw.code_sum)), TypeError, "^w.code_sum must be a cupy.ndarray"),
        (bad(data=qw.data.view(np.uint8)), ValueError, "^w.data must be int8"),
        (bad(scale=qw.scale.reshape(-1)), ValueError, r"^w.scale must have shape \(8, 1\)"),
        (bad(zero_point=cupy.zeros((8, 1), np.uint8)), ValueError, "^w.zero_point must be None"),
    ]
    for w, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            check(w)
        with pytest.raises(exc, match=msg):
            w.dequantize()
    q4 = cq.quantize_weight(cupy.asarray(heavy_tailed((8, 64), 2, np.float16)), "int4", group_size=32)
    q4.code_sum = cupy.zeros(8, np.int32)
    with pytest.raises(ValueError, match="^w.code_sum must be None for int4 weights"):
        check(q4)
    prepared = cq.QuantizedWeight(qw.data, qw.scale, None, qw.scheme, (8, 33), np.float16, data_layout="prepared")
    with pytest.raises(ValueError, match="data_layout must be 'plain' for int8 weights"):
        check(prepared)


@pytest.mark.gpu
def test_refusals(monkeypatch):
    dtype = np.float16
    qw = cq.quantize_weight(cupy.asarray(heavy_tailed((64, 128), 3, dtype)), "int8", group_size=None)
    a = cupy.ones((4, 128), dtype)
    out = poisoned((4, 64), dtype)
    before = cupy.asnumpy(out)
    _no_launch(monkeypatch)
    for call in (
        lambda: cq.matmul(a, qw, out=out),
        lambda: cq.matmul(a, qw),
        lambda: cqw.matmul_path(4, qw),
        lambda: cqw.matmul_path(4096, qw, arch="90", sms=132),
    ):
        with pytest.raises(ValueError, match="^w is an int8 .*cupyquant.scaled_matmul with INT8 activations"):
            call()
    for call in (lambda: cq.prepare_weight(qw), qw.prepare):
        with pytest.raises(ValueError, match="^w is an int8 .*no prepared layout.*scaled_matmul with INT8 activations"):
            call()
    assert_bits_equal(out, before, "out changed by a refused call")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", W_DTYPES, ids=_id)
def test_from_checkpoint(dtype):
    wh = heavy_tailed((200, 271), 4, dtype)
    qw = cq.quantize_weight(cupy.asarray(wh), "int8", group_size=None)
    for s in (qw.scale, qw.scale.reshape(-1)):
        cw = cq.QuantizedWeight.from_checkpoint(qw.data, s, format="int8", block_size=None, dtype=dtype)
        assert cw.scheme == qw.scheme and cw.shape == qw.shape and cw.dtype == dtype
        assert cw.data is qw.data and cw.scale.shape == (200, 1)  # the codes are not copied
        assert cw.code_sum is not qw.code_sum
        assert_bits_equal(cw.code_sum, qw.code_sum, "code sums")
        assert_bits_equal(cw.dequantize(), qw.dequantize(), "dequantized")
    # compressed-tensors' float32 (or bfloat16) weight_scale, kept as it is; float64 where exact
    rng = np.random.default_rng(7)
    d = rng.integers(-128, 128, (129, 100003)).astype(np.int8)
    d[3] = -128
    d[4] = 127
    s32 = (rng.standard_normal(129) * np.float32(1 / 3)).astype(np.float32)
    for sd in (np.float32, BF16, np.float64):
        s = s32.astype(sd)
        cw = cq.QuantizedWeight.from_checkpoint(cupy.asarray(d), cupy.asarray(s), format="int8", block_size=None)
        held = s.astype(np.float32) if sd == np.float64 else s
        assert cw.scheme.scale_dtype == np.dtype(held.dtype).name and cw.dtype == BF16
        assert_bits_equal(cw.scale, held.reshape(-1, 1), f"scales from {_id(sd)}")
        assert_bits_equal(cw.code_sum, ref.weight_code_sum(d), "code sums")
        for out_dtype in W_DTYPES:
            out = poisoned(d.shape, out_dtype)
            want = ref.dequantize_weight(d, held.reshape(-1, 1), dtype="int8", out_dtype=out_dtype)
            assert_bits_equal(cw.dequantize(out_dtype, out=out), want, f"dequantized to {_id(out_dtype)}")
    empty = cq.QuantizedWeight.from_checkpoint(
        cupy.zeros((0, 5), np.int8), cupy.zeros(0, np.float32), format="int8", block_size=None
    )
    assert empty.code_sum.shape == (0,) and empty.dequantize().shape == (0, 5)


@pytest.mark.gpu
def test_from_checkpoint_errors(monkeypatch):
    f = cq.QuantizedWeight.from_checkpoint
    d = cupy.zeros((200, 271), np.int8)
    s = cupy.ones((200, 1), np.float32)
    _no_launch(monkeypatch)
    cases = [
        (lambda: f(d, s, format="int8"), ValueError, r"^block_size=\(128, 128\) is not supported for format 'int8'"),
        (lambda: f(d, s, format="int8", block_size=(1, 271)), ValueError, "^block_size"),
        (lambda: f(d.view(np.uint8), s, format="int8", block_size=None), TypeError, "^data must be int8"),
        (lambda: f(d, s, block_size=None), TypeError, "^data must be uint8"),  # FP8 wants uint8 codes
        (lambda: f(d[:, ::2], s, format="int8", block_size=None), ValueError, "^data must be C-contiguous"),
        (lambda: f(d.reshape(-1), s, format="int8", block_size=None), ValueError, "^data must be 2-D"),
        (
            lambda: f(cupy.zeros((200, 0), np.int8), s, format="int8", block_size=None),
            ValueError,
            "^data's K must be nonzero",
        ),
        (lambda: f(d, s[:100], format="int8", block_size=None), ValueError, r"^scale must have shape \(200,\)"),
        (lambda: f(d, s.astype(np.int32), format="int8", block_size=None), TypeError, "^scale must be float32"),
        (lambda: f(d, cupy.asnumpy(s), format="int8", block_size=None), TypeError, "^scale must be a cupy.ndarray"),
        (
            lambda: f(d, cupy.full((200, 1), 0.1, np.float64), format="int8", block_size=None),
            ValueError,
            "^scale of dtype float64",
        ),
        (lambda: f(d, s, format="int8", block_size=None, dtype="int8"), TypeError, "^dtype"),
        (lambda: f(d, s, format="int16", block_size=None), ValueError, "^format must be one of"),
    ]
    for call, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            call()
    big = cupy.zeros((1, _checks.INT8_WEIGHT_MAX_K + 1), np.int8)
    with pytest.raises(ValueError, match=r"^data's K = 16777217 must be at most 2\^24"):
        f(big, cupy.ones(1, np.float32), format="int8", block_size=None)


@pytest.mark.gpu
def test_quantize_errors(monkeypatch):
    w = cupy.asarray(np.ones((16, 64), BF16))
    _no_launch(monkeypatch)
    cases = [
        (lambda: cq.quantize_weight(w, "int8"), ValueError, "^dtype='int8'"),
        (lambda: cq.quantize_weight(w, "int8", group_size=64), ValueError, "^group_size=64"),
        (lambda: cq.quantize_weight(w, "int8", group_size=None, block_size=(128, 128)), ValueError, "^block_size"),
        (lambda: cq.quantize_weight(w, "int8", group_size=None, symmetric=False), ValueError, "^symmetric"),
        (lambda: cq.quantize_weight(w[:, ::2], "int8", group_size=None), ValueError, "^w must be C-contiguous"),
        (lambda: cq.quantize_weight(w[0], "int8", group_size=None), ValueError, "^w must be 2-D"),
        (
            lambda: cq.quantize_weight(cupy.zeros((16, 0), BF16), "int8", group_size=None),
            ValueError,
            "^w's K must be nonzero",
        ),
        (lambda: cq.quantize_weight(w.astype(np.int32), "int8", group_size=None), TypeError, "^w must be"),
        (lambda: cq.quantize_weight(w.astype(np.float64), "int8", group_size=None), TypeError, "^w must be"),
        (lambda: cq.quantize_weight(cupy.asnumpy(w), "int8", group_size=None), TypeError, "^w must be a cupy"),
    ]
    for call, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            call()
    big = cupy.zeros((1, _checks.INT8_WEIGHT_MAX_K + 1), np.float16)
    with pytest.raises(ValueError, match=r"^w's K = 16777217 must be at most 2\^24"):
        cq.quantize_weight(big, "int8", group_size=None)


@pytest.mark.gpu
def test_dequantize_errors(monkeypatch):
    qw = cq.quantize_weight(cupy.asarray(heavy_tailed((16, 33), 6, BF16)), "int8", group_size=None)
    out = poisoned((16, 33), BF16)
    before = cupy.asnumpy(out)
    _no_launch(monkeypatch)
    cases = [
        (lambda: qw.dequantize(out=poisoned((16, 34), BF16)), ValueError, "^out must have shape"),
        (lambda: qw.dequantize(np.float16, out=out), TypeError, "^out must"),
        (lambda: qw.dequantize("int8"), TypeError, "^out_dtype"),
        (lambda: qw.dequantize(out=cupy.asnumpy(out)), TypeError, "^out must be a cupy.ndarray"),
        (lambda: cq.dequantize_weight(qw.data), TypeError, "^w must be a QuantizedWeight"),
    ]
    for call, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            call()
    assert_bits_equal(out, before, "out changed by a failed call")


@pytest.mark.gpu
def test_cuda_graph_capture():
    """quantize_weight and from_checkpoint for int8 once compiled, captured and replayed on new
    inputs: the codes, scales and code sums equal an eager call."""
    w = cupy.asarray(heavy_tailed((67, 301), 8, np.float16))
    stream = side_stream()

    def op():
        qw = cq.quantize_weight(w, "int8", group_size=None)
        cw = cq.QuantizedWeight.from_checkpoint(qw.data, qw.scale, format="int8", block_size=None)
        return qw, cw

    with stream:
        op()
        stream.synchronize()
        stream.begin_capture()
        qw, cw = op()
        graph = stream.end_capture()
        w[...] = cupy.asarray(heavy_tailed((67, 301), 9, np.float16))
        for a in (qw.data, qw.scale, qw.code_sum, cw.code_sum):
            a.fill(-1)
        graph.launch(stream)
        stream.synchronize()
    wh = cupy.asnumpy(w)
    _check_against_reference(qw, wh, " (graph replay)")
    assert_bits_equal(cw.code_sum, qw.code_sum, "checkpoint code sums (graph replay)")
