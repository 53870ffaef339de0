"""Per-tensor FP8 quantization (TransformerEngine current scaling), static scales, dequantization;
static per-tensor INT8 with or without a zero point (vLLM ``static_scaled_int8_quant``).

Kernels: ``kernels/per_tensor.cu``. Reference: :func:`cupyquant.reference.quantize_fp8`,
:func:`cupyquant.reference.quantize_int8`.
"""

from __future__ import annotations

import numbers

import cupy
import numpy as np

from . import _device, _dtypes, _jit, _launch, _plans, _validate
from .quantized import QuantizedTensor, Scheme, register_dequantizer

_AMAX, _DEVICE = _validate.ScaleSource.AMAX, _validate.ScaleSource.DEVICE
_FP8_TAGS = tuple(_dtypes.element_format(n).ctag for n in _dtypes.FP8_NAMES)
_BOOLS = (False, True)
_FAMILY = _jit.register(
    "per_tensor",
    _jit.product("fp8_amax", _dtypes.INPUT_CTYPES, _BOOLS)
    + _jit.product("fp8_quantize", _dtypes.INPUT_CTYPES, _FP8_TAGS, tuple(_validate.ScaleSource), _BOOLS)
    + _jit.product("fp8_dequantize", _dtypes.INPUT_CTYPES, _FP8_TAGS, _BOOLS)
    # static INT8: <input or output type, with a zero point, vector path>
    + _jit.product("int8_quantize", _dtypes.INPUT_CTYPES, _BOOLS, _BOOLS)
    + _jit.product("int8_dequantize", _dtypes.INPUT_CTYPES, _BOOLS, _BOOLS),
)
_FP8 = _dtypes.FP8_NAMES
_BLOCK = 256  # threads per block of the flat quantize/dequantize kernels
_SCALAR_BLOCKS_PER_SM = 8
_SCHEMES = {f: Scheme(f, "tensor", None, "float32", "scalar", _FAMILY) for f in _FP8 + ("int8",)}
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _flat_grid(n: int, vec: bool, device: int, per_thread: int) -> int:
    """Blocks for a flat vector launch where each thread takes ``per_thread`` elements and one more
    thread the tail, or for the scalar grid-stride loop."""
    if vec:
        return max(1, -(-(n // per_thread + 1) // _BLOCK))
    return max(1, min(-(-n // _BLOCK), _device.sm_count(device) * _SCALAR_BLOCKS_PER_SM))


def amax(x: cupy.ndarray) -> cupy.ndarray:
    """Max of ``|x|`` over the whole tensor, reduced on the device.

    Parameters
    ----------
    x : cupy.ndarray
        float32, float16 or bfloat16, C-contiguous, any shape.

    Returns
    -------
    cupy.ndarray
        float32 of shape (1,). NaN elements are ignored (``fmaxf``); an empty or all-NaN tensor
        gives 0. Subnormal inputs count as their value.

    Raises
    ------
    TypeError
        ``x`` is not a CuPy array of a supported dtype.
    ValueError
        ``x`` is not C-contiguous.
    """
    in_t = _validate.float_input(x, "x")
    _validate.c_contiguous(x, "x")
    with _validate.on_device_of(x):
        out = cupy.empty((1,), dtype=np.float32)
        _launch.launch_amax(x, in_t, out, x.data.device_id, np.int64(x.size))
    return out


def quantize_fp8(
    x: cupy.ndarray,
    dtype: str | type | np.dtype = "float8_e4m3fn",
    *,
    scale: float | cupy.ndarray | None = None,
    out: cupy.ndarray | None = None,
) -> QuantizedTensor:
    """Quantize a whole tensor to FP8 with one float32 scale.

    Parameters
    ----------
    x : cupy.ndarray
        float32, float16 or bfloat16, C-contiguous (any offset), any shape.
    dtype : str or ml_dtypes type
        ``"float8_e4m3fn"`` (default) or ``"float8_e5m2"``.
    scale : float or cupy.ndarray, optional
        None: dynamic scaling, amax reduced on the device. Otherwise a static *decode* scale
        (``x ~ q * scale``; the kernel multiplies by ``1 / scale``): a positive Python float, or a
        float32 CuPy array of one element (read on the device, never copied to the host).
    out : cupy.ndarray, optional
        uint8 buffer of ``x.shape`` for the FP8 bytes.

    Returns
    -------
    QuantizedTensor
        ``data`` uint8 in ``x.shape``; ``scale`` float32 (1,) holding ``scale_inv``
        (TransformerEngine's name); ``amax`` float32 (1,) when dynamic.

    Raises
    ------
    TypeError
        ``x``/``out``/``scale`` is not a CuPy array of the right dtype, or ``dtype`` names no
        dtype.
    ValueError
        ``dtype`` is not an FP8 format; ``x``/``out`` not C-contiguous; ``out`` of the wrong shape,
        on another device or overlapping ``x``; a float ``scale`` not positive and finite; a
        device ``scale`` with other than one element.

    Notes
    -----
    TransformerEngine's current scaling, every step in IEEE float32:
    ``amax = max|x|`` (NaN ignored); ``scale = fp8_max / amax``, with 1 when amax is 0, inf or
    NaN, and FLT_MAX when the quotient overflows; ``q = cvt_rn_satfinite(x * scale)`` (NaN gives
    the canonical NaN 0x7f); ``scale_inv = 1 / scale``. Static: ``scale_kernel = 1 / s`` and
    ``scale_inv = s``. Three device operations when dynamic (a 4-byte memset, the amax reduction,
    the cast, which reads amax and computes the scale itself) and one when static; no host
    synchronization, so the call can be captured in a CUDA graph.
    """
    key = None
    if out is None and type(x) is cupy.ndarray and not isinstance(scale, cupy.ndarray):
        key = (x.shape, x.strides, x.dtype, x.data.device_id, x.data.ptr & 15, dtype, scale is None)
    plan = _PLANS.lookup(key)
    if plan is None:
        plan = _PLANS.keep(key, _plan_quantize(x, dtype, scale, out))
    device = x.data.device_id
    mode, scale_dev, scale_arg = _validate.scale_arg(scale, "scale", device)
    fmt_name, in_t, k, grid = plan
    with _validate.on_device_of(x):
        n64 = np.int64(x.size)
        q = cupy.empty(x.shape, dtype=np.uint8) if out is None else out
        scale_inv = cupy.empty((1,), dtype=np.float32)
        amax_f = None
        if mode == _AMAX:
            amax_f = src = cupy.empty((1,), dtype=np.float32)
            _launch.launch_amax(x, in_t, amax_f, device, n64)
        elif mode == _DEVICE:
            src = scale_dev
        else:
            src = scale_inv  # unused by the kernel in this mode; any valid pointer
        k(grid, (_BLOCK,), (x, q, n64, src, scale_arg, scale_inv))
    return QuantizedTensor(q, scale_inv, _SCHEMES[fmt_name], x.shape, x.dtype, amax=amax_f)


#: quantize_fp8 plans without an ``out=``, per argument signature
_PLANS = _plans.Plans()


def _plan_quantize(x, dtype, scale, out) -> tuple:
    """Check the arguments of quantize_fp8 and plan its cast: (format name, input type, kernel,
    grid)."""
    fmt = _dtypes.element_format(dtype, "dtype", allowed=_FP8)
    in_t = _validate.float_input(x, "x")
    _validate.c_contiguous(x, "x")
    device = x.data.device_id
    mode = _validate.scale_arg(scale, "scale", device).mode
    if out is not None:
        _validate.out_array(out, "out", x.shape, np.uint8, device, inputs=(("x", x),))
    vec = x.data.ptr % 16 == 0 and (out is None or out.data.ptr % 16 == 0)
    k = _jit.kernel(device, _FAMILY, "fp8_quantize", in_t.ctype, fmt.ctag, mode, vec)
    return fmt.name, in_t, k, (_flat_grid(x.size, vec, device, 16),)


def _zero_point_arg(v, device: int) -> tuple:
    """(device array or None, value) of quantize_int8's ``zero_point``: None, an integer in the int32
    range, or a one-element int32 CuPy array on ``device``. Raises TypeError or ValueError naming it."""
    if v is None:
        return None, 0
    if isinstance(v, cupy.ndarray):
        msg = f"zero_point must be an int32 array of one element, got {v.dtype} {v.shape}"
        if v.dtype != np.int32:
            raise TypeError(msg)
        if v.size != 1:
            raise ValueError(msg)
        _validate.same_device(v, "zero_point", device, "x")
        return v, 0
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
        raise TypeError(f"zero_point must be an int, a cupy.ndarray or None, got {type(v).__name__}")
    if not _INT32_MIN <= int(v) <= _INT32_MAX:
        raise ValueError(f"zero_point must be in the int32 range, got {v!r}")
    return None, int(v)


#: quantize_int8 plans without an ``out=``, per argument signature
_INT8_PLANS = _plans.Plans()


def _plan_int8(x, azp: bool, out) -> tuple:
    """Check x and out of quantize_int8 and plan its launch: (kernel, grid)."""
    in_t = _validate.float_input(x, "x")
    _validate.c_contiguous(x, "x")
    device = x.data.device_id
    if out is not None:
        _validate.out_array(out, "out", x.shape, np.int8, device, inputs=(("x", x),))
    vec = x.data.ptr % 16 == 0 and (out is None or out.data.ptr % 16 == 0)
    k = _jit.kernel(device, _FAMILY, "int8_quantize", in_t.ctype, azp, vec)
    return k, (_flat_grid(x.size, vec, device, 16),)


def quantize_int8(
    x: cupy.ndarray,
    *,
    scale: float | cupy.ndarray,
    zero_point: int | cupy.ndarray | None = None,
    out: cupy.ndarray | None = None,
) -> QuantizedTensor:
    """Static per-tensor INT8, symmetric or with a zero point (vLLM ``static_scaled_int8_quant``).

    Parameters
    ----------
    x : cupy.ndarray
        float32, float16 or bfloat16, C-contiguous (any offset), any shape.
    scale : float or cupy.ndarray
        Required, by keyword: the *decode* scale ``s`` (``x ~ (q - zero_point) * s``), a positive
        finite Python float, or a float32 CuPy array of one element, read on the device as it is
        (never copied to the host).
    zero_point : int or cupy.ndarray, optional
        None: symmetric. Otherwise the zero point ``z``: a Python int in the int32 range, or an
        int32 CuPy array of one element, read on the device.
    out : cupy.ndarray, optional
        int8 buffer of ``x.shape``.

    Returns
    -------
    QuantizedTensor
        ``data`` int8 in ``x.shape``; ``scale`` float32 (1,) holding ``s``; ``zero_point`` int32
        (1,) holding ``z``, or None; scheme ``("int8", "tensor")``.

    Raises
    ------
    TypeError
        ``x``/``out`` is not a CuPy array of the right dtype; ``scale`` is not a real or a float32
        array; ``zero_point`` is not an int or an int32 array.
    ValueError
        ``x``/``out`` not C-contiguous; ``out`` of the wrong shape, on another device or overlapping
        ``x``; a float ``scale`` not positive and finite; an int ``zero_point`` outside int32; a
        device ``scale``/``zero_point`` with other than one element or on another device.

    Notes
    -----
    vLLM's arithmetic, IEEE float32 (:func:`cupyquant.reference.quantize_int8`). Without a zero
    point ``q = rne_sat_int8(x / s)`` (the division correctly rounded; NaN gives 0). With one,
    ``q = sat_int8(int32(rne(x * (1 / s))) + z)``: ``1 / s`` once, the conversion to int32
    saturating (NaN to 0), the int32 sum wrapping, then saturation to [-128, 127]. One kernel
    launch, no host synchronization.
    """
    azp = zero_point is not None
    key = None
    if out is None and type(x) is cupy.ndarray:
        key = (x.shape, x.strides, x.dtype, x.data.device_id, x.data.ptr & 15, azp)
    plan = _INT8_PLANS.lookup(key)
    if plan is None:
        plan = _INT8_PLANS.keep(key, _plan_int8(x, azp, out))
    device = x.data.device_id
    mode, scale_dev, scale_value = _validate.scale_arg(scale, "scale", device)
    if mode == _AMAX:
        raise TypeError("scale must be a positive finite float or a float32 cupy.ndarray of one element, got None")
    zp_dev, zp_value = _zero_point_arg(zero_point, device)
    if out is not None:
        _validate.disjoint(out, "out", (("scale", scale_dev), ("zero_point", zp_dev)))
    k, grid = plan
    with _validate.on_device_of(x):
        q = cupy.empty(x.shape, dtype=np.int8) if out is None else out
        s_out = cupy.empty((1,), dtype=np.float32)
        z_out = cupy.empty((1,), dtype=np.int32) if azp else None
        k(
            grid,
            (_BLOCK,),
            (
                x,
                q,
                np.int64(x.size),
                scale_dev,  # None: a null pointer, the kernel takes scale_value
                scale_value,
                zp_dev,
                np.int32(zp_value),
                s_out,
                z_out,
            ),
        )
    return QuantizedTensor(q, s_out, _SCHEMES["int8"], x.shape, x.dtype, zero_point=z_out)


def _dequantize(q: QuantizedTensor, out_t: _dtypes.InputType, out) -> cupy.ndarray:
    fmt = q.format
    device = q.data.data.device_id
    if out is not None:
        _validate.out_array(out, "out", q.shape, out_t.dtype, device, inputs=(("q.data", q.data),))
    with _validate.on_device_of(q.data):
        y = cupy.empty(q.shape, dtype=out_t.dtype) if out is None else out
        n = q.data.size
        vec = q.data.data.ptr % 16 == 0 and y.data.ptr % 16 == 0
        # two units of 16 // itemsize elements per thread (see fp8_dequantize)
        grid = (_flat_grid(n, vec, device, 2 * (16 // y.itemsize)),)
        if fmt.name == "int8":
            azp = q.zero_point is not None
            k = _jit.kernel(device, _FAMILY, "int8_dequantize", out_t.ctype, azp, vec)
            k(grid, (_BLOCK,), (q.data, y, np.int64(n), q.scale, q.zero_point if azp else q.scale))
        else:
            k = _jit.kernel(device, _FAMILY, "fp8_dequantize", out_t.ctype, fmt.ctag, vec)
            k(grid, (_BLOCK,), (q.data, y, np.int64(n), q.scale))
    return y


register_dequantizer(_FAMILY, _dequantize)
