"""Argument checks that need no GPU, shared by the ops and the NumPy reference so that both accept
and refuse the same inputs with the same exceptions. NumPy only: ``cupyquant.reference`` imports it."""

from __future__ import annotations

import numbers

import numpy as np

from . import _dtypes

WEIGHT_DTYPES = ("int4", "uint4", "float8_e4m3fn", "int8", "nvfp4", "mxfp4")
WEIGHT_GROUP_SIZES = (32, 64, 128, None)
#: The 2-D blocks (rows, columns) of block-scaled FP8 weights: DeepSeek-V3's 128 x 128.
WEIGHT_BLOCK_SIZES = ((128, 128),)
#: The largest K of an int8 weight: its code sums, at most 128 K in magnitude, must fit int32.
INT8_WEIGHT_MAX_K = 1 << 24


class _DefaultGroupSize(int):
    """quantize_weight's default ``group_size`` (128), told apart from an explicit 128 so that
    ``block_size`` and ``group_size`` cannot both be given."""

    def __repr__(self) -> str:
        return "128"


DEFAULT_GROUP_SIZE = _DefaultGroupSize(128)


def weight_scheme(dtype, symmetric=True) -> str:
    """The weight scheme a ``(dtype, symmetric)`` pair names: ``"int4"`` (symmetric, uint4b8),
    ``"uint4"`` (asymmetric with zero points: ``dtype="uint4"``, or ``"int4"`` with
    ``symmetric=False``), ``"float8_e4m3fn"``, ``"int8"``, ``"nvfp4"`` or ``"mxfp4"`` (symmetric only)."""
    if not isinstance(dtype, str):
        # ml_dtypes.float8_e4m3fn and numpy.int8 (the types or their np.dtype) name the FP8 and INT8
        # schemes, as they do for quantize_fp8 and quantize_groupwise; int4/uint4 have names only
        # (ml_dtypes' int4 types are not packed formats)
        try:
            name = np.dtype(dtype).name
        except TypeError:
            raise TypeError(
                f"dtype must be one of {WEIGHT_DTYPES}, ml_dtypes.float8_e4m3fn or numpy.int8, got {dtype!r}"
            ) from None
        dtype = name if name in ("float8_e4m3fn", "int8") else dtype
    if not isinstance(dtype, str) or dtype not in WEIGHT_DTYPES:
        raise ValueError(f"dtype must be one of {WEIGHT_DTYPES}, got {dtype!r}")
    if dtype in ("float8_e4m3fn", "int8", "nvfp4", "mxfp4"):
        if not symmetric:
            raise ValueError(f"symmetric=False: {dtype} weights have no zero points")
        return dtype
    return "uint4" if dtype == "uint4" or not symmetric else "int4"


def weight_int8_options(group_size, block_size) -> None:
    """The options of an int8 weight: one scale per output channel, so ``group_size=None`` (given:
    the default 128 is refused too) and no ``block_size``."""
    if block_size is not None:
        raise ValueError(
            f"block_size={block_size!r} is not supported for int8 weights (one scale per output channel): "
            "pass group_size=None and no block_size"
        )
    if group_size is DEFAULT_GROUP_SIZE:
        raise ValueError(
            "dtype='int8' weights have one scale per output channel: pass group_size=None "
            "(the default group_size=128 is for the INT4 and FP8 weights)"
        )
    if group_size is not None:
        raise ValueError(
            f"group_size={group_size!r} is not supported for int8 weights: they have one scale per output "
            "channel (group_size=None)"
        )


def weight_int8_k(K: int, arg: str = "w") -> None:
    """K of an int8 weight: nonzero (any parity) and at most :data:`INT8_WEIGHT_MAX_K`."""
    if K == 0:
        raise ValueError(f"{arg}'s K must be nonzero")
    if K > INT8_WEIGHT_MAX_K:
        raise ValueError(
            f"{arg}'s K = {K} must be at most 2^24 = {INT8_WEIGHT_MAX_K} for int8 weights (their int32 code sums)"
        )


# ------------------------------------------------------------------ element formats per op
#: The element formats each op accepts (``dtype=``), by ml_dtypes name.
PER_TENSOR_FORMATS = _dtypes.FP8_NAMES
GROUPWISE_FORMATS = _dtypes.FP8_NAMES + ("int8",)
MX_FORMATS = _dtypes.MX_NAMES
#: The group sizes of quantize_groupwise and silu_mul_quantize (None: per token, groupwise only).
GROUP_SIZES = (32, 64, 128, 256)
MX_ROUNDINGS = ("ceil", "floor")
#: Paged KV-cache layouts: "NHD" is [blocks, block_size, heads, head_dim], "HND" [blocks, heads, block_size, head_dim].
KV_LAYOUTS = ("NHD", "HND")


def at_least_1d(ndim: int, arg: str = "x") -> None:
    """Ops that work along the last axis need one."""
    if ndim == 0:
        raise ValueError(f"{arg} must have at least one dimension")


def group_count(K: int, group_size, arg: str = "group_size") -> int:
    """Groups along a last axis of ``K`` elements: ``K // group_size`` for a Python int
    ``group_size`` in :data:`GROUP_SIZES` that divides K, 1 for None (one group per token)."""
    if group_size is None:
        return 1
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size not in GROUP_SIZES:
        raise ValueError(f"{arg}={group_size!r} is not supported; expected one of {GROUP_SIZES} or None")
    if K % group_size:
        raise ValueError(f"{arg}={group_size} does not divide the last axis ({K} elements)")
    return K // group_size


def not_per_token(group_size, op: str) -> None:
    """For ops that have groups only (no ``group_size=None``)."""
    if group_size is None:
        raise ValueError(f"group_size=None is not supported by {op}; expected one of {GROUP_SIZES}")


def gate_up_width(K: int, arg: str = "x") -> int:
    """The width of each half of a ``[gate | up]`` last axis of ``K`` elements (K must be even)."""
    if K % 2:
        raise ValueError(f"{arg}'s last axis must be even ([gate | up]), got {K}")
    return K // 2


def norm_eps(eps) -> np.float32:
    """RMSNorm's ``eps``: a real number (not a bool), finite and >= 0; returned as the float32 the
    kernel adds to the mean square."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.floating, np.integer)):
        raise TypeError(f"eps must be a real number, got {type(eps).__name__}")
    if not (np.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    return np.float32(eps)


def small_codes(a, arg: str, hi: int, what: str, bits_of=None) -> np.ndarray:
    """An array of integer codes in ``[0, hi]`` (FP4 codes, bytes) as uint8: any integer dtype (Python
    ints included) with its values checked, or an array of the one-byte ml_dtypes type ``bits_of``
    read as its bit patterns. Floats are a TypeError (a cast would truncate them), values outside
    the range a ValueError (a cast would wrap them)."""
    a = np.asarray(a)
    if bits_of is not None and a.dtype == np.dtype(bits_of):
        return a.view(np.uint8)
    if a.dtype.kind not in "biu":
        raise TypeError(f"{arg} must be integers in [0, {hi}] ({what}), got dtype {a.dtype}")
    if a.dtype == np.uint8 and hi >= 255:
        return a
    if a.size and (a.min() < 0 or a.max() > hi):
        raise ValueError(f"{arg} must be in [0, {hi}] ({what}), got values from {a.min()} to {a.max()}")
    return a.astype(np.uint8)


def mx_rounding(rounding) -> str:
    if rounding not in MX_ROUNDINGS:
        raise ValueError(f"rounding={rounding!r} is not supported; expected one of {MX_ROUNDINGS}")
    return rounding


def kv_layout_is_hnd(kv_layout) -> bool:
    """Whether ``kv_layout`` is "HND" (else "NHD"); ValueError naming ``kv_layout`` for anything else."""
    if not isinstance(kv_layout, str) or kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout={kv_layout!r} is not supported; expected one of {KV_LAYOUTS}")
    return kv_layout == "HND"


def weight_group_size(K: int, group_size) -> int:
    """The group size ``G`` of a weight with ``K`` columns (K for ``group_size`` None): ``group_size``
    in :data:`WEIGHT_GROUP_SIZES`, an int, dividing an even, nonzero K."""
    if group_size not in WEIGHT_GROUP_SIZES or isinstance(group_size, (float, bool, np.floating)):
        raise ValueError(f"group_size must be one of {WEIGHT_GROUP_SIZES}, got {group_size!r}")
    if K == 0 or K % 2:
        raise ValueError(f"w's K = {K} must be even and nonzero (two INT4 codes per byte)")
    G = K if group_size is None else int(group_size)
    if K % G:
        raise ValueError(f"group_size={group_size} must divide K = {K}")
    return G


def fp4_weight_group_size(fmt: str, block: int, group_size) -> int:
    """The block of an FP4 weight format (``"nvfp4"``: 16, ``"mxfp4"``: 32, given as ``block``):
    ``group_size`` must be left at its default or be that block."""
    if group_size is not DEFAULT_GROUP_SIZE and (
        isinstance(group_size, (bool, float, np.floating)) or group_size != block
    ):
        raise ValueError(
            f"group_size={group_size!r} is not supported for {fmt} weights, which have blocks of {block} along K: "
            f"leave group_size at its default (or pass {block})"
        )
    return block


def fp4_weight_k(fmt: str, block: int, K: int, arg: str = "w") -> None:
    """K of an FP4 weight: a nonzero multiple of its block."""
    if K == 0 or K % block:
        raise ValueError(f"{arg}'s K = {K} must be a nonzero multiple of {block} for {fmt} weights")


def weight_block_size(scheme: str, block_size, group_size):
    """The block ``(rows, columns)`` of a block-scaled weight, or None for ``block_size`` None.
    Given, it must be in :data:`WEIGHT_BLOCK_SIZES`, the scheme FP8, and ``group_size`` left at its
    default (the two are exclusive)."""
    if block_size is None:
        return None
    if group_size is not DEFAULT_GROUP_SIZE:
        raise ValueError(f"block_size and group_size are exclusive: pass one of them, got group_size={group_size!r}")
    if scheme != "float8_e4m3fn":
        raise ValueError(f"block_size is for float8_e4m3fn weights, got dtype {scheme!r}")
    ok = isinstance(block_size, (tuple, list)) and all(
        isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_)) for v in block_size
    )
    bs = tuple(int(v) for v in block_size) if ok else None
    if bs not in WEIGHT_BLOCK_SIZES:
        raise ValueError(f"block_size must be one of {WEIGHT_BLOCK_SIZES} or None, got {block_size!r}")
    return bs


# ------------------------------------------------------------------ scales given by the caller
_FLT_MAX = float(np.finfo(np.float32).max)


def positive_finite_scalar(v, arg: str) -> np.float32:
    """A Python/NumPy real that is positive and finite as float32; returned as np.float32."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{arg} must be a real number or a cupy.ndarray, got {type(v).__name__}")
    f = float(v)
    if not (0.0 < f <= _FLT_MAX) or np.float32(f) == 0:  # NaN fails the first test
        raise ValueError(f"{arg} must be a positive finite float32 value, got {v!r}")
    return np.float32(f)


def one_element_float32(a, arg: str):
    """A scale given as an array (CuPy for the ops, NumPy for the reference): float32, one element.
    Its value is not checked: the ops read it on the device, without a host synchronization."""
    msg = f"{arg} must be a float32 array of one element, got {a.dtype} {a.shape}"
    if a.dtype != np.float32:
        raise TypeError(msg)
    if a.size != 1:
        raise ValueError(msg)
    return a


def shape_of(a, arg: str, expected) -> None:
    """``a.shape`` must be ``expected`` (an array that goes with another, such as scales with data)."""
    if tuple(a.shape) != tuple(expected):
        raise ValueError(f"{arg} must have shape {tuple(expected)}, got {tuple(a.shape)}")


def asymmetric_int8(symmetric, fmt_name: str, group_size, scale_pow2, packed: bool, scale_ub, zero_point_out) -> bool:
    """Whether a :func:`cupyquant.quantize_groupwise` call asks for asymmetric INT8 (zero points);
    raises TypeError or ValueError naming the argument that does not go with its ``symmetric``."""
    if not isinstance(symmetric, (bool, np.bool_)):
        raise TypeError(f"symmetric must be a bool, got {type(symmetric).__name__}")
    if symmetric:
        if zero_point_out is not None:
            raise ValueError("zero_point_out is for symmetric=False: symmetric quantization has no zero points")
        return False
    if fmt_name != "int8":
        raise ValueError(f"dtype={fmt_name!r} has no zero points: symmetric=False is for dtype='int8'")
    if group_size is not None:
        raise ValueError(f"group_size={group_size!r} with symmetric=False: zero points are per token, group_size=None")
    if scale_pow2:
        raise ValueError("scale_pow2=True is not supported with symmetric=False: its scales are (max - min) / 255")
    if packed:
        raise ValueError("scale_dtype='float8_e8m0fnu' is not supported with symmetric=False: its scales are float32")
    if scale_ub is not None:
        raise ValueError("scale_ub is not supported with symmetric=False (vLLM's asymmetric INT8 has no bound)")
    return True


def shape_tuple(shape, arg: str = "shape") -> tuple:
    """A tuple or list of ints (NumPy integers included), as a tuple of Python ints."""
    if not isinstance(shape, (tuple, list)) or not all(
        isinstance(d, numbers.Integral) and not isinstance(d, bool) for d in shape
    ):
        raise TypeError(f"{arg} must be a tuple of ints, got {shape!r}")
    if any(d < 0 for d in shape):
        raise ValueError(f"{arg} must not have negative dimensions, got {tuple(shape)!r}")
    return tuple(int(d) for d in shape)
