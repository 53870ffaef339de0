"""Weight quantization and the public conversions of a weight: :func:`quantize_weight` (INT4 and
FP8 through ``kernels/weight_quant.cu``, FP4 through the NVFP4 and MX quantizers),
:func:`dequantize_weight` and :func:`prepare_weight` (the package's docstring describes the two
layouts)."""

from __future__ import annotations

import cupy
import numpy as np

from .. import _checks, _validate, mx, nvfp4
from . import container, quant
from .checks import block_grid
from .container import QuantizedWeight
from .formats import FP4_BLOCK, weight_scheme


def quantize_weight(
    w, dtype="int4", *, group_size=_checks.DEFAULT_GROUP_SIZE, symmetric=True, block_size=None
) -> QuantizedWeight:
    """Quantize a weight ``w`` ``(N, K)`` (PyTorch Linear's ``[out, in]``) along K in groups, or
    (FP8) in 2-D blocks of 128 x 128, or to NVFP4 / MXFP4.

    Parameters
    ----------
    w : cupy.ndarray
        float32, float16 or bfloat16, 2-D, C-contiguous.
    dtype : {"int4", "uint4", "float8_e4m3fn", "int8", "nvfp4", "mxfp4"}
        ``"int4"`` with ``symmetric=True``: GPTQ/Marlin uint4b8, ``s = amax / 7``,
        ``q = clamp(rne(w / s), -8, 7) + 8``. ``"uint4"`` (or ``"int4"`` with ``symmetric=False``):
        AWQ-style asymmetric with integer zero points, ``s = max(max - min, 1e-5) / 15``,
        ``z = clamp(rne(-min / s), 0, 15)``, ``q = clamp(rne(w / s) + z, 0, 15)``.
        ``"float8_e4m3fn"``: W8A16, ``s = amax / 448``, ``q = e4m3(w / s)`` saturating.
        ``"int8"`` (``numpy.int8`` too; with ``group_size=None`` only): W8A8 INT8 weights
        (SmoothQuant, compressed-tensors, for :func:`cupyquant.scaled_matmul` with INT8
        activations), one scale per output channel, ``s = amax / 127``,
        ``q = clamp(rne(w / s), -128, 127)``, data int8 ``(N, K)`` (any K), and the weight's
        ``code_sum`` ``sum_k q`` (int32 ``(N,)``, exact) computed by the same kernel.
        ``"nvfp4"``: the bytes of :func:`cupyquant.quantize_nvfp4` (dense scales; its global scale
        from the whole weight, ``S_enc = 2688 / amax``): per block of 16 along K
        ``sf = e4m3(amax_b * S_enc / 6)``, ``q = e2m1(w / (e4m3(sf) / S_enc))``, and the weight's
        ``scale_2 = float32(1 / S_enc)`` (float32 ``(1,)``, subnormals kept), its decode scale:
        ``w ~ e2m1(q) * (e4m3(sf) * scale_2)``. ``"mxfp4"``: the bytes of
        :func:`cupyquant.quantize_mx` with ``"float4_e2m1fn"`` (rounding ``"ceil"``, dense scales):
        per block of 32, ``b = e8m0_ceil(amax_b / 6)``, ``q = e2m1(w * 2^(127 - b))``,
        ``w ~ e2m1(q) * 2^(b - 127)``. Both: K a nonzero multiple of the block (16, 32), any N;
        data uint8 ``(N, K / 2)`` (E2M1 codes, element 0 in the low nibble), ``scale`` uint8
        ``(N, K / block)`` (the E4M3 or E8M0 bytes), ``scheme.block`` ``(block,)``; bit-exact with
        :func:`cupyquant.reference.quantize_weight_fp4`.
        Scales are rounded to w's dtype before the division, so that dequantization inverts exactly
        what was stored; the weight's ``scale`` is ``s`` and its ``zero_point`` ``z``:
        ``w ~ (q - z) * s``. The maxima are over the finite weights; a NaN weight gives the zero
        code, +-inf the extreme codes, a group whose stored scale is 0 the zero code.
    group_size : {32, 64, 128, None}
        Elements of K per scale; ``None``: one scale per output channel. Must divide K. Leave it
        at its default with ``block_size`` (giving both is a ``ValueError``). ``"int8"`` needs
        ``None`` (its default 128 is a ``ValueError`` there). ``"nvfp4"`` and ``"mxfp4"`` have
        their own blocks: leave it at its default, or give the block (16, 32).
    symmetric : bool
        ``False`` selects zero points (INT4 only).
    block_size : {None, (128, 128)}
        ``(128, 128)`` (``"float8_e4m3fn"`` only): one scale per 2-D block of 128 rows by 128
        columns, DeepSeek-V3's FP8 weights, for :func:`cupyquant.scaled_matmul` (FP8 activations)
        and the weight-only :func:`matmul` (16-bit activations); any N and K (the
        blocks at the bottom and right edges are partial). Per block, over the weights that exist:
        ``amax = max |w|`` over the finite ones (0 if none), ``s = amax / 448`` in float32 (not
        rounded to w's dtype: checkpoints store float32 ``weight_scale_inv``),
        ``q = e4m3_satfinite(w / s)`` (float32 division, round to nearest even); NaN weights and
        every weight of a block whose ``s`` is 0 give the code 0x00, +-inf gives +-448. The
        weight's ``scale`` is float32 ``(ceil(N / 128), ceil(K / 128))``, its ``data`` uint8
        ``(N, K)``, ``scheme.granularity`` ``"block"``, ``scheme.block`` and ``block_size``
        ``(128, 128)``. :func:`matmul` takes it where K is a multiple of 64 (prepare it once
        with :func:`prepare_weight`). Bit-exact with
        :func:`cupyquant.reference.quantize_weight_blocks`.

    Returns
    -------
    QuantizedWeight
        In the plain layout. ``"int8"``: ``data`` int8 ``(N, K)``, ``scale`` ``(N, 1)`` of w's
        dtype, ``code_sum`` int32 ``(N,)``, ``scheme.granularity`` ``"channel"``; bit-exact with
        :func:`cupyquant.reference.quantize_weight_int8` and ``weight_code_sum``. It has no
        prepared layout and no weight-only :func:`matmul`.

    Raises
    ------
    TypeError
        ``w`` is not a CuPy array of float32, float16 or bfloat16; ``dtype`` names no dtype.
    ValueError
        ``w`` not 2-D, not C-contiguous or with an odd K (a zero K with ``block_size``; for
        ``"int8"`` a zero K or one above 2^24; for FP4 a K that is not a nonzero multiple of the
        block); an unsupported ``dtype``, ``group_size`` or
        ``block_size``, or a group size that does not divide K; ``symmetric=False`` with FP8 or
        INT8; ``block_size`` with INT4 or INT8 or with ``group_size``; ``"int8"`` without
        ``group_size=None``; FP4 with another ``group_size`` than the block, or with
        ``symmetric=False`` or ``block_size``.
    """
    scheme = _checks.weight_scheme(dtype, symmetric)
    if scheme == "int8":
        _checks.weight_int8_options(group_size, block_size)
    block = _checks.weight_block_size(scheme, block_size, group_size)
    if scheme in FP4_BLOCK:
        _checks.fp4_weight_group_size(scheme, FP4_BLOCK[scheme], group_size)
    t = _validate.float_input(w, "w")
    if w.ndim != 2:
        raise ValueError(f"w must be 2-D (N, K), got shape {w.shape}")
    _validate.c_contiguous(w, "w")
    if scheme in FP4_BLOCK:
        return _quantize_fp4(w, scheme)
    if scheme == "int8":
        return _quantize_int8(w, t)
    if block is not None:
        return _quantize_blocks(w, t, block)
    N, K = w.shape
    G = _checks.weight_group_size(K, group_size)
    ng = K // G
    with _validate.on_device_of(w):
        data = cupy.empty((N, K if scheme == "float8_e4m3fn" else K // 2), dtype=np.uint8)
        scales = cupy.empty((N, ng), dtype=w.dtype)
        zcodes = cupy.empty((N, ng), dtype=np.uint8) if scheme == "uint4" else None
        if N:
            quant.quantize_groups(w, t, scheme, G, data, scales, zcodes)
        zeros = None
        if zcodes is not None:
            temps = [zcodes]
            if ng % 2:
                temps.append(cupy.zeros((N, 1), np.uint8))
                zcodes = cupy.concatenate([zcodes, temps[-1]], axis=1)
                temps.append(zcodes)
            hi = zcodes[:, 1::2] << 4
            packed = zcodes[:, 0::2] | hi
            zeros = packed.astype(np.uint8)
            _validate.keep_if_capturing(*temps, hi, packed)
    return QuantizedWeight(data, scales, zeros, weight_scheme(scheme, group_size, K, w.dtype), (N, K), w.dtype)


def _quantize_int8(w, t) -> QuantizedWeight:
    """quantize_weight for "int8": one warp per row writes the codes, the scale and the row's code sum."""
    N, K = w.shape
    _checks.weight_int8_k(K)
    with _validate.on_device_of(w):
        data = cupy.empty((N, K), dtype=np.int8)
        scales = cupy.empty((N, 1), dtype=w.dtype)
        sums = cupy.empty((N,), dtype=np.int32)
        if N:
            quant.quantize_int8(w, t, data, scales, sums)
    scheme = weight_scheme("int8", None, K, w.dtype)
    return QuantizedWeight(data, scales, None, scheme, (N, K), w.dtype, code_sum=sums)


def _quantize_blocks(w, t, block) -> QuantizedWeight:
    """quantize_weight with block_size: one 256-thread block per 128 x 128 block of w."""
    N, K = w.shape
    if K == 0:
        raise ValueError(f"w's K must be nonzero, got shape {w.shape}")
    nb, kb = block_grid(N, K)
    if nb * kb >= 1 << 31:
        raise ValueError(f"w of shape {w.shape} has {nb * kb} blocks of 128 x 128, more than a grid holds (2^31 - 1)")
    with _validate.on_device_of(w):
        data = cupy.empty((N, K), dtype=np.uint8)
        scale = cupy.empty((nb, kb), dtype=np.float32)
        if N:
            quant.quantize_blocks(w, t, data, scale)
    scheme = weight_scheme("float8_e4m3fn", None, K, np.float32, block=block)
    return QuantizedWeight(data, scale, None, scheme, (N, K), w.dtype)


def _quantize_fp4(w, fmt: str) -> QuantizedWeight:
    """quantize_weight for "nvfp4" and "mxfp4" (w checked: a 2-D C-contiguous float CuPy array):
    the bytes of quantize_nvfp4 (the global scale reduced on the device) or quantize_mx (rounding
    "ceil"), with dense scales."""
    N, K = w.shape
    block = FP4_BLOCK[fmt]
    _checks.fp4_weight_k(fmt, block, K)
    with _validate.on_device_of(w):
        if fmt == "nvfp4":
            q = nvfp4.quantize_nvfp4(w, scale_layout="dense")
            scale_2 = quant.scale_2_of(q.global_scale)  # the decode scale, as dequantize_nvfp4 takes it
            _validate.keep_if_capturing(q.global_scale)
        else:
            q = mx.quantize_mx(w, "float4_e2m1fn", scale_layout="dense")
            scale_2 = None
    scheme = weight_scheme(fmt, block, K, w.dtype)
    return QuantizedWeight(q.data, q.scale, None, scheme, (N, K), w.dtype, scale_2=scale_2)


def prepare_weight(w: QuantizedWeight) -> QuantizedWeight:
    """``w`` in the layout the matmul kernels read (the module's docstring): a new
    :class:`QuantizedWeight` with ``data_layout == "prepared"``, made on the GPU by copies, bit-exact with
    :func:`cupyquant.reference.prepare_weight`; a prepared ``w`` is returned as is. Prepare a weight
    once and pass the result to every :func:`matmul`; :meth:`QuantizedWeight.plain` goes back.
    FP4 weights: the data in INT4's fragment order with the k permuted, the scale bytes
    ``(ceil(N / 16), K / 128, 16, 128 / block)``, ``scale_2`` as it is (the package's docstring).
    FP8 weights in 128 x 128 blocks: the data as other FP8 weights', the float32 block scales
    repeated for each row of their block, ``(ceil(N / 16), ceil(K / 128), 16)`` float32 (the scale
    of row n and k at ``[n // 16, k // 128, n % 16]``, never rounded); :meth:`QuantizedWeight.plain`
    gives back the block scales. :func:`cupyquant.scaled_matmul` reads the plain weight.

    Raises
    ------
    TypeError
        ``w`` is not a :class:`QuantizedWeight` on the GPU.
    ValueError
        K is not a multiple of 128 (INT4, NVFP4, MXFP4) or 64 (FP8, block weights included), the
        matmul's rule; ``w``'s arrays do not match its shape; ``w`` is an int8 weight (no prepared
        layout: it is for :func:`cupyquant.scaled_matmul` with INT8 activations).
    """
    return container.prepare(w)


def dequantize_weight(w: QuantizedWeight, out_dtype=None, *, out=None) -> cupy.ndarray:
    """``(N, K)`` weights in ``out_dtype`` (default the original's): ``round(float(q - z) * s)``
    (``s = w.scale``, ``z = w.zero_point``, 8 for int4) or ``round(fp8(q) * s)``, the product in
    float32 (exact for scales of float16 or bfloat16; a float32 scale, as block weights have, makes
    it an IEEE float32 product rounded once more to ``out_dtype``, as ``(fp8(q) * s).to(out_dtype)`` does
    in PyTorch). Block weights: ``s = w.scale[n // 128, k // 128]``. INT8 weights:
    ``round(float32(q) * s)`` with the row's scale, likewise (exact for float16 and bfloat16
    scales). NVFP4: ``round(e2m1(q) * float32(e4m3(s) * scale_2))``, MXFP4:
    ``round(e2m1(q) * 2^(b - 127))`` (the byte ``b`` 0 is the subnormal 2^-127, 255 NaN), both
    products IEEE float32; an E4M3 NaN scale byte gives NaN. Bit-exact with
    :func:`cupyquant.reference.dequantize_weight` (``dequantize_weight_blocks``,
    ``dequantize_weight_int8``, ``dequantize_weight_fp4``).

    Raises
    ------
    TypeError
        ``w`` is not a :class:`QuantizedWeight` on the GPU; ``out_dtype`` is not float32, float16 or
        bfloat16; ``out`` is not a CuPy array of that dtype.
    ValueError
        ``out`` of the wrong shape or device, not C-contiguous, or overlapping ``w``'s buffers
        (NVFP4's ``scale_2`` included); ``w``'s arrays do not match its shape and format.
    """
    return container.dequantize(w, out_dtype, out)
