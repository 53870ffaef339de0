"""Kernel launches: every kernel of the library is launched through :class:`Launch`, which marshals
its arguments once (when an op plans a call) and patches only the pointers on each call.

A :class:`Launch` holds one kernel, its grid, block and shared memory, and a parameter buffer in
which each argument has its slot: the values fixed by the plan (sizes, strides, the kernels'
argument structs, tensor maps) are written once, and the device pointers of the call's arrays are
written into their slots just before the launch. The launch itself is the driver's
``cuLaunchKernel`` (``cupy.cuda.driver.launchKernel``), or ``cuLaunchKernelEx`` through ctypes where
the launch has attributes: programmatic dependent launch (PDL) and thread-block clusters, which
CuPy's ``RawKernel`` call does not offer. On an H200 host, a launch of six pointers and a struct
costs 5.9 us this way against 8.1 us through ``cupy.RawKernel``, whose call converts every argument
again (driver.launchKernel alone: 4.4 us).

With PDL (compute capability 9.0 and newer) a kernel may be launched while the kernel before it on
the stream still runs: its blocks start as soon as that kernel's blocks have all signalled
(``griddepcontrol.launch_dependents``) and there is room on the SMs, and each block waits at
``griddepcontrol.wait`` until the kernel before has completed and its writes are visible. A kernel
launched this way must therefore execute that wait before it touches any memory that another kernel
may write (kernels/weight_decode.cu says what the decode matmul does before it). The ops launch
this way where the device has it (``_device.Caps.pdl``): the quantizers, dequantizers, the fused
RMSNorm, the KV cache, the weight-only matmul and the Hopper W8A8 matmul. Under stream capture the
launch becomes a programmatic edge of the graph.

:func:`recording` collects the launches (and memsets) made inside it, for the host-time benchmark's
bare replay (``scripts/bench_host.py``) and for tests that check what an op launched.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading

import numpy as np

from ._jit import KernelLaunchError, function_ptr
from ._sizes import round_up

#: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h)
ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6
#: CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION (cuda.h): the value holds three unsigned ints x, y, z
ATTR_CLUSTER_DIMENSION = 4
#: CUDA_ERROR_INVALID_CONTEXT (cuda.h): a thread whose first CUDA call is a driver launch has no
#: current context yet; the runtime makes the device's primary context current
_INVALID_CONTEXT = 201


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
    """libcuda's cuLaunchKernelEx and cuGetErrorString, loaded at the first launch with attributes."""
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


def _error_string(rc: int) -> str:
    msg = ctypes.c_char_p()
    _driver()[1](rc, ctypes.byref(msg))
    return (msg.value or b"?").decode()


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
    rc = _occupancy_fn(ctypes.byref(n), function_ptr(kernel), ctypes.byref(cfg))
    if rc:
        raise RuntimeError(f"cuOccupancyMaxActiveClusters failed: error {rc} ({_error_string(rc)})")
    return n.value


# ---------------------------------------------------------------- the launcher
#: Marks an argument of a :class:`Launch` whose device pointer is given at each call.
ARG = object()


class Blob:
    """Marks an argument of a :class:`Launch` passed by value and given at each call: a 0-d NumPy
    array of ``dtype`` (a TMA tensor map, whose address is the call's)."""

    __slots__ = ("dtype", "nbytes")

    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)
        self.nbytes = self.dtype.itemsize


#: Alignment of each argument's slot in the parameter buffer (a tensor map's own alignment).
_SLOT_ALIGN = 64

_recording = None  # a list while recording() is active


@contextlib.contextmanager
def recording():
    """Within the block, every :class:`Launch` call and :func:`memset` on this process appends a
    record to the yielded list: ``(kernel, grid, block, args, shared_mem, launch)``, ``args`` as
    ``cupy.RawKernel`` takes them (the call's arrays, fixed values, structs with their pointers
    filled in), ``launch`` the :class:`Launch` (whose attributes a replay needs) or, for a memset,
    ``("memset", ptr, value, nbytes)`` in place of the kernel and None elsewhere."""
    global _recording
    saved, _recording = _recording, []
    try:
        yield _recording
    finally:
        _recording = saved


def _stream_ptr() -> int:
    import cupy

    return cupy.cuda.get_current_stream().ptr


class Launch:
    """One kernel launch, planned: ``kernel`` (a ``cupy.RawKernel``) over ``grid`` x ``block`` with
    ``smem`` dynamic shared bytes, as thread-block clusters of ``cluster`` = (x, y, z) blocks if
    given and with programmatic dependent launch if ``pdl``.

    ``args`` holds one entry per kernel parameter: :data:`ARG` (a pointer given at each call), a
    :class:`Blob` (bytes given at each call), an int (a fixed pointer, 0 for null), a NumPy scalar,
    or a 0-d structured array / ``numpy.void`` (a struct passed by value; ``fields`` names its
    ``(argument index, field)`` pairs whose pointer is given at each call, after the others). Calling the
    launch with those pointers (CuPy arrays, ints, or None for null), in order, launches it on the
    current stream; a plan whose calls never give the last arguments may leave them out (they keep
    their zero bytes: a null pointer, an empty tensor map). Thread-safe.
    Raises :class:`KernelLaunchError` (a ``RuntimeError``) with the driver's code and message if the
    driver refuses the launch."""

    __slots__ = ("kernel", "grid", "block", "smem", "pdl", "cluster", "_args", "_buf", "_words", "_slots",
                 "_params", "_cfg", "_attrs", "_fn", "_lock", "_offsets", "_raw", "_blobs", "_last")  # fmt: skip

    def __init__(self, kernel, grid, block, args, *, smem: int = 0, pdl: bool = False, cluster=None, fields=()):
        self.kernel = kernel
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.block = tuple(block) + (1,) * (3 - len(block))
        self.smem, self.pdl, self.cluster = int(smem), bool(pdl), cluster
        self._args = tuple(args)
        sizes = [_arg_bytes(a) for a in self._args]
        offsets, off = [], 0
        for n in sizes:
            offsets.append(off)
            off += round_up(n, _SLOT_ALIGN)
        self._offsets = offsets
        self._buf = np.zeros(max(off, 8) // 8 + _SLOT_ALIGN // 8, np.uint64)
        base = -self._buf.ctypes.data % _SLOT_ALIGN  # bytes to the first aligned address
        raw = self._raw = self._buf.view(np.uint8)[base:]
        slots = []
        for a, o in zip(self._args, offsets):
            if a is ARG:
                slots.append((base + o) // 8)
            elif isinstance(a, Blob):
                slots.append(~(base + o))  # a byte offset, as ~offset (negative): copied, not written as a word
            elif isinstance(a, int):
                raw[o : o + 8].view(np.uint64)[0] = a
            else:
                v = np.asarray(a)
                raw[o : o + v.dtype.itemsize] = np.frombuffer(v.tobytes(), np.uint8)
        self._blobs = any(isinstance(a, Blob) for a in self._args)
        self._last = {}  # blob slot -> the array last copied there (the same object is not copied again)
        for i, name in fields:
            slots.append((base + offsets[i] + np.asarray(self._args[i]).dtype.fields[name][1]) // 8)
        self._slots = tuple(slots)
        self._words = (ctypes.c_uint64 * self._buf.size).from_buffer(self._buf)
        addr = self._buf.ctypes.data + base
        self._params = (ctypes.c_void_p * len(self._args))(*(addr + o for o in offsets))
        self._fn = function_ptr(kernel)
        self._cfg = None
        if self.pdl or cluster is not None:
            attrs, n = launch_attributes(self.pdl, cluster)
            self._attrs = attrs  # kept alive with the config that points at it
            self._cfg = LaunchConfig(*self.grid, *self.block, self.smem, None, attrs, n)
        self._lock = threading.Lock()

    def __call__(self, *values) -> None:
        stream = _stream_ptr()
        with self._lock:
            words = self._words
            if self._blobs:
                self._copy_blobs(values)
            else:
                for slot, v in zip(self._slots, values):
                    words[slot] = v if type(v) is int else (0 if v is None else v.data.ptr)
            if _recording is not None:
                _recording.append(self._record(values))
            try:
                self._go(stream)
            except KernelLaunchError as e:
                if e.code != _INVALID_CONTEXT:
                    raise
                import cupy

                cupy.cuda.runtime.free(0)  # makes the device's primary context current in this thread
                self._go(stream)

    def _copy_blobs(self, values) -> None:
        words, start, last = self._words, self._buf.ctypes.data, self._last
        for slot, v in zip(self._slots, values):
            if slot < 0:
                if last.get(slot) is not v:  # a cached tensor map comes back as the same object
                    ctypes.memmove(start + ~slot, v.ctypes.data, v.nbytes)
                    last[slot] = v
            else:
                words[slot] = v if type(v) is int else (0 if v is None else v.data.ptr)

    def _go(self, stream: int) -> None:
        if self._cfg is None:
            from cupy.cuda import driver

            g, b = self.grid, self.block
            try:
                driver.launchKernel(
                    self._fn, g[0], g[1], g[2], b[0], b[1], b[2], self.smem, stream, ctypes.addressof(self._params), 0
                )
            except driver.CUDADriverError as e:
                raise KernelLaunchError("cuLaunchKernel", getattr(e, "status", -1), str(e)) from None
            return
        self._cfg.hStream = stream
        rc = _driver()[0](ctypes.byref(self._cfg), self._fn, self._params, None)
        if rc:
            raise KernelLaunchError("cuLaunchKernelEx", rc, _error_string(rc))

    def _record(self, values) -> tuple:
        """This call as cupy.RawKernel would take it (see :func:`recording`)."""
        it = iter(values)
        args, raw = [], self._raw
        for a, o in zip(self._args, self._offsets):
            if a is ARG or isinstance(a, Blob):
                v = next(it, None)  # an argument left out at the end of a call keeps its zero bytes
                if v is None and isinstance(a, Blob):
                    v = np.frombuffer(raw[o : o + a.nbytes].tobytes(), a.dtype)[0]
                args.append(v)
            elif isinstance(a, int):
                args.append(a)
            else:
                v = np.asarray(a)
                args.append(np.frombuffer(raw[o : o + v.dtype.itemsize].tobytes(), v.dtype)[0])
        return (self.kernel, self.grid, self.block, tuple(args), self.smem, self)

    def param_bytes(self, i: int) -> bytes:
        """The bytes of argument ``i`` in the parameter buffer (as the last call left them)."""
        return self._raw[self._offsets[i] : self._offsets[i] + _arg_bytes(self._args[i])].tobytes()


def _arg_bytes(a) -> int:
    if a is ARG or isinstance(a, int):
        return 8
    if isinstance(a, Blob):
        return a.nbytes
    v = np.asarray(a)
    if v.ndim or v.dtype.kind not in "biufV":
        raise TypeError(f"a kernel argument must be a pointer, a NumPy scalar or a 0-d struct, got {a!r}")
    return v.dtype.itemsize


def memset(ptr: int, value: int, nbytes: int) -> None:
    """``cudaMemsetAsync`` of ``nbytes`` at device address ``ptr`` on the current stream (recorded
    like a launch)."""
    import cupy

    if _recording is not None:
        _recording.append((("memset", ptr, value, nbytes), None, None, None, 0, None))
    cupy.cuda.runtime.memsetAsync(ptr, value, nbytes, _stream_ptr())


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
        raise RuntimeError(f"cuTensorMapEncodeTiled failed: error {rc} ({_error_string(rc)})")
    return out
