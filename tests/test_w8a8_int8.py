"""The W8A8 INT8 matmul (cupyquant.scaled_matmul, scaled_mm and scaled_mm_azp on int8 operands).

CPU: the reference (int32 sums with vLLM's azp_adj term, the int32 wrap, the float32 epilogue) on
hand-worked values; the argument rules that need no GPU array; the architecture rule and the Hopper
tile choice.

GPU (the "mma" kernel, and the "sm90" one on compute capability 9.0): the int32 sums exposed through
a float32 output of unit scales, bit-exact up to the int32 range and across its wrap; every
combination of per-tensor / per-token / zero-point activations with per-tensor / per-channel
weights, bit-exact against the reference (the integer sum is exact and the epilogue a fixed
sequence of float32 roundings) and within the bound of one float32 epilogue and one output rounding
of the float64 product; M in {1, 2, 7, 16, 64, 65, 1000, 4096}, N and K off the tiles, the three
output dtypes, bias, K splits, 3-D activations, out=, a stream, a CUDA graph; the quantizers' and
the weight container's outputs; every validation error with the caller's buffers untouched.
"""

from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_bits_equal, poisoned, require_arch, side_stream

from cupyquant import reference as ref
from cupyquant.quantized import QuantizedTensor, Scheme

cupy = pytest.importorskip("cupy")  # the operands' rules live in modules that import CuPy

import cupyquant as cq  # noqa: E402
from cupyquant import _device  # noqa: E402
from cupyquant.w8a8 import build, dispatch, operands, sm90  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
OUT_DTYPES = [BF16, np.dtype(np.float16), np.dtype(np.float32)]
PATHS = ["mma", "sm90"]


def _seed(*parts):
    return zlib.crc32(repr(parts).encode())


# ================================================================== CPU: the reference
def test_int8_accumulate_hand_worked():
    a = np.array([[1, -2], [127, -128]], np.int8)
    b = np.array([[3, 4], [-128, -128]], np.int8)
    np.testing.assert_array_equal(ref.int8_accumulate(a, b), [[-5, 128], [-131, 128]])
    # vLLM's azp_adj form: I = acc - z(m) * sum_k b[n, k]; column sums 7 and -256
    adj = b.sum(axis=1, dtype=np.int32)
    np.testing.assert_array_equal(
        ref.int8_accumulate(a, b, azp=np.int32([1, 2]), azp_adj=adj), [[-12, 384], [-145, 640]]
    )
    # without azp the adj term is subtracted as it is (a per-tensor zero point already in it)
    np.testing.assert_array_equal(ref.int8_accumulate(a, b, azp_adj=3 * adj), [[-26, 896], [-152, 896]])
    # one element: a per-tensor zero point
    np.testing.assert_array_equal(ref.int8_accumulate(a, b, azp=np.int32([3]), azp_adj=adj), [[-26, 896], [-152, 896]])


def test_int8_accumulate_wraps_like_int32():
    # 131072 products of -128 * -128 = 2^14 sum to 2^31: one past the int32 range wraps to -2^31
    K = 131072
    a, b = np.full((1, K), -128, np.int8), np.full((2, K), -128, np.int8)
    b[1, :16] = 0
    got = ref.int8_accumulate(a, b)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, [[-(2**31), 2**31 - 16 * 2**14]])
    # with a zero point the intermediate z * adj may leave the range while the result does not
    z, adj = np.int32([100000]), np.int32([30000, 0])
    small_a, small_b = np.zeros((1, 16), np.int8), np.zeros((2, 16), np.int8)
    np.testing.assert_array_equal(
        ref.int8_accumulate(small_a, small_b, azp=z, azp_adj=adj), [[np.int32(-(3 * 10**9) + 2**32), 0]]
    )


def test_scaled_mm_int8_epilogue_is_float32_roundings():
    a = np.zeros((1, 32), np.int8)
    a[0, :2] = [127, 1]
    b = np.zeros((1, 32), np.int8)
    b[0, :2] = [127, 0]
    # I = 16129; v = float32(I) * (float32(sa) * float32(sb)), then + bias, then the output rounding
    sa, sb = np.float32(0.1), np.float32(0.3)
    want = np.float32(16129) * (sa * sb)
    np.testing.assert_array_equal(ref.scaled_mm_int8(a, b, sa, [sb], out_dtype="float32"), [[want]])
    y = ref.scaled_mm_int8(a, b, sa, [sb], bias=np.float32([0.25]), out_dtype=BF16)
    np.testing.assert_array_equal(y.astype(np.float32), [[np.float32(want + np.float32(0.25)).astype(BF16)]])
    # int32 -> float32 rounds to nearest even: I = 1040 * 127^2 + 127 * 24 + 3 * 3 = 2^24 + 1 gives 2^24
    big_a, big_b = np.zeros((1, 1056), np.int8), np.zeros((1, 1056), np.int8)
    big_a[0, :1042], big_b[0, :1042] = 127, 127
    big_a[0, 1040:1042], big_b[0, 1040:1042] = [127, 3], [24, 3]
    assert ref.int8_accumulate(big_a, big_b)[0, 0] == 2**24 + 1
    np.testing.assert_array_equal(ref.scaled_mm_int8(big_a, big_b, 1.0, 1.0, out_dtype="float32"), [[2.0**24]])
    with pytest.raises(ValueError, match="b_scale"):
        ref.scaled_mm_int8(a, b, sa, np.ones((1, 2), np.float32))


def test_int8_argument_rules_without_gpu_arrays():
    with pytest.raises(ValueError, match="both be FP8 or both INT8"):
        operands.check_pair("int8", "float8_e4m3fn")
    operands.check_pair("int8", "int8")
    operands.check_pair("float8_e5m2", "float8_e4m3fn")
    with pytest.raises(TypeError, match="a must be a cupy.ndarray"):
        cq.scaled_mm_azp(np.zeros((2, 16), np.int8), None, None, None, None)


def test_int8_runs_from_ampere(monkeypatch):
    for arch in ("80", "86", "89", "90", "120"):
        monkeypatch.setitem(_device._caps, 0, _device.caps_of_arch(arch))
        assert dispatch.check_arch(0, True).arch == arch
    monkeypatch.setitem(_device._caps, 0, _device.caps_of_arch("86"))
    with pytest.raises(cq.UnsupportedGPUError, match="compute capability 8.6"):
        dispatch.check_arch(0)  # FP8 still needs 8.9
    monkeypatch.setitem(_device._caps, 0, _device.caps_of_arch("75"))
    with pytest.raises(cq.UnsupportedGPUError, match="INT8 operands needs compute capability 8.0"):
        dispatch.check_arch(0, True)


def test_sm90_int8_tile_choice():
    # 128 x 256 tiles where they still give every SM one; the FP8 tiles otherwise
    assert sm90.config(4096, 4096, 8192, 132, int8=True) == sm90.INT8_WIDE
    assert sm90.config(4096, 4096, 8192, 132) == sm90.WIDE  # FP8: two waves a warpgroup
    assert sm90.config(4096, 4096, 4096, 132, int8=True) == sm90.LARGE  # K below INT8_WIDE_MIN_K
    assert sm90.config(1024, 2048, 8192, 132, int8=True) == sm90.LARGE  # 8 x 8 wide tiles < 132
    assert sm90.config(2048, 7168, 8192, 132, int8=True) == sm90.LARGE  # 4 rounds of wide, 7 of narrow tiles
    assert sm90.config(16, 4096, 4096, 132, int8=True) == sm90.SMALL
    assert sm90.INT8_WIDE.smem() <= 227 * 1024


# ================================================================== GPU: operands
def _need(path):
    require_arch("int8_mma")
    if path == "sm90":
        require_arch("wgmma")


def _scales(rng, n):
    """float32 decode scales of varied mantissas (the epilogue's roundings are exercised)."""
    return (rng.uniform(0.5, 2.0, n) * 2.0 ** rng.integers(-9, -5, n)).astype(np.float32)


A_KINDS = ["tensor", "token", "tensor-zp", "token-zp"]
B_KINDS = ["tensor", "channel"]


def _raw_operands(rng, M, N, K, a_kind, b_kind):
    """Host codes, scales and zero points: a int8 (M, K), b int8 (N, K) (full range, -128 included),
    a_scale, b_scale, azp (None, one element or (M,))."""
    a = rng.integers(-128, 128, (M, K)).astype(np.int8)
    b = rng.integers(-128, 128, (N, K)).astype(np.int8)
    sa = _scales(rng, 1 if a_kind.startswith("tensor") else M)
    sb = _scales(rng, 1 if b_kind == "tensor" else N)
    azp = None
    if a_kind.endswith("zp"):
        azp = rng.integers(-128, 128, 1 if a_kind.startswith("tensor") else M).astype(np.int32)
    return a, b, sa, sb, azp


def _a_tensor(a, sa, azp, per_tensor=False, lead=None):
    """A QuantizedTensor of INT8 codes per tensor or per token ("row" scales), with zero points."""
    M, K = a.shape
    lead = (M,) if lead is None else lead
    data = cupy.asarray(a.reshape(lead + (K,)))
    if per_tensor:
        scheme = Scheme("int8", "tensor", None, "float32", "scalar", "per_tensor")
        scale, zp = cupy.asarray(sa.reshape(1)), None if azp is None else cupy.asarray(azp.reshape(1))
    else:
        scheme = Scheme("int8", "token", (K,), "float32", "row", "groupwise")
        scale = cupy.asarray(sa.reshape(lead + (1,)))
        zp = None if azp is None else cupy.asarray(azp.reshape(lead + (1,)))
    return QuantizedTensor(data, scale, scheme, lead + (K,), np.float32, zero_point=zp)


def _b_tensor(b, sb):
    N, K = b.shape
    if sb.size == 1:
        scheme = Scheme("int8", "tensor", None, "float32", "scalar", "per_tensor")
        scale = cupy.asarray(sb.reshape(1))
    else:
        scheme = Scheme("int8", "token", (K,), "float32", "row", "groupwise")
        scale = cupy.asarray(sb.reshape(N, 1))
    return QuantizedTensor(cupy.asarray(b), scale, scheme, (N, K), np.float32)


def _want(a, b, sa, sb, azp, out_dtype, bias=None):
    adj = None if azp is None else b.sum(axis=1, dtype=np.int32)
    return ref.scaled_mm_int8(a, b, sa, sb, azp=azp, azp_adj=adj, bias=bias, out_dtype=out_dtype)


def _check_bound(y, a, b, sa, sb, azp, bias, out_dtype, what):
    """|y - ref| <= 4 float32 roundings of |v| (int -> float, sa * sb, the product, + bias) + half an
    ulp of the output at |ref|, ref the float64 value of dequant(a) @ dequant(b).T + bias: the exact
    integer sum of (qa - z) * qb (float64 sums of integers below 2^53) times sa(m) sb(n), so that no
    float64 cancellation enters it."""
    sums = a.astype(np.float64) @ b.astype(np.float64).T
    if azp is not None:
        sums -= azp.astype(np.float64).reshape(-1, 1) * b.astype(np.float64).sum(axis=1).reshape(1, -1)
    prod = sums * sa.astype(np.float64).reshape(-1, 1) * sb.astype(np.float64).reshape(1, -1)
    r = prod + (0 if bias is None else bias.astype(np.float64))
    mag = np.abs(prod) + (0 if bias is None else np.abs(bias.astype(np.float64)))
    f32_err = 4 * 2.0**-24 * mag * (1 + 2.0**-20)
    # the output's half ulp at the largest magnitude the float32 value can have
    fi = ml_dtypes.finfo(out_dtype)
    top = np.maximum(np.abs(r) + f32_err, float(fi.smallest_normal))
    half_ulp = np.ldexp(1.0, (np.floor(np.log2(top)) - fi.nmant - 1).astype(np.int64))
    bound = f32_err + half_ulp + (2.0**-149 if out_dtype == np.float32 else 0)
    err = np.abs(cupy.asnumpy(y).astype(np.float64) - r)
    bad = err > bound
    assert not bad.any(), f"{what}: {int(bad.sum())} elements outside the bound; first {np.argwhere(bad)[0]}"


# ================================================================== GPU: the int32 sums
@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_int32_sums_are_exact(path):
    """Unit scales and a float32 output show I itself where it is a float32: full-range random codes
    (|I| < 2^24), and sums of -128 * -128 = 2^14 up to the int32 limit and one step past it (wrapped)."""
    _need(path)
    rng = np.random.default_rng(3)
    one = np.ones(1, np.float32)
    with dispatch._forced_path(path):
        for M, N, K in ((7, 130, 1040), (1, 300, 4096), (65, 72, 16), (200, 264, 2064)):
            a, b = rng.integers(-128, 128, (M, K)).astype(np.int8), rng.integers(-128, 128, (N, K)).astype(np.int8)
            y = cq.scaled_mm(
                cupy.asarray(a), cupy.asarray(b), cupy.asarray(one), cupy.asarray(one), out_dtype="float32"
            )
            sums = ref.int8_accumulate(a, b)
            assert np.abs(sums).max() < 2**24
            assert_bits_equal(y, sums.astype(np.float32), f"{path} I M{M} N{N} K{K}")
        for K, want in ((131056, 131056 * 2**14), (131088, 131088 * 2**14 - 2**32)):
            a = cupy.full((2, K), -128, np.int8)
            b = cupy.full((24, K), -128, np.int8)
            y = cq.scaled_mm(a, b, cupy.asarray(one), cupy.asarray(one), out_dtype="float32")
            np.testing.assert_array_equal(cupy.asnumpy(y), np.full((2, 24), want, np.float32), err_msg=f"{path} K{K}")


# ================================================================== GPU: every scaling, shapes
SHAPES = [
    (1, 25, 16), (2, 130, 272), (7, 201, 1040), (16, 264, 528), (64, 73, 2064), (65, 137, 528),
    (1000, 263, 272), (4096, 264, 528),
]  # fmt: skip
COMBOS = [(a, b) for a in A_KINDS for b in B_KINDS]


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("a_kind,b_kind", COMBOS, ids=[f"{a}-{b}" for a, b in COMBOS])
def test_every_scaling_exact_and_within_bound(path, a_kind, b_kind):
    _need(path)
    with dispatch._forced_path(path):
        for i, (M, N, K) in enumerate(SHAPES):
            rng = np.random.default_rng(_seed(a_kind, b_kind, M, N, K))
            a, b, sa, sb, azp = _raw_operands(rng, M, N, K, a_kind, b_kind)
            out_dtype = OUT_DTYPES[i % 3]
            bias_h = (rng.standard_normal(N) * 4).astype(out_dtype) if i % 2 else None
            bias = None if bias_h is None else cupy.asarray(bias_h)
            what = f"{path} {a_kind}-{b_kind} M{M} N{N} K{K} {out_dtype.name}"
            want = _want(a, b, sa, sb, azp, out_dtype, bias_h)
            # the container form
            qa = _a_tensor(a, sa, azp, per_tensor=a_kind.startswith("tensor"))
            y = cq.scaled_matmul(qa, _b_tensor(b, sb), out_dtype=out_dtype, bias=bias)
            assert_bits_equal(y, want, what)
            _check_bound(y, a, b, sa, sb, azp, bias_h, out_dtype, what)
            # the raw forms: scaled_mm without zero points, scaled_mm_azp with them (per token: azp
            # and the code sums; per tensor: vLLM's premultiplied azp_adj)
            A, B, SA, SB = (cupy.asarray(v) for v in (a, b, sa, sb))
            if azp is None:
                y = cq.scaled_mm(A, B, SA, SB, out_dtype=out_dtype, bias=bias)
            elif a_kind == "tensor-zp":
                adj = cupy.asarray(b.sum(axis=1, dtype=np.int32) * azp[0])
                y = cq.scaled_mm_azp(A, B, SA, SB, adj, out_dtype=out_dtype, bias=bias)
            else:
                adj = cupy.asarray(b.sum(axis=1, dtype=np.int32))
                y = cq.scaled_mm_azp(A, B, SA, SB, adj, azp=cupy.asarray(np.broadcast_to(azp, (M,)).copy()),
                                     out_dtype=out_dtype, bias=bias)  # fmt: skip
            assert_bits_equal(y, want, what + " raw")


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_k_splits_and_wide_tiles(path):
    """Few tiles over a long K (split into parts summed as integers), and every Hopper tile forced,
    alone, in clusters of two sharing a's rows, and split."""
    _need(path)
    with dispatch._forced_path(path):
        for M, N, K in ((1, 256, 8192), (16, 520, 16384), (300, 1000, 4096), (1024, 2048, 1024)):
            rng = np.random.default_rng(_seed(M, N, K))
            a, b, sa, sb, azp = _raw_operands(rng, M, N, K, "token-zp", "channel")
            y = cq.scaled_matmul(_a_tensor(a, sa, azp), _b_tensor(b, sb), out_dtype="float32")
            assert_bits_equal(y, _want(a, b, sa, sb, azp, np.float32), f"{path} M{M} N{N} K{K}")
    if path == "sm90":  # every tile, forced, with and without a split
        rng = np.random.default_rng(9)
        M, N, K = 260, 520, 2064
        a, b, sa, sb, azp = _raw_operands(rng, M, N, K, "token-zp", "channel")
        want = _want(a, b, sa, sb, azp, BF16)
        qa, qb = _a_tensor(a, sa, azp), _b_tensor(b, sb)
        L = operands.for_matmul(qa, qb, "bfloat16", None, None)
        ops = build.operands(L, build.matmul_arrays(qa, qb, None, None))
        for cfg in sm90.INT8_CONFIGS:
            for parts, cluster in ((1, 1), (1, 2), (3, 1)):
                ops.result[...] = cupy.nan
                sm90.MmLaunch(L, cfg, parts, cluster)(ops)
                assert_bits_equal(ops.result, want, f"sm90 {cfg} parts {parts} cluster {cluster}")


@pytest.mark.gpu
def test_sm90_small_int8_splits():
    """The swapped-operand Hopper kernel on INT8 (a's rows as wgmma's N): M = 1, 7, 16, zero
    points per token, N past a tile, with and without a K split summed as integers: bit-exact."""
    _need("sm90")
    from cupyquant.w8a8 import sm90_small

    for M in (1, 7, 16):
        rng = np.random.default_rng(_seed("small", M))
        N, K = 200, 2064
        a, b, sa, sb, azp = _raw_operands(rng, M, N, K, "token-zp", "channel")
        want = _want(a, b, sa, sb, azp, BF16)
        qa, qb = _a_tensor(a, sa, azp), _b_tensor(b, sb)
        L = operands.for_matmul(qa, qb, "bfloat16", None, None)
        assert sm90_small.takes(L)
        ops = build.operands(L, build.matmul_arrays(qa, qb, None, None))
        for parts in (1, 3):
            ops.result[...] = cupy.nan
            sm90_small.MmSmallLaunch(L, parts)(ops)
            assert_bits_equal(ops.result, want, f"M {M} parts {parts}")


# ================================================================== GPU: the library's quantizers
@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_per_token_quantizer_3d_and_layouts(path):
    """quantize_groupwise's symmetric INT8 per-token output, 3-D, "row" and "col" scale layouts."""
    _need(path)
    rng = np.random.default_rng(11)
    B0, M0, N, K = 3, 37, 136, 272
    x = cupy.asarray(rng.standard_normal((B0, M0, K)).astype(np.float16))
    b, sb = rng.integers(-127, 128, (N, K)).astype(np.int8), _scales(rng, N)
    with dispatch._forced_path(path):
        for layout in ("row", "col"):
            qa = cq.quantize_groupwise(x, "int8", group_size=None, scale_layout=layout)
            a = cupy.asnumpy(qa.data).reshape(-1, K)
            sa = np.ascontiguousarray(cupy.asnumpy(qa.scale)).reshape(-1)
            out = poisoned((B0, M0, N), BF16)
            y = cq.scaled_matmul(qa, _b_tensor(b, sb), out=out)
            assert y is out
            assert_bits_equal(y.reshape(-1, N), _want(a, b, sa, sb, None, BF16), f"{path} {layout}")


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("a_q", ["token", "token-zp", "tensor", "tensor-zp"])
def test_quantizers_and_int8_weight(path, a_q):
    """The library's INT8 quantizers into scaled_matmul with quantize_weight(w, "int8") (its code sums
    remove the zero points): bit-exact with the reference on the containers' own bytes, 3-D "col"
    activations included, and close to the float64 product of the unquantized operands."""
    _need(path)
    rng = np.random.default_rng(_seed(a_q))
    B0, M0, N, K = 2, 33, 264, 1040
    xh = (rng.standard_normal((B0, M0, K)) + (0.5 if a_q.endswith("zp") else 0)).astype(np.float32)
    wh = (rng.standard_normal((N, K)) * 0.05).astype(np.float32)
    x, w = cupy.asarray(xh.astype(BF16)), cupy.asarray(wh.astype(BF16))
    qw = cq.quantize_weight(w, "int8", group_size=None)
    b, sb = cupy.asnumpy(qw.data), cupy.asnumpy(qw.scale).astype(np.float32).reshape(-1)
    np.testing.assert_array_equal(cupy.asnumpy(qw.code_sum), b.astype(np.int64).sum(axis=1))
    with dispatch._forced_path(path):
        for layout in ("row", "col") if a_q.startswith("token") else ("scalar",):
            if a_q.startswith("token"):
                qa = cq.quantize_groupwise(x, "int8", group_size=None, scale_layout=layout, symmetric=a_q == "token")
            else:
                qa = cq.quantize_int8(x, scale=0.045, zero_point=-7 if a_q.endswith("zp") else None)
            host = qa.to_host()
            a = host["data"].reshape(-1, K).view(np.int8)
            sa = host["scale"].reshape(-1)
            azp = None if qa.zero_point is None else host["zero_point"].reshape(-1)
            assert (azp is not None) == a_q.endswith("zp")
            y = cq.scaled_matmul(qa, qw)
            assert y.shape == (B0, M0, N)
            assert_bits_equal(y.reshape(-1, N), _want(a, b, sa, sb, azp, BF16), f"{path} {a_q} {layout}")
            exact = xh.astype(BF16).astype(np.float64).reshape(-1, K) @ wh.astype(BF16).astype(np.float64).T
            err = cupy.asnumpy(y).astype(np.float64).reshape(-1, N) - exact
            snr = 10 * np.log10((exact**2).sum() / (err**2).sum())
            assert snr > (25 if a_q.startswith("tensor") else 30), f"{path} {a_q} {layout}: SNR {snr:.1f} dB"


# ================================================================== GPU: out=, streams, graphs
@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_out_stream_graph_and_misaligned(path):
    _need(path)
    rng = np.random.default_rng(5)
    M, N, K = 65, 200, 272
    a, b, sa, sb, azp = _raw_operands(rng, M, N, K, "token-zp", "channel")
    bias_h = (rng.standard_normal(N)).astype(np.float16)
    bias = cupy.asarray(bias_h)
    qa, qb = _a_tensor(a, sa, azp, lead=(5, 13)), _b_tensor(b, sb)
    want = _want(a, b, sa, sb, azp, np.float16, bias_h)
    with dispatch._forced_path(path):
        out = poisoned((5, 13, N), np.float16)
        y = cq.scaled_matmul(qa, qb, out_dtype=np.float16, bias=bias, out=out)
        assert y is out
        assert_bits_equal(y.reshape(M, N), want, "out=, 3-D a")
        wide = poisoned((M, N + 8), np.float16)
        adj = cupy.asarray(b.sum(axis=1, dtype=np.int32))
        A, B, SA, SB, Z = (cupy.asarray(v) for v in (a, b, sa, sb, azp))
        y = cq.scaled_mm_azp(A, B, SA, SB, adj, azp=Z, out_dtype=np.float16, bias=bias, out=wide[:, :N])
        assert_bits_equal(y, want, "strided out")
        assert (cupy.asnumpy(wide[:, N:]).view(np.uint16) == 0xFFFF).all(), "written past the out view"
        big = cupy.zeros((M, K + 8), np.int8)
        big[:, 8:] = A
        y = cq.scaled_mm_azp(big[:, 8:], B, SA, SB, adj, azp=Z, out_dtype=np.float16, bias=bias)
        assert_bits_equal(y, want, "misaligned a")
        s = side_stream()
        with s:
            y = cq.scaled_matmul(qa, qb, out_dtype=np.float16, bias=bias)
        s.synchronize()
        assert_bits_equal(y.reshape(M, N), want, "stream")
        with s:
            out = poisoned((5, 13, N), np.float16)
            s.begin_capture()
            cq.scaled_matmul(qa, qb, bias=bias, out_dtype=np.float16, out=out)
            g = s.end_capture()
            g.launch(s)
        s.synchronize()
        assert_bits_equal(out.reshape(M, N), want, "graph replay")


@pytest.mark.gpu
def test_empty_rows():
    _need("mma")
    a = cupy.zeros((0, 32), np.int8)
    y = cq.scaled_mm(a, cupy.zeros((8, 32), np.int8), cupy.ones(1, np.float32), cupy.ones(8, np.float32))
    assert y.shape == (0, 8)


# ================================================================== GPU: validation
@pytest.mark.gpu
def test_int8_validation_errors_leave_buffers_untouched():
    _need("mma")
    rng = np.random.default_rng(2)
    M, N, K = 4, 24, 32
    a, b, sa, sb, azp = _raw_operands(rng, M, N, K, "token-zp", "channel")
    A, B, SA, SB, Z = (cupy.asarray(v) for v in (a, b, sa, sb, azp))
    adj = cupy.asarray(b.sum(axis=1, dtype=np.int32))
    out = poisoned((M, N), BF16)
    fp8_b = cupy.zeros((N, K), np.uint8)
    A256 = cupy.asarray(rng.integers(-8, 8, (M, 256)).astype(np.int8))
    B256 = cupy.asarray(rng.integers(-8, 8, (N, 256)).astype(np.int8))
    cases = [
        (TypeError, "azp must be int32", lambda: cq.scaled_mm_azp(A, B, SA, SB, adj, azp=Z.astype(np.int64), out=out)),
        (ValueError, "azp must have shape", lambda: cq.scaled_mm_azp(A, B, SA, SB, adj, azp=Z[:2], out=out)),
        (TypeError, "azp_adj must be int32", lambda: cq.scaled_mm_azp(A, B, SA, SB, adj.astype(np.float32), out=out)),
        (ValueError, "azp_adj must have shape", lambda: cq.scaled_mm_azp(A, B, SA, SB, adj[:3], out=out)),
        (TypeError, "b must hold INT8 codes", lambda: cq.scaled_mm_azp(A, fp8_b, SA, SB, adj, out=out)),
        (TypeError, "b must hold INT8 codes as int8", lambda: cq.scaled_mm(A, fp8_b, SA, SB, out=out)),
        (ValueError, r"a_scale of shape \(4, 2\) scales group: INT8 operands take",
         lambda: cq.scaled_mm(A256, B256, cupy.ones((M, 2), np.float32), SB, out=out)),
        (ValueError, "azp_adj and azp take INT8 operands",
         lambda: operands.for_mm(A.view(np.uint8), fp8_b, SA, SB, "bfloat16", None, out, "float8_e4m3fn",
                                 "float8_e4m3fn", azp_adj=adj)),
        (ValueError, "a.scale's shape", lambda: cq.scaled_matmul(_bad_zp_tensor(a, sa), _b_tensor(b, sb), out=out)),
        (TypeError, "a.zero_point must be int32",
         lambda: cq.scaled_matmul(_a_tensor_with(a, sa, cupy.asarray(azp.reshape(M, 1).astype(np.int64))), _b_tensor(b, sb), out=out)),
        (ValueError, "a.zero_point must be None for FP8", lambda: cq.scaled_matmul(_fp8_with_zp(M, K), _fp8_b(N, K), out=out)),
        (ValueError, "both be FP8 or both INT8", lambda: cq.scaled_matmul(_a_tensor(a, sa, None), _fp8_b(N, K), out=out)),
        (ValueError, "b.zero_point must be None", lambda: cq.scaled_matmul(_a_tensor(a, sa, None), _b_with_zp(b, sb), out=out)),
        (ValueError, "granularity='group': INT8 activations",
         lambda: cq.scaled_matmul(cq.quantize_groupwise(cupy.ones((M, 256), np.float16), "int8", group_size=128),
                                  _b_tensor(rng.integers(-8, 8, (N, 256)).astype(np.int8), sb), out=out)),
    ]  # fmt: skip
    for exc, msg, call in cases:
        with pytest.raises(exc, match=msg):
            call()
        assert (cupy.asnumpy(out).view(np.uint16) == 0xFFFF).all(), f"out written by a refused call ({msg})"
    np.testing.assert_array_equal(cupy.asnumpy(A), a)
    np.testing.assert_array_equal(cupy.asnumpy(Z), azp)


def _a_tensor_with(a, sa, zp):
    M, K = a.shape
    scheme = Scheme("int8", "token", (K,), "float32", "row", "groupwise")
    return QuantizedTensor(cupy.asarray(a), cupy.asarray(sa.reshape(M, 1)), scheme, (M, K), np.float32, zero_point=zp)


def _bad_zp_tensor(a, sa):
    return _a_tensor_with(a, sa, cupy.zeros((a.shape[0], 2), np.int32))


def _fp8_with_zp(M, K):
    scheme = Scheme("float8_e4m3fn", "token", (K,), "float32", "row", "groupwise")
    return QuantizedTensor(cupy.zeros((M, K), np.uint8), cupy.ones((M, 1), np.float32), scheme, (M, K), np.float32,
                           zero_point=cupy.zeros((M, 1), np.int32))  # fmt: skip


def _fp8_b(N, K):
    scheme = Scheme("float8_e4m3fn", "tensor", None, "float32", "scalar", "per_tensor")
    return QuantizedTensor(cupy.zeros((N, K), np.uint8), cupy.ones(1, np.float32), scheme, (N, K), np.float32)


def _b_with_zp(b, sb):
    t = _b_tensor(b, sb)
    t.zero_point = cupy.zeros((b.shape[0], 1), np.int32)
    return t
