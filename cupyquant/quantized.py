"""QuantizedTensor: quantized bytes, their scales and the scheme that made them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from . import _dtypes, _layouts
from ._sizes import ceil_div

if TYPE_CHECKING:  # the runtime import of this module must not import CuPy
    import cupy


@dataclass(frozen=True)
class Scheme:
    """How a tensor was quantized.

    Attributes
    ----------
    format : str
        Element format, as ml_dtypes names it (``"float8_e4m3fn"``).
    granularity : str
        ``"tensor"`` (one scale, :func:`quantize_fp8`), ``"token"`` or ``"group"``
        (:func:`quantize_groupwise`, :func:`silu_mul_quantize`), ``"block"`` (:func:`quantize_mx`,
        :func:`quantize_nvfp4`).
    block : tuple of int or None
        Elements per scale along the last axis: None for per-tensor, ``(K,)`` per token, the group
        size per group, ``(32,)`` for MX and ``(16,)`` for NVFP4.
    scale_dtype : str
        dtype of the stored scales: ``"float32"``, ``"float8_e8m0fnu"`` (MX, and packed UE8M0 group
        scales) or ``"float8_e4m3fn"`` (NVFP4).
    scale_layout : str
        ``"scalar"`` for per-tensor; ``"row"`` or ``"col"`` (DeepGEMM's MN-major) for token and group
        scales; ``"dense"`` or ``"swizzled"`` (the 128x4 layout) for MX and NVFP4.
    family : str
        The kernel family (module ``cupyquant.<family>``) that dequantizes it.
    """

    format: str
    granularity: str
    block: tuple | None
    scale_dtype: str
    scale_layout: str
    family: str


class QuantizedTensor:
    """Quantized data on the GPU with what is needed to dequantize it.

    Attributes
    ----------
    data : cupy.ndarray
        The element bytes in the original shape: uint8 FP8 bit patterns, or int8 codes.
    scale : cupy.ndarray
        *Decode* scale(s): ``x ~ float(q) * scale``. float32 (1,) per tensor; per group or
        token in the scheme's layout (float32, or UE8M0 bytes packed in int32).
    scheme : Scheme
    shape : tuple of int
        The original shape.
    dtype : numpy.dtype
        The original dtype (float32, float16 or bfloat16): :meth:`dequantize`'s default.
    amax : cupy.ndarray or None
        float32 (1,), the reduced max |x| of dynamic per-tensor (and NVFP4) quantization.
    global_scale : cupy.ndarray or None
        float32 (1,), NVFP4's global encode scale ``S_enc`` (``x ~ q * float(scale) / S_enc``).
    zero_point : cupy.ndarray or None
        int32 zero points of asymmetric INT8 (``x ~ (q - zero_point) * scale``): per token exactly
        the shape and strides of ``scale`` (its ``"row"`` or ``"col"`` layout, word for word), per
        tensor (1,). None for symmetric schemes; its presence is what marks a tensor asymmetric
        (the :class:`Scheme` is that of the symmetric INT8 of the same granularity).
    """

    __slots__ = ("data", "scale", "scheme", "shape", "dtype", "amax", "global_scale", "zero_point")

    def __init__(
        self,
        data: cupy.ndarray,
        scale: cupy.ndarray,
        scheme: Scheme,
        shape: tuple[int, ...],
        dtype: np.dtype | type | str,
        amax: cupy.ndarray | None = None,
        global_scale: cupy.ndarray | None = None,
        zero_point: cupy.ndarray | None = None,
    ) -> None:
        self.data = data
        self.scale = scale
        self.scheme = scheme
        self.shape = shape if type(shape) is tuple else tuple(shape)
        self.dtype = dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)
        self.amax = amax
        self.global_scale = global_scale
        self.zero_point = zero_point

    @property
    def format(self) -> _dtypes.ElementFormat:
        return _dtypes.element_format(self.scheme.format)

    @property
    def nbytes(self) -> int:
        """Bytes held on the device: ``data``, ``scale``, and ``amax``, ``global_scale`` and
        ``zero_point`` where present."""
        arrays = (self.data, self.scale, self.amax, self.global_scale, self.zero_point)
        return sum(a.nbytes for a in arrays if a is not None)

    def dequantize(
        self, out_dtype: np.dtype | type | str | None = None, *, out: cupy.ndarray | None = None
    ) -> cupy.ndarray:
        """Same as :func:`cupyquant.dequantize` (``out_dtype`` defaults to the original dtype)."""
        return dequantize(self, out_dtype, out=out)

    def to_host(self) -> dict:
        """Copy to NumPy (this synchronizes).

        ``data``: the elements viewed as their ml_dtypes type, in the original shape; FP4 unpacked
        to one ``float4_e2m1fn`` per byte, the packed bytes also given as ``data_packed``.
        ``scale``: in its logical shape ``(..., n_blocks)``: float32, or ml_dtypes
        ``float8_e8m0fnu`` / ``float8_e4m3fn``; packed UE8M0 words are unpacked (the words also
        given as ``scale_packed``) and swizzled scales unswizzled (the layout buffer also given as
        ``scale_swizzled``). ``amax`` and ``global_scale`` where present; ``zero_point`` (int32, in
        the logical shape of ``scale``) where present."""
        scale = np.ascontiguousarray(self.scale.get())
        data = self.data.get()
        fmt = self.format
        if fmt.bits == 4:
            out = {"data": _layouts.unpack_fp4(data, self.shape[-1]).view(fmt.host_dtype), "data_packed": data}
        else:
            out = {"data": data.view(fmt.host_dtype)}
        out["scale"] = scale
        if self.scheme.granularity == "block":
            kb = ceil_div(self.shape[-1], self.scheme.block[0])
            if self.scheme.scale_layout == "swizzled":
                out["scale_swizzled"] = scale
                scale = _layouts.unswizzle_scales(scale, self.shape[:-1], kb)
            out["scale"] = scale.view(_dtypes.SCALE_DTYPES[self.scheme.scale_dtype])
        elif self.scheme.scale_dtype == "float8_e8m0fnu" and scale.dtype == np.int32:
            n = 1 if self.scheme.granularity == "token" else self.shape[-1] // self.scheme.block[0]
            out["scale_packed"] = scale
            out["scale"] = scale.view(np.uint8)[..., :n].view(_dtypes.SCALE_DTYPES["float8_e8m0fnu"])
        if self.amax is not None:
            out["amax"] = self.amax.get()
        if self.global_scale is not None:
            out["global_scale"] = self.global_scale.get()
        if self.zero_point is not None:
            out["zero_point"] = np.ascontiguousarray(self.zero_point.get())
        return out

    def __repr__(self) -> str:
        s = self.scheme
        return (
            f"QuantizedTensor(shape={self.shape}, dtype={self.dtype.name}, format={s.format}, "
            f"granularity={s.granularity}, block={s.block}, scale_dtype={s.scale_dtype}, "
            f"scale_layout={s.scale_layout}{', zero_point=int32' if self.zero_point is not None else ''})"
        )


def dequantize(
    q: QuantizedTensor, out_dtype: np.dtype | type | str | None = None, *, out: cupy.ndarray | None = None
) -> cupy.ndarray:
    """Dequantize a :class:`QuantizedTensor` on the GPU.

    Parameters
    ----------
    q : QuantizedTensor or QuantizedWeight
    out_dtype : float32, float16 or bfloat16, optional
        Output dtype (name or type); defaults to ``q.dtype``, the dtype that was quantized.
    out : cupy.ndarray, optional
        Output buffer of shape ``q.shape`` and dtype ``out_dtype``.

    Returns
    -------
    cupy.ndarray

    Raises
    ------
    TypeError
        ``q`` is not a QuantizedTensor, or its arrays are not CuPy arrays, or ``out_dtype``/``out`` has
        an unsupported dtype.
    ValueError
        ``out`` has the wrong shape, is not contiguous, or is on another device.

    Notes
    -----
    Each family's formula is in its module: per tensor, ``y = round(float(q) * scale)`` with the
    product in IEEE float32, rounded to nearest even into ``out_dtype``. INT8 with zero points:
    ``y = round(float32(q - zero_point) * scale)``, ``q - zero_point`` computed exactly (64-bit
    integers) and rounded once to float32 (exact while its magnitude is at most 2^24), then the
    IEEE float32 product.
    """
    by_type = _TYPE_DEQUANTIZERS.get(type(q))
    if by_type is not None:
        return by_type(q, out_dtype, out=out)
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"q must be a cupyquant.QuantizedTensor or QuantizedWeight, got {type(q).__name__}")
    from . import _validate  # imports CuPy, which this module must not at import

    _validate.cupy_array(q.data, "q.data")
    _validate.cupy_array(q.scale, "q.scale")
    if q.global_scale is not None:
        _validate.cupy_array(q.global_scale, "q.global_scale")
    if q.zero_point is not None:
        _check_zero_point(q, _validate)
    out_type = _dtypes.input_type(q.dtype if out_dtype is None else out_dtype, "out_dtype")
    fn = _DEQUANTIZERS.get(q.scheme.family)
    if fn is None:
        from . import _all_families

        _all_families()  # imports every op module; each registers its dequantizer
        fn = _DEQUANTIZERS.get(q.scheme.family)
        if fn is None:
            raise ValueError(f"q.scheme.family={q.scheme.family!r} names no kernel family")
    return fn(q, out_type, out)


def _check_zero_point(q: QuantizedTensor, _validate) -> None:
    """A zero point goes with INT8 per token or per tensor, is int32 in the exact shape and strides of
    the scales and on their device (the kernels read it at the scale's word offsets)."""
    z = _validate.cupy_array(q.zero_point, "q.zero_point")
    if q.scheme.format != "int8" or q.scheme.granularity not in ("token", "tensor"):
        raise ValueError(
            f"q.zero_point is for int8 per token or per tensor, got {q.scheme.format} per {q.scheme.granularity}"
        )
    if z.dtype != np.int32:
        raise TypeError(f"q.zero_point must have dtype int32, got {z.dtype}")
    if z.shape != q.scale.shape or z.strides != q.scale.strides:
        raise ValueError(
            f"q.zero_point must have the shape and strides of q.scale, {q.scale.shape} {q.scale.strides}; "
            f"got {z.shape} {z.strides}"
        )
    _validate.same_device(z, "q.zero_point", q.data.data.device_id, "q.data")


#: kernel family -> its dequantizer ``fn(q, out_type, out)``, filled by the op modules at import.
_DEQUANTIZERS: dict = {}
#: container type -> ``fn(q, out_dtype, out=out)``, for containers other than QuantizedTensor.
_TYPE_DEQUANTIZERS: dict = {}


def register_dequantizer(family: str, fn: Callable) -> None:
    """Declare the function that dequantizes the QuantizedTensors of a kernel family (``q``, the
    output :class:`~cupyquant._dtypes.InputType`, ``out``): called by each op module at import."""
    _DEQUANTIZERS[family] = fn


def register_container(cls: type, fn: Callable) -> None:
    """Declare how :func:`dequantize` takes a container of another type (``fn(q, out_dtype, out=out)``)."""
    _TYPE_DEQUANTIZERS[cls] = fn
