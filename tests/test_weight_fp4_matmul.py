"""The weight-only matmul with NVFP4 and MXFP4 weights on the GPU, every kernel forced in turn:
each output within a stated element-wise bound of the float64 product with the exactly dequantized
weight (tests/_fp4.py err_ratio), bit-exact where every sum is exact; the sm80 gemm's K splits. The
sm90 gemm's tiles and splits: tests/test_weight_fp4_sm90.py."""

from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np
import pytest
from _fp4 import (
    BLOCK,
    FORMATS,
    HALF,
    assert_exact,
    built,
    err_ratio,
    exact_weight,
    matmul_poisoned,
    scale_bytes,
    weights,
)
from _fp4 import dtype_id as _id
from conftest import assert_bits_equal, require_arch, side_stream

import cupyquant as cq
from cupyquant import _plans
from cupyquant import weight as cqw
from cupyquant.weight import dispatch, sm80_gemm

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")

PATHS = ["decode", "sm80_gemm", "sm90_gemm"]
MS = [1, 2, 7, 16, 17, 64, 65, 256, 1000]
# N at and off the 16-row weight tiles and the gemms' 128-row tiles; K at and off their stages
SHAPES = [(128, 128), (200, 384), (4096, 1024), (1000, 4096)]


def _seed(*parts):
    return zlib.crc32(repr(parts).encode())


class _forced:
    """Within the block, matmuls take ``path``; "sm90_gemm" skips on GPUs other than compute capability 9.0."""

    def __init__(self, path):
        self.path = path

    def __enter__(self):
        if self.path == "sm90_gemm":
            require_arch("wgmma")
        self.ctx = cqw._forced_path(self.path)
        self.ctx.__enter__()

    def __exit__(self, *exc):
        self.ctx.__exit__(*exc)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", HALF, ids=_id)
def test_matmul_within_bound(dtype, fmt, path):
    """Every kernel forced, M from 1 to 1000, N and K at and off the tiles, out= poisoned; the plain
    weight (prepared inside the call) gives the prepared weight's bits."""
    for N, K in SHAPES:
        qw = cq.quantize_weight(weights((N, K), _seed(N, K, fmt), dtype), fmt)
        qp = cq.prepare_weight(qw)
        W = exact_weight(qw)
        rng = np.random.default_rng(_seed("a", N, K))
        with _forced(path):
            for i, M in enumerate(MS):
                a = cupy.asarray(rng.standard_normal((M, K)).astype(np.float32).astype(dtype))
                y = matmul_poisoned(a, qp, dtype)
                r = err_ratio(y, a, W)
                assert r <= 1.0, f"{fmt} {path} M={M} N={N} K={K}: error {r:.3g} of the bound"
                if i == 0:
                    assert_bits_equal(cq.matmul(a, qw), cupy.asnumpy(y), "plain vs prepared weight")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", HALF, ids=_id)
def test_matmul_exact_sums(dtype, fmt, path):
    """Small integer activations, every E2M1 code, one scale per row: every product and sum is
    exact in float32, so each output is the float64 product rounded once to the output dtype, bit
    for bit, for scales over the whole range the kernels take exactly (tests/_fp4.py scale_bytes); a
    wrong scale, code or order of groups cannot hide in a tolerance. NVFP4 also with a scale_2 that
    is not 1."""
    rng = np.random.default_rng(_seed("exact", fmt))
    N, K = 508, 256
    codes = rng.integers(0, 16, (N, K))
    sb = np.repeat(scale_bytes(fmt, dtype, (N, 1), rng), K // BLOCK[fmt], axis=1)
    for scale_2 in (1.0, 2.0**-7) if fmt == "nvfp4" else (1.0,):
        qw = built(fmt, codes, sb, dtype, scale_2)
        W = cupy.asnumpy(exact_weight(qw))
        with _forced(path):
            for M in (1, 16, 17, 64):
                a = rng.integers(-4, 5, (M, K)).astype(np.float32)
                y = matmul_poisoned(cupy.asarray(a.astype(dtype)), qw, dtype)
                assert_exact(y, a @ W.T, f"{fmt} {path} M={M} scale_2={scale_2}")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", HALF, ids=_id)
def test_matmul_groups_are_their_own(dtype, fmt):
    """Each activation row one-hot at one k of one block (a different place in each block), every
    code and a random scale byte per row and block: each output is one weight, exact, so it shows
    the scale of exactly that block, through each kernel."""
    rng = np.random.default_rng(_seed("onehot", fmt))
    N, K = 72, 1024
    B = BLOCK[fmt]
    nb = K // B
    codes = rng.integers(0, 16, (N, K))
    qw = built(fmt, codes, scale_bytes(fmt, dtype, (N, nb), rng), dtype, 2.0**-3)
    W = cupy.asnumpy(exact_weight(qw))
    onehot = np.zeros((nb, K), np.float32)
    onehot[np.arange(nb), np.arange(nb) * B + (np.arange(nb) * 5) % B] = 1.0
    for path in PATHS:
        with _forced(path):
            y = matmul_poisoned(cupy.asarray(onehot.astype(dtype)), qw, dtype)
        assert_exact(y, onehot @ W.T, f"{fmt} {path}")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", HALF, ids=_id)
def test_sm80_gemm_k_splits_exact(monkeypatch, dtype, fmt):
    """The sm80 gemm's K split through the workspace (the planner's, and 1, 2, 3 forced), every
    tile (M 9 to 1000): with small integer activations and scales 1/2 to 2 every sum is exact, so
    each output is the float64 product rounded once, bit for bit; scale_2 is applied once, after
    the splits are added."""
    rng = np.random.default_rng(_seed("splits", fmt))
    real = sm80_gemm.splits
    for N, K in ((200, 384), (4096, 640), (128, 4096)):
        codes = rng.integers(0, 16, (N, K))
        if fmt == "nvfp4":
            choices = np.array([0.5, 1.0, 2.0], np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        else:
            choices = np.array([126, 127, 128])
        qw = built(fmt, codes, rng.choice(choices, (N, K // BLOCK[fmt])), dtype, 0.125).prepare()
        W = cupy.asnumpy(exact_weight(qw.plain()))
        for M in (9, 17, 64, 65, 256, 1000):
            a = rng.integers(-3, 4, (M, K)).astype(np.float32)
            for forced in (None, 1, 2, 3):
                seen = []

                def split(tiles, iters, blocks, forced=forced, seen=seen):
                    s, it = real(tiles, iters, blocks) if forced is None else (forced, -(-iters // forced))
                    seen.append(-(-iters // it))
                    return -(-iters // it), it

                monkeypatch.setattr(sm80_gemm, "splits", split)
                _plans.clear()
                with _forced("sm80_gemm"):
                    y = matmul_poisoned(cupy.asarray(a.astype(dtype)), qw, dtype)
                assert_exact(y, a @ W.T, f"{fmt} M={M} N={N} K={K} splits {seen}")
    monkeypatch.setattr(sm80_gemm, "splits", real)


@pytest.mark.parametrize("fmt", FORMATS)
def test_matmul_batched_strided_stream_and_graph(fmt):
    """Leading batch dimensions, a strided a (copied inside), out=, a non-default stream and a CUDA
    graph replay give the bits of the plain call."""
    dtype = np.float16
    N, K = 300, 512
    qw = cq.prepare_weight(cq.quantize_weight(weights((N, K), 3, dtype), fmt))
    rng = np.random.default_rng(4)
    a = cupy.asarray(rng.standard_normal((2, 3, 2 * K)).astype(dtype))[..., ::2]
    want = cupy.asnumpy(cq.matmul(cupy.ascontiguousarray(a), qw))
    assert_bits_equal(cq.matmul(a, qw), want, "strided a")
    ac = cupy.ascontiguousarray(a)
    s = side_stream()
    with s:
        out = cupy.empty((2, 3, N), dtype)
        cq.matmul(ac, qw, out=out)  # compile and warm outside the capture
        s.begin_capture()
        cq.matmul(ac, qw, out=out)
        g = s.end_capture()
        out.fill(0)
        g.launch(s)
    s.synchronize()
    assert_bits_equal(out, want, "graph replay on a stream")


def test_matmul_path_choice_follows_int4():
    """FP4 weights take the decode kernel up to M = 16 and the tensor-core gemms past it (on compute
    capability 9.0 also at M = 17..32, where INT4 keeps the decode kernel for small N)."""
    for fmt in FORMATS:
        qw = cq.quantize_weight(weights((4096, 4096), 5, np.float16), fmt)
        assert [cqw.matmul_path(M, qw, arch="90", sms=132) for M in (1, 16, 17, 32, 4096)] == ["decode"] * 2 + [
            "sm90_gemm"
        ] * 3
        assert dispatch.choose_path(32, 4096, 4096, False, True, 132) == "decode"  # INT4, on the sm90 kernel's GPU
        assert [cqw.matmul_path(M, qw, arch="80", sms=108) for M in (16, 17, 4096)] == ["decode", "decode", "sm80_gemm"]
