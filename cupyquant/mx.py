"""Microscaling formats: MXFP8 and MXFP4 (OCP MX v1.0, blocks of 32 with E8M0 scales) and NVFP4
(blocks of 16 E2M1 values with E4M3 scales and a float32 global scale), with their dequantization.

Kernels: ``kernels/mx.cu``. Reference: :func:`cupyquant.reference.quantize_mx`,
:func:`cupyquant.reference.quantize_nvfp4` and the dequantizers beside them.

Data. FP8 elements are one byte each, in ``x.shape``. FP4 (E2M1) elements are packed two per byte
along the last axis, element ``2i`` in the low nibble of byte ``i``: ``x.shape[:-1] + (ceil(K/2),)``
uint8, an odd K leaving the last high nibble zero.

Scale layouts (``scale_layout``), for ``Kb = ceil(K / block)`` scales per row, the leading axes of
``x`` flattened into ``rows``:

- ``"dense"``: uint8 ``x.shape[:-1] + (Kb,)``, row-major.
- ``"swizzled"``: the 128x4 layout that cuBLAS and Blackwell block-scaled tensor cores read, written
  in place by the quantizer: uint8 ``(round_up(rows, 128), round_up(Kb, 4))``, whose bytes are in
  layout order: the scale of row m, block k is byte ``((m // 128) * ceil(Kb / 4) + k // 4) * 512 +
  (m % 32) * 16 + ((m // 32) % 4) * 4 + k % 4`` of the buffer; the padding rows and columns are 0.
  (A 3-D tensor is one matrix of ``rows`` rows, as FlashInfer and TransformerEngine flatten it.)

:func:`block_scale_shape` gives either shape for ``scale_out=``. Conversions use the GPU's
instructions where it has them (FP8 on sm_89+, FP4 and UE8M0 on the Blackwell family-specific
targets) and exact software paths elsewhere, with the same bytes; setting the environment variable
``CUPYQUANT_SOFTWARE_CONVERSIONS=1`` (read at import) forces the software paths.
"""

from __future__ import annotations

import math
import os

import cupy
import numpy as np

from . import _checks, _dtypes, _jit, _validate
from .per_tensor import _launch_amax
from .groupwise import _grid2d, _rows_view
from .quantized import QuantizedTensor, Scheme, register_dequantizer

_BOOLS = (False, True)
_MX_TAGS = tuple(_dtypes.element_format(n).ctag for n in _dtypes.MX_NAMES)
# The FP4 and UE8M0 conversions exist as instructions only on the Blackwell family-specific targets.
_FAMILY = _jit.register(
    "mx",
    _jit.product("mx_quantize", _dtypes.INPUT_CTYPES, _MX_TAGS, _BOOLS, _BOOLS)
    + _jit.product("nvfp4_quantize", _dtypes.INPUT_CTYPES, _BOOLS, _BOOLS)
    + _jit.product("mx_dequantize", _dtypes.INPUT_CTYPES, _MX_TAGS, _BOOLS)
    + _jit.product("nvfp4_dequantize", _dtypes.INPUT_CTYPES, _BOOLS)
    + _jit.product("cvt_check", _MX_TAGS, _BOOLS)
    + _jit.product("e8m0_check", _BOOLS),
    specific_targets=("100", "101", "103", "110", "120", "121"),
)
_THREADS = 256  # THREADS in mx.cu
_TILE_K = 256  # TILE_K in mx.cu: elements per tile row (tiles are 128 rows high)
_MX_BLOCK = 32
_NV_BLOCK = 16
_LAYOUTS = ("dense", "swizzled")
_GS_FROM_AMAX, _GS_FROM_DEVICE, _GS_FROM_ARG = 0, 1, 2  # GS_FROM_* in mx.cu

#: Force the software conversions (tests set this to check them against the hardware ones).
_FORCE_SOFTWARE = os.environ.get("CUPYQUANT_SOFTWARE_CONVERSIONS", "") not in ("", "0")

_QUANT_ARGS = np.dtype(
    [
        ("rows", np.int64), ("K", np.int64), ("row_stride", np.int64), ("q_row", np.int64),
        ("n_blocks", np.int64), ("n_units", np.int64), ("n_ktiles", np.int64), ("swizzled", np.int32), ("floor_rule", np.int32),
        ("gs_mode", np.int32), ("gs_arg", np.float32), ("gs_ptr", np.uint64), ("gs_out", np.uint64),
    ],
    align=True,
)
_DEQUANT_ARGS = np.dtype(
    [
        ("rows", np.int64), ("K", np.int64), ("q_row", np.int64), ("n_blocks", np.int64),
        ("swizzled", np.int32), ("gs_ptr", np.uint64),
    ],
    align=True,
)


def block_scale_shape(shape, block_size: int = 32, scale_layout: str = "dense") -> tuple:
    """The shape of the uint8 scale array that :func:`quantize_mx` (``block_size=32``) or
    :func:`quantize_nvfp4` (``block_size=16``) writes for a tensor of ``shape``: ``shape[:-1] +
    (ceil(K / block_size),)`` dense, ``(round_up(rows, 128), round_up(ceil(K / block_size), 4))``
    swizzled, with ``rows`` the product of ``shape[:-1]``.

    Raises
    ------
    TypeError
        ``shape`` is not a tuple of integers.
    ValueError
        An empty ``shape`` or a negative dimension; ``block_size`` not 32 or 16; an unsupported
        ``scale_layout``.
    """
    shape = _validate.shape_tuple(shape)
    if not shape:
        raise ValueError("shape must have at least one dimension")
    if block_size not in (_MX_BLOCK, _NV_BLOCK):
        raise ValueError(f"block_size={block_size!r} is not supported; expected 32 (MX) or 16 (NVFP4)")
    if scale_layout not in _LAYOUTS:
        raise ValueError(f"scale_layout={scale_layout!r} is not supported; expected one of {_LAYOUTS}")
    kb = -(-shape[-1] // block_size)
    if scale_layout == "dense":
        return shape[:-1] + (kb,)
    rows = math.prod(shape[:-1])
    return (-(-rows // 128) * 128, -(-kb // 4) * 4)


def _data_shape(shape, bits: int) -> tuple:
    return tuple(shape) if bits == 8 else tuple(shape[:-1]) + (-(-shape[-1] // 2),)


def _check_scale_out(scale_out, shape, device, inputs=()):
    _validate.cupy_array(scale_out, "scale_out")
    if tuple(scale_out.shape) != tuple(shape):
        raise ValueError(f"scale_out must be uint8 of shape {tuple(shape)}, got {scale_out.dtype} {scale_out.shape}")
    if scale_out.dtype != np.uint8:
        raise TypeError(f"scale_out must have dtype uint8, got {scale_out.dtype}")
    _validate.c_contiguous(scale_out, "scale_out")
    if scale_out.data.ptr % 16:
        raise ValueError("scale_out must start 16-byte aligned")
    _validate.same_device(scale_out, "scale_out", device, "x")
    _validate.disjoint(scale_out, "scale_out", inputs)


def _prepare(x, fmt, block, scale_layout, out, scale_out):
    in_t = _validate.float_input(x, "x")
    if scale_layout not in _LAYOUTS:
        raise ValueError(f"scale_layout={scale_layout!r} is not supported; expected one of {_LAYOUTS}")
    rows, K, row_stride = _rows_view(x, "x")
    device = x.data.device_id
    q_shape = _data_shape(x.shape, fmt.bits)
    s_shape = block_scale_shape(x.shape, block, scale_layout)
    if out is not None:
        _validate.out_array(out, "out", q_shape, np.uint8, device, inputs=(("x", x),))
    if scale_out is not None:
        _check_scale_out(scale_out, s_shape, device, inputs=(("out", out), ("x", x)))
    return in_t, rows, K, row_stride, device, q_shape, s_shape


def _launch_quantize(name, targs, x, q, s, rows, K, row_stride, block, fmt, scale_layout, device, **kw):
    n_blocks = -(-K // block)
    n_ktiles = -(-K // _TILE_K)
    a = np.zeros((), dtype=_QUANT_ARGS)
    a["rows"], a["K"], a["row_stride"] = rows, K, row_stride
    a["q_row"] = K if fmt.bits == 8 else -(-K // 2)
    a["n_blocks"], a["n_units"], a["n_ktiles"] = n_blocks, -(-n_blocks // 4), n_ktiles
    a["swizzled"] = scale_layout == "swizzled"
    a["floor_rule"] = kw.get("floor_rule", 0)
    a["gs_mode"], a["gs_arg"], a["gs_ptr"], a["gs_out"] = kw.get("gs", (0, np.float32(0), 0, 0))
    vec = (
        K % 16 == 0
        and x.data.ptr % 16 == 0
        and (row_stride * x.itemsize) % 16 == 0
        and q.data.ptr % (16 if fmt.bits == 8 else 8) == 0
    )
    k = _jit.kernel(device, _FAMILY, name, *targs, vec, not _FORCE_SOFTWARE)
    k((-(-rows // 128) * n_ktiles,), (_THREADS,), (x, q, s, a[()]))


def quantize_mx(
    x: cupy.ndarray,
    dtype="float8_e4m3fn",
    *,
    scale_layout: str = "dense",
    rounding: str = "ceil",
    out: cupy.ndarray | None = None,
    scale_out: cupy.ndarray | None = None,
) -> QuantizedTensor:
    """MXFP8 or MXFP4 quantization along the last axis: blocks of 32, one E8M0 scale each.

    Parameters
    ----------
    x : cupy.ndarray
        float32, float16 or bfloat16, any leading dimensions, contiguous last axis (leading axes
        may be strided if they collapse into one row stride). Any K: a last block that 32 does not
        fill is treated as zero-padded.
    dtype : {"float8_e4m3fn", "float8_e5m2", "float4_e2m1fn"}
        MXFP8 (either element type) or MXFP4.
    scale_layout : {"dense", "swizzled"}
        See the module docstring; "swizzled" is written in place, with no packing pass.
    rounding : {"ceil", "floor"}
        "ceil" (cuBLAS, TransformerEngine): ``E = ceil(log2(amax / elem_max))`` by the exponent-bit
        rule, so no element saturates; "floor": the OCP MX v1.0 rule ``E = floor(log2(amax)) -
        emax_elem``, elements above elem_max saturating.
    out : cupy.ndarray, optional
        uint8 buffer of ``x.shape`` (FP8) or ``x.shape[:-1] + (ceil(K/2),)`` (FP4).
    scale_out : cupy.ndarray, optional
        uint8 buffer of :func:`block_scale_shape` ``(x.shape, 32, scale_layout)``, 16-byte aligned.

    Returns
    -------
    QuantizedTensor
        ``data`` the element bytes, ``scale`` the E8M0 bytes (``x ~ q * 2^(scale - 127)``).

    Raises
    ------
    TypeError
        ``x`` is not a CuPy array of a supported dtype; ``out``/``scale_out`` has the wrong dtype.
    ValueError
        Unsupported ``dtype``, ``scale_layout`` or ``rounding``; a last axis that is not
        contiguous; ``out``/``scale_out`` of the wrong shape or device, misaligned, or overlapping
        ``x`` or each other.

    Notes
    -----
    Per block: ``amax = max|x|`` (a NaN anywhere in the block makes it NaN); ``E`` =
    ``e8m0_ceil(amax * float32(1 / elem_max))`` (ceil) or ``max(exponent(amax) - emax_elem, 0)``
    (floor); an all-zero block gives 0, an inf 254, a NaN 255; ``q = cvt_satfinite_rn(x *
    2^(127 - E))``, exact in float32 (2^-127 is the subnormal for E = 254). One kernel launch.
    :func:`cupyquant.reference.quantize_mx` states every rule.
    """
    fmt = _dtypes.element_format(dtype, "dtype", allowed=_checks.MX_FORMATS)
    _checks.mx_rounding(rounding)
    in_t, rows, K, row_stride, device, q_shape, s_shape = _prepare(x, fmt, _MX_BLOCK, scale_layout, out, scale_out)
    with _validate.on_device_of(x):
        q = cupy.empty(q_shape, dtype=np.uint8) if out is None else out
        s = cupy.empty(s_shape, dtype=np.uint8) if scale_out is None else scale_out
        if rows and K:
            _launch_quantize("mx_quantize", (in_t.ctype, fmt.ctag), x, q, s, rows, K, row_stride, _MX_BLOCK,
                             fmt, scale_layout, device, floor_rule=int(rounding == "floor"))
    scheme = Scheme(fmt.name, "block", (_MX_BLOCK,), "float8_e8m0fnu", scale_layout, _FAMILY)
    return QuantizedTensor(q, s, scheme, x.shape, x.dtype)


def _global_scale_source(global_scale, device):
    """(mode, value, pointer) for quantize_nvfp4's global_scale."""
    if isinstance(global_scale, cupy.ndarray):
        _checks.one_element_float32(global_scale, "global_scale")
        _validate.same_device(global_scale, "global_scale", device, "x")
        return _GS_FROM_DEVICE, np.float32(0), global_scale.data.ptr
    return _GS_FROM_ARG, _validate.positive_finite_scalar(global_scale, "global_scale"), 0


def quantize_nvfp4(
    x: cupy.ndarray,
    *,
    global_scale=None,
    scale_layout: str = "swizzled",
    out: cupy.ndarray | None = None,
    scale_out: cupy.ndarray | None = None,
) -> QuantizedTensor:
    """NVFP4 quantization: blocks of 16 E2M1 values, an E4M3 scale per block, one float32 global
    scale, TransformerEngine's exact (round-to-nearest, IEEE division) formulas.

    Parameters
    ----------
    x : cupy.ndarray
        float32, float16 or bfloat16, any leading dimensions, contiguous last axis; C-contiguous
        when ``global_scale`` is None. Any K (the last block zero-padded).
    global_scale : float or cupy.ndarray, optional
        The global *encode* scale ``S_enc`` (``2688 / amax``, as vLLM's and FlashInfer's
        ``global_scale``/``input_global_scale``): a positive float, or a float32 device array of
        one element (read on the device). None: ``amax`` is reduced on the device and ``S_enc``
        derived there, with no host synchronization.
    scale_layout : {"swizzled", "dense"}
    out, scale_out : cupy.ndarray, optional
        uint8 buffers: ``x.shape[:-1] + (ceil(K/2),)`` and :func:`block_scale_shape` ``(x.shape,
        16, scale_layout)``.

    Returns
    -------
    QuantizedTensor
        ``data`` packed E2M1, ``scale`` E4M3 bytes, ``global_scale`` float32 (1,) holding the
        ``S_enc`` used, ``amax`` float32 (1,) when it was reduced here. ``x ~ q * float(scale) /
        global_scale``.

    Raises
    ------
    TypeError, ValueError
        As :func:`quantize_mx`; also a ``global_scale`` that is not positive and finite, or not a
        one-element float32 array on ``x``'s device; a non-contiguous ``x`` without
        ``global_scale``.

    Notes
    -----
    ``S_enc = fminf(2688 / amax, FLT_MAX)`` (1 when amax is 0 or inf); per block ``sf =
    e4m3(fminf(block_amax * (S_enc * float32(1/6)), FLT_MAX))`` (NaN ignored in the amaxes);
    ``q = e2m1_rn_satfinite(x * fminf(1 / (float(sf) * (1 / S_enc)), FLT_MAX))``. Two launches
    when dynamic (amax, then quantize; plus a 4-byte memset), one otherwise.
    """
    fmt = _dtypes.element_format("float4_e2m1fn")
    in_t, rows, K, row_stride, device, q_shape, s_shape = _prepare(x, fmt, _NV_BLOCK, scale_layout, out, scale_out)
    if global_scale is None:
        _validate.c_contiguous(x, "x")
    else:
        mode, value, ptr = _global_scale_source(global_scale, device)
    with _validate.on_device_of(x):
        q = cupy.empty(q_shape, dtype=np.uint8) if out is None else out
        s = cupy.empty(s_shape, dtype=np.uint8) if scale_out is None else scale_out
        gs = cupy.empty((1,), dtype=np.float32)
        amax = None
        if global_scale is None:
            amax = cupy.empty((1,), dtype=np.float32)
            _launch_amax(x, in_t, amax, device, np.int64(x.size))
            mode, value, ptr = _GS_FROM_AMAX, np.float32(0), amax.data.ptr
        if rows and K:
            _launch_quantize("nvfp4_quantize", (in_t.ctype,), x, q, s, rows, K, row_stride, _NV_BLOCK, fmt,
                             scale_layout, device, gs=(mode, value, ptr, gs.data.ptr))
        elif mode == _GS_FROM_ARG:
            gs.fill(value)
        elif mode == _GS_FROM_DEVICE:
            gs[...] = global_scale.reshape(1)
        else:  # empty tensor: amax 0 gives S_enc 1
            gs.fill(1)
    scheme = Scheme(fmt.name, "block", (_NV_BLOCK,), "float8_e4m3fn", scale_layout, _FAMILY)
    return QuantizedTensor(q, s, scheme, x.shape, x.dtype, amax=amax, global_scale=gs)


def _dequantize(q: QuantizedTensor, out_t: _dtypes.InputType, out) -> cupy.ndarray:
    fmt = q.format
    device = q.data.data.device_id
    if out is not None:
        _validate.out_array(out, "out", q.shape, out_t.dtype, device, inputs=(("q.data", q.data),))
    shape = q.shape
    K = shape[-1] if shape else 0
    rows = math.prod(shape[:-1])
    nv = q.scheme.scale_dtype == "float8_e4m3fn"
    block = q.scheme.block[0]
    with _validate.on_device_of(q.data):
        y = cupy.empty(shape, dtype=out_t.dtype) if out is None else out
        if rows and K:
            a = np.zeros((), dtype=_DEQUANT_ARGS)
            a["rows"], a["K"] = rows, K
            a["q_row"] = K if fmt.bits == 8 else -(-K // 2)
            a["n_blocks"] = -(-K // block)
            a["swizzled"] = q.scheme.scale_layout == "swizzled"
            a["gs_ptr"] = q.global_scale.data.ptr if nv else 0
            # pieces of 8 elements: 4 (FP4) or 8 (FP8) bytes in, 8 elements out per load/store
            vec = K % 8 == 0 and q.data.data.ptr % (4 if fmt.bits == 4 else 8) == 0 and y.data.ptr % 16 == 0
            if nv:
                k = _jit.kernel(device, _FAMILY, "nvfp4_dequantize", out_t.ctype, vec)
            else:
                k = _jit.kernel(device, _FAMILY, "mx_dequantize", out_t.ctype, fmt.ctag, vec)
            # a warp takes 32 x 4 pieces of a row (mx.cu's PIECES)
            spans = -(-K // (8 * 32 * 4))
            warps = min(8, spans)
            k((rows, -(-spans // warps)), (32, warps), (q.data, q.scale, y, a[()]))
    return y


def _conversion_check(dtype, base: int, n: int, hardware: bool, patterns=None) -> cupy.ndarray:
    """Test hook: the codes of the float32 bit patterns ``base .. base + n - 1`` (or of the uint32
    device array ``patterns``) under the element conversion of ``dtype`` (``"float8_e8m0fnu"``: the
    E8M0 round-up of their magnitudes), by the hardware or the software path, as uint8."""
    if patterns is not None:
        n = patterns.size
    codes = cupy.empty((n,), dtype=np.uint8)
    device = codes.data.device_id
    if dtype == "float8_e8m0fnu":
        k = _jit.kernel(device, _FAMILY, "e8m0_check", bool(hardware))
    else:
        k = _jit.kernel(device, _FAMILY, "cvt_check", _dtypes.element_format(dtype).ctag, bool(hardware))
    k((-(-n // 256),), (256,), (patterns if patterns is not None else np.uint64(0), np.uint32(base), np.int64(n), codes))
    return codes


register_dequantizer(_FAMILY, _dequantize)
