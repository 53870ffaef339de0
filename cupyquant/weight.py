"""Weight-only quantization (INT4 as GPTQ/Marlin and AWQ, FP8 for W8A16) and the matmul that
dequantizes the weights in registers.

Kernels: ``kernels/weight.cu``. Reference: :func:`cupyquant.reference.quantize_weight` and
:func:`cupyquant.reference.dequantize_weight`.

Layout (the interchange format, and the one :func:`matmul` reads: no ``prepare`` step is needed):
``w`` is ``(N, K)`` in PyTorch Linear's ``[out, in]`` order; INT4 data ``(N, K / 2)`` uint8 with
element 0 in the low nibble, FP8 data ``(N, K)`` uint8; scales ``(N, K / G)`` in the weight's
dtype; uint4 zero points ``(N, ceil(K / G / 2))`` uint8, packed like the data.
"""

from __future__ import annotations

import math

import cupy
import ml_dtypes
import numpy as np

from . import _dtypes, _jit, _validate
from . import reference as _ref

_FAMILY = "weight"
_SCHEME_IDS = {"int4": _jit.WEIGHT_INT4, "uint4": _jit.WEIGHT_UINT4, "float8_e4m3fn": _jit.WEIGHT_FP8}
_CHUNK = {"int4": 128, "uint4": 128, "float8_e4m3fn": 64}  # K per warp iteration (weight.cu: 4 x VALS)
_MM_N = 32  # output columns per block (weight.cu: 8 x MM_NT)
_MM_M = 16  # rows of a per block (one mma M tile)
_MAX_GRID_Y = 65535

_WQ_ARGS = np.dtype([("N", np.int64), ("K", np.int64), ("ng", np.int64), ("G", np.int32)], align=True)
_MM_ARGS = np.dtype(
    [("M", np.int64), ("N", np.int64), ("K", np.int64), ("lda", np.int64), ("ng", np.int64), ("G", np.int32)],
    align=True,
)


class QuantizedWeight:
    """A weight quantized by :func:`quantize_weight`.

    Attributes
    ----------
    data : cupy.ndarray
        uint8 ``(N, K / 2)`` (INT4, element 0 in the low nibble) or ``(N, K)`` (FP8 bytes).
    scales : cupy.ndarray
        ``(N, K / group_size)`` in the original weight's dtype.
    zeros : cupy.ndarray or None
        uint4 only: zero points, uint8 ``(N, ceil(K / group_size / 2))``, packed like the data.
    scheme : str
        ``"int4"`` (symmetric, codes ``q - 8``), ``"uint4"`` (asymmetric, ``q - z``) or
        ``"float8_e4m3fn"``.
    group_size : int or None
        ``None``: one scale per output channel.
    shape : tuple
        ``(N, K)`` of the original weight.
    dtype : numpy.dtype
        The original weight's dtype (and the scales').
    """

    def __init__(self, data, scales, zeros, scheme, group_size, shape, dtype):
        self.data, self.scales, self.zeros = data, scales, zeros
        self.scheme, self.group_size = scheme, group_size
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)

    @property
    def G(self) -> int:
        return self.shape[1] if self.group_size is None else self.group_size

    @property
    def nbytes(self) -> int:
        """Bytes on the device: data, scales and zero points."""
        return self.data.nbytes + self.scales.nbytes + (0 if self.zeros is None else self.zeros.nbytes)

    def dequantize(self, dtype=None, *, out=None) -> cupy.ndarray:
        """``(N, K)`` in ``dtype`` (default: the original weight's), bit-exact with
        :func:`cupyquant.reference.dequantize_weight`."""
        return dequantize_weight(self, dtype, out=out)

    def to_host(self) -> dict:
        """NumPy copies: ``data`` (packed), ``codes`` (INT4 unpacked, one per byte, or FP8 as
        ``ml_dtypes.float8_e4m3fn``), ``scales``, ``zeros`` (unpacked codes, or None)."""
        data = cupy.asnumpy(self.data)
        N, K = self.shape
        ng = K // self.G
        if self.scheme == "float8_e4m3fn":
            codes = data.view(ml_dtypes.float8_e4m3fn)
        else:
            codes = _ref.unpack_fp4(data, K)
        zeros = None if self.zeros is None else _ref.unpack_fp4(cupy.asnumpy(self.zeros), ng)
        return {"data": data, "codes": codes, "scales": cupy.asnumpy(self.scales), "zeros": zeros}

    def __repr__(self) -> str:
        g = "per-channel" if self.group_size is None else f"group_size={self.group_size}"
        return (f"QuantizedWeight({self.scheme}, shape={self.shape}, {g}, scales {self.dtype.name}, "
                f"{self.nbytes} bytes)")


def quantize_weight(w, dtype="int4", *, group_size=128, symmetric=True) -> QuantizedWeight:
    """Quantize a weight ``w`` ``(N, K)`` (PyTorch Linear's ``[out, in]``) along K in groups.

    Parameters
    ----------
    w : cupy.ndarray
        float32, float16 or bfloat16, 2-D, C-contiguous.
    dtype : {"int4", "uint4", "float8_e4m3fn"}
        ``"int4"`` with ``symmetric=True``: GPTQ/Marlin uint4b8, ``s = amax / 7``,
        ``q = clamp(rne(w / s), -8, 7) + 8``. ``"uint4"`` (or ``"int4"`` with ``symmetric=False``):
        AWQ-style asymmetric with integer zero points, ``s = max(max - min, 1e-5) / 15``,
        ``z = clamp(rne(-min / s), 0, 15)``, ``q = clamp(rne(w / s) + z, 0, 15)``.
        ``"float8_e4m3fn"``: W8A16, ``s = amax / 448``, ``q = e4m3(w / s)`` saturating.
        Scales are rounded to w's dtype before the division, so that dequantization inverts exactly
        what was stored.
    group_size : {32, 64, 128, None}
        Elements of K per scale; ``None``: one scale per output channel. Must divide K.
    symmetric : bool
        ``False`` selects zero points (INT4 only).

    Returns
    -------
    QuantizedWeight
    """
    scheme = _ref.weight_scheme(dtype, symmetric)
    t = _validate.float_input(w, "w")
    if w.ndim != 2:
        raise ValueError(f"w must be 2-D (N, K), got shape {w.shape}")
    _validate.c_contiguous(w, "w")
    N, K = w.shape
    if group_size not in _ref.WEIGHT_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {_ref.WEIGHT_GROUP_SIZES}, got {group_size!r}")
    G = K if group_size is None else group_size
    if K == 0 or K % G or K % 2:
        raise ValueError(f"group_size={group_size} must divide K = {K}, and K must be even and nonzero")
    ng = K // G
    with _validate.on_device_of(w):
        data = cupy.empty((N, K if scheme == "float8_e4m3fn" else K // 2), dtype=np.uint8)
        scales = cupy.empty((N, ng), dtype=w.dtype)
        zcodes = cupy.empty((N, ng), dtype=np.uint8) if scheme == "uint4" else None
        if N:
            a = np.zeros((), dtype=_WQ_ARGS)
            a["N"], a["K"], a["ng"], a["G"] = N, K, ng, G
            k = _jit.kernel(w.data.device_id, _FAMILY, "weight_quantize", t.ctype, _SCHEME_IDS[scheme])
            warps = N * ng
            k((-(-warps // 8),), (256,), (w, data, scales, zcodes if zcodes is not None else 0, a[()]))
        zeros = None
        if zcodes is not None:
            if ng % 2:
                zcodes = cupy.concatenate([zcodes, cupy.zeros((N, 1), np.uint8)], axis=1)
            zeros = (zcodes[:, 0::2] | (zcodes[:, 1::2] << 4)).astype(np.uint8)
    return QuantizedWeight(data, scales, zeros, scheme, group_size, (N, K), w.dtype)


def _check_weight(w) -> None:
    if not isinstance(w, QuantizedWeight):
        raise TypeError(f"w must be a QuantizedWeight (from cupyquant.quantize_weight), got {type(w).__name__}")
    _validate.c_contiguous(w.data, "w.data")
    _validate.c_contiguous(w.scales, "w.scales")
    N, K = w.shape
    if w.data.shape != ((N, K) if w.scheme == "float8_e4m3fn" else (N, K // 2)) or w.data.dtype != np.uint8:
        raise ValueError(f"w.data must be uint8 of shape matching w.shape {w.shape}, got {w.data.dtype} {w.data.shape}")
    if w.scales.shape != (N, K // w.G):
        raise ValueError(f"w.scales must have shape {(N, K // w.G)}, got {w.scales.shape}")


def dequantize_weight(w: QuantizedWeight, dtype=None, *, out=None) -> cupy.ndarray:
    """``(N, K)`` weights in ``dtype`` (default the original's): ``round(float(q - z) * s)``
    (``z = 8`` for int4) or ``round(fp8(q) * s)``, the product in float32 (exact)."""
    _check_weight(w)
    out_t = _dtypes.input_type(w.dtype if dtype is None else dtype, "dtype")
    device = w.data.data.device_id
    N, K = w.shape
    if out is not None:
        _validate.out_array(out, "out", (N, K), out_t.dtype, device, inputs=(("w.data", w.data), ("w.scales", w.scales)))
    with _validate.on_device_of(w.data):
        y = cupy.empty((N, K), dtype=out_t.dtype) if out is None else out
        if N and K:
            a = np.zeros((), dtype=_WQ_ARGS)
            a["N"], a["K"], a["ng"], a["G"] = N, K, K // w.G, w.G
            st = _dtypes.input_type(w.scales.dtype, "w.scales")
            k = _jit.kernel(device, _FAMILY, "weight_dequantize", st.ctype, out_t.ctype, _SCHEME_IDS[w.scheme])
            grid = (-(-(K // 2) // 256), min(N, _MAX_GRID_Y))
            zeros = w.zeros if w.zeros is not None else 0
            k(grid, (256,), (w.data, w.scales, zeros, y, a[()]))
    return y


def matmul(a, w: QuantizedWeight, *, out=None) -> cupy.ndarray:
    """``a @ dequant(w).T`` in ``a``'s dtype, accumulated in float32, the weights dequantized in
    registers (each weight byte read once per 16 rows of ``a``).

    Parameters
    ----------
    a : cupy.ndarray
        float16 or bfloat16, shape ``(..., K)``; leading dimensions are flattened into M rows.
        Rows that are not 16-byte aligned with a unit stride along K are copied first.
    w : QuantizedWeight
        Its scales must have ``a``'s dtype (the kernel dequantizes in that dtype; quantize a
        weight of the activation dtype). K must be a multiple of 128 (INT4) or 64 (FP8).
    out : cupy.ndarray, optional
        ``(..., N)`` of ``a``'s dtype, C-contiguous.

    Notes
    -----
    This is the decode kernel (tensor-core ``mma.sync`` on one 16-row M tile per block); it is
    correct for any M and fastest for M <= 16. INT4 with ``group_size`` 128 or per-channel: the
    tensor cores multiply ``a`` by the exact integers ``q - z`` and each 128-wide chunk's float32
    partial sums are multiplied by the group's scale (``s * sum((q - z) * a)``, the weights never
    rounded to a's dtype). Group sizes 32 and 64, and FP8: the weights are dequantized to a's dtype
    first, bit-identical to ``w.dequantize(a.dtype)``. Either way each product is exact and the sums
    are float32, in an order that differs from a sequential sum.
    """
    _check_weight(w)
    t = _validate.float_input(a, "a")
    if t.name not in ("float16", "bfloat16"):
        raise TypeError(f"a must be float16 or bfloat16 (the tensor-core input types), got {a.dtype}")
    N, K = w.shape
    if a.ndim == 0 or a.shape[-1] != K:
        raise ValueError(f"a.shape[-1] must equal w's K = {K}, got a.shape {a.shape}")
    if w.scales.dtype != a.dtype:
        raise ValueError(
            f"w's scales are {w.scales.dtype} but a is {a.dtype}: the kernel dequantizes in a's dtype, "
            f"so quantize a weight of dtype {a.dtype} (or pass a as {w.scales.dtype})"
        )
    chunk = _CHUNK[w.scheme]
    if K % chunk:
        raise ValueError(f"w's K = {K} must be a multiple of {chunk} for {w.scheme} weights (the kernel's K step)")
    device = w.data.data.device_id
    _validate.same_device(a, "a", device, "w")
    lead = a.shape[:-1]
    M = math.prod(lead)
    if out is not None:
        _validate.out_array(out, "out", lead + (N,), a.dtype, device, inputs=(("a", a), ("w.data", w.data)))
    with _validate.on_device_of(w.data):
        a2 = a.reshape(M, K) if M else a.reshape(0, K)
        if M and (a2.strides[1] != a2.itemsize or a2.strides[0] % 16 or a2.data.ptr % 16 or a2.strides[0] < 0):
            a2 = cupy.ascontiguousarray(a2)
        y = cupy.empty(lead + (N,), dtype=a.dtype) if out is None else out
        if M and N:
            args = np.zeros((), dtype=_MM_ARGS)
            args["N"], args["K"], args["lda"] = N, K, a2.strides[0] // a2.itemsize
            args["ng"], args["G"] = K // w.G, w.G
            zeros = w.zeros if w.zeros is not None else 0
            y2 = y.reshape(M, N)
            # INT4 with whole-chunk groups: scales applied to each chunk's float32 partial sums
            post = w.scheme != "float8_e4m3fn" and w.G % 128 == 0
            rows_per_launch = _MM_M * _MAX_GRID_Y
            for m0 in range(0, M, rows_per_launch):
                mrows = min(rows_per_launch, M - m0)
                args["M"] = mrows
                k = _jit.kernel(device, _FAMILY, "w4a16_matmul", t.ctype, _SCHEME_IDS[w.scheme], mrows > 8, post)
                grid = (-(-N // _MM_N), -(-mrows // _MM_M))
                k(grid, (256,), (a2[m0:], w.data, w.scales, zeros, y2[m0:], args[()]))
    return y
