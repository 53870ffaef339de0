"""Fused (residual add +) RMSNorm + quantization: the activations are read once, normalized in
registers and quantized by any of the library's activation schemes.

Kernel: ``kernels/rms_norm.cu``. Reference: :func:`cupyquant.reference.rms_norm_quantize`, whose
docstrings give the exact formula (:func:`cupyquant.reference.rms_norm`,
:func:`cupyquant.reference.sum_of_squares`). The quantized bytes and scales are those that the
scheme's own quantizer gives for the normalized ``y``, in the same layouts, so the result
dequantizes with :func:`cupyquant.dequantize` and feeds the same GEMMs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import cupy
import numpy as np

from . import _checks, _device, _dtypes, _jit, _plans, _scales, _validate, groupwise, mx, nvfp4, per_tensor
from ._launch import ARG, Launch
from ._sizes import VECTOR_BYTES, ceil_div, round_up
from .quantized import QuantizedTensor

SCHEMES = ("token", "group", "tensor", "mx", "nvfp4")
_SCHEME_ID = {s: i for i, s in enumerate(SCHEMES)}  # rms_norm.cu's NQ_* numbers
_FORMATS = {
    "token": _checks.GROUPWISE_FORMATS,
    "group": _checks.GROUPWISE_FORMATS,
    "tensor": _dtypes.FP8_NAMES,
    "mx": _dtypes.MX_NAMES,
    "nvfp4": ("float4_e2m1fn",),
}
#: Row bytes a lane holds (kernels/rms_norm.cu NORM_REG_BYTES) and the team sizes: up to 32 warps a
#: row, so rows up to 16384 elements of a 16-bit type, 8192 of float32.
_LANE_BYTES = 32
_WARPS = (1, 2, 4, 8, 16, 32)
#: Elements of one unit (16 bytes of a 16-bit type, 32 of float32): the least a lane of a team holds.
_UNIT = 8
#: The "few" team rule (_few_team): up to this many rows a row gets at least _FEW_ROWS_WARPS warps
#: (H100, bf16, per-token FP8, rms_norm_quantize: 16 x 4096 in 4.2 us with 16 warps a row, 4.5 with 4).
_FEW_ROWS = 64
_FEW_ROWS_WARPS = 16
#: The "fill" team rule (_fill_team): a call whose rows, on teams of one unit a lane, come to at most
#: this many warps an SM takes those teams; a larger one the fewest warps that hold a row (32 bytes a
#: lane). A short call is one row's chain of dependent steps, shorter on more lanes; the bound keeps
#: a call of more rows from queueing the per-warp work of wide teams on the SMs' schedulers.
_FILL_WARPS_PER_SM = 16
#: Teams of fewer warps keep 32 bytes a lane whatever the rows: widening one warp to two would add
#: an exchange through shared memory to save a lane one unit.
_FILL_MIN_WARPS = 2
#: The widest team the "fill" rule widens to (H200, bf16, per-token FP8, 16 x 8192 without a
#: residual: 3.62 us on 16 warps a row, 4.09 on 32).
_FILL_MAX_WARPS = 16
#: Threads of a block: rows of teams of fewer than 256 threads share a block (rms_norm.cu).
_BLOCK = 256
#: The two kernels: rms_norm_quantize (every scheme; every warp computes its row's scalars) and
#: rms_norm_quantize_lead (the schemes of _LEAD_SCHEMES; a row's scalars computed once by its team's
#: first warp, the per-token amax by atomicMax).
_KERNELS = {"lead": "rms_norm_quantize_lead", "block": "rms_norm_quantize"}
#: The schemes whose plans take rms_norm_quantize_lead. On the H200 (bf16, the same teams) it is
#: 1.01-1.21x the other kernel for per-token and static per-tensor FP8 from 1 to 4096 rows of 4096
#: and 8192; for the group, MX and NVFP4 scales, whose scalars need no exchange between a team's
#: warps, a lead kernel measured 0.94-1.03x, so those schemes keep rms_norm_quantize only.
_LEAD_SCHEMES = ("token", "tensor")
#: The kernels' register bound (rms_norm.cu OCC): blocks of 1024 threads an SM must hold. 1: up to
#: 64 registers a thread (36-52 in the 16-bit instances: 2 or 3 rows of 8192 bf16 an SM); 2: at most
#: 32, so an SM holds 2048 threads (4 rows of 8192, 8 of 4096), with 4-32 bytes a thread spilled.
#: Plans take _planned_occupancy's unless _Path.occupancy says otherwise.
_OCCUPANCY = (1, 2)
#: The schemes whose plans take occupancy 2 from _OCC2_FROM_ROWS_PER_SM rows per SM up (more rows
#: than an SM holds at once at occupancy 1). On an H200 (bf16, FP8, with a residual) occupancy 2
#: is 1.25-1.27x occupancy 1 for static per-tensor scales at 4096 and 16384 rows of 8192, 1.05-1.06x
#: per token, 1.04x per group of 128, 1.00-1.07x at 4096 rows of 4096, 0.98-0.99x at 1024 rows of
#: 8192 (7.8 rows per SM, so below the line) and 0.97-1.01x at 1-128 rows. MX and NVFP4 (48-52 registers at occupancy 1) were not measured at occupancy 2.
_OCC2_SCHEMES = ("token", "tensor", "group")
_OCC2_FROM_ROWS_PER_SM = 8


def _planned_occupancy(scheme: str, rows: int, sms: int) -> int:
    """The register bound of a plan of ``rows`` rows of ``scheme`` on ``sms`` SMs (rms_norm.cu OCC)."""
    return 2 if scheme in _OCC2_SCHEMES and rows >= _OCC2_FROM_ROWS_PER_SM * sms else 1


FAMILY = _jit.register(
    "rms_norm",
    [
        _jit.expr(name, t, _SCHEME_ID[s], _dtypes.element_format(f).ctag, occ)
        for occ in _OCCUPANCY
        for kernel, name in _KERNELS.items()
        for s, formats in _FORMATS.items()
        if kernel == "block" or s in _LEAD_SCHEMES
        for f in formats
        for t in _dtypes.INPUT_CTYPES
    ],
    specific_targets=_device.FP4_CVT_TARGETS,
)


@dataclass(frozen=True)
class _Path:
    """How a plan launches (part of its key). ``kernel``: a key of _KERNELS, or None ("lead" for
    _LEAD_SCHEMES, else "block"; schemes outside _LEAD_SCHEMES take "block" whatever it is); ``teams``: "fill" (_fill_team) or "few" (_few_team);
    ``weight``: "async" (rms_norm_quantize_lead stages the weight
    in shared memory by cp.async on the vector path) or "prefetch" (prefetch.global.L1, then loads);
    ``warps``: a team size that replaces the rule's where it holds the row (None: the rule's);
    ``occupancy``: the kernels' register bound, one of _OCCUPANCY (None: _planned_occupancy's)."""

    kernel: str | None = None
    teams: str = "fill"
    weight: str = "async"
    warps: int | None = None
    occupancy: int | None = None


#: The path of new plans (_forced_path changes it).
_PATH = _Path()


@contextlib.contextmanager
def _forced_path(**changes):
    """Private, for tests and benchmarks: within the block, new calls plan with the fields of
    :class:`_Path` given (``kernel="block", teams="few"``: the block-synchronized kernel and its
    rule). Plans are keyed on the path, so both stay memoized. Not thread-safe: it sets a module
    global."""
    global _PATH
    new = replace(_PATH, **changes)
    kernels = (None, *_KERNELS)
    if new.kernel not in kernels or new.teams not in ("fill", "few") or new.weight not in ("async", "prefetch"):
        raise ValueError(f"unknown path {new}")
    if new.warps is not None and new.warps not in _WARPS:
        raise ValueError(f"warps must be one of {_WARPS}, got {new.warps}")
    if new.occupancy is not None and (type(new.occupancy) is not int or new.occupancy not in _OCCUPANCY):
        raise ValueError(f"occupancy must be None or one of {_OCCUPANCY}, got {new.occupancy!r}")
    saved, _PATH = _PATH, new
    try:
        yield
    finally:
        _PATH = saved


# rms_norm.cu's NormArgs, field for field (C alignment).
_NORM_ARGS = np.dtype(
    [
        ("rows", np.int64),
        ("grid_rows", np.int64),
        ("x_stride", np.int64),
        ("r_stride", np.int64),
        ("q_row", np.int64),
        ("n_blocks", np.int64),
        ("H", np.int32),
        ("team_shift", np.int32),
        ("vec", np.int32),
        ("group_size", np.int32),
        ("swizzled", np.int32),
        ("eps", np.float32),
        ("s_mode", np.int32),
        ("s_arg", np.float32),
        ("rcp_H", np.float32),
        ("w_async", np.int32),
        ("s_ptr", np.uint64),
        ("s_out", np.uint64),
    ],
    align=True,
)
_NO_SCALE_ARGS = np.zeros((), dtype=_scales.SCALE_ARGS)[()]


def _row_max(itemsize: int, warps: int) -> int:
    """The longest row ``warps`` warps hold."""
    return 32 * warps * _LANE_BYTES // itemsize


def _narrow_team(H: int, itemsize: int) -> int:
    """The fewest warps that hold a row (32 bytes a lane)."""
    if H > _row_max(itemsize, _WARPS[-1]):
        raise ValueError(
            f"x's last axis ({H}) is longer than the fused kernel holds ({_row_max(itemsize, _WARPS[-1])} "
            f"elements of {itemsize} bytes); normalize and quantize in two steps"
        )
    return next(w for w in _WARPS if H <= _row_max(itemsize, w))


def _few_team(H: int, itemsize: int, rows: int) -> int:
    """Warps per row: the fewest that hold the row; with few rows at least _FEW_ROWS_WARPS."""
    warps = _narrow_team(H, itemsize)
    return max(warps, _FEW_ROWS_WARPS) if rows <= _FEW_ROWS else warps


def _fill_team(H: int, itemsize: int, rows: int, sms: int) -> int:
    """Warps per row: the fewest that hold the row (32 bytes a lane), or, where those are at least
    _FILL_MIN_WARPS and the call is short, the fewest (up to _FILL_MAX_WARPS) that hold it at one unit a lane (16 bytes of a
    16-bit type; float32's unit is already 32 bytes): while ``rows`` such teams come to at most
    _FILL_WARPS_PER_SM warps on each of the ``sms`` SMs. Like quantize_groupwise's per-token team
    (_group_plan._token_team), a short call spreads each row over more lanes and a long one keeps the
    most bytes in flight a lane."""
    narrow = _narrow_team(H, itemsize)
    wide = next(w for w in _WARPS if w == _WARPS[-1] or H <= 32 * w * _UNIT)
    short = rows * wide <= sms * _FILL_WARPS_PER_SM
    if narrow >= _FILL_MIN_WARPS and narrow < wide <= _FILL_MAX_WARPS and short:
        return wide
    return narrow


def _resolved(path: _Path, scheme: str) -> _Path:
    """``path`` with its kernel for ``scheme``: the lead kernel has the tails of _LEAD_SCHEMES only."""
    if scheme not in _LEAD_SCHEMES:
        return replace(path, kernel="block")
    return replace(path, kernel=path.kernel or "lead")


def _team(H: int, itemsize: int, rows: int, device: int, path: _Path) -> int:
    """Warps per row on ``path``: its forced size where that holds the row, else its rule's."""
    narrow = _narrow_team(H, itemsize)
    if path.warps is not None and path.warps >= narrow:
        return path.warps
    if path.teams == "few":
        return _few_team(H, itemsize, rows)
    return _fill_team(H, itemsize, rows, _device.sm_count(device))


def _only_for(scheme: str, **given) -> None:
    for arg, (value, default, schemes) in given.items():
        changed = value is not None if default is None else value != default
        if scheme not in schemes and changed:
            raise ValueError(f"{arg} applies to scheme {' or '.join(map(repr, schemes))}, not {scheme!r}")


class _Plan:
    """A checked call: the launch (None: nothing to launch; arguments x, residual, weight, y, q, the
    scales, then the fields of the argument structs given per call: the given scale and where its
    copy goes ("tensor", "nvfp4"), a device ``scale_ub``), the outputs' shapes, dtypes and layout,
    the scheme, the given scale ("tensor": s; "nvfp4": S_enc), and the overlap check."""

    __slots__ = ("launch", "q_shape", "q_dtype", "s_shape", "lay", "s_dtype", "scheme", "given", "disjoint", "ub")

    def __init__(
        self, x, weight, eps, residual, scheme, dtype, group_size, scale_layout, scale_pow2, scale_dtype, scale_ub,
        scale, global_scale, out, scale_out, path,
    ):  # fmt: skip
        if scheme not in SCHEMES:
            raise ValueError(f"scheme={scheme!r} is not supported; expected one of {SCHEMES}")
        _only_for(
            scheme,
            group_size=(group_size, None, ("group",)),
            scale_pow2=(scale_pow2, False, ("token", "group")),
            scale_dtype=(scale_dtype, "float32", ("token", "group")),
            scale_ub=(scale_ub, None, ("token", "group")),
            scale=(scale, None, ("tensor",)),
            global_scale=(global_scale, None, ("nvfp4",)),
        )
        path = _resolved(path, scheme)
        in_t = _validate.float_input(x, "x")
        if dtype is None:
            dtype = "float4_e2m1fn" if scheme == "nvfp4" else "float8_e4m3fn"
        fmt = _dtypes.element_format(dtype, "dtype", allowed=_FORMATS[scheme])
        rows, H, x_stride = _validate.rows_view(x, "x")
        if H < 1:
            raise ValueError("x's last axis must not be empty")
        device = x.data.device_id
        _validate.cupy_array(weight, "weight")
        if weight.shape != (H,):
            raise ValueError(f"weight must have shape ({H},) (x's last axis), got {weight.shape}")
        if weight.dtype != x.dtype:
            raise TypeError(f"weight must have x's dtype {x.dtype}, got {weight.dtype}")
        _validate.c_contiguous(weight, "weight")
        _validate.same_device(weight, "weight", device, "x")
        r_stride = 0
        if residual is not None:
            _validate.cupy_array(residual, "residual")
            if residual.shape != x.shape:
                raise ValueError(f"residual must have x's shape {x.shape}, got {residual.shape}")
            if residual.dtype != x.dtype:
                raise TypeError(f"residual must have x's dtype {x.dtype}, got {residual.dtype}")
            _validate.same_device(residual, "residual", device, "x")
            r_stride = _validate.rows_view(residual, "residual")[2]
        _checks.norm_eps(eps)

        sa, lay, s_shape, s_dtype, n_blocks, swizzled, given = _NO_SCALE_ARGS, None, None, np.uint8, 0, False, None
        g_elems = 0  # elements per scale of "group" (0 otherwise)
        q_shape, q_dtype = x.shape, (np.int8 if fmt.name == "int8" else np.uint8)
        ub = None
        if scheme in ("token", "group"):
            if scale_layout is None:
                scale_layout = "row"
            packed = _scales.group_scale_packed(scale_layout, scale_dtype)
            gs = None if scheme == "token" else (128 if group_size is None else group_size)
            n_groups = _checks.group_count(H, gs)
            lay = _scales.group_layout(x.shape, n_groups, scale_layout, packed)
            s_dtype = np.int32 if packed else np.float32
            bound = _scales.scale_bound(scale_ub, device)
            ub = scale_ub if isinstance(scale_ub, cupy.ndarray) else None
            sa = _scales.group_scale_args(lay, n_groups, packed, bool(scale_pow2) or packed, bound)
            sch = groupwise.scheme(fmt.name, gs, H, packed, scale_layout)
            g_elems = gs or 0
        elif scheme == "tensor":
            if scale_layout not in (None, "scalar"):
                raise ValueError(
                    f"scale_layout={scale_layout!r} is not supported by scheme 'tensor'; expected 'scalar' (one float32 scale)"
                )
            given = _validate.scale_arg(scale, "scale", device)
            if given.mode == _validate.ScaleSource.AMAX:
                raise ValueError("scale= is required by scheme 'tensor': the static decode scale (y ~ q * scale)")
            sch = per_tensor.scheme(fmt.name)
            s_dtype = np.float32
        else:
            block = _scales.MX_BLOCK if scheme == "mx" else _scales.NV_BLOCK
            if scale_layout is None:
                scale_layout = "dense" if scheme == "mx" else "swizzled"
            _scales.check_block_layout(scale_layout)
            if H % block:
                raise ValueError(f"x's last axis ({H}) must be a multiple of {block} for scheme {scheme!r}")
            if scheme == "nvfp4":
                given = _validate.scale_arg(global_scale, "global_scale", device)
                if given.mode == _validate.ScaleSource.AMAX:
                    raise ValueError(
                        "global_scale= is required by scheme 'nvfp4': the encode scale S_enc (2688 / amax)"
                    )
                sch = nvfp4.scheme(scale_layout)
            else:
                sch = mx.scheme(fmt.name, scale_layout)
            q_shape = _scales.packed_shape(x.shape, fmt.bits)
            s_shape = _scales.block_scale_shape(x.shape, block, scale_layout)
            n_blocks, swizzled = H // block, scale_layout == "swizzled"
        inputs = (("x", x), ("weight", weight), ("residual", residual))
        if out is not None:
            _validate.out_array(out, "out", q_shape, q_dtype, device, inputs=inputs)
        if scale_out is not None:
            if lay is not None:
                _scales.check_group_scale_out(scale_out, lay, s_dtype, device, inputs=inputs + (("out", out),))
            else:
                _validate.scale_out(scale_out, s_shape or (1,), s_dtype, device, inputs=inputs + (("out", out),))
        s_bytes = lay.words * 4 if lay is not None else None
        self.disjoint = _validate.Disjoint(
            (("x", x), ("weight", weight), ("scale_ub", ub), ("residual", residual), ("out", out),
             ("scale_out", scale_out, s_bytes)),
            3,
        )  # fmt: skip

        grid_rows = round_up(rows, _scales.SWIZZLE_ROWS) if swizzled else rows
        na = np.array(
            (rows, grid_rows, x_stride, r_stride, q_shape[-1] if q_shape else 0, n_blocks, H, 0, 0, g_elems,
             swizzled, np.float32(eps), 0, 0.0, np.float32(1) / np.float32(H), 0, 0, 0),
            dtype=_NORM_ARGS,
        )  # fmt: skip
        if given is not None:
            na["s_mode"], na["s_arg"] = int(given.mode), given.value
        warps = _team(H, x.itemsize, rows, device, path)
        self.launch = None
        if grid_rows:
            ptrs = [x.data.ptr, weight.data.ptr] + ([residual.data.ptr] if residual is not None else [])
            vec = (
                H % 8 == 0
                and all(p % VECTOR_BYTES == 0 for p in ptrs)
                and (x_stride * x.itemsize) % VECTOR_BYTES == 0
                and (r_stride * x.itemsize) % VECTOR_BYTES == 0
                and (out is None or out.data.ptr % 8 == 0)
            )
            name = _KERNELS[path.kernel]
            occ = path.occupancy or _planned_occupancy(scheme, rows, _device.sm_count(device))
            kernel = _jit.kernel(device, FAMILY, name, in_t.ctype, _SCHEME_ID[scheme], fmt.ctag, occ)
            threads = 32 * warps
            # the weight staged by cp.async: 16-byte words, the lead kernel only
            w_async = vec and path.kernel == "lead" and path.weight == "async"
            na["team_shift"], na["vec"], na["w_async"] = threads.bit_length() - 1, vec, w_async
            block_dim = (max(_BLOCK, threads),)
            grid = (ceil_div(grid_rows, block_dim[0] // threads),)
            fields = ((6, "s_ptr"), (6, "s_out")) if given is not None else ()
            fields += ((7, "ub_ptr"),) if ub is not None else ()
            args = (ARG, ARG, ARG, ARG, ARG, ARG, na[()], sa)
            smem = _LANE_BYTES * block_dim[0] if w_async else 0  # rms_norm.cu w_stage
            self.launch = Launch(kernel, grid, block_dim, args, smem=smem, pdl=_device.caps(device).pdl, fields=fields)
        self.q_shape, self.q_dtype, self.s_shape, self.lay, self.s_dtype = q_shape, q_dtype, s_shape, lay, s_dtype
        # the plan keeps no array of the call that made it: a device scale is given at each call
        self.scheme, self.ub = sch, ub is not None
        self.given = None if given is None else given._replace(array=None)


#: Plans per argument signature.
_PLANS = _plans.Plans()


def rms_norm_quantize(
    x: cupy.ndarray,
    weight: cupy.ndarray,
    *,
    eps: float = 1e-6,
    residual: cupy.ndarray | None = None,
    scheme: str = "token",
    dtype: str | type | np.dtype | None = None,
    group_size: int | None = None,
    scale_layout: str | None = None,
    scale_pow2: bool = False,
    scale_dtype: str | type | np.dtype = "float32",
    scale_ub: float | cupy.ndarray | None = None,
    scale: float | cupy.ndarray | None = None,
    global_scale: float | cupy.ndarray | None = None,
    return_normalized: bool = False,
    out: cupy.ndarray | None = None,
    scale_out: cupy.ndarray | None = None,
) -> QuantizedTensor | tuple[QuantizedTensor, cupy.ndarray]:
    """RMSNorm of the last axis (after adding ``residual``), quantized, in one kernel launch.

    Parameters
    ----------
    x : cupy.ndarray
        ``(..., H)`` float32, float16 or bfloat16, contiguous last axis (leading axes may be strided
        if they collapse into one row stride). H up to 16384 (8192 for float32).
    weight : cupy.ndarray
        ``(H,)``, x's dtype, contiguous.
    eps : float
        Added to the mean square, as a float32.
    residual : cupy.ndarray, optional
        x's shape and dtype. ``z = round(x + residual)`` is written back into ``residual`` (the
        engines' in-place update) and normalized in place of x.
    scheme : {"token", "group", "tensor", "mx", "nvfp4"}
        How the normalized ``y`` is quantized, with the formulas and scale layouts of
        :func:`quantize_groupwise` (``group_size=None``: vLLM ``rms_norm_dynamic_per_token_quant``),
        :func:`quantize_groupwise` (``group_size``: vLLM ``rms_norm_per_block_quant``),
        :func:`quantize_fp8` with a static ``scale`` (vLLM ``fused_add_rms_norm_static_fp8_quant``),
        :func:`quantize_mx` ("ceil" rule) and :func:`quantize_nvfp4` with a given ``global_scale``.
    dtype : str, optional
        The element format: ``"float8_e4m3fn"`` (default), ``"float8_e5m2"``, ``"int8"`` (token,
        group), ``"float4_e2m1fn"`` (mx; the only and default one for nvfp4).
    group_size : {32, 64, 128, 256}, optional
        "group" only; default 128. Must divide H.
    scale_layout : str, optional
        The scales' layout, as the scheme's quantizer takes it: "token"/"group": ``"row"``
        (default) or ``"col"``; "tensor": ``"scalar"`` (the one float32 scale; the default);
        "mx"/"nvfp4": ``"dense"`` or ``"swizzled"`` (defaults ``"dense"`` for mx and
        ``"swizzled"`` for nvfp4, as the quantizers). "mx" needs H % 32 == 0, "nvfp4" H % 16 == 0.
    scale_pow2, scale_dtype, scale_ub
        "token"/"group" only, as in :func:`quantize_groupwise`.
    scale : float or cupy.ndarray
        "tensor" only, required: the static decode scale (``y ~ q * scale``).
    global_scale : float or cupy.ndarray
        "nvfp4" only, required: the encode scale ``S_enc`` (``2688 / amax`` by convention).
    return_normalized : bool
        Also return ``y``, the normalized output before quantization (x's dtype), for checking.
    out, scale_out : cupy.ndarray, optional
        Buffers for the quantized data and the scales, as the scheme's quantizer takes them.

    Returns
    -------
    QuantizedTensor or tuple
        What the scheme's quantizer returns for ``y``; with ``return_normalized``, the pair
        ``(quantized, y)``.

    Raises
    ------
    TypeError
        An argument of the wrong type or dtype.
    ValueError
        An unsupported scheme, dtype, group size or layout, an argument the scheme does not take,
        a missing ``scale`` / ``global_scale``, mismatched shapes, H too long, overlapping buffers.

    Notes
    -----
    The exact formula is :func:`cupyquant.reference.rms_norm`: ``z`` rounded to x's dtype, its
    sum of squares in a fixed order (units of 8, then a pairwise tree), ``inv = 1 / sqrt(ss / H +
    eps)`` with IEEE division and square root, ``y = round(round(z * inv) * weight)``. No host
    synchronization; CUDA-graph capturable.
    """
    key = (
        _validate.array_key(x), _validate.array_key(weight), type(eps), eps, _validate.array_key(residual), scheme,
        dtype, group_size, type(group_size), scale_layout, scale_pow2, scale_dtype, _validate.scale_key(scale_ub),
        _validate.scale_key(scale), _validate.scale_key(global_scale), _validate.array_key(out),
        _validate.array_key(scale_out), _PATH,
    )  # fmt: skip
    plan = _PLANS.lookup(key)
    if plan is None:
        plan = _PLANS.keep(
            key,
            _Plan(
                x, weight, eps, residual, scheme, dtype, group_size, scale_layout, scale_pow2, scale_dtype, scale_ub,
                scale, global_scale, out, scale_out, _PATH,
            ),
        )  # fmt: skip
    ub = scale_ub if plan.ub else None
    if residual is not None or out is not None or scale_out is not None:  # depend on the addresses
        plan.disjoint.check((x.data.ptr, weight.data.ptr, _ptr(ub), _ptr(residual), _ptr(out), _ptr(scale_out)))
        if scale_out is not None and plan.lay is not None:
            mem = scale_out.data.mem
            if scale_out.data.ptr - mem.ptr + plan.lay.words * 4 > mem.size:
                raise ValueError(
                    "scale_out must start 16-byte aligned in an allocation that covers the layout's padding"
                )
    given = plan.given
    with _validate.on_device_of(x):
        q = cupy.empty(plan.q_shape, dtype=plan.q_dtype) if out is None else out
        if scale_out is not None:
            s = scale_out
        elif plan.lay is not None:
            s = plan.lay.empty(plan.s_dtype)
        else:
            s = cupy.empty(plan.s_shape or (1,), dtype=plan.s_dtype)
        y = cupy.empty(x.shape, dtype=x.dtype) if return_normalized else None
        tensor = plan.scheme.granularity == "tensor"
        gs_out = None if given is None or tensor else cupy.empty((1,), dtype=np.float32)
        if plan.launch is not None:
            if given is not None:
                src = scale if tensor else global_scale
                plan.launch(
                    x, residual, weight, y, q, s, src if type(src) is cupy.ndarray else None, s if tensor else gs_out
                )
            elif ub is not None:
                plan.launch(x, residual, weight, y, q, s, ub)
            else:
                plan.launch(x, residual, weight, y, q, s)
        elif given is not None:  # no rows: the scale the kernel would have stored
            dst = s if tensor else gs_out
            src = scale if tensor else global_scale
            dst[...] = src.reshape(1) if type(src) is cupy.ndarray else given.value
    qt = QuantizedTensor(q, s, plan.scheme, x.shape, x.dtype, global_scale=gs_out)
    return (qt, y) if return_normalized else qt


def _ptr(a) -> int:
    return 0 if a is None else a.data.ptr
