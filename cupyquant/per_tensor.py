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
from ._launch import ARG, Launch
from ._sizes import VECTOR_BYTES, ceil_div
from .quantized import QuantizedTensor, Scheme, register_dequantizer

_AMAX, _DEVICE = _validate.ScaleSource.AMAX, _validate.ScaleSource.DEVICE
_FP8_TAGS = tuple(_dtypes.element_format(n).ctag for n in _dtypes.FP8_NAMES)
_BOOLS = (False, True)
FAMILY = _jit.register(
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
AMAX_BLOCK = 512  # must equal AMAX_BLOCK in per_tensor.cu
AMAX_BLOCKS_PER_SM = 4  # 4 x 512 threads fill an H100 SM (2048 threads) in one wave
_SCHEMES = {f: Scheme(f, "tensor", None, "float32", "scalar", FAMILY) for f in _FP8 + ("int8",)}
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def scheme(fmt_name: str) -> Scheme:
    """The Scheme of a per-tensor quantization to ``fmt_name`` (an FP8 format or ``"int8"``)."""
    return _SCHEMES[fmt_name]


def _flat_grid(n: int, vec: bool, device: int, per_thread: int) -> int:
    """Blocks for a flat vector launch where each thread takes ``per_thread`` elements and one more
    thread the tail, or for the scalar grid-stride loop."""
    if vec:
        return max(1, ceil_div(n // per_thread + 1, _BLOCK))
    return max(1, min(ceil_div(n, _BLOCK), _device.sm_count(device) * _SCALAR_BLOCKS_PER_SM))


class AmaxLaunch:
    """The device-side amax of a C-contiguous tensor, planned: a 4-byte memset of the output, then
    ``fp8_amax`` (which combines blocks with an unsigned atomicMax on the float's bits). Called with
    the tensor and the float32 (1,) output. Used by :func:`amax`, dynamic :func:`quantize_fp8` and
    dynamic NVFP4."""

    __slots__ = ("launch",)

    def __init__(self, x, in_t: _dtypes.InputType):
        n = x.size
        self.launch = None
        if n:
            device = x.data.device_id
            vec = x.data.ptr % VECTOR_BYTES == 0
            per_block = AMAX_BLOCK * (16 // x.itemsize if vec else 1)
            grid = max(1, min(ceil_div(n, per_block), _device.sm_count(device) * AMAX_BLOCKS_PER_SM))
            k = _jit.kernel(device, FAMILY, "fp8_amax", in_t.ctype, vec)
            self.launch = Launch(k, (grid,), (AMAX_BLOCK,), (ARG, np.int64(n), ARG), pdl=_device.caps(device).pdl)

    def __call__(self, x, amax_out) -> None:
        _launch.memset(amax_out.data.ptr, 0, 4)
        if self.launch is not None:
            self.launch(x, amax_out)


_AMAX_PLANS = _plans.Plans()


def _amax_plan(x, arg: str = "x") -> AmaxLaunch:
    key = _validate.array_key(x)
    plan = _AMAX_PLANS.lookup(key)
    if plan is None:
        in_t = _validate.float_input(x, arg)
        _validate.c_contiguous(x, arg)
        plan = _AMAX_PLANS.keep(key, AmaxLaunch(x, in_t))
    return plan


def amax_into(x, amax_out) -> None:
    """Reduce max |x| of a float CuPy array into ``amax_out`` (float32 (1,)) on the current stream,
    on the current device (x's); raises TypeError or ValueError naming ``x`` unless it is a
    C-contiguous float32, float16 or bfloat16 CuPy array."""
    _amax_plan(x)(x, amax_out)


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
    plan = _amax_plan(x)
    with _validate.on_device_of(x):
        out = cupy.empty((1,), dtype=np.float32)
        plan(x, out)
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
    key = (_validate.array_key(x), dtype, _validate.scale_key(scale), _validate.array_key(out))
    plan = _PLANS.lookup(key)
    if plan is None:
        plan = _PLANS.keep(key, _Fp8Plan(x, dtype, scale, out))
    if out is not None:
        plan.disjoint.check((x.data.ptr, out.data.ptr))
    with _validate.on_device_of(x):
        q = cupy.empty(x.shape, dtype=np.uint8) if out is None else out
        scale_inv = cupy.empty((1,), dtype=np.float32)
        amax_f = None
        if plan.mode == _AMAX:
            amax_f = src = cupy.empty((1,), dtype=np.float32)
            plan.amax(x, amax_f)
        elif plan.mode == _DEVICE:
            src = scale
        else:
            src = scale_inv  # unused by the kernel in this mode; any valid pointer
        plan.launch(x, q, src, scale_inv)
    return QuantizedTensor(q, scale_inv, plan.scheme, x.shape, x.dtype, amax=amax_f)


#: quantize_fp8 plans, per argument signature
_PLANS = _plans.Plans()


class _Fp8Plan:
    """A checked quantize_fp8 call: its scale mode, the amax plan (dynamic), the cast's launch (its
    arguments x, q, the scale source and scale_inv), the scheme, and the overlap check of ``out``."""

    def __init__(self, x, dtype, scale, out):
        fmt = _dtypes.element_format(dtype, "dtype", allowed=_FP8)
        in_t = _validate.float_input(x, "x")
        _validate.c_contiguous(x, "x")
        self.device = device = x.data.device_id
        self.mode, _, value = _validate.scale_arg(scale, "scale", device)
        if out is not None:
            _validate.out_array(out, "out", x.shape, np.uint8, device, inputs=(("x", x),))
        self.disjoint = _validate.Disjoint((("x", x), ("out", out)), 1)
        self.amax = _amax_plan(x) if self.mode == _AMAX else None
        vec = x.data.ptr % VECTOR_BYTES == 0 and (out is None or out.data.ptr % VECTOR_BYTES == 0)
        k = _jit.kernel(device, FAMILY, "fp8_quantize", in_t.ctype, fmt.ctag, self.mode, vec)
        grid = (_flat_grid(x.size, vec, device, 16),)
        args = (ARG, ARG, np.int64(x.size), ARG, value, ARG)
        self.launch = Launch(k, grid, (_BLOCK,), args, pdl=_device.caps(device).pdl)
        self.scheme = _SCHEMES[fmt.name]


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


#: quantize_int8 plans, per argument signature
_INT8_PLANS = _plans.Plans()


class _Int8Plan:
    """A checked quantize_int8 call: its launch (arguments x, q, the device scale or null, the
    device zero point or null, the two outputs), the overlap check of ``out``, the zero point's
    presence."""

    def __init__(self, x, scale, zero_point, out):
        in_t = _validate.float_input(x, "x")
        _validate.c_contiguous(x, "x")
        device = x.data.device_id
        mode, scale_dev, scale_value = _validate.scale_arg(scale, "scale", device)
        if mode == _AMAX:
            raise TypeError("scale must be a positive finite float or a float32 cupy.ndarray of one element, got None")
        zp_dev, zp_value = _zero_point_arg(zero_point, device)
        if out is not None:
            _validate.out_array(out, "out", x.shape, np.int8, device, inputs=(("x", x),))
        self.disjoint = _validate.Disjoint((("x", x), ("scale", scale_dev), ("zero_point", zp_dev), ("out", out)), 3)
        self.azp = zero_point is not None
        vec = x.data.ptr % VECTOR_BYTES == 0 and (out is None or out.data.ptr % VECTOR_BYTES == 0)
        k = _jit.kernel(device, FAMILY, "int8_quantize", in_t.ctype, self.azp, vec)
        grid = (_flat_grid(x.size, vec, device, 16),)
        args = (ARG, ARG, np.int64(x.size), ARG, scale_value, ARG, np.int32(zp_value), ARG, ARG)
        self.launch = Launch(k, grid, (_BLOCK,), args, pdl=_device.caps(device).pdl)


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
    key = (_validate.array_key(x), _validate.scale_key(scale), _validate.scale_key(zero_point))
    key += (_validate.array_key(out),)
    plan = _INT8_PLANS.lookup(key)
    if plan is None:
        plan = _INT8_PLANS.keep(key, _Int8Plan(x, scale, zero_point, out))
    scale_dev = scale if type(scale) is cupy.ndarray else None
    zp_dev = zero_point if type(zero_point) is cupy.ndarray else None
    if out is not None:
        plan.disjoint.check((x.data.ptr, _ptr(scale_dev), _ptr(zp_dev), out.data.ptr))
    with _validate.on_device_of(x):
        q = cupy.empty(x.shape, dtype=np.int8) if out is None else out
        s_out = cupy.empty((1,), dtype=np.float32)
        z_out = cupy.empty((1,), dtype=np.int32) if plan.azp else None
        plan.launch(x, q, scale_dev, zp_dev, s_out, z_out)
    return QuantizedTensor(q, s_out, _SCHEMES["int8"], x.shape, x.dtype, zero_point=z_out)


def _ptr(a) -> int:
    return 0 if a is None else a.data.ptr


_DEQUANT_PLANS = _plans.Plans()


def _dequant_plan(q: QuantizedTensor, out_t: _dtypes.InputType, out) -> tuple:
    """(launch, overlap check) of the dequantization of ``q`` (checked by cupyquant.dequantize)."""
    fmt = q.format
    device = q.data.data.device_id
    if out is not None:
        _validate.out_array(out, "out", q.shape, out_t.dtype, device, inputs=(("q.data", q.data),))
    disjoint = _validate.Disjoint((("q.data", q.data), ("out", out)), 1)
    n = q.data.size
    vec = q.data.data.ptr % VECTOR_BYTES == 0 and (out is None or out.data.ptr % VECTOR_BYTES == 0)
    # two units of 16 // itemsize elements per thread (see fp8_dequantize)
    grid = (_flat_grid(n, vec, device, 2 * (16 // out_t.dtype.itemsize)),)
    pdl = _device.caps(device).pdl
    if fmt.name == "int8":
        azp = q.zero_point is not None
        k = _jit.kernel(device, FAMILY, "int8_dequantize", out_t.ctype, azp, vec)
        launch = Launch(k, grid, (_BLOCK,), (ARG, ARG, np.int64(n), ARG, ARG), pdl=pdl)
    else:
        k = _jit.kernel(device, FAMILY, "fp8_dequantize", out_t.ctype, fmt.ctag, vec)
        launch = Launch(k, grid, (_BLOCK,), (ARG, ARG, np.int64(n), ARG), pdl=pdl)
    return launch, disjoint


def _dequantize(q: QuantizedTensor, out_t: _dtypes.InputType, out) -> cupy.ndarray:
    data = q.data
    key = (q.scheme, q.shape, _validate.array_key(data), q.zero_point is not None, out_t, _validate.array_key(out))
    plan = _DEQUANT_PLANS.lookup(key)
    if plan is None:
        plan = _DEQUANT_PLANS.keep(key, _dequant_plan(q, out_t, out))
    launch, disjoint = plan
    if out is not None:
        disjoint.check((data.data.ptr, out.data.ptr))
    with _validate.on_device_of(data):
        y = cupy.empty(q.shape, dtype=out_t.dtype) if out is None else out
        if q.zero_point is not None:
            launch(data, y, q.scale, q.zero_point)
        elif q.scheme.format == "int8":
            launch(data, y, q.scale, q.scale)
        else:
            launch(data, y, q.scale)
    return y


register_dequantizer(FAMILY, _dequantize)
