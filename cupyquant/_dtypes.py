"""Element formats and input dtypes: the one table of names, C++ types and limits.

Nothing here imports CuPy, so the NumPy reference can use these tables on a machine without it.
A new element format is one row of ``_FORMATS``; a new input dtype is one row of ``_INPUTS``.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np


@dataclass(frozen=True)
class ElementFormat:
    """A quantized element format.

    Attributes
    ----------
    name : str
        The ml_dtypes name (``"float8_e4m3fn"``).
    host_dtype : numpy.dtype
        The ml_dtypes dtype that views the stored bytes on the host.
    ctag : str
        The C++ tag type in ``kernels/common.cuh`` that selects the format in a template.
    max : float
        The largest finite value.
    bits : int
        Bits per element.
    """

    name: str
    host_dtype: np.dtype
    ctag: str
    max: float
    bits: int


@dataclass(frozen=True)
class InputType:
    """A floating-point input or output dtype that kernels read and write."""

    name: str
    dtype: np.dtype
    ctype: str


_FORMATS = {
    f.name: f
    for f in (
        ElementFormat("float8_e4m3fn", np.dtype(ml_dtypes.float8_e4m3fn), "cq::E4M3", 448.0, 8),
        ElementFormat("float8_e5m2", np.dtype(ml_dtypes.float8_e5m2), "cq::E5M2", 57344.0, 8),
        ElementFormat("int8", np.dtype(np.int8), "cq::I8", 127.0, 8),
        ElementFormat("float4_e2m1fn", np.dtype(ml_dtypes.float4_e2m1fn), "cq::E2M1", 6.0, 4),
    )
}

#: Scale dtypes: name -> the host dtype that views the stored scales.
SCALE_DTYPES = {
    "float32": np.dtype(np.float32),
    "float8_e8m0fnu": np.dtype(ml_dtypes.float8_e8m0fnu),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
}

_INPUTS = {
    t.dtype: t
    for t in (
        InputType("float32", np.dtype(np.float32), "float"),
        InputType("float16", np.dtype(np.float16), "__half"),
        InputType("bfloat16", np.dtype(ml_dtypes.bfloat16), "__nv_bfloat16"),
    )
}

FORMAT_NAMES = tuple(_FORMATS)
FP8_NAMES = ("float8_e4m3fn", "float8_e5m2")
MX_NAMES = ("float8_e4m3fn", "float8_e5m2", "float4_e2m1fn")
INPUT_TYPES = tuple(_INPUTS.values())
#: C++ types of the inputs, and of the 16-bit inputs the matmul kernels take, for template arguments.
INPUT_CTYPES = tuple(t.ctype for t in INPUT_TYPES)
HALF_CTYPES = ("__half", "__nv_bfloat16")


def element_format(dtype, arg: str = "dtype", allowed=None) -> ElementFormat:
    """Resolve a format given by ml_dtypes name, ml_dtypes type or numpy dtype.

    Raises ``TypeError`` for something that names no dtype and ``ValueError`` for a dtype that is
    not a supported element format (or not in ``allowed``).
    """
    allowed = FORMAT_NAMES if allowed is None else allowed
    if isinstance(dtype, ElementFormat):
        name = dtype.name
    elif isinstance(dtype, str):
        name = dtype
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            raise TypeError(
                f"{arg} must be a format name such as 'float8_e4m3fn' or an ml_dtypes type, got {dtype!r}"
            ) from None
    if name not in allowed or name not in _FORMATS:
        raise ValueError(f"{arg}={name!r} is not supported here; expected one of {tuple(allowed)}")
    return _FORMATS[name]


def scale_dtype(dtype, arg: str = "scale_dtype", allowed=None) -> str:
    """Resolve a scale dtype given by name or type to its name; ``ValueError`` naming ``arg`` for one
    that is not a scale dtype (or not in ``allowed``)."""
    allowed = tuple(SCALE_DTYPES) if allowed is None else allowed
    try:
        name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    except TypeError:
        name = repr(dtype)
    if name not in SCALE_DTYPES or name not in allowed:
        raise ValueError(f"{arg}={name!r} is not supported; expected one of {tuple(allowed)}")
    return name


def input_type(dtype, arg: str = "x") -> InputType:
    """Resolve a float32/float16/bfloat16 dtype; ``TypeError`` naming ``arg`` otherwise."""
    try:
        key = np.dtype(dtype)
    except TypeError:
        key = None
    if key not in _INPUTS:
        raise TypeError(f"{arg} must be float32, float16 or bfloat16; got {dtype}")
    return _INPUTS[key]
