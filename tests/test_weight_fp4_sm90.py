"""The sm90 gemm (wgmma, kernels/weight_sm90_gemm.cu) with NVFP4 and MXFP4 weights, forced on a GPU of
compute capability 9.0: every tile, K whole and split (clusters of 2 and of more blocks, the float32
workspace, splits that start at an odd 64-k stage of the 256-row tile). Each output is within the
element-wise bound of the float64 product with the exactly dequantized weight, bit-exact where every
sum is exact, and a cluster split gives the workspace split's bits."""

from __future__ import annotations

import numpy as np
import pytest
from _fp4 import BLOCK, FORMATS, HALF, assert_exact, built, err_ratio, exact_weight, scale_bytes, weights
from _fp4 import dtype_id as _id
from _fp4 import matmul_poisoned as _matmul
from conftest import assert_bits_equal, require_arch

import cupyquant as cq
from cupyquant import _plans
from cupyquant import weight as cqw
from cupyquant.weight import sm90_gemm

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")

TILES = (32, 64, 128, 256)
# (rows, splits) forced: K = 1280 is 10 stages of 128 k (20 of 64 k on the 256-row tile), so 3 splits
# of the 256-row tile start at stages 0, 7 and 14, and 4 at 0, 5, 10 and 15 (odd: the second half of
# a chunk); 8 splits of 10 stages are 5 of 2
SPLIT_CASES = [(32, 2), (32, 3), (64, 2), (64, 3), (64, 8), (128, 2), (128, 3), (256, 2), (256, 3), (256, 4)]


@pytest.fixture
def sm90(monkeypatch):
    """Forces the sm90 gemm; force(rows, splits) forces its plan too (None: the planner's)."""
    require_arch("wgmma")
    real = sm90_gemm.sm90_plan

    def force(rows=None, splits=1):
        monkeypatch.setattr(
            sm90_gemm, "sm90_plan", real if rows is None else (lambda M, N, iters, sms, **kw: (rows, splits))
        )
        _plans.clear()

    with cqw._forced_path("sm90_gemm"):
        yield force


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", HALF, ids=_id)
def test_sm90_fp4_within_bound(sm90, dtype, fmt):
    """M 17 to 1000, N and K at and off the tiles and stages, the planner's tile and split (K splits
    where the tiles are few) and each tile forced with K whole."""
    worst = 0.0
    for N in (128, 200, 4096):
        for K in (128, 384, 4096):
            plain = cq.quantize_weight(weights((N, K), N * K, dtype), fmt)
            qw, W = cq.prepare_weight(plain), exact_weight(plain)
            rng = np.random.default_rng(K + N)
            for M in (17, 64, 65, 256, 1000):
                a = cupy.asarray(rng.standard_normal((M, K)).astype(np.float32).astype(dtype))
                for rows in (None,) + TILES:
                    sm90(rows)
                    r = err_ratio(_matmul(a, qw, dtype), a, W)
                    assert r <= 1.0, f"{fmt} M={M} N={N} K={K} tile {rows}: error {r} of the bound"
                    worst = max(worst, r)
    print(f"\n{fmt} {_id(dtype)}: worst error / bound {worst:.3g}")


@pytest.mark.parametrize("rows,splits", SPLIT_CASES, ids=[f"{r}-{s}" for r, s in SPLIT_CASES])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", HALF, ids=_id)
def test_sm90_fp4_split_k(sm90, monkeypatch, dtype, fmt, rows, splits):
    """K split as clusters and through the workspace: the same bits, within the bound (N = 520: a
    partial 16-row weight tile; M past a whole number of tiles)."""
    N, K = 520, 1280
    plain = cq.quantize_weight(weights((N, K), 7, dtype), fmt)
    qw, W = cq.prepare_weight(plain), exact_weight(plain)
    sm90(rows, splits)
    for M in (17, rows + 5):
        a = cupy.asarray(np.random.default_rng(M).standard_normal((M, K)).astype(np.float32).astype(dtype))
        got = {}
        for on in (True, False):
            monkeypatch.setattr(sm90_gemm, "CLUSTER_SPLITS", on)
            got[on] = _matmul(a, qw, dtype)
        assert_bits_equal(got[True], cupy.asnumpy(got[False]), f"M={M}: cluster against workspace")
        r = err_ratio(got[True], a, W)
        assert r <= 1.0, f"M={M}: error {r} of the bound"


EXACT_CASES = [(r, 1, True) for r in TILES] + [(64, 3, False), (128, 2, True), (256, 3, False), (256, 4, True)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", HALF, ids=_id)
def test_sm90_fp4_groups_exact(sm90, monkeypatch, dtype, fmt):
    """Each activation row one-hot at one k of one block (a different place in each block), every
    code and a random scale byte per row and block: each output is one weight, exact, so it shows
    the scale of exactly that block (a scale taken from another group, half of a chunk or row is
    off by far more than a rounding). Then small integer activations with one scale per row, whose
    sums are exact: the float64 product rounded once, bit for bit. Every tile, K whole and split."""
    rng = np.random.default_rng(5)
    N, K = 264, 1280
    B = BLOCK[fmt]
    nb = K // B
    codes = rng.integers(0, 16, (N, K))
    for scale_2 in (1.0, 2.0**-7) if fmt == "nvfp4" else (1.0,):
        qw = built(fmt, codes, scale_bytes(fmt, dtype, (N, nb), rng), dtype, scale_2)
        W = cupy.asnumpy(exact_weight(qw))
        onehot = np.zeros((nb, K), np.float32)
        onehot[np.arange(nb), np.arange(nb) * B + (np.arange(nb) * 7) % B] = 1.0
        row_scales = np.repeat(scale_bytes(fmt, dtype, (N, 1), rng), nb, axis=1)
        qe = built(fmt, codes, row_scales, dtype, scale_2)
        We = cupy.asnumpy(exact_weight(qe))
        ints = rng.integers(-4, 5, (65, K)).astype(np.float32)
        for rows, splits, cluster in EXACT_CASES:
            sm90(rows, splits)
            monkeypatch.setattr(sm90_gemm, "CLUSTER_SPLITS", cluster)
            what = f"{fmt} tile {rows} splits {splits} cluster {cluster} scale_2 {scale_2}"
            y = _matmul(cupy.asarray(onehot.astype(dtype)), qw, dtype)
            assert_exact(y, onehot @ W.T, f"one-hot {what}")
            for M in (17, 65):
                y = _matmul(cupy.asarray(ints[:M].astype(dtype)), qe, dtype)
                assert_exact(y, ints[:M] @ We.T, f"exact sums M={M} {what}")


def test_sm90_fp4_cluster_capacity_builds():
    """The cluster capacities come from the 256-row tile's FP4 kernel (sm90_gemm.cluster_cap) as
    from INT4's."""
    require_arch("wgmma")
    from cupyquant import _dtypes
    from cupyquant.weight.formats import SCHEME_IDS

    t = _dtypes.input_type(np.float16, "a")
    for fmt in FORMATS:
        assert sorted(sm90_gemm.cluster_cap(cupy.cuda.Device().id, t, SCHEME_IDS[fmt], True)) == [3, 4, 5, 6, 7, 8]
