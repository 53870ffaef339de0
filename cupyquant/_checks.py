"""Argument checks that need no GPU, shared by the ops and the NumPy reference so that both accept
and refuse the same inputs with the same exceptions. NumPy only: ``cupyquant.reference`` imports it."""

from __future__ import annotations

import numpy as np

WEIGHT_DTYPES = ("int4", "uint4", "float8_e4m3fn")
WEIGHT_GROUP_SIZES = (32, 64, 128, None)


def weight_scheme(dtype, symmetric=True) -> str:
    """The weight scheme a ``(dtype, symmetric)`` pair names: ``"int4"`` (symmetric, uint4b8),
    ``"uint4"`` (asymmetric with zero points: ``dtype="uint4"``, or ``"int4"`` with
    ``symmetric=False``) or ``"float8_e4m3fn"`` (symmetric only)."""
    if not isinstance(dtype, str):
        # ml_dtypes.float8_e4m3fn (the type or its np.dtype) names the FP8 scheme, as it does for
        # quantize_fp8; int4/uint4 have names only (ml_dtypes' int4 types are not packed formats)
        try:
            name = np.dtype(dtype).name
        except TypeError:
            raise TypeError(f"dtype must be one of {WEIGHT_DTYPES} or ml_dtypes.float8_e4m3fn, got {dtype!r}") from None
        dtype = name if name == "float8_e4m3fn" else dtype
    if not isinstance(dtype, str) or dtype not in WEIGHT_DTYPES:
        raise ValueError(f"dtype must be one of {WEIGHT_DTYPES}, got {dtype!r}")
    if dtype == "float8_e4m3fn":
        if not symmetric:
            raise ValueError("symmetric=False: float8_e4m3fn weights have no zero points")
        return dtype
    return "uint4" if dtype == "uint4" or not symmetric else "int4"
