"""Randomized byte-exactness tests: every public quantize op, every scheme and option, random shapes,
dtypes, views and special values, each output compared byte for byte with cupyquant.reference.

How the cases are made
----------------------
``--fuzz-cases N`` cases (default 256) come from ``--fuzz-seed S`` (default 0). Case 0 has seed S;
case i + 1 has the splitmix64 successor of case i's seed with its low 4 bits replaced by
``(i + 1) % 16``, so the 16 slots of :data:`_KIND_TABLE` (which op a case exercises) come round in
turn, and its next 6 bits zero exactly when the case is one of the heavy ones (more than 2^20
elements; every 29th case). Everything about a case (its op, options, shape, view, data, special
values) is drawn from its own seed alone, so a failing case reruns by itself with
``python -m pytest tests/test_fuzz.py --fuzz-seed <its seed> --fuzz-cases 1``; the failure message
prints that command, the case's parameters and every mismatch in it (data, scales, zero points,
padding of the scale buffer, dequantized values), each with its first differing index and bits.
Each case is its own test item, so one failing case hides nothing about the others.

What a case covers
------------------
- ``fp8``: :func:`cupyquant.quantize_fp8`, dynamic or static (Python float, NumPy float32 or a
  one-element device array), E4M3/E5M2 by name or ml_dtypes type, plus :func:`cupyquant.amax`.
- ``group``: :func:`cupyquant.quantize_groupwise`: FP8/INT8, groups 32..256 or per token, row/col
  layouts, power-of-two scales, packed UE8M0 scales, ``scale_ub`` (float or device), ``out=`` and
  ``scale_out=`` (from :func:`cupyquant.empty_scales`); the raw scale buffer's padding is checked.
- ``silu``: :func:`cupyquant.silu_mul_quantize`. CUDA's ``expf`` is not correctly rounded, so as in
  test_groupwise.py the quantized bytes are compared with the reference quantization of the
  device's float32 intermediate (``groupwise._silu_mul_intermediate``), and that intermediate is
  compared bit for bit with :func:`cupyquant.reference.silu_mul_from_exp` of the device's ``expf``.
- ``mx``: :func:`cupyquant.quantize_mx`: MXFP8 (both element types), MXFP4, ceil/floor rounding,
  dense/swizzled scales (padding included).
- ``nvfp4``: :func:`cupyquant.quantize_nvfp4` with the global scale reduced on the device, given
  as a float or as a device array; dense/swizzled scales.
- ``weight``: :func:`cupyquant.quantize_weight`, int4 (symmetric or not), uint4, float8_e4m3fn,
  groups 32/64/128/per channel, with the zero points.
- ``matmul``: :func:`cupyquant.matmul` is a float32 sum, not byte-exact: checked against the float64
  product of the reference-dequantized weight by the bound of tests/test_weight.py,
  ``||y - ref|| / ||ref|| <= 2^-10`` (float16) or ``2^-8`` (bfloat16).
- Every quantizing case also dequantizes (to a random or the default dtype, by the function or the
  method, into a fresh or misaligned ``out=`` or none) and compares with the reference dequantizer.

Shapes include 0-size, 1, primes, powers of two and their neighbours, 0 to 3 leading dimensions;
one case in 29 (matmul cases excepted) has more than 2^20 elements, the others at most 2^16 (2^17
for weights). Inputs are plain, views at a random element offset (a misaligned data pointer,
C-contiguous: all that quantize_fp8, quantize_weight and the dynamic quantize_nvfp4 take), or,
where the op takes them, row-strided views with a contiguous last axis (matmul also gets views
strided along K, which it copies). ``out=`` buffers are fresh or misaligned views, all poisoned
with 0xFF. About a third of the cases get special values (zeros, -0, subnormals, max finite,
+-inf, NaN, format maxima) at random points and over a whole block of one row.

The CPU tests at the end check the generator (determinism, reproduction from a case's seed,
coverage of every option by the default list) and run the reference side of a few cases of each
op, so this file's pure-NumPy half is exercised on a machine without a GPU.
"""

from __future__ import annotations

import math
import traceback

import ml_dtypes
import numpy as np
import pytest
from conftest import (
    FUZZ_DEFAULT_CASES,
    FUZZ_DEFAULT_SEED,
    assert_bits_equal,
    fuzz_options,
    poisoned,
)

import cupyquant as cq
from cupyquant import reference as ref

IN_DTYPES = ("float32", "float16", "bfloat16")
HALF_DTYPES = ("float16", "bfloat16")
FP8 = ("float8_e4m3fn", "float8_e5m2")
Q8 = FP8 + ("int8",)
MX_FORMATS = FP8 + ("float4_e2m1fn",)
GROUPS = (32, 64, 128, 256, None, None)  # None (per token, a kernel of its own) twice as often
SILU_GROUPS = (32, 64, 128, 256)
WEIGHT_GROUPS = (32, 64, 128, None)
# (dtype, symmetric) pairs quantize_weight accepts: int4 with symmetric=False means uint4
WEIGHT_SCHEMES = (("int4", True), ("int4", False), ("uint4", True), ("uint4", False), ("float8_e4m3fn", True))
DISTS = ("heavy", "heavy", "normal", "rowscale", "tiny", "huge", "ints")
EXTREME_SCALES = ("flt_max", "min_subnormal", "1e-30", "1e30")
# matmul bound of tests/test_weight.py (its comment derives it)
MATMUL_TOL = {"float16": 2.0**-10, "bfloat16": 2.0**-8}

#: Which op a case exercises, by the low 4 bits of its seed (case i of a list has slot i % 16).
_KIND_TABLE = (
    "fp8",
    "group",
    "mx",
    "weight",
    "nvfp4",
    "silu",
    "group",
    "mx",
    "fp8",
    "weight",
    "group",
    "mx",
    "nvfp4",
    "silu",
    "weight",
    "matmul",
)
NORMAL_ELEMS = 1 << 16  # element budget of an ordinary case
HEAVY_MIN = (1 << 20) + 1  # heavy cases have at least this many elements
HEAVY_EVERY = 29  # case i is heavy when i % 29 == 28: every op but matmul gets some in the default list
_MASK63 = (1 << 63) - 1
_TYPE_OF = {
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2,
    "float4_e2m1fn": ml_dtypes.float4_e2m1fn,
    "int8": np.int8,
    "float8_e8m0fnu": ml_dtypes.float8_e8m0fnu,
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
}
_FMAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0, "int8": 127.0, "float4_e2m1fn": 6.0}
_FLT_MAX = float(np.finfo(np.float32).max)


# ================================================================== case generation (pure NumPy)
class Case:
    """One fuzz case: its position in the list, its seed, and the parameters drawn from the seed."""

    __slots__ = ("index", "seed", "params")

    def __init__(self, index: int, seed: int, params: dict):
        self.index, self.seed, self.params = index, seed, params

    @property
    def kind(self) -> str:
        return self.params["kind"]

    @property
    def id(self) -> str:
        return f"{self.index:04d}-{self.kind}-s{self.seed}"

    def __eq__(self, other):
        return isinstance(other, Case) and (self.seed, self.params) == (other.seed, other.params)

    def __repr__(self) -> str:
        return f"Case({self.id})"

    def describe(self) -> str:
        return " ".join(f"{k}={v!r}" for k, v in self.params.items())


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def case_seeds(n: int, seed: int) -> list[int]:
    """Case 0: ``seed``. Case i > 0: splitmix64 of case i - 1's seed, 63 bits, with bits 0-3 set to
    ``i % 16`` (the op slot) and bits 4-9 (the heavy field, see :func:`make_params`) set to 0 when
    ``i % HEAVY_EVERY == HEAVY_EVERY - 1`` and to a nonzero value otherwise."""
    out = []
    s = seed
    for i in range(n):
        if i:
            s = _splitmix64(s) & _MASK63
            heavy_field = 0 if i % HEAVY_EVERY == HEAVY_EVERY - 1 else 1 + _splitmix64(s) % 63
            s = (s & ~0x3FF) | (heavy_field << 4) | (i % len(_KIND_TABLE))
        out.append(s)
    return out


def generate_cases(n: int, seed: int) -> list[Case]:
    return [Case(i, s, make_params(s)) for i, s in enumerate(case_seeds(n, seed))]


def _pick(rng, options):
    return options[int(rng.integers(len(options)))]


_LENGTHS = sorted(
    {
        1,
        2,
        3,
        4,
        5,
        7,
        8,
        9,
        13,
        15,
        16,
        17,
        31,
        32,
        33,
        37,
        61,
        63,
        64,
        65,
        97,
        127,
        128,
        129,
        131,
        255,
        256,
        257,
        383,
        509,
        511,
        512,
        513,
        1021,
        1023,
        1024,
        1025,
        1031,
        2039,
        2047,
        2048,
        2049,
        4093,
        4095,
        4096,
        4097,
        8191,
        8192,
        8193,
        16381,
        16384,
        16385,
        65521,
        65536,
        65537,
    }
)


def _length(rng, lo: int, hi: int) -> int:
    """A length in [max(lo, 1), hi]: half the time one of the interesting ones (primes, powers of two
    and their neighbours), else log-uniform."""
    lo = max(lo, 1)
    if hi <= lo:
        return lo
    if rng.random() < 0.5:
        c = [v for v in _LENGTHS if lo <= v <= hi]
        if c:
            return int(_pick(rng, c))
    v = int(round(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))
    return min(max(v, lo), hi)


def _lead(rng, max_rows: int, zero_p: float = 0.04) -> tuple:
    """0 to 3 leading dimensions with a product of at most max_rows (now and then one of them 0)."""
    nd = int(_pick(rng, (0, 1, 1, 2, 2, 3)))
    dims = []
    budget = max(1, max_rows)
    for _ in range(nd):
        d = _length(rng, 1, budget)
        dims.append(d)
        budget = max(1, budget // d)
    if dims and rng.random() < zero_p:
        dims[int(rng.integers(len(dims)))] = 0
    return tuple(dims)


def _heavy_lead(rng, K: int) -> tuple:
    """Leading dimensions with rows * K > 2^20 (up to about 2^21 + K rows' worth)."""
    target = HEAVY_MIN + int(rng.integers(0, 1 << 20))
    rows = -(-target // K)
    if rows < 8 or rng.random() < 0.5:
        return (rows,)
    a = int(_pick(rng, (2, 3, 5, 7)))
    return (a, -(-rows // a))


def _view(rng, shape: tuple, allowed: tuple) -> dict:
    """How the input is laid out: ``contig``; ``offset`` (a slice of a flat buffer starting ``off``
    elements in: C-contiguous with a misaligned pointer unless off * itemsize % 16 == 0); ``rows``
    (``base[..., ::step, off:off + K]`` of a wider buffer: strided rows, contiguous last axis);
    ``colstride`` (every other element of the last axis; only where the op copies such input)."""
    kinds = [k for k in allowed if k not in ("rows", "colstride") or len(shape) >= 2]
    kind = _pick(rng, tuple(kinds))
    if kind == "offset":
        return {"kind": "offset", "off": int(_pick(rng, (1, 2, 3, 4, 5, 7, 8, 15, 16, 31, 32)))}
    if kind == "rows":
        pad = int(rng.integers(0, 33))
        return {"kind": "rows", "step": int(_pick(rng, (1, 2, 3))), "pad": pad, "off": int(rng.integers(0, pad + 1))}
    return {"kind": kind}


def _common(rng, p: dict, specials: bool = True, deq: bool = True) -> None:
    p["dist"] = _pick(rng, DISTS)
    p["specials"] = bool(specials and rng.random() < 0.35)
    p["out"] = _pick(rng, ("none", "fresh", "misaligned"))
    p["out_off"] = int(rng.integers(1, 8))
    if deq:
        p["deq_dtype"] = _pick(rng, (None,) + IN_DTYPES)
        p["deq_as"] = _pick(rng, ("name", "type"))
        p["deq_out"] = _pick(rng, ("none", "fresh", "misaligned"))
        p["deq_off"] = int(rng.integers(1, 8))
        p["deq_call"] = _pick(rng, ("function", "method"))


def _scalar_choice(rng, p: dict, name: str, lo: float, hi: float, extreme_p: float = 0.05) -> None:
    """``<name>_log2`` (the factor over a data-derived nominal value) and a rare extreme value."""
    p[name + "_log2"] = round(float(rng.uniform(lo, hi)), 3)
    p[name + "_extreme"] = _pick(rng, EXTREME_SCALES) if rng.random() < extreme_p else None


def _gen_fp8(rng, p):
    p["in_dtype"] = _pick(rng, IN_DTYPES)
    p["fmt"] = _pick(rng, FP8)
    p["dtype_as"] = _pick(rng, ("name", "type"))
    p["mode"] = _pick(rng, ("dynamic", "static_float", "static_device"))
    if p["mode"] == "static_float":
        p["scale_as"] = _pick(rng, ("float", "np.float32"))
    elif p["mode"] == "static_device":
        p["scale_as"] = _pick(rng, ((1,), (), (1, 1)))
    if p["mode"] != "dynamic":
        _scalar_choice(rng, p, "scale", -6, 6)
    if not p["heavy"] and rng.random() < 0.02:
        shape = ()
    else:
        K = _length(rng, 1, 8192) if p["heavy"] or rng.random() > 0.03 else 0
        lead = _heavy_lead(rng, K) if p["heavy"] else _lead(rng, NORMAL_ELEMS // max(K, 1))
        shape = lead + (K,)
    p["shape"] = shape
    p["view"] = _view(rng, shape, ("contig", "offset"))
    _common(rng, p)


def _gen_group(rng, p):
    p["in_dtype"] = _pick(rng, IN_DTYPES)
    p["fmt"] = _pick(rng, Q8)
    p["dtype_as"] = _pick(rng, ("name", "type"))
    G = p["group_size"] = _pick(rng, GROUPS)
    p["layout"] = _pick(rng, ("row", "col"))
    p["pow2"] = bool(rng.random() < 0.5)
    p["scale_dtype"] = _pick(rng, ("float32", "float8_e8m0fnu"))
    p["scale_dtype_as"] = _pick(rng, ("name", "type"))
    p["ub"] = _pick(rng, ("none", "none", "float", "device"))
    if p["ub"] != "none":
        _scalar_choice(rng, p, "ub", -12, 2, extreme_p=0)
        if p["ub"] == "device":
            p["ub_shape"] = _pick(rng, ((1,), (), (1, 1)))
    p["scale_out"] = bool(rng.random() < 0.3)
    if G is None:
        K = _length(rng, 256 if p["heavy"] else 1, 9000)
    else:
        lo = -(-256 // G) if p["heavy"] else 1
        ng = 0 if (not p["heavy"] and rng.random() < 0.02) else _length(rng, lo, max(1, 8192 // G))
        K = G * ng
    lead = _heavy_lead(rng, K) if p["heavy"] else _lead(rng, NORMAL_ELEMS // max(K, 1))
    p["shape"] = lead + (K,)
    p["view"] = _view(rng, p["shape"], ("contig", "offset", "rows"))
    _common(rng, p)


def _gen_silu(rng, p):
    p["in_dtype"] = _pick(rng, IN_DTYPES)
    p["fmt"] = _pick(rng, Q8)
    p["dtype_as"] = _pick(rng, ("name", "type"))
    G = p["group_size"] = _pick(rng, SILU_GROUPS)
    p["layout"] = _pick(rng, ("row", "col"))
    p["ub"] = _pick(rng, ("none", "none", "float", "device"))
    if p["ub"] != "none":
        _scalar_choice(rng, p, "ub", -6, 2, extreme_p=0)
        if p["ub"] == "device":
            p["ub_shape"] = _pick(rng, ((1,), (), (1, 1)))
    p["scale_out"] = bool(rng.random() < 0.3)
    H = G * _length(rng, -(-256 // G) if p["heavy"] else 1, max(1, 4096 // G))
    lead = _heavy_lead(rng, 2 * H) if p["heavy"] else _lead(rng, NORMAL_ELEMS // (2 * H))
    p["shape"] = lead + (2 * H,)
    p["view"] = _view(rng, p["shape"], ("contig", "offset", "rows"))
    _common(rng, p)


def _gen_mx(rng, p):
    p["in_dtype"] = _pick(rng, IN_DTYPES)
    p["fmt"] = _pick(rng, MX_FORMATS)
    p["dtype_as"] = _pick(rng, ("name", "type"))
    p["layout"] = _pick(rng, ("dense", "swizzled"))
    p["rounding"] = _pick(rng, ("ceil", "floor"))
    p["scale_out"] = bool(rng.random() < 0.3)
    if p["heavy"]:
        K = _length(rng, 256, 8192)
    else:
        K = 0 if rng.random() < 0.03 else _length(rng, 1, 8192)
    lead = _heavy_lead(rng, K) if p["heavy"] else _lead(rng, NORMAL_ELEMS // max(K, 1))
    p["shape"] = lead + (K,)
    p["view"] = _view(rng, p["shape"], ("contig", "offset", "rows"))
    _common(rng, p)


def _gen_nvfp4(rng, p):
    p["in_dtype"] = _pick(rng, IN_DTYPES)
    p["global_scale"] = _pick(rng, ("dynamic", "float", "device"))
    if p["global_scale"] != "dynamic":
        _scalar_choice(rng, p, "gs", -3, 3)
        if p["global_scale"] == "device":
            p["gs_shape"] = _pick(rng, ((1,), (), (1, 1)))
    p["layout"] = _pick(rng, ("swizzled", "dense"))
    p["scale_out"] = bool(rng.random() < 0.3)
    if p["heavy"]:
        K = _length(rng, 256, 8192)
    else:
        K = 0 if rng.random() < 0.03 else _length(rng, 1, 8192)
    lead = _heavy_lead(rng, K) if p["heavy"] else _lead(rng, NORMAL_ELEMS // max(K, 1))
    p["shape"] = lead + (K,)
    # the dynamic global scale needs a C-contiguous x
    views = ("contig", "offset") if p["global_scale"] == "dynamic" else ("contig", "offset", "rows")
    p["view"] = _view(rng, p["shape"], views)
    _common(rng, p)


def _gen_weight(rng, p):
    p["in_dtype"] = _pick(rng, IN_DTYPES)
    p["dtype"], p["symmetric"] = _pick(rng, WEIGHT_SCHEMES)
    G = p["group_size"] = _pick(rng, WEIGHT_GROUPS)
    if G is None:
        K = 2 * _length(rng, 1, 2048)
    else:
        K = G * _length(rng, 1, max(1, 4096 // G))
    if p["heavy"]:
        N = -(-(HEAVY_MIN + int(rng.integers(0, 1 << 20))) // K)
    else:
        N = 0 if rng.random() < 0.03 else _length(rng, 1, max(1, (1 << 17) // K))
    p["shape"] = (N, K)
    p["view"] = _view(rng, p["shape"], ("contig", "offset"))
    _common(rng, p)
    del p["out"], p["out_off"]  # quantize_weight takes no out=
    p["deq_call"] = _pick(rng, ("function", "method", "dequantize_weight"))


def _gen_matmul(rng, p):
    p["heavy"] = False  # the float64 host product is the cost; the weight cases cover big weights
    p["in_dtype"] = _pick(rng, HALF_DTYPES)
    p["dtype"], p["symmetric"] = _pick(rng, WEIGHT_SCHEMES)
    G = p["group_size"] = _pick(rng, WEIGHT_GROUPS)
    chunk = 64 if p["dtype"] == "float8_e4m3fn" else 128
    step = math.lcm(chunk, G or 1)
    K = step * _length(rng, 1, max(1, 2048 // step))
    N = _length(rng, 1, 1100)
    p["shape"] = _lead(rng, 48, zero_p=0.03) + (K,)  # a's shape; M = the product of the leading dims
    p["N"] = N
    p["view"] = _view(rng, p["shape"], ("contig", "offset", "rows", "colstride"))
    _common(rng, p, specials=False, deq=False)
    p["dist"] = "std"


_GEN = {
    "fp8": _gen_fp8,
    "group": _gen_group,
    "silu": _gen_silu,
    "mx": _gen_mx,
    "nvfp4": _gen_nvfp4,
    "weight": _gen_weight,
    "matmul": _gen_matmul,
}


def make_params(seed: int) -> dict:
    """Every parameter of the case with this seed (a function of the seed alone)."""
    rng = np.random.default_rng([seed, 0])
    p = {"kind": _KIND_TABLE[seed % len(_KIND_TABLE)], "heavy": (seed >> 4) & 63 == 0}
    _GEN[p["kind"]](rng, p)
    return p


# ================================================================== host side: inputs, derived scalars, reference
def _base_shape(view: dict, shape: tuple) -> tuple:
    kind = view["kind"]
    if kind == "offset":
        return (math.prod(shape) + view["off"] + 3,)
    if kind == "rows":
        return shape[:-2] + (shape[-2] * view["step"], shape[-1] + view["pad"])
    if kind == "colstride":
        return shape[:-1] + (2 * shape[-1] + 1,)
    return shape


def apply_view(base, view: dict, shape: tuple):
    """The input view of ``base`` (a NumPy or CuPy array of :func:`_base_shape`); the same slicing
    gives the same strides in both."""
    kind = view["kind"]
    if kind == "offset":
        n, off = math.prod(shape), view["off"]
        return base[off : off + n].reshape(shape)
    if kind == "rows":
        K, off = shape[-1], view["off"]
        return base[..., :: view["step"], off : off + K]
    if kind == "colstride":
        return base[..., 1::2]
    return base


def _values(rng, shape: tuple, dist: str, dtype) -> np.ndarray:
    info = ml_dtypes.finfo(dtype)
    with np.errstate(over="ignore", under="ignore"):
        if dist == "heavy":
            v = rng.standard_normal(shape) * np.exp(2.0 * rng.standard_normal(shape))
        elif dist == "normal":
            e = 12 if np.dtype(dtype) == np.float16 else 60
            v = rng.standard_normal(shape) * 2.0 ** rng.uniform(-e, e)
        elif dist == "rowscale":
            lead = shape[:-1] + (1,) if len(shape) else ()
            v = rng.standard_normal(shape) * 2.0 ** rng.uniform(-8, 8, lead)
        elif dist == "tiny":  # mostly subnormal in the input dtype
            v = rng.standard_normal(shape) * float(info.smallest_normal) * 2.0 ** rng.uniform(-8, 1, shape)
        elif dist == "huge":
            v = rng.uniform(-1, 1, shape) * float(info.max) * 2.0 ** rng.uniform(-2, 0, shape)
        elif dist == "std":  # matmul activations
            v = rng.standard_normal(shape)
        elif dist == "ints":
            v = rng.integers(-8, 9, shape).astype(np.float64)
        else:
            raise ValueError(dist)
        return np.asarray(v, np.float64).astype(np.float32).astype(dtype)


def _special_pool(dtype) -> np.ndarray:
    info = ml_dtypes.finfo(dtype)
    sub, norm, big = float(info.smallest_subnormal), float(info.smallest_normal), float(info.max)
    pool = [
        0.0,
        -0.0,
        sub,
        -sub,
        3 * sub,
        norm * 0.5,
        -norm * 0.25,
        norm,
        big,
        -big,
        np.inf,
        -np.inf,
        np.nan,
        448.0,
        -448.0,
        57344.0,
        6.0,
        -6.0,
        0.25,
        127.5,
        2688.0,
        448.0 * 2.0**-20,
        1e-10,
    ]
    with np.errstate(over="ignore", under="ignore"):
        return np.array(pool, np.float64).astype(np.float32).astype(dtype)


def _sprinkle(rng, v: np.ndarray, block: int) -> None:
    """Write special values into the host view ``v`` in place (through to its base): at random
    points, and over one random block-aligned stretch of ``block`` elements of one row."""
    if v.size == 0:
        return
    pool = _special_pool(v.dtype)
    n = 1 + int(rng.poisson(min(64.0, v.size / 256)))
    pick = rng.integers(0, pool.size, n)
    if v.ndim == 0:
        v[()] = pool[pick[0]]
        return
    v[np.unravel_index(rng.integers(0, v.size, n), v.shape)] = pool[pick]
    if rng.random() < 0.6:
        K = v.shape[-1]
        L = max(1, min(block, K))
        row = tuple(int(rng.integers(d)) for d in v.shape[:-1])
        c0 = int(rng.integers(0, max(1, K // L))) * L
        seg = v[row + (slice(c0, c0 + L),)]
        mode = _pick(rng, ("zero", "negzero", "nan", "inf", "subnormal", "max"))
        info = ml_dtypes.finfo(v.dtype)
        with np.errstate(over="ignore"):
            if mode == "subnormal":
                sub = float(info.smallest_subnormal) * rng.integers(-7, 8, seg.shape)
                seg[...] = sub.astype(np.float32).astype(v.dtype)
            else:
                val = {"zero": 0.0, "negzero": -0.0, "nan": np.nan, "inf": np.inf, "max": float(info.max)}[mode]
                seg[...] = np.float32(val).astype(v.dtype)


def _block_of(p: dict) -> int:
    kind = p["kind"]
    if kind in ("group", "silu", "weight"):
        return p["group_size"] or (p["shape"][-1] if p["shape"] else 1)
    return {"mx": 32, "nvfp4": 16}.get(kind, int(p["shape"][-1]) if p["shape"] else 1)


def _finite_amax(a) -> float:
    a = np.abs(np.asarray(a, np.float64)).ravel()
    a = a[np.isfinite(a)]
    return float(a.max()) if a.size else 0.0


def _positive_f32(v: float, extreme) -> np.float32:
    """A positive finite float32 near ``v`` (or the named extreme), as the ops' validation wants."""
    if extreme is not None:
        v = {"flt_max": _FLT_MAX, "min_subnormal": 2.0**-149, "1e-30": 1e-30, "1e30": 1e30}[extreme]
    f = np.float32(min(max(v, 2.0**-149), _FLT_MAX))
    return f if f > 0 else np.float32(2.0**-149)


def _derive(p: dict, xh: np.ndarray) -> dict:
    """The data-dependent scalars of a case (static scale, scale_ub, global scale), as float32."""
    d = {}
    kind = p["kind"]
    if kind == "fp8" and p["mode"] != "dynamic":
        a = _finite_amax(xh)
        nominal = a / _FMAX[p["fmt"]] if a > 0 else 1.0
        d["scale"] = _positive_f32(nominal * 2.0 ** p["scale_log2"], p["scale_extreme"])
    elif kind == "group" and p["ub"] != "none":
        a = _finite_amax(xh)
        d["ub"] = _positive_f32((a if a > 0 else 1.0) * 2.0 ** p["ub_log2"], None)
    elif kind == "silu" and p["ub"] != "none":
        a = _finite_amax(ref.silu_mul(xh)) if xh.size else 0.0
        nominal = a / _FMAX[p["fmt"]] if a > 0 else 1e-3
        d["ub"] = _positive_f32(nominal * 2.0 ** p["ub_log2"], None)
    elif kind == "nvfp4" and p["global_scale"] != "dynamic":
        a = _finite_amax(xh)
        nominal = float(ref.NVFP4_RANGE) / a if a > 0 else 1.0
        d["global_scale"] = _positive_f32(nominal * 2.0 ** p["gs_log2"], p["gs_extreme"])
    return d


def host_side(case: Case) -> dict:
    """The case's host data: ``base`` (the buffer the input is a view of), ``view`` (that view,
    special values written through it), ``x`` (its contiguous copy, what the reference reads),
    ``derived`` scalars, and for matmul the weight ``w``."""
    p = case.params
    rng = np.random.default_rng([case.seed, 1])
    dtype = np.dtype(p["in_dtype"])
    shape = tuple(p["shape"])
    base = _values(rng, _base_shape(p["view"], shape), p["dist"], dtype)
    view = apply_view(base, p["view"], shape)
    if view.shape != shape:
        raise RuntimeError(f"test harness: view of shape {view.shape}, wanted {shape}")
    if p["specials"]:
        _sprinkle(rng, view, _block_of(p))
    # np.array, not np.ascontiguousarray, which would make a 0-d input 1-d
    hs = {"base": base, "view": view, "x": np.array(view, order="C")}
    if p["kind"] == "matmul":
        # per-row magnitudes 2^-6..2^3 as in test_weight.py: outputs stay far inside float16's range
        w = rng.standard_normal((p["N"], shape[-1])) * 2.0 ** rng.uniform(-6, 3, (p["N"], 1))
        hs["w"] = w.astype(np.float32).astype(dtype)
        if p["N"] >= 2 and shape[-1] >= 32:
            hs["w"][1, :32] = 0  # an all-zero group
    hs["derived"] = _derive(p, hs["x"])
    return hs


def _deq_dtype(p: dict) -> np.dtype:
    return np.dtype(p["deq_dtype"] or p["in_dtype"])


def expected(case: Case, hs: dict, r=None) -> dict:
    """The reference outputs of a case. ``r`` (silu only): the float32 intermediate to quantize, the
    device's on the GPU; without it the host's :func:`cupyquant.reference.silu_mul`."""
    p = case.params
    kind = p["kind"]
    xh = hs["x"]
    d = hs["derived"]
    E = {}
    if kind == "fp8":
        eq, es = ref.quantize_fp8(xh, p["fmt"], scale=d.get("scale"))
        E.update(
            data=eq,
            scale=es,
            amax=np.array([ref.amax(xh)], np.float32),
            y=ref.dequantize_fp8(eq, es, p["fmt"], _deq_dtype(p)),
        )
    elif kind == "group":
        G = p["group_size"]
        eq, es = ref.quantize_groupwise(
            xh, p["fmt"], group_size=G, scale_pow2=p["pow2"], scale_dtype=p["scale_dtype"], scale_ub=d.get("ub")
        )
        E.update(
            data=eq,
            scale=es,
            raw=ref.scale_buffer(es, xh.shape, p["layout"]),
            y=ref.dequantize_groupwise(eq, es, p["fmt"], _deq_dtype(p), group_size=G),
        )
    elif kind == "silu":
        G = p["group_size"]
        r = ref.silu_mul(xh) if r is None else r
        eq, es = ref.quantize_silu_intermediate(r, p["fmt"], group_size=G, scale_ub=d.get("ub"))
        E.update(
            data=eq,
            scale=es,
            raw=ref.scale_buffer(es, r.shape, p["layout"]),
            y=ref.dequantize_groupwise(eq, es, p["fmt"], _deq_dtype(p), group_size=G),
        )
    elif kind == "mx":
        eq, es = ref.quantize_mx(xh, p["fmt"], rounding=p["rounding"])
        E.update(
            data=eq,
            scale_logical=es,
            scale=ref.swizzle_scales(es) if p["layout"] == "swizzled" else es,
            y=ref.dequantize_mx(eq, es, p["fmt"], _deq_dtype(p), K=xh.shape[-1]),
        )
    elif kind == "nvfp4":
        eq, es, eg = ref.quantize_nvfp4(xh, global_scale=d.get("global_scale"))
        E.update(
            data=eq,
            scale_logical=es,
            scale=ref.swizzle_scales(es) if p["layout"] == "swizzled" else es,
            global_scale=np.array([eg], np.float32),
            amax=np.array([ref.amax(xh)], np.float32),
            y=ref.dequantize_nvfp4(eq, es, eg, _deq_dtype(p), K=xh.shape[-1]),
        )
    elif kind == "weight":
        scheme = ref.weight_scheme(p["dtype"], p["symmetric"])
        dd, s, z = ref.quantize_weight(xh, p["dtype"], group_size=p["group_size"], symmetric=p["symmetric"])
        E.update(scheme=scheme, data=dd, scales=s, zeros=z, y=ref.dequantize_weight(dd, s, z, scheme, _deq_dtype(p)))
    elif kind == "matmul":
        wh = hs["w"]
        scheme = ref.weight_scheme(p["dtype"], p["symmetric"])
        dd, s, z = ref.quantize_weight(wh, p["dtype"], group_size=p["group_size"], symmetric=p["symmetric"])
        wd = ref.dequantize_weight(dd, s, z, scheme, xh.dtype).astype(np.float64)
        K = xh.shape[-1]
        a64 = xh.reshape(-1, K).astype(np.float64)
        want = a64 @ wd.T
        E.update(
            scheme=scheme,
            data=dd,
            scales=s,
            zeros=z,
            y=want.reshape(xh.shape[:-1] + (p["N"],)),
            y_abs=np.abs(a64) @ np.abs(wd).T,
        )
    else:
        raise ValueError(kind)
    return E


# ================================================================== GPU side
class _Findings:
    """Mismatches of one case, collected so that one bad output does not hide the others."""

    def __init__(self):
        self.errors: list[str] = []

    def bits(self, actual, expected, what: str) -> None:
        try:
            assert_bits_equal(actual, expected, what)
        except AssertionError as e:
            self.errors.append(str(e))

    def check(self, ok: bool, msg: str) -> None:
        if not ok:
            self.errors.append(msg)


def _arg(name, how):
    """A format or dtype as the op is to be given it: its name, or the ml_dtypes / NumPy type."""
    return _TYPE_OF[name] if (how == "type" and name is not None) else name


def _out_buffer(mode: str, off: int, shape: tuple, dtype):
    """None, a poisoned buffer, or a poisoned C-contiguous view ``off`` elements into a larger one."""
    if mode == "none":
        return None
    if mode == "fresh":
        return poisoned(shape, dtype)
    n = math.prod(shape)
    return poisoned((n + off,), dtype)[off : off + n].reshape(shape)


def _device_input(cupy, hs: dict, p: dict):
    """The device twin of ``hs["view"]``: the same slicing of a device copy of ``hs["base"]``."""
    base_h, h = hs["base"], hs["view"]
    base = cupy.asarray(base_h)
    x = apply_view(base, p["view"], tuple(p["shape"]))
    # CuPy must have made the same view as NumPy, not a copy: same pointer offset and the same strides
    # on every axis longer than 1 (the others' strides, and an empty array's, mean nothing)
    if x.shape != h.shape or x.dtype != h.dtype:
        raise RuntimeError(f"test harness: device view {x.dtype} {x.shape} != host {h.dtype} {h.shape}")
    if x.size:
        off_d = x.data.ptr - base.data.ptr
        off_h = h.__array_interface__["data"][0] - base_h.__array_interface__["data"][0]
        st_d = [st for n, st in zip(x.shape, x.strides) if n > 1]
        st_h = [st for n, st in zip(h.shape, h.strides) if n > 1]
        if off_d != off_h or st_d != st_h:
            raise RuntimeError(
                f"test harness: device view at +{off_d} strides {x.strides} differs from the host "
                f"view at +{off_h} strides {h.strides}"
            )
    return x


def _device_scalar(cupy, value: np.float32, shape):
    return cupy.asarray(np.full(tuple(shape), value, np.float32))


def _dequantize_and_check(cq_obj, p: dict, E: dict, shape: tuple, f: _Findings) -> None:
    if f.errors:
        f.errors.append("(dequantization not checked: the quantized outputs already differ)")
        return
    od = _deq_dtype(p)
    out = _out_buffer(p["deq_out"], p["deq_off"], shape, od)
    arg = _arg(p["deq_dtype"], p["deq_as"])
    call = p["deq_call"]
    if call == "method":
        y = cq_obj.dequantize(arg, out=out)
    elif call == "dequantize_weight":
        y = cq.dequantize_weight(cq_obj, arg, out=out)
    else:
        y = cq.dequantize(cq_obj, arg, out=out)
    f.check(out is None or y is out, "dequantize did not return the out= buffer")
    f.check(y.dtype == od and tuple(y.shape) == tuple(shape), f"dequantized {y.dtype} {y.shape}, expected {od} {shape}")
    f.bits(y, E["y"], "dequantized")


def _run_fp8(cupy, case, hs, f):
    p = case.params
    x = _device_input(cupy, hs, p)
    E = expected(case, hs)
    kw = {}
    if p["mode"] == "static_float":
        s = hs["derived"]["scale"]
        kw["scale"] = float(s) if p["scale_as"] == "float" else np.float32(s)
    elif p["mode"] == "static_device":
        kw["scale"] = _device_scalar(cupy, hs["derived"]["scale"], p["scale_as"])
    out = _out_buffer(p["out"], p["out_off"], x.shape, np.uint8)
    q = cq.quantize_fp8(x, _arg(p["fmt"], p["dtype_as"]), out=out, **kw)
    f.check(out is None or q.data is out, "q.data is not the out= buffer")
    f.bits(q.data, E["data"], "data")
    f.bits(q.scale, E["scale"], "scale_inv")
    if p["mode"] == "dynamic":
        f.bits(q.amax, E["amax"], "amax")
    f.bits(cq.amax(x), E["amax"], "cq.amax(x)")
    _dequantize_and_check(q, p, E, x.shape, f)


def _raw_scale_words(cupy, q, shape, n_cols, layout):
    _, total = ref.scale_word_offsets(shape, n_cols, layout)
    return cupy.ndarray((total,), np.uint32, memptr=q.scale.data).get()


def _check_group_result(cupy, q, E, p, out_shape, f):
    packed = p.get("scale_dtype", "float32") == "float8_e8m0fnu"
    f.bits(q.data, E["data"], "data")
    host = q.to_host()
    f.bits(host["scale"].view(np.uint8) if packed else host["scale"], E["scale"], "scales (logical)")
    G = p["group_size"]
    ng = 1 if G is None else out_shape[-1] // G
    n_cols = -(-ng // 4) if packed else ng
    f.check(q.scale.dtype == (np.int32 if packed else np.float32), f"scale dtype {q.scale.dtype}")
    f.check(tuple(q.scale.shape) == tuple(out_shape[:-1]) + (n_cols,), f"scale shape {q.scale.shape}")
    raw = _raw_scale_words(cupy, q, out_shape, n_cols, p["layout"])
    f.bits(raw, E["raw"], f"{p['layout']} scale buffer (padding included)")


def _ub_arg(cupy, p, hs):
    if p["ub"] == "float":
        return float(hs["derived"]["ub"])
    if p["ub"] == "device":
        return _device_scalar(cupy, hs["derived"]["ub"], p["ub_shape"])
    return None


def _run_group(cupy, case, hs, f):
    p = case.params
    x = _device_input(cupy, hs, p)
    E = expected(case, hs)
    q_dtype = np.int8 if p["fmt"] == "int8" else np.uint8
    out = _out_buffer(p["out"], p["out_off"], x.shape, q_dtype)
    sdt = _arg(p["scale_dtype"], p["scale_dtype_as"])
    scale_out = cq.empty_scales(x.shape, p["group_size"], p["layout"], sdt) if p["scale_out"] else None
    q = cq.quantize_groupwise(
        x,
        _arg(p["fmt"], p["dtype_as"]),
        group_size=p["group_size"],
        scale_layout=p["layout"],
        scale_pow2=p["pow2"],
        scale_dtype=sdt,
        scale_ub=_ub_arg(cupy, p, hs),
        out=out,
        scale_out=scale_out,
    )
    f.check(out is None or q.data is out, "q.data is not the out= buffer")
    f.check(scale_out is None or q.scale is scale_out, "q.scale is not the scale_out= buffer")
    _check_group_result(cupy, q, E, p, x.shape, f)
    _dequantize_and_check(q, p, E, x.shape, f)


def _run_silu(cupy, case, hs, f):
    from cupyquant import groupwise

    p = case.params
    x = _device_input(cupy, hs, p)
    H = x.shape[-1] // 2
    out_shape = x.shape[:-1] + (H,)
    q_dtype = np.int8 if p["fmt"] == "int8" else np.uint8
    out = _out_buffer(p["out"], p["out_off"], out_shape, q_dtype)
    scale_out = cq.empty_scales(out_shape, p["group_size"], p["layout"]) if p["scale_out"] else None
    q = cq.silu_mul_quantize(
        x,
        _arg(p["fmt"], p["dtype_as"]),
        group_size=p["group_size"],
        scale_layout=p["layout"],
        scale_ub=_ub_arg(cupy, p, hs),
        out=out,
        scale_out=scale_out,
    )
    f.check(out is None or q.data is out, "q.data is not the out= buffer")
    f.check(scale_out is None or q.scale is scale_out, "q.scale is not the scale_out= buffer")
    r, e = (a.get() for a in groupwise._silu_mul_intermediate(x))
    # r from the device's expf is bit-exact with the host's IEEE steps after it (NaN payloads aside)
    xf = hs["x"].astype(np.float32)
    r_host = ref.silu_mul_from_exp(xf[..., :H], xf[..., H:], e)
    both_nan = np.isnan(r) & np.isnan(r_host)
    f.bits(np.where(both_nan, 0, r), np.where(both_nan, 0, r_host), "SiLU*Mul intermediate r from the device's expf")
    E = expected(case, hs, r=r)
    _check_group_result(cupy, q, E, p, out_shape, f)
    _dequantize_and_check(q, p, E, out_shape, f)


def _check_block_result(cupy, q, E, p, x, block, f):
    f.bits(q.data, E["data"], "data")
    f.check(tuple(q.scale.shape) == cq.block_scale_shape(x.shape, block, p["layout"]), f"scale shape {q.scale.shape}")
    f.bits(q.scale, E["scale"], f"{p['layout']} scales (padding included)")
    f.bits(q.to_host()["scale"].view(np.uint8), E["scale_logical"], "to_host() scales")


def _block_buffers(cupy, p, x, block, bits):
    q_shape = x.shape if bits == 8 else x.shape[:-1] + (-(-x.shape[-1] // 2),)
    out = _out_buffer(p["out"], p["out_off"], q_shape, np.uint8)
    scale_out = poisoned(cq.block_scale_shape(x.shape, block, p["layout"]), np.uint8) if p["scale_out"] else None
    return out, scale_out


def _run_mx(cupy, case, hs, f):
    p = case.params
    x = _device_input(cupy, hs, p)
    E = expected(case, hs)
    out, scale_out = _block_buffers(cupy, p, x, 32, 4 if p["fmt"] == "float4_e2m1fn" else 8)
    q = cq.quantize_mx(
        x, _arg(p["fmt"], p["dtype_as"]), scale_layout=p["layout"], rounding=p["rounding"], out=out, scale_out=scale_out
    )
    f.check(out is None or q.data is out, "q.data is not the out= buffer")
    f.check(scale_out is None or q.scale is scale_out, "q.scale is not the scale_out= buffer")
    _check_block_result(cupy, q, E, p, x, 32, f)
    _dequantize_and_check(q, p, E, x.shape, f)


def _run_nvfp4(cupy, case, hs, f):
    p = case.params
    x = _device_input(cupy, hs, p)
    E = expected(case, hs)
    gs = None
    if p["global_scale"] == "float":
        gs = float(hs["derived"]["global_scale"])
    elif p["global_scale"] == "device":
        gs = _device_scalar(cupy, hs["derived"]["global_scale"], p["gs_shape"])
    out, scale_out = _block_buffers(cupy, p, x, 16, 4)
    q = cq.quantize_nvfp4(x, global_scale=gs, scale_layout=p["layout"], out=out, scale_out=scale_out)
    f.check(out is None or q.data is out, "q.data is not the out= buffer")
    f.check(scale_out is None or q.scale is scale_out, "q.scale is not the scale_out= buffer")
    _check_block_result(cupy, q, E, p, x, 16, f)
    f.bits(q.global_scale, E["global_scale"], "global_scale")
    if p["global_scale"] == "dynamic":
        f.bits(q.amax, E["amax"], "amax")
    _dequantize_and_check(q, p, E, x.shape, f)


def _check_weight(qw, E, p, f):
    f.check(qw.scheme.format == E["scheme"], f"scheme {qw.scheme!r}, expected {E['scheme']!r}")
    f.check(qw.group_size == p["group_size"], f"group_size {qw.group_size}")
    f.bits(qw.data, E["data"], "data")
    f.bits(qw.scale, E["scales"], "scales")
    if E["zeros"] is None:
        f.check(qw.zero_point is None, "zeros should be None")
    else:
        f.check(qw.zero_point is not None, "zeros missing")
        if qw.zero_point is not None:
            f.bits(qw.zero_point, E["zeros"], "zero points")


def _run_weight(cupy, case, hs, f):
    p = case.params
    w = _device_input(cupy, hs, p)
    E = expected(case, hs)
    qw = cq.quantize_weight(w, p["dtype"], group_size=p["group_size"], symmetric=p["symmetric"])
    f.check(tuple(qw.shape) == tuple(w.shape) and qw.dtype == w.dtype, f"shape/dtype {qw.shape} {qw.dtype}")
    _check_weight(qw, E, p, f)
    _dequantize_and_check(qw, p, E, w.shape, f)


def _run_matmul(cupy, case, hs, f):
    p = case.params
    a = _device_input(cupy, hs, p)
    E = expected(case, hs)
    qw = cq.quantize_weight(cupy.asarray(hs["w"]), p["dtype"], group_size=p["group_size"], symmetric=p["symmetric"])
    _check_weight(qw, E, p, f)
    if f.errors:
        f.errors.append("(matmul not checked: the quantized weight already differs)")
        return
    y_shape = a.shape[:-1] + (p["N"],)
    out = _out_buffer(p["out"], p["out_off"], y_shape, a.dtype)
    y = cq.matmul(a, qw, out=out)
    f.check(out is None or y is out, "matmul did not return the out= buffer")
    f.check(y.dtype == a.dtype and tuple(y.shape) == y_shape, f"matmul gave {y.dtype} {y.shape}")
    want = E["y"]
    if want.size:
        # Measured against ||(|a| @ |w|.T)||, not ||ref||: a few outputs with cancellation (small N
        # and K here) would make a norm-wise bound on y itself depend on the data, while each error
        # term (the weights' rounding to a's dtype in the reference or not in the kernel, float32
        # sums, the output rounding) is bounded by the absolute product.
        got = y.get().astype(np.float64).reshape(want.shape)
        norm = float(np.linalg.norm(E["y_abs"]))
        err = float(np.linalg.norm(got - want)) / norm if norm else float(np.linalg.norm(got))
        tol = MATMUL_TOL[p["in_dtype"]]
        f.check(
            err <= tol,
            f"matmul: error {err:.3g} of || |a| |w| || > {tol:.3g} (||ref|| = {float(np.linalg.norm(want)):.3g})",
        )


_RUN = {
    "fp8": _run_fp8,
    "group": _run_group,
    "silu": _run_silu,
    "mx": _run_mx,
    "nvfp4": _run_nvfp4,
    "weight": _run_weight,
    "matmul": _run_matmul,
}


def _report(case: Case, hs, errors, n_cases: int, list_seed: int) -> str:
    derived = {k: float(v) for k, v in (hs or {}).get("derived", {}).items()}
    lines = [
        f"fuzz case {case.index} of {n_cases} (--fuzz-seed {list_seed}): case seed {case.seed}",
        "  rerun it alone: python -m pytest -q tests/test_fuzz.py::test_fuzz_case "
        f"--fuzz-seed {case.seed} --fuzz-cases 1",
        f"  params: {case.describe()}",
        f"  derived scalars: {derived}",
        "  mismatches:",
    ]
    lines += ["   - " + e.replace("\n", "\n     ") for e in errors]
    return "\n".join(lines)


def pytest_generate_tests(metafunc):
    if "fuzz_case" in metafunc.fixturenames:
        n, seed = fuzz_options(metafunc.config)
        cases = generate_cases(n, seed)
        metafunc.parametrize("fuzz_case", cases, ids=[c.id for c in cases])


@pytest.mark.gpu
def test_fuzz_case(fuzz_case, fuzz_config):
    cupy = pytest.importorskip("cupy")
    f = _Findings()
    hs = None
    try:
        hs = host_side(fuzz_case)
        _RUN[fuzz_case.kind](cupy, fuzz_case, hs, f)
    except Exception as e:  # noqa: BLE001 - an op that raises is a finding like a mismatch
        f.errors.append(f"raised {type(e).__name__}: {e}\n{traceback.format_exc(limit=-4)}")
    if f.errors:
        pytest.fail(_report(fuzz_case, hs, f.errors, *fuzz_config), pytrace=False)


# ================================================================== CPU: the generator and the reference side
def _default_cases():
    return generate_cases(FUZZ_DEFAULT_CASES, FUZZ_DEFAULT_SEED)


def test_case_list_is_deterministic_and_each_case_reruns_alone(fuzz_config):
    n, seed = fuzz_config
    cases = generate_cases(min(n, 2000), seed)
    assert cases == generate_cases(len(cases), seed)
    assert len({c.seed for c in cases}) == len(cases)
    for c in cases:
        alone = generate_cases(1, c.seed)[0]  # what --fuzz-seed <c.seed> --fuzz-cases 1 runs
        assert alone == c and alone.kind == c.kind, c.id
        if c.index:
            assert c.kind == _KIND_TABLE[c.index % len(_KIND_TABLE)]
            heavy = c.index % HEAVY_EVERY == HEAVY_EVERY - 1 and c.kind != "matmul"
            assert c.params["heavy"] == heavy
            assert (math.prod(c.params["shape"]) > 1 << 20) == heavy, c.id


def _coverage(cases):
    seen = {}

    def add(key, value):
        seen.setdefault(key, set()).add(value if not isinstance(value, list) else tuple(value))

    for c in cases:
        p = c.params
        k = c.kind
        add("kind", k)
        add(f"{k}.in_dtype", p["in_dtype"])
        add(f"{k}.view", p["view"]["kind"])
        if "out" in p:
            add(f"{k}.out", p["out"])
        add(f"{k}.specials", p["specials"])
        if "deq_dtype" in p:
            for key in ("deq_dtype", "deq_out", "deq_call", "deq_as"):
                add(f"{k}.{key}", p[key])
        for key in (
            "fmt",
            "mode",
            "group_size",
            "layout",
            "pow2",
            "scale_dtype",
            "ub",
            "rounding",
            "global_scale",
            "scale_out",
            "dtype_as",
            "scale_dtype_as",
        ):
            if key in p:
                add(f"{k}.{key}", p[key])
        if k in ("weight", "matmul"):
            add(f"{k}.scheme", (p["dtype"], p["symmetric"]))
        add("heavy", p["heavy"])
        size = math.prod(p["shape"])
        add("size>2^20", size > 1 << 20)
        add("size0", size == 0)
        add("ndim", len(p["shape"]))
    return seen


def test_default_cases_cover_every_option():
    """The default list (what the GPU run checks without options) reaches every scheme and option."""
    cases = _default_cases()
    seen = _coverage(cases)
    want = {
        "kind": set(_GEN),
        "fp8.fmt": set(FP8),
        "fp8.mode": {"dynamic", "static_float", "static_device"},
        "group.fmt": set(Q8),
        "group.group_size": set(GROUPS),
        "group.layout": {"row", "col"},
        "group.pow2": {False, True},
        "group.scale_dtype": {"float32", "float8_e8m0fnu"},
        "group.ub": {"none", "float", "device"},
        "group.scale_out": {False, True},
        "group.view": {"contig", "offset", "rows"},
        "silu.fmt": set(Q8),
        "silu.group_size": set(SILU_GROUPS),
        "silu.layout": {"row", "col"},
        "silu.ub": {"none", "float", "device"},
        "silu.view": {"contig", "offset", "rows"},
        "mx.fmt": set(MX_FORMATS),
        "mx.layout": {"dense", "swizzled"},
        "mx.rounding": {"ceil", "floor"},
        "mx.view": {"contig", "offset", "rows"},
        "mx.scale_out": {False, True},
        "nvfp4.global_scale": {"dynamic", "float", "device"},
        "nvfp4.layout": {"dense", "swizzled"},
        "nvfp4.view": {"contig", "offset", "rows"},
        "weight.scheme": set(WEIGHT_SCHEMES),
        "weight.group_size": set(WEIGHT_GROUPS),
        "weight.deq_call": {"function", "method", "dequantize_weight"},
        "matmul.in_dtype": set(HALF_DTYPES),
        "matmul.group_size": set(WEIGHT_GROUPS),
        "size>2^20": {False, True},
        "size0": {False, True},
        "ndim": {1, 2, 3, 4},
    }
    want["matmul.out"] = {"none", "fresh", "misaligned"}
    for k in ("fp8", "group", "silu", "mx", "nvfp4", "weight"):
        want[f"{k}.in_dtype"] = set(IN_DTYPES)
        want[f"{k}.specials"] = {False, True}
        if k != "weight":
            want[f"{k}.out"] = {"none", "fresh", "misaligned"}
        want[f"{k}.deq_dtype"] = {None, *IN_DTYPES}
        want[f"{k}.deq_out"] = {"none", "fresh", "misaligned"}
    missing = {k: v - seen.get(k, set()) for k, v in want.items() if v - seen.get(k, set())}
    assert not missing, f"the default fuzz list misses: {missing}"
    heavy = {c.kind for c in cases if math.prod(c.params["shape"]) > 1 << 20}
    assert heavy == set(_GEN) - {"matmul"}, heavy


def _check_arguments_accepted(case: Case, hs: dict, E: dict) -> None:
    """What the GPU half will pass, run through the wrappers' own argument checks that need no
    device (cupyquant._dtypes, _validate, _scales, mx import CuPy but touch no GPU; skipped where
    CuPy is missing): formats and dtypes in each spelling, derived scalars, views, group sizes and
    the scale shapes the library allocates."""
    try:
        from cupyquant import _checks, _dtypes, _scales, _validate, mx
    except ImportError:
        pytest.skip("CuPy is not importable: the wrappers' argument checks cannot be loaded")
    p = case.params
    kind = p["kind"]
    x = hs["view"]
    for name, v in hs["derived"].items():
        _validate.positive_finite_scalar(float(v), name)
        _validate.positive_finite_scalar(np.float32(v), name)
    if p.get("deq_dtype") is not None:
        assert _dtypes.input_type(_arg(p["deq_dtype"], p["deq_as"]), "out_dtype").dtype == _deq_dtype(p)
    if kind in ("fp8", "weight") or (kind == "nvfp4" and p["global_scale"] == "dynamic"):
        assert x.flags.c_contiguous, (p["view"], x.strides)
    elif kind != "matmul":
        _validate.rows_view(x, "x")  # raises ValueError where the op would
    if kind in ("fp8", "group", "silu", "mx"):
        allowed = {"fp8": _dtypes.FP8_NAMES, "mx": _dtypes.MX_NAMES}.get(kind, Q8)
        assert _dtypes.element_format(_arg(p["fmt"], p["dtype_as"]), "dtype", allowed=allowed).name == p["fmt"]
    if kind in ("group", "silu"):
        K = x.shape[-1] if kind == "group" else x.shape[-1] // 2
        _checks.group_count(K, p["group_size"])
        if kind == "group":
            sdt = _arg(p["scale_dtype"], p["scale_dtype_as"])
            assert _scales.group_scale_packed(p["layout"], sdt) == (p["scale_dtype"] == "float8_e8m0fnu")
    if kind in ("mx", "nvfp4"):
        block = 32 if kind == "mx" else 16
        assert mx.block_scale_shape(x.shape, block, p["layout"]) == E["scale"].shape
    if kind in ("weight", "matmul"):
        K = x.shape[-1]
        G = p["group_size"] or K
        assert p["group_size"] in ref.WEIGHT_GROUP_SIZES and K and K % G == 0 and K % 2 == 0
        if kind == "matmul":
            assert K % (64 if E["scheme"] == "float8_e4m3fn" else 128) == 0


def _check_expected_shapes(case: Case, hs: dict, E: dict) -> None:
    """What the reference gives has the shapes and dtypes the ops document."""
    p = case.params
    x = hs["x"]
    shape = x.shape
    kind = p["kind"]
    K = shape[-1] if shape else 1
    if kind == "fp8":
        assert E["data"].shape == shape and E["data"].dtype == np.uint8 and E["scale"].shape == (1,)
    elif kind in ("group", "silu"):
        out_shape = shape if kind == "group" else shape[:-1] + (K // 2,)
        assert E["data"].shape == out_shape
        assert E["data"].dtype == (np.int8 if p["fmt"] == "int8" else np.uint8)
        G = p["group_size"]
        assert E["scale"].shape == out_shape[:-1] + (1 if G is None else out_shape[-1] // G,)
    elif kind in ("mx", "nvfp4"):
        block = 32 if kind == "mx" else 16
        bits = 4 if kind == "nvfp4" or p["fmt"] == "float4_e2m1fn" else 8
        assert E["data"].shape == (shape if bits == 8 else shape[:-1] + (-(-K // 2),))
        kb = -(-K // block)
        rows = math.prod(shape[:-1])
        want = (-(-rows // 128) * 128, -(-kb // 4) * 4) if p["layout"] == "swizzled" else shape[:-1] + (kb,)
        assert E["scale"].shape == want and E["scale_logical"].shape == shape[:-1] + (kb,)
    elif kind in ("weight", "matmul"):
        N = shape[0] if kind == "weight" else p["N"]
        Kw = shape[1] if kind == "weight" else K
        G = p["group_size"] or Kw
        assert E["scales"].shape == (N, Kw // G)
        assert E["data"].shape == ((N, Kw) if E["scheme"] == "float8_e4m3fn" else (N, Kw // 2))
    if kind != "matmul":
        out_shape = shape[:-1] + (K // 2,) if kind == "silu" else shape
        assert E["y"].shape == out_shape and E["y"].dtype == _deq_dtype(p)
    else:
        assert E["y"].shape == shape[:-1] + (p["N"],)
        assert E["y"].size == 0 or np.abs(E["y"]).max() < float(ml_dtypes.finfo(x.dtype).max) / 4
    for name, v in hs["derived"].items():
        assert v.dtype == np.float32 and 0 < v <= _FLT_MAX, (name, v)


def _sample(cases, per_kind: int):
    """The first ``per_kind`` cases of each op and the first heavy one."""
    out, count = [], {}
    for c in cases:
        if count.get(c.kind, 0) < per_kind:
            count[c.kind] = count.get(c.kind, 0) + 1
            out.append(c)
    heavy = [c for c in cases if math.prod(c.params["shape"]) > 1 << 20 and c not in out]
    return out + heavy[:1]


def test_reference_side_of_a_sample_runs_on_the_cpu(fuzz_config):
    """Inputs, views, special values, derived scalars and every reference call of a few cases of each
    op (this run's list), with the shapes the ops document; the GPU half of the same cases is
    test_fuzz_case."""
    n, seed = fuzz_config
    cases = generate_cases(n, seed)
    for c in _sample(cases, 2):
        hs = host_side(c)
        assert hs["x"].flags.c_contiguous and hs["x"].shape == tuple(c.params["shape"])
        assert_bits_equal(hs["x"], np.array(hs["view"], order="C"), "contiguous copy of the view")
        E = expected(c, hs)
        _check_expected_shapes(c, hs, E)
        _check_arguments_accepted(c, hs, E)


def test_views_and_specials_on_the_host():
    """The view builder gives the requested shape with the intended strides, and special values
    land inside the view (so the device sees them)."""
    for c in _default_cases():
        p = c.params
        if math.prod(p["shape"]) > 1 << 18:
            continue
        shape = tuple(p["shape"])
        base = np.zeros(_base_shape(p["view"], shape), np.float32)
        v = apply_view(base, p["view"], shape)
        assert v.shape == shape, c.id
        kind = p["view"]["kind"]
        if kind == "offset" and v.size:
            start = v.__array_interface__["data"][0] - base.__array_interface__["data"][0]
            assert v.flags.c_contiguous and start == 4 * p["view"]["off"]
        if kind == "rows" and v.size:
            assert v.strides[-1] == 4 and v.strides[-2] == 4 * p["view"]["step"] * (shape[-1] + p["view"]["pad"])
        if kind == "colstride" and v.size:
            assert v.strides[-1] == 8
    rng = np.random.default_rng(3)
    for dtype in (np.float32, np.float16, ml_dtypes.bfloat16):
        view = {"kind": "rows", "step": 3, "pad": 7, "off": 5}
        base = np.ones(_base_shape(view, (2, 40)), dtype)
        v = apply_view(base, view, (2, 40))
        _sprinkle(rng, v, 16)
        outside = np.ones(base.shape, bool)
        outside[::3, 5:45] = False
        assert (base[outside].astype(np.float32) == 1).all()
        assert not (np.ascontiguousarray(v).astype(np.float32) == 1).all()
