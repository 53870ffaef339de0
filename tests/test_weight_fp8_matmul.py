"""The weight-only matmul with FP8 (E4M3) weights on the GPU, every kernel forced in turn. Every path
multiplies ``a`` by the weight dequantized to a's dtype (``w.dequantize(a.dtype)``, each E4M3 value
times its group's scale rounded once), so each output is within the element-wise bound of the
float64 product with that weight (tests/_fp4.py err_ratio: float32 sums, one rounding to a's
dtype), and bit-exact where every sum is exact: small integer activations times E4M3 values of few
bits and power-of-two scales, and one-hot activations, whose outputs are single weights (the scale
of exactly their group). Then the gemms' tiles and K splits, tails of M and N, out= buffers at odd
offsets, CUDA graphs, and the planner's choice launched."""

from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np
import pytest
from _fp4 import HALF, assert_exact, err_ratio
from _fp4 import dtype_id as _id
from conftest import assert_bits_equal, poisoned, require_arch, side_stream

import cupyquant as cq
from cupyquant import _device, _launch, _plans
from cupyquant import weight as cqw
from cupyquant.weight import dispatch, sm80_gemm, sm90_gemm
from cupyquant.weight.formats import weight_scheme

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")

FP8 = "float8_e4m3fn"
PATHS = ["decode", "sm80_gemm", "sm90_gemm"]
GROUPS = [32, 64, 128, None]
MS = [1, 2, 7, 16, 17, 33, 64, 65, 256, 1000]
# N at and off the 16-row weight tiles and the gemms' 128-row tiles; K at and off their stages
SHAPES = [(128, 128), (200, 384), (1000, 1024), (4096, 640)]
# path -> the kernel's name (a substring of its mangled name)
KERNELS = {"decode": "w16_decode", "sm80_gemm": "sm80_w16_gemm", "sm90_gemm": "sm90_w16_gemm"}
SM90_TILES = (32, 64, 128, 256)


def _seed(*parts):
    return zlib.crc32(repr(parts).encode())


@pytest.fixture
def forced(monkeypatch):
    """forced(path, rows=None, splits=None): matmuls take ``path`` from here on ("sm90_gemm" skips on
    GPUs other than compute capability 9.0); ``rows`` forces the sm90 gemm's tile (with ``splits``)
    and ``splits`` the sm80 gemm's K split (None: the planners' own)."""
    real90, real80 = sm90_gemm.sm90_plan, sm80_gemm.splits

    def force(path, rows=None, splits=None):
        if path == "sm90_gemm":
            require_arch("wgmma")
        monkeypatch.setattr(dispatch, "_FORCED", path)
        plan90 = real90 if rows is None else (lambda M, N, iters, sms, **kw: (rows, splits or 1))
        monkeypatch.setattr(sm90_gemm, "sm90_plan", plan90)
        split80 = real80 if splits is None or path != "sm80_gemm" else (lambda t, it, b: (splits, -(-it // splits)))
        monkeypatch.setattr(sm80_gemm, "splits", split80)
        _plans.clear()

    yield force
    _plans.clear()


def _weights(shape, seed, dtype):
    """Gaussian rows with per-row magnitudes 2^-6..2^6, a few outliers and an all-zero group."""
    rng = np.random.default_rng(seed)
    N, K = shape
    w = rng.standard_normal(shape) * 2.0 ** rng.uniform(-6, 6, (N, 1))
    w.reshape(-1)[rng.integers(0, w.size, max(1, w.size // 997))] *= 40
    w[1 % N, :32] = 0.0
    return cupy.asarray(w.astype(np.float32).astype(dtype))


def _dequantized(qw, dtype):
    """The weight every path multiplies: ``qw.dequantize(dtype)`` (plain or prepared), as float64."""
    return qw.dequantize(dtype).astype(cupy.float64)


def _matmul(a, qw, dtype):
    """cq.matmul into a poisoned out= buffer (every output must be written)."""
    out = poisoned(a.shape[:-1] + (qw.shape[0],), dtype)
    assert cq.matmul(a, qw, out=out) is out
    return out


# E4M3 bytes of the values 0 and +-[1/4, 8) (exponent fields 5..9): 4 significant bits at most,
# multiples of 2^-5
_FEW_BITS = np.array([0] + [s | (e << 3) | m for s in (0, 0x80) for e in range(5, 10) for m in range(8)], np.uint8)


def _exact_weight(N, K, group, dtype, rng, scale_exps=(-2, 1)):
    """A plain FP8 weight of E4M3 values of _FEW_BITS and power-of-two scales 2^e per row and group,
    e in ``scale_exps`` (inclusive): weights are multiples of 2^-7 below 2^4, so with integer
    activations in [-4, 4] and K <= 1280 every partial sum is a multiple of 2^-7 below 2^17, exact
    in float32."""
    G = K if group is None else group
    codes = _FEW_BITS[rng.integers(0, len(_FEW_BITS), (N, K))]
    e = rng.integers(scale_exps[0], scale_exps[1] + 1, (N, K // G))
    scales = np.ldexp(1.0, e).astype(np.float32).astype(dtype)
    scheme = weight_scheme(FP8, group, K, dtype)
    return cq.QuantizedWeight(cupy.asarray(codes), cupy.asarray(scales), None, scheme, (N, K), dtype)


def _ints(rng, M, K, dtype):
    a = rng.integers(-4, 5, (M, K)).astype(np.float32)
    return a, cupy.asarray(a.astype(dtype))


def _onehot(K, G, dtype):
    """One row per group of G along K, one-hot at a different place in each group: row i's outputs
    are the weights at that k, each times the scale of exactly group i."""
    ng = K // G
    a = np.zeros((ng, K), np.float32)
    a[np.arange(ng), np.arange(ng) * G + (np.arange(ng) * 7) % G] = 1.0
    return a, cupy.asarray(a.astype(dtype))


# ---------------------------------------------------------------- every path
@pytest.mark.parametrize("group_size", GROUPS, ids=str)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", HALF, ids=_id)
def test_fp8_matmul_within_bound(forced, dtype, path, group_size):
    """Every kernel forced, M from 1 to 1000, N and K at and off the tiles and stages (and on the
    decode kernel a K that is not a multiple of 128, where the group divides it), out= poisoned,
    within the element-wise bound
    of the float64 product with the dequantized weight; the plain weight (prepared inside the call)
    gives the prepared weight's bits."""
    forced(path)
    off_128 = path == "decode" and (group_size is None or 192 % group_size == 0)
    shapes = SHAPES + ([(130, 192)] if off_128 else [])
    for N, K in shapes:
        qw = cq.quantize_weight(_weights((N, K), _seed(N, K, group_size), dtype), FP8, group_size=group_size)
        qp = cq.prepare_weight(qw)
        W = _dequantized(qw, dtype)
        rng = np.random.default_rng(_seed("a", N, K))
        for i, M in enumerate(MS):
            a = cupy.asarray(rng.standard_normal((M, K)).astype(np.float32).astype(dtype))
            y = _matmul(a, qp, dtype)
            r = err_ratio(y, a, W)
            assert r <= 1.0, f"{path} G={group_size} M={M} N={N} K={K}: error {r:.3g} of the bound"
            if i == 0:
                assert_bits_equal(cq.matmul(a, qw), cupy.asnumpy(y), "plain vs prepared weight")


def check_out_and_graph(a, qw, y, dtype):
    """matmul(a, qw) into out= buffers at odd element offsets (the epilogues' element-wise stores)
    gives ``y``'s bits, the elements before them untouched; a CUDA graph of it replayed over a
    poisoned out= gives them again."""
    N = qw.shape[0]
    want = cupy.asnumpy(y)
    for off in (1, 3):
        buf = poisoned((a.size // a.shape[-1] * N + off,), dtype)
        out = buf[off:].reshape(a.shape[:-1] + (N,))
        assert cq.matmul(a, qw, out=out) is out
        assert_bits_equal(out, want, f"out= offset {off}")
        assert_bits_equal(buf[:off], cupy.asnumpy(poisoned((off,), dtype)), "before out=")
    graph_out = cupy.empty(a.shape[:-1] + (N,), dtype)
    stream = side_stream()
    with stream:
        cq.matmul(a, qw, out=graph_out)  # compiled and planned outside the capture
        stream.begin_capture()
        cq.matmul(a, qw, out=graph_out)
        graph = stream.end_capture()
        for rep in range(2):
            graph_out.view(np.uint16).fill(0x7FC1)  # NaN: an output left unwritten fails
            graph.launch(stream)
            stream.synchronize()
            assert_bits_equal(graph_out, want, f"graph replay {rep}")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", HALF, ids=_id)
def test_fp8_matmul_exact(forced, dtype, path):
    """Each group size: one-hot activations (each output one weight, so the scale of exactly its
    group, k and row), then small integer activations whose sums are exact: each output the
    float64 product rounded once to a's dtype, bit for bit (N = 264: a partial 16-row tile and a
    partial 128-row tile)."""
    forced(path)
    rng = np.random.default_rng(_seed("exact", path))
    N, K = 264, 1280
    for group in GROUPS:
        qw = _exact_weight(N, K, group, dtype, rng)
        W = cupy.asnumpy(_dequantized(qw, dtype))
        oh, ohd = _onehot(K, K if group is None else group, dtype)
        assert_exact(_matmul(ohd, qw, dtype), oh @ W.T, f"{path} G={group} one-hot")
        for M in (1, 16, 17, 64, 65):
            a, ad = _ints(rng, M, K, dtype)
            assert_exact(_matmul(ad, qw, dtype), a @ W.T, f"{path} G={group} M={M} exact sums")


# ---------------------------------------------------------------- the gemms' tiles and K splits
@pytest.mark.parametrize("dtype", HALF, ids=_id)
def test_fp8_sm80_k_splits_exact(forced, dtype):
    """The sm80 gemm's K split through the workspace (the planner's, and 1, 2, 3 forced), every tile
    (M 9 to 1000), every group size: exact sums, bit for bit."""
    rng = np.random.default_rng(_seed("sm80 splits"))
    for N, K in ((200, 384), (4096, 640), (128, 1280)):
        for group in GROUPS:
            qw = cq.prepare_weight(_exact_weight(N, K, group, dtype, rng))
            W = cupy.asnumpy(_dequantized(qw, dtype))
            for M in (9, 17, 64, 65, 256, 1000):
                a, ad = _ints(rng, M, K, dtype)
                for splits in (None, 1, 2, 3):
                    forced("sm80_gemm", splits=splits)
                    assert_exact(_matmul(ad, qw, dtype), a @ W.T, f"G={group} M={M} N={N} K={K} splits {splits}")


# (rows, splits) forced: K = 1280 is 10 stages of 128 k (20 of 64 k on the 256-row tile), so 3 splits
# of the 256-row tile start at stages 0, 7 and 14 (odd: the second half of a group of 128), 4 at
# 0, 5, 10 and 15; 8 splits of 10 stages are 5 of 2
SM90_CASES = [(r, 1) for r in SM90_TILES] + [
    (32, 2),
    (32, 3),
    (64, 2),
    (64, 3),
    (64, 8),
    (128, 2),
    (128, 3),
    (256, 2),
    (256, 3),
    (256, 4),
]


@pytest.mark.parametrize("rows,splits", SM90_CASES, ids=[f"{r}-{s}" for r, s in SM90_CASES])
@pytest.mark.parametrize("dtype", HALF, ids=_id)
def test_fp8_sm90_tiles_and_splits(forced, monkeypatch, dtype, rows, splits):
    """Each wgmma tile, K whole and split (as clusters and through the workspace: the same bits),
    every group size: exact sums and one-hot rows bit for bit, random weights within the bound
    (N = 520: a partial 16-row tile; M past a whole number of tiles)."""
    rng = np.random.default_rng(_seed("sm90", rows, splits))
    N, K = 520, 1280
    forced("sm90_gemm", rows, splits)
    for group in GROUPS:
        qe = cq.prepare_weight(_exact_weight(N, K, group, dtype, rng))
        We = cupy.asnumpy(_dequantized(qe, dtype))
        qw = cq.prepare_weight(cq.quantize_weight(_weights((N, K), _seed(group), dtype), FP8, group_size=group))
        W = _dequantized(qw, dtype)
        oh, ohd = _onehot(K, K if group is None else group, dtype)
        for M in (17, rows + 5):
            a, ad = _ints(rng, M, K, dtype)
            ar = cupy.asarray(rng.standard_normal((M, K)).astype(np.float32).astype(dtype))
            got = {}
            for on in (True, False) if splits > 1 else (True,):
                monkeypatch.setattr(sm90_gemm, "CLUSTER_SPLITS", on)
                _plans.clear()
                what = f"G={group} M={M} tile {rows} splits {splits} cluster {on}"
                assert_exact(_matmul(ad, qe, dtype), a @ We.T, f"exact sums {what}")
                assert_exact(_matmul(ohd, qe, dtype), oh @ We.T, f"one-hot {what}")
                got[on] = _matmul(ar, qw, dtype)
                r = err_ratio(got[on], ar, W)
                assert r <= 1.0, f"{what}: error {r:.3g} of the bound"
            if len(got) == 2:
                assert_bits_equal(got[True], cupy.asnumpy(got[False]), f"G={group} M={M}: cluster against workspace")


# ---------------------------------------------------------------- tails, out=, graphs
TAIL_CASES = [("decode", None, None)] + [("sm80_gemm", None, s) for s in (1, 2, 3)]
TAIL_CASES += [("sm90_gemm", r, s) for r in SM90_TILES for s in (1, 2, 3)]


@pytest.mark.parametrize("path,rows,splits", TAIL_CASES, ids=[f"{p}-{r}-{s}" for p, r, s in TAIL_CASES])
@pytest.mark.parametrize("dtype", HALF, ids=_id)
def test_fp8_tails_out_and_graph(forced, monkeypatch, dtype, path, rows, splits):
    """Odd N (a partial last tile of weight rows), M = 3 x 97 (not a multiple of any tile) as a
    batch, out= buffers at odd element offsets (the epilogues' element-wise stores) give the bits
    of the aligned call, untouched before them; a CUDA graph replayed over a poisoned out= gives
    them again. K whole, split 2 ways (sm90: a cluster) and 3 ways (the workspace)."""
    N, K = 1001, 640
    forced(path, rows, splits)
    monkeypatch.setattr(sm90_gemm, "cluster_cap", lambda *a: None)  # 3 ways through the workspace, whatever the GPU
    qw = cq.prepare_weight(cq.quantize_weight(_weights((N, K), 21, dtype), FP8, group_size=64))
    rng = np.random.default_rng(22)
    a = cupy.asarray(rng.standard_normal((3, 97, K)).astype(np.float32).astype(dtype))
    y = cq.matmul(a, qw)
    assert y.shape == (3, 97, N) and y.dtype == np.dtype(dtype)
    r = err_ratio(y, a, _dequantized(qw, dtype))
    assert r <= 1.0, f"error {r:.3g} of the bound"
    check_out_and_graph(a, qw, y, dtype)


# ---------------------------------------------------------------- the planner and its limits
def planned_matmul(a, qw, gemm):
    """cq.matmul(a, qw) on the planner's path, checked to be the one matmul_path names and the
    kernel it launches: the decode kernel where K is not a multiple of 128 or M is at most
    PATHS.fp8_decode_max_m, the GPU's tensor-core gemm ``gemm`` from M = 1000. Returns y, the path
    and the launched kernel's name."""
    M, K = a.shape
    want = cqw.matmul_path(M, qw)
    if K % 128 or M <= dispatch.PATHS.fp8_decode_max_m:
        assert want == "decode", (M, K)
    elif M >= 1000:
        assert want == gemm, (M, K)
    with _launch.recording() as rec:
        y = cq.matmul(a, qw)
    names = [r[0].name for r in rec if r[5] is not None]
    assert len(names) == 1 and KERNELS[want] in names[0], (M, K, names)
    return y, want, names[0]


def test_fp8_matmul_launches_the_path_it_names():
    """Without a forced path, FP8 weights take the kernel matmul_path names: the decode kernel up to
    PATHS.fp8_decode_max_m, the tensor-core gemm of the GPU at M = 1000 and 4096 (past every decode
    threshold), and with K not a multiple of 128 the decode kernel at every M; within the bound."""
    dtype = ml_dtypes.bfloat16
    rng = np.random.default_rng(5)
    gemm = "sm90_gemm" if _device.caps(cupy.cuda.Device().id).wgmma else "sm80_gemm"
    for N, K in ((4096, 4096), (512, 192)):
        qw = cq.prepare_weight(cq.quantize_weight(_weights((N, K), 6, dtype), FP8, group_size=64))
        W = _dequantized(qw, dtype)
        for M in (1, 16, 17, 64, 1000, 4096):
            a = cupy.asarray(rng.standard_normal((M, K)).astype(np.float32).astype(dtype))
            y, want, _ = planned_matmul(a, qw, gemm)
            r = err_ratio(y, a, W)
            assert r <= 1.0, f"M={M} N={N} K={K} ({want}): error {r:.3g} of the bound"


@pytest.mark.parametrize("path", ["sm80_gemm", "sm90_gemm"])
def test_fp8_forced_gemm_needs_whole_k_stages(forced, path):
    """A gemm forced on an FP8 weight whose K is not a multiple of 128 (the gemms' K stages) is a
    ValueError naming w's K, raised before any launch (out= untouched); the decode kernel takes it."""
    dtype = np.float16
    qw = cq.prepare_weight(cq.quantize_weight(_weights((64, 192), 7, dtype), FP8, group_size=64))
    a = cupy.ones((5, 192), dtype)
    out = poisoned((5, 64), dtype)
    before = cupy.asnumpy(out)
    forced(path)
    with pytest.raises(ValueError, match=r"w's K = 192 must be a multiple of 128"):
        cq.matmul(a, qw, out=out)
    assert_bits_equal(out, before, "out= after a failed call")
    forced("decode")
    assert err_ratio(_matmul(a, qw, dtype), a, _dequantized(qw, dtype)) <= 1.0
