"""Per-token and per-group FP8/INT8 quantization (vLLM's activation path), the fused SiLU*Mul +
group quantization, and their dequantization.

Kernels: ``kernels/groupwise.cu``. Reference: :func:`cupyquant.reference.quantize_groupwise`,
:func:`cupyquant.reference.silu_mul_quantize`, :func:`cupyquant.reference.dequantize_groupwise`.

Scale layouts (``scale_layout``), for ``x`` of shape ``(*B, M, K)`` with ``NG = K // group_size``
scales per token (1 per token when ``group_size`` is None):

- ``"row"``: a C-contiguous array ``(*B, M, NG)``.
- ``"col"``: the transposed, column-major layout DeepGEMM's FP8 GEMMs read through TMA. Each batch
  is a row-major ``(NG, M_pad)`` block with ``M_pad = round_up(M, 4)`` (so that every column starts
  16-byte aligned), batches one after another. The returned array is the ``(*B, M, NG)`` view of
  that buffer: strides ``(..., NG * M_pad * 4, 4, M_pad * 4)`` bytes, so the scale of token m,
  group g of batch b is float ``b * NG * M_pad + g * M_pad + m`` of ``scale.data``. The padding
  rows ``M..M_pad`` are written with zeros. A 1-D ``x`` is one token (M = 1).
- Zero points (``symmetric=False``, per-token INT8): int32, exactly the shape and strides of the
  scales in either layout (the same word offsets, padding zero), in an array of their own.
- ``scale_dtype="float8_e8m0fnu"`` (implies ``scale_pow2``): UE8M0 exponent bytes packed four per
  int32 along the groups, group ``4p + j`` in byte j (least significant first) of word p, the unused
  bytes of a row's last word zero; the array is int32 ``(*B, M, ceil(NG / 4))`` in the layout above
  (``"col"`` is DeepGEMM's SM100 layout). ``QuantizedTensor.to_host()`` unpacks it.

:func:`empty_scales` allocates exactly these layouts, for ``scale_out=``; its float32 array viewed
as int32 (``.view(cupy.int32)``) is a ``zero_point_out=`` buffer.
"""

from __future__ import annotations

import math

import cupy
import numpy as np

from . import _checks, _device, _dtypes, _flat, _group_plan, _jit, _plans, _scales, _validate
from ._launch import ARG, Launch
from ._sizes import MAX_GRID_YZ, VECTOR_BYTES, ceil_div
from .quantized import QuantizedTensor, Scheme, register_dequantizer

_BOOLS = (False, True)

# The planner (cupyquant/_group_plan.py) takes its override knobs as arguments; they live here,
# where _quantize reads them at every call.
#: The per-token kernels TOKEN_PATH names: "few" (token_quantize_few) and "regs"
#: (token_quantize_regs, or the two-pass token_quantize).
TOKEN_PATHS = _group_plan.TOKEN_PATHS
#: Internal override of the per-token planner, for tests and A/B timing: a name of TOKEN_PATHS
#: ("few" wherever the row fits, whatever the number of rows), or None (the planner's choice).
#: Read at every call and part of the plan's key, so it may change between calls.
TOKEN_PATH: str | None = None
#: Internal override of token_quantize_few's units a thread: one of _group_plan._FEW_UNITS (used
#: where the row fits), or None (the fewest that hold the row).
TOKEN_FEW_UNITS: int | None = None
#: The SiLU*Mul paths SILU_PATH names: "per_element" and "batched" (the same bytes).
SILU_PATHS = _group_plan.SILU_PATHS
#: Internal override of the SiLU*Mul planner, for tests and A/B timing: a name of SILU_PATHS, or None
#: (the planner's choice, _group_plan._silu_batched). Read at every call and part of the plan's key.
SILU_PATH: str | None = None

#: The per-group quantizer's geometries for "col" scales (kernels/groupwise.cu): "wide"
#: (group_quantize, grid2d: a warp along a row, its 32 / tpg scales M_pad words apart, stored by
#: store_scale after the codes) and "tall" (group_quantize_tall, _tall_grid: a warp down 32 / tpg
#: rows of one group, its scales one contiguous run, stored by store_col_scale with 32-bit offsets).
#: The same bytes; "row" scales always take "wide".
GROUP_COL_PATHS = ("wide", "tall")
#: The planner takes "tall" for "col" scales from this many rows up, "wide" below. On the H200
#: (bf16, group-128, 16-16384 rows of 2048-16384) "tall" takes 0.80-0.95x the time of "wide" in
#: every cell, for float32 and UE8M0 scales alike, which brings "col" scales to 0.95-1.10x the time
#: of "row" ones (83-92% of copy from 64 MB up); at one row (K 4096 and 7168) it takes 1.46-1.47 us
#: against 1.4, a warp of one group holding a single row.
GROUP_COL_TALL_FROM_ROWS = 16
#: Internal override of the "col" planner, for tests and A/B timing: a name of GROUP_COL_PATHS
#: ("tall" wherever _tall_grid fits), or None (the planner's choice). Read at every call and part
#: of the plan's key.
GROUP_COL_PATH: str | None = None


def _group_col_path(rows: int, path: str | None = None) -> str:
    """The geometry of the per-group quantizer with "col" scales for ``rows`` rows: ``path`` if
    given (a name of GROUP_COL_PATHS), else "tall" from GROUP_COL_TALL_FROM_ROWS rows up, "wide"
    below."""
    if path not in (None, *GROUP_COL_PATHS):
        raise ValueError(f"groupwise.GROUP_COL_PATH must be one of {GROUP_COL_PATHS} or None, got {path!r}")
    if path is None:
        return "tall" if rows >= GROUP_COL_TALL_FROM_ROWS else "wide"
    return path


def _tall_grid(rows: int, n_groups: int, tpg: int, threads: int, words: int):
    """(grid, block) of group_quantize_tall over ``rows`` rows of ``n_groups`` groups of ``tpg``
    16-element pieces, ``threads`` a block, with a scale buffer of ``words`` 4-byte words; None where
    it does not fit (rows or words from 2^31: the kernel's scale offsets are 32-bit; more than
    MAX_GRID_YZ blocks of rows). blockDim (tpg, threads / tpg): one group of threads / tpg rows a
    block, blockIdx.x the group, blockIdx.y the block of rows."""
    by = threads // tpg
    row_blocks = ceil_div(rows, by)
    if rows >= 1 << 31 or words >= 1 << 31 or row_blocks > MAX_GRID_YZ:
        return None
    return (n_groups, row_blocks), (tpg, by)


_FLAT_PIECES = tuple(sorted(set(_flat.PIECES.values())))
_Q8_TAGS = tuple(_dtypes.element_format(n).ctag for n in _dtypes.FP8_NAMES + ("int8",))
FAMILY = _jit.register(
    "groupwise",
    _jit.product("group_quantize", _dtypes.INPUT_CTYPES, _Q8_TAGS, _BOOLS, _BOOLS)
    + _jit.product("group_quantize_tall", _dtypes.INPUT_CTYPES, _Q8_TAGS, _BOOLS, _BOOLS)
    + [
        _jit.expr("token_quantize_regs", t.ctype, f, w)
        for t in _dtypes.INPUT_TYPES
        for f in _Q8_TAGS
        for w in _group_plan._TOKEN_WARPS
    ]
    + _jit.product("token_quantize_few", _dtypes.INPUT_CTYPES, _Q8_TAGS, _group_plan._FEW_UNITS)
    + _jit.product("token_quantize", _dtypes.INPUT_CTYPES, _Q8_TAGS, _BOOLS)
    + _jit.product("silu_mul_quantize", _dtypes.INPUT_CTYPES, _Q8_TAGS, _BOOLS, _BOOLS)
    + _jit.product("silu_mul_intermediate", _dtypes.INPUT_CTYPES)
    + _jit.product("group_dequantize", _dtypes.INPUT_CTYPES, _Q8_TAGS, _BOOLS)
    + _jit.product("group_dequantize_flat", _dtypes.INPUT_CTYPES, _Q8_TAGS, _FLAT_PIECES, _BOOLS)
    # asymmetric per-token INT8 (zero points)
    + _jit.product("token_quantize_azp_regs", _dtypes.INPUT_CTYPES, _group_plan._TOKEN_WARPS)
    + _jit.product("token_quantize_azp", _dtypes.INPUT_CTYPES, _BOOLS)
    + _jit.product("token_dequantize_azp", _dtypes.INPUT_CTYPES, _BOOLS),
)
_FORMATS = _checks.GROUPWISE_FORMATS


def empty_scales(
    shape: tuple[int, ...],
    group_size: int | None = 128,
    scale_layout: str = "row",
    scale_dtype: str | type | np.dtype = "float32",
) -> cupy.ndarray:
    """Allocate a scale array in the exact layout :func:`quantize_groupwise` writes.

    Parameters
    ----------
    shape : tuple of int
        The shape of the quantized tensor (``x.shape``, or the output shape of
        :func:`silu_mul_quantize`).
    group_size : int or None
    scale_layout : {"row", "col"}
        The scales' layout, as for :func:`quantize_groupwise`.
    scale_dtype : {"float32", "float8_e8m0fnu"}

    Returns
    -------
    cupy.ndarray
        float32 ``(..., NG)`` or, for UE8M0, int32 ``(..., ceil(NG / 4))``, with the layout's strides
        (see the module docstring); its allocation covers the padding.

    Raises
    ------
    TypeError
        ``shape`` is not a tuple of integers.
    ValueError
        An empty ``shape`` or a negative dimension; an unsupported ``group_size``,
        ``scale_layout`` or ``scale_dtype``; a group size that does not divide ``shape[-1]``.
    """
    key = (shape, tuple(map(type, shape)) if type(shape) is tuple else [], group_size, type(group_size))
    key += (scale_layout, scale_dtype)
    plan = _EMPTY_SCALES.lookup(key)
    if plan is None:
        shape = _checks.shape_tuple(shape)
        if not shape:
            raise ValueError("shape must have at least one dimension")
        packed = _scales.group_scale_packed(scale_layout, scale_dtype)
        lay = _scales.group_layout(shape, _checks.group_count(shape[-1], group_size), scale_layout, packed)
        plan = _EMPTY_SCALES.keep(key, (lay, np.dtype(np.int32 if packed else np.float32)))
    lay, dtype = plan
    return lay.empty(dtype)


#: empty_scales' layouts, per argument signature
_EMPTY_SCALES = _plans.Plans()


def scheme(fmt_name: str, group_size, K: int, packed: bool, scale_layout: str) -> Scheme:
    """The Scheme of per-token (``group_size`` None) or per-group scales of rows of K elements."""
    return Scheme(
        fmt_name,
        "token" if group_size is None else "group",
        (K if group_size is None else group_size,),
        "float8_e8m0fnu" if packed else "float32",
        scale_layout,
        FAMILY,
    )


class _Plan:
    """A checked quantizer call (quantize_groupwise or silu_mul_quantize) for one argument signature:
    its launch (None when there is nothing to launch; arguments x, q, the scales, the zero points
    with ``azp``, then a device ``scale_ub``), the outputs' shape, dtype, scale layout and scheme,
    and the checks of caller buffers that depend on their addresses."""

    __slots__ = ("launch", "q_shape", "q_dtype", "lay", "s_dtype", "scheme", "azp", "disjoint", "s_given", "z_given")

    def __init__(
        self,
        x,
        dtype,
        group_size,
        scale_layout,
        scale_pow2,
        scale_dtype,
        scale_ub,
        out,
        scale_out,
        silu,
        symmetric,
        zp_out,
        token_path=None,
        few_units=None,
        silu_path=None,
        col_path=None,
    ):
        if silu:
            if isinstance(x, cupy.ndarray) and x.ndim:
                _checks.gate_up_width(x.shape[-1])
            _checks.not_per_token(group_size, "silu_mul_quantize")
        fmt = _dtypes.element_format(dtype, "dtype", allowed=_FORMATS)
        in_t = _validate.float_input(x, "x")
        packed = _scales.group_scale_packed(scale_layout, scale_dtype)
        azp = _checks.asymmetric_int8(symmetric, fmt.name, group_size, scale_pow2, packed, scale_ub, zp_out)
        rows, K, row_stride = _validate.rows_view(x, "x")
        out_shape = x.shape[:-1] + (K // 2,) if silu else x.shape
        K_out = out_shape[-1]
        n_groups = _checks.group_count(K_out, group_size)
        device = x.data.device_id
        bound = _scales.scale_bound(scale_ub, device)
        lay = _scales.group_layout(out_shape, n_groups, scale_layout, packed)
        q_dtype = np.int8 if fmt.name == "int8" else np.uint8
        s_dtype = np.int32 if packed else np.float32
        if out is not None:
            _validate.out_array(out, "out", out_shape, q_dtype, device, inputs=(("x", x),))
        if scale_out is not None:
            _scales.check_group_scale_out(scale_out, lay, s_dtype, device, inputs=(("out", out), ("x", x)))
        if zp_out is not None:
            _scales.check_group_scale_out(
                zp_out,
                lay,
                np.int32,
                device,
                inputs=(("out", out), ("x", x), ("scale_out", scale_out)),
                arg="zero_point_out",
                alloc="cupyquant.empty_scales(x.shape, None, scale_layout).view(cupy.int32)",
            )
        ub = scale_ub if isinstance(scale_ub, cupy.ndarray) else None
        self.disjoint = _validate.Disjoint(
            (
                ("x", x),
                ("scale_ub", ub),
                ("out", out),
                ("scale_out", scale_out, lay.words * 4),
                ("zero_point_out", zp_out, lay.words * 4),
            ),
            2,
        )
        self.s_given, self.z_given = scale_out is not None, zp_out is not None
        sa = _scales.group_scale_args(lay, n_groups, packed, (bool(scale_pow2) or packed) and not silu, bound)
        self.scheme = scheme(fmt.name, group_size, K_out, packed, scale_layout)
        self.q_shape, self.q_dtype, self.lay, self.s_dtype, self.azp = out_shape, q_dtype, lay, s_dtype, azp
        aligned = (
            x.data.ptr % VECTOR_BYTES == 0
            and (row_stride * x.itemsize) % VECTOR_BYTES == 0
            and (out is None or out.data.ptr % VECTOR_BYTES == 0)
        )
        kernel, grid, block, mid = None, (), (), ()
        if silu and rows and K_out:
            vec = aligned and (K_out * x.itemsize) % VECTOR_BYTES == 0
            batched = _group_plan._silu_batched(rows, silu_path)
            kernel = _jit.kernel(device, FAMILY, "silu_mul_quantize", in_t.ctype, fmt.ctag, vec, batched)
            units = K_out // 16
            grid, block = _group_plan.grid2d(
                rows, units, _group_plan.quantize_threads(rows, units, _device.sm_count(device))
            )
            mid = (np.int64(rows), np.int32(K_out), np.int32(group_size))
        elif not silu and rows and (K or group_size is None):
            # per token, an empty row (K = 0) still gets its one scale, that of an all-zero row
            vec = aligned and K % 8 == 0
            few = _group_plan._token_few(K, rows, token_path, few_units) if group_size is None and not azp else None
            team = _group_plan._token_team(K, x.itemsize, rows) if vec and group_size is None else None
            # the asymmetric kernels take the same launch as the symmetric ones (no format argument)
            targs = (in_t.ctype,) if azp else (in_t.ctype, fmt.ctag)
            if few is not None:
                units, threads = few
                kernel = _jit.kernel(device, FAMILY, "token_quantize_few", *targs, units)
                grid, block, mid = (rows,), (threads,), (np.int32(K), np.int32(vec))
            elif team is not None:
                name = "token_quantize_azp_regs" if azp else "token_quantize_regs"
                kernel = _jit.kernel(device, FAMILY, name, *targs, team)
                block = (max(_group_plan._TOKEN_BLOCK, 32 * team),)
                grid = (ceil_div(rows, block[0] // (32 * team)),)
                mid = (np.int64(rows), np.int32(K))
            elif group_size is None:
                name = "token_quantize_azp" if azp else "token_quantize"
                kernel = _jit.kernel(device, FAMILY, name, *targs, vec)
                grid, block, mid = (rows,), (_group_plan._TOKEN_BLOCK,), (np.int32(K),)
            else:
                units = K // 16
                threads = _group_plan.quantize_threads(rows, units, _device.sm_count(device))
                tall = None
                if _group_col_path(rows, col_path) == "tall" and scale_layout == "col":
                    tall = _tall_grid(rows, n_groups, group_size // 16, threads, lay.words)
                if tall is not None:
                    kernel = _jit.kernel(device, FAMILY, "group_quantize_tall", in_t.ctype, fmt.ctag, vec, packed)
                    grid, block = tall
                else:
                    kernel = _jit.kernel(device, FAMILY, "group_quantize", in_t.ctype, fmt.ctag, vec, packed)
                    grid, block = _group_plan.grid2d(rows, units, threads)
                mid = (np.int64(rows), np.int32(K), np.int32(group_size))
        self.launch = None
        if kernel is not None:
            args = (ARG, np.int64(row_stride), ARG, *mid, sa, ARG) + ((ARG,) if azp else ())
            fields = ((len(mid) + 3, "ub_ptr"),) if ub is not None else ()
            self.launch = Launch(kernel, grid, block, args, pdl=_device.caps(device).pdl, fields=fields)


#: Plans of quantizer calls, per argument signature (_quantize's key).
_PLANS = _plans.Plans()


def _quantize(
    silu, x, dtype, group_size, scale_layout, scale_pow2, scale_dtype, scale_ub, out, scale_out, symmetric, zp_out
):
    """The body of both quantizers: the plan (memoized per signature: the group size and
    ``symmetric`` with their types, since 128.0 == 128 is a different, refused argument), the
    checks that depend on caller buffers' addresses, the outputs a caller did not give, one
    launch."""
    key = (
        silu, _validate.array_key(x), dtype, group_size, type(group_size), scale_layout, scale_pow2, scale_dtype,
        _validate.scale_key(scale_ub), symmetric, type(symmetric), _validate.array_key(out),
        _validate.array_key(scale_out), _validate.array_key(zp_out), TOKEN_PATH, TOKEN_FEW_UNITS, SILU_PATH,
        GROUP_COL_PATH,
    )  # fmt: skip
    plan = _PLANS.lookup(key)
    if plan is None:
        plan = _PLANS.keep(
            key,
            _Plan(
                x, dtype, group_size, scale_layout, scale_pow2, scale_dtype, scale_ub, out, scale_out, silu, symmetric,
                zp_out, TOKEN_PATH, TOKEN_FEW_UNITS, SILU_PATH, GROUP_COL_PATH,
            ),
        )  # fmt: skip
    ub = scale_ub if type(scale_ub) is cupy.ndarray else None
    if out is not None or scale_out is not None or zp_out is not None:
        _check_given(plan, x, ub, out, scale_out, zp_out)
    with _validate.on_device_of(x):
        q = cupy.empty(plan.q_shape, dtype=plan.q_dtype) if out is None else out
        s = plan.lay.empty(plan.s_dtype) if scale_out is None else scale_out
        zp = None
        if plan.azp:
            zp = plan.lay.empty(np.int32) if zp_out is None else zp_out
        if plan.launch is not None:
            if plan.azp:
                plan.launch(x, q, s, zp)
            elif ub is not None:
                plan.launch(x, q, s, ub)
            else:
                plan.launch(x, q, s)
    return QuantizedTensor(q, s, plan.scheme, plan.q_shape, x.dtype, zero_point=zp)


def _check_given(plan: _Plan, x, ub, out, scale_out, zp_out) -> None:
    """The checks of caller buffers that depend on their addresses: overlaps, and a padded scale
    layout's allocation covering its padding."""
    ptrs = [x.data.ptr, 0 if ub is None else ub.data.ptr]
    ptrs += [0 if a is None else a.data.ptr for a in (out, scale_out, zp_out)]
    plan.disjoint.check(ptrs)
    for a, arg in ((scale_out, "scale_out"), (zp_out, "zero_point_out")):
        if a is not None:
            mem = a.data.mem
            if a.data.ptr - mem.ptr + plan.lay.words * 4 > mem.size:
                raise ValueError(f"{arg} must start 16-byte aligned in an allocation that covers the layout's padding")


def quantize_groupwise(
    x: cupy.ndarray,
    dtype: str | type | np.dtype = "float8_e4m3fn",
    *,
    group_size: int | None = 128,
    scale_layout: str = "row",
    scale_pow2: bool = False,
    scale_dtype: str | type | np.dtype = "float32",
    scale_ub: float | cupy.ndarray | None = None,
    symmetric: bool = True,
    out: cupy.ndarray | None = None,
    scale_out: cupy.ndarray | None = None,
    zero_point_out: cupy.ndarray | None = None,
) -> QuantizedTensor:
    """Quantize along the last axis with one scale per group of ``group_size`` elements, or per token.

    Parameters
    ----------
    x : cupy.ndarray
        float32, float16 or bfloat16, any leading dimensions, contiguous last axis (leading axes
        may be strided if they collapse into one row stride).
    dtype : {"float8_e4m3fn", "float8_e5m2", "int8"}
    group_size : {32, 64, 128, 256} or None
        None gives one scale per token (row), for any K; otherwise it must divide K.
    scale_layout : {"row", "col"}
        See the module docstring for the exact strides of "col" (DeepGEMM's layout).
    scale_pow2 : bool
        Round scales up to powers of two (UE8M0) by the exponent-bit rule.
    scale_dtype : {"float32", "float8_e8m0fnu"}
        "float8_e8m0fnu" packs UE8M0 exponents four per int32 (implies ``scale_pow2``).
    scale_ub : float or cupy.ndarray, optional
        Upper bound of a group's (or token's) amax, as in vLLM's per-token ``scale_ub``: the amax is
        clamped to it before the scale is derived, so the decode scale is at most about
        ``scale_ub / qmax``. A positive float or a one-element float32 device array.
    symmetric : bool
        False: asymmetric INT8 with one scale and one int32 zero point per token (vLLM's
        ``dynamic_scaled_int8_azp_quant``), ``x ~ (q - zero_point) * scale``. Only with
        ``dtype="int8"``, ``group_size=None``, float32 scales, no ``scale_pow2`` or ``scale_ub``.
    out : cupy.ndarray, optional
        uint8 (FP8) or int8 buffer of ``x.shape``.
    scale_out : cupy.ndarray, optional
        A scale array from :func:`empty_scales` with the same arguments.
    zero_point_out : cupy.ndarray, optional
        With ``symmetric=False``: an int32 buffer in the scales' layout,
        ``empty_scales(x.shape, None, scale_layout).view(cupy.int32)``.

    Returns
    -------
    QuantizedTensor
        ``data`` in ``x.shape``; ``scale`` the *decode* scales in the chosen layout
        (``x ~ q * scale``). With ``symmetric=False``, ``zero_point``: int32 of the scales' exact
        shape and strides (``x ~ (q - zero_point) * scale``).

    Raises
    ------
    TypeError
        ``x`` is not a CuPy array of a supported dtype; ``out``/``scale_out``/``zero_point_out`` or a
        device ``scale_ub`` has the wrong dtype; ``symmetric`` is not a bool.
    ValueError
        Unsupported ``dtype``, ``group_size``, ``scale_layout`` or ``scale_dtype``; a group size that
        does not divide K; a last axis that is not contiguous; ``out``/``scale_out``/``zero_point_out``
        of the wrong shape, strides or device, or overlapping ``x`` or each other; a bad ``scale_ub``;
        with ``symmetric=False``, a ``dtype`` other than int8, a ``group_size``, ``scale_pow2``, a UE8M0
        ``scale_dtype`` or a ``scale_ub``; ``zero_point_out`` with ``symmetric=True``.

    Notes
    -----
    vLLM's formulas, in IEEE float32 (:func:`cupyquant.reference.quantize_groupwise` has them in
    full). Per group: ``amax = fmaxf(1e-10, max|x|)``, ``s = amax / qmax``,
    ``q = cvt(fminf(fmaxf(x / s, qmin), qmax))``. Per token FP8: ``s = fmaxf(amax / qmax,
    1 / (qmax * 512))``; per token INT8: ``s = amax / 127``, ``q = rne(x * (127 / amax))``. INT8
    rounds half to even everywhere (vLLM's per-group INT8 truncates).

    Asymmetric per-token INT8 (``symmetric=False``), vLLM ``dynamic_scaled_int8_azp_quant``: with
    ``lo``, ``hi`` the row's min and max (NaN ignored), ``s = (hi - lo) / 255``,
    ``z = int32(rne(-128 - lo / s))`` (saturating, NaN to 0),
    ``q = sat_int8(int32(rne(x * (1 / s))) + z)`` (the int32 sum wrapping); where ``s`` is 0 (a
    row of equal values, or an empty or all-NaN row) ``s = max(|lo|, |hi|)``, ``z = 0`` and
    ``q = rne_sat(x / s)``, so that a constant row dequantizes exactly.
    :func:`cupyquant.reference.quantize_groupwise` states every corner. One kernel launch, no host
    synchronization.
    """
    return _quantize(
        False,
        x,
        dtype,
        group_size,
        scale_layout,
        scale_pow2,
        scale_dtype,
        scale_ub,
        out,
        scale_out,
        symmetric,
        zero_point_out,
    )


def silu_mul_quantize(
    x: cupy.ndarray,
    dtype: str | type | np.dtype = "float8_e4m3fn",
    *,
    group_size: int = 128,
    scale_layout: str = "row",
    scale_ub: float | cupy.ndarray | None = None,
    out: cupy.ndarray | None = None,
    scale_out: cupy.ndarray | None = None,
) -> QuantizedTensor:
    """``SiLU(gate) * up`` computed in float32 registers and quantized per group, in one pass.

    Parameters
    ----------
    x : cupy.ndarray
        ``(..., 2H)`` = ``[gate | up]``, float32, float16 or bfloat16, contiguous last axis.
    dtype : {"float8_e4m3fn", "float8_e5m2", "int8"}
    group_size : {32, 64, 128, 256}
        Must divide H.
    scale_layout : {"row", "col"}
        The scales' layout, as for :func:`quantize_groupwise`.
    scale_ub : float or cupy.ndarray, optional
        Upper bound of the *decode* scale ``s`` (``r ~ q * s``): vLLM's fused kernel clamps the
        scale, not the amax. A positive float or a one-element float32 device array.
    out, scale_out : cupy.ndarray, optional
        Buffers of the output shape ``(..., H)``, as for :func:`quantize_groupwise`.

    Returns
    -------
    QuantizedTensor
        Of shape ``(..., H)``; the intermediate never touches memory.

    Raises
    ------
    TypeError, ValueError
        As :func:`quantize_groupwise`; also an odd last axis.

    Notes
    -----
    vLLM ``silu_and_mul_per_block_quant``: ``r = (gate * (1 / (1 + expf(-gate)))) * up``;
    ``s = fmaxf(fminf(max|r| / qmax, scale_ub), min_scale)`` with ``min_scale = 1 / (qmax * 512)``
    (FP8) or FLT_EPSILON (INT8); ``q = cvt(clamp(r / s))``. :func:`cupyquant.reference
    .quantize_silu_intermediate` is the exact reference given ``r``.
    """
    return _quantize(True, x, dtype, group_size, scale_layout, False, "float32", scale_ub, out, scale_out, True, None)


def _silu_mul_intermediate(x: cupy.ndarray):
    """Test hook: ``(r, e)``, the float32 SiLU(gate) * up that :func:`silu_mul_quantize` quantizes
    (computed by the same device function) and the ``expf(-gate)`` it was computed from."""
    in_t = _validate.float_input(x, "x")
    rows, K, row_stride = _validate.rows_view(x)
    H = K // 2
    with _validate.on_device_of(x):
        r = cupy.empty(tuple(x.shape[:-1]) + (H,), dtype=np.float32)
        e = cupy.empty_like(r)
        if rows and H:
            device = x.data.device_id
            k = _jit.kernel(device, FAMILY, "silu_mul_intermediate", in_t.ctype)
            grid = (min(ceil_div(rows * H, 256), MAX_GRID_YZ),)
            args = (ARG, np.int64(row_stride), ARG, ARG, np.int64(rows), np.int32(H))
            Launch(k, grid, (256,), args, pdl=_device.caps(device).pdl)(x, r, e)
    return r, e


def _dequant_plan(q: QuantizedTensor, out_t: _dtypes.InputType, out):
    """(launch or None, overlap check) of the dequantization of ``q``: group_dequantize_flat or
    group_dequantize (the geometry of :func:`cupyquant._flat.geometry`), or token_dequantize_azp
    for per-token INT8 with zero points (arguments q.data, y, the scales, the zero points)."""
    shape = q.shape
    K = shape[-1] if shape else 0
    device = q.data.data.device_id
    azp = q.zero_point is not None
    if azp and q.scheme.granularity != "token":
        raise ValueError(f"q.zero_point: zero points are per token here, got granularity {q.scheme.granularity!r}")
    if out is not None:
        _validate.out_array(out, "out", q.shape, out_t.dtype, device, inputs=(("q.data", q.data),))
    disjoint = _validate.Disjoint((("q.data", q.data), ("out", out)), 1)
    rows = math.prod(shape[:-1])
    if not (rows and K):
        return None, disjoint
    G = q.scheme.block[0]
    packed = q.scheme.scale_dtype == "float8_e8m0fnu"
    n_groups = 1 if azp else (K // G if G else 0)
    lay = _scales.group_layout(shape, n_groups, q.scheme.scale_layout, packed and not azp)
    sa = _scales.group_scale_args(lay, 0, packed and not azp, False)
    y_aligned = out is None or out.data.ptr % VECTOR_BYTES == 0
    vec = K % 8 == 0 and q.data.data.ptr % 8 == 0 and y_aligned
    # the group of column c is c >> g_shift: G is a power of two, or one scale per row (G = K)
    g_shift = 31 if q.scheme.granularity == "token" else G.bit_length() - 1
    if not azp:
        aligned = _flat.flat_aligned(q.data.data.ptr, 0 if out is None else out.data.ptr)
        geometry = _flat.geometry(rows * K, aligned, _device.sm_count(device), lay.words)
        if geometry != "rows":
            row_f32 = q.scheme.scale_layout == "row" and not packed
            kernel = _jit.kernel(
                device, FAMILY, "group_dequantize_flat", out_t.ctype, q.format.ctag, _flat.PIECES[geometry], row_f32
            )
            grid, block = _flat.flat_grid(rows * K, geometry)
            args = (ARG, ARG, _flat.flat_rows(rows, K), np.int32(g_shift), sa, ARG)
            return Launch(kernel, grid, block, args, pdl=_device.caps(device).pdl), disjoint
    if azp:
        kernel = _jit.kernel(device, FAMILY, "token_dequantize_azp", out_t.ctype, vec)
        mid = (np.int64(rows), np.int32(K))
    else:
        kernel = _jit.kernel(device, FAMILY, "group_dequantize", out_t.ctype, q.format.ctag, vec)
        mid = (np.int64(rows), np.int32(K), np.int32(g_shift))
    if vec:
        grid, block = _group_plan.grid2d(rows, K // 8)
    else:
        grid, block = (min(ceil_div(rows * K, 256), MAX_GRID_YZ * 16),), (256,)
    args = (ARG, ARG, *mid, sa, ARG) + ((ARG,) if azp else ())
    return Launch(kernel, grid, block, args, pdl=_device.caps(device).pdl), disjoint


_DEQUANT_PLANS = _plans.Plans()


def _dequantize(q: QuantizedTensor, out_t: _dtypes.InputType, out) -> cupy.ndarray:
    data = q.data
    azp = q.zero_point is not None
    key = (q.scheme, q.shape, _validate.array_key(data), azp, out_t, _validate.array_key(out), _flat.GEOMETRY)
    plan = _DEQUANT_PLANS.lookup(key)
    if plan is None:
        plan = _DEQUANT_PLANS.keep(key, _dequant_plan(q, out_t, out))
    launch, disjoint = plan
    if out is not None:
        disjoint.check((data.data.ptr, out.data.ptr))
    with _validate.on_device_of(data):
        y = cupy.empty(q.shape, dtype=out_t.dtype) if out is None else out
        if launch is not None:
            if azp:
                launch(data, y, q.scale, q.zero_point)
            else:
                launch(data, y, q.scale)
    return y


register_dequantizer(FAMILY, _dequantize)
