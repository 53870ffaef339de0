"""QuantizedTensor: quantized bytes, their scales and the scheme that made them."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import numpy as np

from . import _dtypes


@dataclass(frozen=True)
class Scheme:
    """How a tensor was quantized.

    Attributes
    ----------
    format : str
        Element format, as ml_dtypes names it (``"float8_e4m3fn"``).
    granularity : str
        ``"tensor"`` (one scale), later ``"token"``, ``"group"``, ``"block"``.
    block : tuple of int or None
        Elements per scale along each blocked axis, None for per-tensor.
    scale_dtype : str
        dtype of the stored scales (``"float32"``).
    scale_layout : str
        ``"scalar"`` for per-tensor; ``"row"``, ``"col"``, ``"dense"``, ``"swizzled"`` later.
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
        Dequantization scale(s): ``x ~ float(q) * scale``. float32 (1,) per tensor; per group or
        token in the scheme's layout (float32, or UE8M0 bytes packed in int32).
    scheme : Scheme
    shape : tuple of int
        The original shape.
    dtype : numpy.dtype
        The original dtype (float32, float16 or bfloat16): :meth:`dequantize`'s default.
    amax : cupy.ndarray or None
        float32 (1,), the reduced max |x| of dynamic per-tensor quantization.
    """

    __slots__ = ("data", "scale", "scheme", "shape", "dtype", "amax")

    def __init__(self, data, scale, scheme: Scheme, shape, dtype, amax=None):
        self.data = data
        self.scale = scale
        self.scheme = scheme
        self.shape = shape if type(shape) is tuple else tuple(shape)
        self.dtype = dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)
        self.amax = amax

    @property
    def format(self) -> _dtypes.ElementFormat:
        return _dtypes.element_format(self.scheme.format)

    @property
    def nbytes(self) -> int:
        """Bytes held on the device: data plus scales (plus amax)."""
        return sum(a.nbytes for a in (self.data, self.scale, self.amax) if a is not None)

    def dequantize(self, dtype=None, *, out=None):
        """Same as :func:`cupyquant.dequantize` (``dtype`` defaults to the original dtype)."""
        return dequantize(self, dtype, out=out)

    def to_host(self) -> dict:
        """Copy to NumPy (this synchronizes): ``data`` viewed as the ml_dtypes element type;
        ``scale`` in its logical shape (float32, or ml_dtypes float8_e8m0fnu with packed UE8M0 words
        unpacked, the packed words also given as ``scale_packed``); ``amax`` where present."""
        scale = np.ascontiguousarray(self.scale.get())
        out = {"data": self.data.get().view(self.format.host_dtype), "scale": scale}
        if self.scheme.scale_dtype == "float8_e8m0fnu" and scale.dtype == np.int32:
            n = self.shape[-1] // self.scheme.block[0] if self.scheme.block[0] else 0
            out["scale_packed"] = scale
            out["scale"] = scale.view(np.uint8)[..., :n].view(_dtypes.SCALE_DTYPES["float8_e8m0fnu"])
        if self.amax is not None:
            out["amax"] = self.amax.get()
        return out

    def __repr__(self) -> str:
        s = self.scheme
        return (
            f"QuantizedTensor(shape={self.shape}, dtype={self.dtype.name}, format={s.format}, "
            f"granularity={s.granularity}, block={s.block}, scale_dtype={s.scale_dtype}, "
            f"scale_layout={s.scale_layout})"
        )


def dequantize(q: QuantizedTensor, dtype=None, *, out=None):
    """Dequantize a :class:`QuantizedTensor` on the GPU.

    Parameters
    ----------
    q : QuantizedTensor
    dtype : float32, float16 or bfloat16, optional
        Output dtype (name or type); defaults to ``q.dtype``, the dtype that was quantized.
    out : cupy.ndarray, optional
        Output buffer of shape ``q.shape`` and dtype ``dtype``.

    Returns
    -------
    cupy.ndarray

    Raises
    ------
    TypeError
        ``q`` is not a QuantizedTensor, or ``dtype``/``out`` has an unsupported dtype.
    ValueError
        ``out`` has the wrong shape, is not contiguous, or is on another device.

    Notes
    -----
    Each family's formula is in its module: per tensor, ``y = round(float(q) * scale)`` with the
    product in IEEE float32, rounded to nearest even into ``dtype``.
    """
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"q must be a cupyquant.QuantizedTensor, got {type(q).__name__}")
    out_type = _dtypes.input_type(q.dtype if dtype is None else dtype, "dtype")
    module = importlib.import_module(f"{__package__}.{q.scheme.family}")
    return module._dequantize(q, out_type, out)
