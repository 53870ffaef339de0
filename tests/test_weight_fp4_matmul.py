"""The weight-only matmul with NVFP4 and MXFP4 weights on the GPU, every kernel forced in turn:
each output within a stated element-wise bound of the float64 product with the exactly dequantized
weight, bit-exact where every sum is exact, and the prepared bytes against the reference."""

from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_bits_equal, poisoned

import cupyquant as cq
from cupyquant import weight as cqw
from cupyquant.weight import plan
from cupyquant.weight.container import weight_scheme

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")

FORMATS = ["nvfp4", "mxfp4"]
HALF = [np.float16, ml_dtypes.bfloat16]
PATHS = ["decode", "sm80_gemm", "sm90_gemm"]
MS = [1, 2, 7, 16, 17, 64, 65, 256, 1000]
# N at and off the 16-row weight tiles and the gemms' 128-row tiles; K at and off their stages
SHAPES = [(128, 128), (200, 384), (4096, 1024), (1000, 4096)]
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
BLOCK = {"nvfp4": 16, "mxfp4": 32}


def _id(v):
    return np.dtype(v).name if not isinstance(v, (str, int)) else str(v)


def _seed(*parts):
    return zlib.crc32(repr(parts).encode())


class _forced:
    """Within the block, matmuls take ``path``; "sm90_gemm" skips on GPUs other than compute capability 9.0."""

    def __init__(self, path):
        self.path = path

    def __enter__(self):
        if self.path == "sm90_gemm" and cupy.cuda.Device().compute_capability not in plan.SM90_ARCHS:
            pytest.skip("the sm90 gemm needs compute capability 9.0")
        self.ctx = cqw._forced_path(self.path)
        self.ctx.__enter__()

    def __exit__(self, *exc):
        self.ctx.__exit__(*exc)


def _exact_weight(qw) -> np.ndarray:
    """The float64 weight ``e2m1(q) * scale (* scale_2)``, not rounded anywhere (plain qw)."""
    data = cupy.asnumpy(qw.data)
    N, K = qw.shape
    codes = np.stack([data & 15, data >> 4], axis=-1).reshape(N, K)
    sb = cupy.asnumpy(qw.scale)
    if qw.scheme.format == "nvfp4":
        s = sb.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * float(cupy.asnumpy(qw.scale_2)[0])
    else:
        s = np.ldexp(1.0, sb.astype(np.int64) - 127)
    return E2M1[codes] * np.repeat(s, BLOCK[qw.scheme.format], axis=1)


def _ulp_half(x, dtype):
    """Half a unit in the last place of |x| in dtype (fp16: 11 bits, min 2^-24; bf16: 8 bits, min 2^-133)."""
    bits, tiny = (11, -24) if np.dtype(dtype) == np.float16 else (8, -133)
    e = np.floor(np.log2(np.maximum(np.abs(x), 2.0**-140)))
    return np.ldexp(1.0, np.maximum(e - bits + 1, tiny).astype(np.int64)) / 2


def _check_bound(y, a, W, what):
    """|y - a @ W.T| <= (K 2^-23 + 2^-22) (|a| @ |W|.T) + half an ulp of y: float32 sums with
    at most one rounding (truncation included) per addition, the final scaling, and the rounding to
    y's dtype."""
    K = a.shape[-1]
    a64 = cupy.asnumpy(a).astype(np.float64).reshape(-1, K)
    want = a64 @ W.T
    mag = np.abs(a64) @ np.abs(W).T
    yh = cupy.asnumpy(y).astype(np.float64).reshape(want.shape)
    bound = (K * 2.0**-23 + 2.0**-22) * mag + _ulp_half(np.maximum(np.abs(want), np.abs(yh)), y.dtype)
    err = np.abs(yh - want)
    bad = ~(err <= bound)
    if bad.any():
        i = np.argwhere(bad)[0]
        raise AssertionError(
            f"{what}: {bad.sum()} outputs past the bound, first at {tuple(i)}: y {yh[tuple(i)]!r}, "
            f"want {want[tuple(i)]!r}, bound {bound[tuple(i)]!r}"
        )


def _weights(shape, seed, dtype):
    """Gaussian rows with per-row magnitudes 2^-6..2^6 and an all-zero block: every MXFP4 scale
    within the range where fp16 is exact (2^-16..2^8)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape) * 2.0 ** rng.uniform(-6, 6, (shape[0], 1))
    w[1 % shape[0], :32] = 0.0
    return cupy.asarray(w.astype(np.float32).astype(dtype))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", HALF, ids=_id)
def test_matmul_within_bound(dtype, fmt, path):
    """Every kernel forced, M from 1 to 1000, N and K at and off the tiles; the plain weight (prepared
    inside the call) gives the prepared weight's bits."""
    for N, K in SHAPES:
        qw = cq.quantize_weight(_weights((N, K), _seed(N, K, fmt), dtype), fmt)
        qp = cq.prepare_weight(qw)
        W = _exact_weight(qw)
        rng = np.random.default_rng(_seed("a", N, K))
        with _forced(path):
            for i, M in enumerate(MS):
                if M > 256 and N * K > 1 << 22:
                    continue  # the float64 reference on the host
                a = cupy.asarray(rng.standard_normal((M, K)).astype(np.float32).astype(dtype))
                out = poisoned((M, N), dtype)
                y = cq.matmul(a, qp, out=out)
                assert y is out
                _check_bound(y, a, W, f"{fmt} {path} M={M} N={N} K={K}")
                if i == 0:
                    assert_bits_equal(cq.matmul(a, qw), cupy.asnumpy(y), "plain vs prepared weight")


def _built(fmt, codes, scale_bytes, dtype, scale_2=1.0):
    """A plain FP4 QuantizedWeight from E2M1 codes (N, K) and scale bytes (N, K / block)."""
    N, K = codes.shape
    data = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    s2 = cupy.asarray(np.array([scale_2], np.float32)) if fmt == "nvfp4" else None
    scheme = weight_scheme(fmt, BLOCK[fmt], K, dtype)
    return cq.QuantizedWeight(
        cupy.asarray(data), cupy.asarray(scale_bytes.astype(np.uint8)), None, scheme, (N, K), dtype, scale_2=s2
    )


def _scale_bytes(fmt, dtype, N):
    """A scale byte per row covering the range the kernels are exact in: every finite positive and
    negative E4M3 value (NVFP4), the E8M0 exponents -16..8 (fp16) or -125..8 (bf16)."""
    if fmt == "nvfp4":
        finite = [b for b in range(256) if b & 0x7F != 0x7F]
        return np.array([finite[n % len(finite)] for n in range(N)])
    lo = -16 if np.dtype(dtype) == np.float16 else -125
    return np.array([127 + lo + n % (9 - lo) for n in range(N)])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", HALF, ids=_id)
def test_matmul_exact_sums(dtype, fmt, path):
    """Small integer activations, every E2M1 code, one scale per row: every product and sum is
    exact in float32, so each output is the float64 product rounded once to the output dtype, bit
    for bit, for every scale the kernels take exactly; a wrong scale, code or order of groups
    cannot hide in a tolerance. NVFP4 also with a scale_2 that is not a power of two."""
    rng = np.random.default_rng(_seed("exact", fmt))
    N, K = 508, 256
    codes = rng.integers(0, 16, (N, K))
    sb = np.repeat(_scale_bytes(fmt, dtype, N)[:, None], K // BLOCK[fmt], axis=1)
    for scale_2 in (1.0, 2.0**-7) if fmt == "nvfp4" else (1.0,):
        qw = _built(fmt, codes, sb, dtype, scale_2)
        W = _exact_weight(qw)
        with _forced(path):
            for M in (1, 16, 17, 64):
                a = rng.integers(-4, 5, (M, K)).astype(np.float32)
                y = cq.matmul(cupy.asarray(a.astype(dtype)), qw)
                want = (a @ W.T).astype(np.float32).astype(dtype)
                assert_bits_equal(y, want, f"{fmt} {path} M={M} scale_2={scale_2}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_matmul_groups_are_their_own(fmt):
    """One block of each row set apart (codes 0 elsewhere, a distinct scale per block): each output
    of a one-hot activation row picks exactly its block's scale, through each kernel."""
    dtype = ml_dtypes.bfloat16
    N, K = 64, 512
    B = BLOCK[fmt]
    nb = K // B
    codes = np.full((N, K), 2)  # 1.0
    sb = np.empty((N, nb), np.int64)
    for j in range(nb):
        sb[:, j] = (0x30 + j % 40) if fmt == "nvfp4" else 120 + j % 15
    qw = _built(fmt, codes, sb, dtype)
    W = _exact_weight(qw)
    a = np.zeros((nb, K), np.float32)
    for j in range(nb):
        a[j, j * B] = 1.0
    for path in PATHS:
        with _forced(path):
            y = cq.matmul(cupy.asarray(a.astype(dtype)), qw)
        assert_bits_equal(y, (a @ W.T).astype(np.float32).astype(dtype), f"{fmt} {path}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_matmul_batched_strided_stream_and_graph(fmt):
    """Leading batch dimensions, a strided a (copied inside), out=, a non-default stream and a CUDA
    graph replay give the bits of the plain call."""
    dtype = np.float16
    N, K = 300, 512
    qw = cq.prepare_weight(cq.quantize_weight(_weights((N, K), 3, dtype), fmt))
    rng = np.random.default_rng(4)
    a = cupy.asarray(rng.standard_normal((2, 3, 2 * K)).astype(dtype))[..., ::2]
    want = cupy.asnumpy(cq.matmul(cupy.ascontiguousarray(a), qw))
    assert_bits_equal(cq.matmul(a, qw), want, "strided a")
    s = cupy.cuda.Stream(non_blocking=True)
    ac = cupy.ascontiguousarray(a)
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
    """FP4 weights take INT4's kernel for each M (plan.choose_path), FP8's decode-only rule not."""
    qw = cq.quantize_weight(_weights((4096, 4096), 5, np.float16), "nvfp4")
    for M in (1, 16, 64, 4096):
        assert cqw.matmul_path(M, qw, arch="90", sms=132) == plan.choose_path(M, 4096, 4096, False, "90", 132)
    assert cqw.matmul_path(4096, qw, arch="90", sms=132) == "sm90_gemm"
    assert cqw.matmul_path(4096, qw, arch="80", sms=108) == "sm80_gemm"
