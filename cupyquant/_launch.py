"""Kernel launches with programmatic dependent launch (PDL), through the driver's
``cuLaunchKernelEx``: CuPy's ``RawKernel`` call has no launch attributes.

With PDL (compute capability 9.0 and newer) a kernel may be launched while the kernel before it on
the stream still runs: its blocks start as soon as that kernel's blocks have all signalled
(``griddepcontrol.launch_dependents``) and there is room on the SMs, and each block waits at
``griddepcontrol.wait`` until the kernel before has completed and its writes are visible. A kernel
launched this way must therefore execute that wait before it touches any memory that another kernel
may write (kernels/weight_decode.cu says what the decode matmul does before it: address arithmetic, and,
for a weight that an earlier call has read, the loads of its first weight chunk and scales, which
no kernel before it writes: weight.py _early_ok). Under stream capture the launch becomes a
programmatic edge of the graph.

Everything here is host-side marshalling of the launch; nothing runs without a GPU except the
checks of the structure layouts and the parameter array (tests/test_launch.py). Launch shapes and
launches that more than one op uses are here too (:func:`grid2d`, :func:`launch_amax`).
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np

from . import _jit
from ._jit import KernelLaunchError

#: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h)
ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6
#: CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION (cuda.h): the value holds three unsigned ints x, y, z
ATTR_CLUSTER_DIMENSION = 4


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, padding to 8 bytes, and a 64-byte value union."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_ubyte * 64)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""

    _fields_ = [
        ("gridDimX", ctypes.c_uint),
        ("gridDimY", ctypes.c_uint),
        ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint),
        ("blockDimY", ctypes.c_uint),
        ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint),
        ("hStream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(LaunchAttribute)),
        ("numAttrs", ctypes.c_uint),
    ]


_lib = None
_lib_lock = threading.Lock()


def _driver():
    """libcuda's cuLaunchKernelEx and cuGetErrorString, loaded at the first PDL launch."""
    global _lib
    if _lib is None:
        with _lib_lock:
            if _lib is None:
                lib = ctypes.CDLL("libcuda.so.1")
                launch = lib.cuLaunchKernelEx
                launch.restype = ctypes.c_int
                launch.argtypes = [
                    ctypes.POINTER(LaunchConfig),
                    ctypes.c_void_p,
                    ctypes.POINTER(ctypes.c_void_p),
                    ctypes.c_void_p,
                ]
                err = lib.cuGetErrorString
                err.restype = ctypes.c_int
                err.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
                _lib = (launch, err)
    return _lib


def kernel_params(args) -> tuple:
    """The ``void**`` array of a launch and the ctypes object whose memory it points into (keep it
    alive until the launch returns). ``args`` holds CuPy arrays (passed as their data pointers),
    ints (pointers: 0 for a null one; every int argument of the kernels launched here is a pointer)
    and 0-d NumPy structured arrays (the kernels' argument structs, passed by value, from the
    array's own memory)."""
    n = len(args)
    values = (ctypes.c_void_p * n)()
    params = (ctypes.c_void_p * n)()
    base = ctypes.addressof(values)
    for i, v in enumerate(args):
        if isinstance(v, np.ndarray):
            if v.ndim or v.dtype.names is None:
                raise TypeError("a NumPy kernel argument must be a 0-d structured array")
            params[i] = v.ctypes.data
            continue
        values[i] = v.data.ptr if hasattr(v, "data") else int(v)
        params[i] = base + 8 * i
    return params, values


_PDL_ATTR = LaunchAttribute()
_PDL_ATTR.id = ATTR_PROGRAMMATIC_STREAM_SERIALIZATION
_PDL_ATTR.value[0] = 1
_PDL_ATTR_PTR = ctypes.pointer(_PDL_ATTR)


def launch_attributes(pdl: bool, cluster=None):
    """The attribute array of a launch and its length: programmatic stream serialization if
    ``pdl``, and the cluster dimension (x, y, z) if ``cluster`` is given (that one first)."""
    if cluster is None:
        return (_PDL_ATTR_PTR, 1) if pdl else (None, 0)
    attrs = (LaunchAttribute * 2)()
    attrs[0].id = ATTR_CLUSTER_DIMENSION
    dims = (ctypes.c_uint * 3).from_buffer(attrs[0].value)
    dims[0], dims[1], dims[2] = cluster
    attrs[1].id = ATTR_PROGRAMMATIC_STREAM_SERIALIZATION
    attrs[1].value[0] = 1
    return attrs, 2 if pdl else 1


_occupancy_fn = None


def max_active_clusters(kernel, block: int, shared_mem: int, cluster) -> int:
    """How many clusters of ``cluster`` = (x, y, z) blocks of ``kernel`` (``block`` threads and
    ``shared_mem`` dynamic shared bytes each) can be resident on the current device at once
    (``cuOccupancyMaxActiveClusters``). A cluster's blocks must all fit in one GPC, so on a GPU
    whose GPCs hold SM counts that are not multiples of the cluster size this is less than
    SMs / cluster size (the H100 at one block per SM: 66 clusters of 2, 39 of 3, 30 of 4, 15 of 8).
    The kernel's shared-memory limit must already allow ``shared_mem``. Raises ``RuntimeError``
    with the driver's message if the query fails."""
    global _occupancy_fn
    if _occupancy_fn is None:
        fn = ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveClusters
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.POINTER(LaunchConfig)]
        _occupancy_fn = fn
    attrs, nattrs = launch_attributes(False, cluster)
    cfg = LaunchConfig(cluster[0], cluster[1], cluster[2], block, 1, 1, shared_mem, None, attrs, nattrs)
    n = ctypes.c_int(0)
    rc = _occupancy_fn(ctypes.byref(n), kernel.kernel.ptr, ctypes.byref(cfg))
    if rc:
        msg = ctypes.c_char_p()
        _driver()[1](rc, ctypes.byref(msg))
        raise RuntimeError(f"cuOccupancyMaxActiveClusters failed: error {rc} ({(msg.value or b'?').decode()})")
    return n.value


def launch(kernel, grid, block, args, shared_mem: int = 0, stream=None, *, pdl: bool = True, cluster=None) -> None:
    """Launch ``kernel`` (a ``cupy.RawKernel``) like ``kernel(grid, block, args, shared_mem=...)``
    on ``stream`` (the current stream by default), with programmatic stream serialization (the
    attribute that makes the launch programmatic-dependent) unless ``pdl`` is false, and as
    thread-block clusters of ``cluster`` = (x, y, z) blocks if given (compute capability 9.0+);
    ``args`` as :func:`kernel_params` takes them. Raises :class:`KernelLaunchError` (a
    ``RuntimeError``) with the driver's code and message if the launch fails."""
    import cupy

    if stream is None:
        stream = cupy.cuda.get_current_stream()
    gx, gy, gz = tuple(grid) + (1,) * (3 - len(grid))
    bx, by, bz = tuple(block) + (1,) * (3 - len(block))
    attrs, nattrs = launch_attributes(pdl, cluster)
    cfg = LaunchConfig(gx, gy, gz, bx, by, bz, shared_mem, stream.ptr, attrs, nattrs)
    params, values = kernel_params(args)
    fn, err = _driver()
    rc = fn(ctypes.byref(cfg), kernel.kernel.ptr, params, None)
    if rc:
        msg = ctypes.c_char_p()
        err(rc, ctypes.byref(msg))
        raise KernelLaunchError("cuLaunchKernelEx", rc, (msg.value or b"?").decode())
    del values, attrs


#: A CUtensorMap (cuda.h): 128 opaque bytes, passed by value to a kernel's ``__grid_constant__``
#: parameter (kernels/weight_sm90_gemm.cu TmaMap)
TENSOR_MAP = np.dtype([("w", "<u8", (16,))])
# cuda.h enums: CU_TENSOR_MAP_DATA_TYPE_UINT8 / _UINT16, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
# CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE (elements outside read as zeros)
_TM_DATA_TYPES = {1: 0, 2: 1}
_TM_INTERLEAVE_NONE, _TM_SWIZZLE_128B, _TM_L2_256B, _TM_OOB_ZERO = 0, 3, 3, 0
_encode_fn = None


def tensor_map_2d(
    ptr: int, rows: int, cols: int, row_bytes: int, box_cols: int, box_rows: int, elem_bytes: int = 2
) -> np.ndarray:
    """A 0-d :data:`TENSOR_MAP` for TMA loads of ``box_rows`` x ``box_cols`` boxes of a row-major
    matrix of ``elem_bytes``-byte elements (1 or 2) at device address ``ptr`` (``rows`` x ``cols``,
    rows ``row_bytes`` apart) into shared memory in the 128-byte swizzle, elements outside the
    matrix read as zeros (``cuTensorMapEncodeTiled``, a host-side encoding: no GPU work). The driver
    wants ``ptr`` 16-byte aligned, ``row_bytes`` a multiple of 16, ``box_cols`` x ``elem_bytes`` <=
    128 bytes and ``box_rows`` <= 256. Raises ``RuntimeError`` with the driver's message if it
    refuses."""
    global _encode_fn
    if _encode_fn is None:
        fn = ctypes.CDLL("libcuda.so.1").cuTensorMapEncodeTiled
        fn.restype = ctypes.c_int
        u64p, u32p = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
        fn.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_uint32,
            ctypes.c_void_p,
            u64p,
            u64p,
            u32p,
            u32p,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
        ]
        _encode_fn = fn
    raw = np.zeros(TENSOR_MAP.itemsize + 64, dtype=np.uint8)  # the driver writes a 64-byte-aligned map
    off = -raw.ctypes.data % 64
    out = raw[off : off + TENSOR_MAP.itemsize].view(TENSOR_MAP).reshape(())
    dims = (ctypes.c_uint64 * 2)(cols, rows)
    strides = (ctypes.c_uint64 * 1)(row_bytes)
    box = (ctypes.c_uint32 * 2)(box_cols, box_rows)
    elem = (ctypes.c_uint32 * 2)(1, 1)
    rc = _encode_fn(
        out.ctypes.data,
        _TM_DATA_TYPES[elem_bytes],
        2,
        ptr,
        dims,
        strides,
        box,
        elem,
        _TM_INTERLEAVE_NONE,
        _TM_SWIZZLE_128B,
        _TM_L2_256B,
        _TM_OOB_ZERO,
    )
    if rc:
        msg = ctypes.c_char_p()
        _driver()[1](rc, ctypes.byref(msg))
        raise RuntimeError(f"cuTensorMapEncodeTiled failed: error {rc} ({(msg.value or b'?').decode()})")
    return out


def grid2d(rows: int, units: int, threads: int = 256) -> tuple:
    """(grid, block) of the 2-D row kernels (groupwise.cu): blockDim (bx, by), bx the largest power of
    two up to ``threads`` that divides the ``units`` (16- or 8-element pieces) of a row, so that no
    group straddles two block rows, and by = threads / bx rows per block."""
    bx = threads
    while units % bx:
        bx //= 2
    by = threads // bx
    return (-(-rows // by), units // bx), (bx, by)


AMAX_BLOCK = 512  # must equal AMAX_BLOCK in per_tensor.cu
AMAX_BLOCKS_PER_SM = 4  # 4 x 512 threads fill an H100 SM (2048 threads) in one wave


def launch_amax(x, in_t, amax_out, device: int, n64: np.int64) -> None:
    """Zero ``amax_out`` (float32, (1,)) on the current stream, then reduce max |x| of the
    C-contiguous ``x`` into it with the per_tensor family's ``fp8_amax`` (which combines blocks with
    an unsigned atomicMax on the float's bits). The caller's module must have imported
    :mod:`cupyquant.per_tensor`, which registers that family."""
    import cupy

    from . import _device

    cupy.cuda.runtime.memsetAsync(amax_out.data.ptr, 0, 4, cupy.cuda.get_current_stream().ptr)
    n = x.size
    if n == 0:
        return
    vec = x.data.ptr % 16 == 0
    per_block = AMAX_BLOCK * (16 // x.itemsize if vec else 1)
    grid = max(1, min(-(-n // per_block), _device.sm_count(device) * AMAX_BLOCKS_PER_SM))
    k = _jit.kernel(device, "per_tensor", "fp8_amax", in_t.ctype, vec)
    k((grid,), (AMAX_BLOCK,), (x, n64, amax_out))
