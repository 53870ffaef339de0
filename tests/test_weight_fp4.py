"""FP4 weights (``quantize_weight(w, "nvfp4")`` / ``"mxfp4"``): the bytes of quantize_nvfp4 /
quantize_mx (dense) and of the reference, the dequantization bit-exact with the reference (every
output dtype, ``out=``, every code and scale byte), the prepared layout and its inverse,
``from_checkpoint`` (``scale_2`` or ``global_scale``), the container (``to_host``, ``copy``,
``repr``) and check_weight's rules (GPU tests; the reference's own tests are in
test_reference_weight.py)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_bits_equal, heavy_tailed, poisoned, side_stream

import cupyquant as cq
from cupyquant import _jit, _testing
from cupyquant import reference as ref
from cupyquant import weight as cqw

cupy = pytest.importorskip("cupy")

BF16 = np.dtype(ml_dtypes.bfloat16)
W_DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BF16]
FP4 = ("nvfp4", "mxfp4")
BLOCK = {"nvfp4": 16, "mxfp4": 32}
SCALE_TYPE = {"nvfp4": np.dtype(ml_dtypes.float8_e4m3fn), "mxfp4": np.dtype(ml_dtypes.float8_e8m0fnu)}
# (N, K in blocks): odd N, one block, K not a multiple of 128, N above the grid's 65535 rows
SHAPES = [(1, 1), (33, 3), (127, 17), (300, 65), (70000, 1), (5, 257)]


def _id(v):
    return np.dtype(v).name


def _shape(fmt, nk):
    return nk[0], nk[1] * BLOCK[fmt]


def _no_launch(monkeypatch):
    """Any kernel lookup fails the test: the call must raise before a launch."""

    def boom(*a, **k):
        raise AssertionError(f"a kernel was requested: {a[1:]}")

    monkeypatch.setattr(_jit, "kernel", boom)


def _u8(a):
    return cupy.asnumpy(a).view(np.uint8)


def _check_quantized(qw, wh, fmt, what=""):
    """qw's bytes against the reference and against quantize_nvfp4 / quantize_mx of the same weight;
    returns the reference's (data, scale, scale_2)."""
    d, s, s2 = ref.quantize_weight(wh, fmt)
    assert_bits_equal(qw.data, d, f"codes{what}")
    assert_bits_equal(qw.scale, s, f"scale bytes{what}")
    if fmt == "nvfp4":
        assert qw.scale_2.dtype == np.float32 and qw.scale_2.shape == (1,)
        assert_bits_equal(qw.scale_2, s2, f"scale_2{what}")
        q = cq.quantize_nvfp4(cupy.asarray(wh), scale_layout="dense")
        assert_bits_equal(qw.scale_2, np.float32(1) / cupy.asnumpy(q.global_scale), f"scale_2 = 1 / S_enc{what}")
    else:
        assert qw.scale_2 is None
        q = cq.quantize_mx(cupy.asarray(wh), "float4_e2m1fn", scale_layout="dense")
    assert_bits_equal(qw.data, q.data, f"codes against the op{what}")
    assert_bits_equal(qw.scale, q.scale, f"scale bytes against the op{what}")
    return d, s, s2


def _check_dequantized(qw, d, s, s2, fmt, what=""):
    N, K = qw.shape
    for out_dtype in W_DTYPES:
        want = ref.dequantize_weight(d, s, dtype=fmt, scale_2=s2, out_dtype=out_dtype)
        assert_bits_equal(qw.dequantize(out_dtype), want, f"dequantized to {_id(out_dtype)}{what}")
        out = poisoned((N, K), out_dtype)
        y = cq.dequantize_weight(qw, out_dtype, out=out)
        assert y is out
        assert_bits_equal(y, want, f"dequantized into out= {_id(out_dtype)}{what}")
    want = ref.dequantize_weight(d, s, dtype=fmt, scale_2=s2, out_dtype=qw.dtype)
    assert_bits_equal(cq.dequantize(qw), want, f"cq.dequantize{what}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", W_DTYPES, ids=_id)
@pytest.mark.parametrize("nk", SHAPES, ids=[f"{n}x{k}blocks" for n, k in SHAPES])
@pytest.mark.parametrize("fmt", FP4)
def test_quantize_and_dequantize(fmt, nk, dtype):
    shape = _shape(fmt, nk)
    wh = heavy_tailed(shape, 7 * shape[0] + shape[1] + (fmt == "mxfp4"), dtype)
    wh[shape[0] // 2] = 0  # a zero row
    qw = cq.quantize_weight(cupy.asarray(wh), fmt)
    d, s, s2 = _check_quantized(qw, wh, fmt)
    sc = qw.scheme
    assert (sc.format, sc.granularity, sc.block, sc.scale_dtype, sc.scale_layout, sc.family) == (
        fmt,
        "group",
        (BLOCK[fmt],),
        SCALE_TYPE[fmt].name,
        "dense",
        "weight_quant",
    )
    assert qw.data.dtype == np.uint8 and qw.data.shape == (shape[0], shape[1] // 2)
    assert qw.scale.dtype == np.uint8 and qw.scale.shape == (shape[0], shape[1] // BLOCK[fmt])
    assert qw.zero_point is None and qw.code_sum is None and qw.group_size == BLOCK[fmt] and qw.block_size is None
    assert qw.shape == shape and qw.dtype == dtype
    cqw.container.check_weight(qw)
    _check_dequantized(qw, d, s, s2, fmt)
    # group_size given as the block: the same weight
    again = cq.quantize_weight(cupy.asarray(wh), fmt, group_size=BLOCK[fmt])
    assert again.scheme == qw.scheme
    assert_bits_equal(again.data, qw.data)


def _special_weights(dtype, K):
    """Weights (float32 values cast to ``dtype``) with the edge cases: zeros, dtype's subnormals,
    its max finite value, ties of E2M1, +-inf, NaN, tiny-only weights."""
    info = ml_dtypes.finfo(dtype)
    big, tiny = float(info.max), float(info.smallest_subnormal)
    base = np.zeros((7, K), np.float32)
    base[0] = np.linspace(-3, 5, K)
    # base[1]: zeros
    base[2, :4] = tiny, -tiny, 3 * tiny, 0  # subnormals
    base[3, :3] = big, -big, big / 3  # the max finite value
    base[4, ::7] = 1e-3
    base[5, 16:20] = 0.25, 0.75, 2.5, 5  # E2M1 ties (at a scale of 1 where the block's amax is 6)
    base[5, 20] = 6
    base[6, :] = -tiny
    out = {"finite": base}
    w = base.copy()
    w[0, 5], w[0, 6], w[4, 0] = np.inf, -np.inf, np.inf
    out["inf"] = w
    w = base.copy()
    w[0, 7], w[5, 0] = np.nan, np.nan
    out["nan"] = w
    w = base.copy()
    w[:, ::3] = np.nan
    w[:, 1::3] = -np.inf
    out["nonfinite"] = w
    out["zeros"] = np.zeros((3, K), np.float32)
    out["tiny"] = np.full((3, K), tiny, np.float32) * (np.arange(K) % 4)
    out["normal_min"] = np.full((2, K), float(info.smallest_normal), np.float32)
    out["no_max"] = base[[0, 2, 4, 5, 6]]  # without the max finite row
    return {k: v.astype(dtype) for k, v in out.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", W_DTYPES, ids=_id)
@pytest.mark.parametrize("fmt", FP4)
def test_special_values(fmt, dtype):
    for K in (2 * BLOCK[fmt], 4 * BLOCK[fmt]):
        for name, wh in _special_weights(dtype, K).items():
            what = f" ({name}, K={K})"
            qw = cq.quantize_weight(cupy.asarray(wh), fmt)
            d, s, s2 = _check_quantized(qw, wh, fmt, what)
            _check_dequantized(qw, d, s, s2, fmt, what)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16], ids=_id)
def test_scale_2_subnormal(dtype):
    """An amax below 2688 * 2^-126 gives S_enc above 2^126 and a subnormal scale_2 = 1 / S_enc,
    which weight_scale_2 keeps (a CuPy division, compiled with -ftz=true, would give 0)."""
    wh = np.full((3, 32), 1e-38 if dtype == np.float32 else 2.0**-125, np.float32).astype(dtype)
    wh[1, 1] = 0
    qw = cq.quantize_weight(cupy.asarray(wh), "nvfp4")
    d, s, s2 = _check_quantized(qw, wh, "nvfp4")
    assert 0 < s2[0] < np.finfo(np.float32).tiny
    _check_dequantized(qw, d, s, s2, "nvfp4")
    # from a checkpoint's global scale (the device array quantize_nvfp4 gives, and a float)
    q = cq.quantize_nvfp4(cupy.asarray(wh), scale_layout="dense")
    for gs in (q.global_scale, float(cupy.asnumpy(q.global_scale)[0])):
        cw = cq.QuantizedWeight.from_checkpoint(q.data, q.scale, format="nvfp4", global_scale=gs, dtype=dtype)
        assert_bits_equal(cw.scale_2, s2, f"scale_2 from global_scale {type(gs).__name__}")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FP4)
def test_dequantize_every_code_and_scale_byte(fmt):
    """Row b has the scale byte b (E4M3 NaN 0x7f / 0xff, E8M0 0 and 255 included) in every block,
    the codes 0..15 twice per block; NVFP4 with several scale_2, given as floats and as arrays."""
    block = BLOCK[fmt]
    dh = np.tile(ref.pack_fp4(np.arange(32) % 16), (256, 2 * block // 32))
    sh = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 2, axis=1)
    d, s = cupy.asarray(dh), cupy.asarray(sh)
    if fmt == "nvfp4":
        given = [1.0, 0.0123, 2.0**-140, 2.0**100] + [
            cupy.asarray(np.array([v], np.float32)) for v in (0.37, np.inf, np.nan)
        ]
    else:
        given = [None]
    for v in given:
        cw = cq.QuantizedWeight.from_checkpoint(d, s, format=fmt, scale_2=v)
        s2 = None if v is None else (cupy.asnumpy(v) if isinstance(v, cupy.ndarray) else np.array([v], np.float32))
        for out_dtype in W_DTYPES:
            want = ref.dequantize_weight(dh, sh, dtype=fmt, scale_2=s2, out_dtype=out_dtype)
            out = poisoned(cw.shape, out_dtype)
            assert_bits_equal(cw.dequantize(out_dtype, out=out), want, f"to {_id(out_dtype)}, scale_2 {s2}")
        assert cw.dequantize().dtype == BF16  # from_checkpoint's default dtype


@pytest.mark.gpu
@pytest.mark.parametrize("ctype", ["__half", "__nv_bfloat16"])
def test_fp4_frag_every_word(ctype):
    """weight_mma.cuh fp4_frag, the matmul kernels' expansion of a fragment-ordered word of E2M1 codes
    into its four registers (rotates and selects), equals the shift-and-mask form on all 2^32 words;
    on a sample (every 16-bit half, random words) register j holds nibble j's value times 2^-BIAS in
    its low half and nibble j + 4's in its high half (fp16: 2^-14, bf16: 2^-126), bit for bit."""
    chunk = 1 << 30
    for base in range(0, 1 << 32, chunk):
        bad, _ = _testing._fp4_frag_check(ctype, base, chunk)
        assert bad == 0, f"{ctype}: {bad} registers differ in [{base:#x}, {base + chunk:#x})"
    rng = np.random.default_rng(11)
    half = np.arange(1 << 16, dtype=np.uint32)
    rand = rng.integers(0, 1 << 32, 1 << 16, dtype=np.uint64).astype(np.uint32)
    words = np.concatenate([half, half << 16, half | (rand << 16), rand])
    bad, regs = _testing._fp4_frag_check(ctype, 0, 0, words=cupy.asarray(words), regs=True)
    assert bad == 0
    regs = cupy.asnumpy(regs)
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    if ctype == "__half":
        bits = (e2m1 * 2.0**-14).astype(np.float16).view(np.uint16).astype(np.uint32)
    else:
        bits = (e2m1 * 2.0**-126).astype(np.float32).view(np.uint32) >> 16
    for j in range(4):
        lo, hi = bits[(words >> (4 * j)) & 15], bits[(words >> (4 * j + 16)) & 15]
        assert_bits_equal(regs[:, j], lo | (hi << 16), f"{ctype} register {j}")


@pytest.mark.gpu
@pytest.mark.parametrize("ctype", ["__half", "__nv_bfloat16"])
def test_fp4_scale_pairs_every_word(ctype):
    """weight_mma.cuh fp4_scale_pairs, the matmul kernels' NVFP4 scale pairs (four E4M3 bytes to two
    16-bit pairs), equals fp4_scale2 of each byte on all 2^32 words (a NaN byte gives a NaN)."""
    chunk = 1 << 30
    for base in range(0, 1 << 32, chunk):
        bad = _testing._fp4_scale_pairs_check(ctype, base, chunk)
        assert bad == 0, f"{ctype}: {bad} scales differ in [{base:#x}, {base + chunk:#x})"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FP4)
@pytest.mark.parametrize("shape", [(1, 128), (33, 256), (16, 384), (100, 1024), (70, 640)])
def test_prepare_weight(fmt, shape):
    wh = heavy_tailed(shape, shape[0] + shape[1], BF16)
    qw = cq.quantize_weight(cupy.asarray(wh), fmt)
    d, s, s2 = _check_quantized(qw, wh, fmt)
    qp = cq.prepare_weight(qw)
    assert qp.data_layout == "prepared" and qp.scheme == qw.scheme and qp.scheme.format == fmt and qp.shape == shape
    rd, rs, rz = ref.prepare_weight(d, s, scheme=fmt)
    assert rz is None and qp.zero_point is None
    assert_bits_equal(qp.data, rd, "prepared data")
    assert_bits_equal(qp.scale, rs, "prepared scale bytes")
    assert qp.scale_2 is qw.scale_2
    cqw.container.check_weight(qp)
    assert qp.prepare() is qp and "prepared" in repr(qp)
    back = qp.plain()
    assert back.scheme == qw.scheme and back.scale_2 is qw.scale_2
    assert_bits_equal(back.data, qw.data, "plain() data")
    assert_bits_equal(back.scale, qw.scale, "plain() scale bytes")
    for out_dtype in W_DTYPES:
        want = ref.dequantize_weight(d, s, dtype=fmt, scale_2=s2, out_dtype=out_dtype)
        assert_bits_equal(qp.dequantize(out_dtype, out=poisoned(shape, out_dtype)), want, "prepared, dequantized")
    h = qp.to_host()
    assert_bits_equal(h["data"], d)
    assert_bits_equal(h["scale"].view(np.uint8), s)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FP4)
def test_prepare_weight_refuses_partial_chunks(fmt, monkeypatch):
    qw = cq.quantize_weight(cupy.asarray(heavy_tailed((8, 3 * BLOCK[fmt]), 1, BF16)), fmt)
    _no_launch(monkeypatch)
    with pytest.raises(ValueError, match=f"^w's K = {3 * BLOCK[fmt]} must be a multiple of 128"):
        qw.prepare()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", W_DTYPES, ids=_id)
@pytest.mark.parametrize("fmt", FP4)
def test_from_checkpoint(fmt, dtype):
    wh = heavy_tailed((65, 8 * BLOCK[fmt]), 3, dtype)
    qw = cq.quantize_weight(cupy.asarray(wh), fmt)
    want = {t: qw.dequantize(t) for t in W_DTYPES}
    f = cq.QuantizedWeight.from_checkpoint
    variants = []
    for bs in ("default", None, (1, BLOCK[fmt]), [1, BLOCK[fmt]]):
        kw = {} if bs == "default" else {"block_size": bs}
        if fmt == "nvfp4":
            kw["scale_2"] = qw.scale_2
        variants.append((f"block_size {bs}", qw.scale, kw))
    typed = qw.scale.view(SCALE_TYPE[fmt])
    assert typed.dtype == SCALE_TYPE[fmt]
    s2kw = {"scale_2": qw.scale_2} if fmt == "nvfp4" else {}
    variants.append(("ml_dtypes scale", typed, s2kw))
    variants.append(("non-contiguous scale", cupy.asfortranarray(qw.scale), s2kw))
    if fmt == "nvfp4":
        q = cq.quantize_nvfp4(cupy.asarray(wh), scale_layout="dense")
        S_enc = cupy.asnumpy(q.global_scale)
        variants += [
            ("scale_2 float", qw.scale, {"scale_2": float(cupy.asnumpy(qw.scale_2)[0])}),
            ("scale_2 (1, 1)", qw.scale, {"scale_2": qw.scale_2.reshape(1, 1)}),
            ("global_scale array", qw.scale, {"global_scale": q.global_scale}),
            ("global_scale float", qw.scale, {"global_scale": float(S_enc[0])}),
            ("global_scale numpy float32", qw.scale, {"global_scale": np.float32(S_enc[0])}),
        ]
    for what, scale, kw in variants:
        cw = f(qw.data, scale, format=fmt, dtype=dtype, **kw)
        assert cw.data is qw.data, what  # the codes are not copied
        assert cw.scheme == qw.scheme and cw.shape == qw.shape and cw.dtype == dtype, what
        assert cw.scale.dtype == np.uint8 and cw.scale.flags.c_contiguous, what
        if what != "non-contiguous scale":
            assert cw.scale.data.ptr == qw.scale.data.ptr, what  # a view, not a copy
        assert_bits_equal(cw.scale, qw.scale, f"scale bytes ({what})")
        if fmt == "nvfp4":
            assert cw.scale_2.shape == (1,) and cw.scale_2.dtype == np.float32, what
            assert_bits_equal(cw.scale_2, qw.scale_2, f"scale_2 ({what})")
            if "scale_2" in kw and isinstance(kw["scale_2"], cupy.ndarray):
                assert cw.scale_2.data.ptr == qw.scale_2.data.ptr, what
        else:
            assert cw.scale_2 is None
        cqw.container.check_weight(cw)
        for t in W_DTYPES:
            assert_bits_equal(cw.dequantize(t), want[t], f"dequantized to {_id(t)} ({what})")
        assert_bits_equal(cw.prepare().data, qw.prepare().data, f"prepared ({what})")
    # codes and scale bytes that start at an odd address (a checkpoint's tensors inside one buffer)
    buf = cupy.zeros(qw.data.size + qw.scale.size + 1, np.uint8)
    odd_d = buf[1 : 1 + qw.data.size].reshape(qw.data.shape)
    odd_s = buf[1 + qw.data.size :].reshape(qw.scale.shape)
    odd_d[...] = qw.data
    odd_s[...] = qw.scale
    cw = f(odd_d, odd_s, format=fmt, dtype=dtype, **s2kw)
    assert cw.data is odd_d and cw.data.data.ptr % 2 == 1
    for t in W_DTYPES:
        assert_bits_equal(cw.dequantize(t), want[t], f"dequantized to {_id(t)} (data at an odd address)")
    empty = f(cupy.zeros((0, BLOCK[fmt]), np.uint8), cupy.zeros((0, 2), np.uint8), format=fmt, **s2kw)
    assert empty.shape == (0, 2 * BLOCK[fmt]) and empty.dequantize().shape == (0, 2 * BLOCK[fmt])


@pytest.mark.gpu
def test_from_checkpoint_errors(monkeypatch):
    f = cq.QuantizedWeight.from_checkpoint
    d = cupy.zeros((20, 32), np.uint8)  # K = 64
    s16, s32 = cupy.zeros((20, 4), np.uint8), cupy.zeros((20, 2), np.uint8)
    one = cupy.ones(1, np.float32)

    def u8(shape):
        return cupy.zeros(shape, np.uint8)

    _no_launch(monkeypatch)
    nv = dict(format="nvfp4", scale_2=one)
    cases = [
        (lambda: f(d, s16, format="nvfp4"), ValueError, "^scale_2 or global_scale must be given"),
        (lambda: f(d, s16, format="nvfp4", scale_2=one, global_scale=one), ValueError, "^scale_2 and global_scale"),
        (lambda: f(d, s32, format="mxfp4", scale_2=one), ValueError, "^scale_2 must be None for mxfp4"),
        (lambda: f(d, s32, format="mxfp4", global_scale=2.0), ValueError, "^global_scale must be None for mxfp4"),
        (lambda: f(d, s16, scale_2=one), ValueError, "^scale_2 is for nvfp4 weights only"),
        (lambda: f(d, s16, format="int8", block_size=None, global_scale=1.0), ValueError, "^global_scale is for"),
        (lambda: f(d, s16, block_size=(128, 128), **nv), ValueError, r"^block_size=\(128, 128\) is not supported"),
        (lambda: f(d, s16, block_size=(1, 32), **nv), ValueError, r"^block_size=\(1, 32\) is not supported"),
        (lambda: f(d, s32, format="mxfp4", block_size=(1, 16)), ValueError, "^block_size"),
        (lambda: f(d, s16, block_size=(1.0, 16.0), **nv), ValueError, "^block_size"),
        (lambda: f(d, s16, block_size=16, **nv), ValueError, "^block_size"),
        (lambda: f(d.view(np.int8), s16, **nv), TypeError, "^data must be uint8"),
        (lambda: f(cupy.asnumpy(d), s16, **nv), TypeError, "^data must be a cupy.ndarray"),
        (lambda: f(d.reshape(-1), s16, **nv), ValueError, "^data must be 2-D"),
        (lambda: f(cupy.zeros((32, 40), np.uint8)[:, ::2].T, s16, **nv), ValueError, "^data must be C-contiguous"),
        (lambda: f(u8((20, 12)), s16[:, :1], **nv), ValueError, "^data's K = 24 must be a nonzero multiple of 16"),
        (lambda: f(u8((20, 0)), u8((20, 0)), **nv), ValueError, "^data's K = 0"),
        (lambda: f(u8((20, 24)), s32, format="mxfp4"), ValueError, "^data's K = 48 must be a nonzero multiple of 32"),
        (lambda: f(d, cupy.asnumpy(s16), **nv), TypeError, "^scale must be a cupy.ndarray"),
        (lambda: f(d, s16.astype(np.float32), **nv), TypeError, "^scale must be uint8 or float8_e4m3fn"),
        (lambda: f(d, s16.view(SCALE_TYPE["mxfp4"]), **nv), TypeError, "^scale must be uint8 or float8_e4m3fn"),
        (lambda: f(d, s32.view(SCALE_TYPE["nvfp4"]), format="mxfp4"), TypeError, "^scale must be uint8 or float8_e8m0"),
        (lambda: f(d, s32, **nv), ValueError, r"^scale must have shape \(20, 4\)"),
        (lambda: f(d, s16, format="mxfp4"), ValueError, r"^scale must have shape \(20, 2\)"),
        (lambda: f(d, s16, format="nvfp4", scale_2=0.0), ValueError, "^scale_2 must be a positive finite"),
        (lambda: f(d, s16, format="nvfp4", scale_2=float("inf")), ValueError, "^scale_2 must be a positive finite"),
        (lambda: f(d, s16, format="nvfp4", scale_2="1"), TypeError, "^scale_2 must be a real number"),
        (lambda: f(d, s16, format="nvfp4", scale_2=True), TypeError, "^scale_2 must be a real number"),
        (lambda: f(d, s16, format="nvfp4", scale_2=np.ones(1, np.float32)), TypeError, "^scale_2 must be a real"),
        (lambda: f(d, s16, format="nvfp4", scale_2=cupy.ones(1, np.float64)), TypeError, "^scale_2 must be a float32"),
        (lambda: f(d, s16, format="nvfp4", scale_2=cupy.ones(2, np.float32)), ValueError, "^scale_2 must be a float32"),
        (lambda: f(d, s16, format="nvfp4", global_scale=-1.0), ValueError, "^global_scale must be a positive"),
        (lambda: f(d, s16, format="nvfp4", global_scale=cupy.ones((1, 2), np.float32)), ValueError, "^global_scale"),
        (lambda: f(d, s16, dtype="int8", **nv), TypeError, "^dtype"),
        (lambda: f(d, s16, format="fp4"), ValueError, "^format must be one of"),
    ]
    for call, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            call()
    if cupy.cuda.runtime.getDeviceCount() > 1:
        with cupy.cuda.Device(1):
            other = cupy.ones(1, np.float32)
            s_other = cupy.zeros((20, 4), np.uint8)
        with pytest.raises(ValueError, match="^scale_2 is on device 1"):
            f(d, s16, format="nvfp4", scale_2=other)
        with pytest.raises(ValueError, match="^global_scale is on device 1"):
            f(d, s16, format="nvfp4", global_scale=other)
        with pytest.raises(ValueError, match="^scale is on device 1"):
            f(d, s_other, **nv)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FP4)
def test_container(fmt):
    shape = (37, 256)  # whole 128-k chunks: the prepared weight's to_host too
    wh = heavy_tailed(shape, 5, np.float16)
    qw = cq.quantize_weight(cupy.asarray(wh), fmt)
    d, s, s2 = ref.quantize_weight(wh, fmt)
    extra = 4 if fmt == "nvfp4" else 0
    assert qw.nbytes == 37 * 128 + 37 * 256 // BLOCK[fmt] + extra
    r = repr(qw)
    assert fmt in r and f"group_size={BLOCK[fmt]}" in r and SCALE_TYPE[fmt].name in r and f"{qw.nbytes} bytes" in r
    assert ("scale_2 float32" in r) == (fmt == "nvfp4")
    c = qw.copy()
    assert c.scheme == qw.scheme and c.shape == qw.shape and c.dtype == qw.dtype
    arrays = [(c.data, qw.data), (c.scale, qw.scale)] + ([(c.scale_2, qw.scale_2)] if fmt == "nvfp4" else [])
    for a, b in arrays:
        assert a.data.ptr != b.data.ptr
        assert_bits_equal(a, b)
    assert (c.scale_2 is None) == (fmt == "mxfp4") and c.zero_point is None and c.code_sum is None
    for w in (qw, qw.prepare()):
        h = w.to_host()
        assert set(h) == {"data", "codes", "scale", "zero_point", "code_sum", "scale_2"}
        assert h["data"].dtype == np.uint8 and h["data"].shape == (37, shape[1] // 2)
        assert_bits_equal(h["data"], d)
        assert h["codes"].dtype == np.dtype(ml_dtypes.float4_e2m1fn) and h["codes"].shape == shape
        assert_bits_equal(h["codes"].view(np.uint8), ref.unpack_fp4(d, shape[1]))
        np.testing.assert_array_equal(h["codes"].astype(np.float32), ref.e2m1_to_float(ref.unpack_fp4(d, shape[1])))
        assert h["scale"].dtype == SCALE_TYPE[fmt]
        assert_bits_equal(h["scale"].view(np.uint8), s)
        assert h["zero_point"] is None and h["code_sum"] is None
        if fmt == "nvfp4":
            assert isinstance(h["scale_2"], np.ndarray) and h["scale_2"].dtype == np.float32
            assert h["scale_2"].shape == (1,)
            assert_bits_equal(h["scale_2"], s2)
        else:
            assert h["scale_2"] is None
    # the other formats' to_host has "scale_2": None, and their repr no scale_2
    q4 = cq.quantize_weight(cupy.asarray(heavy_tailed((16, 128), 1, BF16)), "int4")
    assert q4.to_host()["scale_2"] is None and "scale_2" not in repr(q4)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FP4)
def test_check_weight_rules(fmt):
    qw = cq.quantize_weight(cupy.asarray(heavy_tailed((20, 8 * BLOCK[fmt]), 2, BF16)), fmt)
    check = cqw.container.check_weight
    N, K = qw.shape

    def bad(**attrs):
        c = qw.copy()
        for k, v in attrs.items():
            setattr(c, k, v)
        return c

    cases = [
        (bad(data=qw.data[:, :-1].copy()), ValueError, r"^w.data must be uint8 of shape \(20, "),
        (bad(data=qw.data.view(np.int8)), ValueError, "^w.data must be uint8"),
        (bad(data=cupy.asnumpy(qw.data)), TypeError, "^w.data must be a cupy.ndarray"),
        (bad(scale=qw.scale[:, :1].copy()), ValueError, "^w.scale must be uint8"),
        (bad(scale=qw.scale.astype(np.float32)), ValueError, "^w.scale must be uint8"),
        (bad(scale=cupy.asfortranarray(qw.scale)), ValueError, "^w.scale must be C-contiguous"),
        (bad(zero_point=cupy.zeros((N, 1), np.uint8)), ValueError, f"^w.zero_point must be None for {fmt}"),
        (bad(code_sum=cupy.zeros(N, np.int32)), ValueError, f"^w.code_sum must be None for {fmt}"),
    ]
    if fmt == "nvfp4":
        cases += [
            (bad(scale_2=None), ValueError, r"^w.scale_2 must be the float32 \(1,\) decode scale"),
            (bad(scale_2=qw.scale_2.astype(np.float64)), ValueError, r"^w.scale_2 must be float32 of shape \(1,\)"),
            (bad(scale_2=cupy.ones(2, np.float32)), ValueError, r"^w.scale_2 must be float32 of shape \(1,\)"),
            (bad(scale_2=cupy.ones((), np.float32)), ValueError, r"^w.scale_2 must be float32 of shape \(1,\)"),
            (bad(scale_2=cupy.asnumpy(qw.scale_2)), TypeError, "^w.scale_2 must be a cupy.ndarray"),
            (bad(scale_2=1.0), TypeError, "^w.scale_2 must be a cupy.ndarray"),
        ]
    else:
        cases.append((bad(scale_2=cupy.ones(1, np.float32)), ValueError, "^w.scale_2 must be None for mxfp4"))
    other = 32 if fmt == "nvfp4" else 16
    scheme = cqw.formats.weight_scheme(fmt, other, K, BF16)
    cases.append(
        (
            cq.QuantizedWeight(qw.data, qw.scale, None, scheme, (N, K), BF16, scale_2=qw.scale_2),
            ValueError,
            f"^{fmt} weights have groups of {BLOCK[fmt]}",
        )
    )
    for w, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            check(w)
        with pytest.raises(exc, match=msg):
            w.dequantize()
        with pytest.raises(exc, match=msg):
            cq.prepare_weight(w)
    qp = qw.prepare()
    cases = [
        (qp._with(qp.data[:1].copy(), qp.scale, None, "prepared"), ValueError, "^w.data must be uint8 of shape"),
        (qp._with(qp.data, qp.scale[:, :, :, :1].copy(), None, "prepared"), ValueError, "^w.scale must be uint8"),
        (qp._with(qp.data, qw.scale, None, "prepared"), ValueError, "^w.scale must be uint8"),
    ]
    for w, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            check(w)
        with pytest.raises(exc, match=msg):
            w.plain()
    q4 = cq.quantize_weight(cupy.asarray(heavy_tailed((8, 64), 2, np.float16)), "int4", group_size=32)
    q4.scale_2 = cupy.ones(1, np.float32)
    with pytest.raises(ValueError, match="^w.scale_2 must be None for int4 weights"):
        check(q4)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FP4)
def test_quantize_errors(fmt, monkeypatch):
    block = BLOCK[fmt]
    w = cupy.asarray(np.ones((16, 4 * block), BF16))
    other = 32 if fmt == "nvfp4" else 16
    _no_launch(monkeypatch)
    cases = [
        (lambda: cq.quantize_weight(w, fmt, group_size=other), ValueError, f"^group_size={other} is not supported"),
        (lambda: cq.quantize_weight(w, fmt, group_size=None), ValueError, "^group_size=None is not supported"),
        (lambda: cq.quantize_weight(w, fmt, group_size=float(block)), ValueError, "^group_size"),
        (lambda: cq.quantize_weight(w, fmt, symmetric=False), ValueError, "^symmetric=False"),
        (lambda: cq.quantize_weight(w, fmt, block_size=(128, 128)), ValueError, "^block_size is for float8_e4m3fn"),
        (lambda: cq.quantize_weight(w[:, : 3 * block // 2], fmt), ValueError, "^w must be C-contiguous"),
        (
            lambda: cq.quantize_weight(cupy.ones((16, 3 * block // 2), BF16), fmt),
            ValueError,
            f"^w's K = {3 * block // 2} must be a nonzero multiple of {block} for {fmt}",
        ),
        (lambda: cq.quantize_weight(cupy.ones((16, 0), BF16), fmt), ValueError, "^w's K = 0"),
        (lambda: cq.quantize_weight(w[0], fmt), ValueError, "^w must be 2-D"),
        (lambda: cq.quantize_weight(w.astype(np.float64), fmt), TypeError, "^w must be"),
        (lambda: cq.quantize_weight(cupy.asnumpy(w), fmt), TypeError, "^w must be a cupy"),
    ]
    for call, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            call()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FP4)
def test_dequantize_errors(fmt, monkeypatch):
    shape = (16, 4 * BLOCK[fmt])
    qw = cq.quantize_weight(cupy.asarray(heavy_tailed(shape, 6, BF16)), fmt)
    out = poisoned(shape, BF16)
    before = cupy.asnumpy(out)
    # a weight whose scale_2 lies inside the buffer the caller gives as out
    buf = poisoned((shape[0] * shape[1],), np.float32)
    if fmt == "nvfp4":
        buf[7:8] = qw.scale_2
        aliased = cq.QuantizedWeight.from_checkpoint(qw.data, qw.scale, format=fmt, scale_2=buf[7:8])
    buf_before = cupy.asnumpy(buf)
    _no_launch(monkeypatch)
    cases = [
        (lambda: qw.dequantize(out=poisoned((16, shape[1] + 1), BF16)), ValueError, "^out must have shape"),
        (lambda: qw.dequantize(np.float16, out=out), TypeError, "^out must"),
        (lambda: qw.dequantize("float8_e4m3fn"), TypeError, "^out_dtype"),
        (lambda: qw.dequantize(out=cupy.asnumpy(out)), TypeError, "^out must be a cupy.ndarray"),
    ]
    if fmt == "nvfp4":
        cases.append(
            (lambda: aliased.dequantize(np.float32, out=buf.reshape(shape)), ValueError, "^out overlaps w.scale_2")
        )
    for call, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            call()
    assert_bits_equal(out, before, "out changed by a failed call")
    assert_bits_equal(buf, buf_before, "the aliased buffer changed by a failed call")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FP4)
def test_empty(fmt):
    w = cupy.zeros((0, 2 * BLOCK[fmt]), np.float16)
    qw = cq.quantize_weight(w, fmt)
    assert qw.data.shape == (0, BLOCK[fmt]) and qw.scale.shape == (0, 2)
    assert (qw.scale_2 is None) == (fmt == "mxfp4")
    y = qw.dequantize(np.float32)
    assert y.shape == (0, 2 * BLOCK[fmt]) and y.dtype == np.float32


@pytest.mark.gpu
def test_cuda_graph_capture():
    """quantize_weight("nvfp4"), from_checkpoint with a device global_scale and dequantize_weight
    captured once and replayed on new inputs: the same bytes as eager calls."""
    w = cupy.asarray(heavy_tailed((67, 384), 8, np.float16))
    stream = side_stream()

    def op():
        qw = cq.quantize_weight(w, "nvfp4")
        q = cq.quantize_nvfp4(w, scale_layout="dense")
        cw = cq.QuantizedWeight.from_checkpoint(q.data, q.scale, format="nvfp4", global_scale=q.global_scale)
        return qw, cw, q, qw.dequantize(np.float32), cw.prepare().dequantize(np.float16)

    with stream:
        op()
        stream.synchronize()
        stream.begin_capture()
        qw, cw, q, y, y_cw = op()
        graph = stream.end_capture()
        w[...] = cupy.asarray(heavy_tailed((67, 384), 9, np.float16))
        for a in (qw.data, qw.scale, qw.scale_2, cw.scale_2, y, y_cw):
            a.fill(0)
        graph.launch(stream)
        stream.synchronize()
    wh = cupy.asnumpy(w)
    d, s, s2 = _check_quantized(qw, wh, "nvfp4", " (graph replay)")
    assert_bits_equal(cw.scale_2, s2, "checkpoint scale_2 (graph replay)")
    assert_bits_equal(y, ref.dequantize_weight(d, s, dtype="nvfp4", scale_2=s2), "dequantized (graph replay)")
    want16 = ref.dequantize_weight(d, s, dtype="nvfp4", scale_2=s2, out_dtype=np.float16)
    assert_bits_equal(y_cw, want16, "checkpoint, prepared, dequantized (graph replay)")
