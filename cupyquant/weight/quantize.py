"""Weight quantization and dequantization, and the prepared (tile-major) layout the matmul reads:
:func:`quantize_weight`, :func:`dequantize_weight`, :func:`prepare_weight` and the permutations
between the two layouts (the package's docstring describes both); INT8 (W8A8) weights and their
code sums (:func:`code_sums`)."""

from __future__ import annotations

import cupy
import numpy as np

from .. import _checks, _dtypes, _jit, _validate
from . import configs as C
from . import fp4
from .container import QuantizedWeight, weight_scheme


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
        columns, DeepSeek-V3's FP8 weights, for :func:`cupyquant.scaled_matmul`; any N and K (the
        blocks at the bottom and right edges are partial). Per block, over the weights that exist:
        ``amax = max |w|`` over the finite ones (0 if none), ``s = amax / 448`` in float32 (not
        rounded to w's dtype: checkpoints store float32 ``weight_scale_inv``),
        ``q = e4m3_satfinite(w / s)`` (float32 division, round to nearest even); NaN weights and
        every weight of a block whose ``s`` is 0 give the code 0x00, +-inf gives +-448. The
        weight's ``scale`` is float32 ``(ceil(N / 128), ceil(K / 128))``, its ``data`` uint8
        ``(N, K)``, ``scheme.granularity`` ``"block"``, ``scheme.block`` and ``block_size``
        ``(128, 128)``. Such a weight has no prepared layout and no weight-only :func:`matmul`:
        use :func:`cupyquant.scaled_matmul`, or :func:`dequantize_weight`. Bit-exact with
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
    if scheme in fp4.FORMATS:
        fp4.group_size_of(scheme, group_size)
    t = _validate.float_input(w, "w")
    if w.ndim != 2:
        raise ValueError(f"w must be 2-D (N, K), got shape {w.shape}")
    _validate.c_contiguous(w, "w")
    if scheme in fp4.FORMATS:
        return fp4.quantize(w, scheme)
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
            a = np.zeros((), dtype=C.QUANT_ARGS)
            a["N"], a["K"], a["ng"], a["G"] = N, K, ng, G
            k = _jit.kernel(w.data.device_id, C.QUANT_FAMILY, "weight_quantize", t.ctype, C.QUANT_SCHEME_IDS[scheme])
            warps = N * ng
            k((-(-warps // 8),), (256,), (w, data, scales, zcodes if zcodes is not None else 0, 0, a[()]))
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
    """quantize_weight for "int8": weight_quantize<T, W_INT8>, one warp per row, which writes the
    codes, the scale and the row's code sum."""
    N, K = w.shape
    _checks.weight_int8_k(K)
    with _validate.on_device_of(w):
        data = cupy.empty((N, K), dtype=np.int8)
        scales = cupy.empty((N, 1), dtype=w.dtype)
        sums = cupy.empty((N,), dtype=np.int32)
        if N:
            a = np.zeros((), dtype=C.QUANT_ARGS)
            a["N"], a["K"], a["ng"], a["G"] = N, K, 1, K
            k = _jit.kernel(w.data.device_id, C.QUANT_FAMILY, "weight_quantize", t.ctype, C.WEIGHT_INT8)
            k((-(-N // 8),), (256,), (w, data, scales, 0, sums, a[()]))
    scheme = weight_scheme("int8", None, K, w.dtype)
    return QuantizedWeight(data, scales, None, scheme, (N, K), w.dtype, code_sum=sums)


def code_sums(data):
    """``sum_k data[n, k]`` per row of int8 codes (a C-contiguous CuPy int8 ``(N, K)`` array, K up
    to 2^24), int32 ``(N,)``, exact (integer sums), on data's device and current stream, no host
    synchronization: one launch of ``weight_code_sum`` (one warp per row). None for anything else
    (``check_weight`` then names what is wrong). Bit-exact with
    :func:`cupyquant.reference.weight_code_sum`."""
    if not isinstance(data, cupy.ndarray) or data.dtype != np.int8 or data.ndim != 2 or not data.flags.c_contiguous:
        return None
    N, K = data.shape
    if K > _checks.INT8_WEIGHT_MAX_K:
        return None
    with _validate.on_device_of(data):
        sums = cupy.empty((N,), dtype=np.int32)
        if N:
            a = np.zeros((), dtype=C.QUANT_ARGS)
            a["N"], a["K"], a["ng"], a["G"] = N, K, 1, K
            k = _jit.kernel(data.data.device_id, C.QUANT_FAMILY, "weight_code_sum", C.WEIGHT_INT8)
            k((-(-N // 8),), (256,), (data, sums, a[()]))
    return sums


def _block_grid(N: int, K: int) -> tuple[int, int]:
    """The scale shape of 128 x 128 blocks, ``(ceil(N / 128), ceil(K / 128))``."""
    return -(-N // C.BLOCK), -(-K // C.BLOCK)


def _quantize_blocks(w, t, block) -> QuantizedWeight:
    """quantize_weight with block_size: one 256-thread block per 128 x 128 block of w."""
    N, K = w.shape
    if K == 0:
        raise ValueError(f"w's K must be nonzero, got shape {w.shape}")
    nb, kb = _block_grid(N, K)
    if nb * kb >= 1 << 31:
        raise ValueError(f"w of shape {w.shape} has {nb * kb} blocks of 128 x 128, more than a grid holds (2^31 - 1)")
    with _validate.on_device_of(w):
        data = cupy.empty((N, K), dtype=np.uint8)
        scale = cupy.empty((nb, kb), dtype=np.float32)
        if N:
            a = np.zeros((), dtype=C.BLOCK_ARGS)
            a["N"], a["K"], a["kb"] = N, K, kb
            k = _jit.kernel(w.data.device_id, C.QUANT_FAMILY, "weight_quantize_block", t.ctype)
            k((nb * kb,), (256,), (w, data, scale, a[()]))
    scheme = weight_scheme("float8_e4m3fn", None, K, np.float32, block=block)
    return QuantizedWeight(data, scale, None, scheme, (N, K), w.dtype)


def _check_block_weight(w) -> None:
    """check_weight's rules for a weight of granularity "block"."""
    N, K = w.shape
    if w._format != "float8_e4m3fn" or w.scheme.block != (C.BLOCK, C.BLOCK):
        raise ValueError(
            f"block weights are float8_e4m3fn in blocks of ({C.BLOCK}, {C.BLOCK}), "
            f"got format {w._format!r}, block {w.scheme.block}"
        )
    if w._prepared:
        raise ValueError("block weights have only the plain layout (scheme.scale_layout 'plain')")
    if w.zero_point is not None:
        raise ValueError("w.zero_point must be None for float8_e4m3fn weights")
    if w.data.shape != (N, K) or w.data.dtype != np.uint8:
        raise ValueError(
            f"w.data must be uint8 of shape {(N, K)} for a weight of shape {w.shape}, got {w.data.dtype} {w.data.shape}"
        )
    if w.scale.shape != _block_grid(N, K) or w.scale.dtype != np.float32:
        raise ValueError(
            f"w.scale must be float32 of shape {_block_grid(N, K)} (ceil(N / 128), ceil(K / 128)) for a "
            f"weight of shape {w.shape}, got {w.scale.dtype} {w.scale.shape}"
        )


def _check_int8_weight(w) -> None:
    """check_weight's rules for an int8 weight: plain, per channel, int8 data, int32 code sums."""
    N, K = w.shape
    if w.scheme.granularity != "channel" or w.scheme.block != (K,):
        raise ValueError(
            f"int8 weights have one scale per output channel (granularity 'channel', block ({K},)), "
            f"got granularity {w.scheme.granularity!r}, block {w.scheme.block}"
        )
    if w._prepared:
        raise ValueError("int8 weights have only the plain layout (scheme.scale_layout 'plain')")
    _checks.weight_int8_k(K, "w.shape")
    if w.zero_point is not None:
        raise ValueError("w.zero_point must be None for int8 weights (symmetric)")
    if w.data.shape != (N, K) or w.data.dtype != np.int8:
        raise ValueError(
            f"w.data must be int8 of shape {(N, K)} for an int8 weight of shape {w.shape}, "
            f"got {w.data.dtype} {w.data.shape}"
        )
    if w.scale.shape != (N, 1):
        raise ValueError(f"w.scale must have shape {(N, 1)}, got {w.scale.shape}")
    if w.code_sum is None:
        raise ValueError("w.code_sum must be the int32 code sums of an int8 weight, got None")
    _validate.cupy_array(w.code_sum, "w.code_sum")
    _validate.c_contiguous(w.code_sum, "w.code_sum")
    if w.code_sum.shape != (N,) or w.code_sum.dtype != np.int32:
        raise ValueError(f"w.code_sum must be int32 of shape {(N,)}, got {w.code_sum.dtype} {w.code_sum.shape}")
    _validate.same_device(w.code_sum, "w.code_sum", w.data.data.device_id, "w.data")


def check_weight(w) -> None:
    """Raise TypeError or ValueError unless ``w`` is a QuantizedWeight whose arrays are CuPy arrays
    of the shapes its scheme and shape say."""
    if not isinstance(w, QuantizedWeight):
        raise TypeError(f"w must be a QuantizedWeight (from cupyquant.quantize_weight), got {type(w).__name__}")
    for name in ("data", "scale") + (("zero_point",) if w.zero_point is not None else ()):
        _validate.cupy_array(getattr(w, name), f"w.{name}")
    _validate.c_contiguous(w.data, "w.data")
    _validate.c_contiguous(w.scale, "w.scale")
    if w.zero_point is not None:
        _validate.c_contiguous(w.zero_point, "w.zero_point")
    fmt = w._format
    N, K = w.shape
    if K <= 0 or N < 0:
        raise ValueError(f"w.shape must be (N >= 0, K > 0), got {w.shape}")
    if fmt == "int8":
        _check_int8_weight(w)
        return
    if getattr(w, "code_sum", None) is not None:
        raise ValueError(f"w.code_sum must be None for {fmt} weights (only int8 weights have code sums)")
    if fmt in fp4.FORMATS:
        fp4.check(w)
        return
    if getattr(w, "scale_2", None) is not None:
        raise ValueError(f"w.scale_2 must be None for {fmt} weights (only nvfp4 weights have a second scale)")
    if w.scheme.granularity == "block":
        _check_block_weight(w)
        return
    ng = K // w._group
    if w._prepared:
        n16, chunk = -(-N // 16), C.CHUNK[fmt]
        data_shape = (n16, K // chunk, 16, 64) if fmt == "float8_e4m3fn" else (n16, K // chunk, 2, 32, 16)
        shapes = {"data": data_shape, "scales": (n16, ng, 16), "zeros": (n16, ng, 8)}
        if K % chunk:
            raise ValueError(f"w.shape's K must be a multiple of {chunk} for a prepared weight, got w.shape {w.shape}")
    else:
        shapes = {
            "data": (N, K) if fmt == "float8_e4m3fn" else (N, K // 2),
            "scales": (N, ng),
            "zeros": (N, (ng + 1) // 2),
        }
    if w.data.shape != shapes["data"] or w.data.dtype != np.uint8:
        raise ValueError(
            f"w.data must be uint8 of shape {shapes['data']} for a {w.scheme.scale_layout} weight of shape {w.shape}, "
            f"got {w.data.dtype} {w.data.shape}"
        )
    if w.scale.shape != shapes["scales"]:
        raise ValueError(f"w.scale must have shape {shapes['scales']}, got {w.scale.shape}")
    if w.zero_point is not None and (w.zero_point.shape != shapes["zeros"] or w.zero_point.dtype != np.uint8):
        raise ValueError(
            f"w.zero_point must be uint8 of shape {shapes['zeros']}, got {w.zero_point.dtype} {w.zero_point.shape}"
        )
    if (w.zero_point is not None) != (fmt == "uint4"):
        raise ValueError(f"w.zero_point must be given for uint4 weights and only for them (format {fmt!r})")


def prepare_weight(w: QuantizedWeight) -> QuantizedWeight:
    """``w`` in the layout the matmul kernels read (the module's docstring): a new
    :class:`QuantizedWeight` with ``scheme.scale_layout == "prepared"``, made on the GPU by copies, bit-exact with
    :func:`cupyquant.reference.prepare_weight`; a prepared ``w`` is returned as is. Prepare a weight
    once and pass the result to every :func:`matmul`; :meth:`QuantizedWeight.plain` goes back.
    FP4 weights: the data in INT4's fragment order with the k permuted, the scale bytes
    ``(ceil(N / 16), K / 128, 16, 128 / block)``, ``scale_2`` as it is (the package's docstring).

    Raises
    ------
    TypeError
        ``w`` is not a :class:`QuantizedWeight` on the GPU.
    ValueError
        K is not a multiple of 128 (INT4, NVFP4, MXFP4) or 64 (FP8), the matmul's rule; ``w``'s arrays do not
        match its shape; ``w`` is a block weight (128 x 128 blocks have no prepared layout: they
        are for :func:`cupyquant.scaled_matmul`, which reads the plain layout) or an int8 weight
        (likewise, with INT8 activations).
    """
    check_weight(w)
    if w._format == "int8":
        raise ValueError(
            "w is an int8 (W8A8) weight, which has no prepared layout and no weight-only matmul: pass it as it "
            "is to cupyquant.scaled_matmul with INT8 activations, or dequantize it (w.dequantize())"
        )
    if w.block_size is not None:
        raise ValueError(
            f"w is a weight in {w.block_size} blocks, which has no prepared layout: pass it to "
            "cupyquant.scaled_matmul as it is"
        )
    if w._prepared:
        return w
    N, K = w.shape
    chunk = C.CHUNK[w._format]
    if K % chunk:
        raise ValueError(f"w's K = {K} must be a multiple of {chunk} for {w._format} weights (the kernel's K step)")
    with _validate.on_device_of(w.data):
        return prepared_of(w)


def plain_weight(w: QuantizedWeight) -> QuantizedWeight:
    """``w`` in the plain layout (itself if it is plain; a new copy if prepared)."""
    if not w._prepared:
        return w
    check_weight(w)
    with _validate.on_device_of(w.data):
        return plain_of(w)


def _pad_rows(x, rows, keep):
    if x.shape[0] == rows:
        return x
    y = keep(cupy.zeros((rows,) + x.shape[1:], x.dtype))
    y[: x.shape[0]] = x
    return y


def _nibbles(z, keep):
    """Packed uint8 (..., B) -> codes (..., 2 B), element 2 i the low nibble of byte i."""
    return keep(cupy.stack([keep(z & 15), keep(z >> 4)], axis=-1)).reshape(z.shape[:-1] + (2 * z.shape[-1],))


def _pack_pairs(codes, keep):
    """Codes (..., 2 B) -> packed uint8 (..., B), element 2 i in the low nibble of byte i."""
    out = keep(codes[..., 0::2] | keep(codes[..., 1::2] << 4))
    return out if out.dtype == np.uint8 else out.astype(np.uint8)


def _temps():
    """(keep, done): keep(x) records an intermediate array and returns it; done() keeps them all
    alive with the graph if the stream is capturing (every array made inside a capture must outlive
    the graph's replays, not return to the pool when the function returns)."""
    temps: list = []

    def keep(x):
        temps.append(x)
        return x

    return keep, lambda: _validate.keep_if_capturing(*temps)


# The INT4 fragment order's transposes (prepared_of, plain_of), and with the chunk's 4 x 4 blocks
# of 8 k transposed (k_permuted).
_FRAG, _FRAG_K_PERMUTED = (0, 3, 6, 2, 4, 5, 8, 9, 7, 1), (0, 3, 4, 2, 6, 7, 8, 9, 5, 1)
_PLAIN, _PLAIN_K_PERMUTED = (0, 9, 3, 1, 4, 5, 2, 8, 6, 7), (0, 9, 3, 1, 2, 8, 4, 5, 6, 7)


def k_permuted(w) -> bool:
    """Whether w's prepared INT4 chunks have their 4 x 4 blocks of 8 k transposed
    (reference.prepare_weight): INT4 weights whose groups are whole 128-k chunks (the matmul kernels
    then scale each chunk's float32 partial sums: scale_after_sum), and FP4 weights, always."""
    return w._format in fp4.FORMATS or w._format != "float8_e4m3fn" and w._group % 128 == 0


def prepared_of(w: QuantizedWeight) -> QuantizedWeight:
    """The copies of prepare_weight (plain w, on its device)."""
    N, K = w.shape
    n16, ng, chunk = -(-N // 16), K // w._group, C.CHUNK[w._format]
    keep, done = _temps()
    rows = _pad_rows(w.data, 16 * n16, keep)
    if w._format == "float8_e4m3fn":
        data = cupy.ascontiguousarray(rows.reshape(n16, 16, K // chunk, 64).transpose(0, 2, 1, 3))
    else:  # fragment order (reference.prepare_weight): k16 step s = 4 h + 2 u1 + u0 of a chunk, k = 16 s + 8 kb + 2 t + e
        codes = keep(
            _nibbles(rows, keep).reshape(n16, 2, 8, K // 128, 2, 2, 2, 2, 4, 2)
        )  # tile, row / 8, g, chunk, h, u1, u0, kb, t, e
        # [s % 2][g, s // 2][t, e, kb] pairs; k_permuted: the chunk's axes read (a1, a0, b1, b0) for
        # (h, u1, u0, kb): k = 32 a + 8 b + r goes where 32 b + 8 a + r would
        frag = keep(cupy.ascontiguousarray(codes.transpose(_FRAG_K_PERMUTED if k_permuted(w) else _FRAG)))
        data = _pack_pairs(frag.reshape(n16, K // 128, 2, 32, 32), keep)
    if w._format in fp4.FORMATS:
        scales, padded = fp4.prepared_scales(w)
        keep(padded)
    else:
        scales = cupy.ascontiguousarray(_pad_rows(w.scale, 16 * n16, keep).reshape(n16, 16, ng).transpose(0, 2, 1))
    zeros = None
    if w.zero_point is not None:
        codes = _nibbles(w.zero_point, keep)[:, :ng]
        tiles = keep(_pad_rows(codes, 16 * n16, keep).reshape(n16, 16, ng)).transpose(0, 2, 1)
        zeros = _pack_pairs(keep(cupy.ascontiguousarray(tiles)), keep)
    done()
    return w._with(data, scales, zeros, "prepared")


def plain_of(w: QuantizedWeight) -> QuantizedWeight:
    """The inverse of prepared_of (prepared w, on its device)."""
    N, K = w.shape
    n16, ng = w.data.shape[0], K // w._group
    keep, done = _temps()
    if w._format == "float8_e4m3fn":
        data = cupy.ascontiguousarray(keep(w.data.transpose(0, 2, 1, 3).reshape(16 * n16, -1))[:N])
    else:  # the inverse of prepared_of's fragment order
        frag = keep(
            _nibbles(w.data, keep).reshape(n16, K // 128, 2, 8, 2, 2, 4, 2, 2, 2)
        )  # tile, chunk, u0, g, h, u1, t, e, kb, row / 8
        inv = _PLAIN_K_PERMUTED if k_permuted(w) else _PLAIN
        codes = keep(cupy.ascontiguousarray(frag.transpose(inv)).reshape(16 * n16, K)[:N])
        data = _pack_pairs(codes, keep)
    if w._format in fp4.FORMATS:
        scales, t = fp4.plain_scales(w)
        keep(t)
    else:
        scales = cupy.ascontiguousarray(keep(w.scale.transpose(0, 2, 1).reshape(16 * n16, ng))[:N])
    zeros = None
    if w.zero_point is not None:
        codes = keep(_nibbles(w.zero_point, keep).transpose(0, 2, 1).reshape(16 * n16, ng))[:N]
        if ng % 2:
            codes = keep(cupy.concatenate([codes, keep(cupy.zeros((N, 1), np.uint8))], axis=1))
        zeros = _pack_pairs(keep(cupy.ascontiguousarray(codes)), keep)
    done()
    return w._with(data, scales, zeros, "plain")


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
    check_weight(w)
    out_t = _dtypes.input_type(w.dtype if out_dtype is None else out_dtype, "out_dtype")
    device = w.data.data.device_id
    N, K = w.shape
    if out is not None:
        _validate.out_array(out, "out", (N, K), out_t.dtype, device, inputs=(("w.data", w.data), ("w.scale", w.scale)))
    with _validate.on_device_of(w.data):
        if w._prepared:
            w = plain_of(w)
            _validate.keep_if_capturing(w.data, w.scale, w.zero_point)
        y = cupy.empty((N, K), dtype=out_t.dtype) if out is None else out
        if N and w._format in fp4.FORMATS:
            fp4.dequantize(w, out_t, y)
        elif N and w.block_size is not None:
            a = np.zeros((), dtype=C.BLOCK_ARGS)
            a["N"], a["K"], a["kb"] = N, K, w.scale.shape[1]
            k = _jit.kernel(device, C.QUANT_FAMILY, "weight_dequantize_block", out_t.ctype)
            k((-(-K // 256), min(N, C.MAX_GRID_Y)), (256,), (w.data, w.scale, y, a[()]))
        elif N and K:
            a = np.zeros((), dtype=C.QUANT_ARGS)
            a["N"], a["K"], a["ng"], a["G"] = N, K, K // w._group, w._group
            st = _dtypes.input_type(w.scale.dtype, "w.scale")
            k = _jit.kernel(
                device, C.QUANT_FAMILY, "weight_dequantize", st.ctype, out_t.ctype, C.QUANT_SCHEME_IDS[w._format]
            )
            grid = (-(-((K + 1) // 2) // 256), min(N, C.MAX_GRID_Y))  # element pairs (an int8 K may be odd)
            zeros = w.zero_point if w.zero_point is not None else 0
            k(grid, (256,), (w.data, w.scale, zeros, y, a[()]))
    return y
