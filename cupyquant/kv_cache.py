"""FP8 writes into a paged KV cache (vLLM ``reshape_and_cache_flash`` with an FP8 cache) and the
dequantizing read of cache blocks.

Kernels: ``kernels/kv_cache.cu``. Reference: :func:`cupyquant.reference.quantize_kv_cache` and
:func:`cupyquant.reference.dequantize_kv_cache`.
"""

from __future__ import annotations

from typing import NamedTuple

import cupy
import numpy as np

from . import _checks, _device, _dtypes, _jit, _plans, _validate
from ._launch import ARG, Launch
from ._sizes import VECTOR_BYTES, ceil_div

_FP8 = _dtypes.FP8_NAMES
_FP8_TAGS = tuple(_dtypes.element_format(n).ctag for n in _FP8)
_BOOLS = (False, True)
FAMILY = _jit.register(
    "kv_cache",
    _jit.product("kv_cache_write", _dtypes.INPUT_CTYPES, _FP8_TAGS, _BOOLS)
    + _jit.product("kv_cache_write_wide", _dtypes.INPUT_CTYPES, _FP8_TAGS)
    + _jit.product("kv_cache_dequantize", _dtypes.INPUT_CTYPES, _FP8_TAGS, _BOOLS),
)

_BLOCK = 256  # threads per block (KV_BLOCK in kv_cache.cu)
_UNITS_PER_LANE = {True: 2, False: 8}  # KVUnits in kv_cache.cu
_MAX_ROWS = (1 << 31) - 1  # rows split into (token, head) with 32-bit arithmetic

#: The write kernels of static scales, as :data:`WRITE_PATH` names them: "units8" (kv_cache_write:
#: a lane takes units of 8 elements, an 8-byte store each) and "wide" (kv_cache_write_wide: a lane
#: takes 16 contiguous elements of one row, one 16-byte store). Dynamic scales always take
#: kv_cache_write. ptxas (sm_90), 16-bit x: kv_cache_write_wide takes 32 registers (8 blocks of 256
#: threads per SM), kv_cache_write 42 (5 blocks per SM); both keep 32 bytes of loads a lane in
#: flight.
WRITE_PATHS = ("units8", "wide")
#: Internal override of the write planner, for tests and A/B timing: a name of WRITE_PATHS, or None
#: (the planner's choice). Read at every call and part of the plan's key, so it may change between
#: calls. "wide" asked for where it does not apply (dynamic scales, alignment, head_dim) gives
#: "units8".
WRITE_PATH: str | None = None
#: The planner takes the wide kernel from this many (token, head) rows up. On an H200 (bf16, head_dim
#: 128) it is 1.14-1.16x kv_cache_write from 32768 rows (4096 tokens x 8 heads) up, and 0.97x at 2048
#: (2.10 us against 2.03), where a call is its launch and one row of work a lane.
WIDE_FROM_ROWS = 8192
#: The wide kernel's largest head_dim: one pass of 16 elements by each of at most 32 lanes.
WIDE_MAX_HEAD_DIM = 32 * 16

# The kernels' KVWriteArgs and KVReadArgs, field for field (C alignment).
_WRITE_ARGS = np.dtype(
    [(f, np.int64) for f in ("rows", "num_slots", "x_tok_k", "x_head_k", "x_tok_v", "x_head_v")]
    + [(f, np.int64) for f in ("c_block", "c_off", "c_head", "s_block", "s_off", "s_head")]
    + [(f, np.int32) for f in ("heads", "head_dim", "block_size", "slot64", "stride_k", "stride_v", "dynamic")]
    + [(f, np.int32) for f in ("tpr_log2", "heads_log2", "block_size_log2")],
    align=True,
)
_READ_ARGS = np.dtype(
    [("rows", np.int64), ("num_blocks", np.int64)]
    + [
        (f, np.int32)
        for f in ("rows_per_block", "heads", "head_dim", "block_size", "hnd", "ids64", "scale_stride", "dynamic")
    ]
    + [("tpr_log2", np.int32), ("pad", np.int32)],
    align=True,
)


# ------------------------------------------------------------------ layouts and arguments
def _dims(cache_shape, hnd: bool) -> tuple:
    """(blocks, block_size, heads, head_dim) of a cache shape in its layout."""
    b, d1, d2, d = cache_shape
    return (b, d2, d1, d) if hnd else (b, d1, d2, d)


def _strides(block_size: int, heads: int, row: int, hnd: bool) -> tuple:
    """Element strides of (block, in-block offset, head) for rows of ``row`` elements (head_dim for the
    data, 1 for the scales)."""
    if hnd:
        return heads * block_size * row, row, block_size * row
    return block_size * heads * row, heads * row, row


def kv_scale_cache_shape(cache_shape, kv_layout: str = "NHD") -> tuple:
    """The shape of the float32 scale cache that goes with a cache of ``cache_shape`` in ``kv_layout``:
    ``[blocks, block_size, heads]`` for "NHD", ``[blocks, heads, block_size]`` for "HND" (the cache's
    shape without head_dim)."""
    _checks.kv_layout_is_hnd(kv_layout)
    shape = _checks.shape_tuple(cache_shape, "cache_shape")
    if len(shape) != 4:
        raise ValueError(f"cache_shape must have 4 dimensions, got {shape}")
    return shape[:3]


def empty_kv_scale_cache(cache: cupy.ndarray, kv_layout: str = "NHD") -> cupy.ndarray:
    """An uninitialized float32 scale cache for ``cache`` in ``kv_layout`` (see
    :func:`kv_scale_cache_shape`), on its device: the ``key_scale_cache`` / ``value_scale_cache`` of
    dynamic :func:`quantize_kv_cache`."""
    _validate.cupy_array(cache, "cache")
    shape = kv_scale_cache_shape(cache.shape, kv_layout)
    with _validate.on_device_of(cache):
        return cupy.empty(shape, dtype=np.float32)


class _Scale(NamedTuple):
    """A parsed static or dynamic scale: the device array (or None), the value by argument, and the
    array's stride over heads (0: one scale)."""

    dynamic: bool
    array: cupy.ndarray | None
    value: np.float32
    stride: int


_DYNAMIC = _Scale(True, None, np.float32(0), 0)


def _scale(v, arg: str, heads: int, device: int, ref: str) -> _Scale:
    """A scale given as "dynamic", a positive finite real, or a float32 CuPy array of shape (1,)
    (per tensor) or (heads,) (per head) on ``device``. Its values are not checked (they stay on the
    device)."""
    if isinstance(v, str):
        if v != "dynamic":
            raise ValueError(f"{arg}={v!r} is not supported; expected 'dynamic', a positive float or a float32 array")
        return _DYNAMIC
    if isinstance(v, cupy.ndarray):
        if v.dtype != np.float32:
            raise TypeError(f"{arg} must be a float32 array, got {v.dtype}")
        if v.shape not in ((1,), (heads,)):
            raise ValueError(f"{arg} must have shape (1,) or ({heads},) (one scale, or one per head), got {v.shape}")
        if v.size > 1 and v.strides[0] != 4:
            raise ValueError(f"{arg} must be contiguous; pass cupy.ascontiguousarray({arg})")
        _validate.same_device(v, arg, device, ref)
        return _Scale(False, v, np.float32(0), int(v.size > 1))
    return _Scale(False, None, _validate.positive_finite_scalar(v, arg), 0)


def _scales(scale_k, scale_v, heads: int, device: int) -> tuple:
    sk = _scale(scale_k, "scale_k", heads, device, "key")
    sv = _scale(scale_v, "scale_v", heads, device, "key")
    if sk.dynamic != sv.dynamic:
        raise ValueError("scale_k and scale_v must both be 'dynamic' or both static")
    return sk, sv


def _log2_or_minus1(n: int) -> int:
    """log2(n) for a power of two n, else -1 (the kernels then divide)."""
    return n.bit_length() - 1 if n > 0 and n & (n - 1) == 0 else -1


def _team_log2(units: int, vec: bool) -> int:
    """log2 of the lanes per row: the fewest (up to 32) that leave each lane its units in registers."""
    need = ceil_div(units, _UNITS_PER_LANE[vec])
    return min(5, max(0, (need - 1).bit_length()))


def _rows_input(x, arg: str) -> _dtypes.InputType:
    """key or value: float32/float16/bfloat16 ``[tokens, heads, head_dim]``, head_dim contiguous."""
    t = _validate.float_input(x, arg)
    if x.ndim != 3:
        raise ValueError(f"{arg} must have 3 dimensions [tokens, heads, head_dim], got shape {x.shape}")
    if x.shape[2] > 1 and x.size and x.strides[2] != x.itemsize:
        raise ValueError(f"{arg} must have a contiguous last axis (head_dim), got strides {x.strides}")
    if x.size and (min(x.strides[:2]) < 0 or any(st % x.itemsize for st in x.strides)):
        raise ValueError(f"{arg} must have non-negative strides, multiples of its itemsize; got {x.strides}")
    return t


def _cache(c, arg: str, device: int) -> None:
    _validate.cupy_array(c, arg)
    if c.dtype != np.uint8:
        raise TypeError(f"{arg} must have dtype uint8 (FP8 bit patterns), got {c.dtype}")
    if c.ndim != 4:
        raise ValueError(f"{arg} must have 4 dimensions, got shape {c.shape}")
    _validate.c_contiguous(c, arg)
    _validate.same_device(c, arg, device, "key")


def _index_array(a, arg: str, device: int) -> None:
    """slot_mapping or block_ids: a 1-D contiguous int32/int64 CuPy array on ``device``."""
    _validate.cupy_array(a, arg)
    if a.dtype not in (np.int32, np.int64):
        raise TypeError(f"{arg} must have dtype int32 or int64, got {a.dtype}")
    if a.ndim != 1:
        raise ValueError(f"{arg} must be 1-D, got shape {a.shape}")
    if a.size > 1 and a.strides[0] != a.itemsize:
        raise ValueError(f"{arg} must be contiguous; pass cupy.ascontiguousarray({arg})")
    _validate.same_device(a, arg, device, "the cache" if arg == "block_ids" else "key")


def _scale_cache(sc, arg: str, shape, device: int) -> None:
    _validate.cupy_array(sc, arg)
    if sc.dtype != np.float32:
        raise TypeError(f"{arg} must have dtype float32, got {sc.dtype}")
    if tuple(sc.shape) != tuple(shape):
        raise ValueError(f"{arg} must have shape {tuple(shape)} (the cache's shape without head_dim), got {sc.shape}")
    _validate.c_contiguous(sc, arg)
    _validate.same_device(sc, arg, device, "key")


# ------------------------------------------------------------------ the write
def wide_applies(dynamic: bool, head_dim: int, x_aligned: bool, cache_ptrs) -> bool:
    """Whether kv_cache_write_wide can write this call: static scales, head_dim a multiple of 16 up
    to WIDE_MAX_HEAD_DIM, key and value 16-byte aligned with 16-byte token and head strides
    (``x_aligned``), and both caches 16-byte aligned (so that every cache row of head_dim bytes is)."""
    return (
        not dynamic
        and head_dim % 16 == 0
        and 0 < head_dim <= WIDE_MAX_HEAD_DIM
        and x_aligned
        and all(p % 16 == 0 for p in cache_ptrs)
    )


def write_path(applies: bool, rows: int) -> str:
    """The write path (a name of WRITE_PATHS) of a write of ``rows`` (token, head) rows:
    :data:`WRITE_PATH` where set, else the planner's ("wide" where it applies from WIDE_FROM_ROWS
    rows up); "units8" where the wide kernel does not apply. A WRITE_PATH that names no path raises
    ValueError."""
    forced = WRITE_PATH
    if forced is not None and forced not in WRITE_PATHS:
        raise ValueError(f"kv_cache.WRITE_PATH must be one of {WRITE_PATHS} or None, got {forced!r}")
    if not applies or forced == "units8" or (forced is None and rows < WIDE_FROM_ROWS):
        return "units8"
    return "wide"


class _WritePlan(NamedTuple):
    launch: object  # None: nothing to launch
    num_slots: int
    disjoint: _validate.Disjoint  # the written buffers against everything else, by address


#: quantize_kv_cache plans, per argument signature (shapes, strides, dtypes, devices, alignments,
#: static scale values, options)
_WRITE_PLANS = _plans.Plans()
#: The arrays of a write, inputs first, then the buffers it writes (_FIRST_WRITTEN on).
_NAMES = ("key", "value", "slot_mapping", "scale_k", "scale_v")
_NAMES += ("key_cache", "value_cache", "key_scale_cache", "value_scale_cache")
_FIRST_WRITTEN = 5


def _plan_write(key, value, key_cache, value_cache, slot_mapping, scale_k, scale_v, dtype, kv_layout, ksc, vsc):
    fmt = _dtypes.element_format(dtype, "dtype", allowed=_FP8)
    hnd = _checks.kv_layout_is_hnd(kv_layout)
    in_t = _rows_input(key, "key")
    device = key.data.device_id
    if _rows_input(value, "value") is not in_t:
        raise TypeError(f"value must have key's dtype {key.dtype}, got {value.dtype}")
    if value.shape != key.shape:
        raise ValueError(f"value must have key's shape {key.shape}, got {value.shape}")
    _validate.same_device(value, "value", device, "key")
    tokens, heads, head_dim = key.shape
    for c, arg in ((key_cache, "key_cache"), (value_cache, "value_cache")):
        _cache(c, arg, device)
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache must have key_cache's shape {key_cache.shape}, got {value_cache.shape}")
    blocks, block_size, c_heads, c_dim = _dims(key_cache.shape, hnd)
    if (c_heads, c_dim) != (heads, head_dim):
        raise ValueError(
            f"key_cache ({kv_layout} {key_cache.shape}) must hold {heads} heads of {head_dim} (key's), "
            f"got {c_heads} heads of {c_dim}"
        )
    _index_array(slot_mapping, "slot_mapping", device)
    if slot_mapping.size > tokens:
        raise ValueError(f"slot_mapping must have at most key's {tokens} tokens, got {slot_mapping.size}")
    sk, sv = _scales(scale_k, scale_v, heads, device)
    if sk.dynamic:
        sshape = kv_scale_cache_shape(key_cache.shape, kv_layout)
        for sc, arg in ((ksc, "key_scale_cache"), (vsc, "value_scale_cache")):
            if sc is None:
                raise ValueError(f"{arg} is needed with scale_k='dynamic': allocate it with empty_kv_scale_cache()")
            _scale_cache(sc, arg, sshape, device)
    else:
        for sc, arg in ((ksc, "key_scale_cache"), (vsc, "value_scale_cache")):
            if sc is not None:
                raise ValueError(f"{arg} is only for scale_k='dynamic' and scale_v='dynamic'")
    rows = slot_mapping.size * heads
    if rows > _MAX_ROWS:
        raise ValueError(f"slot_mapping * heads = {rows} rows is more than {_MAX_ROWS}")
    num_slots = blocks * block_size
    named = zip(_NAMES, (key, value, slot_mapping, sk.array, sv.array, key_cache, value_cache, ksc, vsc))
    disjoint = _validate.Disjoint(tuple(named), _FIRST_WRITTEN)
    if not (rows and head_dim and num_slots):
        return _WritePlan(None, num_slots, disjoint)
    item = key.itemsize
    vec = (
        head_dim % 8 == 0
        and all(
            a.data.ptr % VECTOR_BYTES == 0 and all(st % VECTOR_BYTES == 0 for st in a.strides[:2]) for a in (key, value)
        )
        and all(c.data.ptr % 8 == 0 for c in (key_cache, value_cache))
    )
    applies = wide_applies(sk.dynamic, head_dim, vec, (key_cache.data.ptr, value_cache.data.ptr))
    path = write_path(applies, rows)
    if path == "wide":
        tpr_log2 = (head_dim // 16 - 1).bit_length()  # the fewest lanes with 16 elements each
    else:
        tpr_log2 = _team_log2(head_dim // 8 if vec else head_dim, vec)
    args = np.array(
        (
            rows,
            num_slots,
            key.strides[0] // item,
            key.strides[1] // item,
            value.strides[0] // item,
            value.strides[1] // item,
            *_strides(block_size, heads, head_dim, hnd),
            *_strides(block_size, heads, 1, hnd),
            heads,
            head_dim,
            block_size,
            int(slot_mapping.dtype == np.int64),
            sk.stride,
            sv.stride,
            int(sk.dynamic),
            tpr_log2,
            _log2_or_minus1(heads),
            _log2_or_minus1(block_size),
        ),
        _WRITE_ARGS,
    )[()]
    with _validate.on_device_of(key):
        if path == "wide":
            k = _jit.kernel(device, FAMILY, "kv_cache_write_wide", in_t.ctype, fmt.ctag)
        else:
            k = _jit.kernel(device, FAMILY, "kv_cache_write", in_t.ctype, fmt.ctag, vec)
    grid = (ceil_div(rows, _BLOCK >> tpr_log2), 2)
    # key, value, the caches, slot_mapping, the device scales (or null) and the values, the scale caches
    launch = Launch(k, grid, (_BLOCK,), (ARG,) * 7 + (sk.value, sv.value, ARG, ARG, args), pdl=_device.caps(device).pdl)
    return _WritePlan(launch, num_slots, disjoint)


def _check_slots(slot_mapping, num_slots: int) -> None:
    """Copy slot_mapping to the host; ValueError naming it for a slot past the cache or repeated."""
    s = slot_mapping.get().astype(np.int64)
    bad = np.flatnonzero(s >= num_slots)
    if bad.size:
        t = int(bad[0])
        raise ValueError(f"slot_mapping[{t}] = {int(s[t])} is past the cache's {num_slots} slots")
    used = s[s >= 0]
    vals, first, counts = np.unique(used, return_index=True, return_counts=True)
    if (counts > 1).any():
        v = int(vals[np.argmax(counts > 1)])
        t = np.flatnonzero(s == v)
        raise ValueError(f"slot_mapping repeats slot {v} (tokens {int(t[0])} and {int(t[1])})")


def quantize_kv_cache(
    key: cupy.ndarray,
    value: cupy.ndarray,
    key_cache: cupy.ndarray,
    value_cache: cupy.ndarray,
    slot_mapping: cupy.ndarray,
    *,
    scale_k: float | cupy.ndarray | str,
    scale_v: float | cupy.ndarray | str,
    dtype: str | type | np.dtype = "float8_e4m3fn",
    kv_layout: str = "NHD",
    key_scale_cache: cupy.ndarray | None = None,
    value_scale_cache: cupy.ndarray | None = None,
    check_slots: bool = False,
) -> None:
    """Quantize one step's keys and values to FP8 and write them into a paged cache, in place.

    Parameters
    ----------
    key, value : cupy.ndarray
        float32, float16 or bfloat16 ``[tokens, heads, head_dim]``, the same shape and dtype;
        head_dim contiguous, the token and head axes may be strided (views of a fused qkv).
    key_cache, value_cache : cupy.ndarray
        uint8 (FP8 bit patterns), C-contiguous, ``[blocks, block_size, heads, head_dim]`` for
        ``kv_layout="NHD"`` or ``[blocks, heads, block_size, head_dim]`` for ``"HND"``; written in
        place at the given slots only.
    slot_mapping : cupy.ndarray
        int32 or int64, 1-D, contiguous, ``n <= tokens`` entries: token ``t < n`` goes to slot
        ``slot_mapping[t] = block * block_size + offset``; tokens from ``n`` on are not written (a
        key padded for a CUDA graph, as in vLLM). A negative slot is skipped (vLLM's padding slot
        -1); so is a slot ``>= blocks * block_size`` (never an out-of-bounds write).
    scale_k, scale_v : float, cupy.ndarray or "dynamic"
        Decode scales (``x ~ float(q) * s``): a positive finite Python float, or a float32 CuPy
        array of shape (1,) (per tensor) or (heads,) (per head), read on the device. ``"dynamic"``
        (both, or neither): one scale per token and head, written to the scale caches.
    dtype : str or ml_dtypes type
        ``"float8_e4m3fn"`` (default) or ``"float8_e5m2"``.
    kv_layout : str
        ``"NHD"`` (default) or ``"HND"``.
    key_scale_cache, value_scale_cache : cupy.ndarray, optional
        Dynamic scales only (required there): float32, C-contiguous, the cache's shape without
        head_dim (``[blocks, block_size, heads]`` for "NHD", ``[blocks, heads, block_size]`` for
        "HND"; :func:`empty_kv_scale_cache`); written at the same slots.
    check_slots : bool
        Copy ``slot_mapping`` to the host (a synchronization) and raise on a slot past the cache or
        one used twice, before any launch. Off by default: then nothing synchronizes and the call
        can be captured in a CUDA graph.

    Raises
    ------
    TypeError
        An argument is not a CuPy array of the right dtype, or a scale is of no accepted type.
    ValueError
        Shapes, layouts, devices or options that do not fit together, a non-contiguous cache, an
        unsupported ``dtype`` or ``kv_layout``, a float scale not positive and finite, dynamic and
        static scales mixed, missing (dynamic) or extra (static) scale caches, written buffers
        overlapping each other or an input; with ``check_slots``, a bad ``slot_mapping``. Raised
        before any launch, with every buffer untouched.

    Notes
    -----
    For each written (token, head) row ``x`` of head_dim elements, every step IEEE float32:

    - static: ``q = cvt_rn_satfinite(x / s)``, ``s`` the scale of the head; NaN gives the
      canonical NaN 0x7f, overflow and inf saturate to +-max (vLLM ``scaled_fp8_conversion``).
    - dynamic: ``amax = max|x|`` (NaN ignored), ``s = fmaxf(amax / qmax, 1 / (qmax * 512))``
      (vLLM's per-token FP8 rule; qmax 448 or 57344), ``q = cvt_rn_satfinite(fminf(x / s, qmax))``
      (a NaN element becomes +qmax); ``s`` is stored in the scale cache.

    One kernel launch writes keys and values; nothing is allocated. With slots repeated (not checked
    unless ``check_slots``), which token's bytes land at a repeated slot is unspecified.
    """
    if not isinstance(check_slots, (bool, np.bool_)):
        raise TypeError(f"check_slots must be a bool, got {type(check_slots).__name__}")
    ksc, vsc = key_scale_cache, value_scale_cache
    k = _validate.array_key
    key_ = (k(key), k(value), k(slot_mapping), k(key_cache), k(value_cache), k(ksc), k(vsc))
    key_ += (_validate.scale_key(scale_k), _validate.scale_key(scale_v), dtype, kv_layout, WRITE_PATH)
    plan = _WRITE_PLANS.lookup(key_)
    if plan is None:
        plan = _WRITE_PLANS.keep(
            key_,
            _plan_write(key, value, key_cache, value_cache, slot_mapping, scale_k, scale_v, dtype, kv_layout, ksc, vsc),
        )
    # per call (the plan checked the rest): the buffers' addresses
    sk = scale_k if type(scale_k) is cupy.ndarray else None
    sv = scale_v if type(scale_v) is cupy.ndarray else None
    arrays = (key, value, slot_mapping, sk, sv, key_cache, value_cache, ksc, vsc)
    plan.disjoint.check(tuple(0 if a is None else a.data.ptr for a in arrays))
    if check_slots:
        _check_slots(slot_mapping, plan.num_slots)
    if plan.launch is None:
        return
    with _validate.on_device_of(key):
        plan.launch(key, value, key_cache, value_cache, slot_mapping, sk, sv, ksc, vsc)


def _ptr(a) -> int:
    return 0 if a is None else a.data.ptr


# ------------------------------------------------------------------ the read
def dequantize_kv_cache(
    cache: cupy.ndarray,
    block_ids: cupy.ndarray,
    *,
    scale: float | cupy.ndarray | str,
    kv_layout: str = "NHD",
    out_dtype: str | type | np.dtype = "bfloat16",
    cache_dtype: str | type | np.dtype = "float8_e4m3fn",
    scale_cache: cupy.ndarray | None = None,
    out: cupy.ndarray | None = None,
) -> cupy.ndarray:
    """Dequantize whole blocks of an FP8 paged cache (the read that goes with
    :func:`quantize_kv_cache`).

    Parameters
    ----------
    cache : cupy.ndarray
        uint8, C-contiguous, ``[blocks, block_size, heads, head_dim]`` ("NHD") or
        ``[blocks, heads, block_size, head_dim]`` ("HND").
    block_ids : cupy.ndarray
        int32 or int64, 1-D, contiguous: the ``n`` blocks to read, in order. An id outside
        ``[0, blocks)`` gives a block of NaNs (no host check, no out-of-bounds read).
    scale : float, cupy.ndarray or "dynamic"
        As ``scale_k`` of :func:`quantize_kv_cache`: a positive float, a float32 array of shape (1,)
        or (heads,), or ``"dynamic"`` with ``scale_cache``.
    kv_layout : str
        ``"NHD"`` (default) or ``"HND"``.
    out_dtype : str or numpy dtype
        The output dtype: float32, float16 or bfloat16 (default).
    cache_dtype : str or ml_dtypes type
        The cache's FP8 format, ``"float8_e4m3fn"`` (default) or ``"float8_e5m2"``.
    scale_cache : cupy.ndarray, optional
        float32 ``[blocks, block_size, heads]`` ("NHD") or ``[blocks, heads, block_size]`` ("HND"),
        with ``scale="dynamic"`` only.
    out : cupy.ndarray, optional
        A C-contiguous buffer of the result's shape and ``out_dtype``.

    Returns
    -------
    cupy.ndarray
        ``[n, block_size, heads, head_dim]`` ("NHD") or ``[n, heads, block_size, head_dim]`` ("HND")
        in ``out_dtype``.

    Raises
    ------
    TypeError, ValueError
        Bad arguments, named, before any launch.

    Notes
    -----
    ``y = round_rn(float(q) * s)``, the product in IEEE float32, then to ``out_dtype`` (NaN as CUDA's
    canonical NaN); ``s`` the scale of the element's head, or its row's scale-cache entry.
    """
    k = _validate.array_key
    key = (k(cache), k(block_ids), _validate.scale_key(scale), kv_layout, out_dtype, cache_dtype, k(scale_cache))
    key += (k(out),)
    plan = _READ_PLANS.lookup(key)
    if plan is None:
        plan = _READ_PLANS.keep(
            key, _ReadPlan(cache, block_ids, scale, kv_layout, out_dtype, cache_dtype, scale_cache, out)
        )
    sc = scale if type(scale) is cupy.ndarray else None
    if out is not None:
        plan.disjoint.check((cache.data.ptr, block_ids.data.ptr, _ptr(sc), _ptr(scale_cache), out.data.ptr))
    with _validate.on_device_of(cache):
        y = cupy.empty(plan.shape, dtype=plan.out_dtype) if out is None else out
        if plan.launch is not None:
            plan.launch(cache, block_ids, y, sc, scale_cache)
    return y


#: dequantize_kv_cache plans, per argument signature
_READ_PLANS = _plans.Plans()


class _ReadPlan:
    """A checked dequantize_kv_cache call: the output's shape and dtype, the launch (None: nothing to
    launch; arguments the cache, block_ids, y, the device scale or null, the scale cache or null),
    and the overlap check of ``out``."""

    __slots__ = ("shape", "out_dtype", "launch", "disjoint")

    def __init__(self, cache, block_ids, scale, kv_layout, out_dtype, cache_dtype, scale_cache, out):
        fmt = _dtypes.element_format(cache_dtype, "cache_dtype", allowed=_FP8)
        out_t = _dtypes.input_type(out_dtype, "out_dtype")
        hnd = _checks.kv_layout_is_hnd(kv_layout)
        _validate.cupy_array(cache, "cache")
        device = cache.data.device_id
        _cache(cache, "cache", device)
        blocks, block_size, heads, head_dim = _dims(cache.shape, hnd)
        _index_array(block_ids, "block_ids", device)
        sc = _scale(scale, "scale", heads, device, "cache")
        if sc.dynamic:
            if scale_cache is None:
                raise ValueError("scale_cache is needed with scale='dynamic'")
            _scale_cache(scale_cache, "scale_cache", cache.shape[:3], device)
        elif scale_cache is not None:
            raise ValueError("scale_cache is only for scale='dynamic'")
        n = block_ids.size
        self.shape = (n,) + tuple(cache.shape[1:])
        self.out_dtype = out_t.dtype
        inputs = (("cache", cache), ("block_ids", block_ids), ("scale", sc.array), ("scale_cache", scale_cache))
        if out is not None:
            _validate.out_array(out, "out", self.shape, out_t.dtype, device, inputs=inputs)
        self.disjoint = _validate.Disjoint(inputs + (("out", out),), 4)
        rows_per_block = block_size * heads
        rows = n * rows_per_block
        if rows > _MAX_ROWS:
            raise ValueError(f"block_ids selects {rows} rows, more than {_MAX_ROWS}")
        self.launch = None
        if not (rows and head_dim):
            return
        y_aligned = out is None or out.data.ptr % VECTOR_BYTES == 0
        vec = head_dim % 8 == 0 and cache.data.ptr % 8 == 0 and y_aligned
        tpr_log2 = _team_log2(head_dim // 8 if vec else head_dim, vec)
        args = np.array(
            (rows, blocks, rows_per_block, heads, head_dim, block_size, int(hnd), int(block_ids.dtype == np.int64),
             sc.stride, int(sc.dynamic), tpr_log2, 0),
            _READ_ARGS,
        )[()]  # fmt: skip
        k = _jit.kernel(device, FAMILY, "kv_cache_dequantize", out_t.ctype, fmt.ctag, vec)
        grid = (ceil_div(rows, _BLOCK >> tpr_log2),)
        self.launch = Launch(
            k, grid, (_BLOCK,), (ARG, ARG, ARG, ARG, sc.value, ARG, args), pdl=_device.caps(device).pdl
        )
