"""NVFP4 (blocks of 16 E2M1 values with E4M3 scales and one float32 global scale), with its
dequantization.

Kernels: ``kernels/nvfp4.cu`` (on ``kernels/block_scale.cuh``; the global amax by
``kernels/per_tensor.cu``). Reference: :func:`cupyquant.reference.quantize_nvfp4`,
:func:`cupyquant.reference.dequantize_nvfp4`.

Data and scale layouts are those of :mod:`cupyquant.mx` with blocks of 16: E2M1 packed two per byte
along the last axis, and one E4M3 scale byte per block, ``"dense"`` or ``"swizzled"``
(:func:`cupyquant.block_scale_shape` with ``block_size=16`` gives the shape).
"""

from __future__ import annotations

import cupy
import numpy as np

from . import _block_scale, _device, _dtypes, _jit, _plans, _scales, _validate, per_tensor
from ._validate import ScaleSource
from .quantized import QuantizedTensor, Scheme, register_dequantizer

_BOOLS = (False, True)
FAMILY = _jit.register(
    "nvfp4",
    _jit.product("nvfp4_quantize", _dtypes.INPUT_CTYPES, _BOOLS, _BOOLS)
    + _jit.product("nvfp4_quantize_small", _dtypes.INPUT_CTYPES, _BOOLS, _BOOLS)
    + _jit.product("nvfp4_quantize_wide", _dtypes.INPUT_CTYPES, _BOOLS, _BOOLS)
    + _jit.product("nvfp4_dequantize", _dtypes.INPUT_CTYPES, _BOOLS),
    specific_targets=_device.FP4_CVT_TARGETS,
)
_NV_BLOCK = _scales.NV_BLOCK
_SCHEMES = {
    layout: Scheme("float4_e2m1fn", "block", (_NV_BLOCK,), "float8_e4m3fn", layout, FAMILY)
    for layout in _scales.BLOCK_LAYOUTS
}


def scheme(scale_layout: str) -> Scheme:
    """The Scheme of NVFP4 quantization with scales in ``scale_layout``."""
    return _SCHEMES[scale_layout]


def quantize_nvfp4(
    x: cupy.ndarray,
    *,
    global_scale: float | cupy.ndarray | None = None,
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
        The global *encode* scale ``S_enc`` (the elements are encoded from ``x * S_enc``, decoded
        as ``x ~ q * float(scale) / S_enc``; ``2688 / amax``, as vLLM's and FlashInfer's
        ``global_scale``/``input_global_scale``): a positive float, or a float32 device array of
        one element (read on the device). None: ``amax`` is reduced on the device and ``S_enc``
        derived there, with no host synchronization.
    scale_layout : {"swizzled", "dense"}
        The scales' layout: ``"swizzled"`` (default, the 128x4 layout of :mod:`cupyquant.mx`) or
        ``"dense"``.
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
    key = (_validate.array_key(x), _validate.scale_key(global_scale), scale_layout)
    key += (_validate.array_key(out), _validate.array_key(scale_out))
    plan = _PLANS.lookup(key)
    if plan is None:
        plan = _PLANS.keep(key, _Plan(x, global_scale, scale_layout, out, scale_out))
    quant = _block_scale.plan_quantize(
        FAMILY, "nvfp4_quantize", (), x, _E2M1, _NV_BLOCK, scale_layout, out, scale_out, gs=plan.gs
    )
    mode = plan.mode
    if plan.amax is None and mode == ScaleSource.AMAX:  # the amax reduction reads x as one flat array
        _validate.c_contiguous(x, "x")
    with _validate.on_device_of(x):
        q = cupy.empty(quant.q_shape, dtype=np.uint8) if out is None else out
        s = cupy.empty(quant.s_shape, dtype=np.uint8) if scale_out is None else scale_out
        gs = cupy.empty((1,), dtype=np.float32)
        amax = None
        gs_dev = global_scale if mode == ScaleSource.DEVICE else None
        if mode == ScaleSource.AMAX:
            amax = gs_dev = cupy.empty((1,), dtype=np.float32)
            plan.amax(x, amax)
        if quant.launch is not None:
            quant.launch(x, q, s, gs_dev, gs)
        elif mode == ScaleSource.ARG:
            gs.fill(plan.gs[1])
        elif mode == ScaleSource.DEVICE:
            gs[...] = gs_dev.reshape(1)
        else:  # empty tensor: amax 0 gives S_enc 1
            gs.fill(1)
    return QuantizedTensor(q, s, _SCHEMES[scale_layout], x.shape, x.dtype, amax=amax, global_scale=gs)


_E2M1 = _dtypes.element_format("float4_e2m1fn")


class _Plan:
    """The checks of a quantize_nvfp4 call that the block quantizer's plan does not make: the
    global scale's mode and value, and the amax plan when it is reduced here (x C-contiguous)."""

    __slots__ = ("mode", "gs", "amax")

    def __init__(self, x, global_scale, scale_layout, out, scale_out):
        in_t = _validate.float_input(x, "x")
        mode, _, value = _validate.scale_arg(global_scale, "global_scale", x.data.device_id)
        self.mode, self.gs = mode, (int(mode), value)
        self.amax = None
        if mode == ScaleSource.AMAX and x.flags.c_contiguous:
            self.amax = per_tensor.AmaxLaunch(x, in_t)


_PLANS = _plans.Plans()


def _dequantize(q: QuantizedTensor, out_t: _dtypes.InputType, out) -> cupy.ndarray:
    return _block_scale.dequantize(FAMILY, "nvfp4_dequantize", (out_t.ctype,), q, out_t, out, nv=True)


register_dequantizer(FAMILY, _dequantize)
