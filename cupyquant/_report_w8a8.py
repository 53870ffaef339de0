"""The W8A8 section of ``python -m cupyquant``: :func:`cupyquant.scaled_matmul` on the built-in
tensor as FP8 activations times a Gaussian FP8 weight, per-token x per-channel and 1 x 128 groups x
128 x 128 blocks, and as INT8 activations (per token, symmetric and with zero points) times the
weight in per-channel INT8.

Per scheme: the SNR of the bf16 result against the float64 product of the unquantized bf16
operands (what quantizing both sides costs); the kernels' error bound (docs/w8a8.md) checked on
every element against the float64 product of the dequantized operands (INT8: also the result of
:func:`cupyquant.reference.scaled_mm_int8`, bit for bit); the time of a 4096 x 4096 x 4096 call (the
tensor and the weight tiled 2 x 2) by CUDA-graph replay, its TFLOP/s and its speed against cuBLAS
bf16 (``cupy.matmul`` of the bf16 operands). A row the GPU has no tensor cores for (FP8 below
compute capability 8.9, INT8 below 8.0) prints one line saying so.

The helpers that need no GPU (:func:`expand_scale`, :func:`dequantize64`, :func:`bf16_half_ulp`,
:func:`bound_ratio`, :func:`snr_db`) take NumPy or CuPy arrays (``xp``)."""

from __future__ import annotations

import numpy as np

from . import _device
from ._sizes import ceil_div

#: The weight's shape (N, K) and the seed of its Gaussian values (standard deviation 0.02).
WEIGHT_SEED = 20261122
WEIGHT_STD = 0.02
#: The kernels' accumulation bound: |y - ref| <= 2^-9 * sum_k |a_k b_k| + half an ulp of the output.
BOUND_REL = 2.0**-9
#: The activations and the weight tiled to a 4096 x 4096 x 4096 problem for the timing.
TIME_TILE = (2, 2)

SCHEMES = (
    ("FP8 per-token x per-channel", "token"),
    ("FP8 1x128 x 128x128 blocks", "block"),
    ("INT8 per-token x per-channel", "int8"),
    ("INT8 per-token+zp x per-channel", "int8-zp"),
)


def builtin_weight(shape) -> np.ndarray:
    """A deterministic Gaussian weight (float32 on the host; the report uses its bf16 rounding)."""
    rng = np.random.default_rng(WEIGHT_SEED)
    return (rng.standard_normal(shape) * WEIGHT_STD).astype(np.float32)


def quantize_pair(x, w, kind):
    """(a, b) for :func:`cupyquant.scaled_matmul`: ``kind`` ``"token"`` (per-token activations,
    per-channel weight), ``"block"`` (1 x 128 activation groups in the "col" layout, 128 x 128
    weight blocks), ``"int8"`` / ``"int8-zp"`` (INT8 per-token activations, symmetric or with zero
    points, and the per-channel INT8 weight)."""
    import cupyquant as cq

    if kind.startswith("int8"):
        return (
            cq.quantize_groupwise(x, "int8", group_size=None, symmetric=kind == "int8"),
            cq.quantize_weight(w, "int8", group_size=None),
        )
    if kind == "token":
        return (
            cq.quantize_groupwise(x, "float8_e4m3fn", group_size=None),
            cq.quantize_weight(w, "float8_e4m3fn", group_size=None),
        )
    return (
        cq.quantize_groupwise(x, "float8_e4m3fn", group_size=128, scale_layout="col"),
        cq.quantize_weight(w, "float8_e4m3fn", block_size=(128, 128)),
    )


def expand_scale(s, rows: int, cols: int, xp=np):
    """The float64 scale of every element of a (rows, cols) operand from its scale array ``s``:
    one element (per tensor), (rows, 1) (per token or channel), (rows, ceil(cols/128)) (1 x 128
    groups) or (ceil(rows/128), ceil(cols/128)) (128 x 128 blocks)."""
    s = xp.asarray(s).astype(xp.float64)
    if s.size == 1:
        return xp.full((rows, cols), float(s.reshape(-1)[0]), dtype=xp.float64)
    if s.ndim != 2:
        raise ValueError(f"s must be 2-D or hold one element, got shape {s.shape}")

    def step(n, total):
        if n == total:
            return 1
        if n == 1:
            return total
        if n == ceil_div(total, 128):
            return 128
        raise ValueError(f"s has {n} scales along an axis of {total}: not 1, {total} or ceil({total}/128)")

    r, c = step(s.shape[0], rows), step(s.shape[1], cols)
    return xp.repeat(xp.repeat(s, r, axis=0), c, axis=1)[:rows, :cols]


def dequantize64(codes, scale, xp=np, zero_point=None):
    """float64 values ``(code - zero_point) * scale`` of FP8 e4m3 ``codes`` (host uint8 bytes) or INT8
    codes (host int8), (rows, cols), and their scales (any shape :func:`expand_scale` takes) and
    zero points (one per row, or one), on ``xp``."""
    import ml_dtypes

    codes = np.ascontiguousarray(codes)
    v = codes.astype(np.float64) if codes.dtype == np.int8 else codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    if zero_point is not None:
        v = v - np.asarray(zero_point, dtype=np.float64).reshape(-1, 1)
    rows, cols = v.shape
    s = scale if xp is np else xp.asarray(np.asarray(scale).astype(np.float64))
    return xp.asarray(v) * expand_scale(s, rows, cols, xp)


def bf16_half_ulp(v, xp=np):
    """Half the spacing of bfloat16 numbers at |v| (8 significant bits; 2^-134 below the normals)."""
    a = xp.abs(v)
    _, e = xp.frexp(a)  # a = m 2^e, m in [0.5, 1): the ulp is 2^(e - 8), half of it 2^(e - 9)
    e = xp.where(a > 0, e, -200)
    return xp.ldexp(xp.ones_like(a), xp.maximum(e - 9, -134))


def bound_ratio(y, ref, S, xp=np) -> float:
    """max over elements of |y - ref| / (2^-9 S + half a bf16 ulp at max(|ref|, |y|)): at most 1
    where the result keeps the kernels' stated bound."""
    y = y.astype(xp.float64)
    lim = BOUND_REL * S + bf16_half_ulp(xp.maximum(xp.abs(ref), xp.abs(y)), xp)
    return float((xp.abs(y - ref) / lim).max())


def snr_db(y, target, xp=np) -> float:
    err = y.astype(xp.float64) - target
    return float(10 * np.log10(float((target**2).sum()) / max(float((err**2).sum()), 1e-300)))


def _int8_exact(y, ha, hb) -> bool:
    """Whether ``y`` equals the INT8 reference on the operands' host copies (to_host()), bit for bit."""
    import cupy

    from .reference import scaled_mm_int8

    a = ha["data"].reshape(-1, ha["data"].shape[-1]).view(np.int8)
    b = hb["data"].view(np.int8)
    zp = ha.get("zero_point")
    want = scaled_mm_int8(
        a,
        b,
        ha["scale"].reshape(-1),
        hb["scale"].reshape(-1),
        azp=None if zp is None else zp.reshape(-1),
        azp_adj=None if zp is None else hb["code_sum"],
        out_dtype=y.dtype,
    )
    return bool((cupy.asnumpy(y).reshape(want.shape).view(np.uint16) == want.view(np.uint16)).all())


def _time_ours(fn, calls=3):
    """Seconds per call by CUDA-graph replay (a loop of calls if the call cannot be captured)."""
    from . import _bench

    try:
        return _bench.time_graph(fn, [()] * calls, reps=10)
    except Exception:  # noqa: BLE001 - not capturable: time a loop between events instead
        return _bench.time_loop(fn, [()], calls=20)


def _time_scheme(a, w, kind):
    """Seconds per :func:`cupyquant.scaled_matmul` call of ``a`` and ``w`` quantized by ``kind``."""
    import cupy

    import cupyquant as cq

    qa, qb = quantize_pair(a, w, kind)
    y = cupy.empty((a.shape[0], w.shape[0]), a.dtype)
    return _time_ours(lambda: cq.scaled_matmul(qa, qb, out=y))


def _cublas(a16, w16):
    """(seconds, label) of cuBLAS ``a @ w.T`` through cupy.matmul: bf16 if CuPy multiplies bf16,
    else the same values in fp16."""
    import cupy

    from . import _bench

    label = "bf16"
    try:
        y = cupy.matmul(a16, w16.T)
    except (TypeError, ValueError, NotImplementedError):
        a16, w16, label = a16.astype(np.float16), w16.astype(np.float16), "fp16"
        y = cupy.matmul(a16, w16.T)
    return _bench.time_loop(lambda: cupy.matmul(a16, w16.T, out=y), [()], calls=20), label


def w8a8_report(xh, x) -> bool:
    """Print the W8A8 table for the built-in tensor (host ``xh`` and device ``x``, bf16 (M, K)).
    Returns False when an element breaks the error bound; True otherwise, and when the GPU has no
    FP8 tensor cores (the section says it is skipped and why)."""
    import cupy

    import cupyquant as cq

    from .w8a8 import dispatch

    print()
    try:
        dispatch.check_arch(cupy.cuda.Device().id, int8=True)
    except _device.UnsupportedGPUError as e:
        print(f"W8A8 matmul: skipped ({e})")
        return True
    M, K = x.shape
    N = K
    wh = builtin_weight((N, K)).astype(xh.dtype)
    w = cupy.asarray(wh)
    target = cupy.asarray(xh.astype(np.float64)) @ cupy.asarray(wh.astype(np.float64)).T
    big_a, big_w = cupy.tile(x, TIME_TILE), cupy.tile(w, TIME_TILE)
    Mb, Kb = big_a.shape
    Nb = big_w.shape[0]
    flop = 2.0 * Mb * Nb * Kb
    t_cublas, label = _cublas(big_a, big_w)
    print(
        f"W8A8 matmul: y = a @ w.T, a the tensor ({M}, {K}) in FP8 e4m3 or INT8, w a Gaussian ({N}, {K}) weight "
        f"in the same format, bf16 out; timed at {Mb}x{Nb}x{Kb} (both tiled 2 x 2) vs cuBLAS {label} "
        f"({t_cublas * 1e6:.1f} us, {flop / t_cublas / 1e12:.0f} TFLOP/s)"
    )
    cols = ("scheme", "SNR dB", "bound*", "within", "matmul us", "TFLOP/s", "x cuBLAS")
    widths = (31, 7, 6, 6, 9, 7, 8)
    print("  ".join(c.ljust(wd) for c, wd in zip(cols, widths)))
    ok_all = True
    for name, kind in SCHEMES:
        try:
            dispatch.check_arch(cupy.cuda.Device().id, int8=kind.startswith("int8"))
        except _device.UnsupportedGPUError as e:
            print(f"{name.ljust(widths[0])}  skipped ({e})")
            continue
        qa, qb = quantize_pair(x, w, kind)
        y = cq.scaled_matmul(qa, qb)
        ha, hb = qa.to_host(), qb.to_host()
        zp = ha.get("zero_point")
        A = dequantize64(ha["data"], ha["scale"], cupy, zp)
        B = dequantize64(hb["data"], hb["scale"], cupy)
        ref = A @ B.T
        S = cupy.abs(A) @ cupy.abs(B).T
        ratio = bound_ratio(y, ref, S, cupy)
        within = ratio <= 1.0 and (not kind.startswith("int8") or _int8_exact(y, ha, hb))
        ok_all &= within
        snr = snr_db(y, target, cupy)
        del A, B, ref, S
        t = _time_scheme(big_a, big_w, kind)
        row = (
            name,
            f"{snr:.2f}",
            f"{ratio:.3f}",
            "yes" if within else "NO",
            f"{t * 1e6:.1f}",
            f"{flop / t / 1e12:.0f}",
            f"{t_cublas / t:.2f}",
        )
        print("  ".join(c.ljust(wd) for c, wd in zip(row, widths)))
    print("* SNR of y against the float64 product of the unquantized bf16 operands; bound: the largest")
    print("  |y - ref| / (2^-9 sum_k |a_k b_k| + half a bf16 ulp) over all elements, ref the float64")
    print("  product of the dequantized operands; the kernels keep it at most 1 (docs/w8a8.md). INT8 rows")
    print("  are within only if y also equals cupyquant.reference.scaled_mm_int8 bit for bit.")
    cupy.get_default_memory_pool().free_all_blocks()
    return ok_all
