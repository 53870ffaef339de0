"""Fused (residual add +) RMSNorm + quantization: the activations are read once, normalized in
registers and quantized by any of the library's activation schemes.

Kernel: ``kernels/rms_norm.cu``. Reference: :func:`cupyquant.reference.rms_norm_quantize`, whose
docstrings give the exact formula (:func:`cupyquant.reference.rms_norm`,
:func:`cupyquant.reference.sum_of_squares`). The quantized bytes and scales are those that the
scheme's own quantizer gives for the normalized ``y``, in the same layouts, so the result
dequantizes with :func:`cupyquant.dequantize` and feeds the same GEMMs.
"""

from __future__ import annotations

from typing import NamedTuple

import cupy
import numpy as np

from . import _block_scale, _checks, _dtypes, _jit, _plans, _validate, groupwise, mx, nvfp4, per_tensor
from .quantized import QuantizedTensor, Scheme

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
#: Up to this many rows a row gets at least _FEW_ROWS_WARPS warps: a short call is latency-bound, and
#: spreading each row over more lanes shortens its chain (H100, bf16, per-token FP8: 16 x 4096 in
#: 4.2 us with 16 warps a row, 4.5 with 4; 256 x 4096 in 7.3 us with 16, 5.6 with 4).
_FEW_ROWS = 64
_FEW_ROWS_WARPS = 16
_FAMILY = _jit.register(
    "rms_norm",
    [
        _jit.expr("rms_norm_quantize", t, _SCHEME_ID[s], _dtypes.element_format(f).ctag)
        for s, formats in _FORMATS.items()
        for f in formats
        for t in _dtypes.INPUT_CTYPES
    ],
    specific_targets=_block_scale.SPECIFIC_TARGETS,
)

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
        ("s_ptr", np.uint64),
        ("s_out", np.uint64),
    ],
    align=True,
)
_NO_SCALE_ARGS = np.zeros((), dtype=groupwise._SCALE_ARGS)[()]


class _Plan(NamedTuple):
    """A call's launch after its checks: kernel (None: nothing to launch), grid, block, NormArgs
    (its s_ptr / s_out set per call), ScaleArgs, outputs, and the scale of "tensor" / "nvfp4"."""

    kernel: object
    grid: tuple
    block: tuple
    na: np.ndarray
    sa: np.void
    q_shape: tuple
    q_dtype: type
    s_shape: tuple  # block scales (uint8); None for token / group
    lay: object  # groupwise._Layout of token / group scales
    s_dtype: type
    scheme: Scheme
    given: _validate.Scale  # "tensor": s; "nvfp4": S_enc


def _row_max(itemsize: int, warps: int) -> int:
    """The longest row ``warps`` warps hold."""
    return 32 * warps * _LANE_BYTES // itemsize


def _team(H: int, itemsize: int, rows: int) -> int:
    """Warps per row: the fewest that hold the row; with few rows at least _FEW_ROWS_WARPS."""
    if H > _row_max(itemsize, _WARPS[-1]):
        raise ValueError(
            f"x's last axis ({H}) is longer than the fused kernel holds ({_row_max(itemsize, _WARPS[-1])} "
            f"elements of {itemsize} bytes); normalize and quantize in two steps"
        )
    warps = next(w for w in _WARPS if H <= _row_max(itemsize, w))
    return max(warps, _FEW_ROWS_WARPS) if rows <= _FEW_ROWS else warps


def _only_for(scheme: str, **given) -> None:
    for arg, (value, default, schemes) in given.items():
        changed = value is not None if default is None else value != default
        if scheme not in schemes and changed:
            raise ValueError(f"{arg} applies to scheme {' or '.join(map(repr, schemes))}, not {scheme!r}")


def _plan(
    x,
    weight,
    eps,
    residual,
    scheme,
    dtype,
    group_size,
    scale_layout,
    scale_pow2,
    scale_dtype,
    scale_ub,
    scale,
    global_scale,
    out,
    scale_out,
) -> _Plan:
    """Check every argument of rms_norm_quantize and plan the launch; nothing is allocated."""
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
    if scheme in ("token", "group"):
        if scale_layout is None:
            scale_layout = "row"
        packed = groupwise._scale_kind(scale_layout, scale_dtype)
        gs = None if scheme == "token" else (128 if group_size is None else group_size)
        n_groups = _checks.group_count(H, gs)
        lay = groupwise._Layout(x.shape[:-1], groupwise._n_cols(n_groups, packed), scale_layout == "col")
        s_dtype = np.int32 if packed else np.float32
        sa = groupwise._scale_args(lay, n_groups, packed, bool(scale_pow2) or packed, groupwise._ub(scale_ub, device))
        sch = groupwise._scheme(fmt.name, gs, H, packed, scale_layout)
        g_elems = gs or 0
    elif scheme == "tensor":
        if scale_layout is not None:
            raise ValueError("scale_layout does not apply to scheme 'tensor' (one float32 scale)")
        given = _validate.scale_arg(scale, "scale", device)
        if given.mode == _validate.ScaleSource.AMAX:
            raise ValueError("scale= is required by scheme 'tensor': the static decode scale (y ~ q * scale)")
        sch = per_tensor._SCHEMES[fmt.name]
        s_dtype = np.float32
    else:
        block = _block_scale.MX_BLOCK if scheme == "mx" else _block_scale.NV_BLOCK
        if scale_layout is None:
            scale_layout = "dense" if scheme == "mx" else "swizzled"
        if scale_layout not in _block_scale.LAYOUTS:
            raise ValueError(f"scale_layout={scale_layout!r} is not supported; expected one of {_block_scale.LAYOUTS}")
        if H % block:
            raise ValueError(f"x's last axis ({H}) must be a multiple of {block} for scheme {scheme!r}")
        if scheme == "nvfp4":
            given = _validate.scale_arg(global_scale, "global_scale", device)
            if given.mode == _validate.ScaleSource.AMAX:
                raise ValueError("global_scale= is required by scheme 'nvfp4': the encode scale S_enc (2688 / amax)")
            sch = nvfp4._SCHEMES[scale_layout]
        else:
            sch = mx._SCHEMES[(fmt.name, scale_layout)]
        q_shape = _block_scale.data_shape(x.shape, fmt.bits)
        s_shape = _block_scale.block_scale_shape(x.shape, block, scale_layout)
        n_blocks, swizzled = H // block, scale_layout == "swizzled"
    inputs = (("x", x), ("weight", weight), ("residual", residual))
    if out is not None:
        _validate.out_array(out, "out", q_shape, q_dtype, device, inputs=inputs)
    if scale_out is not None:
        if lay is not None:
            _validate.scale_out(
                scale_out,
                lay.shape,
                s_dtype,
                device,
                inputs=inputs + (("out", out),),
                strides=lay.strides,
                nbytes=lay.words * 4,
                alloc="cupyquant.empty_scales()",
            )
        else:
            _validate.scale_out(scale_out, s_shape or (1,), s_dtype, device, inputs=inputs + (("out", out),))

    grid_rows = -(-rows // 128) * 128 if swizzled else rows
    na = np.array(
        (rows, grid_rows, x_stride, r_stride, q_shape[-1] if q_shape else 0, n_blocks, H, 0, 0, g_elems,
         swizzled, np.float32(eps), 0, 0.0, 0, 0),
        dtype=_NORM_ARGS,
    )  # fmt: skip
    if given is not None:
        na["s_mode"], na["s_arg"] = int(given.mode), given.value
    kernel, grid, block_dim = None, (), ()
    if grid_rows:
        ptrs = [x.data.ptr, weight.data.ptr] + ([residual.data.ptr] if residual is not None else [])
        vec = (
            H % 8 == 0
            and all(p % 16 == 0 for p in ptrs)
            and (x_stride * x.itemsize) % 16 == 0
            and (r_stride * x.itemsize) % 16 == 0
            and (out is None or out.data.ptr % 8 == 0)
        )
        warps = _team(H, x.itemsize, rows)
        kernel = _jit.kernel(device, _FAMILY, "rms_norm_quantize", in_t.ctype, _SCHEME_ID[scheme], fmt.ctag)
        threads = 32 * warps
        na["team_shift"], na["vec"] = threads.bit_length() - 1, vec
        block_dim = (max(groupwise._TOKEN_BLOCK, threads),)
        grid = (-(-grid_rows // (block_dim[0] // threads)),)
    else:
        _team(H, x.itemsize, rows)
    return _Plan(kernel, grid, block_dim, na, sa, q_shape, q_dtype, s_shape, lay, s_dtype, sch, given)


#: Plans of calls without caller buffers or device scales, per argument signature.
_PLANS = _plans.Plans()


def _signature(
    x,
    weight,
    eps,
    residual,
    scheme,
    dtype,
    group_size,
    scale_layout,
    scale_pow2,
    scale_dtype,
    scale_ub,
    scale,
    global_scale,
    out,
    scale_out,
):
    """What a plan depends on, or None where a call is not memoized (caller buffers, device scales or
    a scale bound, arguments that are not CuPy arrays)."""
    if (
        out is not None
        or scale_out is not None
        or scale_ub is not None
        or isinstance(scale, cupy.ndarray)
        or isinstance(global_scale, cupy.ndarray)
        or type(x) is not cupy.ndarray
        or type(weight) is not cupy.ndarray
        or (residual is not None and type(residual) is not cupy.ndarray)
    ):
        return None
    r = None if residual is None else (residual.shape, residual.strides, residual.dtype, residual.data.ptr & 15)
    return (
        x.shape, x.strides, x.dtype, x.data.device_id, x.data.ptr & 15,
        weight.shape, weight.strides, weight.dtype, weight.data.device_id, weight.data.ptr & 15,
        r, residual.data.device_id if residual is not None else None,
        type(eps), eps, scheme, dtype, group_size, type(group_size), scale_layout, bool(scale_pow2), scale_dtype,
        type(scale), scale, type(global_scale), global_scale,
    )  # fmt: skip


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
        "token"/"group": ``"row"`` (default) or ``"col"``; "mx"/"nvfp4": ``"dense"`` or
        ``"swizzled"`` (defaults ``"dense"`` for mx and ``"swizzled"`` for nvfp4, as the
        quantizers). "mx" needs H % 32 == 0, "nvfp4" H % 16 == 0.
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
    args = (x, weight, eps, residual, scheme, dtype, group_size, scale_layout, scale_pow2, scale_dtype, scale_ub,
            scale, global_scale, out, scale_out)  # fmt: skip
    key = _signature(*args)
    plan = _PLANS.lookup(key)
    if plan is None:
        plan = _PLANS.keep(key, _plan(*args))
    if residual is not None:  # depends on the addresses, so checked on every call
        _validate.disjoint(residual, "residual", (("x", x), ("weight", weight)))
    with _validate.on_device_of(x):
        q = cupy.empty(plan.q_shape, dtype=plan.q_dtype) if out is None else out
        if scale_out is not None:
            s = scale_out
        elif plan.lay is not None:
            s = plan.lay.view(cupy.cuda.alloc(max(plan.lay.words, 1) * 4), plan.s_dtype)
        else:
            s = cupy.empty(plan.s_shape or (1,), dtype=plan.s_dtype)
        y = cupy.empty(x.shape, dtype=x.dtype) if return_normalized else None
        na = plan.na
        if plan.given is not None:
            na = na.copy()
            na["s_ptr"] = 0 if plan.given.array is None else plan.given.array.data.ptr
            if plan.scheme.granularity == "tensor":
                na["s_out"] = s.data.ptr
            else:
                gs_out = cupy.empty((1,), dtype=np.float32)
                na["s_out"] = gs_out.data.ptr
        if plan.kernel is not None:
            plan.kernel(plan.grid, plan.block, (x, residual, weight, y, q, s, na[()], plan.sa))
        elif plan.given is not None:  # no rows: the scale the kernel would have stored
            dst = s if plan.scheme.granularity == "tensor" else gs_out
            dst[...] = plan.given.value if plan.given.array is None else plan.given.array.reshape(1)
    if plan.scheme.granularity == "tensor":
        qt = QuantizedTensor(q, s, plan.scheme, x.shape, x.dtype)
    elif plan.scheme.family == nvfp4._FAMILY:
        qt = QuantizedTensor(q, s, plan.scheme, x.shape, x.dtype, global_scale=gs_out)
    else:
        qt = QuantizedTensor(q, s, plan.scheme, x.shape, x.dtype)
    return (qt, y) if return_normalized else qt
