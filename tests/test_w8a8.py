"""The W8A8 FP8 matmul (cupyquant.scaled_matmul, cupyquant.scaled_mm).

CPU: the float64 reference on hand-worked values, the error bound, the scale-shape table of
scaled_mm, the mode rule, the scale addressing of every activation layout against the layouts'
word offsets, and the argument checks that need no GPU array.

GPU (both kernels, the "sm90" one only on compute capability 9.0): every scale combination of a and
b, bit-exact where every partial sum is exact (small integer codes, power-of-two scales); real
quantizer outputs within the element-wise bound of the float64 reference; odd M, N and K, the three
output dtypes, bias, 3-D activations, out=, a non-default stream, a CUDA graph; every validation
error, with the caller's buffers untouched.
"""

from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np
import pytest
from _pdl import check_rounds
from conftest import assert_bits_equal, poisoned, require_arch, side_stream

from cupyquant import reference as ref
from cupyquant.quantized import QuantizedTensor, Scheme

cupy = pytest.importorskip("cupy")  # the operands' shape rules live in a module that imports CuPy

import cupyquant as cq  # noqa: E402
from cupyquant import _device, _scales  # noqa: E402
from cupyquant.w8a8 import args, build, dispatch, operands  # noqa: E402

E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"
BF16 = np.dtype(ml_dtypes.bfloat16)
OUT_DTYPES = [BF16, np.dtype(np.float16), np.dtype(np.float32)]


def _seed(*parts):
    return zlib.crc32(repr(parts).encode())


def _codes(values, fmt=E4M3) -> np.ndarray:
    """float values (exact in the format) -> uint8 codes."""
    return np.asarray(values, np.float32).astype(np.dtype(getattr(ml_dtypes, fmt))).view(np.uint8)


# ================================================================== CPU: the reference
def test_reference_hand_worked():
    # a (2, 16): row 0 all 1, row 1 alternating 2, -1; b (3, 16) rows 1, 0.5 and k-dependent
    a = np.zeros((2, 16), np.float32)
    a[0], a[1] = 1, np.tile([2, -1], 8)
    b = np.zeros((3, 16), np.float32)
    b[0], b[1], b[2] = 1, 0.5, np.arange(16) % 4
    qa, qb = _codes(a), _codes(b)
    r, S = ref.scaled_mm(qa, qb, np.float32([2.0]), np.float32([1, 4, 0.25]), bias=np.float32([1, 0, -1]))
    # row 0: 2 * 16 * 1 + 1, 2 * 16 * 0.5 * 4, 2 * 0.25 * sum(k % 4) - 1 = 0.5 * 24 - 1
    # row 1: sum(2, -1) = 8 per b of ones: 2 * 8 + 1, 2 * 8 * 2, 2 * 0.25 * sum((2, -1) * k % 4) - 1
    kk = np.arange(16) % 4
    want = np.array([[33, 64, 11], [17, 32, 0.5 * np.dot(np.tile([2, -1], 8), kk) - 1]])
    np.testing.assert_array_equal(r, want)
    assert S[1, 0] == 2 * 1 * (2 * 8 + 1 * 8) + 2.0**-24
    # per-token (M,) and (M, 1) and a 1-element (1, 1) give the same reference
    for sa in (np.float32([2, 2]), np.float32([[2], [2]]), np.float32([[2]])):
        np.testing.assert_array_equal(ref.scaled_mm(qa, qb, sa, np.float32([1, 4, 0.25]))[0], want - [1, 0, -1])


def test_reference_blocks_along_k():
    """K = 272 (three 128-k blocks, the last of 16): group scales of a, 128 x 128 blocks of b, and
    packed UE8M0 words; e5m2 activations."""
    M, N, K = 3, 130, 272
    rng = np.random.default_rng(0)
    a = rng.integers(-3, 4, (M, K)).astype(np.float32)
    b = rng.integers(-3, 4, (N, K)).astype(np.float32)
    sa = 2.0 ** rng.integers(-2, 3, (M, 3))
    sb = 2.0 ** rng.integers(-2, 3, (2, 3))
    blk = np.repeat(np.arange(3), 128)[:K]
    A, B = a * sa[:, blk], b * np.repeat(sb, 128, axis=0)[:N][:, blk]
    r, S = ref.scaled_mm(_codes(a, E5M2), _codes(b), sa.astype(np.float32), sb.astype(np.float32), a_format=E5M2)
    np.testing.assert_array_equal(r, A @ B.T)
    np.testing.assert_array_equal(S, np.abs(A) @ np.abs(B).T)
    # the same a scales as packed UE8M0 words (group 4p + j in byte j of word p)
    e = (np.log2(sa) + 127).astype(np.uint8)
    words = np.zeros((M, 4), np.uint8)
    words[:, :3] = e
    packed = words.view(np.int32)
    np.testing.assert_array_equal(ref.a_block_scales(packed, M, K), sa)
    np.testing.assert_array_equal(ref.unpack_ue8m0_words(packed, 3).astype(np.float64), sa)
    # ml_dtypes codes need no format
    np.testing.assert_array_equal(
        ref.scaled_mm(_codes(a, E5M2).view(ml_dtypes.float8_e5m2), _codes(b), sa.astype(np.float32), sb)[0], A @ B.T
    )
    with pytest.raises(ValueError):
        ref.a_block_scales(np.ones((M, 2), np.float32), M, K)
    with pytest.raises(ValueError):
        ref.b_block_scales(np.ones((3, 3), np.float32), N, K)


def test_round_result_is_one_rounding():
    v = np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8, -(2.0**-30), 65504.0, 1e-9])
    np.testing.assert_array_equal(ref.round_result(v, BF16).astype(np.float64)[:2], [1.0, 1 + 2.0**-6])
    assert ref.round_result(v, np.float16).dtype == np.float16
    np.testing.assert_array_equal(ref.round_result(v, np.float32), v.astype(np.float32))


def test_error_bound_values_and_kernel_model():
    # 2^-9 S + half an ulp at |ref| + 2^-9 S (bf16: 2^-8 at 1; fp16: 2^-11; fp32: 1.5 * 2^-23)
    one = np.array([1.0])
    assert ref.error_bound(one, one, BF16)[0] == 2.0**-9 + 2.0**-8
    assert ref.error_bound(one, one, np.float16)[0] == 2.0**-9 + 2.0**-11
    assert ref.error_bound(one, one, np.float32)[0] == 2.0**-9 + 3 * 2.0**-24
    assert ref.error_bound(np.array([0.0]), np.array([0.0]), np.float32)[0] > 0  # subnormal spacing
    # the kernels' formula with float32 block sums rounded to 14 bits stays inside the bound
    rng = np.random.default_rng(1)
    M, N, K = 8, 24, 400
    a = rng.standard_normal((M, K)).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    b = rng.standard_normal((N, K)).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    sa = (2.0 ** rng.uniform(-3, 3, (M, 4))).astype(np.float32)
    sb = (2.0 ** rng.uniform(-3, 3, (N, 4))).astype(np.float32)
    r, S = ref.scaled_mm(a, b, sa, sb)
    acc = np.zeros((M, N), np.float32)
    for kb in range(4):
        ks = slice(128 * kb, min(K, 128 * kb + 128))
        p = a[:, ks].astype(np.float64) @ b[:, ks].astype(np.float64).T
        m, e = np.frexp(p)
        p14 = np.ldexp(np.round(m * 2.0**14) / 2.0**14, e).astype(np.float32)  # a 14-bit block sum
        scale = (sa[:, kb : kb + 1] * sb[:, kb][None, :]).astype(np.float32)
        acc = (acc.astype(np.float64) + p14.astype(np.float64) * scale).astype(np.float32)
    for od in OUT_DTYPES:
        y = ref.round_result(acc, od).astype(np.float64)
        assert (np.abs(y - r) <= ref.error_bound(r, S, od)).all(), od


# ================================================================== CPU: operands' rules
def test_infer_a_scale_table():
    M, K = 5, 272  # 3 blocks, one packed word
    f = operands.infer_a_scale
    assert f((1,), np.float32, M, K) == "tensor" and f((1, 1), np.float32, M, K) == "tensor"
    assert f((M,), np.float32, M, K) == "token" and f((M, 1), np.float32, M, K) == "token"
    assert f((M, 3), np.float32, M, K) == "group"
    assert f((M, 1), np.int32, M, K) == "packed"
    assert f((M, 1), np.float32, M, 128) == "token"  # one block: a group is a token's scale
    with pytest.raises(ValueError, match=r"\(5, 3\) \(1 x 128 groups\)"):
        f((M, 2), np.float32, M, K)
    with pytest.raises(ValueError, match="packed UE8M0"):
        f((M, 3), np.int32, M, K)
    with pytest.raises(TypeError, match="float32"):
        f((M,), np.float16, M, K)


def test_infer_b_scale_table():
    f = operands.infer_b_scale
    N, K = 200, 272
    assert f((1,), np.float32, N, K) == "tensor"
    assert f((N,), np.float32, N, K) == "channel" and f((N, 1), np.float32, N, K) == "channel"
    assert f((2, 3), np.float32, N, K) == "block"
    assert f((N, 3), np.float32, N, K) == "group"
    # N = 1: blocks and groups are the same shape and the same scaling; N <= 128, K <= 128: one block
    assert f((1, 3), np.float32, 1, K) == "block"  # for N = 1 the same scaling as (N, 3) groups
    assert f((1, 3), np.float32, 2, K) == "block" and f((2, 3), np.float32, 2, K) == "group"
    assert f((33, 1), np.float32, 33, 128) == "channel"
    with pytest.raises(ValueError, match="fits none"):
        f((N, 2), np.float32, N, K)
    with pytest.raises(TypeError):
        f((N,), BF16, N, K)
    assert operands.b_scale_addressing("block", (12, 4)) == (3, 1, 7)
    assert operands.b_scale_addressing("group", (4, 4 * 204)) == (1, 204, 0)  # a "col" layout
    assert operands.b_scale_addressing("channel", (4, 4)) == (1, 0, 0)
    assert operands.b_scale_addressing("tensor", ()) == (0, 0, 0)


def test_mode_rule():
    f = operands.mode_of
    assert f(0, 0, 0, 0) == args.MODE_END  # tensor x tensor
    assert f(0, 1, 0, 0) == args.MODE_END  # token x channel
    assert f(1, 0, 0, 0) == args.MODE_K_TILE  # group a, per-tensor b
    assert f(3, 3, 1, 7) == args.MODE_K_TILE and f(0, 3, 1, 7) == args.MODE_K_TILE  # 128 x 128 blocks
    assert f(1, 1, 0, 0) == args.MODE_K_COL  # group a, per-channel b
    assert f(0, 3, 1, 0) == args.MODE_K_COL  # 1 x 128 weight groups


def _word(rows, batch, sa_m, sa_k, packed, m, kb):
    return (m // rows) * batch + (m % rows) * sa_m + (kb // 4 if packed else kb) * sa_k


LAYOUT_CASES = [
    (lead, layout, kind)
    for lead in [(), (1,), (7,), (2, 5), (3, 1, 6), (2, 3, 4), (4, 1)]
    for layout in ("row", "col")
    for kind in ("token", "group", "packed")
]


@pytest.mark.parametrize("lead,layout,kind", LAYOUT_CASES, ids=[f"{lead}-{lay}-{k}" for lead, lay, k in LAYOUT_CASES])
def test_a_scale_addressing_matches_the_layouts(lead, layout, kind):
    """The (sa_rows, sa_batch, sa_m, sa_k) of quantize_groupwise's scale arrays (_scales.GroupLayout)
    address exactly the words reference.scale_word_offsets gives, row by flattened row."""
    K = 1280 if kind != "token" else 64
    ng = 1 if kind == "token" else K // 128
    n_cols = -(-ng // 4) if kind == "packed" else ng
    lay = _scales.GroupLayout(lead, n_cols, layout == "col")
    rows, batch, sa_m, sa_k = operands.a_scale_addressing(lead, lay.shape, lay.strides, kind == "token")
    offsets, _ = ref.scale_word_offsets(lead + (K,), n_cols, layout)
    offsets = offsets.reshape(-1, n_cols)
    for m in range(offsets.shape[0]):
        for kb in range(ng):
            assert (
                _word(rows, batch, sa_m, sa_k, kind == "packed", m, kb)
                == offsets[m, kb // 4 if kind == "packed" else kb]
            )
    if kind == "token":
        assert sa_k == 0


def test_a_scale_addressing_rejects_uncollapsible_batches():
    with pytest.raises(ValueError, match="collapse"):
        operands.a_scale_addressing((2, 3, 4), (2, 3, 4, 2), (4 * 100, 4 * 8, 4 * 2, 4), False)
    with pytest.raises(ValueError, match="multiples of 4"):
        operands.a_scale_addressing((4,), (4, 2), (6, 2), False)


def test_k_rule_and_out_dtype():
    operands.check_k(272, 272)
    with pytest.raises(ValueError, match="multiple of 16"):
        operands.check_k(200, 200)
    with pytest.raises(ValueError, match="multiple of 16"):
        operands.check_k(0, 0)
    with pytest.raises(ValueError, match="same K"):
        operands.check_k(256, 272)
    for od in ("bfloat16", ml_dtypes.bfloat16, np.float16, "float32", np.dtype(np.float32)):
        assert operands.out_dtype_of(od) in OUT_DTYPES
    for bad in ("float64", np.int8, "nonsense"):
        with pytest.raises(TypeError, match="out_dtype"):
            operands.out_dtype_of(bad)


def test_argument_types_without_gpu_arrays():
    """Checks that come before any GPU array is touched."""
    host = np.zeros((4, 16), np.uint8)
    with pytest.raises(TypeError, match="QuantizedTensor"):
        cq.scaled_matmul(host, host)
    with pytest.raises(TypeError, match=r"cupy.asarray"):
        cq.scaled_mm(host, host, np.float32([1]), np.float32([1]))
    with pytest.raises(ValueError, match="a_format"):
        cq.scaled_mm(host, host, np.float32([1]), np.float32([1]), a_format="int8")
    qa = QuantizedTensor(
        host, np.float32([1]), Scheme(E4M3, "tensor", None, "float32", "scalar", "per_tensor"), (4, 16), np.float32
    )
    with pytest.raises(TypeError, match="a.data must be a cupy.ndarray"):
        cq.scaled_matmul(qa, qa)
    qa4 = QuantizedTensor(
        host,
        np.float32([1]),
        Scheme("float4_e2m1fn", "block", (32,), "float8_e8m0fnu", "dense", "mx"),
        (4, 16),
        np.float32,
    )
    with pytest.raises(ValueError, match="a.scheme.format"):
        cq.scaled_matmul(qa4, qa)


def test_unsupported_gpu_message(monkeypatch):
    monkeypatch.setitem(_device._caps, 0, _device.caps_of_arch("86"))
    with pytest.raises(cq.UnsupportedGPUError, match="compute capability 8.6"):
        dispatch.check_arch(0)
    assert issubclass(cq.UnsupportedGPUError, RuntimeError)


# ================================================================== GPU: inputs
PATHS = ["mma", "sm90"]


def _need(path):
    require_arch("fp8_mma")
    if path == "sm90":
        require_arch("wgmma")


def _pow2(rng, shape):
    return (2.0 ** rng.integers(-2, 3, shape)).astype(np.float32)


def _ints(rng, shape):
    return rng.integers(-3, 4, shape).astype(np.float32)


A_KINDS = ["tensor", "token-row", "token-col", "group-row", "group-col", "packed-row", "packed-col"]
B_KINDS = ["tensor", "channel", "group", "block"]


def _a_operand(kind, lead, K, fmt, rng, values=None):
    """(QuantizedTensor, host codes (rows, K) uint8, host scales in scaled_mm's table)."""
    vals = _ints(rng, lead + (K,)) if values is None else values
    codes = _codes(vals, fmt)
    data = cupy.asarray(codes)
    rows = int(np.prod(lead)) if lead else 1
    nkb = -(-K // 128)
    if kind == "tensor":
        s = _pow2(rng, (1,))
        scheme = Scheme(fmt, "tensor", None, "float32", "scalar", "per_tensor")
        return QuantizedTensor(data, cupy.asarray(s), scheme, codes.shape, np.float32), codes.reshape(rows, K), s
    gran, layout = kind.split("-")
    packed = gran == "packed"
    ng = 1 if gran == "token" else nkb
    logical = _pow2(rng, lead + (ng,))
    if packed:
        host_scale = (np.log2(logical) + 127).astype(np.uint8)
        buf = ref.scale_buffer(host_scale, lead + (K,), layout)
    else:
        buf = ref.scale_buffer(logical, lead + (K,), layout)
    lay = _scales.GroupLayout(lead, _scales.group_scale_columns(ng, packed), layout == "col")
    mem = cupy.cuda.alloc(max(lay.words, 1) * 4)
    mem.copy_from_host(buf.ctypes.data, buf.nbytes)
    scale = lay.view(mem, np.int32 if packed else np.float32)
    scheme = Scheme(
        fmt, "token" if gran == "token" else "group", (K,) if gran == "token" else (128,),
        "float8_e8m0fnu" if packed else "float32", layout, "groupwise",
    )  # fmt: skip
    q = QuantizedTensor(data, scale, scheme, codes.shape, np.float32)
    return q, codes.reshape(rows, K), logical.reshape(rows, ng)


def _b_operand(kind, N, K, rng, values=None):
    """(QuantizedWeight or QuantizedTensor, host codes, host scales in scaled_mm's table)."""
    vals = _ints(rng, (N, K)) if values is None else values
    codes = _codes(vals)
    data = cupy.asarray(codes)
    nkb = -(-K // 128)
    if kind == "tensor":
        s = _pow2(rng, (1,))
        scheme = Scheme(E4M3, "tensor", None, "float32", "scalar", "per_tensor")
        return QuantizedTensor(data, cupy.asarray(s), scheme, (N, K), np.float32), codes, s
    if kind == "channel":
        s = _pow2(rng, (N, 1)).astype(BF16)
        scheme = Scheme(E4M3, "channel", (K,), "bfloat16", "plain", "weight_quant")
    elif kind == "group":
        s = _pow2(rng, (N, nkb)).astype(np.float16)
        scheme = Scheme(E4M3, "group", (128,), "float16", "plain", "weight_quant")
    else:
        s = _pow2(rng, (-(-N // 128), nkb))
        scheme = Scheme(E4M3, "block", (128, 128), "float32", "plain", "weight_quant")
    w = cq.QuantizedWeight(data, cupy.asarray(s), None, scheme, (N, K), s.dtype)
    return w, codes, s


def _packed_words(logical) -> np.ndarray:
    """Power-of-two float32 scales (rows, n) -> packed UE8M0 int32 words (rows, ceil(n / 4))."""
    e = (np.log2(logical) + 127).astype(np.uint8)
    words = np.zeros((e.shape[0], -(-e.shape[1] // 4) * 4), np.uint8)
    words[:, : e.shape[1]] = e
    return words.view(np.int32)


def _raw_a_scale(a_kind, sa):
    """The scaled_mm a_scale of an activation kind: packed words, column-major groups, or as is."""
    if a_kind.startswith("packed"):
        return cupy.asarray(_packed_words(sa))
    return cupy.asfortranarray(cupy.asarray(sa)) if a_kind.endswith("col") else cupy.asarray(sa)


def _exact_call(a_kind, b_kind, M, N, K, seed):
    """A call of M x N x K on exact operands of the two kinds, with a bias, bf16 out: the operands
    (qa, codes, scales, qb, codes, scales), the reference's bits, the Layout and its Operands."""
    rng = np.random.default_rng(seed)
    qa, ca, sa = _a_operand(a_kind, (M,), K, E4M3, rng)
    qb, cb, sb = _b_operand(b_kind, N, K, rng)
    bias_h = (rng.integers(-64, 64, N) / 16).astype(BF16)
    want = ref.round_result(ref.scaled_mm(ca, cb, sa, sb, bias_h)[0], BF16)
    bias = cupy.asarray(bias_h)
    L = operands.for_matmul(qa, qb, "bfloat16", bias, None)
    return (qa, ca, sa, qb, cb, sb), want, L, build.operands(L, build.matmul_arrays(qa, qb, bias, None))


def _check_exact(y, codes_a, sa, codes_b, sb, out_dtype, bias=None, a_format=E4M3, what=""):
    r, _ = ref.scaled_mm(codes_a, codes_b, sa, sb, bias, a_format=a_format)
    assert_bits_equal(y.reshape(r.shape), ref.round_result(r, out_dtype), what)


def _check_bound(y, r, S, out_dtype, what=""):
    yh = cupy.asnumpy(y).reshape(r.shape).astype(np.float64)
    err, bound = np.abs(yh - r), ref.error_bound(r, S, out_dtype)
    # where the value within the bound may pass the largest finite output, +-inf is its rounding
    top = float(ml_dtypes.finfo(np.dtype(out_dtype)).max)
    overflow = np.isinf(yh) & (np.sign(yh) == np.sign(r)) & (np.abs(r) + ref.W8A8_REL_ERROR * S > top)
    bad = ~((err <= bound) | overflow)
    if bad.any():
        i = tuple(int(v) for v in np.argwhere(bad)[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.size} beyond the bound; first {i}: got {yh[i]}, ref {r[i]}, bound {bound[i]}"
        )


# ================================================================== GPU: exactness, every combination
EXACT = [(a, b) for a in A_KINDS for b in B_KINDS]


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("a_kind,b_kind", EXACT, ids=[f"{a}-{b}" for a, b in EXACT])
def test_exact_every_scale_combination(path, a_kind, b_kind):
    """Small integer codes, power-of-two scales, bias multiples of 2^-4, K = 272 (3 blocks, the last
    short): every partial sum is exact, so the bytes equal the reference's single rounding."""
    _need(path)
    rng = np.random.default_rng(_seed(a_kind, b_kind))
    M, N, K = 65, 200, 272
    qa, ca, sa = _a_operand(a_kind, (M,), K, E4M3, rng)
    qb, cb, sb = _b_operand(b_kind, N, K, rng)
    bias_h = (rng.integers(-64, 64, N) / 16).astype(BF16)
    with dispatch._forced_path(path):
        y = cq.scaled_matmul(qa, qb, bias=cupy.asarray(bias_h))
        y32 = cq.scaled_matmul(qa, qb, out_dtype="float32")
        y_mm = cq.scaled_mm(
            cupy.asarray(ca),
            cupy.asarray(cb),
            _raw_a_scale(a_kind, sa),
            cupy.asarray(sb.astype(np.float32)),
            out_dtype=np.float16,
        )
    _check_exact(y, ca, sa, cb, sb, BF16, bias_h, what=f"{path} {a_kind} x {b_kind} bf16+bias")
    _check_exact(y32, ca, sa, cb, sb, np.float32, what=f"{path} {a_kind} x {b_kind} f32")
    _check_exact(y_mm, ca, sa, cb, sb, np.float16, what=f"{path} scaled_mm {a_kind} x {b_kind}")


SHAPES = [  # (M, N, K, a kind, b kind): big M on few combinations
    (1, 33, 16, "tensor", "channel"),
    (2, 200, 272, "group-row", "group"),
    (7, 2112, 528, "token-col", "block"),
    (16, 33, 1024, "packed-col", "channel"),
    (64, 2112, 144, "group-col", "block"),
    (128, 200, 400, "tensor", "tensor"),
    (1000, 2112, 1040, "group-row", "block"),
    (4096, 200, 528, "token-row", "group"),
    (4096, 2112, 2048, "group-col", "block"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("M,N,K,a_kind,b_kind", SHAPES, ids=[f"M{s[0]}-N{s[1]}-K{s[2]}-{s[3]}-{s[4]}" for s in SHAPES])
def test_shapes_within_bound(path, M, N, K, a_kind, b_kind):
    """Gaussian codes (every e4m3 magnitude) and power-of-two scales, odd shapes: within the bound."""
    _need(path)
    rng = np.random.default_rng(_seed(M, N, K))
    va = rng.standard_normal((M, K)).astype(np.float32) * 8
    vb = rng.standard_normal((N, K)).astype(np.float32) * 8
    qa, ca, sa = _a_operand(a_kind, (M,), K, E4M3, rng, _codes(va).view(ml_dtypes.float8_e4m3fn).astype(np.float32))
    qb, cb, sb = _b_operand(b_kind, N, K, rng, _codes(vb).view(ml_dtypes.float8_e4m3fn).astype(np.float32))
    r, S = ref.scaled_mm(ca, cb, sa, sb)
    for od in OUT_DTYPES:
        with dispatch._forced_path(path):
            y = cq.scaled_matmul(qa, qb, out_dtype=od)
        assert y.shape == (M, N) and y.dtype == od
        _check_bound(y, r, S, od, what=f"{path} M{M} N{N} K{K} {od}")


E5M2_CASES = [(b, bf) for b in B_KINDS for bf in (E4M3, E5M2)]


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("b_kind,b_format", E5M2_CASES, ids=[f"{b}-b_{f}" for b, f in E5M2_CASES])
def test_exact_e5m2(path, b_kind, b_format):
    """e5m2 activations (scaled_matmul and scaled_mm), and e5m2 weights through scaled_mm's b_format."""
    _need(path)
    rng = np.random.default_rng(_seed("e5m2", b_kind, b_format))
    M, N, K = 16, 33, 400
    qa, ca, sa = _a_operand("group-row", (M,), K, E5M2, rng)
    qb, cb, sb = _b_operand(b_kind, N, K, rng)
    cb_raw = _codes(_ints(rng, (N, K)), b_format)
    with dispatch._forced_path(path):
        if b_format == E4M3:
            y = cq.scaled_matmul(qa, qb, out_dtype="float32")
            _check_exact(y, ca, sa, cb, sb, np.float32, a_format=E5M2, what=f"{path} e5m2 a x {b_kind}")
        y = cq.scaled_mm(cupy.asarray(ca), cupy.asarray(cb_raw), cupy.asarray(sa), cupy.asarray(sb.astype(np.float32)),
                         out_dtype="float32", a_format=E5M2, b_format=b_format)  # fmt: skip
    r, _ = ref.scaled_mm(ca, cb_raw, sa, sb, a_format=E5M2, b_format=b_format)
    assert_bits_equal(y, ref.round_result(r, np.float32), f"{path} scaled_mm e5m2 a x {b_format} {b_kind}")


# ================================================================== GPU: real quantizers
QUANT = [("fp8", "channel"), ("token", "group"), ("group-row", "channel"), ("group-col", "group"), ("packed", "block")]


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("a_q,b_q", QUANT, ids=[f"{a}-{b}" for a, b in QUANT])
def test_quantizer_outputs_within_bound(path, fmt, a_q, b_q):
    """Activations from quantize_fp8 / quantize_groupwise (3-D), weights from quantize_weight (bf16
    scales) or 128 x 128 blocks: within the bound of the float64 reference of their host copies."""
    _need(path)
    rng = np.random.default_rng(_seed(fmt, a_q, b_q))
    B, M, N, K = 3, 37, 2112, 768
    x = cupy.asarray(rng.standard_normal((B, M, K)).astype(np.float32).astype(BF16))
    w = cupy.asarray(rng.standard_normal((N, K)).astype(np.float32).astype(BF16) * 0.05)
    if a_q == "fp8":
        qa = cq.quantize_fp8(x, fmt)
    elif a_q == "token":
        qa = cq.quantize_groupwise(x, fmt, group_size=None, scale_layout="col")
    elif a_q == "packed":
        qa = cq.quantize_groupwise(x, fmt, group_size=128, scale_dtype="float8_e8m0fnu", scale_layout="col")
    else:
        qa = cq.quantize_groupwise(x, fmt, group_size=128, scale_layout=a_q.split("-")[1])
    ha = qa.to_host()
    ca = ha["data"].reshape(B * M, K)
    sa = ha["scale"] if a_q == "fp8" else ha["scale"].reshape(B * M, -1)
    if b_q == "block":
        qb, cb, sb = _b_operand(
            "block", N, K, rng, _codes(cupy.asnumpy(w) * 64).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        )
    else:
        qb = cq.quantize_weight(w, E4M3, group_size=None if b_q == "channel" else 128)
        hb = qb.to_host()
        cb, sb = hb["codes"], hb["scale"]
    bias = cupy.asarray(rng.standard_normal(N).astype(BF16))
    with dispatch._forced_path(path):
        y = cq.scaled_matmul(qa, qb, bias=bias)
        y2 = cq.scaled_matmul(qa, qb, bias=bias)  # the cached float32 weight scales
    assert y.shape == (B, M, N)
    assert_bits_equal(y2, y, "second call")
    r, S = ref.scaled_mm(ca, cb, sa, sb, cupy.asnumpy(bias), a_format=fmt)
    _check_bound(y, r, S, BF16, what=f"{path} {fmt} {a_q} x {b_q}")


# ================================================================== GPU: every Hopper tile, forced
TILE_CASES = [
    ("tensor", "tensor"),
    ("token-row", "channel"),
    ("group-col", "block"),
    ("packed-row", "block"),
    ("group-row", "group"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("a_kind,b_kind", TILE_CASES, ids=[f"{a}-{b}" for a, b in TILE_CASES])
def test_every_sm90_tile_forced(a_kind, b_kind):
    """Every tile of the Hopper kernel that the call's scaling mode is built for, alone and in
    clusters of two that share a's rows, and with a K split where the tile takes one, on tails in
    M, N and K (M = 300: a 256-row tile's second half mostly past M; K = 2064: a short last block):
    bit-exact on exact inputs, into a poisoned output. N = 520: five tile columns of 128 (a cluster's
    last pair has a tile past N), rows 1040 bytes apart (y through TMA where the tile can); N = 422:
    rows 844 bytes apart, y stored directly, in pieces where a chunk is not aligned or N cuts it
    (the 144-column tile's last tile column: N at column 134, within its 4-column half chunks)."""
    require_arch("wgmma")
    from cupyquant.w8a8 import sm90

    M, K = 300, 2064
    ran = 0
    for N in (520, 422):
        _, want, L, ops = _exact_call(a_kind, b_kind, M, N, K, _seed("tiles", a_kind, b_kind, N))
        for cfg in sm90.CONFIGS:
            if L.mode not in sm90.modes(cfg):
                continue
            for parts, cluster in ((1, 1), (1, 2), (3, 1)) if cfg.can_split else ((1, 1), (1, 2)):
                launch = sm90.MmLaunch(L, cfg, parts, cluster)
                # bf16 out, rows 1040 bytes apart at N = 520; MODE_K_TILE has the scales' ring where the
                # staging buffers would be
                assert launch.y_tma == (parts == 1 and cfg.y_stage(L.mode) > 0 and N == 520)
                for y_tma in (launch.y_tma, False):  # y through shared memory and TMA, and stored directly
                    launch.y_tma = y_tma
                    ops.result[...] = cupy.nan
                    launch(ops)
                    what = f"{cfg} N {N} parts {parts} cluster {cluster} TMA {y_tma} {a_kind} x {b_kind}"
                    assert_bits_equal(ops.result, want, what)
                    ran += 1
    # an N: 128 x 128 and 64 x 64 tiles 6 launches each, 256 x 128 4 (unsplit), 144-192 columns 4 (MODE_END)
    assert ran == 2 * {args.MODE_END: 16 + 12, args.MODE_K_TILE: 16, args.MODE_K_COL: 12}[L.mode]


# ================================================================== GPU: the Hopper kernel for few rows
SMALL_CASES = [(a, b) for a in ("tensor", "token-row", "group-col", "packed-row") for b in B_KINDS]


@pytest.mark.gpu
@pytest.mark.parametrize("a_kind,b_kind", SMALL_CASES, ids=[f"{a}-{b}" for a, b in SMALL_CASES])
def test_sm90_small_every_scaling_and_split(a_kind, b_kind):
    """The swapped-operand kernel (a's rows as wgmma's N) at M = 1, 7 and 16 (a short and a full
    width), N = 200 (a tile past N), K = 2064 (a short last block), with and without a K
    split, bias, into a poisoned output: bit-exact on exact inputs."""
    require_arch("wgmma")
    from cupyquant.w8a8 import sm90_small

    for M in (1, 7, 16):
        (qa, ca, sa, qb, cb, sb), want, L, ops = _exact_call(
            a_kind, b_kind, M, 200, 2064, _seed("small", a_kind, b_kind, M)
        )
        assert sm90_small.takes(L)
        for parts in (1, 3):
            ops.result[...] = cupy.nan
            sm90_small.MmSmallLaunch(L, parts)(ops)
            assert_bits_equal(ops.result, want, f"M {M} parts {parts} {a_kind} x {b_kind}")
        with dispatch._forced_path("sm90"):
            y = cq.scaled_matmul(qa, qb, out_dtype="float32")
        _check_exact(y, ca, sa, cb, sb, np.float32, what=f"planned, float32, M {M} {a_kind} x {b_kind}")


@pytest.mark.gpu
@pytest.mark.parametrize("b_kind", ["channel", "block"])
def test_sm90_small_pdl_reads_a_after_the_kernel_that_writes_it(b_kind):
    """At M <= 16 the kernel is launched with PDL, and from the second call with a weight its first
    weight slots go before the PDL wait (MmArgs.early). Rounds of new activations (codes and
    scales), each written into the same buffers by a kernel that lets the matmul start at once
    (tests/_pdl.py), give each round's reference bits, in a stream and replayed from a CUDA graph
    (a read of a before the wait would see the last round's). A per-tensor weight slot of one
    128-k block, a block-scaled one of four."""
    require_arch("wgmma")
    from cupyquant import _launch

    rng = np.random.default_rng(_seed("pdl", b_kind))
    M, N, K, R = 16, 320, 1024, 4
    qb, cb, sb = _b_operand(b_kind, N, K, rng)
    rounds = [_a_operand("token-row", (M,), K, E4M3, rng) for _ in range(R)]
    wants = [ref.round_result(ref.scaled_mm(ca, cb, sa, sb, None)[0], BF16) for _, ca, sa in rounds]
    qa = rounds[0][0]  # its buffers receive each round's codes and scales
    out = cupy.empty((M, N), BF16)
    assert not qb._read
    with _launch.recording() as rec:
        cq.scaled_matmul(qa, qb, out=out)
        cq.scaled_matmul(qa, qb, out=out)
    flags = [int(a["early"]) for *_, args_, _, launch in rec if launch is not None and launch.pdl for a in args_
             if isinstance(a, np.void) and "early" in a.dtype.names]  # fmt: skip
    assert flags == [0, 1], flags
    sources = [[q.data.copy(), q.scale.copy()] for q, _, _ in rounds]

    def check(r, got, where):
        assert_bits_equal(got[0], wants[r], f"{where}, round {r}")

    check_rounds(lambda: [cq.scaled_matmul(qa, qb, out=out)], [qa.data, qa.scale], sources, check)


# ================================================================== GPU: out=, streams, graphs, layouts
@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_out_stream_graph_and_strided_operands(path):
    _need(path)
    rng = np.random.default_rng(7)
    M, N, K = 65, 200, 272
    qa, ca, sa = _a_operand("group-col", (5, 13), K, E4M3, rng)
    qb, cb, sb = _b_operand("group", N, K, rng)
    bias_h = (rng.integers(-64, 64, N) / 16).astype(np.float16)
    bias = cupy.asarray(bias_h)
    with dispatch._forced_path(path):
        out = poisoned((5, 13, N), np.float16)
        y = cq.scaled_matmul(qa, qb, out_dtype=np.float16, bias=bias, out=out)
        assert y is out
        _check_exact(y, ca, sa, cb, sb, np.float16, bias_h, what="out=, 3-D a")
        # an out whose rows are strided (a column slice of a wider buffer)
        wide = poisoned((M, N + 8), np.float16)
        y = cq.scaled_mm(cupy.asarray(ca), cupy.asarray(cb), cupy.asarray(sa), cupy.asarray(sb.astype(np.float32)),
                         out_dtype=np.float16, out=wide[:, :N])  # fmt: skip
        _check_exact(y, ca, sa, cb, sb, np.float16, what="strided out")
        assert (cupy.asnumpy(wide[:, N:]).view(np.uint16) == 0xFFFF).all(), "written past the out view"
        # operands whose rows are not 16-byte aligned are copied
        big_a = cupy.zeros((M, K + 8), np.uint8)
        big_a[:, 8:] = cupy.asarray(ca)
        a_mis = big_a[:, 8:]
        y = cq.scaled_mm(a_mis, cupy.asarray(cb), cupy.asarray(sa), cupy.asarray(sb.astype(np.float32)))
        _check_exact(y, ca, sa, cb, sb, BF16, what="misaligned a")
        # a non-default stream
        s = side_stream()
        with s:
            y = cq.scaled_matmul(qa, qb, out_dtype="float32")
        s.synchronize()
        _check_exact(y, ca, sa, cb, sb, np.float32, what="stream")
        # a CUDA graph: captured once, replayed into the same output
        with s:
            cq.scaled_matmul(qa, qb, bias=bias, out_dtype=np.float16)  # compiled before the capture
            out = poisoned((5, 13, N), np.float16)
            s.begin_capture()
            cq.scaled_matmul(qa, qb, bias=bias, out_dtype=np.float16, out=out)
            g = s.end_capture()
            g.launch(s)
        s.synchronize()
        _check_exact(out, ca, sa, cb, sb, np.float16, bias_h, what="graph replay")


@pytest.mark.gpu
def test_operands_addressing_of_real_layouts():
    """for_matmul and build() of quantize_groupwise's layouts: the addressing of the containers' own
    strides, and the arguments the kernels get (args.mm_args)."""
    require_arch("fp8_mma")
    x = cupy.ones((2, 6, 256), np.float16)
    w = cq.quantize_weight(cupy.ones((40, 256), np.float16), E4M3, group_size=128)

    def call(qa, b):
        L = operands.for_matmul(qa, b, "bfloat16", None, None)
        return L, build.operands(L, build.matmul_arrays(qa, b, None, None)), args.mm_args(L)

    qa = cq.quantize_groupwise(x, group_size=128, scale_layout="col")
    L, ops, p = call(qa, w)
    assert (L.sa_rows, L.sa_batch, L.sa_m, L.sa_k, L.sa_packed) == (6, 16, 1, 8, False)
    assert (L.sb_n, L.sb_k, L.sb_shift, L.mode) == (2, 1, 0, args.MODE_K_COL)
    assert ops.sb.dtype == np.float32 and ops.result.shape == (2, 6, 40) and (L.M, L.N, p["ldy"]) == (12, 40, 40)
    qa = cq.quantize_groupwise(x, group_size=128, scale_dtype="float8_e8m0fnu")
    L, ops, p = call(qa, w)
    assert (L.sa_rows, L.sa_batch, L.sa_m, L.sa_k, L.sa_packed) == (6, 6, 1, 1, True)
    qa = cq.quantize_groupwise(x, group_size=None, scale_dtype="float8_e8m0fnu")  # expanded to float32
    L, ops, p = call(qa, w)
    assert L.sa_unpack and ops.sa.dtype == np.float32
    assert (p["sa_m"], p["sa_k"], p["sa_packed"]) == (1, 0, 0)
    qa = cq.quantize_fp8(x)
    L, ops, p = call(qa, w.prepare())
    assert (L.sa_m, L.sa_k, L.mode, L.b_plain) == (0, 0, args.MODE_K_COL, True)
    assert_bits_equal(ops.b, w.data, "prepared weight made plain")


# ================================================================== GPU: validation
@pytest.mark.gpu
def test_validation_errors_leave_buffers_untouched():
    rng = np.random.default_rng(3)
    M, N, K = 8, 40, 256
    qa, ca, sa = _a_operand("group-row", (M,), K, E4M3, rng)
    qb, cb, sb = _b_operand("group", N, K, rng)
    a, b = cupy.asarray(ca), cupy.asarray(cb)
    a_s, b_s = cupy.asarray(sa), cupy.asarray(sb.astype(np.float32))
    out = poisoned((M, N), BF16)
    before = [cupy.asnumpy(v).copy() for v in (a, b, a_s, b_s, qa.scale, qb.scale)]
    qa_k = _a_operand("tensor", (M,), 272, E4M3, rng)[0]
    qa_bad_k = _a_operand("tensor", (M,), 264, E4M3, rng)[0]
    qa_g64 = QuantizedTensor(
        qa.data, qa.scale, Scheme(E4M3, "group", (64,), "float32", "row", "groupwise"), qa.shape, np.float32
    )
    w_int4 = cq.quantize_weight(cupy.ones((N, K), np.float16), "int4")
    w_g64 = cq.quantize_weight(cupy.ones((N, K), np.float16), E4M3, group_size=64)
    qb_e5 = QuantizedTensor(
        b, cupy.ones(1, np.float32), Scheme(E5M2, "tensor", None, "float32", "scalar", "per_tensor"), (N, K), np.float32
    )
    cases = [
        (lambda: cq.scaled_matmul(qa, b), TypeError, "b must be"),
        (lambda: cq.scaled_matmul(qa, qb_e5), ValueError, "b.scheme.format"),
        (lambda: cq.scaled_matmul(qa, w_int4), ValueError, "FP8"),
        (lambda: cq.scaled_matmul(qa, w_g64), ValueError, "groups of 128"),
        (lambda: cq.scaled_matmul(qa_g64, qb), ValueError, "groups of 128"),
        (lambda: cq.scaled_matmul(qa_k, qb), ValueError, "same K"),
        (lambda: cq.scaled_mm(a[:, :200], b[:, :200], a_s, b_s), ValueError, "multiple of 16"),
        (lambda: cq.scaled_matmul(qa_bad_k, qb), ValueError, "same K"),
        (lambda: cq.scaled_matmul(qa, qb, out_dtype="float64"), TypeError, "out_dtype"),
        (lambda: cq.scaled_matmul(qa, qb, bias=cupy.zeros(N, np.float32)), TypeError, "bias"),
        (lambda: cq.scaled_matmul(qa, qb, bias=cupy.zeros(N + 1, BF16)), ValueError, "bias"),
        (lambda: cq.scaled_matmul(qa, qb, bias=cupy.zeros(2 * N, BF16)[::2]), ValueError, "bias"),
        (lambda: cq.scaled_matmul(qa, qb, out=out[:, :-1]), ValueError, "out must have shape"),
        (lambda: cq.scaled_matmul(qa, qb, out=out, out_dtype="float16"), TypeError, "out must have dtype"),
        (lambda: cq.scaled_matmul(qa, qb, out=poisoned((N, M), BF16).T), ValueError, "contiguous last axis"),
        (lambda: cq.scaled_mm(a, b, a_s, b_s, out=poisoned((M, N), np.float32)), TypeError, "out must have dtype"),
        (lambda: cq.scaled_mm(a, b, a_s[:, :1].copy()[:2], b_s), ValueError, "a_scale of shape"),
        (lambda: cq.scaled_mm(a, b, a_s, b_s[:, :1].copy()[:3]), ValueError, "b_scale of shape"),
        (lambda: cq.scaled_mm(a, b, a_s.astype(np.float16), b_s), TypeError, "a_scale must be float32"),
        (lambda: cq.scaled_mm(a, b, a_s, b_s, b_format="int8"), ValueError, "b_format"),
        (lambda: cq.scaled_mm(a.view(np.int8), b, a_s, b_s), TypeError, "uint8"),
        (lambda: cq.scaled_mm(a[None], b, a_s, b_s), ValueError, "2-D"),
    ]
    overlap = cupy.zeros((M, N), np.float32)
    cases.append(
        (
            lambda: cq.scaled_mm(a, b, overlap[:, :1].reshape(M), b_s, out=overlap, out_dtype="float32"),
            ValueError,
            "overlaps",
        )
    )
    if cupy.cuda.runtime.getDeviceCount() > 1:
        with cupy.cuda.Device(1):
            other = cupy.zeros(N, BF16)
        cases.append((lambda: cq.scaled_matmul(qa, qb, bias=other), ValueError, "device"))
    for fn, exc, match in cases:
        with pytest.raises(exc, match=match):
            fn()
    assert (cupy.asnumpy(out).view(np.uint16) == 0xFFFF).all(), "out was written"
    for v, h in zip((a, b, a_s, b_s, qa.scale, qb.scale), before):
        assert_bits_equal(v, h, "an input")


@pytest.mark.gpu
def test_unsupported_gpu_raises_before_allocating(monkeypatch):
    rng = np.random.default_rng(4)
    qa = _a_operand("tensor", (4,), 64, E4M3, rng)[0]
    qb = _b_operand("channel", 8, 64, rng)[0]
    monkeypatch.setitem(_device._caps, cupy.cuda.Device().id, _device.caps_of_arch("80"))

    def no_alloc(*a, **k):
        raise AssertionError("allocated before the architecture check")

    monkeypatch.setattr(build, "operands", no_alloc)
    with pytest.raises(cq.UnsupportedGPUError):
        cq.scaled_matmul(qa, qb)


@pytest.mark.gpu
def test_empty_rows():
    require_arch("fp8_mma")
    rng = np.random.default_rng(5)
    qb = _b_operand("channel", 8, 64, rng)[0]
    y = cq.scaled_mm(cupy.zeros((0, 64), np.uint8), qb.data, cupy.ones((0,), np.float32), cupy.ones(1, np.float32))
    assert y.shape == (0, 8)


# ================================================================== CPU: the Hopper kernel's plan
def test_sm90_tile_choice():
    from cupyquant.w8a8 import sm90

    small, large, wide = sm90.SMALL, sm90.LARGE, sm90.WIDE
    assert sm90.config(1, 4096, 4096, 132) == small
    assert sm90.config(64, 24576, 1536, 132) == small
    assert sm90.config(128, 7168, 2048, 132) == small  # 56 large tiles would leave half the SMs idle
    assert sm90.config(128, 2112, 7168, 132) == small
    assert sm90.config(65, 8192, 8192, 132) == large  # 256 small tiles: two waves over a long K
    assert sm90.config(65, 14336, 4096, 132) == large  # 112 large tiles fill the SMs
    assert sm90.config(129, 2112, 7168, 132) == large  # 34 wide tiles would leave most SMs idle
    assert sm90.config(512, 4096, 4096, 132) == large  # 64 wide tiles: half the SMs
    assert sm90.config(1024, 4096, 4096, 132) == wide  # one round of 128 wide tiles against two of narrow
    assert sm90.config(8192, 8192, 8192, 132) == wide
    assert sm90.config(8192, 8192, 8192, 132, mode=args.MODE_K_TILE) == wide
    assert sm90.config(8192, 8192, 8192, 132, mode=args.MODE_K_COL) == large  # no two-wave K_COL tile
    assert sm90.modes(wide) == (args.MODE_END, args.MODE_K_TILE) and sm90.modes(large) == args.MODES
    for cfg in sm90.CONFIGS:  # a ring of 128-k slots, the alignment slack and y's staging or the scales' ring
        for mode in sm90.modes(cfg):
            assert cfg.smem(mode) == cfg.stages * (cfg.bm + cfg.bn) * 128 + 1024 + cfg.y_stage(mode) + cfg.scale_ring(
                mode
            )
            assert cfg.smem(mode) <= 227 * 1024
        assert cfg.stages * (cfg.bm + cfg.bn) * 128 % 1024 == 0  # every slot 1024-byte aligned
        assert cfg.y_stage() == (0 if cfg.bn > 128 else (2 if cfg.bm > 64 else 1) * 64 * cfg.bn * 2)
        assert cfg.y_stage(args.MODE_K_TILE) == 0 and cfg.scale_ring(args.MODE_K_TILE) == cfg.stages * (cfg.bm + 4) * 4
        assert cfg.can_split == (cfg.bm <= 128 and cfg.bn <= 128)


def test_sm90_tile_widths():
    """The 128 x 192, 160 and 144 FP8 tiles (MODE_END only, never split) where their rounds of tiles
    take less modelled time than the 128 x 128 and 256 x 128 tiles' (sm90._time), the widest of equal
    times; elsewhere the choice of the 128-column tiles stands."""
    from cupyquant.w8a8 import sm90

    large, wide, w192, w160, w144 = sm90.LARGE, sm90.WIDE, sm90.LARGE_192, sm90.LARGE_160, sm90.LARGE_144
    assert sm90.config(4096, 2112, 7168, 132) == w192  # 3 rounds x 1.5 against 3 x 1.6 (wide), 5 (large)
    assert sm90._time(4096, 2112, w144, 132) == sm90._time(4096, 2112, w192, 132) == 4.5  # 4 x 1.125: the wider
    assert sm90.config(1024, 2112, 7168, 132) == w144  # 120 tiles in one round (1.125) against 68 wide ones (1.6)
    assert sm90.config(2048, 2112, 7168, 132) == w144  # 2 rounds (2.25) against 3 (large) and 2 x 1.6 (wide)
    assert sm90.config(512, 5120, 8192, 132) == w160  # 128 tiles of 160 columns, one round (1.25)
    assert sm90.config(4096, 576, 7168, 132) == w144  # 128 tiles (1.125) against 80 wide ones (1.6)
    # N = 24576 = 128 x 192: 32 x 128 tiles of 192 columns take 32 rounds (48) against 24 x 1.6 (wide)
    assert sm90.config(4096, 24576, 1536, 132) == wide
    assert sm90.config(4096, 7168, 7168, 132) == wide  # 11.2 against 15 (192), 13.75 (160), 14.625 (144)
    assert sm90.config(4096, 4096, 4096, 132) == wide
    assert sm90.config(4096, 14336, 4096, 132) == wide
    assert sm90.config(2048, 14336, 4096, 132) == wide
    assert sm90.config(256, 7168, 7168, 132) == large  # one round of 112 tiles
    # block scales and per-column scales along K keep the 128-column tiles; INT8 has its own
    assert sm90.config(4096, 2112, 7168, 132, mode=args.MODE_K_TILE) == wide
    assert sm90.config(4096, 2112, 7168, 132, mode=args.MODE_K_COL) == large
    assert sm90.config(1024, 2112, 4096, 132, int8=True) == large
    for cfg in sm90.LARGE_WIDTHS:
        assert cfg in sm90.CONFIGS and sm90.modes(cfg) == (args.MODE_END,) and not cfg.can_split
        assert (cfg.bm, cfg.waves, cfg.threads) == (128, 1, 384)
        assert cfg.smem() + (cfg.bm + cfg.bn) * 128 > 227 * 1024  # the deepest ring that fits


def test_sm90_k_split():
    from cupyquant.w8a8 import sm90

    assert sm90.splits(192, 12, 132) == (1, 12)  # more tiles than SMs: no split
    assert sm90.splits(67, 32, 132) == (1, 32)  # half the SMs busy or more: no split
    assert sm90.splits(64, 32, 132) == (2, 16)
    assert sm90.splits(34, 56, 132) == (3, 19)  # the last part takes the rest (18 blocks)
    assert sm90.splits(1, 6, 132) == (1, 6)  # no part shorter than MIN_KB_PER_SPLIT blocks
    assert sm90.splits(1, 8, 132) == (2, 4)
