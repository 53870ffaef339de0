"""Weight-only quantization (INT4 as GPTQ/Marlin and AWQ, FP8 for W8A16) and the matmul that
dequantizes the weights in registers.

Kernels: ``kernels/weight.cu``. Reference: :func:`cupyquant.reference.quantize_weight` and
:func:`cupyquant.reference.dequantize_weight`.

Layouts. The plain layout is the interchange format (what :func:`quantize_weight` returns, what
:meth:`QuantizedWeight.to_host` gives, what to store): ``w`` is ``(N, K)`` in PyTorch Linear's
``[out, in]`` order; INT4 data ``(N, K / 2)`` uint8 with element 0 in the low nibble, FP8 data
``(N, K)`` uint8; scales ``(N, K / G)`` in the weight's dtype; uint4 zero points
``(N, ceil(K / G / 2))`` uint8, packed like the data.

The matmul kernels read the prepared layout that :func:`prepare_weight` makes on the GPU (once, at
load time, as Marlin's repacking): the rows in tiles of 16 (the last padded with zero rows), each
tile's K cut into chunks of 128 INT4 or 64 FP8 elements (64 bytes a row) stored one after the
other, 1 KB a chunk. INT4 data ``(ceil(N / 16), K / 128, 2, 32, 16)`` uint8 in fragment order: each
32-bit word holds the 8 codes that one lane of a warp feeds to one k16 tensor-core step (rows g and
g + 8 of the tile, k ``2t, 2t + 1, 2t + 8, 2t + 9`` of the step), arranged so that a shift and a
lop3 take out two codes at once, and each 16-byte piece holds the four lanes' words of one step,
so that the two pieces ``4 g + j`` of a chunk hold every code of rows g and g + 8 at k
``32 j .. 32 j + 31``; where the groups are whole chunks (``group_size`` a multiple of 128, or
per-channel), each chunk's 4 x 4 blocks of 8 k are transposed first, so that the four lanes of the
decode kernel that share a row read its activations 64 contiguous bytes at a time
(:func:`cupyquant.reference.prepare_weight` has the exact map). FP8
data ``(ceil(N / 16), K / 64, 16, 64)``: the 16 rows x 64 bytes of a chunk. Scales
``(ceil(N / 16), K / G, 16)`` (a tile's 16 scales of a group together); uint4 zero points
``(ceil(N / 16), K / G, 8)`` uint8 (row ``i`` of the tile in the low nibble of byte ``i / 2`` when
``i`` is even, the high one when odd). It is private to the kernels and may change between
versions; :func:`matmul` takes a plain weight too, converting it on every call (a copy of the
weight: prepare once instead).
"""

from __future__ import annotations

import math

import cupy
from cupy.cuda import driver as _driver
import ml_dtypes
import numpy as np

from . import _checks, _device, _dtypes, _jit, _launch, _layouts, _validate
from .quantized import register_container

_BOOLS = (False, True)
# Weight schemes of kernels/weight.cu (W_INT4, W_UINT4, W_FP8); the matmul takes fp16/bf16 only.
WEIGHT_INT4, WEIGHT_UINT4, WEIGHT_FP8 = 0, 1, 2
_SCHEME_IDS = {"int4": WEIGHT_INT4, "uint4": WEIGHT_UINT4, "float8_e4m3fn": WEIGHT_FP8}
# Configurations of the decode matmul (kernels/weight.cu MM_DEC3 ... MM_TWO_ONE): M <= 8 with 3
# or 4 blocks of 8 warps per SM, M tiles of 16 rows with blocks of 8 warps, M <= 8 with blocks of
# 16 warps, M <= 8 with blocks of 4, M tiles of 16 rows with blocks of 4 and of 16 warps (32 weight
# rows a block), with blocks of 4 and of 8 warps of 64 weight rows, and M tiles of 16 rows with
# blocks of 8 warps one per SM and two sets of partial sums (MM_TWO_ONE).
MATMUL_CONFIGS = tuple(range(10))
(MATMUL_DEC3, MATMUL_DEC4, MATMUL_TWO, MATMUL_WIDE, MATMUL_NARROW, MATMUL_TWO_NARROW, MATMUL_TWO_WIDE, MATMUL_FOUR,
 MATMUL_FOUR_WIDE, MATMUL_TWO_ONE) = MATMUL_CONFIGS
#: w4a16_gemm tile configurations (MT m16 tiles per warp, WM warps along M, STAGES) and the POST
#: values each is built with (kernels/weight_gemm.cu: MT = 4 has no registers for POST's partials).
GEMM_CONFIGS = {(1, 1, 4): _BOOLS, (2, 1, 4): _BOOLS, (4, 1, 4): (False,), (4, 2, 3): (False,)}
#: w4a16_wgmma tile configurations: (rows of a per tile, ring stages, 64-k halves per stage)
#: (kernels/weight_wgmma.cu), each built for both prepared INT4 orders (KP: _kperm).
WGMMA_CONFIGS = ((32, 6, 2), (64, 4, 2), (128, 5, 2), (256, 6, 1))
_INT4_IDS = (WEIGHT_INT4, WEIGHT_UINT4)
_FAMILY = _jit.register(
    "weight",
    _jit.product("weight_quantize", _dtypes.INPUT_CTYPES, _SCHEME_IDS.values())
    + _jit.product("weight_dequantize", _dtypes.INPUT_CTYPES, _dtypes.INPUT_CTYPES, _SCHEME_IDS.values())
    + _jit.product("w4a16_matmul", _dtypes.HALF_CTYPES, _SCHEME_IDS.values(), MATMUL_CONFIGS, _BOOLS),
)
_jit.register(
    "weight_gemm",
    [
        e
        for cfg, posts in GEMM_CONFIGS.items()
        for e in _jit.product("w4a16_gemm", _dtypes.HALF_CTYPES, _INT4_IDS, *[(v,) for v in cfg], posts)
    ],
)
# Hopper's wgmma exists only on sm_90a, and the kernel has no portable build (it traps elsewhere).
_jit.register(
    "weight_wgmma",
    [
        e
        for cfg in WGMMA_CONFIGS
        for e in _jit.product("w4a16_wgmma", _dtypes.HALF_CTYPES, _INT4_IDS, *[(v,) for v in cfg], _BOOLS)
    ],
    specific_targets=("90",),
    specific_required=True,
)
_CHUNK = {"int4": 128, "uint4": 128, "float8_e4m3fn": 64}  # K per warp iteration (weight.cu: 4 x VALS)
_MM_M = 16  # rows of a per block (one M tile: one or two mma B fragments)


def _mm_rows(two: bool, four: bool = False) -> int:
    """Weight rows (output columns) per decode block: weight.cu's 16 x mm_row_tiles(CFG), 64 in
    MM_FOUR."""
    return 64 if four else 32 if two else 16


# weight.cu MM_STAGES: weight chunks in flight per warp. Measured on the H100 (M = 1, bf16, INT4
# g128): 2 stages beat 3, 4, 6 and 8 on every benchmark shape (4096^2: 6.2 us with 2, 6.9 with 4,
# 7.4 with 6; 8192 x 28672: 48 us with 2, 53 with 4, 59 with 6); asking for a minimal shared-memory
# carveout (more L1) instead made no difference. Re-measured in session 16 (fragment order, every
# configuration of _DECODE_CONFIGS forced): 3 and 4 stages 1-20% slower on every shape and
# configuration (4096^2 M = 1 16-warp blocks 5.34 us with 2, 6.43 with 3, 6.28 with 4).
_MM_STAGES = 2


def _mm_warps(cfg: int) -> int:
    """Warps per decode block: weight.cu's mm_warps(CFG)."""
    return _DECODE_WARPS[cfg]


def _mm_smem(two: bool, warps: int = 8, four: bool = False) -> int:
    """Dynamic shared bytes of a decode block: the warps' rings of MM_STAGES chunks, each 16 bytes
    per lane of the 2 x RT weight rows (1 KB per 16 rows): weight.cu's mm_smem_bytes(CFG)."""
    return warps * _MM_STAGES * 1024 * (_mm_rows(two, four) // 16)

_MAX_GRID_Y = 65535
_LAYOUTS = ("plain", "prepared")

_WQ_ARGS = np.dtype([("N", np.int64), ("K", np.int64), ("ng", np.int64), ("G", np.int32)], align=True)
_MM_ARGS = np.dtype(
    [("M", np.int64), ("N", np.int64), ("K", np.int64), ("lda", np.int64), ("ng", np.int64), ("gshift", np.int32),
     ("early", np.int32)],
    align=True,
)


class QuantizedWeight:
    """A weight quantized by :func:`quantize_weight`.

    Attributes
    ----------
    data : cupy.ndarray
        uint8 ``(N, K / 2)`` (INT4, element 0 in the low nibble) or ``(N, K)`` (FP8 bytes); prepared:
        ``(ceil(N / 16), K / 128, 2, 32, 16)`` (INT4) or ``(ceil(N / 16), K / 64, 16, 64)`` (FP8) (the module's docstring).
    scales : cupy.ndarray
        ``(N, K / group_size)`` in the original weight's dtype; prepared:
        ``(ceil(N / 16), K / group_size, 16)``.
    zeros : cupy.ndarray or None
        uint4 only: zero points, uint8 ``(N, ceil(K / group_size / 2))``, packed like the data;
        prepared: ``(ceil(N / 16), K / group_size, 8)``.
    scheme : str
        ``"int4"`` (symmetric, codes ``q - 8``), ``"uint4"`` (asymmetric, ``q - z``) or
        ``"float8_e4m3fn"``.
    group_size : int or None
        ``None``: one scale per output channel.
    shape : tuple
        ``(N, K)`` of the original weight.
    dtype : numpy.dtype
        The original weight's dtype (and the scales').
    layout : {"plain", "prepared"}
        ``"plain"`` from :func:`quantize_weight`, ``"prepared"`` from :func:`prepare_weight`.
    """

    def __init__(self, data, scales, zeros, scheme, group_size, shape, dtype, layout="plain"):
        if layout not in _LAYOUTS:
            raise ValueError(f"layout must be one of {_LAYOUTS}, got {layout!r}")
        self.data, self.scales, self.zeros = data, scales, zeros
        self.scheme, self.group_size = scheme, group_size
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.layout = layout
        # the arrays a matmul has read (_arrays_key): later decode calls with the same arrays may
        # read them before the kernel before them completes (matmul, _early_ok)
        self._read_key = None

    @property
    def G(self) -> int:
        return self.shape[1] if self.group_size is None else self.group_size

    @property
    def nbytes(self) -> int:
        """Bytes on the device: data, scales and zero points."""
        return self.data.nbytes + self.scales.nbytes + (0 if self.zeros is None else self.zeros.nbytes)

    def dequantize(self, dtype=None, *, out=None) -> cupy.ndarray:
        """``(N, K)`` in ``dtype`` (default: the original weight's), bit-exact with
        :func:`cupyquant.reference.dequantize_weight`."""
        return dequantize_weight(self, dtype, out=out)

    def copy(self) -> "QuantizedWeight":
        """A copy with its own device arrays (same layout)."""
        z = None if self.zeros is None else self.zeros.copy()
        return QuantizedWeight(self.data.copy(), self.scales.copy(), z, self.scheme, self.group_size, self.shape,
                               self.dtype, self.layout)

    def prepare(self) -> "QuantizedWeight":
        """:func:`prepare_weight` of this weight."""
        return prepare_weight(self)

    def plain(self) -> "QuantizedWeight":
        """This weight in the plain layout (itself if it is plain; a new copy if prepared)."""
        if self.layout == "plain":
            return self
        _check_weight(self)
        with _validate.on_device_of(self.data):
            return _plain_of(self)

    def to_host(self) -> dict:
        """NumPy copies in the plain layout (a prepared weight is converted first): ``data``
        (packed), ``codes`` (INT4 unpacked, one per byte, or FP8 as ``ml_dtypes.float8_e4m3fn``),
        ``scales``, ``zeros`` (unpacked codes, or None)."""
        w = self.plain()
        data = cupy.asnumpy(w.data)
        N, K = w.shape
        ng = K // w.G
        if w.scheme == "float8_e4m3fn":
            codes = data.view(ml_dtypes.float8_e4m3fn)
        else:
            codes = _layouts.unpack_fp4(data, K)
        zeros = None if w.zeros is None else _layouts.unpack_fp4(cupy.asnumpy(w.zeros), ng)
        return {"data": data, "codes": codes, "scales": cupy.asnumpy(w.scales), "zeros": zeros}

    def __repr__(self) -> str:
        g = "per-channel" if self.group_size is None else f"group_size={self.group_size}"
        lay = "" if self.layout == "plain" else ", prepared"
        return (f"QuantizedWeight({self.scheme}, shape={self.shape}, {g}, scales {self.dtype.name}{lay}, "
                f"{self.nbytes} bytes)")


def quantize_weight(w, dtype="int4", *, group_size=128, symmetric=True) -> QuantizedWeight:
    """Quantize a weight ``w`` ``(N, K)`` (PyTorch Linear's ``[out, in]``) along K in groups.

    Parameters
    ----------
    w : cupy.ndarray
        float32, float16 or bfloat16, 2-D, C-contiguous.
    dtype : {"int4", "uint4", "float8_e4m3fn"}
        ``"int4"`` with ``symmetric=True``: GPTQ/Marlin uint4b8, ``s = amax / 7``,
        ``q = clamp(rne(w / s), -8, 7) + 8``. ``"uint4"`` (or ``"int4"`` with ``symmetric=False``):
        AWQ-style asymmetric with integer zero points, ``s = max(max - min, 1e-5) / 15``,
        ``z = clamp(rne(-min / s), 0, 15)``, ``q = clamp(rne(w / s) + z, 0, 15)``.
        ``"float8_e4m3fn"``: W8A16, ``s = amax / 448``, ``q = e4m3(w / s)`` saturating.
        Scales are rounded to w's dtype before the division, so that dequantization inverts exactly
        what was stored.
    group_size : {32, 64, 128, None}
        Elements of K per scale; ``None``: one scale per output channel. Must divide K.
    symmetric : bool
        ``False`` selects zero points (INT4 only).

    Returns
    -------
    QuantizedWeight

    Raises
    ------
    TypeError
        ``w`` is not a CuPy array of float32, float16 or bfloat16; ``dtype`` names no dtype.
    ValueError
        ``w`` not 2-D, not C-contiguous or with an odd K; an unsupported ``dtype`` or
        ``group_size``, or one that does not divide K; ``symmetric=False`` with FP8.
    """
    scheme = _checks.weight_scheme(dtype, symmetric)
    t = _validate.float_input(w, "w")
    if w.ndim != 2:
        raise ValueError(f"w must be 2-D (N, K), got shape {w.shape}")
    _validate.c_contiguous(w, "w")
    N, K = w.shape
    G = _checks.weight_group_size(K, group_size)
    ng = K // G
    with _validate.on_device_of(w):
        data = cupy.empty((N, K if scheme == "float8_e4m3fn" else K // 2), dtype=np.uint8)
        scales = cupy.empty((N, ng), dtype=w.dtype)
        zcodes = cupy.empty((N, ng), dtype=np.uint8) if scheme == "uint4" else None
        if N:
            a = np.zeros((), dtype=_WQ_ARGS)
            a["N"], a["K"], a["ng"], a["G"] = N, K, ng, G
            k = _jit.kernel(w.data.device_id, _FAMILY, "weight_quantize", t.ctype, _SCHEME_IDS[scheme])
            warps = N * ng
            k((-(-warps // 8),), (256,), (w, data, scales, zcodes if zcodes is not None else 0, a[()]))
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
    return QuantizedWeight(data, scales, zeros, scheme, group_size, (N, K), w.dtype)


def _check_weight(w) -> None:
    if not isinstance(w, QuantizedWeight):
        raise TypeError(f"w must be a QuantizedWeight (from cupyquant.quantize_weight), got {type(w).__name__}")
    for name in ("data", "scales") + (("zeros",) if w.zeros is not None else ()):
        _validate.cupy_array(getattr(w, name), f"w.{name}")
    _validate.c_contiguous(w.data, "w.data")
    _validate.c_contiguous(w.scales, "w.scales")
    if w.zeros is not None:
        _validate.c_contiguous(w.zeros, "w.zeros")
    N, K = w.shape
    if K <= 0 or N < 0:
        raise ValueError(f"w.shape must be (N >= 0, K > 0), got {w.shape}")
    ng = K // w.G
    if w.layout == "prepared":
        n16, chunk = -(-N // 16), _CHUNK[w.scheme]
        data_shape = (n16, K // chunk, 16, 64) if w.scheme == "float8_e4m3fn" else (n16, K // chunk, 2, 32, 16)
        shapes = {"data": data_shape, "scales": (n16, ng, 16), "zeros": (n16, ng, 8)}
        if K % chunk:
            raise ValueError(f"w.shape's K must be a multiple of {chunk} for a prepared weight, got w.shape {w.shape}")
    else:
        shapes = {"data": (N, K) if w.scheme == "float8_e4m3fn" else (N, K // 2), "scales": (N, ng),
                  "zeros": (N, (ng + 1) // 2)}
    if w.data.shape != shapes["data"] or w.data.dtype != np.uint8:
        raise ValueError(f"w.data must be uint8 of shape {shapes['data']} for a {w.layout} weight of shape {w.shape}, "
                         f"got {w.data.dtype} {w.data.shape}")
    if w.scales.shape != shapes["scales"]:
        raise ValueError(f"w.scales must have shape {shapes['scales']}, got {w.scales.shape}")
    if w.zeros is not None and (w.zeros.shape != shapes["zeros"] or w.zeros.dtype != np.uint8):
        raise ValueError(f"w.zeros must be uint8 of shape {shapes['zeros']}, got {w.zeros.dtype} {w.zeros.shape}")
    if (w.zeros is not None) != (w.scheme == "uint4"):
        raise ValueError(f"w.zeros must be given for uint4 weights and only for them (scheme {w.scheme!r})")


def prepare_weight(w: QuantizedWeight) -> QuantizedWeight:
    """``w`` in the layout the matmul kernels read (the module's docstring): a new
    :class:`QuantizedWeight` with ``layout="prepared"``, made on the GPU by copies, bit-exact with
    :func:`cupyquant.reference.prepare_weight`; a prepared ``w`` is returned as is. Prepare a weight
    once and pass the result to every :func:`matmul`; :meth:`QuantizedWeight.plain` goes back.

    Raises
    ------
    TypeError
        ``w`` is not a :class:`QuantizedWeight` on the GPU.
    ValueError
        K is not a multiple of 128 (INT4) or 64 (FP8), the matmul's rule; ``w``'s arrays do not
        match its shape.
    """
    _check_weight(w)
    if w.layout == "prepared":
        return w
    N, K = w.shape
    chunk = _CHUNK[w.scheme]
    if K % chunk:
        raise ValueError(f"w's K = {K} must be a multiple of {chunk} for {w.scheme} weights (the kernel's K step)")
    with _validate.on_device_of(w.data):
        return _prepared_of(w)


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


# The INT4 fragment order's transposes (_prepared_of, _plain_of), and with the chunk's 4 x 4 blocks
# of 8 k transposed (_kperm).
_FRAG, _FRAG_KPERM = (0, 3, 6, 2, 4, 5, 8, 9, 7, 1), (0, 3, 4, 2, 6, 7, 8, 9, 5, 1)
_PLAIN, _PLAIN_KPERM = (0, 9, 3, 1, 4, 5, 2, 8, 6, 7), (0, 9, 3, 1, 2, 8, 4, 5, 6, 7)


def _kperm(w) -> bool:
    """Whether w's prepared INT4 chunks have their 4 x 4 blocks of 8 k transposed
    (reference.prepare_weight): INT4 weights whose groups are whole 128-k chunks."""
    return w.scheme != "float8_e4m3fn" and w.G % 128 == 0


def _prepared_of(w: QuantizedWeight) -> QuantizedWeight:
    """The copies of prepare_weight (plain w, on its device)."""
    N, K = w.shape
    n16, ng, chunk = -(-N // 16), K // w.G, _CHUNK[w.scheme]
    keep, done = _temps()
    rows = _pad_rows(w.data, 16 * n16, keep)
    if w.scheme == "float8_e4m3fn":
        data = cupy.ascontiguousarray(rows.reshape(n16, 16, K // chunk, 64).transpose(0, 2, 1, 3))
    else:  # fragment order (reference.prepare_weight): k16 step s = 4 h + 2 u1 + u0 of a chunk, k = 16 s + 8 kb + 2 t + e
        codes = keep(_nibbles(rows, keep).reshape(n16, 2, 8, K // 128, 2, 2, 2, 2, 4, 2))  # tile, row / 8, g, chunk, h, u1, u0, kb, t, e
        # [s % 2][g, s // 2][t, e, kb] pairs; with _kperm the chunk's axes read (a1, a0, b1, b0) for
        # (h, u1, u0, kb): k = 32 a + 8 b + r goes where 32 b + 8 a + r would
        frag = keep(cupy.ascontiguousarray(codes.transpose(_FRAG_KPERM if _kperm(w) else _FRAG)))
        data = _pack_pairs(frag.reshape(n16, K // 128, 2, 32, 32), keep)
    scales = cupy.ascontiguousarray(_pad_rows(w.scales, 16 * n16, keep).reshape(n16, 16, ng).transpose(0, 2, 1))
    zeros = None
    if w.zeros is not None:
        codes = _nibbles(w.zeros, keep)[:, :ng]
        tiles = keep(_pad_rows(codes, 16 * n16, keep).reshape(n16, 16, ng)).transpose(0, 2, 1)
        zeros = _pack_pairs(keep(cupy.ascontiguousarray(tiles)), keep)
    done()
    return QuantizedWeight(data, scales, zeros, w.scheme, w.group_size, w.shape, w.dtype, layout="prepared")


def _plain_of(w: QuantizedWeight) -> QuantizedWeight:
    """The inverse of _prepared_of (prepared w, on its device)."""
    N, K = w.shape
    n16, ng = w.data.shape[0], K // w.G
    keep, done = _temps()
    if w.scheme == "float8_e4m3fn":
        data = cupy.ascontiguousarray(keep(w.data.transpose(0, 2, 1, 3).reshape(16 * n16, -1))[:N])
    else:  # the inverse of _prepared_of's fragment order
        frag = keep(_nibbles(w.data, keep).reshape(n16, K // 128, 2, 8, 2, 2, 4, 2, 2, 2))  # tile, chunk, u0, g, h, u1, t, e, kb, row / 8
        inv = _PLAIN_KPERM if _kperm(w) else _PLAIN
        codes = keep(cupy.ascontiguousarray(frag.transpose(inv)).reshape(16 * n16, K)[:N])
        data = _pack_pairs(codes, keep)
    scales = cupy.ascontiguousarray(keep(w.scales.transpose(0, 2, 1).reshape(16 * n16, ng))[:N])
    zeros = None
    if w.zeros is not None:
        codes = keep(_nibbles(w.zeros, keep).transpose(0, 2, 1).reshape(16 * n16, ng))[:N]
        if ng % 2:
            codes = keep(cupy.concatenate([codes, keep(cupy.zeros((N, 1), np.uint8))], axis=1))
        zeros = _pack_pairs(keep(cupy.ascontiguousarray(codes)), keep)
    done()
    return QuantizedWeight(data, scales, zeros, w.scheme, w.group_size, w.shape, w.dtype)


def dequantize_weight(w: QuantizedWeight, dtype=None, *, out=None) -> cupy.ndarray:
    """``(N, K)`` weights in ``dtype`` (default the original's): ``round(float(q - z) * s)``
    (``z = 8`` for int4) or ``round(fp8(q) * s)``, the product in float32 (exact).

    Raises
    ------
    TypeError
        ``w`` is not a :class:`QuantizedWeight` on the GPU; ``dtype`` is not float32, float16 or
        bfloat16; ``out`` is not a CuPy array of that dtype.
    ValueError
        ``out`` of the wrong shape or device, not C-contiguous, or overlapping ``w``'s buffers.
    """
    _check_weight(w)
    out_t = _dtypes.input_type(w.dtype if dtype is None else dtype, "dtype")
    device = w.data.data.device_id
    N, K = w.shape
    if out is not None:
        _validate.out_array(out, "out", (N, K), out_t.dtype, device, inputs=(("w.data", w.data), ("w.scales", w.scales)))
    with _validate.on_device_of(w.data):
        if w.layout == "prepared":
            w = _plain_of(w)
            _validate.keep_if_capturing(w.data, w.scales, w.zeros)
        y = cupy.empty((N, K), dtype=out_t.dtype) if out is None else out
        if N and K:
            a = np.zeros((), dtype=_WQ_ARGS)
            a["N"], a["K"], a["ng"], a["G"] = N, K, K // w.G, w.G
            st = _dtypes.input_type(w.scales.dtype, "w.scales")
            k = _jit.kernel(device, _FAMILY, "weight_dequantize", st.ctype, out_t.ctype, _SCHEME_IDS[w.scheme])
            grid = (-(-(K // 2) // 256), min(N, _MAX_GRID_Y))
            zeros = w.zeros if w.zeros is not None else 0
            k(grid, (256,), (w.data, w.scales, zeros, y, a[()]))
    return y


# The pipelined tensor-core kernel (kernels/weight_gemm.cu): tile configuration by M.
_GEMM_BN = 128  # output columns per block (GM_BN)
_GEMM_BK = 128  # K per pipeline stage (GM_BK)
# (largest M, (MT, WM, STAGES)): the smallest tile that covers M, so each weight byte is read once
# per ceil(M / BM) row tiles; past 64 rows, 128-row tiles of 8 warps.
_GEMM_TILES = ((16, (1, 1, 4)), (32, (2, 1, 4)), (64, (4, 1, 4)), (None, (4, 2, 3)))
# Which kernel takes INT4 weights, by M and the weight's size N * K, from scripts/bench.py --matmul
# --matmul-paths on an H200 (2026-11-21; bf16, group 128, us per call, decode / pipelined):
#   N x K          M=1        16         32          64          128         256          1024
#   4096x4096      9.0/18     11/26      15/69       25/113      46/115      87/114       312/189
#   14336x4096     21/34      26/45      45/68       78/100      149/132     288/171      -
#   28672x8192     68/93      88/107     160/141     311/212     612/333     1226/667     4537/2593
# The decode kernel reads each weight once per 16 rows, so its time grows with M from the start;
# the pipelined kernel reads it once per 16..128-row tile but pays a pipeline fill and a split-K
# fixup, which a small weight does not amortize. So: decode for M <= DECODE_MAX_M, or up to
# _DECODE_SMALL_M for weights of fewer than _SMALL_W elements and _DECODE_MID_M below _MID_W.
DECODE_MAX_M = 16
_DECODE_SMALL_M, _SMALL_W = 256, 1 << 25
_DECODE_MID_M, _MID_W = 64, 1 << 26
# FP8 weights always take the decode kernel (the tensor-core kernels are INT4 only).
# On compute capability 9.0 the tensor-core path is weight_wgmma.cu, which splits K when its tiles
# cannot fill the GPU (_wg_plan). Its time hardly grows with M while the tiles are few, and the
# decode kernel's grows in proportion to M, so the crossover falls with N. Measured on the H100
# (session 13, stages of 128 k and 2-way splits as clusters; bf16, g128, us, decode / the best
# wgmma plan of scripts-style forced plans):
#   N x K         M=16           32             64
#   4096x4096     7.7/14.9       10.6/15.0      19.6/15.0
#   14336x4096    19.6/25.4      36.0/25.6      62.3/25.7
#   4096x14336    19.1/30.5      27.5/30.5      53.0/30.5
#   28672x8192    63.1/84.2      111.8/84.7     210.3/86.8
#   8192x28672    54.3/83.6      102.8/83.6     198.5/83.6
# (the same crossover as session 12's measurements: 4096 x 4096 M = 32 12.2 / ~19, M = 64
# 19.5 / 19.0). So the decode kernel keeps M <= _WG_DECODE_MAX_M while M x N < _WG_DECODE_MN_PER_SM x SMs
# (202,752 on 132 SMs: N = 4096 up to M = 32, N = 8192 up to M = 24, N = 14336 only M <= 16).
# _WG_DECODE_MAX_M was 256 until session 18, when the decode kernel's 64-row blocks (MM_FOUR_WIDE)
# made 2 M tiles faster and 3 still slower. Measured then on an H200 (no H100 was free; 132 SMs as
# well; bf16, g128, us, decode / wgmma, each the better of two interleaved runs):
#   N x K         M=24          32            40            48            64
#   4096x4096     8.53/10.76    8.49/10.80    12.85/10.90   12.87/10.94   13.13/11.09
#   4096x14336    20.54/26.63   20.74/26.78   37.09/26.87   36.95/26.92   37.58/27.73
#   3072x8192     13.22/14.06   13.38/14.17   22.53/14.24   22.66/14.10   22.25/14.21
#   2048x8192     9.33/10.96    9.48/11.08    12.89/11.07   12.75/11.09   12.90/11.22
#   6144x4096     12.91/13.68   13.01/13.95   19.57/13.99   19.98/14.13   23.16/14.24
#   8192x8192     23.40/24.32   24.05/24.73   (wgmma by the M x N rule from M = 25)
# With 3 M tiles (M > 32) the decode kernel was slower on 9 of the 10 shapes measured, by up to
# 60%; with 2 or fewer it was faster wherever the M x N rule gives it the call. The exception,
# 5120 x 5120 (decode 5% faster at M = 40 and 48, where the M x N bound already gave wgmma), means
# the new bound likely gives up about 5% there at M = 33-39.
_WGMMA_ARCHS = ("90",)
_WG_DECODE_MAX_M = 32
_WG_DECODE_MN_PER_SM = 1536
#: Tests and benchmarks set this to "decode", "pipelined" or "wgmma" to force INT4 matmuls onto one
#: kernel ("wgmma" needs compute capability 9.0; FP8 weights always take "decode").
FORCE_PATH = None

_GM_ARGS = np.dtype(
    [("M", np.int64), ("N", np.int64), ("K", np.int64), ("lda", np.int64), ("ng", np.int64), ("gshift", np.int32),
     ("splits", np.int32), ("iters", np.int32), ("kperm", np.int32)],
    align=True,
)
# weight_wgmma.cu's WgArgs: the same layout, the last field the early flag (weight_wgmma.cu, _early_ok)
_WG_ARGS = np.dtype([(n if n != "kperm" else "early", _GM_ARGS.fields[n][0]) for n in _GM_ARGS.names], align=True)
_occupancy: dict = {}
_decode_smem_set: set = set()  # ids of the decode kernels whose shared-memory limit is raised


def _gemm_config(M: int):
    for limit, cfg in _GEMM_TILES:
        if limit is None or M <= limit:
            return cfg


def matmul_path(M: int, w: QuantizedWeight, *, arch=None, sms=None) -> str:
    """The kernel :func:`matmul` uses for ``M`` rows of activations: ``"decode"`` (the split-K
    kernel of ``weight.cu``, one 16-row tile per block), ``"wgmma"`` (``weight_wgmma.cu``, Hopper's
    warpgroup tensor-core instructions, on GPUs of compute capability 9.0) or ``"pipelined"``
    (``weight_gemm.cu``, ``mma.sync``, on the other GPUs).

    ``arch`` is the compute capability as CuPy spells it (``"90"``) and ``sms`` the GPU's
    multiprocessor count; by default the current device's, or (no GPU) none, which gives
    ``"pipelined"`` for the tensor-core path, and 132 (an H100 SXM)."""
    if FORCE_PATH is not None and (w.scheme != "float8_e4m3fn" or FORCE_PATH == "decode"):
        return FORCE_PATH
    if w.scheme == "float8_e4m3fn" or M <= DECODE_MAX_M:
        return "decode"
    N, K = w.shape
    if arch is None:
        arch = _device.current_arch()
    if arch in _WGMMA_ARCHS and K < 1 << 31:  # the kernel's group index is 32-bit
        if sms is None:
            sms = _device.current_sm_count()
        if M <= _WG_DECODE_MAX_M and M * N < _WG_DECODE_MN_PER_SM * sms:
            return "decode"
        return "wgmma"
    if M <= _DECODE_SMALL_M and N * K < _SMALL_W or M <= _DECODE_MID_M and N * K < _MID_W:
        return "decode"
    return "pipelined"


def _gemm_kernel(device, t, w, M):
    mt, wm, stages = _gemm_config(M)
    post = w.G % _GEMM_BK == 0 and mt < 4
    k = _jit.kernel(device, "weight_gemm", "w4a16_gemm", t.ctype, _SCHEME_IDS[w.scheme], mt, wm, stages, post)
    bm = 16 * mt * wm
    smem = stages * (bm * _GEMM_BK * 2 + _GEMM_BN * _GEMM_BK // 2)
    threads = 128 * wm
    return k, bm, threads, smem


def _occupancy_of(device, k, threads: int, smem: int) -> int:
    """Blocks of ``k`` per SM; the first call per kernel also raises its shared-memory limit past
    the 48 KiB default (the function keeps the attribute)."""
    key = (device, id(k))
    occ = _occupancy.get(key)
    if occ is None:
        k.max_dynamic_shared_size_bytes = smem
        occ = _occupancy[key] = max(1, _driver.occupancyMaxActiveBlocksPerMultiprocessor(k.kernel.ptr, threads, smem))
    return occ


_MIN_SPLIT_STAGES = 4  # each split streams at least this many stages of K (pipeline fill, reduction)


def _splits(tiles: int, iters_total: int, blocks: int):
    """(splits, stages per split): split K across blocks until the tiles fill ``blocks`` slots,
    keeping at least ``_MIN_SPLIT_STAGES`` stages per split."""
    if tiles >= blocks:
        return 1, iters_total
    splits = max(1, min(iters_total // _MIN_SPLIT_STAGES, -(-blocks // tiles)))
    iters = -(-iters_total // splits)
    return -(-iters_total // iters), iters


def matmul(a, w: QuantizedWeight, *, out=None, pdl=None) -> cupy.ndarray:
    """``a @ dequant(w).T`` in ``a``'s dtype, accumulated in float32, the weights dequantized in
    registers on their way to the tensor cores (``mma.sync``); the 4-bit form is never expanded in
    memory.

    Parameters
    ----------
    a : cupy.ndarray
        float16 or bfloat16, shape ``(..., K)``; leading dimensions are flattened into M rows.
        Rows that are not 16-byte aligned with a unit stride along K are copied first.
    w : QuantizedWeight
        Prepared by :func:`prepare_weight` (the layout the kernels read), or plain, which is then
        converted on every call: a copy of the weight through memory, several times the matmul's
        own time at decode, so prepare a weight once and reuse it. Its scales must have ``a``'s
        dtype (the kernel dequantizes in that dtype; quantize a weight of the activation dtype).
        K must be a multiple of 128 (INT4) or 64 (FP8).
    out : cupy.ndarray, optional
        ``(..., N)`` of ``a``'s dtype, C-contiguous.
    pdl : bool, optional
        Programmatic dependent launch (FlashInfer's ``enable_pdl``): the matmul kernel is launched
        so that it may start while the kernel before it on the stream is still running, its
        blocks set up on the SMs and waiting there, before any load of ``a``, for that kernel to
        complete; and it lets the kernel after it (another PDL launch) do the same. The result is
        the same either way. None (the default) turns it on on GPUs of compute capability 9.0 and
        newer, the ones that have it; True elsewhere is a ``ValueError``. It works in CUDA graphs
        (the launch becomes a programmatic edge). From the second call with the same prepared
        weight object and arrays on (captured calls do not count), the decode kernel also reads
        the first part of ``w`` before that wait, while the kernel before finishes (weights are
        constants): so if you write into a weight's arrays after its first matmul, pass
        ``pdl=False`` to the matmul launched right after that write on the same stream (or launch
        any other kernel in between).

    Notes
    -----
    Three kernels; :func:`matmul_path` says which one a call takes:

    * ``"decode"`` (``weight.cu``): one 16-row tile of ``a`` per block, the block's 4, 8 or 16
      warps splitting K over 16 to 64 weight rows (chosen by shape); each weight byte is read once
      per 16 rows. FP8 weights take it for every M. INT4 takes it for M <= 16; on compute
      capability 9.0 also for M <= 32 while M x N is under
      1536 per SM (202,752 on an H100 SXM: N = 4096 up to M = 32, N = 8192 up to 24); on other GPUs also for
      M <= 64 when the weight has fewer than 2^26 elements, and for M <= 256 when it has
      fewer than 2^25.
    * ``"wgmma"`` (``weight_wgmma.cu``): INT4 for every larger M on GPUs of compute capability 9.0
      (H100, H200). Hopper's warpgroup instructions with the dequantized weights as the register
      operand: blocks of 128 weight rows by 32 (M <= 32), 64, 128 or 256 rows of ``a``, K
      streamed through shared memory with ``cp.async`` in stages of 128 (4 deep; the 32-row tile
      6 deep; 256-row tiles: stages of 64, 6 deep; the 128-row tile 5 deep, loaded by a producer
      warpgroup of its own, the activations by TMA), and split across blocks when few tiles and a
      long K make that pay: 2 ways as a thread-block cluster whose two blocks add their partials
      through distributed shared memory,
      3 to 8 ways likewise where every tile's cluster fits on the GPU at once (one block per SM;
      the driver's cluster occupancy says), otherwise 4 or 8 ways as below. The tile height and
      the splits are chosen together by an estimate fitted to H100 timings.
    * ``"pipelined"`` (``weight_gemm.cu``): INT4 for every larger M on the other GPUs
      (``mma.sync``). Tiles of 16, 32, 64 or 128 rows by 128 columns, K streamed in stages of 128,
      3-4 stages deep; when its tiles cannot fill the GPU, K is split across blocks and the last
      block of a tile adds the float32 partials in split order (the result does not depend on
      timing).

    The thresholds come from measurements recorded in ``weight.py`` (``DECODE_MAX_M``). INT4 with
    ``group_size`` 128 or per-channel (decode kernel, and pipelined tiles of up to 32 rows): the
    tensor cores multiply ``a`` by the exact integers ``q - z`` and each 128-wide chunk's float32
    partial sums are multiplied by the group's scale (``s * sum((q - z) * a)``, the weights never
    rounded to a's dtype). Otherwise (groups of 32 and 64, FP8, larger pipelined tiles, wgmma) the weights
    are dequantized to a's dtype first, bit-identical to ``w.dequantize(a.dtype)``. Either way each
    product is exact and the sums are float32, in an order that differs from a sequential sum, and
    that depends on the path and tile (so a row's result can change in the last bits with M).

    Raises
    ------
    TypeError
        ``a`` is not a CuPy array of float16 or bfloat16; ``w`` is not a :class:`QuantizedWeight`;
        ``w``'s scales are not in ``a``'s dtype; ``out`` has the wrong dtype.
    ValueError
        ``a``'s last axis is not ``w``'s K; K not a multiple of 128 (INT4) or 64 (FP8); ``a`` and
        ``w`` on different devices; ``out`` of the wrong shape or device, not C-contiguous, or
        overlapping ``a`` or ``w``; ``pdl=True`` on a GPU below compute capability 9.0.
    """
    _check_weight(w)
    t = _validate.float_input(a, "a")
    if t.name not in ("float16", "bfloat16"):
        raise TypeError(f"a must be float16 or bfloat16 (the tensor-core input types), got {a.dtype}")
    N, K = w.shape
    if a.ndim == 0 or a.shape[-1] != K:
        raise ValueError(f"a.shape[-1] must equal w's K = {K}, got a.shape {a.shape}")
    if w.scales.dtype != a.dtype:
        raise ValueError(
            f"w's scales are {w.scales.dtype} but a is {a.dtype}: the kernel dequantizes in a's dtype, "
            f"so quantize a weight of dtype {a.dtype} (or pass a as {w.scales.dtype})"
        )
    chunk = _CHUNK[w.scheme]
    if K % chunk:
        raise ValueError(f"w's K = {K} must be a multiple of {chunk} for {w.scheme} weights (the kernel's K step)")
    if K // chunk >= 1 << 30:
        raise ValueError(f"w's K = {K} must be below {chunk << 30} (the kernels count K steps in 32 bits)")
    device = w.data.data.device_id
    _validate.same_device(a, "a", device, "w")
    if pdl is not None and not isinstance(pdl, (bool, np.bool_)):
        raise TypeError(f"pdl must be None, True or False, got {type(pdl).__name__}")
    pdl_ok = int(_device.arch(device)) >= 90
    if pdl and not pdl_ok:
        raise ValueError(f"pdl=True needs a GPU of compute capability 9.0 or newer (programmatic dependent launch), "
                         f"device {device} is {_device.arch(device)}")
    pdl = pdl_ok if pdl is None else bool(pdl)
    lead = a.shape[:-1]
    M = math.prod(lead)
    if out is not None:
        _validate.out_array(out, "out", lead + (N,), a.dtype, device, inputs=(("a", a), ("w.data", w.data)))
    with _validate.on_device_of(w.data):
        a2 = a.reshape(M, K) if M else a.reshape(0, K)
        if M and (a2.strides[1] != a2.itemsize or a2.strides[0] % 16 or a2.data.ptr % 16 or a2.strides[0] < 0):
            a2 = a2.copy(order="C")  # not ascontiguousarray: that returns a misaligned contiguous view as is
            _validate.keep_if_capturing(a2)
        y = cupy.empty(lead + (N,), dtype=a.dtype) if out is None else out
        if M and N:
            early = _early_ok(w, pdl)
            user_w = w
            if w.layout == "plain":  # the kernels read the prepared layout: a copy per call
                w = _prepared_of(w)
                _validate.keep_if_capturing(w.data, w.scales, w.zeros)
            zeros = w.zeros if w.zeros is not None else 0
            path = matmul_path(M, w, arch=_device.arch(device), sms=_device.sm_count(device))
            if path == "decode":
                _launch_decode(device, t, a2, w, y.reshape(M, N), M, N, K, zeros, pdl, early)
            elif path == "wgmma":
                if _device.arch(device) not in _WGMMA_ARCHS:
                    raise ValueError(f"the wgmma path needs a GPU of compute capability 9.0, device {device} is "
                                     f"{_device.arch(device)}")
                _launch_wgmma(device, t, a2, w, y.reshape(M, N), M, N, K, zeros, pdl, early)
            else:
                _launch_gemm(device, t, a2, w, y.reshape(M, N), M, N, K, zeros, pdl)
            if not cupy.cuda.get_current_stream().is_capturing():  # a captured call may never run
                user_w._read_key = _arrays_key(user_w)
    return y


def _early_ok(w: QuantizedWeight, pdl: bool) -> bool:
    """Whether the decode kernel may load ``w``'s first chunk and its scales before its PDL wait
    (weight.cu ``early``), and the wgmma kernel its first stages' weights and scales
    (weight_wgmma.cu ``early``), so that they are on their way while the kernel before it on the
    stream finishes. Only the activations can be that kernel's output, provided that it does not
    write the weight: so not before a matmul made outside a graph capture has read the weight's
    present arrays (the kernel that made them may be the one just before), nor with a plain weight
    (its prepared copy is made in the same call), nor without PDL (nothing to overlap). After that,
    ``matmul``'s docstring asks that a kernel writing into a weight's arrays not be the one
    launched just before a PDL call with it."""
    return bool(pdl) and w.layout == "prepared" and w._read_key == _arrays_key(w)


def _arrays_key(w: QuantizedWeight) -> tuple:
    """The device buffers of ``w`` (address and size of data, scales and zero points): a weight whose
    arrays were replaced, or a ``copy.deepcopy`` of one (new buffers), counts as not yet read."""
    return tuple(None if x is None else (x.data.ptr, x.nbytes) for x in (w.data, w.scales, w.zeros))


def _gshift(w) -> int:
    """The kernels find k's group as k >> gshift: log2 of the group size, or 62 (every k < 2^62) for
    one group per row."""
    return 62 if w.group_size is None else int(w.group_size).bit_length() - 1


# The decode kernel's configurations (weight.cu CFG): (warps per block, blocks per SM that its
# register budget allows), for M <= 8 (16 weight rows a block) and for M tiles of 16 rows (32).
_DECODE_CONFIGS = {
    False: {MATMUL_DEC3: (8, 3), MATMUL_DEC4: (8, 4), MATMUL_WIDE: (16, 2), MATMUL_NARROW: (4, 8)},
    True: {MATMUL_TWO: (8, 2), MATMUL_TWO_NARROW: (4, 4), MATMUL_TWO_WIDE: (16, 1)},
}
# MM_FOUR (M tiles of 16 rows, 64 weight rows a block): 4 warps, 2 blocks per SM. Not in the wave
# model: _decode_config takes it for INT4 whenever its blocks outnumber the SMs (measured below).
_DECODE_FOUR = {MATMUL_FOUR: (4, 2), MATMUL_FOUR_WIDE: (8, 1)}
_FOUR_WIDE_MIN_CHUNKS = 4
# MM_TWO_ONE (M tiles of 16 rows, 32 rows a block of 8 warps, one per SM, two sets of partial sums):
# not in the wave model either; _decode_config takes it instead of MM_TWO_WIDE for K of at most
# _TWO_ONE_MAX_CHUNKS chunks where the partial sums are taken per chunk (INT4, groups of 128 or per channel).
_DECODE_TWO_ONE = {MATMUL_TWO_ONE: (8, 1)}
_TWO_ONE_MAX_CHUNKS = 32
_DECODE_WARPS = {cfg: warps for table in (*_DECODE_CONFIGS.values(), _DECODE_FOUR, _DECODE_TWO_ONE) for cfg, (warps, _) in table.items()}
# The decode kernel's time model (_decode_config): below _DECODE_INFLIGHT_KB of weights in flight per
# SM a round of chunks takes one memory latency, above it time grows with the bytes (the memory's
# rate); a block costs _DECODE_BLOCK_CHUNKS chunks more than its own (first load, the K reduction).
# Each warp keeps one chunk in flight (1 KB per 16 rows, MM_STAGES = 2); 132 SMs x 20 KB = 2.6 MB is
# about 0.9 us of an H100's 3 TB/s.
_DECODE_INFLIGHT_KB = 20
_DECODE_BLOCK_CHUNKS = 1.0


def _decode_estimate(cfg: int, blocks: int, sms: int, nchunks: int, two: bool) -> float:
    """The decode kernel's time for ``blocks`` blocks in configuration ``cfg``, in units of one round
    at _DECODE_INFLIGHT_KB: the blocks run in waves of (blocks per SM x SMs), each wave as long as
    a warp's chunks (plus _DECODE_BLOCK_CHUNKS) times its round, max(1, KB in flight / 20)."""
    warps, per_sm = _DECODE_CONFIGS[bool(two)][cfg]
    slots = per_sm * sms
    per_warp = -(-nchunks // warps) + _DECODE_BLOCK_CHUNKS
    kb = (2 if two else 1) * min(warps, nchunks)  # per block: warps past the chunks stream nothing
    total, left = 0.0, blocks
    while left > 0:
        wave = min(slots, left)
        left -= wave
        total += per_warp * max(1.0, wave / sms * kb / _DECODE_INFLIGHT_KB)
    return total


def _decode_config(blocks: int, sms: int, nchunks: int, two: bool = False, four_blocks: int = 0, split_ok: bool = False,
                   chains_ok: bool = False) -> int:
    """The decode kernel's configuration for a grid of ``blocks`` blocks (16 weight rows each, or 32
    with ``two``: M tiles of 16 rows, times the M tiles) whose K is ``nchunks`` chunks (weight.cu's
    CHUNK: 128 INT4 or 64 FP8 elements): MM_FOUR when ``four_blocks`` (its blocks of 64 rows, times
    the M tiles; 0 where it is not offered: FP8, M <= 8) outnumber the SMs; MM_FOUR_WIDE where
    _four_wide_splits takes it (``split_ok``: a K split may be offered); else the least
    _decode_estimate (ties to the first listed in _DECODE_CONFIGS), except that MM_TWO_ONE replaces
    MM_TWO_WIDE where ``chains_ok`` (INT4 with whole-chunk groups: the kernel's POST sums) and K
    has at most _TWO_ONE_MAX_CHUNKS chunks.

    MM_TWO_ONE. At M tiles of 16 rows and a short K the mma.sync steps, not the memory, set the
    pace: a warp's 8 k16 steps a chunk are a chain of dependent mma on each set of accumulators.
    MM_TWO's 8-warp blocks, one per SM, have the registers for two sets of partial sums (even and
    odd steps), which halves that chain. Measured on the H100 (session 23, bf16, INT4 g128, scratch
    builds, bench protocol, two rounds each, us): at 4096^2 M = 16 the kernel as it was 6.9 (TX);
    with its mma.sync taken out 3.8, with half of them 5.6, with the dequantization taken out
    instead 6.9; MM_TWO's blocks one per SM with one / two / four sets of sums 7.2 / 6.5 / 6.4, and
    with two sets but 3 or 4 ring stages 7.1 / 7.5. Two sets against the pick (M = 16):
      N x K         pick        two sets     N x K          pick        two sets
      4096x4096     TX 6.92     6.47         4096x8192      FW/2 10.73  10.80 (TX forced 10.44)
      3072x4096     TX 6.36     6.30         4096x14336     FW/2 15.80  18.04
      2048x8192     TX 9.18     8.92         5120x5120      FW 9.69     13.79
    At M = 1 two or four sets in the M <= 8 configurations were no faster (WI 4.76 / 4.73 / 4.90).
    So it replaces MM_TWO_WIDE up to 32 chunks only (2048 x 8192, 3% faster at 64 chunks, is left
    out with 4096 x 8192, 3% slower).

    MM_FOUR_WIDE (one block of 8 warps and 64 rows per SM) where the blocks of 64 rows fill between
    half the SMs and all of them, or, split 2 ways along K as clusters, between a quarter and a
    half. Measured on the H100 (session 18, bf16, INT4 g128, 20 shapes x M = 9, 16, 24, 32, the
    rule against the session-17 rule, each timed twice interleaved; us, best of two):
      N x K, M          before        after         N x K, M           before       after
      5120x13824, 16    TW 25.94      FW/1 21.63    4096x4096, 32      TW 10.36     FW/1 8.74
      4608x4096, 16     TW 10.03      FW/1 8.80     4096x14336, 32     TW 26.27     FW/1 22.85
      8192x8192, 16     TW 18.05      FW/1 17.28    2048x16384, 32     TX 17.21     FW/2 15.05
      2560x10240, 16    TX 12.97      FW/2 11.93    4096x8192, 16      TX 11.66     FW/2 11.99
      4096x14336, 16    TX 17.05      FW/2 16.97    8192x8192, 9       TW 16.66     FW/1 17.04
    Of the 48 cases where this rule picks differently, 45 were faster, by up to 17%, and 3 slower:
    8192 x 8192 and 8192 x 28672 at M = 9 (FW/1, 2.2% and 1.3%), 4096 x 8192 M = 16 (FW/2, 2.9%).
    A 2-way split with one M tile of 9 rows was 6-11% slower than the 32-row blocks on all 8 such
    shapes (the same run; those blocks read the repeated rows of a past M from L1, which may be
    why), so a split needs 16 rows of a or more. Splits of 3 and 4 (forced, 12 shapes at M = 16 and
    5 at M = 32) were never the fastest configuration of a shape; 4 ways do not even fit one wave
    as clusters (30 clusters of 4 blocks of one per SM on the H100). Deeper weight rings
    (MM_STAGES 3 and 4) were slower in 189 of 192 cells (8 shapes, M = 1 and 16, these blocks
    included; by up to 26%; the other 3 by 1-2%, none a pick).

    MM_FOUR halves the activation reads per weight byte against the blocks of 32 rows, for fewer
    warps per SM (8: 32 KB of weights in flight) and coarser blocks. Measured on the H100 (session
    17, bf16, INT4 g128, 20 shapes at M = 16 and 32, every configuration forced; FO = MM_FOUR): with
    more blocks than SMs it was the fastest on all 19 such cases (within 0.1% on 18432 x 2048
    M = 16), by 4-20% over the model's pick; with fewer it was slower than the model's pick on 20
    of the 21 (by up to 1.8x; 4096 x 4096 M = 32 1.7% faster). A few (us; the model's pick first):
      N x K, M          pick          FO      N x K, M           pick          FO
      14336x4096, 16    TN 18.20      15.30   8192x8192, 16      TW 17.79      21.20 (128 blocks)
      28672x8192, 16    TN 60.15      55.28   8192x28672, 16     TW 51.90      67.36 (128 blocks)
      11008x4096, 16    TN 17.43      14.35   4096x14336, 16     TX 17.15      29.67 (64 blocks)
      14336x4096, 32    TN 32.38      26.83   4096x4096, 32      TW 10.46      10.28 (128 blocks)
      8192x28672, 32    TN 90.94      77.86   5120x5120, 32      TN 19.24      15.48
    FP8 with MM_FOUR was 12-156% slower than the model's pick on all 20 shapes at M = 16 (not
    analysed), so FP8 is not offered it. A block of 8 warps of 64 rows (one per SM, tried
    alongside; MM_FOUR_WIDE since session 18) was the fastest on 7 of the 10 cases where its
    blocks numbered between half the SMs and all of them, by 1-15% (4096 x 14336 M = 32 23.2 us
    against 26.8), and lost by up to 27% elsewhere.

    The model's two numbers (20 KB, 1 chunk) were fitted to the fastest configuration of 20 shapes
    x {INT4, FP8} x M = {1, 16} on the H100 (session 16, bf16, INT4 g128, FP8 per channel, all
    configurations forced in turn); its picks are within 5% of the fastest on all 80 and within 2%
    on 75 (20 to 24 KB with 0.75 to 1 chunk do as well; 16 KB misses by up to 39%, half a chunk
    by up to 12%). A few of the measurements (us; D3 / D4 / WI / NA: blocks of 8 warps 3 or 4 per
    SM, 16 warps, 4 warps; TW / TN / TX: M tiles of 16 rows, blocks of 8, 4, 16 warps; * the pick;
    the whole table in BENCHMARKS.md, session 16):
      N x K         INT4 M=1: D3     D4      WI      NA        M=16: TW      TN      TX
      4096x4096               5.53   5.19    5.37*   6.54            7.54    8.97    7.45*
      14336x4096              15.42  13.95   16.53   12.80*          19.54   18.02*  24.79
      4096x14336              14.34  13.91   12.79*  19.13           18.77   26.67   17.16*
      28672x8192              47.67  47.46   48.21   45.22*          64.12   61.69*  71.14
      8192x28672              58.34  44.69*  45.08   50.20           52.66*  63.20   60.22
      5120x5120               6.90*  7.66    9.42    8.25            11.71*  12.77   14.28
      3072x4096               4.62   4.72    4.84*   6.18            6.93    8.55    7.08*
      22016x4096              21.44  20.65*  22.95   20.90           29.16*  32.40   37.27
    FP8 4096x14336 M = 16: TW 33.05, TX 24.00*. The misses past 2%, INT4: 3072 x 4096 M = 1 (+4.8%),
    18432 x 2048 M = 1 (D3 10.67, NA 10.27), 4096 x 4096 M = 1 (+3.5%: D4, D3's blocks in a smaller
    register budget, is faster; the model sees waves and bytes in flight, not how ptxas schedules
    the loop; since the first chunk is loaded before the PDL wait, session 22, WI is the fastest
    there, 4.67 us against D4 5.16), 3072 x 4096 M = 16 (+2.2%); FP8 28672 x 8192 M = 16 (TN 94.03, TX 91.25)."""
    if two and four_blocks > sms:
        return MATMUL_FOUR
    if two and four_blocks and _four_wide_splits(four_blocks, sms, nchunks, split_ok):
        return MATMUL_FOUR_WIDE
    configs = _DECODE_CONFIGS[bool(two)]
    pick = min(configs, key=lambda cfg: _decode_estimate(cfg, blocks, sms, nchunks, two))
    if pick == MATMUL_TWO_WIDE and chains_ok and nchunks <= _TWO_ONE_MAX_CHUNKS:
        return MATMUL_TWO_ONE
    return pick


def _four_wide_splits(four_blocks: int, sms: int, nchunks: int, split_ok: bool) -> int:
    """MM_FOUR_WIDE's K split for ``four_blocks`` blocks of 64 weight rows (times the M tiles) over
    ``nchunks`` chunks, or 0 where it is not taken: 1 when those blocks fill between half the SMs
    and all of them (one block of 8 warps per SM), 2 when they fill between a quarter and a half,
    a split is offered (``split_ok``: the GPU runs clusters and the launch has 16 rows of a or
    more) and each of the cluster's 16 warps keeps at least _FOUR_WIDE_MIN_CHUNKS chunks. (The
    measurements: _decode_config.)"""
    if sms < 2 * four_blocks <= 2 * sms:
        return 1
    if split_ok and sms < 4 * four_blocks <= 2 * sms and nchunks >= 16 * _FOUR_WIDE_MIN_CHUNKS:
        return 2
    return 0


def _decode_splits(cfg: int, blocks: int, sms: int, nchunks: int) -> int:
    """Into how many blocks the decode kernel splits each tile's K (1: none), for ``blocks`` blocks
    of configuration ``cfg`` (M tiles included) over ``nchunks`` chunks; called on compute
    capability 9.0+ only. The splits of a tile run as one thread-block cluster (weight.cu) whose
    blocks add their sums through distributed shared memory. Only MM_FOUR_WIDE is split, as
    _four_wide_splits says."""
    return max(1, _four_wide_splits(blocks, sms, nchunks, True)) if cfg == MATMUL_FOUR_WIDE else 1


def _run(k, grid, block, args, smem, pdl, cluster=None):
    """One launch of a matmul kernel: through cuLaunchKernelEx with programmatic dependent launch
    or as clusters of ``cluster`` blocks (_launch.py), or CuPy's RawKernel call; ``args`` ends with
    the 0-d argument struct."""
    if pdl or cluster is not None:
        _launch.launch(k, grid, block, args, smem, pdl=pdl, cluster=cluster)
    else:
        k(grid, block, args[:-1] + (args[-1][()],), shared_mem=smem)


def _launch_decode(device, t, a2, w, y2, M, N, K, zeros, pdl, early=False):
    args = np.zeros((), dtype=_MM_ARGS)
    args["N"], args["K"], args["lda"] = N, K, a2.strides[0] // a2.itemsize
    args["ng"], args["gshift"], args["early"] = K // w.G, _gshift(w), int(early)
    # INT4 with whole-chunk groups: scales applied to each chunk's float32 partial sums, and the
    # chunks' blocks of 8 k transposed (the kernel reads the activations that way when POST)
    post = _kperm(w)
    rows_per_launch = _MM_M * _MAX_GRID_Y
    for m0 in range(0, M, rows_per_launch):
        mrows = min(rows_per_launch, M - m0)
        args["M"] = mrows
        two = mrows > 8
        mtiles = -(-mrows // _MM_M)
        four_blocks = -(-N // _mm_rows(two, True)) * mtiles if two and w.scheme != "float8_e4m3fn" else 0
        cfg = _decode_config(-(-N // _mm_rows(two)) * mtiles, _device.sm_count(device), K // _CHUNK[w.scheme], two, four_blocks,
                             int(_device.arch(device)) >= 90 and mrows >= _MM_M, post)
        k = _jit.kernel(device, _FAMILY, "w4a16_matmul", t.ctype, _SCHEME_IDS[w.scheme], cfg, post)
        warps = _mm_warps(cfg)
        four = cfg in _DECODE_FOUR
        rows = _mm_rows(two, four)
        smem = _mm_smem(two, warps, four)
        if id(k) not in _decode_smem_set:  # past the 48 KiB default; the function keeps the
            k.max_dynamic_shared_size_bytes = smem  # attribute, so it is set once per kernel
            _decode_smem_set.add(id(k))
        grid = (-(-N // rows), mtiles)
        splits = _decode_splits(cfg, grid[0] * mtiles, _device.sm_count(device), K // _CHUNK[w.scheme]) if int(_device.arch(device)) >= 90 else 1
        _run(k, grid + (splits,), (32 * warps,), (a2[m0:], w.data, w.scales, zeros, y2[m0:], args), smem, pdl,
             (1, 1, splits) if splits > 1 else None)


def _launch_gemm(device, t, a2, w, y2, M, N, K, zeros, pdl):
    k, bm, threads, smem = _gemm_kernel(device, t, w, M)
    _launch_tiled(device, k, threads, smem, bm, _GEMM_BN, _GEMM_BK, _splits, a2, w, y2, M, N, K, zeros, pdl)


# The split-K arrival counters (weight_mma.cuh split_k_finish) are zero between calls: the last
# block of each tile resets its counter after the fix-up, so a zeroed buffer serves every later call
# with no memset. A memset per call cost 2.3-3 us in a CUDA graph (session 20, H200, the same bits):
# 4096x14336 M = 64 64/4 27.5 -> 25.2 us, M = 128 128/4 37.8 -> 34.9, 8192x28672 M = 64 64/4
# 73.1 -> 71.0, 4096^2 M = 256 256/4 30.7 -> 27.7. One buffer per device and stream: the calls on
# a stream run one after another (a PDL launch waits for the kernel before it to complete before
# its first global access, the counters included), so they can share one. A CUDA graph being
# captured takes a slice of its own from a zeroed slab allocated outside any capture (a graph may
# be replayed on any stream, concurrently with direct calls, and lives as long as the user keeps
# it, so its slices are never handed out again); without room there, a zeroed buffer of its own,
# the memset a node of the graph.
_COUNTER_SLAB = 1 << 20  # int32 counters per device for captured graphs
_COUNTER_STREAMS = 32  # per-stream buffers kept per process (the oldest is dropped past this)
_stream_counters: dict = {}
_graph_slabs: dict = {}


def _split_counters(device, n: int) -> cupy.ndarray:
    """``n`` zeroed int32 arrival counters for one split-K launch on the current stream."""
    stream = cupy.cuda.get_current_stream()
    if stream.is_capturing():
        slab = _graph_slabs.get(device)
        if slab is not None and slab[1] + n <= slab[0].size:
            out = slab[0][slab[1]:slab[1] + n]
            slab[1] += n
            return out
        out = cupy.zeros(n, dtype=np.int32)
        _validate.keep_if_capturing(out)
        return out
    if device not in _graph_slabs:  # zeroed before any graph can be captured with it, on any stream
        _graph_slabs[device] = [cupy.zeros(_COUNTER_SLAB, dtype=np.int32), 0]
        stream.synchronize()
    key = (device, stream.ptr)
    buf = _stream_counters.pop(key, None)
    if buf is None or buf.size < n:
        buf = cupy.zeros(max(n, 1024), dtype=np.int32)
    _stream_counters[key] = buf  # (re)inserted last: the most recently used
    while len(_stream_counters) > _COUNTER_STREAMS:
        del _stream_counters[next(iter(_stream_counters))]
    return buf[:n]


def _launch_tiled(device, k, threads, smem, bm, bn, bk, split, a2, w, y2, M, N, K, zeros, pdl, cluster=False,
                  cluster_cap=None, wg=False, early=False):
    """Launch a tensor-core kernel (weight_gemm.cu or weight_wgmma.cu: the same arguments) over
    bm x bn tiles of y, K in stages of bk, split as ``split(tiles, stages, slots)`` says; at most
    _MAX_GRID_Y row tiles per launch. ``cluster`` (weight_wgmma.cu): the splits of a tile run as one
    thread-block cluster, whose blocks add their partials through distributed shared memory (no
    workspace), when K is split 2 ways, or s = 3..8 ways with at most ``cluster_cap[s]`` tiles
    (clusters resident at once with one block per SM, _wg_cluster_cap); those wider clusters are
    launched with shared memory for one block per SM (_wg_one_block_smem). Other splits go through a
    float32 workspace in global memory. ``wg``: the kernel is weight_wgmma.cu's, which takes a tensor
    map of the launch's rows of a after the argument struct (read by the 128-row tile,
    _act_tensor_map; zeros for the others), always launched through cuLaunchKernelEx, and ``early``
    (_early_ok): it copies its first stages' weights before its PDL wait."""
    occ = _occupancy_of(device, k, threads, smem)
    args = np.zeros((), dtype=_WG_ARGS if wg else _GM_ARGS)
    args["N"], args["K"], args["lda"] = N, K, a2.strides[0] // a2.itemsize
    args["ng"], args["gshift"] = K // w.G, _gshift(w)
    if wg:
        args["early"] = int(bool(early) and bool(pdl))
    else:
        args["kperm"] = int(_kperm(w))
    iters_total = K // bk
    ntiles = -(-N // bn)
    rows_per_launch = bm * _MAX_GRID_Y
    for m0 in range(0, M, rows_per_launch):
        mrows = min(rows_per_launch, M - m0)
        mtiles = -(-mrows // bm)
        splits, iters = split(ntiles * mtiles, iters_total, occ * _device.sm_count(device))
        args["M"], args["splits"], args["iters"] = mrows, splits, iters
        in_cluster = cluster and (splits == 2 or (splits > 2 and _wide_cluster_fits(cluster_cap, splits, ntiles * mtiles)))
        launch_smem = smem
        if in_cluster and splits > 2:
            launch_smem = _wg_one_block_smem(device, k, smem)
        if splits > 1 and not in_cluster:  # float32 partial tiles (whole, tile-major), per-tile arrival counters
            ws = cupy.empty((splits, mtiles, ntiles, bm, bn), dtype=np.float32)
            counters = _split_counters(device, ntiles * mtiles)
            _validate.keep_if_capturing(ws)
        else:
            ws = counters = 0
        kargs = (a2[m0:], w.data, w.scales, zeros, y2[m0:], ws, counters, args)
        if wg:
            tmaps = (_NO_TENSOR_MAP, _NO_TENSOR_MAP)
            if bm == _WG_TMA_TILE:  # boxes of the whole tile, and of the last tile's rows rounded up to 8
                tail = -(-(mrows % bm) // 8) * 8
                tail_map = _act_tensor_map(a2[m0:], mrows, K, tail) if tail else _NO_TENSOR_MAP
                tmaps = (_act_tensor_map(a2[m0:], mrows, K, bm), tail_map)
            _launch.launch(k, (ntiles, mtiles, splits), (threads,), kargs + tmaps, launch_smem, pdl=pdl,
                           cluster=(1, 1, splits) if in_cluster else None)
        else:
            _run(k, (ntiles, mtiles, splits), (threads,), kargs, launch_smem, pdl, (1, 1, splits) if in_cluster else None)


# The 128-row wgmma tile loads its activations by TMA from a producer warpgroup (weight_wgmma.cu, the
# header: 384 threads, the others 256), through a tensor map of the launch's rows of a: boxes of 64 k
# by 128 rows in the 128-byte swizzle, and where M is not a multiple of 128 a second map whose boxes
# are the last tile's rows rounded up to 8 (a box mostly past M was slow on most shapes: session 37,
# the kernel's header). Encoding one is host work in the driver (session 35, H100 host: 7.6 us a
# map, 0.5 us for a cached one); the maps are cached by address, shape and box (matmul's
# activations are usually the same few buffers from call to call), at most _TMAP_CACHE of them.
_WG_TMA_TILE = 128  # the tile height that loads by TMA
_WG_THREADS = {32: 256, 64: 256, 128: 384, 256: 256}
_NO_TENSOR_MAP = np.zeros((), dtype=_launch.TENSOR_MAP)
_TMAP_CACHE = 256
_tmap_cache: dict = {}


def _act_tensor_map(a2, rows: int, K: int, box_rows: int) -> np.ndarray:
    """The tensor map of the first ``rows`` rows of ``a2`` (``K`` columns; 16-byte aligned, rows a
    multiple of 16 bytes apart: matmul copies ``a`` otherwise) for the 128-row tile's TMA loads, in
    boxes of 64 k by ``box_rows`` rows."""
    key = (a2.data.ptr, rows, K, a2.strides[0], a2.device.id, box_rows)
    m = _tmap_cache.get(key)
    if m is None:
        m = _launch.tensor_map_2d(a2.data.ptr, rows, K, a2.strides[0], _WG_BK, box_rows)
        if len(_tmap_cache) >= _TMAP_CACHE:  # the oldest goes (another thread may be evicting too)
            try:
                _tmap_cache.pop(next(iter(_tmap_cache)), None)
            except (StopIteration, RuntimeError):  # emptied, or changed size under the iterator
                pass
        _tmap_cache[key] = m
    return m


# The wgmma kernel (kernels/weight_wgmma.cu): blocks of 128 weight rows by 32, 64, 128 or 256 rows of a,
# K in stages of 64 or 128 (1 or 2 halves of 64), and the ring depth that fits each tile in shared
# memory. _WG_BK is the unit of K the plans below count in. Stages of 128 k for the 64- and 128-row
# tiles (session 13, forced plans, us, stages of 64 -> 128, the same bits): 28672x8192 M = 64 64/1
# 99.8 -> 84.3, 14336x4096 M = 256 128/1 80.3 -> 70.1, 8192x28672 M = 256 128/1 272 -> 234,
# 28672x8192 M = 1024 128/1 1128 -> 952; 4 stages of 128 for 64 rows (two blocks a SM; 6, one
# block a SM, made 28672x8192 M = 64 64/1 65 -> 74 us, session 33) and 5 for 128 (session 13
# measured 5 the same as 4; on session 33's faster loop, per-block clock probes put a 128-k stage at
# 1230 against 1250 cycles, and an A/B in one run, the same bits, made the 128-row plans 2.5-5%
# faster: 4096 x 14336 M = 128 128/1 31.8 -> 30.0-30.4 us, 8192 x 28672 M = 128 93.2 -> 89.7-90.3;
# stages of 64, 8 or 10 deep, were 4-7% slower).
# The 256-row tile keeps stages of 64: with 128 only 3 fit, one in flight (14336x4096 M = 256 256/1
# 52 -> 67, 4096^2 M = 4096 224 -> 270). The 32-row tile (M <= 32; session 36) is the 64-row tile's
# code at half the width, 6 stages of 128 deep (two blocks a SM); 10 deep (one block a SM) was
# slower on every plan measured (H100, us, bf16 g128, M = 32: 14336x4096 32/1 18.1 -> 19.7,
# 28672x8192 32/1 56.3 -> 69.1, 8192x28672 32/4 55.4 -> 67.4).
_WG_BN, _WG_BK = 128, 64
_WG_CONFIG = {bma: (stages, halves) for bma, stages, halves in WGMMA_CONFIGS}  # rows -> (stages, halves)


_WG_BLOCKS_PER_SM = {32: 2, 64: 2, 128: 1, 256: 1}  # registers (launch bounds) and shared memory


# Estimated microseconds of a wgmma call on the H100 (bf16, g128), fitted by least squares (relative
# error) to every plan of 35 cells timed forced in session 38 (_wg_plan replaced by each plan in turn,
# _bench.time_graph; BENCHMARKS.md, session 38: 4096^2 M = 32-1024, the other four benchmark shapes
# M = 32-1024, 4096x14336 M = 200, 4096x11008, 11008x4096, 2048x8192; 587 timings of the plans the
# planner may pick, rms error 4%, at most 11%). A 64 k of a block's main
# loop: _WG_STAGE_US[rows] = (one block a SM, in one wave; each block where two share an SM (32 and
# 64 rows) or each wave beyond the first (128, 256)): 14336x4096 M = 64 64/1 20.0 us, M = 128 128/1
# 25.2, M = 256 256/1 43.1; 28672x8192 M = 64 64/1 67.1, M = 128 128/1 97.4, M = 256 256/1 165.7.
# Session 13's costs (64 rows 0.375, 128 rows 0.53, 256 rows 0.85) were older than the kernels' later
# speedups and put 4096x14336 M = 200 on 256/4 (51.1 us) where 128/2 takes 44.1. A call costs
# _WG_CALL_US more; K split 2 ways as a cluster _WG_CLUSTER_SPLIT_US = (fixed, per row of a up to the
# tile's) more (4096^2 M = 256 128/2 16.2, 8192x28672 M = 256 256/2 154.0), 3 to 8 ways as clusters
# _WG_WIDE_CLUSTER_US (4096^2 M = 64 64/3 10.0, 2048x8192 M = 64 64/6 10.3), through the workspace
# _WG_SPLIT_US = (fixed, per split and row of the tile: the partial tiles are whole) (4096x14336
# M = 64 64/4 22.9, M = 128 128/4 29.8, M = 256 256/4 52.3). Over those 35 cells the plan picked is
# within 3% of the fastest plan measured (4096x11008 M = 128: 128/4 26.1 us, 128/3 25.4), 0.1% on
# average; with session 13's costs it was up to 16% off (4096x14336 M = 200) and 9% (11008x4096
# M = 64: 64/1 19.5, 64/3 through the workspace 17.9, a split the planner did not try).
_WG_STAGE_US = {32: (0.245, 0.221), 64: (0.271, 0.247), 128: (0.340, 0.375), 256: (0.600, 0.644)}
_WG_CALL_US = 1.47
_WG_SPLIT_US = (2.92, 0.0101)
# Session 39 summed 2-way cluster splits from registers and copied the first stages' weights
# before the PDL wait, which made a 2-way split about 1 us cheaper against an unsplit plan of one
# wave (4096^2 M = 128 64/2 13.0 -> 11.9 us; 14336x4096 M = 64 64/1 20.2 -> 20.0). Its fixed cost
# went from 1.88 to 0.8, the highest value at which the planner splits 14336x4096 M = 32 and 64
# (the faster plans). That moves the pick of 20 cells of a grid of 18 shapes x 14 M, each timed
# with both picks forced (old -> new, us): 14336x4096 M = 64 64/1 20.1-20.2 ->
# 64/2 19.2-19.3, M = 32 32/1 17.4 -> 32/2 16.4-16.6, 12288x4096 M = 17-64 1-8% faster, 4096^2
# M = 80-96 128/3 12.2-12.4 -> 64/2 11.8-11.9, 5120^2 M = 80-200 5-9% faster, 3072x4096 M = 160
# 256/4 15.7 -> 128/2 14.4; slower in one, 6144x4096 M = 160 (128/1 23.2-23.5 -> 256/2 24.3-24.5),
# where no value of this cost alone picks right without losing 14336x4096. Over session 39's scan
# of the 35 cells (every plan forced again) the other picks did not move.
_WG_CLUSTER_SPLIT_US = (0.8, 0.0091)
_WG_WIDE_CLUSTER_US = (2.15, 0.0122)


def _wg_estimate(bma: int, tiles: int, splits: int, iters: int, sms: int, M: int, cluster=None) -> float:
    """Estimated microseconds of a wgmma call (see _WG_STAGE_US). ``cluster``: the splits run as
    clusters (default: 2 splits, while _WG_CLUSTER is on); clusters of more than 2 blocks run one
    block per SM."""
    if cluster is None:
        cluster = splits == 2 and _WG_CLUSTER
    blocks = tiles * splits
    one, per = _WG_STAGE_US[bma]
    per_sm = -(-blocks // sms)  # blocks on the busiest SM (32/64 rows, two a SM) or waves (one a SM)
    stage = one if per_sm == 1 else per * per_sm
    rows = min(bma, M)
    if splits == 1:
        split = 0.0
    elif cluster:
        fixed, per_row = _WG_CLUSTER_SPLIT_US if splits == 2 else _WG_WIDE_CLUSTER_US
        split = fixed + per_row * rows
    else:
        fixed, per_row = _WG_SPLIT_US
        split = fixed + per_row * splits * bma
    return _WG_CALL_US + stage * -(-iters // splits) + split


def _wide_cluster_fits(cluster_cap, splits: int, tiles: int) -> bool:
    """Whether the ``tiles`` clusters of ``splits`` > 2 blocks all fit on the GPU at once with one
    block per SM (``cluster_cap``: splits -> clusters that fit, _wg_cluster_cap; None: none do)."""
    return bool(_WG_CLUSTER and cluster_cap and tiles <= cluster_cap.get(splits, 0))


def _wg_plan(M: int, N: int, iters: int, sms: int, cluster_cap=None):
    """(rows of a per tile, K splits) for the wgmma kernel: the least _wg_estimate over tile heights
    64 / 128 / 256 (and 32 where M <= 32) and splits 1 / 2 / 3 / 4 / 6 / 8 (a split only while its
    blocks fit in one wave); ties go to the taller tile and fewer splits. ``cluster_cap`` (splits ->
    clusters resident at once with one block per SM, _wg_cluster_cap) lets splits of 3 to 8 run as
    clusters where every tile's cluster fits at once (None: only 2 splits are clusters; more go
    through the workspace). Checked against the H100's capacities and session 38's forced timings
    (us, the three fastest plans the planner may take; c: a cluster of 3 or more, w: the workspace;
    2 splits are a cluster):
      4096x4096   M = 64   64/3c 9.9, 64/4w 11.0, 64/8w 12.3              -> 64/3c
      4096x4096   M = 256  128/2 16.2, 64/1 19.1, 64/2 19.8               -> 128/2
      14336x4096  M = 64   64/1 20.0, 64/2 20.7, 128/1 24.2               -> 64/1 (64/2 since
                                                                          session 39: 19.4 / 20.1)
      14336x4096  M = 256  256/1 43.1, 128/1 48.9, 64/1 64.8              -> 256/1
      4096x14336  M = 64   64/4w 22.9, 64/8w 23.0, 64/3c 25.3             -> 64/4w
      4096x14336  M = 200  128/2 44.1, 256/4w 51.1, 256/3c 51.6           -> 128/2 (256/4w before)
      4096x14336  M = 256  128/2 44.6, 256/4w 52.3, 256/3c 52.8           -> 128/2
      28672x8192  M = 128  128/1 97.4, 64/1 132.8, 256/1 163.4            -> 128/1
      28672x8192  M = 256  256/1 165.7, 128/1 197.2, 64/1 233.8           -> 256/1
      8192x28672  M = 64   64/4w 65.1, 64/2 69.3, 64/3w 80.5              -> 64/4w
      8192x28672  M = 128  128/2 89.3, 64/2 119.3, 64/1 125.1             -> 128/2
      8192x28672  M = 256  256/2 154.0, 128/1 167.2, 64/1 225.5           -> 256/2
      11008x4096  M = 64   64/3w 17.9, 64/1 19.5, 64/2 20.4               -> 64/3w (64/1 before)
      2048x8192   M = 256  128/3c 19.6, 256/6c 20.5, 64/2 20.7            -> 128/3c (256/6c before)
      4096x11008  M = 128  128/3c 25.4, 128/4w 26.1, 64/2 27.1            -> 128/4w (the worst miss, 3%)
    Splits of 3 and 6 through the workspace were not tried before session 38 (only as clusters).
    """
    best = None
    for bma in (256, 128, 64, 32):
        if bma == 32 and M > 32:
            break  # the 32-row tile serves M <= 32 only (two tiles of 32 rows read the weights twice)
        tiles = -(-N // _WG_BN) * -(-M // bma)
        for splits in (1, 2, 3, 4, 6, 8):
            if splits > iters:
                break
            wide = splits > 2 and _wide_cluster_fits(cluster_cap, splits, tiles)
            if splits > 1 and not wide and tiles * splits > _WG_BLOCKS_PER_SM[bma] * sms:
                continue
            est = _wg_estimate(bma, tiles, splits, iters, sms, M, cluster=(splits == 2 and _WG_CLUSTER) or wide)
            if best is None or est < best[0] * 0.999:
                best = (est, bma, splits)
    return best[1], best[2]


# K split 2 ways runs as clusters of the two blocks of a tile, which add their partials through
# distributed shared memory (weight_wgmma.cu cluster_split_finish): no workspace, counters or memset,
# the same bits. Measured (session 13, us, workspace -> cluster): 4096^2 M = 64 64/2 19.5 -> 16.0,
# 14336x4096 M = 64 64/2 30.1 -> 26.1, 4096^2 M = 256 128/2 28.0 -> 21.8, 4096x14336 M = 256 128/2
# 68.3 -> 62.4, 8192x28672 M = 256 256/2 190 -> 183. Splits of 3 to 8 ways are clusters too, but
# only where every tile's cluster fits on the GPU at once with one block per SM (_wg_cluster_cap):
# a cluster's blocks must share a GPC, so the H100 holds 30 clusters of 4 (not 33) and 15 of 8.
# Session 13's clusters of 4 were slower than the workspace for that reason (session 14, a probe
# kernel recording each block's SM and start: 128 blocks in clusters of 4 with one block per SM ran
# in two waves, 40 us for 20 us of work; with two blocks per SM, as the 64-row tile allows, the
# scheduler put 8 SMs' worth of blocks two to an SM while 12 SMs idled): 4096x14336 M = 64 64/4
# 31.0 -> 40.8, 4096x14336 M = 256 256/4 62 -> 97. Measured with the rule (us, session 14, the
# plan without -> with wide clusters): 4096^2 M = 64 64/2 16.0 -> 64/3 12.5; 2048x8192 M = 64 64/8
# 17.0 -> 64/6 12.7, M = 128 64/4 21.0 -> 128/6 16.8, M = 256 64/2 26.9 -> 256/6 24.0; 1024x4096
# M = 64 64/2 15.3 -> 64/8 7.5; 256x4096 M = 1024 64/2 15.1 -> 128/6 11.6; 4096x11008 M = 64 64/4
# 25.8 -> 64/3 25.1.
_WG_CLUSTER = True
_WG_SZ_STAGE = 640  # weight_wgmma.cu SZ_STAGE per 64-k half: scales (8 tiles x 64 bytes) and zero codes (8 x 16)


def _wg_smem(bma: int) -> int:
    """The ring (STAGES slots of activations and weights), the scale ring (STAGES slots of
    _WG_SZ_STAGE bytes a half), and 1 KB to align the first slot to 1024 bytes."""
    stages, halves = _WG_CONFIG[bma]
    return stages * halves * (bma * 128 + _WG_BN * 32 + _WG_SZ_STAGE) + 1024


_wg_cluster_caps: dict = {}
_one_block_set: set = set()


def _wg_one_block_smem(device, k, smem: int) -> int:
    """Dynamic shared bytes for a launch of ``k`` that leaves room for only one block per SM (more
    than half an SM's shared memory; at least ``smem``), the kernel's limit raised to allow it.
    A 64-row tile (104 KB) otherwise runs two blocks a SM, and the cluster scheduler then packs a
    cluster's blocks two to an SM on some SMs while others idle (session 14: 4096x14336 M = 64 64/3
    40.0 us packed, 32.2-32.7 one block per SM; 4096^2 M = 64 64/3 15.2 and 12.6)."""
    smem_sm = _device.smem_per_sm(device)
    one = max(smem, smem_sm // 2 + 1024)
    key = (device, id(k))
    if key not in _one_block_set:
        k.max_dynamic_shared_size_bytes = one
        _one_block_set.add(key)
    return one


def _wg_cluster_cap(device, t, scheme, kp) -> dict:
    """splits -> how many clusters of that many blocks of the wgmma kernel (one block per SM) the
    device holds at once (cuOccupancyMaxActiveClusters; once per device). The H100: 39 clusters of
    3, 30 of 4, 22 of 5, 17 of 6, 15 of 7 and 8: fewer than 132 / s, since a cluster's blocks
    must all be in one GPC. A split whose clusters do not all fit at once would run in two waves
    (session 14: 128 blocks in clusters of 4, 30 resident, took 2x as long as the same blocks
    unclustered), so those splits use the workspace."""
    cap = _wg_cluster_caps.get(device)
    if cap is None:
        stages, halves = _WG_CONFIG[256]
        k = _jit.kernel(device, "weight_wgmma", "w4a16_wgmma", t.ctype, _SCHEME_IDS[scheme], 256, stages, halves, kp)
        smem = _wg_one_block_smem(device, k, _wg_smem(256))
        cap = {s: _launch.max_active_clusters(k, 256, smem, (1, 1, s)) for s in range(3, 9)}
        _wg_cluster_caps[device] = cap
    return cap


def _launch_wgmma(device, t, a2, w, y2, M, N, K, zeros, pdl, early=False):
    cap = _wg_cluster_cap(device, t, w.scheme, _kperm(w)) if _WG_CLUSTER else None
    bma, splits = _wg_plan(M, N, K // _WG_BK, _device.sm_count(device), cluster_cap=cap)
    stages, halves = _WG_CONFIG[bma]
    k = _jit.kernel(device, "weight_wgmma", "w4a16_wgmma", t.ctype, _SCHEME_IDS[w.scheme], bma, stages, halves, _kperm(w))

    def split(tiles, iters_total, slots):
        iters = -(-iters_total // splits)
        return -(-iters_total // iters), iters

    _launch_tiled(device, k, _WG_THREADS[bma], _wg_smem(bma), bma, _WG_BN, _WG_BK * halves, split, a2, w, y2, M, N, K, zeros,
                  pdl, cluster=_WG_CLUSTER, cluster_cap=cap, wg=True, early=early)


register_container(QuantizedWeight, dequantize_weight)
