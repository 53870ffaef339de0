"""Weight-only quantization and the in-register-dequantizing matmul on the GPU: quantized bytes,
scales and zero points bit-exact with cupyquant.reference; dequantization bit-exact; matmul against
a float64 product of the dequantized weight by a stated relative-error bound; validation errors."""

from __future__ import annotations

import copy
import zlib

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_bits_equal, poisoned, require_arch, side_stream

import cupyquant as cq
from cupyquant import _device, _dtypes, _jit, _launch, _plans, _workspace
from cupyquant import reference as ref
from cupyquant import weight as cqw
from cupyquant.weight import decode, dispatch, sm80_gemm, sm90_gemm
from cupyquant.weight.formats import SCHEME_IDS, weight_scheme

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")

SCHEMES = [("int4", True), ("uint4", False), ("float8_e4m3fn", True)]
GROUPS = [32, 64, 128, None]
W_DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32]
HALF = [np.float16, ml_dtypes.bfloat16]


def _id(v):
    return np.dtype(v).name if not isinstance(v, (str, tuple, type(None), int, bool)) else str(v)


def _seed(*parts):
    return zlib.crc32(repr(parts).encode())


def _weights(shape, seed, dtype, outliers=True):
    """Gaussian rows with per-row magnitudes over 2^-6..2^6, a few outliers, an exact-zero group,
    and exact ties at k + 1/2 of the int4 step."""
    rng = np.random.default_rng(seed)
    N, K = shape
    w = rng.standard_normal(shape) * 2.0 ** rng.uniform(-6, 6, (N, 1))
    if outliers:
        w.reshape(-1)[rng.integers(0, w.size, max(1, w.size // 997))] *= 40
    if K >= 32 and N >= 2:
        w[1, :32] = 0.0
    return w.astype(np.float32).astype(dtype)


def _check_quantized(qw, wh, scheme, group_size):
    d, s, z = ref.quantize_weight(wh, scheme, group_size=group_size, symmetric=scheme != "uint4")
    assert_bits_equal(qw.data, d, f"{scheme} data")
    assert_bits_equal(qw.scale, s, f"{scheme} scales")
    if z is None:
        assert qw.zero_point is None
    else:
        assert_bits_equal(qw.zero_point, z, "zero points")
    return d, s, z


# ---------------------------------------------------------------- quantize / dequantize bytes
@pytest.mark.parametrize("group_size", GROUPS, ids=_id)
@pytest.mark.parametrize("scheme,sym", SCHEMES, ids=[s for s, _ in SCHEMES])
@pytest.mark.parametrize("w_dtype", W_DTYPES, ids=_id)
def test_quantize_and_dequantize_bit_exact(w_dtype, scheme, sym, group_size):
    for shape in [(256, 256), (1000, 384), (7, 1024), (3, 128)]:
        wh = _weights(shape, _seed(shape, w_dtype, scheme, group_size), w_dtype)
        qw = cq.quantize_weight(cupy.asarray(wh), scheme, group_size=group_size, symmetric=sym)
        assert qw.scheme.format == scheme and qw.shape == shape and qw.dtype == np.dtype(w_dtype)
        d, s, z = _check_quantized(qw, wh, scheme, group_size)
        for out_dtype in W_DTYPES:
            want = ref.dequantize_weight(d, s, z, scheme, out_dtype)
            out = poisoned(shape, out_dtype)
            y = qw.dequantize(out_dtype, out=out)
            assert y is out
            assert_bits_equal(y, want, f"dequantized to {_id(out_dtype)}")
        assert_bits_equal(cq.dequantize(qw), ref.dequantize_weight(d, s, z, scheme, w_dtype), "cq.dequantize")


@pytest.mark.parametrize("scheme,sym", SCHEMES, ids=[s for s, _ in SCHEMES])
def test_large_weights_bit_exact(scheme, sym):
    """The benchmark-sized shapes, one group size and dtype each."""
    for shape, g in [((4096, 4096), 128), ((11008, 4096), 64), ((4096, 11008), None)]:
        wh = _weights(shape, _seed("big", shape, scheme), ml_dtypes.bfloat16)
        qw = cq.quantize_weight(cupy.asarray(wh), scheme, group_size=g, symmetric=sym)
        _check_quantized(qw, wh, scheme, g)


@pytest.mark.parametrize("scheme,sym", SCHEMES, ids=[s for s, _ in SCHEMES])
@pytest.mark.parametrize("w_dtype", W_DTYPES, ids=_id)
def test_special_values(w_dtype, scheme, sym):
    """All-zero groups, NaN (ignored by the maxima, quantized to the zero), +-inf (clamped), a
    lone max-finite, subnormal groups whose scale underflows, and exact rounding ties."""
    info = ml_dtypes.finfo(w_dtype)
    rng = np.random.default_rng(_seed("special", w_dtype, scheme))
    w = rng.standard_normal((10, 64)).astype(np.float32)
    w[0] = 0
    w[1, 5] = np.nan
    w[2, :] = np.nan
    w[3, 7], w[3, 8] = np.inf, -np.inf
    w[4, 9] = float(info.max)
    w[5] = float(info.smallest_subnormal) * rng.integers(-3, 4, 64)
    w[6] = np.arange(64) - 32.0  # int4 step 32 / 7: many exact quotients
    w[7] = (np.arange(64) % 15 - 7) + 0.5  # halves
    w[8, :32] = -1.0  # a negative-only group (uint4 zero point clamps to 15)
    w[9, :32] = 3.0  # a positive-only group (zero point clamps to 0)
    wh = w.astype(w_dtype)
    for g in (32, None):
        qw = cq.quantize_weight(cupy.asarray(wh), scheme, group_size=g, symmetric=sym)
        d, s, z = _check_quantized(qw, wh, scheme, g)
        assert_bits_equal(qw.dequantize(np.float32), ref.dequantize_weight(d, s, z, scheme, np.float32), "dequantized")
    # hand-checked anchors: an all-zero group has scale 0 and the zero code (uint4: AWQ's 1e-5
    # floor of max - min keeps the scale positive, and the zero point is 0); +inf clamps
    d, s, z = ref.quantize_weight(wh, scheme, group_size=32, symmetric=sym)
    if scheme == "uint4":
        assert float(s[0, 0]) > 0 and (ref.unpack_fp4(d[0:1], 64) == 0).all()
    else:
        assert float(s[0, 0]) == 0.0
    if scheme == "int4":
        assert (ref.unpack_fp4(d[0:1], 64) == 8).all() and ref.unpack_fp4(d[3:4], 64)[0, 7] == 15
    if scheme == "float8_e4m3fn":
        assert d[0].max() == 0 and d[1, 5] == 0 and d[3, 7] == 0x7E


def test_to_host_and_repr():
    wh = _weights((64, 256), 1, ml_dtypes.bfloat16)
    qw = cq.quantize_weight(cupy.asarray(wh), "uint4", group_size=64)
    h = qw.to_host()
    d, s, z = ref.quantize_weight(wh, "uint4", group_size=64)
    np.testing.assert_array_equal(h["data"], d)
    np.testing.assert_array_equal(h["codes"], ref.unpack_fp4(d, 256))
    np.testing.assert_array_equal(h["zero_point"], ref.unpack_fp4(z, 4))
    assert h["scale"].dtype == ml_dtypes.bfloat16 and "scales" not in h and "zeros" not in h
    assert "uint4" in repr(qw) and "group_size=64" in repr(qw)
    assert qw.nbytes == 64 * 128 + 64 * 4 * 2 + 64 * 2
    q8 = cq.quantize_weight(cupy.asarray(wh), "float8_e4m3fn", group_size=None)
    assert q8.to_host()["codes"].dtype == ml_dtypes.float8_e4m3fn and q8.to_host()["zero_point"] is None
    # the ml_dtypes type names the FP8 scheme as the string does (as in quantize_fp8)
    q8t = cq.quantize_weight(cupy.asarray(wh), ml_dtypes.float8_e4m3fn, group_size=None)
    assert q8t.scheme.format == "float8_e4m3fn"
    np.testing.assert_array_equal(q8t.data.get(), q8.data.get())


# ---------------------------------------------------------------- from_checkpoint (INT4)
@pytest.mark.parametrize("group_size", GROUPS, ids=_id)
@pytest.mark.parametrize("scheme,sym", SCHEMES[:2], ids=[s for s, _ in SCHEMES[:2]])
@pytest.mark.parametrize("w_dtype", W_DTYPES, ids=_id)
def test_from_checkpoint_int4_bit_exact(w_dtype, scheme, sym, group_size):
    """QuantizedWeight.from_checkpoint of INT4 bytes is the weight they came from: given
    quantize_weight's arrays, the same scheme, the same arrays (the codes not copied) and the same
    dequantization and matmul; given the reference's host bytes (per-channel scales as (N,)), the
    exact bytes and the reference's dequantization. An odd number of groups a row (the zero
    points' last byte half used), one row, and a K that is a multiple of 128."""
    bs = None if group_size is None else (1, group_size)
    for shape in [(33, 3 * (group_size or 32)), (1, 256), (200, 512)]:
        wh = _weights(shape, _seed(shape, w_dtype, scheme, group_size, "checkpoint"), w_dtype)
        qw = cq.quantize_weight(cupy.asarray(wh), scheme, group_size=group_size, symmetric=sym)
        cw = cq.QuantizedWeight.from_checkpoint(
            qw.data, qw.scale, format=scheme, block_size=bs, zero_point=qw.zero_point, dtype=w_dtype
        )
        assert cw.scheme == qw.scheme and cw.shape == shape and cw.dtype == np.dtype(w_dtype)
        assert cw.data is qw.data and cw.group_size == group_size and cw.data_layout == "plain"
        assert_bits_equal(cw.scale, qw.scale, "scale")
        if scheme == "uint4":
            assert_bits_equal(cw.zero_point, qw.zero_point, "zero_point")
        else:
            assert cw.zero_point is None
        assert_bits_equal(cw.dequantize(), qw.dequantize(), f"{shape} dequantized")
        if w_dtype in HALF and shape[1] % 128 == 0:
            a = cupy.asarray(_weights((5, shape[1]), 3, w_dtype, outliers=False))
            assert_bits_equal(cq.matmul(a, cw.prepare()), cq.matmul(a, qw.prepare()), f"{shape} matmul")
        d, s, z = ref.quantize_weight(wh, scheme, group_size=group_size, symmetric=sym)
        hs = s.reshape(-1) if group_size is None else s
        hz = None if z is None else cupy.asarray(z)
        hw = cq.QuantizedWeight.from_checkpoint(
            cupy.asarray(d), cupy.asarray(hs), format=scheme, block_size=bs, zero_point=hz, dtype=w_dtype
        )
        assert hw.scheme == qw.scheme and hw.scale.shape == s.shape
        assert_bits_equal(hw.data, d, "data")
        assert_bits_equal(hw.scale, s, "scale")
        if z is not None:
            assert_bits_equal(hw.zero_point, z, "zero_point")
        for out_dtype in W_DTYPES:
            want = ref.dequantize_weight(d, s, z, scheme, out_dtype)
            assert_bits_equal(hw.dequantize(out_dtype), want, f"{shape} dequantized to {_id(out_dtype)}")


def test_from_checkpoint_int4_scales_and_zero_points_as_held():
    """float64 scales that float32 holds exactly become float32 (the scheme says so); float16 and
    bfloat16 are kept; a non-contiguous zero point array is held as a contiguous copy; the
    default dtype is bfloat16; uint4 per channel takes (N, 1) zero points."""
    wh = _weights((40, 256), 7, np.float32)
    d, s, z = ref.quantize_weight(wh, "uint4", group_size=64)
    data, zp = cupy.asarray(d), cupy.asarray(z)
    w64 = cq.QuantizedWeight.from_checkpoint(
        data, cupy.asarray(s.astype(np.float64)), format="uint4", block_size=(1, 64), zero_point=zp
    )
    assert w64.scale.dtype == np.float32 and w64.scheme.scale_dtype == "float32" and w64.dtype == ml_dtypes.bfloat16
    assert_bits_equal(w64.dequantize("float32"), ref.dequantize_weight(d, s, z, "uint4", np.float32), "float64 scales")
    for sd in HALF:
        wh16 = _weights((40, 256), 8, sd)
        d16, s16, z16 = ref.quantize_weight(wh16, "uint4", group_size=64)
        wide = cupy.zeros((40, 4), np.uint8)
        wide[:, ::2] = cupy.asarray(z16)
        w16 = cq.QuantizedWeight.from_checkpoint(
            cupy.asarray(d16), cupy.asarray(s16), format="uint4", block_size=(1, 64), zero_point=wide[:, ::2]
        )
        assert w16.scale.dtype == np.dtype(sd) and w16.zero_point.flags.c_contiguous
        assert_bits_equal(w16.zero_point, z16, "zero points from a strided view")
        assert_bits_equal(w16.dequantize(sd), ref.dequantize_weight(d16, s16, z16, "uint4", sd), _id(sd))
    dc, sc, zc = ref.quantize_weight(wh, "uint4", group_size=None)
    assert zc.shape == (40, 1)
    wc = cq.QuantizedWeight.from_checkpoint(
        cupy.asarray(dc), cupy.asarray(sc), format="uint4", block_size=None, zero_point=cupy.asarray(zc)
    )
    assert wc.scheme.granularity == "channel" and wc.group_size is None
    assert_bits_equal(wc.dequantize("float32"), ref.dequantize_weight(dc, sc, zc, "uint4", np.float32), "channel")


# ---------------------------------------------------------------- the prepared layout
PREP_SHAPES = [(1, 128), (17, 256), (1000, 384), (64, 1024)]


@pytest.mark.parametrize("group_size", GROUPS, ids=_id)
@pytest.mark.parametrize("scheme,sym", SCHEMES, ids=[s for s, _ in SCHEMES])
@pytest.mark.parametrize("w_dtype", HALF, ids=_id)
def test_prepare_weight_bit_exact(w_dtype, scheme, sym, group_size):
    """prepare_weight against reference.prepare_weight (bytes, padding rows included, into poisoned
    memory: every byte of the result is compared), and back: plain(), to_host and dequantize of
    the prepared weight equal the plain weight's."""
    for N, K in PREP_SHAPES:
        if group_size is not None and K % group_size:
            continue
        wh = _weights((N, K), _seed("prep", N, K, scheme, group_size), w_dtype)
        qw = cq.quantize_weight(cupy.asarray(wh), scheme, group_size=group_size, symmetric=sym)
        d, s, z = ref.prepare_weight(
            cupy.asnumpy(qw.data),
            cupy.asnumpy(qw.scale),
            None if qw.zero_point is None else cupy.asnumpy(qw.zero_point),
            scheme=scheme,
        )
        cupy.get_default_memory_pool().free_all_blocks()
        poisoned((1 << 20,), np.uint8)  # freed at once: the prepared arrays likely reuse bytes of 0xff
        qp = cq.prepare_weight(qw)
        assert qp.data_layout == "prepared" and qw.data_layout == "plain" and qp.shape == qw.shape
        assert qp.scheme == qw.scheme and qw.scheme.scale_layout == "row"
        assert_bits_equal(qp.data, d, f"{scheme} N={N} K={K} prepared data")
        assert_bits_equal(qp.scale, s, f"{scheme} N={N} K={K} prepared scales")
        if z is None:
            assert qp.zero_point is None
        else:
            assert_bits_equal(qp.zero_point, z, f"{scheme} N={N} K={K} prepared zeros")
        assert cq.prepare_weight(qp) is qp and qp.prepare() is qp and qw.plain() is qw
        back = qp.plain()
        assert back.data_layout == "plain"
        for name in ("data", "scale", "zero_point"):
            if getattr(qw, name) is not None:
                assert_bits_equal(getattr(back, name), cupy.asnumpy(getattr(qw, name)), f"plain() {name}")
        hp, hq = qp.to_host(), qw.to_host()
        for k in hq:
            if hq[k] is not None:
                np.testing.assert_array_equal(hp[k].view(np.uint8), hq[k].view(np.uint8))
        assert_bits_equal(qp.dequantize(), cupy.asnumpy(qw.dequantize()), "dequantize of the prepared weight")
        assert "prepared" in repr(qp) and "prepared" not in repr(qw)


def test_prepare_weight_errors():
    dtype = np.float16
    w = cupy.asarray(_weights((8, 64), 21, dtype))
    q64 = cq.quantize_weight(w, "int4", group_size=32)  # K = 64: half an INT4 chunk
    with pytest.raises(ValueError, match="multiple of 128"):
        cq.prepare_weight(q64)
    with pytest.raises(TypeError, match="w must be a QuantizedWeight"):
        cq.prepare_weight(w)
    with pytest.raises(ValueError, match="data_layout"):
        cq.QuantizedWeight(q64.data, q64.scale, None, q64.scheme, (8, 64), dtype, data_layout="marlin")
    with pytest.raises(TypeError, match="scheme must be a cupyquant.Scheme"):
        cq.QuantizedWeight(q64.data, q64.scale, None, "int4", (8, 64), dtype)
    qp = cq.prepare_weight(cq.quantize_weight(cupy.asarray(_weights((20, 256), 22, dtype)), "uint4", group_size=64))
    a = cupy.ones((2, 256), dtype)
    sch = weight_scheme("uint4", 64, 256, dtype)

    def prepared(data, scale, zero_point):
        return cq.QuantizedWeight(data, scale, zero_point, sch, (20, 256), dtype, data_layout="prepared")

    bad = prepared(qp.data[:1], qp.scale, qp.zero_point)
    with pytest.raises(ValueError, match=r"w\.data must be uint8 of shape \(2, 2, 2, 32, 16\)"):
        cq.matmul(a, bad)
    bad = prepared(qp.data, qp.scale, cupy.ascontiguousarray(qp.zero_point[:, :2]))
    with pytest.raises(ValueError, match=r"w\.zero_point must be uint8 of shape \(2, 4, 8\)"):
        cq.matmul(a, bad)
    bad = prepared(qp.data, qp.scale, qp.zero_point[:, ::-1])
    with pytest.raises(ValueError, match=r"w\.zero_point must be C-contiguous"):
        cq.matmul(a, bad)
    bad = prepared(qp.data, qp.scale, None)
    with pytest.raises(ValueError, match="w.zero_point must be given for uint4"):
        bad.dequantize()


# ---------------------------------------------------------------- matmul
# Bound on ||y - ref|| / ||ref||, ref = float64 a @ dequant(w).T with dequant(w) in a's dtype. Groups
# 32/64 and FP8: the kernel's weights are bit-identical to dequant(w) and each product is exact in
# float32. Groups 128/per-channel INT4: the kernel computes s * sum((q - z) a) without rounding
# (q - z) * s to a's dtype, so it differs from ref by that rounding, at most 2^-9 (bf16) or 2^-12
# (fp16) relative per weight and of random sign (norm-wise far smaller). What else remains is float32
# accumulation (relative ~K * 2^-24 at worst, ~sqrt(K) * 2^-24 typically, below 1e-4 for K <= 11008)
# plus one rounding of each output to a's dtype, at most 2^-9 (bf16) or 2^-12 (fp16) relative.
# Bounds: 2^-8 for bf16, 2^-10 for fp16.
TOL = {np.dtype(np.float16): 2.0**-10, np.dtype(ml_dtypes.bfloat16): 2.0**-8}
MM_SHAPES = [(256, 256), (4096, 4096), (11008, 4096), (4096, 11008), (1000, 384)]
MS = [1, 2, 3, 8, 16, 33, 64]


def _matmul_ref(a, qw):
    wd = qw.dequantize(a.dtype).astype(cupy.float64)
    return a.reshape(-1, a.shape[-1]).astype(cupy.float64) @ wd.T


def _rel_err(y, want):
    y = y.reshape(want.shape).astype(cupy.float64)
    return float(cupy.linalg.norm(y - want) / cupy.linalg.norm(want))


def _hopper():
    return _device.caps(cupy.cuda.Device().id).wgmma


def _launches(fn):
    """``fn()`` and the kernel launches it made (cupyquant._launch.recording: kernel, grid, block,
    arguments, shared memory, the Launch)."""
    with _launch.recording() as rec:
        result = fn()
    return result, [r for r in rec if r[5] is not None]


def _early(records, kernel: str) -> list:
    """The ``early`` flags (weights read before the PDL wait) of the recorded launches of ``kernel``."""
    flags = []
    for k, _, _, args, _, _ in records:
        if k is not None and kernel in k.name:
            struct = next(a for a in args if isinstance(a, np.void) and "early" in (a.dtype.names or ()))
            flags.append(bool(struct["early"]))
    return flags


class _forced:
    """Within the block, matmuls take ``path`` ("decode", "sm80_gemm" or "sm90_gemm") whatever M
    is; "sm90_gemm" skips the test on GPUs without the sm90 kernel (conftest.require_arch)."""

    def __init__(self, path):
        self.path = None if path == "auto" else path

    def __enter__(self):
        if self.path == "sm90_gemm":
            require_arch("wgmma")
        self.ctx = cqw._forced_path(self.path)
        self.ctx.__enter__()

    def __exit__(self, *exc):
        self.ctx.__exit__(*exc)


def _check_matmul(qw, ms, dtype, seed, what=""):
    """matmul of the prepared weight against the float64 reference for each M; for the first M also
    the plain weight (converted inside the call), which must give the same bits."""
    tol = TOL[np.dtype(dtype)]
    N, K = qw.shape
    qp = cq.prepare_weight(qw)
    rng = np.random.default_rng(seed)
    for i, M in enumerate(ms):
        a = cupy.asarray(rng.standard_normal((M, K)).astype(np.float32).astype(dtype))
        y = cq.matmul(a, qp)
        assert y.shape == (M, N) and y.dtype == np.dtype(dtype)
        err = _rel_err(y, _matmul_ref(a, qw))
        assert err <= tol, f"{what} M={M} N={N} K={K} ({cqw.matmul_path(M, qw)}): relative error {err:.3g} > {tol:.3g}"
        if i == 0:
            assert_bits_equal(cq.matmul(a, qw), cupy.asnumpy(y), f"{what} M={M}: plain vs prepared weight")


# (scheme, symmetric, path): every kernel for every scheme (FP8 weights: tests/test_weight_fp8_matmul.py too)
MM_PATHS = [(s, sym, p) for s, sym in SCHEMES for p in ("decode", "sm80_gemm", "sm90_gemm")]


@pytest.mark.parametrize("group_size", GROUPS, ids=_id)
@pytest.mark.parametrize("scheme,sym,path", MM_PATHS, ids=[f"{s}-{p}" for s, _, p in MM_PATHS])
@pytest.mark.parametrize("dtype", HALF, ids=_id)
def test_matmul_relative_error(dtype, scheme, sym, group_size, path):
    """Every kernel at the decode sizes M = 1..64."""
    for N, K in MM_SHAPES:
        if scheme == "float8_e4m3fn" and K % 64 or K % 128 and scheme != "float8_e4m3fn":
            continue
        wh = _weights((N, K), _seed("mm", N, K, scheme, group_size, dtype), dtype, outliers=False)
        qw = cq.quantize_weight(cupy.asarray(wh), scheme, group_size=group_size, symmetric=sym)
        with _forced(path):
            _check_matmul(qw, MS, dtype, _seed("a", N, K), path)


PREFILL_MS = [16, 17, 64, 128, 1000, 4096]
INT4_SCHEMES = SCHEMES[:2]


@pytest.mark.parametrize("group_size", GROUPS, ids=_id)
@pytest.mark.parametrize("scheme,sym", INT4_SCHEMES, ids=[s for s, _ in INT4_SCHEMES])
@pytest.mark.parametrize("dtype", HALF, ids=_id)
def test_prefill_relative_error(dtype, scheme, sym, group_size):
    """Prefill sizes, M not a multiple of any tile (17, 1000) included, on the path matmul picks."""
    for N, K in MM_SHAPES:
        wh = _weights((N, K), _seed("pf", N, K, scheme, group_size, dtype), dtype, outliers=False)
        qw = cq.quantize_weight(cupy.asarray(wh), scheme, group_size=group_size, symmetric=sym)
        _check_matmul(qw, PREFILL_MS, dtype, _seed("pa", N, K))


BENCH_SHAPES = [(14336, 4096), (4096, 14336), (28672, 8192), (8192, 28672)]


@pytest.mark.parametrize(
    "dtype,scheme,sym,group_size",
    [(ml_dtypes.bfloat16, "int4", True, 128), (np.float16, "uint4", False, 64)],
    ids=["int4-g128-bf16", "uint4-g64-f16"],
)
def test_prefill_benchmark_shapes(dtype, scheme, sym, group_size):
    for N, K in BENCH_SHAPES:
        wh = _weights((N, K), _seed("bs", N, K), dtype, outliers=False)
        qw = cq.quantize_weight(cupy.asarray(wh), scheme, group_size=group_size, symmetric=sym)
        _check_matmul(qw, [1, 16, 64, 256, 1024, 4096], dtype, _seed("ba", N, K))
        del qw
        cupy.get_default_memory_pool().free_all_blocks()


# path -> the kernel's name (a substring of its mangled name)
_KERNELS = {"decode": "w16_decode", "sm80_gemm": "sm80_w16_gemm", "sm90_gemm": "sm90_w16_gemm"}


def test_matmul_launches_the_path_it_names():
    dtype = ml_dtypes.bfloat16
    N, K = 256, 512
    wh = cupy.asarray(_weights((N, K), 11, dtype))
    seen = set()
    for scheme, sym in SCHEMES:
        qw = cq.quantize_weight(wh, scheme, group_size=128, symmetric=sym)
        for M in (1, 100, 256, 257, 1000):
            want = cqw.matmul_path(M, qw)
            assert want == cqw.matmul_path(M, qw, arch=_device.arch(cupy.cuda.Device().id))
            seen.add(want)
            y, launched = _launches(lambda: cq.matmul(cupy.ones((M, K), dtype=dtype), qw))
            names = [r[0].name for r in launched]
            assert len(names) == 1 and _KERNELS[want] in names[0], (scheme, M, names)
            assert y.shape == (M, N)
    assert seen == {"decode", "sm90_gemm" if _hopper() else "sm80_gemm"}


@pytest.mark.parametrize("path", ["sm80_gemm", "sm90_gemm"])
def test_tensor_core_split_k_is_deterministic(monkeypatch, path):
    """Small M and N leave most of the GPU idle unless K is split across blocks; the partial tiles
    are added in split order, so repeated calls give the same bits. (On the wgmma kernel matmul
    splits this shape at M = 16; 2, 3 and 8 ways on 64-row tiles are forced too.)"""
    dtype = ml_dtypes.bfloat16
    N, K = 256, 8192
    qw = cq.quantize_weight(cupy.asarray(_weights((N, K), 12, dtype, outliers=False)), "int4", group_size=128)
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    if path == "sm80_gemm":
        splits, _ = sm80_gemm.splits(-(-N // sm80_gemm.BN), K // sm80_gemm.BK, sms)
        assert splits > 1
        cases = [None]
    else:
        assert sm90_gemm.sm90_plan(16, N, K // sm90_gemm.BK, sms)[1] > 1
        cases = [None, 2, 3, 8]
    for forced in cases:
        if forced is not None:
            monkeypatch.setattr(sm90_gemm, "sm90_plan", lambda M, N, iters, sms, f=forced, **kw: (64, f))
            _plans.clear()
        for M in (16, 200):
            a = cupy.asarray(np.random.default_rng(13).standard_normal((M, K)).astype(np.float32).astype(dtype))
            with _forced(path):
                first = cupy.asnumpy(cq.matmul(a, qw))
                for _ in range(3):
                    assert_bits_equal(cq.matmul(a, qw), first, f"repeat, {forced} splits")
            assert _rel_err(cupy.asarray(first), _matmul_ref(a, qw)) <= TOL[np.dtype(dtype)]


CLUSTER_CASES = [(32, 2), (64, 2), (128, 2), (256, 2), (32, 3), (64, 3), (128, 3), (256, 6), (64, 8)]


@pytest.mark.parametrize("bma,splits", CLUSTER_CASES, ids=[f"{b}-{s}" for b, s in CLUSTER_CASES])
def test_wgmma_cluster_split_matches_workspace(monkeypatch, bma, splits):
    """K split 2 to 8 ways runs as a cluster of the tile's blocks, which add their partials through
    distributed shared memory; through the float32 workspace instead (_WG_CLUSTER off) the same
    additions in the same order give the same bits. The launches are checked to be what each says
    (cluster dimension (1, 1, splits), and no cluster with the workspace); clusters of more than 2
    blocks are launched with shared memory for one block per SM."""
    dtype = ml_dtypes.bfloat16
    N, K = 520, 1024  # a partial last tile of weight rows
    qw = cq.quantize_weight(
        cupy.asarray(_weights((N, K), 31, dtype, outliers=False)), "uint4", group_size=32, symmetric=False
    )
    a = cupy.asarray(np.random.default_rng(32).standard_normal((bma + 5, K)).astype(np.float32).astype(dtype))
    monkeypatch.setattr(sm90_gemm, "sm90_plan", lambda M, N, iters, sms, **kw: (bma, splits))
    smem_sm = cupy.cuda.Device().attributes["MaxSharedMemoryPerMultiprocessor"]
    got = {}
    with _forced("sm90_gemm"):
        for on in (True, False):
            monkeypatch.setattr(sm90_gemm, "CLUSTER_SPLITS", on)
            _plans.clear()
            out = poisoned((bma + 5, N), dtype)
            _, launched = _launches(lambda: cq.matmul(a, qw, out=out))
            assert [r[5].cluster for r in launched] == [(1, 1, splits) if on else None], launched
            if on and splits > 2:  # one block per SM: two would need more than the SM's shared memory
                assert 2 * (launched[0][4] + 1024) > smem_sm, launched
            got[on] = cupy.asnumpy(out)
    assert_bits_equal(cupy.asarray(got[True]), got[False], "cluster against workspace")
    assert _rel_err(cupy.asarray(got[True]), _matmul_ref(a, qw)) <= TOL[np.dtype(dtype)]


TMA_CASES = [("int4", 128, 1), ("uint4", 64, 2), ("int4", None, 3)]


@pytest.mark.parametrize("scheme,group,splits", TMA_CASES, ids=[f"{s}-g{g}-{k}" for s, g, k in TMA_CASES])
def test_wgmma_128_rows_activations_by_tma(monkeypatch, scheme, group, splits):
    """The 128-row tile's producer warpgroup loads the activations by TMA through a tensor map of
    the launch's rows of a (weight.py _act_tensor_map; the kernel launched with 384 threads, the 64-
    and 256-row tiles with 256 and maps of zeros they do not read). Rows of a 192 bytes further
    apart than K (a view, not copied: the map's row stride), M = 200 (the second tile's 72 rows
    through the second map, whose boxes are 72 rows: none past M), K whole, split 2 ways (a cluster)
    and 3 (the workspace): the same bits as a contiguous copy of a, within the tolerance of the
    float64 reference, and the same bits again from a CUDA graph replayed over a poisoned out= (the
    maps travel by value in the graph's node). Then M = 128 (no tail: a second map of zeros) and
    last tiles of 1, 63, 64 and 127 rows (boxes of 8, 64, 64 and 128 rows; 7, 1, 0 and 1 past M) over
    poisoned outputs, within the tolerance."""
    dtype = ml_dtypes.bfloat16
    N, K, M = 392, 1536, 200
    qw = cq.quantize_weight(
        cupy.asarray(_weights((N, K), 51, dtype, outliers=False)), scheme, group_size=group, symmetric=scheme == "int4"
    )
    wide = cupy.asarray(np.random.default_rng(52).standard_normal((255, K + 96)).astype(np.float32).astype(dtype))
    a = wide[:M, :K]
    assert a.strides[0] == (K + 96) * 2 and not a.flags.c_contiguous
    monkeypatch.setattr(sm90_gemm, "sm90_plan", lambda M, N, iters, sms, **kw: (128, splits))
    monkeypatch.setattr(sm90_gemm, "cluster_cap", lambda *a: None)  # 3 ways through the workspace, whatever the GPU

    def last_launch(fn):
        _, launched = _launches(fn)
        k, grid, block, args, smem, launch = launched[-1]
        return block, args[0], args[-2], args[-1]

    with _forced("sm90_gemm"):
        out = poisoned((M, N), dtype)
        block, ptr, tmap, tail = last_launch(lambda: cq.matmul(a, qw, out=out))
        assert block == (384, 1, 1) and ptr == a.data.ptr, "the strided view itself, by a producer warpgroup"
        assert tmap.dtype == tail.dtype == _launch.TENSOR_MAP and tmap["w"].any(), "a tensor map"
        assert tail["w"].any() and not np.array_equal(tail, tmap), "a second map for the last tile's 72 rows"
        want = cq.matmul(cupy.ascontiguousarray(a), qw)
        assert_bits_equal(out, cupy.asnumpy(want), "strided rows against a contiguous copy")
        assert _rel_err(out, _matmul_ref(a, qw)) <= TOL[np.dtype(dtype)]
        graph_out = cupy.empty((M, N), dtype)
        stream = side_stream()
        with stream:
            stream.begin_capture()
            cq.matmul(a, qw, out=graph_out)
            graph = stream.end_capture()
            for rep in range(2):
                graph_out.view(np.uint16).fill(0x7FC1)
                graph.launch(stream)
                stream.synchronize()
                assert_bits_equal(graph_out, cupy.asnumpy(want), f"graph replay {rep}")
        for m in (128, 129, 191, 192, 255):
            out = poisoned((m, N), dtype)
            block, _, _, tail = last_launch(lambda: cq.matmul(wide[:m, :K], qw, out=out))
            assert block == (384, 1, 1) and tail["w"].any() == (m % 128 != 0), m
            assert _rel_err(out, _matmul_ref(wide[:m, :K], qw)) <= TOL[np.dtype(dtype)], m
        for bma in (32, 64, 256):
            monkeypatch.setattr(sm90_gemm, "sm90_plan", lambda M, N, iters, sms, b=bma, **kw: (b, 1))
            _plans.clear()
            block, _, tmap, tail = last_launch(lambda: cq.matmul(a, qw))
            assert block == (256, 1, 1) and not tmap["w"].any() and not tail["w"].any(), bma


SCALE_STEP_CASES = [(bma, g, s) for bma in (32, 64, 128, 256) for g in (128, None) for s in (1, 3)]


@pytest.mark.parametrize("bma,group,splits", SCALE_STEP_CASES, ids=[f"{b}-g{g}-{s}" for b, g, s in SCALE_STEP_CASES])
def test_wgmma_scale_sources_across_split_starts(monkeypatch, bma, group, splits):
    """The wgmma kernel steps each stage's scale source by the stage's groups. The 256-row tile's
    stages are 64 k, so with groups of 128 it moves to the next group after every stage of odd
    index, counted from K's start: K = 1280 is 20 such stages, which 3 splits start at stages 0, 7
    and 14, so the second split's first stage is odd. Per channel the source never moves; the
    64- and 128-row tiles (stages of 128 k) take one group a stage. Against the float64 reference,
    where a scale taken from the wrong group would be off by far more than the tolerance."""
    dtype = ml_dtypes.bfloat16
    N, K = 264, 1280
    qw = cq.quantize_weight(cupy.asarray(_weights((N, K), 41, dtype, outliers=False)), "int4", group_size=group)
    a = cupy.asarray(np.random.default_rng(42).standard_normal((bma + 3, K)).astype(np.float32).astype(dtype))
    monkeypatch.setattr(sm90_gemm, "sm90_plan", lambda M, N, iters, sms, **kw: (bma, splits))
    with _forced("sm90_gemm"):
        out = poisoned((bma + 3, N), dtype)
        cq.matmul(a, qw, out=out)
    assert _rel_err(out, _matmul_ref(a, qw)) <= TOL[np.dtype(dtype)]


def test_wgmma_cluster_capacity():
    """The capacities that decide which splits of 3 to 8 ways run as clusters: positive, and at most
    the SMs over the cluster size (one block per SM); the H100 holds fewer than that (a cluster's
    blocks must share a GPC). A wide split whose clusters exceed the capacity goes through the
    workspace; within it, the plan may take 3 or 6 splits."""
    require_arch("wgmma")
    device = cupy.cuda.Device().id
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    cap = sm90_gemm.cluster_cap(device, _dtypes.input_type(ml_dtypes.bfloat16, "a"), SCHEME_IDS["int4"], True)
    assert sorted(cap) == [3, 4, 5, 6, 7, 8]
    for s, n in cap.items():
        assert 0 < n <= sms // s, cap
    assert cap[4] >= cap[8]
    assert sm90_gemm.wide_cluster_fits(cap, 3, cap[3]) and not sm90_gemm.wide_cluster_fits(cap, 3, cap[3] + 1)


# (path, M): every kernel, and on the tensor-core kernels a split-K launch (the 256 x 4096 weight of
# the chain below at M = 16: few tiles, long K) besides a plain one
PDL_CASES = [
    ("decode", 1),
    ("decode", 16),
    ("sm80_gemm", 16),
    ("sm80_gemm", 200),
    ("sm90_gemm", 16),
    ("sm90_gemm", 200),
]


@pytest.mark.parametrize("path,M", PDL_CASES, ids=[f"{p}-M{m}" for p, m in PDL_CASES])
def test_matmul_pdl_chain_is_exact(monkeypatch, path, M):
    """Programmatic dependent launch: in a CUDA graph, a CuPy kernel writes ``a`` and then a chain of
    matmuls each reads the output of the one before (x -> w1 -> w2 -> w1 -> w2), every one launched
    with PDL, so that each may start while its producer still runs. Each waits for its producer
    before any load, so the chain gives the bits of the same calls made one after another without
    PDL. Replayed several times over outputs poisoned in between."""
    dtype = ml_dtypes.bfloat16
    rng = np.random.default_rng(_seed("pdl", path, M))
    w1 = cq.prepare_weight(cq.quantize_weight(cupy.asarray(_weights((256, 4096), 21, dtype, outliers=False)), "int4"))
    w2 = cq.prepare_weight(
        cq.quantize_weight(
            cupy.asarray(_weights((4096, 256), 22, dtype, outliers=False)), "uint4", group_size=64, symmetric=False
        )
    )
    ws = [w1, w2, w1, w2]
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    if M == 16 and path == "sm80_gemm":
        assert (
            sm80_gemm.splits(-(-256 // sm80_gemm.BN), 4096 // sm80_gemm.BK, sms)[0] > 1
        )  # split-K launches in the chain
    if M == 16 and path == "sm90_gemm":
        assert sm90_gemm.sm90_plan(16, 256, 4096 // sm90_gemm.BK, sms)[1] > 1
    src = cupy.asarray(rng.standard_normal((M, 4096)).astype(np.float32).astype(dtype))
    hopper = _hopper()
    with _forced(path), _launch.recording() as rec:
        want, h = [], src
        for w in ws:
            h = cq.matmul(h, w, pdl=False)
            want.append(cupy.asnumpy(h))
        assert not [r for r in rec if r[5] is not None and r[5].pdl]
        x = cupy.empty_like(src)
        outs = [cupy.empty((M, w.shape[0]), dtype) for w in ws]
        stream = side_stream()
        with stream:
            cq.matmul(x, w1, out=outs[0], pdl=hopper)  # compile and allocate outside the capture
            stream.begin_capture()
            cupy.multiply(src, 1, out=x)  # the producer of x, right before the first matmul
            h = x
            for w, o in zip(ws, outs):
                h = cq.matmul(h, w, out=o, pdl=hopper)
            graph = stream.end_capture()
            for rep in range(3):
                x.fill(0)
                for o in outs:
                    o.view(np.uint16).fill(0x7FC1)  # NaN: an output left unwritten fails
                graph.launch(stream)
                stream.synchronize()
                for i, o in enumerate(outs):
                    assert_bits_equal(o, want[i], f"graph replay {rep}, matmul {i} of the chain")
            # the same eagerly, default pdl (on where the GPU has it)
            h = src
            for i, w in enumerate(ws):
                h = cq.matmul(h, w)
                assert_bits_equal(h, want[i], f"eager, matmul {i} of the chain")
            stream.synchronize()
    pdl_launches = [r for r in rec if r[5] is not None and r[5].pdl]
    assert bool(pdl_launches) == hopper, "PDL launches are made exactly on GPUs of compute capability 9.0+"
    if path == "decode":
        # the want calls (pdl=False, w1 and w2 read for the first time) not early; every PDL call
        # after them (the warm-up, the captured chain, the eager chain) early
        assert _early(rec, "w16_decode") == [False] * 4 + [hopper] * 9, _early(rec, "w16_decode")


def test_matmul_pdl_argument(monkeypatch):
    a = cupy.ones((2, 256), ml_dtypes.bfloat16)
    qw = cq.quantize_weight(cupy.ones((64, 256), ml_dtypes.bfloat16), "int4")
    with pytest.raises(TypeError, match="^pdl must be None, True or False"):
        cq.matmul(a, qw, pdl="yes")
    # a GPU below compute capability 9.0 has no PDL: None turns it off there and True is an error
    monkeypatch.setitem(_device._caps, cupy.cuda.Device().id, _device.caps_of_arch("80"))
    with pytest.raises(ValueError, match="^pdl=True needs a GPU of compute capability 9.0"):
        cq.matmul(a, qw, pdl=True)
    with _forced("decode"):
        y, launched = _launches(lambda: cq.matmul(a, qw))
    assert launched and not any(r[5].pdl or r[5].cluster for r in launched), "PDL launch below compute capability 9.0"
    assert_bits_equal(y, cupy.asnumpy(cq.matmul(a, qw, pdl=False)), "pdl off")


@pytest.mark.parametrize("path", ["decode", "sm90_gemm"])
def test_matmul_early_weight_reads(monkeypatch, path):
    """The decode kernel reads a weight's first chunk and scales before its PDL wait (early), and the
    wgmma kernel its first stages' weights and scales, only from the second call with a prepared
    weight object on, with PDL on: not in a weight's first call (the kernel that wrote its arrays
    may be the one the launch overlaps), not for a plain weight (converted in the call), not with
    pdl=False; a copy is a new object. Early or not, the same bits. In a CUDA graph, a CuPy kernel
    writes a fresh weight's scales right before its first matmul; the captured call must see
    them."""
    hopper = _hopper()
    if path == "sm90_gemm":
        require_arch("wgmma")
    kernel = _KERNELS[path]
    dtype = ml_dtypes.bfloat16
    wh = _weights((200, 512), _seed("early"), dtype)
    plain = cq.quantize_weight(cupy.asarray(wh), "int4")
    qw = cq.prepare_weight(plain)
    a = cupy.asarray(np.random.default_rng(_seed("early-a")).standard_normal((3, 512)).astype(dtype))
    want = _matmul_ref(a, qw)
    with _forced(path):
        with _launch.recording() as rec:
            ys = [cq.matmul(a, qw), cq.matmul(a, qw), cq.matmul(a, qw, pdl=False), cq.matmul(a, qw)]
        assert _early(rec, kernel) == [False, hopper, False, hopper], _early(rec, kernel)
        for y in ys[1:]:
            assert_bits_equal(y, cupy.asnumpy(ys[0]), "early against not")
        assert _rel_err(ys[0], want) <= TOL[np.dtype(dtype)]
        with _launch.recording() as rec:
            cq.matmul(a, plain), cq.matmul(a, plain)
            q2 = qw.copy()
            cq.matmul(a, q2), cq.matmul(a, q2)
            q2.scale = q2.scale.copy()  # new arrays in the same object: read as new
            cq.matmul(a, q2), cq.matmul(a, q2)
            q4 = copy.deepcopy(q2)  # the attributes copied, the buffers new
            cq.matmul(a, q4), cq.matmul(a, q4)
        assert _early(rec, kernel) == [False, False, False, hopper, False, hopper, False, hopper], _early(rec, kernel)
        # a fresh weight whose scales a kernel writes right before its first (captured) matmul
        q3 = qw.copy()
        right = q3.scale.copy()
        q3.scale.fill(0)
        out = poisoned((3, 200), dtype)
        stream = side_stream()
        with stream:
            stream.begin_capture()
            cupy.multiply(right, 1, out=q3.scale)  # a kernel (a copy may be a memcpy node)
            cq.matmul(a, q3, out=out)
            graph = stream.end_capture()
            graph.launch(stream)
            stream.synchronize()
        with _launch.recording() as rec:
            cq.matmul(a, q3), cq.matmul(a, q3)  # a captured call does not count as the first read
        assert _early(rec, kernel) == [False, hopper], _early(rec, kernel)
    assert_bits_equal(out, cupy.asnumpy(ys[0]), "first captured call after its weight was written")


EARLY_PLANS = [(32, 1), (32, 2), (64, 1), (64, 2), (64, 3), (128, 1), (128, 2), (128, 3), (256, 1), (256, 2)]


@pytest.mark.parametrize("bma,splits", EARLY_PLANS, ids=[f"{b}-{s}" for b, s in EARLY_PLANS])
def test_wgmma_early_weights_every_tile(monkeypatch, bma, splits):
    """The wgmma kernel's early copies (weight_sm90_gemm.cu a.early: the first stages' weights and
    scales before the PDL wait; the 128-row tile's producer copies a whole ring of them, the others
    STAGES - 2) on every tile, unsplit, split 2 ways (a cluster) and 3 (a cluster or the workspace,
    as the GPU holds them), over a K shorter than the ring (4 stages of 128 k: fewer than the
    32-row tile's 6, the 128-row tile's 5) and a longer one: the same bits as the calls that copy
    them after the wait (pdl=False, and the weight's first call), within the tolerance."""
    require_arch("wgmma")
    dtype = ml_dtypes.bfloat16
    monkeypatch.setattr(sm90_gemm, "sm90_plan", lambda M, N, iters, sms, **kw: (bma, splits))
    for N, K in ((264, 512), (136, 3072)):
        qw = cq.prepare_weight(
            cq.quantize_weight(
                cupy.asarray(_weights((N, K), _seed("ew", N, K), dtype, outliers=False)),
                "uint4",
                group_size=64,
                symmetric=False,
            )
        )
        a = cupy.asarray(
            np.random.default_rng(_seed("ewa", N, K)).standard_normal((bma + 7, K)).astype(np.float32).astype(dtype)
        )
        with _forced("sm90_gemm"), _launch.recording() as rec:
            outs = [poisoned((bma + 7, N), dtype) for _ in range(3)]
            cq.matmul(a, qw, out=outs[0])  # the weight's first call
            cq.matmul(a, qw, out=outs[1], pdl=False)
            cq.matmul(a, qw, out=outs[2])
        assert _early(rec, "sm90_w16_gemm") == [False, False, True], _early(rec, "sm90_w16_gemm")
        for o in outs[1:]:
            assert_bits_equal(o, cupy.asnumpy(outs[0]), f"early against not, {N}x{K}")
        assert _rel_err(outs[2], _matmul_ref(a, qw)) <= TOL[np.dtype(dtype)]


@pytest.mark.parametrize("group_size", [32, 128, None], ids=_id)
@pytest.mark.parametrize("scheme,sym", INT4_SCHEMES, ids=[s for s, _ in INT4_SCHEMES])
@pytest.mark.parametrize("dtype", HALF, ids=_id)
def test_prefill_other_tensor_core_kernel(dtype, scheme, sym, group_size):
    """On compute capability 9.0 matmul picks the wgmma kernel; the mma.sync kernel (every other
    GPU's) is held to the same bound here, at prefill sizes, and vice versa elsewhere."""
    other = "sm80_gemm" if _hopper() else "sm90_gemm"
    for N, K in [(1000, 384), (4096, 4096)]:
        wh = _weights((N, K), _seed("po", N, K, scheme, group_size, dtype), dtype, outliers=False)
        qw = cq.quantize_weight(cupy.asarray(wh), scheme, group_size=group_size, symmetric=sym)
        with _forced(other):
            _check_matmul(qw, PREFILL_MS, dtype, _seed("poa", N, K), other)


@pytest.mark.parametrize("path", ["sm80_gemm", "sm90_gemm"])
def test_split_k_counters_reset_by_the_kernel(monkeypatch, path):
    """The split-K arrival counters are zeroed once and reset by the last block of each tile, so no
    memset precedes a call (weight.py _split_counters): every call writes all of y (out= poisoned
    before each), repeated on one stream, on a second stream, and in a CUDA graph (two splits of its
    own in the zeroed slab) replayed three times over poisoned outputs; the counters are zero
    afterwards, and each stream has its own."""
    dtype = ml_dtypes.bfloat16
    N, K, M = 520, 1024, 70  # 5 tiles of 128 weight rows, M over one tile of 64 rows; 8 stages of 128 k: 4 splits of 2
    qw = cq.quantize_weight(
        cupy.asarray(_weights((N, K), 41, dtype, outliers=False)), "uint4", group_size=64, symmetric=False
    )
    a = cupy.asarray(np.random.default_rng(42).standard_normal((M, K)).astype(np.float32).astype(dtype))
    monkeypatch.setattr(sm80_gemm, "splits", lambda tiles, iters, blocks: (4, -(-iters // 4)))
    monkeypatch.setattr(sm90_gemm, "sm90_plan", lambda M, N, iters, sms, **kw: (64, 4))
    monkeypatch.setattr(sm90_gemm, "cluster_cap", lambda *a: None)  # 4 ways through the workspace
    seen = []
    real = _workspace.split_counters
    monkeypatch.setattr(_workspace, "split_counters", lambda d, n: seen.append(real(d, n)) or seen[-1])
    dev = cupy.cuda.Device().id
    with _forced(path):
        want = cupy.asnumpy(cq.matmul(a, qw))
        assert _rel_err(cupy.asarray(want), _matmul_ref(a, qw)) <= TOL[np.dtype(dtype)]
        assert seen, "the forced plan splits K through the workspace"
        buffers = set()
        for stream in (cupy.cuda.get_current_stream(), side_stream()):
            with stream:
                for rep in range(3):
                    out = poisoned((M, N), dtype)
                    assert cq.matmul(a, qw, out=out) is out
                    assert_bits_equal(out, want, f"call {rep} on stream {stream.ptr}")
                stream.synchronize()
                buf = _workspace.stream_counters[(dev, stream.ptr)]
                assert int(cupy.count_nonzero(buf)) == 0, "counters reset by the kernel"
                buffers.add(buf.data.ptr)
        assert len(buffers) == 2, "one counter buffer per stream"
        slab = _workspace.graph_slabs[dev]
        start = slab[1]
        outs = [cupy.empty((M, N), dtype) for _ in range(2)]
        stream = side_stream()
        with stream:
            stream.begin_capture()
            for o in outs:
                cq.matmul(a, qw, out=o)
            graph = stream.end_capture()
            n1, n2 = seen[-2].size, seen[-1].size
            assert slab[1] == start + n1 + n2, "each captured call takes counters of its own from the slab"
            assert seen[-2].data.ptr == slab[0].data.ptr + 4 * start
            assert seen[-1].data.ptr == slab[0].data.ptr + 4 * (start + n1)
            for rep in range(3):
                for o in outs:
                    o.view(np.uint16).fill(0x7FC1)  # NaN: an output left unwritten fails
                graph.launch(stream)
                stream.synchronize()
                for i, o in enumerate(outs):
                    assert_bits_equal(o, want, f"graph replay {rep}, call {i}")
            assert int(cupy.count_nonzero(slab[0][start : slab[1]])) == 0


@pytest.mark.parametrize("splits", [1, 2, 3], ids=["whole-K", "split2-K", "split3-K"])
@pytest.mark.parametrize(
    "path,bma",
    [("sm80_gemm", 64), ("sm90_gemm", 32), ("sm90_gemm", 64), ("sm90_gemm", 128), ("sm90_gemm", 256)],
    ids=["sm80_gemm", "wgmma-32", "wgmma-64", "wgmma-128", "wgmma-256"],
)
def test_tensor_core_out_tails_and_batches(monkeypatch, path, bma, splits):
    """Odd N (a partial last tile of weight rows), M not a multiple of the tile, batched input, and
    out= buffers that are not 16-byte aligned (the epilogue's scalar path) give the same bits as
    the aligned call; with K whole in each block, and split 2 ways (wgmma: a cluster whose blocks
    each write their share of y) and 3 ways (the last block of each tile writes y from the float32
    partials), each through its own 8-byte and scalar paths. The wgmma kernel runs each tile height
    (activation rows a block: 32, 64, 128, 256), whose unsplit epilogues store their tiles to shared
    memory with stmatrix, four 8 x 8 tiles a warp at a time (M = 291 leaves a partial last tile)."""
    dtype = ml_dtypes.bfloat16
    N, K = 1001, 640
    qw = cq.quantize_weight(cupy.asarray(_weights((N, K), 21, dtype)), "uint4", group_size=64, symmetric=False)
    rng = np.random.default_rng(22)
    a = cupy.asarray(rng.standard_normal((3, 97, K)).astype(np.float32).astype(dtype))
    # 5 stages of 128 k (10 of 64 k for the 256-row tile): 2 splits of 3 stages (5), 3 splits of 2 (4)
    monkeypatch.setattr(sm80_gemm, "splits", lambda tiles, iters, blocks: (splits, -(-iters // splits)))
    monkeypatch.setattr(sm90_gemm, "sm90_plan", lambda M, N, iters, sms, **kw: (bma, splits))
    monkeypatch.setattr(sm90_gemm, "cluster_cap", lambda *a: None)  # 3 ways through the workspace, whatever the GPU
    with _forced(path):
        y = cq.matmul(a, qw)
        assert y.shape == (3, 97, N)
        assert _rel_err(y, _matmul_ref(a.reshape(-1, K), qw)) <= TOL[np.dtype(dtype)]
        for off in (1, 3):
            buf = poisoned((3 * 97 * N + off,), dtype)
            out = buf[off:].reshape(3, 97, N)
            assert cq.matmul(a, qw, out=out) is out
            assert_bits_equal(out, cupy.asnumpy(y), f"out= offset {off}")
            assert_bits_equal(buf[:off], cupy.asnumpy(poisoned((off,), dtype)), "before out=")


@pytest.mark.parametrize("scheme,sym", SCHEMES, ids=[s for s, _ in SCHEMES])
def test_matmul_batched_strided_and_out(scheme, sym):
    dtype = ml_dtypes.bfloat16
    N, K = 384, 512
    qw = cq.quantize_weight(cupy.asarray(_weights((N, K), 5, dtype)), scheme, group_size=128, symmetric=sym)
    rng = np.random.default_rng(6)
    a = cupy.asarray(rng.standard_normal((2, 3, K)).astype(np.float32).astype(dtype))
    y = cq.matmul(a, qw)
    assert y.shape == (2, 3, N)
    assert _rel_err(y, _matmul_ref(a, qw)) <= TOL[np.dtype(dtype)]
    # the same rows one at a time: the kernel's result for a row does not depend on the others
    y1 = cq.matmul(a[1, 2], qw)
    assert y1.shape == (N,)
    assert_bits_equal(y1, cupy.asnumpy(y[1, 2]), "row alone")
    # strided (every other column of a wider array) and offset views are copied first
    wide = cupy.asarray(rng.standard_normal((5, 2 * K + 1)).astype(np.float32).astype(dtype))
    for view in (wide[:, 1 : 2 * K + 1 : 2], wide[:, 1 : K + 1]):
        want = cq.matmul(cupy.ascontiguousarray(view), qw)
        assert_bits_equal(cq.matmul(view, qw), cupy.asnumpy(want), "view")
    out = poisoned((2, 3, N), dtype)
    assert cq.matmul(a, qw, out=out) is out
    assert_bits_equal(out, cupy.asnumpy(y), "out=")
    # M = 0
    assert cq.matmul(a[:0], qw).shape == (0, 3, N)


def test_decode_launches_the_configuration_it_picks(monkeypatch):
    """matmul launches the decode kernel in the configuration _decode_config names for the device's
    SM count (blocks of 4, 8 or 16 warps), with that many threads, and with MM_FOUR_WIDE's K split
    (compute capability 9.0+) as a grid of that many blocks along z in clusters of 1 x 1 x splits."""
    picked = []
    pick = decode.decode_config
    monkeypatch.setattr(decode, "decode_config", lambda *a: picked.append(pick(*a)) or picked[-1])
    dtype = ml_dtypes.bfloat16
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    hopper = _device.caps(cupy.cuda.Device().id).pdl
    seen, split_seen = set(), set()
    # 16 x SMs rows: one block of 16 rows (M <= 8) a SM; 128 x SMs rows, K = 1024: 8 blocks of 4
    # warps a SM, at M = 16 two blocks of 64 rows (MM_FOUR); 64 x SMs rows: one block of 64 rows a
    # SM (MM_FOUR_WIDE); 32 x SMs rows with K = 8192 (64 chunks): half a block of 64 rows a SM, K
    # split 2 ways (MM_FOUR_WIDE) at M = 16 but not at M = 9
    for N, K in ((16 * sms, 4096), (16 * 8 * sms, 1024), (5000, 2048), (64 * sms, 1024), (32 * sms, 8192)):
        qw = cq.prepare_weight(
            cq.quantize_weight(cupy.asarray(_weights((N, K), 3, dtype, outliers=False)), "int4", group_size=128)
        )
        for M in (1, 9, 16):
            picked.clear()
            a = cupy.asarray(np.random.default_rng(M).standard_normal((M, K)).astype(np.float32).astype(dtype))
            y, launched = _launches(lambda: cq.matmul(a, qw))
            assert _rel_err(y, _matmul_ref(a, qw)) <= TOL[np.dtype(dtype)]
            want = pick(
                -(-N // (32 if M > 8 else 16)),
                sms,
                K // 128,
                M > 8,
                -(-N // 64) if M > 8 else 0,
                hopper and M >= 16,
                True,
            )
            assert picked == [want]
            assert len(launched) == 1, (N, M, launched)
            k, grid, block, _, _, launch = launched[0]
            dev, bf16 = cupy.cuda.Device().id, _dtypes.input_type(dtype).ctype
            assert k is _jit.kernel(dev, decode.FAMILY, "w16_decode", bf16, 0, *want.targs, True), (N, M, k.name)
            rows = want.rows
            splits = decode.decode_splits(want, -(-N // rows), sms, K // 128) if hopper else 1
            assert block == (32 * want.warps, 1, 1), (N, M, block)
            assert grid == (-(-N // rows), 1, splits), (N, M, grid)
            assert launch.cluster == ((1, 1, splits) if splits > 1 else None), (N, M, launch.cluster)
            seen.add(want)
            if splits > 1:
                split_seen.add((N, M))
    # whatever the SM count, N = 16 x SMs with K = 4096 takes blocks of 16 warps (one block of 16
    # rows a SM) and N = 128 x SMs with K = 1024 blocks of 4 (one wave of 8 a SM); at M = 16 the
    # latter is 2 x SMs blocks of 64 rows (MM_FOUR)
    assert {c.warps for c in seen} >= {4, 16}, seen
    assert {decode.R64_W4_B2, decode.R64_W8_B1} <= seen, seen
    assert split_seen == ({(32 * sms, 16)} if hopper else set()), split_seen


@pytest.mark.parametrize("scheme,sym", SCHEMES, ids=[s for s, _ in SCHEMES])
def test_decode_configs_agree(monkeypatch, scheme, sym):
    """The decode kernel's configurations, each forced in turn (weight.py _decode_config picks one by
    waves): at M <= 8 blocks of 8 warps in two register budgets (3 or 4 blocks per SM), which compute
    the same sums in the same order and must give the same bits, and blocks of 16 and 4 warps, which
    split K 16 and 4 ways; at M > 8 (M tiles of 16 rows) blocks of 8, 4 and 16 warps of 32 weight
    rows, of 4 and 8 warps of 64 rows (MM_FOUR, MM_FOUR_WIDE; with M = 33, three M tiles), and of 8
    warps of 32 rows one per SM (MM_TWO_ONE; groups of 64, so its one set of sums). Odd N exercises the
    clamped tail rows (N = 1000 leaves 40 rows, 3 of 4 tiles, in the last block of 64), and K = 1024
    (8 chunks) leaves half of a 16-warp block idle. Every configuration is held to the error
    bound."""

    dtype = ml_dtypes.bfloat16
    N, K = 1000, 1024
    qw = cq.quantize_weight(
        cupy.asarray(_weights((N, K), 14, dtype, outliers=False)), scheme, group_size=64, symmetric=sym
    )
    got = {}
    monkeypatch.setattr(dispatch, "_FORCED", "decode")  # M = 33 takes wgmma on compute capability 9.0
    for cfg, ms in (
        (decode.R16_W8_B3, (1, 5, 8)),
        (decode.R16_W8_B4, (1, 5, 8)),
        (decode.R16_W16_B2, (1, 5, 8)),
        (decode.R16_W4_B8, (1, 5, 8)),
        (decode.R32_W8_B2, (9, 16)),
        (decode.R32_W4_B4, (9, 16)),
        (decode.R32_W16_B1, (9, 16)),
        (decode.R64_W4_B2, (9, 16, 33)),
        (decode.R64_W8_B1, (9, 16, 33)),
        (decode.R32_W8_B1_EVEN_ODD, (9, 16, 33)),
    ):
        monkeypatch.setattr(decode, "decode_config", lambda *args, cfg=cfg: cfg)
        _plans.clear()
        for M in ms:
            a = cupy.asarray(np.random.default_rng(M).standard_normal((M, K)).astype(np.float32).astype(dtype))
            out = poisoned((M, N), dtype)
            cq.matmul(a, qw, out=out)
            assert _rel_err(out, _matmul_ref(a, qw)) <= TOL[np.dtype(dtype)], (cfg, M)
            got.setdefault((cfg, M), cupy.asnumpy(out))
    for M in (1, 5, 8):
        assert_bits_equal(
            cupy.asarray(got[decode.R16_W8_B4, M]), got[decode.R16_W8_B3, M], f"M={M}: 4 blocks per SM vs 3"
        )


def test_decode_k_split_exact_and_deterministic(monkeypatch):
    """The decode kernel's K split across the blocks of a cluster (compute capability 9.0+), forced
    for configurations the wrapper never splits too: with integer weights whose group scales are 1
    and small integer activations every product and partial sum is exact in float32, so whatever
    the split, each output must be the float64 product rounded once, bit for bit (an output left
    unwritten, added twice or from the wrong block fails). Splits of 2, 3 and 8 over K = 2048 (16
    chunks: with 8 blocks of 8 warps most warps get no chunk), N = 1000 (a partial last tile),
    M = 1, 5 (M tiles of 8 rows), 9, 16 and 33, and MM_TWO_ONE unsplit and split, whose two sets of
    partial sums (even and odd k16 steps of a chunk) must both reach the output; the 64-row blocks
    (MM_FOUR, MM_FOUR_WIDE: two sets, the weight registers of two k16 steps regrouped into each mma)
    in fp16 and bf16; and the wrapper's own split run twice gives the same bits."""

    require_arch("pdl")  # the decode K split runs as thread-block clusters: compute capability 9.0+
    rng = np.random.default_rng(18)
    N, K = 1000, 2048
    w = rng.integers(-7, 8, (N, K)).astype(np.float32)
    w[:, ::128] = 7  # amax 7 in every group of 128: scale exactly 1
    monkeypatch.setattr(dispatch, "_FORCED", "decode")  # M = 33 takes wgmma otherwise
    fp16_cases = (
        (decode.R64_W8_B1, 2, (9, 16, 33)),
        (decode.R64_W8_B1, 3, (16,)),
        (decode.R64_W4_B2, 2, (16, 33)),
        (decode.R32_W16_B1, 2, (9,)),
        (decode.R32_W8_B2, 8, (16,)),
        (decode.R16_W8_B3, 2, (1, 5)),
        (decode.R16_W16_B2, 8, (1,)),
        (decode.R32_W8_B1_EVEN_ODD, 1, (9, 16, 33)),
        (decode.R32_W8_B1_EVEN_ODD, 2, (16,)),
    )
    # bf16 (its own code extraction): the 64-row blocks, whose mma pair the weight registers of two
    # k16 steps and keep two sets of partial sums, unsplit and split
    bf16_cases = ((decode.R64_W8_B1, 1, (16, 33)), (decode.R64_W8_B1, 2, (9,)), (decode.R64_W4_B2, 1, (16,)))
    for dtype, cases in ((np.float16, fp16_cases), (ml_dtypes.bfloat16, bf16_cases)):
        qw = cq.prepare_weight(cq.quantize_weight(cupy.asarray(w.astype(dtype)), "int4", group_size=128))
        for cfg, splits, ms in cases:
            monkeypatch.setattr(decode, "decode_config", lambda *args, cfg=cfg: cfg)
            monkeypatch.setattr(decode, "decode_splits", lambda *args, splits=splits: splits)
            _plans.clear()
            for M in ms:
                a = rng.integers(-4, 5, (M, K)).astype(dtype)
                out = poisoned((M, N), dtype)
                cq.matmul(cupy.asarray(a), qw, out=out)
                want = (a.astype(np.float64) @ w.T).astype(np.float32).astype(dtype)  # exact in float32, one rounding
                assert_bits_equal(out, want, f"{np.dtype(dtype)} cfg {cfg} splits {splits} M={M}")
    monkeypatch.undo()
    # the wrapper's own pick for 32 x SMs rows of 64 chunks at M = 16 is split (test above): the
    # sum order is fixed, so two calls agree bit for bit
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    qw = cq.quantize_weight(
        cupy.asarray(_weights((32 * sms, 8192), 5, ml_dtypes.bfloat16, outliers=False)), "int4", group_size=128
    )
    a = cupy.asarray(np.random.default_rng(3).standard_normal((16, 8192)).astype(np.float32).astype(ml_dtypes.bfloat16))
    y1, y2 = cq.matmul(a, qw), cq.matmul(a, qw)
    assert_bits_equal(y2, cupy.asnumpy(y1), "split K, second call")
    assert _rel_err(y1, _matmul_ref(a, qw)) <= TOL[np.dtype(ml_dtypes.bfloat16)]


def test_weight_with_empty_k_is_rejected():
    """quantize_weight never makes K = 0; a hand-built one is a ValueError, not a kernel reading
    before its rows (or a division by the zero group size)."""
    sch = weight_scheme("int4", None, 0, np.float16)
    w = cq.QuantizedWeight(cupy.zeros((4, 0), np.uint8), cupy.zeros((4, 0), np.float16), None, sch, (4, 0), np.float16)
    with pytest.raises(ValueError, match=r"w\.shape must be"):
        cq.matmul(cupy.zeros((1, 0), np.float16), w)
    with pytest.raises(ValueError, match=r"w\.shape must be"):
        w.dequantize()


def test_matmul_exact_small_case():
    """Small integers and power-of-two scales make every product and sum exact in float32: the
    result must equal the float64 product bit for bit after rounding."""
    dtype = np.float16
    rng = np.random.default_rng(9)
    N, K = 64, 256
    w = rng.integers(-7, 8, (N, K)).astype(np.float32)
    w[:, 0] = 7  # amax 7 in every group: scale exactly 1
    w[:, 128] = -7
    qw = cq.quantize_weight(cupy.asarray(w.astype(dtype)), "int4", group_size=128)
    a = rng.integers(-4, 5, (5, K)).astype(np.float16)
    y = cq.matmul(cupy.asarray(a), qw)
    want = (a.astype(np.float64) @ w.T).astype(np.float16)
    assert_bits_equal(y, want, "exact integer matmul")


def _untouched(buf, before):
    assert_bits_equal(buf, before, "buffer changed by a failed call")


def test_validation_errors():
    dtype = ml_dtypes.bfloat16
    w = cupy.asarray(_weights((64, 256), 3, dtype))
    with pytest.raises(ValueError, match="group_size"):
        cq.quantize_weight(w, "int4", group_size=48)
    with pytest.raises(ValueError, match="group_size"):
        cq.quantize_weight(cupy.ascontiguousarray(w[:, :96]), "int4", group_size=64)
    with pytest.raises(ValueError, match="dtype"):
        cq.quantize_weight(w, "int8")
    with pytest.raises(ValueError, match="symmetric"):
        cq.quantize_weight(w, "float8_e4m3fn", symmetric=False)
    with pytest.raises(ValueError, match="w must be C-contiguous"):
        cq.quantize_weight(w[:, ::2], "int4", group_size=32)
    with pytest.raises(ValueError, match="2-D"):
        cq.quantize_weight(w[0], "int4")
    with pytest.raises(TypeError, match="w must be a cupy.ndarray"):
        cq.quantize_weight(cupy.asnumpy(w), "int4")
    with pytest.raises(TypeError, match="w"):
        cq.quantize_weight(w.astype(cupy.int32), "int4")

    qw = cq.quantize_weight(w, "int4", group_size=128)
    a = cupy.ones((4, 256), dtype=dtype)
    out = poisoned((4, 64), dtype)
    before = cupy.asnumpy(out)
    with pytest.raises(ValueError, match="K = 256"):
        cq.matmul(cupy.ones((4, 128), dtype=dtype), qw, out=out)
    with pytest.raises(TypeError, match="a must be float16 or bfloat16"):
        cq.matmul(a.astype(cupy.float32), qw, out=out)
    with pytest.raises(TypeError, match="scales are bfloat16 but a is float16"):
        cq.matmul(a.astype(cupy.float16), qw)
    with pytest.raises(TypeError, match="w must be a QuantizedWeight"):
        cq.matmul(a, w)
    with pytest.raises(ValueError, match="out must have shape"):
        cq.matmul(a, qw, out=poisoned((4, 65), dtype))
    with pytest.raises(ValueError, match="overlaps a"):
        cq.matmul(a, qw, out=a.reshape(-1)[:256].reshape(4, 64))
    _untouched(out, before)
    q_odd = cq.quantize_weight(cupy.asarray(_weights((8, 96), 4, dtype)), "int4", group_size=32)
    with pytest.raises(ValueError, match="multiple of 128"):
        cq.matmul(cupy.ones((1, 96), dtype=dtype), q_odd)
    q_nc = cq.quantize_weight(w, "int4", group_size=128)
    q_nc.data = q_nc.data[:, ::-1]
    with pytest.raises(ValueError, match="w.data must be C-contiguous"):
        cq.matmul(a, q_nc)
