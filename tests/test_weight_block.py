"""FP8 weights in 128 x 128 blocks with float32 scales (``quantize_weight(..., block_size=(128, 128))``)
and ``QuantizedWeight.from_checkpoint``: the NumPy reference against hand-worked values and an
independent per-block model, argument validation (CPU); the kernels' bytes and scales bit-exact with
the reference, dequantization, checkpoint round trips and the GPU-side errors (GPU tests)."""

from __future__ import annotations

import inspect

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_bits_equal, poisoned

import cupyquant as cq
from cupyquant import _checks
from cupyquant import reference as ref
from cupyquant import weight as cqw

E4M3 = "float8_e4m3fn"
BLOCK = (128, 128)
BF16 = np.dtype(ml_dtypes.bfloat16)
W_DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BF16]


def _id(v):
    return np.dtype(v).name


def _q(w):
    return ref.quantize_weight(w, E4M3, block_size=BLOCK)


def _rand(shape, seed, dtype):
    """Normal values whose magnitude varies by row and column over 2^-8..2^8, so that the blocks'
    amax differ."""
    rng = np.random.default_rng(seed)
    N, K = shape
    v = rng.standard_normal(shape) * 2.0 ** rng.uniform(-4, 4, (N, 1)) * 2.0 ** rng.uniform(-4, 4, (1, K))
    return v.astype(np.float32).astype(dtype)


def _model(w):
    """The block formula written block by block with float64 steps rounded to float32 (one IEEE
    float32 division each), independent of the reference's padding and reshapes."""
    w = np.asarray(w).astype(np.float32)
    N, K = w.shape
    nb, kb = -(-N // 128), -(-K // 128)
    s = np.zeros((nb, kb), np.float32)
    q = np.zeros((N, K), np.uint8)
    for i in range(nb):
        for j in range(kb):
            b = w[128 * i : 128 * i + 128, 128 * j : 128 * j + 128].astype(np.float64)
            fin = b[np.isfinite(b)]
            amax = np.abs(fin).max() if fin.size else 0.0
            sb = np.float32(amax / 448.0)
            s[i, j] = sb
            if sb == 0:
                continue
            v = np.float32(b / np.float64(sb))  # a float32 division (53 >= 2 * 24 + 2)
            v = np.where(np.isnan(b), 0, np.clip(v, -448, 448)).astype(np.float32)
            codes = v.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
            q[128 * i : 128 * i + 128, 128 * j : 128 * j + 128] = np.where(np.isnan(b), 0, codes)
    return q, s


# ---------------------------------------------------------------- reference, hand-worked (CPU)
def test_block_amax_hand_worked():
    w = np.ones((128, 128), np.float32)
    w[3, 5] = 896.0  # amax 896: s = 2
    w[100, 7] = -896.0
    d, s, z = _q(w)
    assert z is None and s.dtype == np.float32 and s.shape == (1, 1) and s[0, 0] == 2.0
    assert d.dtype == np.uint8 and d.shape == (128, 128)
    assert d[3, 5] == 0x7E and d[100, 7] == 0xFE  # +-448
    assert d[0, 0] == 0x30  # 1 / 2 = 0.5: exponent 6, mantissa 0


def test_partial_edge_blocks_hand_worked():
    N, K = 200, 272  # blocks of rows 0..127, 128..199 by columns 0..127, 128..255, 256..271
    w = np.zeros((N, K), np.float32)
    w[0, 0] = 448.0  # s = 1
    w[127, 255] = -7.0  # s = 2^-6
    w[199, 271] = 3.5  # the corner block of 72 x 16: s = 2^-7
    w[150, 0] = 0.875  # s = 2^-9
    d, s, _ = _q(w)
    want = np.array([[1.0, 2.0**-6, 0.0], [2.0**-9, 0.0, 2.0**-7]], np.float32)
    assert s.shape == (2, 3)
    np.testing.assert_array_equal(s, want)
    assert d[0, 0] == 0x7E and d[127, 255] == 0xFE and d[199, 271] == 0x7E and d[150, 0] == 0x7E
    assert np.count_nonzero(d) == 4  # the zeros and the zero blocks give 0x00


def test_zero_block_and_nonfinite():
    w = np.zeros((128, 256), np.float32)
    w[0, 0], w[0, 1], w[0, 2], w[0, 3] = np.inf, -np.inf, np.nan, 1.0  # block 0: amax 1 (inf, NaN ignored)
    w[5, 200] = np.inf  # block 1: no finite nonzero weight: s = 0, every code 0x00 (inf too)
    w[6, 201] = np.nan
    d, s, _ = _q(w)
    assert s[0, 0] == np.float32(np.float32(1) / np.float32(448)) and s[0, 1] == 0
    assert d[0, 0] == 0x7E and d[0, 1] == 0xFE and d[0, 2] == 0x00 and d[0, 3] == 0x7E
    assert d[:, 128:].max() == 0


@pytest.mark.parametrize("dtype", W_DTYPES, ids=_id)
def test_max_finite_and_underflow(dtype):
    big = float(ml_dtypes.finfo(dtype).max)
    w = np.zeros((130, 130), np.float32)
    w[0, 0] = big
    w[0, 1] = -big / 2
    w[129, 129] = float(ml_dtypes.finfo(dtype).smallest_subnormal)
    wd = w.astype(dtype)
    d, s, _ = _q(wd)
    assert s[0, 0] == np.float32(np.float32(big) / np.float32(448))
    assert d[0, 0] == 0x7E and d[0, 1] == 0xF6  # -224: exponent 14, mantissa 6 / 8 -> 1.75 * 128
    sub = np.float32(np.float32(w[129, 129]) / np.float32(448))  # 2^-24 / 448, 2^-133 / 448 or 2^-149 / 448
    assert s[1, 1] == sub
    if dtype == np.float32:
        assert s[1, 1] == 0 and d[129, 129] == 0  # the quotient underflows: s = 0, code 0x00
    else:
        assert s[1, 1] > 0 and d[129, 129] == 0x7E


@pytest.mark.parametrize("dtype", W_DTYPES, ids=_id)
@pytest.mark.parametrize("shape", [(128, 128), (200, 272), (1, 7), (257, 129), (0, 16)])
def test_matches_block_model(shape, dtype):
    w = _rand(shape, sum(shape), dtype)
    if w.size:
        w.reshape(-1)[:: max(1, w.size // 7)] = np.array(np.inf, np.float32).astype(dtype)
        w[0, -1] = np.array(np.nan, np.float32).astype(dtype)
    d, s, _ = _q(w)
    md, ms = _model(w)
    assert_bits_equal(s, ms, "scales")
    assert_bits_equal(d, md, "codes")


@pytest.mark.parametrize("out_dtype", W_DTYPES, ids=_id)
def test_dequantize_blocks(out_dtype):
    w = _rand((200, 272), 5, np.float32)
    d, s, _ = _q(w)
    s = (s * np.float32(1 / 3)).astype(np.float32)  # scales whose products with the codes round
    y = ref.dequantize_weight(d, s, dtype=E4M3, out_dtype=out_dtype, block_size=BLOCK)
    sf = np.repeat(np.repeat(s, 128, 0), 128, 1)[:200, :272].astype(np.float64)
    prod = np.float32(d.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * sf)  # exact, then float32
    assert_bits_equal(y, prod.astype(out_dtype), "dequantized")
    assert_bits_equal(ref.dequantize_weight_blocks(d, s, out_dtype), y, "dequantize_weight_blocks")
    # the round trip of quantize: within half an E4M3 step of each weight, relative
    d, s, _ = _q(w)
    back = ref.dequantize_weight(d, s, dtype=E4M3, block_size=BLOCK)
    sf = np.repeat(np.repeat(s, 128, 0), 128, 1)[:200, :272]
    assert (np.abs(back - w) <= np.maximum(np.abs(w) * 2.0**-4, sf * 2.0**-9) * 1.0001).all()


def test_dequantize_canonical_nan():
    d = np.array([[0x7F, 0xFF, 0x7E]], np.uint8)
    y = ref.dequantize_weight_blocks(d, np.ones((1, 1), np.float32), np.float16)
    assert y.view(np.uint16)[0, 0] == 0x7FFF and y.view(np.uint16)[0, 1] == 0x7FFF and y[0, 2] == 448


# ---------------------------------------------------------------- argument checks (CPU)
def test_block_size_arguments():
    w = np.ones((128, 128), np.float32)
    with pytest.raises(ValueError, match="exclusive"):
        ref.quantize_weight(w, E4M3, block_size=BLOCK, group_size=128)
    with pytest.raises(ValueError, match="exclusive"):
        ref.quantize_weight(w, E4M3, block_size=BLOCK, group_size=None)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        ref.quantize_weight(w, "int4", block_size=BLOCK)
    for bad in [(64, 64), (128,), 128, (128, 128.0), (True, 128), "128x128", (128, 128, 1)]:
        with pytest.raises(ValueError, match="block_size"):
            ref.quantize_weight(w, E4M3, block_size=bad)
    with pytest.raises(ValueError, match="symmetric"):
        ref.quantize_weight(w, E4M3, block_size=BLOCK, symmetric=False)
    with pytest.raises(ValueError, match="K must be nonzero"):
        ref.quantize_weight(np.ones((4, 0), np.float32), E4M3, block_size=BLOCK)
    with pytest.raises(ValueError, match="2-D"):
        ref.quantize_weight(np.ones(128, np.float32), E4M3, block_size=BLOCK)
    with pytest.raises(TypeError, match="w must be"):
        ref.quantize_weight(np.ones((4, 4), np.int32), E4M3, block_size=BLOCK)
    assert ref.quantize_weight(w, E4M3, block_size=[128, 128])[1].shape == (1, 1)  # a list is fine
    # the default group size is 128 and still selectable on its own
    a, b = ref.quantize_weight(w, E4M3), ref.quantize_weight(w, E4M3, group_size=128)
    assert_bits_equal(a[0], b[0])
    assert_bits_equal(a[1], b[1])
    assert _checks.DEFAULT_GROUP_SIZE == 128 and repr(_checks.DEFAULT_GROUP_SIZE) == "128"
    sig = inspect.signature(cq.quantize_weight)
    assert str(sig.parameters["group_size"]) == "group_size=128" and sig.parameters["block_size"].default is None


def test_dequantize_blocks_arguments():
    d = np.zeros((200, 272), np.uint8)
    with pytest.raises(ValueError, match=r"\(2, 3\)"):
        ref.dequantize_weight(d, np.ones((2, 2), np.float32), dtype=E4M3, block_size=BLOCK)
    with pytest.raises(ValueError, match="float32"):
        ref.dequantize_weight(d, np.ones((2, 3), np.float16), dtype=E4M3, block_size=BLOCK)
    with pytest.raises(ValueError, match="neither zeros nor K"):
        ref.dequantize_weight(d, np.ones((2, 3), np.float32), dtype=E4M3, K=256, block_size=BLOCK)


def test_from_checkpoint_arguments_cpu():
    """The checks made before any CuPy array is touched."""
    d = np.zeros((128, 128), np.uint8)
    s = np.ones((1, 1), np.float32)
    f = cq.QuantizedWeight.from_checkpoint
    with pytest.raises(ValueError, match="scale_2 or global_scale must be given"):
        f(d, s, format="nvfp4")
    with pytest.raises(TypeError, match="data must be a cupy.ndarray"):
        f(d, s, format="mxfp4")
    with pytest.raises(ValueError, match="format must be one of"):
        f(d, s, format="float8_e5m2")
    with pytest.raises(TypeError, match="format"):
        f(d, s, format=3)
    with pytest.raises(TypeError, match="dtype"):
        f(d, s, dtype=np.int32)
    with pytest.raises(TypeError, match="data must be a cupy.ndarray"):
        f(d, s)
    with pytest.raises(TypeError, match="data must be a cupy.ndarray"):
        f(d, s, format=ml_dtypes.float8_e4m3fn)


# ---------------------------------------------------------------- kernels (GPU)
cupy = pytest.importorskip("cupy")

SHAPES = [(n, k) for n in (128, 200, 2112) for k in (128, 272, 7168)] + [(1, 16), (70000, 16), (0, 272)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", W_DTYPES, ids=_id)
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_quantize_blocks_bit_exact(shape, dtype):
    wh = _rand(shape, hash(shape) % 1000, dtype)
    if wh.size:
        wh[-1, -1] = 0  # keep at least one value that is not special
        wh[0, :: max(1, shape[1] // 5)] = np.array(np.inf, np.float32).astype(dtype)
        wh[min(1, shape[0] - 1), 0] = np.array(np.nan, np.float32).astype(dtype)
    qw = cq.quantize_weight(cupy.asarray(wh), E4M3, block_size=BLOCK)
    d, s, _ = _q(wh)
    assert_bits_equal(qw.data, d, "codes")
    assert_bits_equal(qw.scale, s, "scales")
    sc = qw.scheme
    assert (sc.format, sc.granularity, sc.block, sc.scale_dtype, sc.scale_layout) == (
        E4M3,
        "block",
        BLOCK,
        "float32",
        "row",
    )
    assert qw.block_size == BLOCK and qw.zero_point is None and qw.shape == shape and qw.dtype == dtype
    assert qw.scale.dtype == np.float32 and qw.scale.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    for out_dtype in W_DTYPES:
        want = ref.dequantize_weight(d, s, dtype=E4M3, out_dtype=out_dtype, block_size=BLOCK)
        out = poisoned(shape, out_dtype)
        y = qw.dequantize(out_dtype, out=out)
        assert y is out
        assert_bits_equal(y, want, f"dequantized to {_id(out_dtype)}")
    assert_bits_equal(cq.dequantize(qw), ref.dequantize_weight(d, s, dtype=E4M3, out_dtype=dtype, block_size=BLOCK))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", W_DTYPES, ids=_id)
def test_quantize_blocks_special_values(dtype):
    info = ml_dtypes.finfo(dtype)
    w = np.zeros((300, 400), np.float32)
    w[:128, :128] = np.random.default_rng(1).standard_normal((128, 128))
    w[0, 0], w[0, 1], w[0, 2] = np.inf, -np.inf, np.nan
    w[130, 130] = float(info.max)  # a lone max-finite
    w[131, 131] = -float(info.max)
    w[200, 300] = np.inf  # a block of zeros and inf: s = 0
    w[299, 399] = float(info.smallest_subnormal)  # a subnormal amax
    w[5, 260:270] = float(info.smallest_normal) * np.arange(10)
    wh = w.astype(dtype)
    qw = cq.quantize_weight(cupy.asarray(wh), E4M3, block_size=BLOCK)
    d, s, _ = _q(wh)
    assert_bits_equal(qw.data, d, "codes")
    assert_bits_equal(qw.scale, s, "scales")
    md, ms = _model(wh)
    assert_bits_equal(qw.data, md, "codes against the model")
    assert_bits_equal(qw.scale, ms, "scales against the model")
    y = qw.dequantize(np.float32)
    assert_bits_equal(y, ref.dequantize_weight(d, s, dtype=E4M3, block_size=BLOCK), "dequantized")


@pytest.mark.gpu
def test_block_weight_container():
    wh = _rand((200, 320), 3, BF16)
    qw = cq.quantize_weight(cupy.asarray(wh), E4M3, block_size=BLOCK)
    cqw.container.check_weight(qw)
    assert qw.plain() is qw and qw.group_size == 128
    c = qw.copy()
    assert c.scheme == qw.scheme and c.data.data.ptr != qw.data.data.ptr
    assert_bits_equal(c.data, qw.data)
    assert_bits_equal(c.scale, qw.scale)
    h = qw.to_host()
    assert h["codes"].dtype == ml_dtypes.float8_e4m3fn and h["zero_point"] is None and h["scale"].dtype == np.float32
    assert "block_size=(128, 128)" in repr(qw) and "float32" in repr(qw)
    assert qw.nbytes == 200 * 320 + 2 * 3 * 4
    # the weight-only matmul takes it (tests/test_weight_fp8_block_matmul.py), prepared or plain
    a = cupy.ones((4, 320), BF16)
    assert cqw.matmul_path(4, qw) == "decode"
    qp = cq.prepare_weight(qw)
    assert qp.data_layout == "prepared" and qp.block_size == BLOCK and qp.scale.dtype == np.float32
    assert_bits_equal(qp.plain().scale, qw.scale)
    assert_bits_equal(cq.matmul(a, qp), cq.matmul(a, qw))
    bad = qw.copy()
    bad.scale = bad.scale.astype(cupy.float16)
    with pytest.raises(ValueError, match="w.scale must be float32"):
        bad.dequantize()
    bad = qw.copy()
    bad.scale = bad.scale[:1]
    with pytest.raises(ValueError, match=r"\(2, 3\)"):
        bad.dequantize()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", W_DTYPES, ids=_id)
def test_from_checkpoint_round_trip(dtype):
    wh = _rand((200, 272), 4, dtype)
    w = cupy.asarray(wh)
    qw = cq.quantize_weight(w, E4M3, block_size=BLOCK)
    cw = cq.QuantizedWeight.from_checkpoint(qw.data, qw.scale, dtype=dtype)
    assert cw.scheme == qw.scheme and cw.shape == qw.shape and cw.dtype == qw.dtype and cw.block_size == BLOCK
    assert cw.data is qw.data  # the codes are not copied
    assert_bits_equal(cw.dequantize(), qw.dequantize(), "dequantized")
    # bf16 and f16 scales convert exactly to float32; float64 where exact
    for sd in (BF16, np.float16, np.float64):
        s = qw.scale.astype(sd)
        cs = cq.QuantizedWeight.from_checkpoint(qw.data, s, dtype=dtype)
        assert cs.scale.dtype == np.float32
        assert_bits_equal(cs.scale, cupy.asnumpy(s).astype(np.float32), f"scales from {_id(sd)}")
    # groups of 128 along K and one scale per channel: the weights of quantize_weight
    wk = cupy.asarray(_rand((200, 256), 5, dtype))
    for g, bs in ((128, (1, 128)), (64, (1, 64)), (None, None)):
        qg = cq.quantize_weight(wk, E4M3, group_size=g)
        scales = [qg.scale] if g is not None else [qg.scale, qg.scale.reshape(-1)]
        for s in scales:
            cg = cq.QuantizedWeight.from_checkpoint(qg.data, s, block_size=bs, dtype=dtype)
            assert cg.scheme == qg.scheme and cg.group_size == g and cg.block_size is None
            assert cg.scale.shape == qg.scale.shape
            assert_bits_equal(cg.dequantize(), qg.dequantize(), f"group_size={g}")
    # float32 group scales are kept as float32 (the W8A8 checkpoints' per-channel weight_scale)
    s32 = cupy.full((200, 1), 0.5, np.float32)
    cg = cq.QuantizedWeight.from_checkpoint(qg.data, s32, block_size=None, dtype=dtype)
    assert cg.scheme.scale_dtype == "float32" and cg.scheme.granularity == "channel" and cg.dtype == dtype
    want = ref.dequantize_weight(cupy.asnumpy(qg.data), cupy.asnumpy(s32), dtype=E4M3, out_dtype=dtype)
    assert_bits_equal(cg.dequantize(), want, "float32 channel scales")


@pytest.mark.gpu
def test_from_checkpoint_errors():
    f = cq.QuantizedWeight.from_checkpoint
    d = cupy.zeros((200, 272), np.uint8)
    s = cupy.ones((2, 3), np.float32)
    f(d, s)  # fine
    with pytest.raises(TypeError, match="data must be uint8"):
        f(d.view(np.int8), s)
    with pytest.raises(TypeError, match="data must be uint8"):
        f(d.astype(np.float32), s)
    with pytest.raises(ValueError, match="data must be 2-D"):
        f(d.reshape(200, 272, 1), s)
    with pytest.raises(ValueError, match="data must be C-contiguous"):
        f(cupy.zeros((272, 200), np.uint8).T, s)
    with pytest.raises(ValueError, match="data's K must be nonzero"):
        f(cupy.zeros((4, 0), np.uint8), cupy.ones((1, 0), np.float32))
    with pytest.raises(TypeError, match="scale must be a cupy.ndarray"):
        f(d, cupy.asnumpy(s))
    with pytest.raises(TypeError, match="scale must be float32"):
        f(d, s.astype(np.int32))
    with pytest.raises(ValueError, match=r"scale must have shape \(2, 3\)"):
        f(d, cupy.ones((200, 3), np.float32))
    with pytest.raises(ValueError, match="cannot hold exactly"):
        f(d, cupy.full((2, 3), 0.1, np.float64))
    with pytest.raises(ValueError, match="cannot hold exactly"):
        f(d, cupy.full((2, 3), 1e300, np.float64))
    nan = f(d, cupy.full((2, 3), np.nan, np.float64))  # NaN converts to NaN
    assert nan.scale.dtype == np.float32
    with pytest.raises(ValueError, match="block_size must be"):
        f(d, s, block_size=(64, 64))
    with pytest.raises(ValueError, match="block_size must be"):
        f(d, s, block_size=(1, 48))
    with pytest.raises(ValueError, match="groups of 128 must divide"):
        f(d, cupy.ones((200, 2), np.float32), block_size=(1, 128))
    with pytest.raises(ValueError, match=r"scale must have shape \(200,\) or \(200, 1\)"):
        f(d, cupy.ones((200, 2), np.float32), block_size=None)
    with pytest.raises(ValueError, match="data's K = 3 must be even"):
        f(cupy.zeros((4, 3), np.uint8), cupy.ones(4, np.float32), block_size=None)
    with pytest.raises(TypeError, match="scale must be uint8 or float8_e4m3fn"):
        f(d, s, format="nvfp4", scale_2=1.0)
    with pytest.raises(TypeError, match="dtype"):
        f(d, s, dtype="int8")
    # a non-contiguous scale is held as a contiguous copy
    st = cupy.ones((3, 2), np.float32).T
    assert f(d, st).scale.flags.c_contiguous
    if cupy.cuda.runtime.getDeviceCount() > 1:
        with cupy.cuda.Device(1):
            s1 = cupy.ones((2, 3), np.float32)
        with pytest.raises(ValueError, match="scale is on device 1"):
            f(d, s1)


@pytest.mark.gpu
def test_quantize_blocks_errors():
    w = cupy.asarray(np.ones((128, 256), BF16))
    with pytest.raises(ValueError, match="exclusive"):
        cq.quantize_weight(w, E4M3, group_size=128, block_size=BLOCK)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        cq.quantize_weight(w, "int4", block_size=BLOCK)
    with pytest.raises(ValueError, match="block_size must be"):
        cq.quantize_weight(w, E4M3, block_size=(1, 128))
    with pytest.raises(ValueError, match="w must be C-contiguous"):
        cq.quantize_weight(w[:, ::2], E4M3, block_size=BLOCK)
    with pytest.raises(ValueError, match="K must be nonzero"):
        cq.quantize_weight(cupy.ones((4, 0), BF16), E4M3, block_size=BLOCK)
    with pytest.raises(TypeError, match="w must be a cupy.ndarray"):
        cq.quantize_weight(cupy.asnumpy(w), E4M3, block_size=BLOCK)
    # an odd K is fine for blocks (the groups need an even one)
    qw = cq.quantize_weight(cupy.ones((3, 5), np.float32), E4M3, block_size=BLOCK)
    assert qw.scale.shape == (1, 1) and float(qw.scale[0, 0]) == np.float32(1) / np.float32(448)
