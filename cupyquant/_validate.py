"""Argument checks shared by every op. Each raises TypeError or ValueError naming the argument,
before any allocation or launch, so that a caller's buffers are untouched when an op raises."""

from __future__ import annotations

import contextlib
import numbers

import cupy
import numpy as np

from . import _checks, _dtypes


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
    disjoint(out, arg, inputs)
    return out


def disjoint(out: cupy.ndarray, arg: str, inputs, nbytes: int | None = None) -> None:
    """Raise unless ``out`` shares no memory with any of ``inputs``, ``(name, array or None)`` pairs.
    ``nbytes``: the bytes ``out`` covers from its start, where a layout's padding makes that more
    than its elements span."""
    lo, hi = _extent(out) if nbytes is None else (out.data.ptr, out.data.ptr + nbytes)
    for name, a in inputs:
        if a is not None and _intersect((lo, hi), _extent(a)):
            raise ValueError(f"{arg} overlaps {name}; give a separate buffer")


def _extent(a: cupy.ndarray) -> tuple:
    """[first, last + 1) byte addresses of ``a``'s elements, by its strides (empty for no elements)."""
    lo = hi = a.data.ptr
    if not a.size:
        return lo, hi
    for n, st in zip(a.shape, a.strides):
        if st < 0:
            lo += (n - 1) * st
        else:
            hi += (n - 1) * st
    return lo, hi + a.itemsize


def _intersect(a: tuple, b: tuple) -> bool:
    """Whether two non-empty byte ranges [a0, a1) and [b0, b1) intersect."""
    return a[0] < a[1] and b[0] < b[1] and a[0] < b[1] and b[0] < a[1]


def _overlap(a: cupy.ndarray, b: cupy.ndarray) -> bool:
    return _intersect(_extent(a), _extent(b))


def shape_tuple(shape, arg: str = "shape") -> tuple:
    """A tuple or list of ints (NumPy integers included), as a tuple of Python ints."""
    if not isinstance(shape, (tuple, list)) or not all(
        isinstance(d, numbers.Integral) and not isinstance(d, bool) for d in shape
    ):
        raise TypeError(f"{arg} must be a tuple of ints, got {shape!r}")
    if any(d < 0 for d in shape):
        raise ValueError(f"{arg} must not have negative dimensions, got {tuple(shape)!r}")
    return tuple(int(d) for d in shape)


positive_finite_scalar = _checks.positive_finite_scalar  # shared with the reference


# Temporaries that kernels write while a CUDA graph is being captured: every replay of the graph
# writes them again, so their memory must not go back to CuPy's pool (which would hand it to the next
# allocation) when the op returns. They are kept for the life of the process: a graph is captured
# once and replayed many times, so this costs one op's temporaries per capture.
_graph_temporaries: list = []


def keep_if_capturing(*arrays) -> None:
    """Keep ``arrays`` (op temporaries) alive if the current stream is capturing a CUDA graph."""
    if cupy.cuda.get_current_stream().is_capturing():
        _graph_temporaries.extend(a for a in arrays if isinstance(a, cupy.ndarray))
