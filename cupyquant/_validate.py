"""Argument checks shared by every op. Each raises TypeError or ValueError naming the argument,
before any allocation or launch, so that a caller's buffers are untouched when an op raises."""

from __future__ import annotations

import contextlib
import enum
import math
from typing import NamedTuple

import cupy
import numpy as np

from . import _checks, _dtypes
from ._sizes import VECTOR_BYTES


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
            f"{arg} must be C-contiguous (shape {a.shape}, strides {a.strides}); pass cupy.ascontiguousarray({arg})"
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


def span(a: cupy.ndarray) -> tuple:
    """[first, last + 1) byte offsets of ``a``'s elements from its data pointer, by its strides
    ((0, 0) for no elements)."""
    if not a.size:
        return 0, 0
    lo = hi = 0
    for n, st in zip(a.shape, a.strides):
        if st < 0:
            lo += (n - 1) * st
        else:
            hi += (n - 1) * st
    return lo, hi + a.itemsize


class Disjoint:
    """The overlap checks of a planned call, made on each call from the arrays' addresses: the byte
    span of each array relative to its data pointer is computed once, when the call is planned.

    ``named`` lists ``(name, array or None)`` or ``(name, array, nbytes)`` (an array whose layout's
    padding makes it cover ``nbytes`` from its start); those from index ``first_written`` on are
    written by the op and must overlap none of the others (nor each other)."""

    __slots__ = ("_pairs",)

    def __init__(self, named, first_written: int):
        spans = []
        for entry in named:
            a = entry[1]
            if a is None or not a.size:
                spans.append(None)
            else:
                spans.append((0, entry[2]) if len(entry) > 2 and entry[2] is not None else span(a))
        self._pairs = tuple(
            (i, j, named[i][0], named[j][0], spans[i], spans[j])
            for i in range(first_written, len(named))
            if spans[i] is not None
            for j in range(i)
            if spans[j] is not None
        )

    def check(self, ptrs) -> None:
        """Raise ValueError naming the written array unless no pair overlaps (``ptrs``: the data
        pointers of ``named``'s arrays, 0 for None)."""
        for i, j, name_i, name_j, si, sj in self._pairs:
            pi, pj = ptrs[i], ptrs[j]
            if pi + si[0] < pj + sj[1] and pj + sj[0] < pi + si[1]:
                raise ValueError(f"{name_i} overlaps {name_j}; give a separate buffer")


def array_key(a):
    """What a plan depends on of a CuPy array argument (shape, strides, dtype, device, address modulo
    16), or of None; unhashable (so never memoized) for anything else."""
    if a is None:
        return None
    if type(a) is not cupy.ndarray:
        return [a]  # a list: the plan memo refuses it
    mem = a.data
    return a.shape, a.strides, a.dtype, mem.device_id, mem.ptr & 15


def scale_key(v):
    """What a plan depends on of a scale argument: a device array's :func:`array_key` (its value is
    read on the device), or a value's type and value (a static scale is part of the plan's
    arguments)."""
    if type(v) is cupy.ndarray:
        return ("array", array_key(v))
    return type(v), v


def _extent(a: cupy.ndarray) -> tuple:
    """[first, last + 1) byte addresses of ``a``'s elements (empty for no elements)."""
    lo, hi = span(a)
    return a.data.ptr + lo, a.data.ptr + hi


def _intersect(a: tuple, b: tuple) -> bool:
    """Whether two non-empty byte ranges [a0, a1) and [b0, b1) intersect."""
    return a[0] < a[1] and b[0] < b[1] and a[0] < b[1] and b[0] < a[1]


positive_finite_scalar = _checks.positive_finite_scalar  # shared with the reference


class ScaleSource(enum.IntEnum):
    """Where a kernel takes a scale (or a scale bound) from. The numbers are those of
    ``cq::ScaleSource`` in kernels/common.cuh, which the kernels take as a template or struct argument."""

    #: None given: derived on the device from the data's amax (a bound: none applies)
    AMAX = 0
    #: a one-element float32 device array, read by the kernel (never copied to the host)
    DEVICE = 1
    #: a positive finite Python or NumPy real, passed to the kernel by value
    ARG = 2


class Scale(NamedTuple):
    """A parsed scale argument: where it comes from, the device array (DEVICE) and the value (ARG;
    0 otherwise)."""

    mode: ScaleSource
    array: cupy.ndarray | None
    value: np.float32


_NO_SCALE = Scale(ScaleSource.AMAX, None, np.float32(0))


def scale_arg(v, arg: str, device: int, ref: str = "x") -> Scale:
    """Parse a scale given as None, a positive finite real, or a one-element float32 CuPy array on
    ``device`` (that of ``ref``). Raises TypeError or ValueError naming ``arg``."""
    if v is None:
        return _NO_SCALE
    if isinstance(v, cupy.ndarray):
        _checks.one_element_float32(v, arg)
        same_device(v, arg, device, ref)
        return Scale(ScaleSource.DEVICE, v, np.float32(0))
    return Scale(ScaleSource.ARG, None, positive_finite_scalar(v, arg))


def scale_out(
    a,
    shape,
    dtype,
    device: int,
    inputs=(),
    *,
    strides=None,
    nbytes: int | None = None,
    alloc: str = "",
    arg: str = "scale_out",
) -> cupy.ndarray:
    """A caller-given scale buffer (named ``arg`` in messages): CuPy, exact shape and dtype, 16-byte
    aligned, on ``device`` and not overlapping any of ``inputs`` (``(name, array or None)`` pairs).
    C-contiguous unless ``strides`` (bytes) is given: then exactly those strides where the layout
    holds any word, in an allocation that covers ``nbytes`` from the buffer's start (a padded
    layout, whose padding is written too). ``alloc`` names the function that allocates such a
    buffer, for the message."""
    dtype = np.dtype(dtype)
    cupy_array(a, arg)
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{arg} must be {dtype.name} of shape {tuple(shape)}, got {a.dtype} {a.shape}")
    if a.dtype != dtype:
        raise TypeError(f"{arg} must have dtype {dtype.name}, got {a.dtype}")
    if strides is None:
        c_contiguous(a, arg)
        if a.data.ptr % VECTOR_BYTES:
            raise ValueError(f"{arg} must start 16-byte aligned")
    else:
        if nbytes and tuple(a.strides) != tuple(strides):
            raise ValueError(
                f"{arg} must have strides {tuple(strides)} (the layout's padding included); "
                f"got {a.strides}: allocate it with {alloc}"
            )
        mem = a.data.mem
        if a.data.ptr % VECTOR_BYTES or a.data.ptr - mem.ptr + nbytes > mem.size:
            raise ValueError(f"{arg} must start 16-byte aligned in an allocation that covers the layout's padding")
    same_device(a, arg, device, "x")
    disjoint(a, arg, inputs, nbytes=nbytes)
    return a


def rows_view(x: cupy.ndarray, arg: str = "x") -> tuple:
    """(rows, K, row stride in elements) for x seen as a matrix of its leading dimensions; raises
    unless the last axis is contiguous and the leading axes collapse into one stride."""
    _checks.at_least_1d(x.ndim, arg)
    item = x.itemsize
    K = x.shape[-1]
    if x.size == 0:  # nothing is read; CuPy may give an empty array any strides
        return math.prod(x.shape[:-1]), K, K
    if K > 1 and x.strides[-1] != item:
        raise ValueError(f"{arg} must have a contiguous last axis (stride {x.strides[-1]} bytes)")
    rows = math.prod(x.shape[:-1])
    if x.ndim == 1 or rows <= 1:
        return rows, K, K
    dims = [(n, st) for n, st in zip(x.shape[:-1], x.strides[:-1]) if n != 1]
    row_stride = dims[-1][1]
    for (_, st_outer), (n_inner, st_inner) in zip(dims[:-1], dims[1:]):
        if st_outer != st_inner * n_inner:
            raise ValueError(
                f"{arg}'s leading axes must collapse into one row stride; pass cupy.ascontiguousarray({arg})"
            )
    if row_stride % item or row_stride < K * item:
        raise ValueError(f"{arg}'s rows overlap or are misaligned (row stride {row_stride} bytes)")
    return rows, K, row_stride // item


# Temporaries that kernels write while a CUDA graph is being captured: every replay of the graph
# writes them again, so their memory must not go back to CuPy's pool (which would hand it to the next
# allocation) when the op returns. They are kept for the life of the process: a graph is captured
# once and replayed many times, so this costs one op's temporaries per capture.
_graph_temporaries: list = []


def keep_if_capturing(*arrays) -> None:
    """Keep ``arrays`` (op temporaries) alive if the current stream is capturing a CUDA graph."""
    if cupy.cuda.get_current_stream().is_capturing():
        _graph_temporaries.extend(a for a in arrays if isinstance(a, cupy.ndarray))
