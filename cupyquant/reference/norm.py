"""Reference of the fused (residual add +) RMSNorm + quantization (``kernels/rms_norm.cu``)."""

from __future__ import annotations

import numpy as np

from .. import _checks, _dtypes
from ._common import _as_f32, round_to
from .groupwise import quantize_groupwise
from .mx import quantize_mx
from .nvfp4 import quantize_nvfp4
from .per_tensor import quantize_fp8

#: Elements of one unit of the sum of squares.
NORM_UNIT = 8
#: The quantization schemes of :func:`rms_norm_quantize`.
NORM_SCHEMES = ("token", "group", "tensor", "mx", "nvfp4")


def sum_of_squares(z) -> np.ndarray:
    """The sum of squares of the last axis in the kernels' fixed order, float32 ``z.shape[:-1]``.

    Units of :data:`NORM_UNIT` consecutive elements (the last one zero-padded) are summed left to
    right, ``p = z0 * z0``, then ``p = p + zi * zi``, every product and sum rounded to float32 (no
    fused multiply-add). The unit sums are then added by a pairwise tree, lowest index bit first
    (``p[2u] + p[2u + 1]``, the units zero-padded to a power of two), to one value. The kernel gets
    exactly this order whatever number of threads holds a row."""
    z = np.asarray(z, dtype=np.float32)
    H = z.shape[-1]
    n_units = max(1, -(-H // NORM_UNIT))
    width = 1 << (n_units - 1).bit_length()
    zp = np.zeros(z.shape[:-1] + (width * NORM_UNIT,), np.float32)
    zp[..., :H] = z
    u = zp.reshape(z.shape[:-1] + (width, NORM_UNIT))
    with np.errstate(over="ignore", invalid="ignore"):
        sq = (u * u).astype(np.float32)
        p = sq[..., 0]
        for i in range(1, NORM_UNIT):
            p = (p + sq[..., i]).astype(np.float32)
        while p.shape[-1] > 1:
            p = (p[..., 0::2] + p[..., 1::2]).astype(np.float32)
    return p[..., 0]


def rms_norm(x, weight, *, eps=1e-6, residual=None):
    """RMSNorm of the last axis as the fused kernel computes it; returns ``(y, residual_out)``.

    With ``T`` the dtype of ``x`` (float32, float16 or bfloat16) and every float step IEEE float32:
    ``z = round_T(x + residual)`` (``residual_out = z``, the engines' in-place update) or ``z = x``
    (``residual_out`` None); ``ss = sum_of_squares(z)`` (:func:`sum_of_squares`);
    ``inv = 1 / sqrt(ss / H + float32(eps))`` (correctly rounded division and square root, not an
    approximate reciprocal square root); ``y = round_T(round_T(z * inv) * weight)``, the product with
    the weight computed in float32 (exact for 16-bit types) and rounded once to ``T``.

    vLLM's ``fused_add_rms_norm`` also rounds ``x + residual`` to ``T`` before the norm and rounds
    ``z * inv`` to ``T`` before the weight; its dynamic per-token quantized variant normalizes the
    unrounded float32 sum instead. Its sum of squares is a per-thread strided sum and a block
    reduction, whose order depends on the block size."""
    eps = _checks.norm_eps(eps)
    xf = _as_f32(x)
    _checks.at_least_1d(xf.ndim)
    dtype = np.asarray(x).dtype
    w = np.asarray(weight)
    if w.shape != (xf.shape[-1],) or w.dtype != dtype:
        raise ValueError(f"weight must be ({xf.shape[-1]},) of dtype {dtype}, got {w.shape} {w.dtype}")
    z_out = None
    if residual is not None:
        r = np.asarray(residual)
        if r.shape != xf.shape or r.dtype != dtype:
            raise ValueError(f"residual must match x ({xf.shape}, {dtype}), got {r.shape} {r.dtype}")
        with np.errstate(over="ignore", invalid="ignore"):
            z_out = round_to(xf + r.astype(np.float32), dtype)
        zf = z_out.astype(np.float32)
    else:
        zf = xf
    H = xf.shape[-1]
    ss = sum_of_squares(zf)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        inv = (np.float32(1) / np.sqrt((ss / np.float32(H)).astype(np.float32) + eps)).astype(np.float32)
        a = round_to((zf * inv[..., None]).astype(np.float32), dtype).astype(np.float32)
        y = round_to((a * w.astype(np.float32)).astype(np.float32), dtype)
    return y, z_out


def rms_norm_quantize(
    x,
    weight,
    *,
    eps=1e-6,
    residual=None,
    scheme="token",
    dtype=None,
    group_size=None,
    scale_pow2=False,
    scale_dtype="float32",
    scale_ub=None,
    scale=None,
    global_scale=None,
):
    """:func:`rms_norm`, then the ``scheme``'s quantizer applied to ``y``; returns
    ``(quantized, y, residual_out)`` with ``quantized`` what that quantizer returns:

    - ``"token"``: :func:`quantize_groupwise` (``group_size=None``) -> ``(q, scale)``
    - ``"group"``: :func:`quantize_groupwise` (``group_size``, default 128) -> ``(q, scale)``
    - ``"tensor"``: :func:`quantize_fp8` with the static decode ``scale`` -> ``(q, scale)``
    - ``"mx"``: :func:`quantize_mx` ("ceil" rule) -> ``(data, scale)``
    - ``"nvfp4"``: :func:`quantize_nvfp4` with the encode ``global_scale`` -> ``(data, scale, S_enc)``

    ``dtype`` defaults to ``"float8_e4m3fn"`` (``"float4_e2m1fn"`` for NVFP4)."""
    if scheme not in NORM_SCHEMES:
        raise ValueError(f"scheme={scheme!r} is not supported; expected one of {NORM_SCHEMES}")
    y, z = rms_norm(x, weight, eps=eps, residual=residual)
    name = _dtypes.element_format(
        ("float4_e2m1fn" if scheme == "nvfp4" else "float8_e4m3fn") if dtype is None else dtype, "dtype"
    ).name
    if scheme in ("token", "group"):
        gs = None if scheme == "token" else (128 if group_size is None else group_size)
        quantized = quantize_groupwise(
            y, name, group_size=gs, scale_pow2=scale_pow2, scale_dtype=scale_dtype, scale_ub=scale_ub
        )
    elif scheme == "tensor":
        quantized = quantize_fp8(y, name, scale=scale)
    elif scheme == "mx":
        quantized = quantize_mx(y, name)
    else:
        quantized = quantize_nvfp4(y, global_scale=global_scale)
    return quantized, y, z
