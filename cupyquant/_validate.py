"""Argument checks shared by every op. Each raises TypeError or ValueError naming the argument,
before any allocation or launch, so that a caller's buffers are untouched when an op raises."""

from __future__ import annotations

import contextlib
import numbers

import cupy
import numpy as np

from . import _dtypes


def cupy_array(a, arg: str) -> cupy.ndarray:
    if not isinstance(a, cupy.ndarray):
        hint = "; move it to the GPU with cupy.asarray()" if isinstance(a, np.ndarray) else ""
        raise TypeError(f"{arg} must be a cupy.ndarray, got {type(a).__module__}.{type(a).__name__}{hint}")
    return a


def float_input(x, arg: str = "x") -> _dtypes.InputType:
    """A CuPy float32/float16/bfloat16 array; returns its InputType."""
    cupy_array(x, arg)
    return _dtypes.input_type(x.dtype, arg)


def c_contiguous(a: cupy.ndarray, arg: str) -> None:
    if not a.flags.c_contiguous:
        raise ValueError(
            f"{arg} must be C-contiguous (shape {a.shape}, strides {a.strides}); "
            f"pass cupy.ascontiguousarray({arg})"
        )


_SAME_DEVICE = contextlib.nullcontext()


def on_device_of(a: cupy.ndarray):
    """A context that makes ``a``'s device current (a no-op when it already is)."""
    return _SAME_DEVICE if a.data.device_id == cupy.cuda.runtime.getDevice() else a.device


def same_device(a: cupy.ndarray, arg: str, device: int, ref: str) -> None:
    if a.data.device_id != device:
        raise ValueError(f"{arg} is on device {a.data.device_id} but {ref} is on device {device}")


def out_array(out, arg: str, shape, dtype, device: int, inputs=()) -> cupy.ndarray:
    """A caller-given output buffer: CuPy, exact shape and dtype, C-contiguous, same device, and
    not overlapping any input."""
    cupy_array(out, arg)
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{arg} must have shape {tuple(shape)}, got {tuple(out.shape)}")
    if out.dtype != np.dtype(dtype):
        raise TypeError(f"{arg} must have dtype {np.dtype(dtype).name}, got {out.dtype}")
    c_contiguous(out, arg)
    same_device(out, arg, device, "the input")
    for name, a in inputs:
        if a is not None and a.size and out.size and _overlap(out, a):
            raise ValueError(f"{arg} overlaps {name}; give a separate buffer")
    return out


def _overlap(a: cupy.ndarray, b: cupy.ndarray) -> bool:
    a0 = a.data.ptr
    b0 = b.data.ptr
    a1 = a0 + a.nbytes
    b1 = b0 + b.nbytes
    return a0 < b1 and b0 < a1


_FLT_MAX = float(np.finfo(np.float32).max)


def positive_finite_scalar(v, arg: str) -> np.float32:
    """A Python/NumPy real that is positive and finite as float32; returned as np.float32."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{arg} must be a real number or a cupy.ndarray, got {type(v).__name__}")
    f = float(v)
    if not (0.0 < f <= _FLT_MAX) or np.float32(f) == 0:  # NaN fails the first test
        raise ValueError(f"{arg} must be a positive finite float32 value, got {v!r}")
    return np.float32(f)
