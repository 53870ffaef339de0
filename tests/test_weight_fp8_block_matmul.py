"""The weight-only matmul with FP8 (E4M3) weights in 128 x 128 blocks and their float32 block
scales, every kernel forced in turn. Every path multiplies ``a`` by the weight dequantized to a's
dtype as :func:`cupyquant.reference.weight_matmul_blocks` defines it (each E4M3 value times its
block's float32 scale in an IEEE float32 multiply, rounded once to a's dtype: ``w.dequantize(a.dtype)``;
the scale is never rounded to 16 bits), so each output is within
:func:`cupyquant.reference.weight_matmul_error_bound` of the float64 product (float32 sums, one
rounding to a's dtype: the bound of the FP8 group tests, tests/_fp4.py err_ratio), and bit-exact
where every sum is exact: small integer activations times E4M3 values of few bits and
power-of-two block scales, and one-hot activations, whose outputs are single weights, each the
product of its code and exactly its block's float32 scale (full 24-bit significands there, so a
scale rounded to 16 bits or taken from the wrong block shows). Then the gemms' tiles and K splits,
partial blocks (N and K past whole blocks), tails of M and N, out= buffers at odd offsets, CUDA
graphs, leading dimensions of a, and the planner's choice launched. The CPU tests at the end: the
planner takes block weights where it takes FP8 groups, and the checks of a block weight's arrays."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest
from _fp4 import HALF, assert_exact
from _fp4 import dtype_id as _id
from conftest import assert_bits_equal, poisoned
from test_weight_fp8_matmul import (
    _FEW_BITS,
    PATHS,
    SM90_CASES,
    SM90_TILES,
    _seed,
    _weights,
    check_out_and_graph,
    planned_matmul,
)
from test_weight_fp8_matmul import forced as forced  # the fixture

import cupyquant as cq
from cupyquant import _device, _plans
from cupyquant import reference as ref
from cupyquant import weight as cqw
from cupyquant.weight import checks, dispatch, sm90_gemm
from cupyquant.weight.formats import weight_scheme

try:
    import cupy
except ImportError:  # the GPU tests skip; the CPU tests run
    cupy = None

FP8 = "float8_e4m3fn"
BLOCK = (128, 128)
MS = [1, 2, 7, 16, 17, 33, 64, 65, 256, 1000]
# N at and off the 16-row tiles and the 128-row blocks; K at and off the gemms' stages and blocks
SHAPES = [(128, 128), (200, 384), (1000, 1024), (4096, 640)]
# K past whole blocks (a last block of 64 k): the decode kernel's, whose K step is 64
DECODE_SHAPES = [(130, 192), (264, 320)]
gpu = pytest.mark.gpu


def _host(qw):
    """The plain weight's codes (uint8) and block scales (float32) on the host."""
    p = qw.plain()
    return cupy.asnumpy(p.data), cupy.asnumpy(p.scale)


def _ratio(y, a, qw):
    """max |y - ref| / weight_matmul_error_bound (the reference's, on the host)."""
    ah = cupy.asnumpy(a)
    data, scales = _host(qw)
    want, S = ref.weight_matmul_blocks(ah, data, scales)
    bound = ref.weight_matmul_error_bound(want, S, ah.shape[-1], ah.dtype)
    r = np.abs(cupy.asnumpy(y).astype(np.float64) - want) / bound
    return float(np.where(np.isfinite(r), r, np.inf).max())


def _matmul(a, qw):
    """cq.matmul into a poisoned out= buffer (every output must be written)."""
    out = poisoned(a.shape[:-1] + (qw.shape[0],), a.dtype)
    assert cq.matmul(a, qw, out=out) is out
    return out


def _full_scales(rng, shape):
    """float32 block scales 2^e (1 + f), f of 23 random bits: not one of them a 16-bit value."""
    f = rng.integers(1, 2**23, shape).astype(np.float64) * 2.0**-23
    return np.ldexp(1.0 + f, rng.integers(-3, 1, shape)).astype(np.float32)


def _block_weight(codes, scales, dtype):
    N, K = codes.shape
    scheme = weight_scheme(FP8, None, K, np.float32, block=BLOCK)
    return cq.QuantizedWeight(cupy.asarray(codes), cupy.asarray(scales), None, scheme, (N, K), dtype)


def _exact_weight(N, K, dtype, rng, full=False):
    """A plain block weight of E4M3 values of _FEW_BITS (multiples of 2^-5 below 8) and block scales
    2^e, e in -2..1 (or, ``full``, scales of 24 significant bits for one-hot activations): with
    integer activations in [-4, 4] and K <= 1280 every partial sum is a multiple of 2^-7 below 2^17,
    exact in float32."""
    codes = _FEW_BITS[rng.integers(0, len(_FEW_BITS), (N, K))]
    grid = (-(-N // 128), -(-K // 128))
    scales = _full_scales(rng, grid) if full else np.ldexp(1.0, rng.integers(-2, 2, grid)).astype(np.float32)
    return _block_weight(codes, scales, dtype)


def _ints(rng, M, K, dtype):
    a = rng.integers(-4, 5, (M, K)).astype(np.float32)
    return a, cupy.asarray(a.astype(dtype))


def _onehot(K, dtype):
    """One row per 64 k (each 128-k block twice, the last partial one included), one-hot at a
    different place in each: row i's outputs are single weights of k block i // 2."""
    nr = -(-K // 64)
    a = np.zeros((nr, K), np.float32)
    a[np.arange(nr), np.minimum(np.arange(nr) * 64 + (np.arange(nr) * 7) % 64, K - 1)] = 1.0
    return a, cupy.asarray(a.astype(dtype))


def _exact_check(qw, what, rng, Ms=(1, 16, 17, 64, 65)):
    """Exact sums bit for bit: one-hot activations and small integer ones."""
    N, K = qw.shape
    dtype = qw.dtype
    data, scales = _host(qw)
    W = ref.dequantize_weight_blocks(data, scales, dtype).astype(np.float64)
    oh, ohd = _onehot(K, dtype)
    assert_exact(_matmul(ohd, qw), oh @ W.T, f"{what} one-hot")
    for M in Ms:
        a, ad = _ints(rng, M, K, dtype)
        assert_exact(_matmul(ad, qw), a @ W.T, f"{what} M={M} exact sums")


# ---------------------------------------------------------------- every path
@gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", HALF, ids=_id)
def test_block_matmul_within_bound(forced, dtype, path):
    """Every kernel forced, M from 1 to 1000, N and K at and off the tiles, stages and blocks (on the
    decode kernel also K past whole blocks), out= poisoned, within the reference's bound; the plain
    weight (prepared inside the call) gives the prepared weight's bits."""
    forced(path)
    for N, K in SHAPES + (DECODE_SHAPES if path == "decode" else []):
        qw = cq.quantize_weight(_weights((N, K), _seed("block", N, K), dtype), FP8, block_size=BLOCK)
        qp = cq.prepare_weight(qw)
        rng = np.random.default_rng(_seed("a", N, K))
        for i, M in enumerate(MS):
            a = cupy.asarray(rng.standard_normal((M, K)).astype(np.float32).astype(dtype))
            y = _matmul(a, qp)
            r = _ratio(y, a, qw)
            assert r <= 1.0, f"{path} M={M} N={N} K={K}: error {r:.3g} of the bound"
            if i == 0:
                assert_bits_equal(cq.matmul(a, qw), cupy.asnumpy(y), "plain vs prepared weight")


@gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", HALF, ids=_id)
def test_block_matmul_exact(forced, dtype, path):
    """One-hot activations against weights whose block scales have 24 significant bits (each output
    one weight: its code times exactly its block's float32 scale, rounded once), then small integer
    activations whose sums are exact, bit for bit. N = 264: a partial 16-row tile, a partial
    128-row tile and a partial row of blocks (8 rows); on the decode kernel also K = 1216, whose
    last block is 64 k."""
    forced(path)
    rng = np.random.default_rng(_seed("exact", path))
    for K in (1280, 1216) if path == "decode" else (1280,):
        for full in (True, False):
            qw = cq.prepare_weight(_exact_weight(264, K, dtype, rng, full))
            _exact_check(qw, f"{path} K={K} full-scales={full}", rng, Ms=(1, 17) if full else (1, 16, 17, 64, 65))


# ---------------------------------------------------------------- the gemms' tiles and K splits
@gpu
@pytest.mark.parametrize("dtype", HALF, ids=_id)
def test_block_sm80_k_splits_exact(forced, dtype):
    """The sm80 gemm's K split through the workspace (the planner's, and 1, 2, 3 forced), every tile
    (M 9 to 1000): exact sums, bit for bit."""
    rng = np.random.default_rng(_seed("sm80 block splits"))
    for N, K in ((200, 384), (4096, 640), (128, 1280)):
        qw = cq.prepare_weight(_exact_weight(N, K, dtype, rng))
        data, scales = _host(qw)
        W = ref.dequantize_weight_blocks(data, scales, dtype).astype(np.float64)
        for M in (9, 17, 64, 65, 256, 1000):
            a, ad = _ints(rng, M, K, dtype)
            for splits in (None, 1, 2, 3):
                forced("sm80_gemm", splits=splits)
                assert_exact(_matmul(ad, qw), a @ W.T, f"M={M} N={N} K={K} splits {splits}")


@gpu
@pytest.mark.parametrize("rows,splits", SM90_CASES, ids=[f"{r}-{s}" for r, s in SM90_CASES])
@pytest.mark.parametrize("dtype", HALF, ids=_id)
def test_block_sm90_tiles_and_splits(forced, monkeypatch, dtype, rows, splits):
    """Each wgmma tile, K whole and split (as clusters and through the workspace: the same bits; the
    256-row tile's stages of 64 k take each block's scale twice): exact sums and one-hot rows bit for
    bit, random weights within the bound (N = 520: a partial 16-row tile and row of blocks)."""
    rng = np.random.default_rng(_seed("sm90 block", rows, splits))
    N, K = 520, 1280
    forced("sm90_gemm", rows, splits)
    qe = cq.prepare_weight(_exact_weight(N, K, dtype, rng))
    qf = cq.prepare_weight(_exact_weight(N, K, dtype, rng, full=True))
    qw = cq.prepare_weight(cq.quantize_weight(_weights((N, K), _seed("sm90b"), dtype), FP8, block_size=BLOCK))
    for M in (17, rows + 5):
        ar = cupy.asarray(rng.standard_normal((M, K)).astype(np.float32).astype(dtype))
        got = {}
        for on in (True, False) if splits > 1 else (True,):
            monkeypatch.setattr(sm90_gemm, "CLUSTER_SPLITS", on)
            _plans.clear()
            what = f"M={M} tile {rows} splits {splits} cluster {on}"
            _exact_check(qe, what, rng, Ms=(M,))
            _exact_check(qf, what + " full scales", rng, Ms=())
            got[on] = _matmul(ar, qw)
            r = _ratio(got[on], ar, qw)
            assert r <= 1.0, f"{what}: error {r:.3g} of the bound"
        if len(got) == 2:
            assert_bits_equal(got[True], cupy.asnumpy(got[False]), f"M={M}: cluster against workspace")


# ---------------------------------------------------------------- tails, out=, graphs
TAIL_CASES = [("decode", None, None)] + [("sm80_gemm", None, s) for s in (1, 2, 3)]
TAIL_CASES += [("sm90_gemm", r, s) for r in SM90_TILES for s in (1, 2, 3)]


@gpu
@pytest.mark.parametrize("path,rows,splits", TAIL_CASES, ids=[f"{p}-{r}-{s}" for p, r, s in TAIL_CASES])
@pytest.mark.parametrize("dtype", HALF, ids=_id)
def test_block_tails_out_and_graph(forced, monkeypatch, dtype, path, rows, splits):
    """Odd N (a partial last tile and row of blocks), M = 3 x 97 as a batch (leading dimensions of
    a), out= buffers at odd element offsets give the bits of the aligned call, untouched before
    them; a CUDA graph replayed over a poisoned out= gives them again. K whole, split 2 ways (sm90:
    a cluster) and 3 ways (the workspace)."""
    N, K = 1001, 640
    forced(path, rows, splits)
    monkeypatch.setattr(sm90_gemm, "cluster_cap", lambda *a: None)  # 3 ways through the workspace, whatever the GPU
    qw = cq.prepare_weight(cq.quantize_weight(_weights((N, K), 31, dtype), FP8, block_size=BLOCK))
    rng = np.random.default_rng(32)
    a = cupy.asarray(rng.standard_normal((3, 97, K)).astype(np.float32).astype(dtype))
    y = cq.matmul(a, qw)
    assert y.shape == (3, 97, N) and y.dtype == np.dtype(dtype)
    r = _ratio(y, a, qw)
    assert r <= 1.0, f"error {r:.3g} of the bound"
    check_out_and_graph(a, qw, y, dtype)


# ---------------------------------------------------------------- the planner, the layout, the checks
@gpu
def test_block_matmul_launches_the_path_it_names():
    """Without a forced path, block weights take the kernel matmul_path names (FP8's rules: the
    decode kernel up to PATHS.fp8_decode_max_m and for K past whole 128-k stages, the GPU's gemm at
    M = 1000 and 4096), its float32-scale build (scheme 6, W_FP8_BLOCK), within the bound; the
    same prepared weight serves fp16 and bf16 activations (its scales are float32)."""
    rng = np.random.default_rng(5)
    gemm = "sm90_gemm" if _device.caps(cupy.cuda.Device().id).wgmma else "sm80_gemm"
    for dtype in HALF:
        for N, K in ((4096, 4096), (512, 192)):
            qw = cq.prepare_weight(cq.quantize_weight(_weights((N, K), 6, np.float32), FP8, block_size=BLOCK))
            for M in (1, 16, 17, 64, 1000, 4096):
                a = cupy.asarray(rng.standard_normal((M, K)).astype(np.float32).astype(dtype))
                y, want, name = planned_matmul(a, qw, gemm)
                assert re.search(r"I(6__half|13__nv_bfloat16)Li6E", name), f"not the W_FP8_BLOCK build: {name}"
                r = _ratio(y, a, qw)
                assert r <= 1.0, f"{_id(dtype)} M={M} N={N} K={K} ({want}): error {r:.3g} of the bound"


@gpu
def test_block_prepared_layout_round_trip():
    """prepare_weight of a block weight is the reference's layout bit for bit (N and K past whole
    blocks), plain() gives back the codes and the block scales, and the prepared weight
    dequantizes to the plain one's bits."""
    rng = np.random.default_rng(7)
    for N, K in ((200, 192), (16, 64), (1000, 1280)):
        codes = rng.integers(0, 256, (N, K), dtype=np.uint8)
        scales = _full_scales(rng, (-(-N // 128), -(-K // 128)))
        qw = _block_weight(codes, scales, ml_dtypes.bfloat16)
        qp = cq.prepare_weight(qw)
        checks.check_arrays(qp)
        d, s, _ = ref.prepare_weight(codes, scales, scheme=FP8, block_size=BLOCK)
        assert_bits_equal(qp.data, d, f"{N} x {K} data")
        assert_bits_equal(qp.scale, s, f"{N} x {K} scales")
        back = qp.plain()
        assert_bits_equal(back.data, codes, "plain data")
        assert_bits_equal(back.scale, scales, "plain scales")
        for t in HALF:
            assert_bits_equal(qp.dequantize(t), cupy.asnumpy(qw.dequantize(t)), "dequantized")


@gpu
def test_block_matmul_errors():
    """A block weight whose K is not a multiple of 64 (the decode kernel's K step) cannot be prepared
    or multiplied; a gemm forced with K not a multiple of 128 is refused before any launch (out=
    untouched); float32 activations are refused; int8 weights still are; a prepared block weight
    with 16-bit scales is refused by name."""
    bf = ml_dtypes.bfloat16
    rng = np.random.default_rng(8)
    qw = _block_weight(rng.integers(0, 120, (64, 200), dtype=np.uint8), np.ones((1, 2), np.float32), bf)
    with pytest.raises(ValueError, match="multiple of 64"):
        cq.prepare_weight(qw)
    with pytest.raises(ValueError, match="multiple of 64"):
        cq.matmul(cupy.ones((2, 200), bf), qw)
    qw = cq.prepare_weight(
        _block_weight(rng.integers(0, 120, (64, 192), dtype=np.uint8), np.ones((1, 2), np.float32), bf)
    )
    out = poisoned((5, 64), bf)
    before = cupy.asnumpy(out)
    with dispatch._forced_path("sm80_gemm"):
        _plans.clear()
        with pytest.raises(ValueError, match=r"w's K = 192 must be a multiple of 128"):
            cq.matmul(cupy.ones((5, 192), bf), qw, out=out)
    _plans.clear()
    assert_bits_equal(out, before, "out= after a failed call")
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        cq.matmul(cupy.ones((5, 192), np.float32), qw)
    bad = qw.copy()
    bad.scale = bad.scale.astype(bf)
    with pytest.raises(ValueError, match="w.scale must be float32"):
        cq.matmul(cupy.ones((5, 192), bf), bad)
    q8 = cq.quantize_weight(cupy.ones((64, 128), bf), "int8", group_size=None)
    with pytest.raises(ValueError, match="int8 .*scaled_matmul"):
        cq.matmul(cupy.ones((5, 128), bf), q8)


# ---------------------------------------------------------------- CPU: the planner and the checks
def _host_weight(N, K, data_layout="plain", scale=None, data=None):
    """A block weight of NumPy arrays (what the planner and _check_block_weight read of it)."""
    n16 = -(-N // 16)
    if data is None:
        data = np.zeros((N, K) if data_layout == "plain" else (n16, K // 64, 16, 64), np.uint8)
    if scale is None:
        scale = np.zeros(
            (-(-N // 128), -(-K // 128)) if data_layout == "plain" else (n16, -(-K // 128), 16), np.float32
        )
    scheme = weight_scheme(FP8, None, K, np.float32, block=BLOCK)
    return cq.QuantizedWeight(data, scale, None, scheme, (N, K), ml_dtypes.bfloat16, data_layout=data_layout)


def test_block_weight_paths_are_fp8_paths():
    """matmul_path takes a block weight as it takes an FP8 weight in groups (no ValueError any
    more), on compute capability 9.0 and 8.0, over M, N and K (K past whole 128-k stages: the
    decode kernel); int8 weights are still refused."""
    for arch in ("90", "80"):
        for N, K in ((4096, 4096), (28672, 8192), (4096, 14336), (512, 192), (200, 320)):
            qb = _host_weight(N, K)
            qg = cq.QuantizedWeight(
                np.zeros((N, K), np.uint8), np.zeros((N, K // 64), np.float32), None, weight_scheme(FP8, 64, K, np.float32),
                (N, K), np.float32,
            )  # fmt: skip
            for M in (1, 16, 17, 32, 33, 64, 65, 256, 257, 1024, 4096):
                assert cqw.matmul_path(M, qb, arch=arch, sms=132) == cqw.matmul_path(M, qg, arch=arch, sms=132)
    scheme8 = weight_scheme("int8", None, 128, np.float32)
    q8 = cq.QuantizedWeight(
        np.zeros((4, 128), np.int8),
        np.zeros((4, 1), np.float32),
        None,
        scheme8,
        (4, 128),
        np.float32,
        code_sum=np.zeros(4, np.int32),
    )
    with pytest.raises(ValueError, match="int8 .*scaled_matmul"):
        cqw.matmul_path(4, q8, arch="90", sms=132)


def test_block_weight_checks():
    """The shapes and dtypes _check_block_weight wants of plain and prepared block weights, N and K
    past whole blocks, and the errors that name what is wrong."""
    N, K = 200, 192
    checks._check_block_weight(_host_weight(N, K))
    checks._check_block_weight(_host_weight(N, K, "prepared"))
    cases = [
        (_host_weight(N, K, scale=np.zeros((2, 2), np.float16)), r"w.scale must be float32 of shape \(2, 2\)"),
        (_host_weight(N, K, scale=np.zeros((1, 2), np.float32)), r"w.scale must be float32 of shape \(2, 2\)"),
        (_host_weight(N, K, "prepared", scale=np.zeros((2, 2), np.float32)), r"float32 of shape \(13, 2, 16\)"),
        (
            _host_weight(N, K, "prepared", scale=np.zeros((13, 2, 16), ml_dtypes.bfloat16)),
            r"float32 of shape \(13, 2, 16\)",
        ),
        (
            _host_weight(N, K, "prepared", data=np.zeros((N, K), np.uint8)),
            r"w.data must be uint8 of shape \(13, 3, 16, 64\)",
        ),
        (_host_weight(N, 200, "prepared", data=np.zeros((13, 3, 16, 64), np.uint8)), "multiple of 64"),
    ]
    for w, match in cases:
        with pytest.raises(ValueError, match=match):
            checks._check_block_weight(w)
