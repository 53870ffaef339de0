"""What the FP4 weight-only matmul tests share: the exactly dequantized weight, the element-wise error
bound, weights built from chosen codes and scale bytes, and the scale bytes the kernels take exactly."""

from __future__ import annotations

import ml_dtypes
import numpy as np
from conftest import assert_bits_equal, poisoned

import cupyquant as cq
from cupyquant.weight.formats import weight_scheme

try:
    import cupy
except ImportError:  # the GPU tests skip; the module still imports
    cupy = None

FORMATS = ["nvfp4", "mxfp4"]
HALF = [np.float16, ml_dtypes.bfloat16]
BLOCK = {"nvfp4": 16, "mxfp4": 32}
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def dtype_id(v):
    return np.dtype(v).name if not isinstance(v, (str, int)) else str(v)


def exact_weight(qw):
    """The float64 weight ``e2m1(q) * scale (* scale_2)`` of plain ``qw``, on the device, not rounded."""
    N, K = qw.shape
    codes = cupy.stack([qw.data & 15, qw.data >> 4], axis=-1).reshape(N, K)
    sb = cupy.asnumpy(qw.scale)
    if qw.scheme.format == "nvfp4":
        s = sb.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * float(cupy.asnumpy(qw.scale_2)[0])
    else:
        s = np.ldexp(1.0, sb.astype(np.int64) - 127)
    return cupy.asarray(E2M1)[codes] * cupy.repeat(cupy.asarray(s), BLOCK[qw.scheme.format], axis=1)


def half_ulp(x, dtype):
    """Half a unit in the last place of |x| in dtype (fp16: 11 bits, min 2^-24; bf16: 8 bits, min 2^-133)."""
    bits, tiny = (11, -24) if np.dtype(dtype) == np.float16 else (8, -133)
    e = cupy.floor(cupy.log2(cupy.maximum(x, 2.0**-140)))
    return cupy.exp2(cupy.maximum(e - bits + 1, tiny)) / 2


def err_ratio(y, a, W) -> float:
    """max |y - a @ W.T| / bound, bound ``(K 2^-23 + 2^-22) (|a| @ |W|.T)`` plus half an ulp of y's
    dtype: float32 sums with at most one rounding (truncation included) an addition, the final
    scaling and the rounding to y's dtype (NaN and infinity count as past it)."""
    K = a.shape[-1]
    a64 = a.astype(cupy.float64).reshape(-1, K)
    want = a64 @ W.T
    bound = (K * 2.0**-23 + 2.0**-22) * (cupy.abs(a64) @ cupy.abs(W).T)
    yh = y.astype(cupy.float64).reshape(want.shape)
    bound += half_ulp(cupy.maximum(cupy.abs(want), cupy.abs(yh)), y.dtype)
    r = cupy.abs(yh - want) / bound
    return float(cupy.where(cupy.isfinite(r), r, cupy.inf).max())


def weights(shape, seed, dtype):
    """Gaussian rows with per-row magnitudes 2^-6..2^6 and an all-zero block: every MXFP4 scale
    within the range where fp16 is exact (2^-16..2^8)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape) * 2.0 ** rng.uniform(-6, 6, (shape[0], 1))
    w[1 % shape[0], :32] = 0.0
    return cupy.asarray(w.astype(np.float32).astype(dtype))


def built(fmt, codes, scale_bytes, dtype, scale_2=1.0):
    """A plain FP4 QuantizedWeight from E2M1 codes (N, K) and scale bytes (N, K / block)."""
    N, K = codes.shape
    data = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    s2 = cupy.asarray(np.array([scale_2], np.float32)) if fmt == "nvfp4" else None
    scheme = weight_scheme(fmt, BLOCK[fmt], K, dtype)
    return cq.QuantizedWeight(
        cupy.asarray(data), cupy.asarray(scale_bytes.astype(np.uint8)), None, scheme, (N, K), dtype, scale_2=s2
    )


def scale_bytes(fmt, dtype, shape, rng):
    """Scale bytes the kernels take exactly: finite E4M3 values of either sign (NVFP4), E8M0
    exponents -16..8 (fp16) or -108..25 (bf16)."""
    if fmt == "nvfp4":
        finite = np.array([b for b in range(256) if b & 0x7F != 0x7F])
        return finite[rng.integers(0, len(finite), shape)]
    lo, hi = (-16, 8) if np.dtype(dtype) == np.float16 else (-108, 25)
    return 127 + rng.integers(lo, hi + 1, shape)


def assert_exact(y, want, what):
    """y equals the exact float64 products ``want`` rounded once to y's dtype (compared as float32
    values plus 0, so that a zero's sign, which a sum's order sets, does not count)."""
    with np.errstate(over="ignore"):  # fp16 sums past its range are inf, in y too
        exact = want.astype(np.float32).astype(y.dtype).astype(np.float32) + np.float32(0)
    assert_bits_equal(cupy.asnumpy(y).astype(np.float32) + np.float32(0), exact, what)


def matmul_poisoned(a, qw, dtype):
    """cq.matmul into a poisoned out= buffer (every output must be written)."""
    out = poisoned((a.shape[0], qw.shape[0]), dtype)
    assert cq.matmul(a, qw, out=out) is out
    return out
