"""The weight family's kernels (``kernels/weight_quant.cu``): quantization of INT4, FP8 and INT8
weights, their dequantization (FP8 blocks and FP4 included), INT8 code sums and NVFP4's
``scale_2``. Each function launches on arrays it is given and makes no QuantizedWeight; the
launches are planned once per argument signature."""

from __future__ import annotations

import cupy
import numpy as np

from .. import _dtypes, _jit, _plans
from .._launch import ARG, Launch
from .._sizes import MAX_GRID_YZ, ceil_div
from .formats import FP4_BLOCK, FP4_IDS, QUANT_SCHEME_IDS, SCHEME_IDS, WEIGHT_INT8, WEIGHT_NVFP4

#: WQuantArgs / WDequantArgs of weight_quant.cu
QUANT_ARGS = np.dtype([("N", np.int64), ("K", np.int64), ("ng", np.int64), ("G", np.int32)], align=True)
#: weight_quantize_block / weight_dequantize_block (WBlockArgs): kb the blocks along K.
BLOCK_ARGS = np.dtype([("N", np.int64), ("K", np.int64), ("kb", np.int64)], align=True)
_THREADS = 256
_WARPS = _THREADS // 32

FAMILY = _jit.register(
    "weight_quant",
    _jit.product("weight_quantize", _dtypes.INPUT_CTYPES, QUANT_SCHEME_IDS.values())
    + _jit.product("weight_dequantize", _dtypes.INPUT_CTYPES, _dtypes.INPUT_CTYPES, QUANT_SCHEME_IDS.values())
    + _jit.product("weight_code_sum", (WEIGHT_INT8,))
    + _jit.product("weight_quantize_block", _dtypes.INPUT_CTYPES)
    + _jit.product("weight_dequantize_block", _dtypes.INPUT_CTYPES)
    + _jit.product("weight_dequantize_fp4", _dtypes.INPUT_CTYPES, FP4_IDS)
    + _jit.product("weight_scale_2", (WEIGHT_NVFP4,)),
)

_LAUNCHES = _plans.Plans()


def _launch(key, make) -> Launch:
    """The Launch of ``key``, made by ``make()`` at its first request."""
    launch = _LAUNCHES.lookup(key)
    if launch is None:
        launch = _LAUNCHES.keep(key, make())
    return launch


def _quant_args(N: int, K: int, ng: int, G: int) -> np.void:
    return np.array((N, K, ng, G), dtype=QUANT_ARGS)[()]


def quantize_groups(w, t: _dtypes.InputType, fmt: str, G: int, data, scales, zcodes) -> None:
    """weight_quantize of an INT4 or FP8 weight ``w`` (N, K) in groups of ``G``: one warp per
    group, writing ``data``, ``scales`` and, for uint4, the zero codes ``zcodes`` (N, K / G)."""
    N, K = w.shape
    device = w.data.device_id

    def make():
        k = _jit.kernel(device, FAMILY, "weight_quantize", t.ctype, QUANT_SCHEME_IDS[fmt])
        return Launch(
            k, (ceil_div(N * (K // G), _WARPS),), (_THREADS,), (ARG, ARG, ARG, ARG, 0, _quant_args(N, K, K // G, G))
        )

    _launch(("quantize", device, t, fmt, N, K, G), make)(w, data, scales, zcodes)


def quantize_int8(w, t: _dtypes.InputType, data, scales, sums) -> None:
    """weight_quantize<T, W_INT8>: one warp per row, writing the codes, the row's scale and its code sum."""
    N, K = w.shape
    device = w.data.device_id

    def make():
        k = _jit.kernel(device, FAMILY, "weight_quantize", t.ctype, WEIGHT_INT8)
        return Launch(k, (ceil_div(N, _WARPS),), (_THREADS,), (ARG, ARG, ARG, 0, ARG, _quant_args(N, K, 1, K)))

    _launch(("int8", device, t, N, K), make)(w, data, scales, sums)


def quantize_blocks(w, t: _dtypes.InputType, data, scale) -> None:
    """weight_quantize_block: one 256-thread block per 128 x 128 block of ``w``; ``scale`` is
    (ceil(N / 128), ceil(K / 128)) float32."""
    N, K = w.shape
    device = w.data.device_id
    nb, kb = scale.shape

    def make():
        k = _jit.kernel(device, FAMILY, "weight_quantize_block", t.ctype)
        return Launch(k, (nb * kb,), (_THREADS,), (ARG, ARG, ARG, np.array((N, K, kb), BLOCK_ARGS)[()]))

    _launch(("block", device, t, N, K), make)(w, data, scale)


def code_sums(data):
    """``sum_k data[n, k]`` per row of int8 codes (a C-contiguous CuPy int8 ``(N, K)`` array, K up
    to 2^24), int32 ``(N,)``, exact (integer sums), on data's device and current stream, no host
    synchronization: one launch of ``weight_code_sum`` (one warp per row). None for anything else
    (the weight's check then names what is wrong). Bit-exact with
    :func:`cupyquant.reference.weight_code_sum`."""
    from .. import _checks, _validate

    if not isinstance(data, cupy.ndarray) or data.dtype != np.int8 or data.ndim != 2 or not data.flags.c_contiguous:
        return None
    N, K = data.shape
    if K > _checks.INT8_WEIGHT_MAX_K:
        return None
    with _validate.on_device_of(data):
        sums = cupy.empty((N,), dtype=np.int32)
        if N:
            device = data.data.device_id

            def make():
                k = _jit.kernel(device, FAMILY, "weight_code_sum", WEIGHT_INT8)
                return Launch(k, (ceil_div(N, _WARPS),), (_THREADS,), (ARG, ARG, _quant_args(N, K, 1, K)))

            _launch(("code_sum", device, N, K), make)(data, sums)
    return sums


def scale_2_of(global_scale) -> cupy.ndarray:
    """NVFP4's decode scale ``float32(1 / S_enc)`` (a new float32 (1,) array) from the encode scale
    ``global_scale`` (a float32 device array of one element, on the current device), correctly
    rounded with subnormals kept: one launch of ``weight_scale_2`` (a CuPy division would flush a
    subnormal quotient, ``-ftz=true``), no host synchronization."""
    s2 = cupy.empty((1,), np.float32)
    device = global_scale.data.device_id

    def make():
        return Launch(_jit.kernel(device, FAMILY, "weight_scale_2", WEIGHT_NVFP4), (1,), (32,), (ARG, ARG))

    _launch(("scale_2", device), make)(global_scale, s2)
    return s2


def dequantize(w, out_t: _dtypes.InputType, y) -> None:
    """Dequantize the plain weight ``w`` (N > 0, K > 0) into ``y`` (N, K) of ``out_t``, on the
    current device: weight_dequantize (groups and channels; one thread per pair of elements),
    weight_dequantize_block (128 x 128 blocks) or weight_dequantize_fp4 (one thread per 8
    elements)."""
    N, K = w.shape
    fmt = w.scheme.format
    device = w.data.data.device_id
    if fmt in FP4_BLOCK:
        B = FP4_BLOCK[fmt]

        def make():
            k = _jit.kernel(device, FAMILY, "weight_dequantize_fp4", out_t.ctype, SCHEME_IDS[fmt])
            grid = (ceil_div(K // 8, _THREADS), min(N, MAX_GRID_YZ))
            return Launch(k, grid, (_THREADS,), (ARG, ARG, ARG, ARG, _quant_args(N, K, K // B, B)))

        _launch(("dequant_fp4", device, out_t, fmt, N, K), make)(w.data, w.scale, w.scale_2, y)
    elif w.scheme.granularity == "block":
        kb = w.scale.shape[1]

        def make():
            k = _jit.kernel(device, FAMILY, "weight_dequantize_block", out_t.ctype)
            grid = (ceil_div(K, _THREADS), min(N, MAX_GRID_YZ))
            return Launch(k, grid, (_THREADS,), (ARG, ARG, ARG, np.array((N, K, kb), BLOCK_ARGS)[()]))

        _launch(("dequant_block", device, out_t, N, K), make)(w.data, w.scale, y)
    else:
        G = K if w.scheme.granularity == "channel" else w.scheme.block[0]
        st = _dtypes.input_type(w.scale.dtype, "w.scale")

        def make():
            k = _jit.kernel(device, FAMILY, "weight_dequantize", st.ctype, out_t.ctype, QUANT_SCHEME_IDS[fmt])
            grid = (ceil_div(ceil_div(K, 2), _THREADS), min(N, MAX_GRID_YZ))  # element pairs (an int8 K may be odd)
            return Launch(k, grid, (_THREADS,), (ARG, ARG, ARG, ARG, _quant_args(N, K, K // G, G)))

        _launch(("dequant", device, st, out_t, fmt, N, K, G), make)(w.data, w.scale, w.zero_point, y)
