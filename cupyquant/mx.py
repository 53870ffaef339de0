"""Microscaling formats MXFP8 and MXFP4 (OCP MX v1.0: blocks of 32 with E8M0 scales), with their
dequantization.

Kernels: ``kernels/mx.cu`` (on ``kernels/block_scale.cuh``). Reference:
:func:`cupyquant.reference.quantize_mx`, :func:`cupyquant.reference.dequantize_mx`.

Data. FP8 elements are one byte each, in ``x.shape``. FP4 (E2M1) elements are packed two per byte
along the last axis, element ``2i`` in the low nibble of byte ``i``: ``x.shape[:-1] + (ceil(K/2),)``
uint8, an odd K leaving the last high nibble zero.

Scale layouts (``scale_layout``), for ``Kb = ceil(K / block)`` scales per row, the leading axes of
``x`` flattened into ``rows`` (the same for NVFP4, :mod:`cupyquant.nvfp4`):

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

import cupy
import numpy as np

from . import _block_scale, _checks, _device, _dtypes, _flat, _jit, _scales, _validate
from ._scales import block_scale_shape as block_scale_shape  # public, re-exported by cupyquant
from .quantized import QuantizedTensor, Scheme, register_dequantizer

_BOOLS = (False, True)
_FP8_TAGS = tuple(_dtypes.element_format(n).ctag for n in _dtypes.FP8_NAMES)
_FLAT_PIECES = tuple(sorted(set(_flat.PIECES.values())))
_MX_TAGS = tuple(_dtypes.element_format(n).ctag for n in _dtypes.MX_NAMES)
# The FP4 and UE8M0 conversions exist as instructions only on the Blackwell family-specific targets.
FAMILY = _jit.register(
    "mx",
    _jit.product("mx_quantize", _dtypes.INPUT_CTYPES, _MX_TAGS, _BOOLS, _BOOLS)
    + _jit.product("mx_quantize_small", _dtypes.INPUT_CTYPES, _MX_TAGS, _BOOLS, _BOOLS)
    + _jit.product("mx_quantize_wide", _dtypes.INPUT_CTYPES, _MX_TAGS, _BOOLS, _BOOLS)
    + _jit.product("mx_dequantize", _dtypes.INPUT_CTYPES, _MX_TAGS, _BOOLS)
    + _jit.product("mx_dequantize_flat", _dtypes.INPUT_CTYPES, _FP8_TAGS, _FLAT_PIECES, _BOOLS),
    specific_targets=_device.FP4_CVT_TARGETS,
)
_MX_BLOCK = _scales.MX_BLOCK
_SCHEMES = {
    (f, layout): Scheme(f, "block", (_MX_BLOCK,), "float8_e8m0fnu", layout, FAMILY)
    for f in _dtypes.MX_NAMES
    for layout in _scales.BLOCK_LAYOUTS
}


def scheme(fmt_name: str, scale_layout: str) -> Scheme:
    """The Scheme of MX quantization to ``fmt_name`` with scales in ``scale_layout``."""
    return _SCHEMES[fmt_name, scale_layout]


def quantize_mx(
    x: cupy.ndarray,
    dtype: str | type | np.dtype = "float8_e4m3fn",
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
        ``data`` the element bytes, ``scale`` the E8M0 bytes of the *decode* scales
        (``x ~ q * 2^(scale - 127)``).

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
    plan = _block_scale.plan_quantize(
        FAMILY, "mx_quantize", (fmt.ctag,), x, fmt, _MX_BLOCK, scale_layout, out, scale_out, int(rounding == "floor")
    )
    with _validate.on_device_of(x):
        q = cupy.empty(plan.q_shape, dtype=np.uint8) if out is None else out
        s = cupy.empty(plan.s_shape, dtype=np.uint8) if scale_out is None else scale_out
        if plan.launch is not None:
            plan.launch(x, q, s)
    return QuantizedTensor(q, s, _SCHEMES[fmt.name, scale_layout], x.shape, x.dtype)


def _dequantize(q: QuantizedTensor, out_t: _dtypes.InputType, out) -> cupy.ndarray:
    flat = "mx_dequantize_flat" if q.format.bits == 8 else None
    return _block_scale.dequantize(FAMILY, "mx_dequantize", (out_t.ctype, q.format.ctag), q, out_t, out, flat=flat)


register_dequantizer(FAMILY, _dequantize)
