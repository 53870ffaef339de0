"""The ops and the NumPy reference accept and refuse the same arguments, with the same exception types.

Both call the checks of ``cupyquant._checks`` (NumPy only). One table of cases runs twice: on the
reference (CPU, always) and on the op (``gpu``-marked: skipped without a device). Where an op takes a
CuPy array (a scale on the device), the reference takes a NumPy array in its place: the table's
``Arr`` is made with ``cupy.asarray`` on one side and ``numpy.asarray`` on the other.
"""

from __future__ import annotations

import importlib.util

import ml_dtypes
import numpy as np
import pytest

from cupyquant import _checks
from cupyquant import reference as ref

F32 = np.float32
E4M3, E5M2, E2M1 = "float8_e4m3fn", "float8_e5m2", "float4_e2m1fn"


class Arr:
    """An array argument, made per side (CuPy for the op, NumPy for the reference)."""

    def __init__(self, values, dtype=F32):
        self.values, self.dtype = values, dtype

    def make(self, xp):
        return xp.asarray(self.values, dtype=self.dtype)

    def __repr__(self):
        return f"Arr({self.values}, {np.dtype(self.dtype).name})"


CASES = []


def case(op, shape, args=(), exc=None, x_dtype=F32, **kw):
    """``op(x of shape, *args, **kw)`` must raise ``exc`` (None: must not raise) on both sides."""
    what = ",".join([repr(a) for a in args] + [f"{k}={v!r}" for k, v in kw.items()])
    CASES.append(pytest.param(op, shape, x_dtype, args, kw, exc, id=f"{op}-{shape}-{np.dtype(x_dtype).name}-{what}"))


# quantize_fp8: FP8 formats only; a static scale positive and finite, or a float32 array of one element
case("quantize_fp8", (4, 64))
case("quantize_fp8", (), (E5M2,))
case("quantize_fp8", (4, 64), (ml_dtypes.float8_e4m3fn,))
case("quantize_fp8", (4, 64), ("int8",), ValueError)
case("quantize_fp8", (4, 64), (E2M1,), ValueError)
case("quantize_fp8", (4, 64), (np.float16,), ValueError)
case("quantize_fp8", (4, 64), (object(),), TypeError)
case("quantize_fp8", (4, 64), x_dtype=np.int32, exc=TypeError)
case("quantize_fp8", (4, 64), x_dtype=np.float64, exc=TypeError)
for s in (0.5, np.float32(0.5), 1e-30):
    case("quantize_fp8", (4, 64), scale=s)
for s in (0.0, -1.0, float("inf"), float("nan"), 1e-50, 1e39):
    case("quantize_fp8", (4, 64), exc=ValueError, scale=s)
for s in ("0.5", True, [0.5]):
    case("quantize_fp8", (4, 64), exc=TypeError, scale=s)
case("quantize_fp8", (4, 64), scale=Arr([0.5]))
case("quantize_fp8", (4, 64), scale=Arr([-1.0]))  # a device value is not read on the host: not checked
case("quantize_fp8", (4, 64), exc=TypeError, scale=Arr([0.5], np.float64))
case("quantize_fp8", (4, 64), exc=ValueError, scale=Arr([0.5, 1.0]))

# quantize_groupwise: group sizes 32, 64, 128, 256 (dividing K) or None; FP8 or INT8
for g in (32, 64, 128, 256, None):
    case("quantize_groupwise", (4, 256), group_size=g)
for g in (16, 0, 48, 512, 128.0, True, np.int64(128), "128"):
    case("quantize_groupwise", (4, 256), exc=ValueError, group_size=g)
case("quantize_groupwise", (4, 96), exc=ValueError, group_size=64)
case("quantize_groupwise", (4, 96), group_size=32)
case("quantize_groupwise", (4, 100), group_size=None)
case("quantize_groupwise", (), exc=ValueError)
case("quantize_groupwise", (4, 256), ("int8",))
case("quantize_groupwise", (4, 256), (E5M2,))
case("quantize_groupwise", (4, 256), (E2M1,), ValueError)
case("quantize_groupwise", (4, 256), scale_dtype="float8_e8m0fnu")
case("quantize_groupwise", (4, 256), exc=ValueError, scale_dtype=E4M3)
case("quantize_groupwise", (4, 256), scale_ub=2.0)
case("quantize_groupwise", (4, 256), scale_ub=Arr([2.0]))
case("quantize_groupwise", (4, 256), exc=ValueError, scale_ub=0.0)
case("quantize_groupwise", (4, 256), exc=TypeError, scale_ub=Arr([2.0], np.float16))

# silu_mul_quantize: [gate | up] (even K), groups only
case("silu_mul_quantize", (4, 256))
case("silu_mul_quantize", (4, 256), group_size=32)
case("silu_mul_quantize", (4, 255), exc=ValueError)
case("silu_mul_quantize", (4, 256), exc=ValueError, group_size=None)
case("silu_mul_quantize", (4, 256), exc=ValueError, group_size=16)
case("silu_mul_quantize", (4, 192), exc=ValueError, group_size=64)
case("silu_mul_quantize", (4, 256), ("int8",), group_size=64)
case("silu_mul_quantize", (4, 256), (E2M1,), ValueError)
case("silu_mul_quantize", (4, 256), exc=ValueError, scale_ub=-1.0)

# quantize_mx: MX element formats, two roundings
for fmt in (E4M3, E5M2, E2M1):
    case("quantize_mx", (4, 100), (fmt,))
case("quantize_mx", (4, 100), ("int8",), ValueError)
case("quantize_mx", (4, 100), rounding="floor")
case("quantize_mx", (4, 100), exc=ValueError, rounding="nearest")
case("quantize_mx", (), exc=ValueError)

# quantize_nvfp4: the global scale as quantize_fp8's static scale
case("quantize_nvfp4", (4, 100))
case("quantize_nvfp4", (4, 100), global_scale=2.0)
case("quantize_nvfp4", (4, 100), global_scale=Arr([2.0]))
case("quantize_nvfp4", (4, 100), exc=ValueError, global_scale=0.0)
case("quantize_nvfp4", (4, 100), exc=ValueError, global_scale=float("-inf"))
case("quantize_nvfp4", (4, 100), exc=TypeError, global_scale=Arr([2.0], np.float64))
case("quantize_nvfp4", (4, 100), exc=ValueError, global_scale=Arr([[2.0, 2.0]]))
case("quantize_nvfp4", (), exc=ValueError)

# quantize_weight: 2-D, even K, group sizes 32, 64, 128 or None dividing K
for scheme in ("int4", "uint4", E4M3):
    for g in (32, 64, 128, None):
        case("quantize_weight", (16, 256), (scheme,), group_size=g)
for g in (16, 0, 256, 128.0, True):
    case("quantize_weight", (16, 256), exc=ValueError, group_size=g)
case("quantize_weight", (16, 96), exc=ValueError, group_size=64)
case("quantize_weight", (16, 129), exc=ValueError, group_size=None)
case("quantize_weight", (16, 0), exc=ValueError, group_size=None)
case("quantize_weight", (256,), exc=ValueError)
case("quantize_weight", (2, 16, 64), exc=ValueError)
case("quantize_weight", (16, 256), ("int8",), ValueError)
case("quantize_weight", (16, 256), (E4M3,), ValueError, symmetric=False)
case("quantize_weight", (16, 256), ("int4",), symmetric=False)
case("quantize_weight", (16, 256), x_dtype=np.float64, exc=TypeError)


def _x(shape, dtype):
    n = int(np.prod(shape))
    return np.linspace(-3.0, 5.0, n, dtype=np.float32).reshape(shape).astype(dtype)


def _run(fn, xp, shape, x_dtype, args, kw, exc):
    kw = {k: v.make(xp) if isinstance(v, Arr) else v for k, v in kw.items()}
    x = xp.asarray(_x(shape, x_dtype))
    if exc is None:
        fn(x, *args, **kw)
    else:
        with pytest.raises(exc):
            fn(x, *args, **kw)


@pytest.mark.parametrize("op, shape, x_dtype, args, kw, exc", CASES)
def test_reference(op, shape, x_dtype, args, kw, exc):
    _run(getattr(ref, op), np, shape, x_dtype, args, kw, exc)


@pytest.mark.gpu
@pytest.mark.parametrize("op, shape, x_dtype, args, kw, exc", CASES)
def test_op(op, shape, x_dtype, args, kw, exc):
    import cupy

    import cupyquant as cq

    _run(getattr(cq, op), cupy, shape, x_dtype, args, kw, exc)


# ------------------------------------------------------------------ the shared checks themselves
def test_group_count():
    assert _checks.group_count(256, 128) == 2 and _checks.group_count(100, None) == 1
    assert _checks.group_count(0, 32) == 0
    for g in (16, 0, 128.0, True, np.int64(128)):
        with pytest.raises(ValueError, match="group_size"):
            _checks.group_count(256, g)
    with pytest.raises(ValueError, match="does not divide the last axis"):
        _checks.group_count(96, 64)
    with pytest.raises(ValueError, match="not supported by silu_mul_quantize"):
        _checks.not_per_token(None, "silu_mul_quantize")


def test_weight_group_size():
    assert _checks.weight_group_size(256, 128) == 128 and _checks.weight_group_size(130, None) == 130
    with pytest.raises(ValueError, match="group_size must be one of"):
        _checks.weight_group_size(256, 128.0)
    with pytest.raises(ValueError, match="K = 129 must be even"):
        _checks.weight_group_size(129, None)
    with pytest.raises(ValueError, match="must divide K = 96"):
        _checks.weight_group_size(96, 64)


@pytest.mark.parametrize("v", [0.0, -0.5, float("inf"), float("nan"), 1e-46, 3.5e38])
def test_positive_finite_scalar_rejects(v):
    with pytest.raises(ValueError, match="scale must be a positive finite float32 value"):
        _checks.positive_finite_scalar(v, "scale")


def test_positive_finite_scalar_accepts_and_types():
    assert _checks.positive_finite_scalar(2, "scale") == np.float32(2)
    assert _checks.positive_finite_scalar(np.float32(1e-40), "scale") == np.float32(1e-40)  # subnormal
    with pytest.raises(TypeError, match="scale must be a real number"):
        _checks.positive_finite_scalar(np.array([1.0]), "scale")


def test_one_element_float32():
    _checks.one_element_float32(np.ones((1, 1), F32), "s")
    with pytest.raises(TypeError, match="s must be a float32 array of one element"):
        _checks.one_element_float32(np.ones(1, np.float64), "s")
    with pytest.raises(ValueError, match="s must be a float32 array of one element"):
        _checks.one_element_float32(np.ones(0, F32), "s")


def test_the_ops_use_the_shared_checks():
    """The op modules' checks are these very functions (CuPy imports without a GPU)."""
    if importlib.util.find_spec("cupy") is None:
        pytest.skip("CuPy is not installed")
    from cupyquant import _validate

    assert _validate.positive_finite_scalar is _checks.positive_finite_scalar


def test_dequantizers_check_shapes():
    q, s = ref.quantize_groupwise(_x((2, 256), F32), group_size=64)
    with pytest.raises(ValueError, match="scale must have shape"):
        ref.dequantize_groupwise(q, s, group_size=128)
    with pytest.raises(ValueError, match="group_size"):
        ref.dequantize_groupwise(q, s, group_size=16)
    d, e = ref.quantize_mx(_x((2, 100), F32), E2M1)
    with pytest.raises(ValueError, match="scale must have shape"):
        ref.dequantize_mx(d, e[:, :2], E2M1)
    with pytest.raises(ValueError, match="K=98"):
        ref.dequantize_mx(d, e, E2M1, K=98)
    d, sf, g = ref.quantize_nvfp4(_x((2, 100), F32))
    with pytest.raises(ValueError, match="scale must have shape"):
        ref.dequantize_nvfp4(d, sf[:, :3], g, K=100)
    data, scales, zeros = ref.quantize_weight(_x((16, 256), F32), "uint4", group_size=64)
    with pytest.raises(ValueError, match="zeros must have shape"):
        ref.dequantize_weight(data, scales, zeros[:, :1], "uint4")
    with pytest.raises(ValueError, match="split into the scales' 3 groups"):
        ref.dequantize_weight(data, np.ones((16, 3), F32), zeros, "uint4")
